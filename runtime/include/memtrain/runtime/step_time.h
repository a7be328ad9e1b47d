// The time model of `memtrain plan` and `memtrain estimate --target`: a training step's predicted time on a target,
// from the step's FLOPs and bytes, without building the model. docs/ESTIMATE.md ("Step time") states each term,
// where its numbers come from, and what the model leaves out.
//
//   StepSettings s = step_settings(config, /*world=*/8, /*nproc_per_node=*/8);
//   TargetSpeed speed = target_speed(parse_target("h100-80gb"), s.half_matmuls);
//   StepTime t = predict_step(s, speed);      // t.total_s, t.tokens_per_s, and each term
//
// A step is accum_steps micro-batches, each a forward and a backward (plus the recomputed share of the forward);
// then the optimizer on this rank's part. Per micro-batch:
//   compute  = sum over the block's matmuls of their time (forward; backward: the input's gradient, and the weight's
//              where the weight trains) + attention (forward; backward 2.5x, a flash kernel's) + the head, x layers;
//   matmul time: FLOPs / (peak x achieved share) on a GPU target; timed on this machine's own cores for cpu: targets
//              (this machine is the host the target names), at the micro-batch's own shapes.
// Communication (stages 0-3) moves bytes over the slowest link the ranks use at the ring's bus bandwidth; the
// reductions overlap the backward and stage 3's prefetched gathers the forward and backward: only what they exceed
// their window by is exposed, plus what cannot overlap (the parameters' all-gather after stages 1-2's step).
// Tensor parallelism (dist.tensor_parallel = T, the shape a rank's slice): ZeRO runs over world / T ranks, and each
// block's forward moves its activations (tokens x hidden) through 2 all-reduces (with sequence parallelism 2 all-gathers
// and 2 reduce-scatters: the same bytes), its backward as many, a recomputed forward again; the embedding's and the
// head's one each. They sit between the block's matmuls: all exposed, over the node's link.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>

#include "memtrain/core/activation_model.h"
#include "memtrain/runtime/memory_estimate.h"

namespace memtrain {

struct Config;

// A target's speeds. GPU targets: published peaks (SXM parts) and an achieved share stated as an assumption; cpu:
// targets are this machine, its matmuls and attention timed here (`timed` = true).
struct TargetSpeed {
  std::string source;                    // where the numbers come from, for the plan's footer
  bool timed = false;                    // cpu: the primitives below are measured, not derived from a peak
  double matmul_flops = 0;               // dense matmul FLOP/s in the step's matmul dtype (peak)
  double achieved = 1;                   // share of the peak a training step's matmuls reach
  double memory_bytes_per_s = 0;         // device memory bandwidth (the optimizer's update)
  double intra_node_bytes_per_s = 0;     // collective bus bandwidth between the GPUs of a node
  double inter_node_bytes_per_s = 0;     // per GPU, between nodes
  double host_link_bytes_per_s = 25e9;   // device <-> host (offload), an assumption: pinned copies on PCIe 4/5 x16
  double optimizer_ns_per_element = 0;   // cpu: ATen's fused AdamW timed here (time_cpu_update)
  double kernel_overhead_s = 0;          // per kernel launched (GPU: launch and tail latency, an assumption)
  // cpu: timed primitives, memoized by shape: a (m x k) x (k x n) matmul, and causal attention forward + backward.
  mutable std::map<std::tuple<int64_t, int64_t, int64_t>, double> matmul_s;
  mutable std::map<std::tuple<int64_t, int64_t, int64_t, int64_t>, std::pair<double, double>> attention_s;
  bool half = false;                     // 16-bit matmuls (autocast or bf16 parameters)
  double matmul_seconds(int64_t m, int64_t k, int64_t n) const;
  // Causal attention of `batch` x `heads` sequences of `tokens` x `head_dim`: (forward, backward) seconds.
  std::pair<double, double> attention_seconds(int64_t batch, int64_t heads, int64_t tokens, int64_t head_dim) const;
};

// What a step's time depends on, from the config as it stands and the world it runs on.
struct StepSettings {
  TransformerShape shape;
  int64_t micro_batch = 1, accum_steps = 1;
  double recompute_fraction = 0;   // the share of the blocks' forward run again (recompute_fraction in planner.h)
  int stage = 0;
  bool offload = false;
  bool half_matmuls = false;       // train.precision bf16 | fp16, or train.param_dtype = bf16
  bool lora = false;               // a frozen base: its linears' weights get no gradient
  int world = 1, nproc_per_node = 1;
  int tensor_parallel = 1;         // dist.tensor_parallel: ZeRO over world / tensor_parallel ranks
  int64_t activation_bytes = 4;    // an activation element's bytes (2 with 16-bit matmuls)
  int64_t trained_elements = 0;    // every rank's stepped elements in all (the optimizer steps 1/N of them)
  int64_t parameter_elements = 0;  // trained + frozen (stage 3 gathers them all)
  int64_t param_bytes = 4, grad_bytes = 4;
  bool reduce_every_micro_batch = false;
  int64_t tokens_per_step() const { return micro_batch * accum_steps * shape.context * (world / tensor_parallel); }
};

struct StepTime {
  double compute_s = 0;        // forward + backward of every micro-batch, the recomputed forward included
  double recompute_s = 0;      // of which the recomputed forward
  double communication_s = 0;  // every collective's time, overlapped or not
  double exposed_s = 0;        // what the step waits for of it
  double tensor_parallel_s = 0;  // of communication_s (and exposed_s), the tensor-parallel collectives
  double optimizer_s = 0;
  double offload_s = 0;        // the CPU update and the host link's copies (offload only)
  double overhead_s = 0;       // kernel launches (GPU)
  double total_s = 0;
  double tokens_per_s = 0;
};

StepSettings step_settings(const Config& config, int world, int nproc_per_node);
TargetSpeed target_speed(const Target& target, bool half_matmuls);
StepTime predict_step(const StepSettings& s, const TargetSpeed& speed);

}  // namespace memtrain
