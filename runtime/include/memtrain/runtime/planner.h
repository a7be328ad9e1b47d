// The planner behind memory.budget_mib: among the settings that keep the global batch (micro-batch x
// accumulation), the activation recomputation policy, the LM head (plain or fused) and, with several ranks,
// the ZeRO stage, the fastest whose estimated peak (memory_estimate.h) fits the budget.
//
//   std::vector<PlanCandidate> c = ...;            // each with its estimate and predicted step time
//   Plan p = choose_plan(c, 512 << 20, 0.05);       // throws ConfigError when nothing fits
//   std::cout << p.explain();                       // the choice, the runners-up, and why
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "memtrain/runtime/memory_estimate.h"

namespace memtrain {

struct Config;

struct PlanCandidate {
  int64_t micro_batch = 1;
  int64_t accum_steps = 1;
  std::string recompute = "none";  // memory.recompute
  std::string head = "plain";      // memory.head
  int stage = 0;                   // dist.zero_stage (several ranks)
  bool offload = false;            // dist.offload_optimizer = cpu (considered on CUDA, where it frees the device)
  // train.optimizer when the planner changes it (memory.allow_lowbit_optimizer: adamw8bit, adamw4bit); "" = as
  // configured. Fewer bits rank after more whatever their speed: numerics are changed only where nothing else fits.
  std::string optimizer;
  int lowbit_rank = 0;             // 0 as configured, 1 adamw8bit, 2 adamw4bit (+ 3 with quantize_base = nf4)
  // lora.quantize_base when the target planner changes it (memory.allow_quantized_base: nf4); "" = as configured.
  // Ranked after every setting with the configured base, as fewer bits are.
  std::string quantize_base;
  // dist.tensor_parallel (plan --target: up to the GPUs of a node; micro_batch x accum_steps is then each data-parallel
  // rank's, T times a rank's share of the global batch, which stays the same).
  int tensor_parallel = 1;
  MemoryEstimate estimate;
  double step_ms = 0;              // predicted step time (the time model: step_time.h, plan_step_cost or the probe's timings)
  double tokens_per_s = 0;         // all ranks' tokens per second at step_ms (step_time.h's model only; 0 otherwise)
  std::string describe() const;    // "micro-batch 8 x 2, recompute all, head fused, stage 2"
  // The candidate's settings written into a config: train.micro_batch, train.accum_steps, memory.recompute,
  // memory.head, dist.zero_stage, dist.offload_optimizer and (when changed) train.optimizer.
  void apply_to(Config& config) const;
};

struct Plan {
  int64_t budget_bytes = 0;
  double headroom = 0;                    // the share of the budget a chosen estimate leaves free
  PlanCandidate chosen;
  std::vector<PlanCandidate> runners_up;  // the next fastest that fit (at most 3)
  int64_t considered = 0;                 // candidates estimated
  int64_t fitting = 0;                    // of which fit the budget
  // Where step_ms comes from: "probe" (one process: the probe's timings here), "model" (several ranks: the time
  // model of step_time.h, whose speeds `speed_source` states) or "relative" (several ranks, a model without a
  // closed form: plan_step_cost's units).
  std::string timing = "probe";
  std::string speed_source;
  // What a chosen estimate may reach: the budget less the headroom.
  int64_t usable_bytes() const { return static_cast<int64_t>(static_cast<double>(budget_bytes) * (1 - headroom)); }
  std::string explain() const;
};

// The fastest candidate whose estimated device peak is at most `budget_bytes` x (1 - `headroom`) (ties: the
// smaller peak), among those of the lowest lowbit_rank that has one. The headroom (memory.budget_headroom) is kept for the estimate's error: an estimate a
// few percent under the measured peak must not put a plan that just fits over the budget. Nothing fits: a
// ConfigError naming the smallest feasible budget, its settings and the part of the estimate that
// dominates it.
Plan choose_plan(std::vector<PlanCandidate> candidates, int64_t budget_bytes, double headroom = 0);

// The ranking where neither the probe's timings nor the time model apply (several ranks, a model without a closed
// form): relative
// cost of a step of `accum_steps` micro-batches of `micro_batch` samples, each micro-batch costing one
// sample's worth of fixed overhead; recomputation adds its share of the forward (a third of forward +
// backward) and stage 3 gathers the parameters twice more than stages 0-2 move gradients (half again as
// many bytes: at `comm_share` of a stage-0 step spent communicating). Offload, whose CPU update cannot be
// priced without timing, doubles the cost: it is chosen only where nothing without it fits.
double plan_step_cost(int64_t micro_batch, int64_t accum_steps, double recompute_fraction, int stage,
                      double comm_share = 0.1, bool offload = false);

// The cost offload adds to a step, in milliseconds: the CPU update of `stepped_elements` (this rank's part) at
// `cpu_update_ns_per_element` (timed on this machine by time_cpu_update), and its gradient copied down and
// parameters copied up over the host link (`link_bytes_per_s`; an assumption, not measured: 25 GB/s, about
// what pinned copies reach on PCIe 4/5 x16). Its moments and masters never cross.
double offload_step_ms(int64_t stepped_elements, int64_t grad_bytes_per_element, int64_t param_bytes_per_element,
                       double cpu_update_ns_per_element, double link_bytes_per_s = 25e9);
// ATen's fused AdamW on the CPU, timed: nanoseconds per fp32 element (fastest of a few steps of 2^20).
double time_cpu_update();

// The share of the blocks' forward that a recompute policy runs again: none 0, all 1, every:K 1/K,
// attn 1/3 and mlp 2/3 (a GPT block's attention and MLP matrices are 4 d^2 and 8 d^2 per token).
double recompute_fraction(const std::string& policy);

}  // namespace memtrain
