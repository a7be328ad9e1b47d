// The degrees of parallelism of a run, owned in one place (torchtitan's ParallelDims): how many ranks there are,
// how they split (data parallel; tensor parallel to come, tp = 1 until then), and how the data-parallel ranks
// shard (the ZeRO stage, and whether the sharded optimizer lives in host memory). The Trainer makes it once, after
// memory.budget_mib's plan has chosen the stage, and every "is this stage 3?" reads it.
//
//   const auto dims = ParallelDims::of(config.dist, world.world_size);
//   if (dims.gathers_parameters()) ...;   // ZeRO-3 on a sharded group
#pragma once

#include <string>

#include "memtrain/core/config.h"

namespace memtrain {

struct ParallelDims {
  int world = 1;          // every rank
  int dp = 1;             // data-parallel degree: world / tp
  int tp = 1;             // tensor-parallel degree (1: none yet)
  int zero_stage = 0;     // how the data-parallel ranks shard; 0 where nothing is sharded (one process, no offload)
  bool offload = false;   // dist.offload_optimizer = cpu

  // dist.* on `world` ranks. A stage is only what runs: one process without offload trains unsharded (stage 0).
  static ParallelDims of(const DistConfig& dist, int world);
  // Buckets and a sharded optimizer: several ranks, or one with offload (a group of one).
  bool sharded() const { return world > 1 || offload; }
  bool shards_gradients() const { return zero_stage >= 2; }
  bool gathers_parameters() const { return zero_stage == 3; }  // each unit gathered before it runs, freed after
  std::string describe() const;  // "2 ranks: data parallel 2, ZeRO stage 3"
};

}  // namespace memtrain
