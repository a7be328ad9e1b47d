#include "memtrain/distributed/parallel_dims.h"

#include "memtrain/core/error.h"

namespace memtrain {

ParallelDims ParallelDims::of(const DistConfig& dist, int world) {
  MEMTRAIN_CHECK(world >= 1, Error, "[dist] a world of ", world, " ranks");
  ParallelDims d;
  const auto tp = static_cast<int>(dist.tensor_parallel);
  MEMTRAIN_CHECK(tp >= 1 && world % tp == 0, ConfigError, "[config] dist.tensor_parallel = ", tp, " must divide the ",
                 world, " ranks (groups of ", tp, " consecutive ranks; data parallel across them)");
  d.world = world, d.tp = tp, d.dp = world / tp;
  d.sequence_parallel = tp > 1 && dist.sequence_parallel != "off";
  d.offload = dist.offload_optimizer == "cpu";
  d.zero_stage = d.sharded() ? static_cast<int>(dist.zero_stage) : 0;
  return d;
}

std::string ParallelDims::describe() const {
  return detail::concat(world, world == 1 ? " rank" : " ranks", ": data parallel ", dp,
                        tp > 1 ? detail::concat(", tensor parallel ", tp, sequence_parallel ? " (sequence parallel)" : "")
                               : std::string(),
                        ", ZeRO stage ", zero_stage,
                        offload ? ", optimizer offloaded to the host" : "");
}

}  // namespace memtrain
