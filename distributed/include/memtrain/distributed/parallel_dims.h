// The degrees of parallelism of a run, owned in one place (torchtitan's ParallelDims): how many ranks there are,
// how they split (tensor parallel within groups of tp consecutive ranks, data parallel across them), and how the data-parallel ranks
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
  int tp = 1;             // tensor-parallel degree: groups of tp consecutive ranks (1: none)
  bool sequence_parallel = false;  // tp > 1 and dist.sequence_parallel not off
  int zero_stage = 0;     // how the data-parallel ranks shard; 0 where nothing is sharded (one process, no offload)
  bool offload = false;   // dist.offload_optimizer = cpu

  // dist.* on `world` ranks. A stage is only what runs: one process without offload trains unsharded (stage 0).
  static ParallelDims of(const DistConfig& dist, int world);
  // Buckets and a sharded optimizer: several ranks, or one with offload (a group of one).
  bool sharded() const { return world > 1 || offload; }
  int tp_rank(int rank) const { return rank % tp; }
  int dp_rank(int rank) const { return rank / tp; }
  bool shards_gradients() const { return zero_stage >= 2; }
  bool gathers_parameters() const { return zero_stage == 3; }  // each unit gathered before it runs, freed after
  std::string describe() const;  // "2 ranks: data parallel 2, ZeRO stage 3"
};

}  // namespace memtrain
