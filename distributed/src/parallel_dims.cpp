#include "memtrain/distributed/parallel_dims.h"

#include "memtrain/core/error.h"

namespace memtrain {

ParallelDims ParallelDims::of(const DistConfig& dist, int world) {
  MEMTRAIN_CHECK(world >= 1, Error, "[dist] a world of ", world, " ranks");
  ParallelDims d;
  d.world = world, d.tp = 1, d.dp = world;
  d.offload = dist.offload_optimizer == "cpu";
  d.zero_stage = d.sharded() ? static_cast<int>(dist.zero_stage) : 0;
  return d;
}

std::string ParallelDims::describe() const {
  return detail::concat(world, world == 1 ? " rank" : " ranks", ": data parallel ", dp,
                        tp > 1 ? detail::concat(", tensor parallel ", tp) : std::string(), ", ZeRO stage ", zero_stage,
                        offload ? ", optimizer offloaded to the host" : "");
}

}  // namespace memtrain
