// Memory estimate of a run before its first step: per rank, the bytes of parameters, gradients,
// optimizer state (moments and fp32 masters), data, activations, stage-3 gathered units and gradient
// buckets in flight, on the training device and on the host.
//
// Model states are analytic (element counts x bytes, by param_dtype, optimizer, ZeRO stage, world size
// and offload: the rules DataParallel lays its buckets out by). Activations are measured: one forward +
// backward at two small micro-batches (the probe, Trainer::setup), extrapolated linearly to the configured
// micro-batch — the intercept holds what does not grow with the batch (autocast's weight copies, weight
// gradients), the slope what does.
//
//   EstimateInputs in{.block_elements = {...}, .root_elements = 98816, .world = 2, .stage = 2,
//                     .probe = {.micro_batch = {2, 4}, .bytes = {21e6, 40e6}}, .micro_batch = 8};
//   MemoryEstimate e = estimate_memory(in);
//   std::cout << e.table();                    // per component, device and host
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace memtrain {

// Activation bytes of one forward + backward (the tracker's activation_peak of a step) measured at two
// micro-batches; at(m) extrapolates linearly. One point (micro_batch[0] == micro_batch[1]) scales it.
struct ActivationProbe {
  int64_t micro_batch[2] = {0, 0};
  int64_t bytes[2] = {0, 0};
  double ms[2] = {0, 0};        // the probe's forward + backward time at each point (the planner's time model)
  bool grads_included = false;  // single process: the gradients born in backward are in `bytes`
  std::string closed_form;      // not measured but computed (core/activation_model.h): the peak's moment
  bool measured() const { return micro_batch[0] > 0; }
  int64_t at(int64_t m) const;
  double ms_at(int64_t m) const;  // the same line through the times
};

struct EstimateInputs {
  // The model's distinct trainable parameters, in elements: each block's (stage 3's units) and the rest
  // (embeddings, final norm, head, and parameters two blocks share: the root unit).
  std::vector<int64_t> block_elements;
  int64_t root_elements = 0;
  // Parameters that do not train (train.freeze, LoRA's base): their bytes only; whole on every rank, but
  // sharded and gathered per unit in stage 3 (each block's, and the root's).
  int64_t frozen_elements = 0;
  std::vector<int64_t> frozen_block_elements;
  int64_t frozen_root_elements = 0;
  int64_t param_bytes = 4;            // per element: 4 fp32, 2 bf16 (train.param_dtype)
  bool master_weights = false;        // bf16 parameters stepped through fp32 masters
  int64_t state_bytes = 8;            // optimizer state per stepped element: AdamW 8 (two fp32 moments), SGD 4 or 0
  // Low-bit AdamW: the elements of parameters whose moments are quantized, and their state per element
  // (two moments' codes plus absmaxes: 2 (1 + 4 / block) at 8 bits, 2 (1/2 + 4 / block) at 4); the others
  // take state_bytes.
  int64_t quantized_elements = 0;
  double quantized_state_bytes = 0;
  int64_t data_bytes = 0;             // the dataset in host memory
  bool cuda = false;                  // the training device is a GPU: host and device apart
  // CUDA: the cuBLAS workspaces a step leaves allocated (cublas_workspace_bytes, device.h). Counted with activations
  // in closed form; a probe's measured activations already hold what the workspaces add.
  int64_t workspace_bytes = 0;
  int world = 1;                      // the data-parallel ranks ZeRO shards over (world / dist.tensor_parallel)
  bool tensor_parallel = false;       // dist.tensor_parallel > 1: the optimizer is sharded (DataParallel) even on one
  int stage = 0;
  bool offload = false;               // dist.offload_optimizer = cpu
  double bucket_mib = 25;
  int64_t prefetch = 1;
  ActivationProbe probe;
  // One process with accumulation: the later micro-batches find the gradients of the earlier ones resident;
  // this probe (gradients dropped as they arrive) measures what they add on top.
  ActivationProbe probe_dropped;
  int64_t micro_batch = 1;
  int64_t accum_steps = 1;
  bool reduce_every_micro_batch = false;  // dist.reduce = micro_batch (or bf16 parameters; stage 3 always)
  int64_t budget_bytes = -1;          // memory.recompute = budget: the activations are held to it (no probe)
  int64_t largest_elements = 0;       // the largest parameter, trained or not (the setup's transients)
};

// Bytes per rank, by owner, on one memory.
struct MemoryParts {
  int64_t params = 0;
  int64_t grads = 0;              // resident gradient buckets and reduced parts
  int64_t optimizer_state = 0;    // moments, fp32 masters and their gradients, offloaded copies
  int64_t data = 0;
  int64_t activations = 0;        // the step's own peak over what was resident (with gradients born in
                                  // backward in a single process)
  int64_t gathered = 0;           // stage 3: full parameter storage held at once (root + (1 + prefetch) blocks)
  int64_t buckets_in_flight = 0;  // stages 2-3: a full-size gradient bucket between its first gradient and its reduce-scatter
  int64_t workspace = 0;          // CUDA: cuBLAS workspaces (EstimateInputs::workspace_bytes)
  int64_t resident() const { return params + grads + optimizer_state + data; }
  int64_t peak() const { return resident() + activations + gathered + buckets_in_flight + workspace; }
};

// The peak of the setup, before the first step (Trainer's constructor; a model built from shapes, models/shapes.h):
// what the rank holds (its parameters, whole or, under ZeRO-3 on several ranks, its parts; the fp32 masters it
// steps; data) plus the transients: one bucket while DataParallel lays its buckets out, and the values of one tensor
// on the host (with init_from, its read too) while they are filled.
struct SetupPeak {
  int64_t device = 0;  // the training device (on a CPU run: everything)
  int64_t host = 0;    // a GPU run's host memory
  std::string terms;   // what makes it, for messages
};

struct MemoryEstimate {
  MemoryParts device;   // the training device (on a CPU run: everything)
  MemoryParts host;     // a GPU run's host memory (data, offloaded optimizer part); empty on CPU runs
  SetupPeak setup;      // before the first step
  bool cuda = false;
  std::string method;   // how the activations were found
  int64_t peak_device() const { return device.peak(); }
  std::string table() const;          // a few lines: each component, device and host
  std::string to_json() const;        // for summary.json
};

MemoryEstimate estimate_memory(const EstimateInputs& in);

// A machine to estimate for (`memtrain estimate --target`), which need not be this one: its kind and the memory of
// one device (a GPU, or the host for cpu:).
struct Target {
  std::string name;
  bool cuda = true;
  int64_t bytes = 0;
};
// a100-40gb | a100-80gb | h100-80gb | h200-141gb (memory.total as nvidia-smi reports it for the SXM parts) |
// cpu:<N>GiB | cpu:<N>GB | cpu:<N>MiB | a byte count (a GPU). Throws ConfigError naming the spec and the names it knows.
Target parse_target(const std::string& spec);

}  // namespace memtrain
