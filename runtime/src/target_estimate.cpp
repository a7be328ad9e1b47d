#include "memtrain/runtime/target_estimate.h"

#include <algorithm>
#include <iomanip>
#include <numeric>
#include <sstream>

#include "memtrain/core/error.h"
#include "memtrain/core/memory_tracker.h"
#include "memtrain/runtime/factories.h"
#include "memtrain/runtime/step_time.h"

namespace memtrain {

namespace {

// Low-bit state and an NF4 base on a split model keep whole blocks when their blocks divide every run of the
// row-parallel weights' slices (h / T and F / T columns; the column and vocabulary splits run in multiples of h):
// Trainer::lowbit_slices_refusal's and quantize_frozen_linears' rule for the closed form's weights.
bool blocks_fit_slices(const Config& v) {
  const int64_t T = v.dist.tensor_parallel;
  if (T <= 1) return true;
  const auto whole = model_family(v.model.name).shape(v.model, config_vocab(v));
  const int64_t runs = std::gcd(whole.hidden / T, whole.ffn / T);
  const int64_t block = optimizer_block(v.train);
  return (block == 0 || runs % block == 0) && (v.lora.quantize_base != "nf4" || runs % v.lora.quantize_block == 0);
}

constexpr int64_t kMiB = int64_t{1} << 20;

// What a GPU holds besides the caching allocator's tensors at the step's peak (docs/ESTIMATE.md, "CUDA terms").
std::vector<DeviceTerm> device_terms(const Target& t, int world, const ActivationEstimate& a) {
  if (!t.cuda) return {};
  std::vector<DeviceTerm> terms;
  terms.push_back({"CUDA context", 512 * kMiB,
                   "driver state and the kernels loaded lazily (CUDA_MODULE_LOADING=LAZY); outside the allocator; "
                   "an assumption until measured on the GPU"});
  // PyTorch's cuBLAS workspace per (handle, stream), through the caching allocator: CUBLAS_WORKSPACE_CONFIG's
  // default is :4096:8 (32 MiB) on Hopper and :4096:2:16:8 (8.125 MiB) before it, as cuBLAS recommends; handles are
  // per thread, and a step runs GEMMs on two (the forward on the caller's, the backward on autograd's device thread):
  // two workspaces (cublas_workspace_bytes in device.h reads the same on the machine itself). cuBLASLt shares them.
  const bool ampere = t.name.rfind("a100", 0) == 0;  // a byte count: an unknown GPU, taken as Hopper's
  terms.push_back({"cuBLAS workspaces", 2 * (ampere ? 8 * kMiB + 128 * 1024 : 32 * kMiB),
                   "PyTorch's CUBLAS_WORKSPACE_CONFIG default for the architecture, one per thread running GEMMs "
                   "(forward and autograd's backward)"});
  if (world > 1)
    terms.push_back({"NCCL buffers", 2 * 32 * 4 * kMiB,
                     "NCCL_BUFFSIZE (4 MiB) for send and receive on up to 32 channels, outside the allocator; an "
                     "assumption until measured"});
  // Requests round up to 512 B; blocks over 1 MiB come from segments of 2 MiB multiples (20 MiB for 1-10 MiB
  // requests, split): on average about half of 2 MiB more is reserved than allocated per live activation tensor.
  terms.push_back({"allocator rounding", a.saved_tensors * (kMiB + 512),
                   "each live activation tensor rounded to the allocator's 2 MiB granularity (half on average)"});
  return terms;
}

}  // namespace

ActivationSettings activation_settings(const Config& config, bool cuda, bool keep_grads, int64_t micro_batch, int world) {
  ActivationSettings s;
  s.reduced_bytes_per_element = reduced_part_bytes_per_element(config.train, config.dist, world, cuda);
  s.micro_batch = micro_batch;
  s.half_params = config.train.param_dtype == "bf16";
  s.masters_by_bucket = s.half_params && keep_grads && world == 1 && config.dist.offload_optimizer != "cpu" &&
                        config.train.accum_steps == 1 && steps_in_parts(config.train.optimizer);
  s.bucket_elements = static_cast<int64_t>(config.dist.bucket_mib * 1024 * 1024) / 4;
  s.autocast = config.train.precision != "fp32" && !s.half_params;
  s.policy = RecomputePolicy::parse(config.memory.recompute);
  s.policy.offload = config.memory.offload;
  s.head_rows = parse_head_rows(config.memory.head);
  s.keep_grads = keep_grads;
  s.accumulates = keep_grads && config.train.accum_steps > 1;
  s.cuda = cuda;
  if (config.lora.rank > 0)
    s.lora = {.rank = config.lora.rank, .dropout = config.lora.dropout, .targets = lora_targets(config.lora)};
  s.packed = config.data.dataset == "chat";
  if (config.lora.quantize_base == "nf4" && has_closed_form(config.model)) {
    // The largest NF4 weight dequantized: bf16 values (on CUDA also a chunk's int32 indices and gathered levels, 6
    // bytes per value of 2^24 at most), and their fp32 copy for an fp32 input without autocast.
    // Split T: a slice of 1/T of a weight whose whole is eligible.
    const auto shapes = model_family(config.model.name).tensors(config.model, config_vocab(config));
    int64_t largest = 0;
    for (int64_t i = 0; i < shapes.block_linears; ++i)
      if (nf4_eligible(shapes.block[static_cast<size_t>(i)], nf4_options(config.lora)))
        largest = std::max(largest, shapes.block[static_cast<size_t>(i)] / config.dist.tensor_parallel);
    const int64_t fp32_copy = s.autocast || s.half_params ? 0 : 4;
    s.nf4_dequantized_bytes = largest * 2 + std::max(cuda ? 6 * std::min(largest, int64_t{1} << 24) : 0, fp32_copy * largest);
  }
  return s;
}

ActivationProbe as_probe(const ActivationEstimate& a, int64_t micro_batch, bool keep_grads) {
  ActivationProbe p;
  p.micro_batch[0] = p.micro_batch[1] = micro_batch;
  p.bytes[0] = p.bytes[1] = a.peak;
  p.grads_included = keep_grads;
  p.closed_form = a.at;
  return p;
}

int64_t TargetEstimate::device_peak() const {
  int64_t extra = 0;
  for (const auto& t : device_terms) extra += t.bytes;
  return states.peak_device() + extra;
}

TargetEstimate estimate_for_target(const Config& config, const Target& target, int world) {
  TargetEstimate out;
  out.target = target, out.world = world;
  // dist.tensor_parallel = T: each rank holds its slice (model_state_inputs, config_transformer_shape); ZeRO shards
  // over the world / T data-parallel ranks (estimate_settings); the optimizer is sharded on any world above one.
  ParallelDims::of(config.dist, world);  // T must divide the target's ranks
  auto in = model_state_inputs(config, world);
  in.cuda = target.cuda;
  const auto shape = config_transformer_shape(config);
  const bool sharded = world > 1 || config.dist.offload_optimizer == "cpu";
  const auto mb = config.train.micro_batch;
  auto probe = [&](bool keep) {
    const auto a = transformer_activations(shape, activation_settings(config, target.cuda, keep, mb, world));
    return std::make_pair(as_probe(a, mb, keep), a);
  };
  MEMTRAIN_CHECK(RecomputePolicy::parse(config.memory.recompute).mode != RecomputePolicy::Mode::kBudget, ConfigError,
                 "[estimate] memory.recompute = ", config.memory.recompute, " is resolved by measuring on the machine "
                 "itself; estimate for a target with none | all | every:K | attn | mlp");
  auto [p, a] = probe(!sharded);
  in.probe = p;
  if (!sharded && config.train.accum_steps > 1) in.probe_dropped = probe(false).first;
  out.activations = a;
  out.states = estimate_memory(in);
  out.device_terms = device_terms(target, world, a);
  return out;
}

std::string TargetEstimate::table() const {
  std::ostringstream out;
  out << states.table() << "  activations at the peak: " << activations.at << "\n";
  for (const auto& t : activations.terms)
    out << "    " << t.name << std::string(t.name.size() < 56 ? 56 - t.name.size() : 1, ' ') << format_bytes(t.bytes) << "\n";
  if (!device_terms.empty()) {
    out << "  outside the tensors (CUDA):\n";
    for (const auto& t : device_terms)
      out << "    " << t.name << std::string(t.name.size() < 24 ? 24 - t.name.size() : 1, ' ') << format_bytes(t.bytes)
          << "  (" << t.source << ")\n";
  }
  std::ostringstream share;
  share << std::fixed << std::setprecision(1) << 100.0 * static_cast<double>(device_peak()) / static_cast<double>(target.bytes);
  out << "  total per " << (target.cuda ? "GPU" : "host") << "    " << format_bytes(device_peak()) << " (" << share.str()
      << "% of " << target.name << ", " << format_bytes(target.bytes) << ")" << (fits() ? ": fits" : ": does not fit") << "\n";
  return out.str();
}

std::vector<std::string> TargetPlan::overrides(const PlanCandidate& c) const {
  std::vector<std::string> o = {"--train.micro_batch=" + std::to_string(c.micro_batch),
                                "--train.accum_steps=" + std::to_string(c.accum_steps), "--memory.recompute=" + c.recompute,
                                "--memory.head=" + c.head, "--dist.zero_stage=" + std::to_string(c.stage),
                                std::string("--dist.offload_optimizer=") + (c.offload ? "cpu" : "none")};
  if (!c.optimizer.empty()) o.push_back("--train.optimizer=" + c.optimizer);
  if (!c.quantize_base.empty()) o.push_back("--lora.quantize_base=" + c.quantize_base);
  o.push_back("--dist.tensor_parallel=" + std::to_string(c.tensor_parallel));
  return o;
}

TargetPlan plan_for_target(const Config& config, const Target& target, int world, int nproc_per_node) {
  TargetPlan plan;
  const auto speed = target_speed(target, config.train.param_dtype == "bf16" || config.train.precision != "fp32");
  plan.speed_source = speed.source;
  const auto& t = config.train;
  // The global batch stays: train.micro_batch x train.accum_steps per data-parallel rank of the configured T, so a
  // rank's share is that / T, and a data-parallel rank of another T' takes T' shares.
  const int configured_T = static_cast<int>(std::max<int64_t>(1, config.dist.tensor_parallel));
  const int64_t configured = t.micro_batch * t.accum_steps;
  // Tensor parallelism: T up to the GPUs of one node, dividing the world, the heads, the kv heads and the MLP width
  // (a candidate whose other settings it does not compose with is skipped below: Config::tensor_parallel_refusal).
  std::vector<int> degrees = {1};
  const int node = nproc_per_node > 0 ? std::min(nproc_per_node, world) : world;
  if (has_closed_form(config.model)) {  // else estimate_for_target names the model it cannot estimate
    const auto whole = model_family(config.model.name).shape(config.model, config_vocab(config));
    for (int T = 2; T <= node; T *= 2)
      if (world % T == 0 && whole.heads % T == 0 && whole.kv_heads % T == 0 && whole.ffn % T == 0) degrees.push_back(T);
  }
  if (std::find(degrees.begin(), degrees.end(), configured_T) == degrees.end()) degrees.push_back(configured_T);
  if (configured % configured_T != 0) degrees = {configured_T};  // a share that does not divide: T as configured
  const std::vector<std::string> policies = {"none", "every:2", "attn", "all"};
  const std::vector<std::string> heads = {"plain", "fused"};
  std::vector<bool> offloads = {false};
  if (target.cuda && t.precision != "fp16") offloads = {false, true};
  std::vector<std::string> optimizers = {""};
  if (config.memory.allow_lowbit_optimizer && (t.optimizer == "adamw" || t.optimizer == "adamw_loop"))
    optimizers = {"", "adamw8bit", "adamw4bit"};
  // memory.allow_quantized_base: a LoRA base stored in NF4 (QLoRA), after every level of the configured base.
  std::vector<std::string> bases = {""};
  if (config.memory.allow_quantized_base && config.lora.rank > 0 && config.lora.quantize_base == "none") bases.push_back("nf4");
  std::vector<std::pair<std::string, size_t>> levels;  // (base, optimizer), fewer bits later
  for (const auto& b : bases)
    for (size_t o = 0; o < optimizers.size(); ++o) levels.emplace_back(b, o);
  const auto usable = static_cast<int64_t>(static_cast<double>(target.bytes) * (1 - config.memory.budget_headroom));
  std::vector<PlanCandidate> fitting;
  for (size_t level = 0; level < levels.size(); ++level) {
    const auto& [base, o] = levels[level];
    for (int T : degrees) {
      const int data = world / T;
      const int64_t samples = T == configured_T ? configured : configured / configured_T * T;  // per data-parallel rank
      std::vector<int64_t> micro;
      for (int64_t mb = samples; mb >= 1; mb /= 2)
        if (samples % mb == 0) micro.push_back(mb);
      std::vector<int> stages = {0};
      if (data > 1) stages = {0, 1, 2, 3};
      for (auto mb : micro)
        for (const auto& policy : policies)
          for (const auto& head : heads)
            for (int stage : stages)
              for (bool offload : offloads) {
                if (offload && stage == 0 && data > 1) continue;
                PlanCandidate c{.micro_batch = mb, .accum_steps = samples / mb, .recompute = policy, .head = head,
                                .stage = offload && data == 1 ? 1 : stage, .offload = offload, .optimizer = optimizers[o],
                                .lowbit_rank = static_cast<int>(level), .quantize_base = base, .tensor_parallel = T,
                                .estimate = {}};
                auto v = config;
                c.apply_to(v);
                if (!v.tensor_parallel_refusal().empty()) continue;  // e.g. an NF4 base
                if (!blocks_fit_slices(v)) continue;
                const auto e = estimate_for_target(v, target, world);
                ++plan.considered;
                c.estimate = e.states;
                // The device terms go in the estimate's peak as the planner reads it.
                c.estimate.device.activations += e.device_peak() - e.states.peak_device();
                const auto time = predict_step(step_settings(v, world, nproc_per_node > 0 ? nproc_per_node : world), speed);
                c.step_ms = time.total_s * 1e3, c.tokens_per_s = time.tokens_per_s;
                if (c.estimate.peak_device() <= usable) fitting.push_back(c);
              }
    }
    if (!fitting.empty()) break;  // fewer bits only where nothing with more fits
  }
  std::stable_sort(fitting.begin(), fitting.end(), [](const PlanCandidate& a, const PlanCandidate& b) {
    if (a.step_ms != b.step_ms) return a.step_ms < b.step_ms;
    return a.estimate.peak_device() < b.estimate.peak_device();
  });
  plan.fitting = std::move(fitting);
  return plan;
}

}  // namespace memtrain
