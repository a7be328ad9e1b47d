// Memory of a run on a machine that need not be this one (`memtrain estimate --target`, `memtrain plan`): each
// rank's model states (memory_estimate.h) and activations in closed form (core/activation_model.h) for the config's
// gpt or llama, from shapes alone (nothing built, no data read, no CUDA needed), plus what a GPU holds besides the
// caching allocator's tensors, each a named term: the CUDA context, cuBLAS's workspace, NCCL's buffers, and the
// allocator's rounding. docs/ESTIMATE.md says where each number comes from.
//
//   auto target = memtrain::parse_target("h100-80gb");
//   auto e = memtrain::estimate_for_target(config, target, /*world=*/8);
//   std::cout << e.table();                         // every term; e.device_peak() against target.bytes
//   auto plan = memtrain::plan_for_target(config, target, 8);   // best first, the ones that fit
#pragma once

#include <string>
#include <vector>

#include "memtrain/core/activation_model.h"
#include "memtrain/core/config.h"
#include "memtrain/runtime/memory_estimate.h"
#include "memtrain/runtime/planner.h"

namespace memtrain {

struct DeviceTerm {
  std::string name;
  int64_t bytes = 0;
  std::string source;  // where the number comes from
};

struct TargetEstimate {
  Target target;
  int world = 1;
  MemoryEstimate states;              // tensors: model states, data, activations, gathered units, buckets
  ActivationEstimate activations;     // the activations' peak and its terms
  std::vector<DeviceTerm> device_terms;  // a GPU's memory outside its tensors (empty for cpu: targets)
  int64_t device_peak() const;        // states' device peak + device_terms
  bool fits() const { return device_peak() <= target.bytes; }
  std::string table() const;
};

// The closed form's settings for the config as it stands: its precision and parameter dtype, memory.recompute (with
// memory.offload) and memory.head, LoRA, and ZeRO 2-3's reduced parts for `world` ranks, at `micro_batch`.
ActivationSettings activation_settings(const Config& config, bool cuda, bool keep_grads, int64_t micro_batch, int world);
// A closed-form estimate in the probe's form (one point, at its micro-batch) for estimate_memory.
ActivationProbe as_probe(const ActivationEstimate& a, int64_t micro_batch, bool keep_grads);

// The config as it stands (its stage, recompute, head, micro-batch, offload, optimizer) on `world` ranks of the
// target. ConfigError for models without a closed form, [lora] and train.freeze.
TargetEstimate estimate_for_target(const Config& config, const Target& target, int world);

struct TargetPlan {
  std::vector<PlanCandidate> fitting;  // best (fastest step) first
  int64_t considered = 0;
  std::string speed_source;            // where the time model's speeds come from (TargetSpeed::source)
  std::vector<std::string> overrides(const PlanCandidate& c) const;  // --section.key=value for the candidate
};
// Every setting that keeps the global batch (train.micro_batch x train.accum_steps per rank): micro-batches
// dividing it, recompute none | every:2 | attn | all, head plain | fused, ZeRO stage 0-3 (several ranks), optimizer
// offload (CUDA targets), tensor parallelism T = 2, 4, ... up to the GPUs of a node (gpt and llama, T dividing the
// heads, kv heads and MLP width; the global batch kept: a data-parallel rank takes T ranks' samples; the plain head;
// fp32 moments), and with memory.allow_lowbit_optimizer AdamW's 8- and 4-bit state; those whose device
// peak fits the target less memory.budget_headroom, fastest first by the time model (step_time.h: each candidate's
// predicted step time and tokens/s on `world` ranks, `nproc_per_node` to a node; 0 = all on one node), low-bit state
// only where nothing with fp32 moments fits. A cpu: target times its matmuls here (about a second).
TargetPlan plan_for_target(const Config& config, const Target& target, int world, int nproc_per_node = 0);

}  // namespace memtrain
