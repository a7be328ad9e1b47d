#include "memtrain/runtime/trainer.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/cuda.h>
#include <torch/csrc/cuda/memory_snapshot.h>
#include <c10/core/AllocatorConfig.h>
#include <torch/nn/modules/batchnorm.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "memtrain/core/safetensors.h"
#include "memtrain/runtime/factories.h"
#include "memtrain/core/error.h"
#include "memtrain/runtime/fused_loss.h"
#include "memtrain/core/cpu_memory.h"
#include "stop_signals.h"

namespace memtrain {

namespace fs = std::filesystem;

namespace {
// Dense peak TFLOP/s (no sparsity) from NVIDIA's data sheets, by device name: half precision (bf16/fp16
// on tensor cores) and fp32 (no TF32). Longer names first: "A100" before "A10", "L40S" before "L4".
struct KnownPeak {
  const char* name;
  double half_tflops, fp32_tflops;
};
constexpr KnownPeak kKnownPeaks[] = {
    {"H100 PCIe", 756, 51}, {"H100", 989, 67},    {"H200", 989, 67},     {"A100", 312, 19.5}, {"A10", 125, 31.2},
    {"L40S", 362, 91.6},    {"L4", 121, 30.3},    {"RTX 4090", 165, 82.6}, {"V100", 125, 15.7},
};

// FLOP/s that MFU is a fraction of, and where the figure came from; 0 when unknown.
std::pair<double, std::string> peak_flops(double configured_tflops, const c10::Device& device, Precision p) {
  if (configured_tflops > 0) return {configured_tflops * 1e12, "log.peak_tflops"};
  if (!device.is_cuda()) return {0, ""};
  const std::string name = at::cuda::getDeviceProperties(device.index())->name;
  for (const auto& k : kKnownPeaks)
    if (name.find(k.name) != std::string::npos)
      return {(p == Precision::kFp32 ? k.fp32_tflops : k.half_tflops) * 1e12, name};
  return {0, ""};
}

// A CPU without native bf16 (AVX512-BF16 or AMX) runs bf16 autocast in emulation: ~10-20x slower than fp32.
bool cpu_has_native_bf16() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("flags", 0) == 0) return line.find(" avx512_bf16") != std::string::npos || line.find(" amx_bf16") != std::string::npos;
  return true;  // unknown: say nothing
}

}  // namespace

c10::Device resolve_device(const std::string& name, int local_rank) {
  if (name == "cpu") return c10::kCPU;
  const bool cuda = torch::cuda::is_available();
  if (name == "auto") return cuda ? c10::Device(c10::kCUDA, local_rank) : c10::Device(c10::kCPU);
  MEMTRAIN_CHECK(name == "cuda", ConfigError, "[config] train.device = '", name, "': expected cpu | cuda | auto");
  MEMTRAIN_CHECK(cuda, ConfigError, "[config] train.device = cuda, but no CUDA device is available here; use cpu or auto");
  MEMTRAIN_CHECK(local_rank < static_cast<int>(torch::cuda::device_count()), ConfigError, "[dist] local rank ",
                 local_rank, " has no GPU: only ", torch::cuda::device_count(), " visible");
  return c10::Device(c10::kCUDA, local_rank);
}

namespace {
std::shared_ptr<Dataset> dataset_for(const Config& c, const World& w) {
  return make_dataset(c, {w.rank, w.world_size});
}

// ZeRO stage 3: each block's parameters gathered just before it runs (forward and backward), freed after.
class GatherBlocks : public BlockHooks {
 public:
  explicit GatherBlocks(DataParallel& dp) : dp_(dp) {}
  void before_block(int64_t block) override { dp_.before_block(block); }
  void after_block(int64_t block) override { dp_.after_block(block); }
  void before_block_backward(int64_t block) override { dp_.before_block_backward(block); }

 private:
  DataParallel& dp_;
};
}  // namespace

// log.trace_blocks: a span per block in the trace. Forward: from just before the block (its ZeRO-3 gather
// included) to just after it. Backward: from the arrival of the block's output gradient to the arrival of
// the previous block's (the first block's ends with the backward: the embeddings' share is in it).
class TraceBlocks : public BlockHooks {
 public:
  TraceBlocks(MemoryTracker& tracker, std::unique_ptr<BlockHooks> inner) : tracker_(tracker), inner_(std::move(inner)) {}
  void before_block(int64_t block) override {
    begin_ = MemoryTracker::Clock::now();
    if (inner_) inner_->before_block(block);
  }
  void after_block(int64_t block) override {
    if (inner_) inner_->after_block(block);
    tracker_.trace_span("block " + std::to_string(block) + " forward", begin_, MemoryTracker::Clock::now());
  }
  void before_block_backward(int64_t block) override {
    end_backward();
    open_ = block, backward_begin_ = MemoryTracker::Clock::now();
    if (inner_) inner_->before_block_backward(block);
  }
  void end_backward() {
    if (open_ >= 0)
      tracker_.trace_span("block " + std::to_string(open_) + " backward", backward_begin_, MemoryTracker::Clock::now());
    open_ = -1;
  }

 private:
  MemoryTracker& tracker_;
  std::unique_ptr<BlockHooks> inner_;
  MemoryTracker::Clock::time_point begin_, backward_begin_;
  int64_t open_ = -1;
};

Trainer::Trainer(const Config& config, const World& world) : config_(config), world_(world) {
  data_ = dataset_for(config_, world_);
  torch::manual_seed(static_cast<uint64_t>(config_.train.seed));  // weights depend on the seed alone
  model_ = make_model(config_.model, data_->info());
  setup();
}

Trainer::Trainer(const Config& config, std::shared_ptr<Model> model, std::shared_ptr<Dataset> data, const World& world)
    : config_(config), world_(world), model_(std::move(model)), data_(std::move(data)) {
  MEMTRAIN_CHECK(model_ && data_, Error, "[trainer] a model and a dataset are required");
  setup();
}

void Trainer::setup() {
  const auto& t = config_.train;
  if (t.threads > 0) at::set_num_threads(static_cast<int>(t.threads));
  device_ = resolve_device(t.device, world_.local_rank);
  configure_cuda_allocator();
  if (device_.is_cuda()) c10::cuda::set_device(device_.index());  // this rank's GPU: LOCAL_RANK
  precision_ = parse_precision(t.precision);
  check_precision_supported(precision_, device_);
  if (precision_ == Precision::kBf16 && device_.is_cpu() && world_.is_main() && !cpu_has_native_bf16())
    std::cerr << "memtrain: warning: [precision] train.precision = bf16 on a CPU without native bf16 (no AVX512-BF16 "
                 "or AMX): bf16 autocast runs emulated, about 10-20x slower than fp32\n";
  model_->to(device_);
  model_->train();

  std::set<const void*> seen;
  std::vector<std::string> names;  // of params_, in the same order
  for (const auto& item : model_->named_parameters()) {
    const auto& p = item.value();
    if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) params_.push_back(p), names.push_back(item.key());
  }
  param_names_ = names;
  // Several ranks use the data-parallel engine and its sharded optimizer; so does one process whose
  // optimizer state is offloaded to host memory (a group of one: ZeRO-Offload on a single device).
  // A plan for memory.budget_mib (below) may turn offload on or off in one process: the masters are made
  // whenever one process might need them (from the fp32 weights, before the bf16 cast), and dropped if not.
  const bool planning = parse_budget_mib(config_.memory.budget_mib) != 0;
  bool sharded = this->sharded(world_.world_size);
  torch::OrderedDict<std::string, torch::Tensor> masters;
  if (t.param_dtype == "bf16") {
    // bf16 parameters and gradients in the model; the optimizer steps fp32 master copies, which are
    // copied back after each step (the bf16 rounding of an update never accumulates).
    param_dtype_ = torch::kBFloat16;
    // Several ranks: DataParallel keeps the masters (for this rank's part only from ZeRO stage 1).
    for (size_t i = 0; i < params_.size() && (!sharded || (planning && world_.world_size == 1)); ++i) {
      master_.push_back(params_[i].detach().to(torch::kFloat, /*non_blocking=*/false, /*copy=*/true).requires_grad_());
      masters.insert(names[i], master_.back());
    }
    // Floating parameters and buffers only (Module::to(dtype) would also turn BatchNorm's int64 step
    // counter into bf16). BatchNorm's affine parameters and running statistics stay fp32, as PyTorch
    // FSDP's MixedPrecision keeps them by default: running statistics averaged in bf16 lose most of
    // each update (8 bits of mantissa against momentum 0.1), and ATen's batch_norm takes a bf16 input
    // with fp32 weight and statistics (CPU and CUDA), returning bf16. They cost 4 bytes each instead of 2:
    // 2 * channels parameters and 2 * channels statistics per BatchNorm, small beside the convolutions.
    std::set<const void*> keep_fp32;
    for (const auto& m : model_->modules(/*include_self=*/true)) {
      const auto* mod = m.get();
      const bool batch_norm = dynamic_cast<const torch::nn::BatchNorm1dImpl*>(mod) != nullptr ||
                              dynamic_cast<const torch::nn::BatchNorm2dImpl*>(mod) != nullptr ||
                              dynamic_cast<const torch::nn::BatchNorm3dImpl*>(mod) != nullptr;
      if (!batch_norm) continue;
      for (const auto& p : m->parameters(/*recurse=*/false)) keep_fp32.insert(p.unsafeGetTensorImpl());
      for (const auto& b : m->buffers(/*recurse=*/false)) keep_fp32.insert(b.unsafeGetTensorImpl());
    }
    auto to_bf16 = [&](torch::Tensor& t) {
      if (t.is_floating_point() && !keep_fp32.count(t.unsafeGetTensorImpl())) t.set_data(t.data().to(torch::kBFloat16));
    };
    for (auto& p : model_->parameters()) to_bf16(p);
    for (auto& b : model_->buffers()) to_bf16(b);
  }
  // Stage 3's units (and the estimate's): each parameter's block; -1 (the root, gathered for the whole
  // step) for those outside every block and for those two blocks share.
  {
    std::map<const void*, int64_t> unit;
    for (int64_t b = 0; b < model_->num_blocks(); ++b)
      for (const auto& p : model_->block_parameters(b)) {
        auto [it, added] = unit.emplace(p.unsafeGetTensorImpl(), b);
        if (!added && it->second != b) it->second = -1;
      }
    for (const auto& p : params_) {
      auto it = unit.find(p.unsafeGetTensorImpl());
      units_.push_back(it == unit.end() ? -1 : it->second);
    }
  }
  // memory.budget_mib: the settings below (micro-batch, recompute, head, stage, offload) are the plan's.
  if (planning) {
    plan_to_budget();
    sharded = this->sharded(world_.world_size);
    if (sharded) master_.clear(), masters.clear();  // one process, offload chosen: DataParallel keeps them
  }
  if (!sharded) optimizer_ = make_optimizer(optimizer_options(t), t.param_dtype == "bf16" ? masters : model_->named_parameters());
  policy_ = CheckpointPolicy::parse(config_.memory.recompute);
  policy_.offload = config_.memory.offload;
  if (policy_.mode == CheckpointPolicy::Mode::kPart) {
    auto parts = model_->part_names();
    MEMTRAIN_CHECK(std::find(parts.begin(), parts.end(), policy_.part) != parts.end(), ConfigError,
                   "[config] memory.recompute = ", policy_.part, ": this model's blocks have no '", policy_.part,
                   "' part (selective checkpointing needs a transformer; use all or every:K)");
  }

  head_rows_ = parse_head_rows(config_.memory.head);
  MEMTRAIN_CHECK(head_rows_ < 0 || model_->has_linear_head(), ConfigError,
                 "[config] memory.head = fused needs a model whose head is one linear map (gpt); this model's is not");
  // Before the buckets exist: the model is whole on every rank here, and the probe needs no collective.
  make_estimate();

  if (sharded) {
    // Rendezvous, process group, flat buckets; the optimizer steps the buckets' parts this rank owns.
    const auto& d = config_.dist;
    auto group = ProcessGroup::create(
        world_, {.backend = d.backend, .timeout = std::chrono::seconds(d.timeout_s), .device = device_});
    std::vector<std::pair<std::string, torch::Tensor>> named;
    for (size_t i = 0; i < params_.size(); ++i) named.emplace_back(names[i], params_[i]);
    const std::vector<int64_t> units = d.zero_stage == 3 ? units_ : std::vector<int64_t>{};
    dp_ = std::make_unique<DataParallel>(group, named,
                                         DataParallelOptions{.stage = static_cast<int>(d.zero_stage),
                                                             .bucket_mib = d.bucket_mib,
                                                             // bf16 parameters: each micro-batch's gradient goes
                                                             // to the fp32 masters, as in one process
                                                             .reduce_every_micro_batch = d.reduce == "micro_batch" ||
                                                                                         param_dtype_ != torch::kFloat ||
                                                                                         d.zero_stage == 3,
                                                             .master_weights = param_dtype_ != torch::kFloat,
                                                             .units = units,
                                                             .prefetch = d.prefetch,
                                                             .offload = d.offload_optimizer == "cpu"});
    if (d.zero_stage == 3) block_hooks_ = std::make_unique<GatherBlocks>(*dp_);
    optimizer_ = make_optimizer(optimizer_options(t), dp_->decay_tensors(), dp_->no_decay_tensors());
    sync_buffers();  // an embedder's model may start with other statistics on each rank
  }
  schedule_ = std::make_unique<CosineSchedule>(
      CosineScheduleOptions{.peak = t.lr, .min = t.min_lr, .warmup_steps = t.warmup_steps, .total_steps = t.steps});
  if (precision_ == Precision::kFp16) {
    scaler_ = std::make_unique<GradScaler>(GradScalerOptions{.init_scale = t.loss_scale_init,
                                                             .growth_factor = t.loss_scale_growth,
                                                             .backoff_factor = t.loss_scale_backoff,
                                                             .growth_interval = t.loss_scale_interval},
                                           device_);
  }

  MemoryTrackerOptions mo;
  mo.rank = world_.rank;
  mo.devices.clear();
  if (cpu_memory::installed()) mo.devices.push_back(c10::kCPU);
  if (device_.is_cuda()) mo.devices.push_back(device_);
  MEMTRAIN_CHECK(!config_.memory.track || !mo.devices.empty(), Error,
                 "[memory] memory.track = true on CPU needs memtrain::cpu_memory::install() at the start of main()");
  if (!config_.memory.track) mo.devices.clear();
  tracker_ = std::make_unique<MemoryTracker>(mo);
  if (config_.log.trace && dp_)
    dp_->observe_collectives([tracker = tracker_.get()](const std::string& what, int64_t bytes, MemoryTracker::Clock::time_point issued,
                                                        MemoryTracker::Clock::time_point completed) {
      tracker->trace_collective(what, bytes, issued, completed);
    });
  if (config_.log.trace && config_.log.trace_blocks) {
    auto traced = std::make_unique<TraceBlocks>(*tracker_, std::move(block_hooks_));
    trace_blocks_ = traced.get();
    block_hooks_ = std::move(traced);
  }
  tracker_->set_resident_source([this](const c10::Device& d) {
    // Master weights and their gradients are the optimizer's: counted as optimizer state.
    auto state = optimizer_state_tensors(*optimizer_);
    ResidentBytes r;
    if (dp_) {
      r = dp_->resident(state, d);
    } else {
      for (const auto& m : master_) state.push_back(m), state.push_back(m.grad());
      r = resident_bytes(params_, state, d);
    }
    if (d.is_cpu()) r.data = data_->resident_bytes();  // datasets live in host memory
    return r;
  });

  auto name = config_.log.name;
  if (name.empty()) name = config_.source.empty() ? "run" : fs::path(config_.source).stem().string();
  run_dir_ = (fs::path(config_.log.dir) / name).string();
  ckpt_dir_ = config_.checkpoint.dir.empty() ? (fs::path(run_dir_) / "checkpoints").string() : config_.checkpoint.dir;

  // memory.limit_mib: on CPU the counting allocator refuses allocations past it (process-wide; 0 lifts
  // it); on CUDA the caching allocator gets the matching fraction of the device.
  const int64_t limit = config_.memory.limit_mib * 1024 * 1024;
  if (device_.is_cuda()) {
    if (limit > 0) {
      const double total = static_cast<double>(at::cuda::getDeviceProperties(device_.index())->totalGlobalMem);
      c10::cuda::CUDACachingAllocator::setMemoryFraction(std::min(1.0, static_cast<double>(limit) / total), device_.index());
    }
  } else {
    MEMTRAIN_CHECK(limit == 0 || cpu_memory::installed(), Error,
                   "[memory] memory.limit_mib on CPU needs memtrain::cpu_memory::install() at the start of main()");
    cpu_memory::set_limit(limit);
  }
}

torch::Tensor Trainer::forward_loss(const Batch& batch) {
  AutocastGuard autocast(device_.type(), autocast_dtype(precision_));
  if (dp_) dp_->begin_forward();  // stage 3: the root unit (embeddings, head) gathered
  auto h = run_blocks(*model_, batch.input, policy_, block_hooks_.get());
  if (head_rows_ >= 0) {
    auto [features, weight] = *model_->head_features(h);
    return fused_linear_cross_entropy(features.reshape({-1, features.size(-1)}), weight, batch.target.reshape({-1}),
                                      head_rows_);
  }
  return model_->loss(model_->head(h), batch.target);
}

void Trainer::mark_gradients() const {
  // The counting allocator takes the peak apart by marked blocks: the gradients this backward made (a
  // parameter's .grad). With DataParallel the .grad are views of its buckets, which it marks itself.
  if (dp_ || !device_.is_cpu() || !cpu_memory::installed()) return;
  for (const auto& p : params_)
    if (p.grad().defined()) cpu_memory::mark(p.grad().storage().data(), cpu_memory::Kind::kGradient);
}

void Trainer::move_grads_to_masters() {
  if (master_.empty()) return;
  torch::NoGradGuard no_grad;
  const bool mark = device_.is_cpu() && cpu_memory::installed();
  for (size_t i = 0; i < master_.size(); ++i) {
    auto& g = params_[i].mutable_grad();
    if (!g.defined()) continue;
    if (master_[i].grad().defined()) master_[i].mutable_grad().add_(g);
    else master_[i].mutable_grad() = g.to(torch::kFloat);
    if (mark) cpu_memory::mark(master_[i].grad().storage().data(), cpu_memory::Kind::kGradient);
    g.reset();  // the bf16 gradient is freed: the next micro-batch starts from zero
  }
}

void Trainer::configure_cuda_allocator() {
  const auto& m = config_.memory;
  const bool asked = m.snapshot || m.expandable_segments || m.gc_threshold > 0 || m.cuda_allocator != "native";
  if (!asked) return;
  MEMTRAIN_CHECK(device_.is_cuda(), ConfigError, "[config] memory.snapshot, memory.expandable_segments, memory.gc_threshold "
                 "and memory.cuda_allocator set CUDA's caching allocator; this run is on ", device_.str());
  // PYTORCH_CUDA_ALLOC_CONF's grammar. The backend is read once, when the allocator is first used: it goes
  // into the environment (an explicit PYTORCH_CUDA_ALLOC_CONF of the user's is kept, and said); the others
  // can change at any time.
  std::string settings = "expandable_segments:" + std::string(m.expandable_segments ? "True" : "False");
  if (m.gc_threshold > 0) settings += ",garbage_collection_threshold:" + std::to_string(m.gc_threshold);
  if (m.cuda_allocator != "native") {
    const char* user = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
    if (user && world_.is_main())
      std::cerr << "memtrain: warning: [memory] PYTORCH_CUDA_ALLOC_CONF=" << user << " is set; memory.cuda_allocator = "
                << m.cuda_allocator << " only takes effect where it does not name a backend\n";
    const std::string env = std::string(user ? std::string(user) + "," : "") + "backend:" + m.cuda_allocator;
    ::setenv("PYTORCH_CUDA_ALLOC_CONF", env.c_str(), /*overwrite=*/1);
  } else {
    c10::CachingAllocator::setAllocatorSettings(settings);
  }
  // The history memory_viz draws: every allocation and free with its stack, up to 100,000 entries.
  if (m.snapshot) torch::cuda::_record_memory_history(std::string("all"), std::string("all"), "all", 100000);
}

void Trainer::write_memory_snapshot() {
  if (!config_.memory.snapshot || !device_.is_cuda()) return;
  const auto path = (fs::path(run_dir_) / ("memory_snapshot.rank" + std::to_string(world_.rank) + ".pickle")).string();
  write_file_atomically(path, torch::cuda::_memory_snapshot_pickled());
  if (world_.is_main())
    std::cout << "memory snapshot: " << path << " (python -m torch.cuda._memory_viz trace_plot " << path
              << " -o memory_viz.html)\n";
}

Batch Trainer::to_device(Batch b) const {
  b.input = b.input.to(device_, /*non_blocking=*/true);
  if (b.input.is_floating_point()) b.input = b.input.to(param_dtype_);
  b.target = b.target.to(device_, /*non_blocking=*/true);
  return b;
}

void Trainer::resolve_budget_policy() {
  // budget:MiB: one measured forward + backward with every block checkpointed gives each block's
  // activation bytes; the plan then checkpoints as few blocks as fit the budget.
  auto batch = to_device(data_->train_batch(step_, 0, config_.train.micro_batch));
  auto measure_device = memory_device();
  MEMTRAIN_CHECK(device_.is_cuda() || cpu_memory::installed(), Error,
                 "[checkpoint] budget policy on CPU needs memtrain::cpu_memory::install()");
  auto profile = profile_block_activations(*model_, [&] { return forward_loss(batch); }, measure_device);
  if (dp_) dp_->release_all();  // stage 3: outside a micro-batch nothing frees what the probe gathered
  // Several ranks: the probe's backward reduces nothing (outside a micro-batch), the stepped parts' gradients
  // (views of the reduced buckets, which LibTorch's zero_grad cannot detach) are untouched, and
  // DataParallel::begin_step re-attaches the parameters' gradient buckets.
  if (!dp_) optimizer_->zero_grad(true);
  model_->zero_grad(true);
  policy_.blocks = plan_checkpoint_budget(profile, static_cast<int64_t>(policy_.budget_mib * 1024 * 1024));
}

StepResult Trainer::step() {
  for (;;) {
    try {
      return attempt_step();
    } catch (const c10::OutOfMemoryError& e) {
      recover_from_oom(e.what_without_backtrace());
    }
  }
}

void Trainer::recover_from_oom(const std::string& what) {
  // Nothing of the abandoned step survives: its gradients, the scaler's per-step state, and the buffers
  // its forward passes updated (BatchNorm's running statistics, restored from the step's start).
  if (!dp_) optimizer_->zero_grad(/*set_to_none=*/true);  // several ranks: stops below; the buckets are views
  model_->zero_grad(/*set_to_none=*/true);
  if (scaler_) scaler_->discard_step();
  if (!buffer_backup_.empty()) {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> buffers;
    for (const auto& b : model_->buffers())
      if (b.is_floating_point()) buffers.push_back(b);
    torch::_foreach_copy_(buffers, buffer_backup_);
  }
  // FusedAdamW allocates all its state before it updates anything: out of memory inside it leaves the
  // parameters as they were. LibTorch's AdamW and SGD update parameter by parameter: not retried.
  const bool half_updated = in_optimizer_ && dynamic_cast<FusedAdamW*>(optimizer_.get()) == nullptr;
  in_optimizer_ = false;
  const auto measured = device_.is_cuda() || cpu_memory::installed() ? read_counters(device_) : DeviceCounters{};
  if (device_.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
  const auto& t = config_.train;
  const int64_t next = split_ * 2;
  const auto first_line = what.substr(0, what.find('\n'));
  std::ostringstream facts;
  facts << "out of memory in step " << step_ + 1 << " (" << first_line << "); peak this step "
        << format_bytes(measured.peak_allocated) << ", memory.limit_mib = " << config_.memory.limit_mib
        << (config_.memory.limit_mib == 0 ? " (none: the device is full)" : "");
  std::string why_not;
  if (t.oom != "retry") why_not = "train.oom = fail";
  else if (half_updated) why_not = "it happened inside train.optimizer = " + t.optimizer + "'s update, which may have changed some parameters already (adamw, the fused one, is retried)";
  else if (dp_) why_not = "with the sharded optimizer (several ranks, or dist.offload_optimizer) an out-of-memory step is not retried (the other ranks are inside its collectives)";
  else if (t.micro_batch < next) why_not = "the micro-batch cannot be halved again (" + std::to_string(t.micro_batch) + " samples in " + std::to_string(split_) + " pieces)";
  MEMTRAIN_CHECK(why_not.empty(), Error, "[memory] ", facts.str(), "; stopping: ", why_not,
                 ". Lower train.micro_batch, recompute more (memory.recompute) or raise the limit");
  split_ = next;
  if (world_.is_main())
    std::cerr << "memtrain: " << facts.str() << ": retrying it with micro-batches of " << (t.micro_batch + split_ - 1) / split_
              << " x " << t.accum_steps * split_ << " (the same " << t.micro_batch * t.accum_steps << " samples)\n"
              << std::flush;
}

StepResult Trainer::attempt_step() {
  const auto& t = config_.train;
  if (policy_.budget_unresolved()) resolve_budget_policy();
  StepResult r;
  r.step = step_;
  r.lr = schedule_->at(step_);
  set_learning_rate(*optimizer_, r.lr);
  if (scaler_) scaler_->discard_step();  // nothing left of an abandoned attempt
  if (t.oom == "retry" && !dp_) {
    // The floating buffers as the step found them, for a retry after an out-of-memory error.
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> buffers;
    for (const auto& b : model_->buffers())
      if (b.is_floating_point()) buffers.push_back(b);
    if (buffer_backup_.size() != buffers.size())
      for (const auto& b : buffers) buffer_backup_.push_back(torch::empty_like(b));
    if (!buffers.empty()) torch::_foreach_copy_(buffer_backup_, buffers);
  }
  if (dp_) {
    dp_->begin_step();  // zeroes the flat gradient buckets in place: parameters' gradients are views into them
  } else {
    optimizer_->zero_grad(/*set_to_none=*/true);
    if (!master_.empty()) model_->zero_grad(/*set_to_none=*/true);
  }
  tracker_->begin_step(step_ + 1);  // steps are numbered from 1 everywhere: step N is the N-th update
  // Dropout draws from the default generators, reseeded from (seed, step, rank): a step's masks do not
  // depend on what ran before it in the process (another trainer, an evaluation), a resumed run repeats
  // them, and ranks draw different masks for their different samples.
  torch::manual_seed(static_cast<uint64_t>(t.seed) * 1000003u + static_cast<uint64_t>(step_) +
                     static_cast<uint64_t>(world_.rank) * 0x9E3779B97F4A7C15ull);

  // 1. Micro-batches: forward under autocast, loss scaled to the mean over the step, backward. After an
  //    out-of-memory retry each micro-batch runs in split_ pieces, weighted by their share of it.
  auto loss_sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat).device(device_));
  for (int64_t micro = 0; micro < t.accum_steps; ++micro) {
    auto whole = data_->train_batch(step_, micro, t.micro_batch);
    const auto inputs = split_ == 1 ? std::vector<torch::Tensor>{whole.input} : whole.input.tensor_split(split_);
    const auto targets = split_ == 1 ? std::vector<torch::Tensor>{whole.target} : whole.target.tensor_split(split_);
    for (size_t piece = 0; piece < inputs.size(); ++piece) {
      auto batch = to_device({inputs[piece], targets[piece]});
      auto loss = split_ == 1 ? forward_loss(batch) / static_cast<double>(t.accum_steps)
                              : forward_loss(batch) * (static_cast<double>(inputs[piece].size(0)) /
                                                       static_cast<double>(whole.input.size(0) * t.accum_steps));
      tracker_->end_phase(Phase::kForward);
      // 2. Several ranks: buckets are reduced as they fill during this backward (every micro-batch, or the
      //    last only with dist.reduce = step); end_micro_batch waits for them.
      if (dp_) dp_->begin_micro_batch(/*last=*/micro + 1 == t.accum_steps && piece + 1 == inputs.size());
      (scaler_ ? scaler_->scale(loss) : loss).backward();
      if (dp_) dp_->end_micro_batch();
      if (trace_blocks_) trace_blocks_->end_backward();
      mark_gradients();         // for the tracker's breakdown of the peak (CPU)
      move_grads_to_masters();  // bf16 parameters: accumulate in fp32, not across micro-batches in bf16
      tracker_->end_phase(Phase::kBackward);
      loss_sum += loss.detach();
    }
  }
  tracker_->before_optimizer();
  // 3. Unscale (fp16), clip; the norm stays on the device (fp32 master gradients when there are masters;
  //    several ranks: this rank's reduced part, and the norm is global).
  const auto stepped = dp_ ? dp_->stepped_tensors() : (master_.empty() ? params_ : master_);
  if (scaler_) {
    scaler_->unscale(stepped);
    if (dp_) dp_->all_reduce_found_inf(scaler_->found_inf());  // every rank skips, or none
  }
  r.grad_norm = dp_ ? dp_->clip_grad_norm(t.grad_clip) : clip_grad_norm(stepped, t.grad_clip);
  // Without fp16's scaler, an inf/NaN is found here (one host read per step): the update is skipped.
  // Several ranks decide on the global norm, which every rank holds, so they skip together.
  if (!scaler_) {
    auto finite = torch::isfinite(r.grad_norm);
    if (!dp_) finite = finite.logical_and(torch::isfinite(loss_sum));
    r.nonfinite = !finite.item<bool>();
  }
  // 4. Optimizer step (skipped by the scaler on inf/NaN gradients).
  bool updated_in_place = false;  // offload: the update ran with the copies back, bucket by bucket
  if (r.nonfinite) {
    r.applied = false;
    ++nonfinite_run_;
    const bool stop = t.on_nonfinite == "stop" || nonfinite_run_ >= t.max_nonfinite;
    std::ostringstream what;
    what << "step " << step_ + 1 << ": non-finite " << (dp_ ? "" : "loss " + std::to_string(loss_sum.item<double>()) + " or ")
         << "gradient norm " << r.grad_norm.item<double>();
    MEMTRAIN_CHECK(!stop, Error, "[train] ", what.str(), "; stopping (",
                   t.on_nonfinite == "stop" ? std::string("train.on_nonfinite = stop")
                                            : std::to_string(nonfinite_run_) + " consecutive such steps, train.max_nonfinite = " +
                                                  std::to_string(t.max_nonfinite),
                   "). The parameters are those after step ", step_, "; lower train.lr or check the data");
    if (world_.is_main())
      std::cerr << "memtrain: warning: " << what.str() << ": update skipped (" << nonfinite_run_ << " in a row; the run "
                << "stops at " << t.max_nonfinite << ")\n";
  } else if (scaler_) {
    nonfinite_run_ = 0;
    in_optimizer_ = true;
    r.applied = scaler_->step(*optimizer_, stepped);
    scaler_->update();
  } else {
    nonfinite_run_ = 0;
    in_optimizer_ = true;
    // Offload with the fused AdamW: the CPU update runs bucket by bucket inside after_optimizer_step, each
    // bucket's copy up and gather overlapping the next bucket's update.
    auto* fused = dp_ && dp_->offload() ? dynamic_cast<FusedAdamW*>(optimizer_.get()) : nullptr;
    if (fused) {
      dp_->after_optimizer_step([fused](const std::vector<torch::Tensor>& stepped) { fused->step_only(stepped); });
      updated_in_place = true;
    } else {
      optimizer_->step();
    }
  }
  in_optimizer_ = false;
  if (r.applied && !master_.empty()) {
    torch::NoGradGuard no_grad;
    torch::_foreach_copy_(params_, master_);  // fp32 -> bf16, rounded once per step
  }
  if (dp_) {
    if (r.applied && !updated_in_place) dp_->after_optimizer_step();  // masters -> parameters, parts all-gathered
    r.comm_bytes = dp_->take_bytes_communicated();
    r.gathered_peak_bytes = dp_->take_peak_gathered_bytes();
  }
  tracker_->end_phase(Phase::kOptimizer);
  // 5. Memory sample of this step.
  tracker_->end_step();
  r.loss = loss_sum;
  ++step_;
  return r;
}

void Trainer::sync_buffers() {
  // Buffers (BatchNorm's running statistics) follow each rank's own batches; rank 0's are the ones
  // evaluated and saved, as DDP's broadcast_buffers makes them.
  if (!dp_) return;
  for (auto& b : model_->buffers())
    if (b.is_floating_point()) dp_->group_broadcast(b, 0);
}

EvalResult Trainer::evaluate(const std::vector<Batch>& batches) {
  sync_buffers();
  torch::NoGradGuard no_grad;
  model_->eval();
  // Evaluation's own peak on the training device (between steps: the step's peaks are reset at its start).
  const c10::Device measured = memory_device();
  const bool track = can_measure();
  const int64_t eval_start = track ? read_counters(measured).allocated : 0;
  if (track) reset_peak(measured);
  const int64_t traffic = dp_ ? dp_->traffic_mark() : 0;
  EvalResult e;
  double loss_sum = 0;
  int64_t correct = 0;
  bool classifier = false;
  for (const auto& b : batches) {
    auto moved = to_device(b);
    auto x = moved.input, y = moved.target;
    torch::Tensor out;
    const auto n = y.size(0);
    {
      AutocastGuard autocast(device_.type(), autocast_dtype(precision_));
      if (dp_) dp_->begin_forward();
      auto h = run_blocks(*model_, x, policy_, block_hooks_.get());  // no-grad: nothing recomputed
      if (head_rows_ >= 0) {
        // memory.head = fused: the loss chunk by chunk (no-grad: the loss only), the logits never whole.
        auto [features, weight] = *model_->head_features(h);
        loss_sum += fused_linear_cross_entropy(features.reshape({-1, features.size(-1)}), weight, y.reshape({-1}),
                                               head_rows_).item<double>() * static_cast<double>(n);
        e.samples += n;
        continue;
      }
      out = model_->head(h);
    }
    loss_sum += model_->loss(out, y).item<double>() * static_cast<double>(n);
    if (out.dim() == 2) {
      classifier = true;
      correct += out.argmax(1).eq(y).sum().item<int64_t>();
    }
    e.samples += n;
  }
  model_->train();
  if (track) e.peak_bytes = read_counters(measured).peak_allocated, e.activation_peak = e.peak_bytes - eval_start;
  if (dp_) dp_->release_all(), dp_->not_step_traffic(traffic);
  if (dp_) {  // every rank evaluated its own part: sums over ranks
    auto sums = torch::tensor({loss_sum, static_cast<double>(correct), static_cast<double>(e.samples)},
                              torch::TensorOptions().dtype(torch::kDouble).device(device_));
    dp_->group_all_reduce_sum(sums);
    auto host = sums.cpu();
    loss_sum = host[0].item<double>();
    correct = static_cast<int64_t>(host[1].item<double>());
    e.samples = static_cast<int64_t>(host[2].item<double>());
  }
  e.loss = std::numeric_limits<double>::quiet_NaN();  // no held-out data (val_fraction = 0)
  if (e.samples > 0) {
    e.loss = loss_sum / static_cast<double>(e.samples);
    if (classifier) e.accuracy = static_cast<double>(correct) / static_cast<double>(e.samples);
  }
  return e;
}

void Trainer::save_weights(const std::string& path) {
  // Stage 3: full copies by the trainer's parameter names; a tied parameter's other names find its copy
  // by TensorImpl.
  auto full = dp_ ? dp_->full_parameters(world_.is_main()) : std::map<std::string, torch::Tensor>{};
  if (!world_.is_main() && dp_ && dp_->stage() == 3) return;
  std::map<const void*, torch::Tensor> by_impl;
  for (size_t i = 0; i < params_.size(); ++i)
    if (auto it = full.find(param_names_[i]); it != full.end()) by_impl[params_[i].unsafeGetTensorImpl()] = it->second;
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& item : model_->named_parameters()) {
    auto it = by_impl.find(item.value().unsafeGetTensorImpl());
    tensors.emplace(item.key(), it != by_impl.end() ? it->second : item.value());
  }
  for (const auto& item : model_->named_buffers()) tensors.emplace(item.key(), item.value());
  save_safetensors(path, tensors, {{"format", "memtrain-weights"}, {"version", "1"}, {"step", std::to_string(step_)}});
}

namespace {

// 42s, 3m10s, 1h02m.
std::string duration_text(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s < 60) std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(s));
  else if (s < 3600) std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  else std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(s / 3600), static_cast<long long>(s / 60 % 60));
  return buf;
}

std::string si(double v) {
  std::ostringstream os;
  const char* suffix = "";
  if (v >= 1e9) v /= 1e9, suffix = "G";
  else if (v >= 1e6) v /= 1e6, suffix = "M";
  else if (v >= 1e3) v /= 1e3, suffix = "k";
  os << std::fixed << std::setprecision(1) << v << suffix;
  return os.str();
}

}  // namespace

void Trainer::fit() {
  const auto& t = config_.train;
  const bool main = world_.is_main();
  const bool bar = config_.log.progress == "bar" || (config_.log.progress == "auto" && isatty(STDOUT_FILENO));
  // Every folder the run will write is created and probed now: an unwritable checkpoint folder found
  // after the last step would lose the whole run's work.
  auto probe = [](const std::string& dir, const char* what) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    const auto file = fs::path(dir) / (".memtrain-probe-" + std::to_string(::getpid()));
    std::ofstream out(file);
    MEMTRAIN_CHECK(!ec && out.good(), Error, "[io] ", what, " '", dir, "' is not writable",
                   ec ? ": " + ec.message() : std::string(), "; nothing was trained");
    out.close();
    fs::remove(file, ec);
  };
  probe(run_dir_, "the run folder (log.dir / log.name)");
  if (config_.checkpoint.save_final || config_.checkpoint.every > 0) probe(ckpt_dir_, "checkpoint.dir");
  resume_or_refuse();
  const detail::StopSignals signals;  // SIGTERM / SIGINT: save after this step and return
  const auto peak = peak_flops(config_.log.peak_tflops, device_, precision_);
  if (main) {
    std::cout << config_.to_ini() << "\n";
    write_file_atomically((fs::path(run_dir_) / "config.ini").string(), config_.to_ini());
    std::cout << "model:      " << model_->describe() << "\n"
              << "data:       " << data_->describe() << "\n"
              << "device:     " << device_.str() << ", precision " << precision_name(precision_) << ", "
              << at::get_num_threads() << " threads\n"
              << "batch:      " << t.micro_batch << " x " << t.accum_steps << " micro-batches x " << world_.world_size
              << (world_.world_size == 1 ? " rank" : " ranks") << " = " << t.micro_batch * t.accum_steps * world_.world_size
              << " samples per step\n"
              << "recompute:  " << policy_.describe() << "; head " << config_.memory.head << "\n"
              << "MFU peak:   "
              << (peak.first > 0 ? si(peak.first) + "FLOP/s (" + peak.second + ")" : std::string("unknown: no MFU (set log.peak_tflops to report it)"))
              << "\n"
              << (dp_ ? "parallel:   " + dp_->describe() + "\n" : std::string())
              << "run folder: " << run_dir_ << "\n";
    if (config_.memory.track && config_.memory.estimate)
      std::cout << "memory estimate per rank, " << memory_device().str() << ":\n"
                << estimate_.table();
    std::cout << std::flush;
  }
  // The measured peak of the training device beside the estimate: "X (estimate Y, +Z%)".
  const std::string measured_device = memory_device().str();
  auto last_peak = [&] {  // the last step's peak on the training device (-1: not tracked)
    int64_t peak = -1;
    for (const auto& m : tracker_->last())
      if (m.device == measured_device) peak = m.peak_allocated;
    return peak;
  };
  auto against_estimate = [&](int64_t measured) {
    std::ostringstream o;
    const double e = static_cast<double>(estimate_.peak_device());
    o << format_bytes(measured) << " (estimate " << format_bytes(estimate_.peak_device()) << ", " << std::showpos
      << std::fixed << std::setprecision(1) << 100 * (e - static_cast<double>(measured)) / static_cast<double>(measured)
      << std::noshowpos << "%)";
    return o.str();
  };
  int64_t step1_peak = -1;
  // A resumed run appends to its logs; a fresh one starts them (the trace covers this life of the run).
  const bool resumed = !resumed_from_.empty();
  tracker_->record_trace(config_.log.trace);
  const auto trace_path =
      (fs::path(run_dir_) / (world_.world_size == 1 ? std::string("trace.json")
                                                    : "trace.rank" + std::to_string(world_.rank) + ".json")).string();
  auto write_trace = [&] {
    if (config_.log.trace) tracker_->write_trace(trace_path);
  };
  if (config_.memory.track)
    tracker_->write_jsonl((fs::path(run_dir_) / ("memory.rank" + std::to_string(world_.rank) + ".jsonl")).string(),
                          /*append=*/resumed);
  std::ofstream metrics;  // rank 0 only
  if (main) {
    metrics.open((fs::path(run_dir_) / "metrics.jsonl").string(), resumed ? std::ios::app : std::ios::trunc);
    if (resumed) metrics << nlohmann::json({{"event", "resumed"}, {"step", step_}, {"checkpoint", resumed_from_}}).dump() << "\n";
  }

  // A training-state save, with its size and speed on one line (rank 0: all ranks' files).
  auto save_and_say = [&] {
    const auto begin = std::chrono::steady_clock::now();
    const auto folder = save_checkpoint();
    tracker_->trace_span("checkpoint save", begin, std::chrono::steady_clock::now());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    if (main) {
      std::uintmax_t bytes = 0;
      std::error_code ec;
      for (const auto& e : fs::directory_iterator(folder, ec)) bytes += e.is_regular_file() ? e.file_size() : 0;
      std::cout << (bar ? "\n" : "") << "checkpoint: step " << step_ << " saved to " << folder << " ("
                << format_bytes(static_cast<int64_t>(bytes)) << " in " << std::fixed << std::setprecision(3) << s << " s)\n" << std::defaultfloat
                << std::flush;
    }
    return folder;
  };
  const double samples_per_step = static_cast<double>(t.micro_batch * t.accum_steps * world_.world_size);
  const double tokens_per_step = samples_per_step * static_cast<double>(model_->tokens_per_sample());
  auto last_time = std::chrono::steady_clock::now();
  int64_t last_step = step_;
  // Throughput over the run, from the end of the first step (which allocates the optimizer state).
  auto first_step_end = last_time;
  int64_t first_step = -1;
  double last_loss = std::numeric_limits<double>::quiet_NaN();
  const auto run_start = last_time;
  const int64_t start_step = step_;
  std::string last_metrics;  // the bar shows the last logged values beside the live step count
  while (step_ < t.steps) {
    auto r = step();
    const bool last = step_ == t.steps;
    if (!plan_candidates_.empty() && step_ == start_step + 2) {
      // The plan against the first steady step's peak (the optimizer state exists from step 1 on); several
      // ranks decide on their mean peak, so that they change together.
      double peak = static_cast<double>(last_peak());
      if (dp_) {
        auto p = torch::tensor({peak}, torch::TensorOptions().dtype(torch::kDouble).device(device_));
        dp_->group_all_reduce_sum(p);
        peak = p.item<double>() / world_.world_size;
      }
      correct_plan(static_cast<int64_t>(peak));
    }
    if (step1_peak < 0 && config_.memory.track) {
      step1_peak = last_peak();
      if (main && config_.memory.estimate && step1_peak >= 0)
        std::cout << (bar ? "\n" : "") << "memory: step " << step_ << " peak " << measured_device << " "
                  << against_estimate(step1_peak) << "\n" << std::flush;
    }
    // Elapsed time in this loop and the time left at its mean pace so far (evaluations and saves
    // included); no host read of the device here.
    const auto now_step = std::chrono::steady_clock::now();
    const double elapsed = std::chrono::duration<double>(now_step - run_start).count();
    std::string eta = "?";
    if (step_ - start_step >= 2) {
      const double per_step = elapsed / static_cast<double>(step_ - start_step);
      eta = duration_text(per_step * static_cast<double>(t.steps - step_));
    }
    const std::string timing = "elapsed " + duration_text(elapsed) + " | ETA " + eta;
    auto draw_bar = [&] {
      const int width = 20, filled = static_cast<int>(width * step_ / t.steps);
      std::cout << "\r[" << std::string(filled, '#') << std::string(width - filled, '.') << "] step " << step_ << "/"
                << t.steps << " | " << timing << last_metrics << "\033[K" << std::flush;
    };
    if (step_ % config_.log.every == 0 || last || step_ == 1) {
      // Host reads happen here only, every log.every steps.
      if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
      auto now = std::chrono::steady_clock::now();
      const double ms = std::chrono::duration<double, std::milli>(now - last_time).count() /
                        static_cast<double>(step_ - last_step);
      last_time = now, last_step = step_;
      if (dp_) {  // the mean over ranks: each rank's loss is the mean over its own samples
        auto l = r.loss.to(torch::kDouble);
        dp_->group_all_reduce_sum(l);
        r.loss = l / static_cast<double>(world_.world_size);
      }
      last_loss = r.loss.item<double>();
      const double norm = r.grad_norm.item<double>();
      const auto& mem = tracker_->last();
      if (first_step < 0) first_step = step_, first_step_end = now;
      nlohmann::json j = {{"step", step_}, {"loss", last_loss}, {"lr", r.lr}, {"grad_norm", norm}, {"ms_per_step", ms},
                          {"samples_per_s", samples_per_step * 1000 / ms}};
      if (model_->tokens_per_sample() > 1) j["tokens_per_s"] = tokens_per_step * 1000 / ms;
      // Achieved FLOP/s (all ranks), and MFU as a fraction of their peak. 0: the model's FLOPs are unknown.
      const double flops = samples_per_step * model_->train_flops_per_sample() * 1000 / ms;
      const double mfu = peak.first > 0 ? flops / (peak.first * world_.world_size) : 0;
      if (flops > 0) j["flops_per_s"] = flops;
      if (mfu > 0) j["mfu"] = mfu;
      if (scaler_) j["loss_scale"] = scaler_->current_scale(), j["skipped"] = !r.applied;
      if (r.nonfinite) j["skipped_nonfinite"] = true;
      if (dp_) j["comm_bytes"] = r.comm_bytes;  // this rank's, in the last step's collectives
      if (dp_ && dp_->stage() == 3) j["gathered_peak_bytes"] = r.gathered_peak_bytes;  // full parameters held at once
      for (const auto& m : mem) j["peak_" + m.device] = m.peak_allocated;
      metrics << j.dump() << "\n" << std::flush;
      if (main) {
        std::ostringstream line;
        line << " | loss " << std::fixed << std::setprecision(4) << last_loss << " | lr " << std::scientific << std::setprecision(2) << r.lr << " | grad norm (pre-clip) "
             << std::fixed << std::setprecision(3) << norm << " | " << std::setprecision(1) << ms << " ms/step | "
             << si(model_->tokens_per_sample() > 1 ? tokens_per_step * 1000 / ms : samples_per_step * 1000 / ms)
             << (model_->tokens_per_sample() > 1 ? " tok/s" : " samples/s");
        if (mfu > 0) line << " | MFU " << std::setprecision(1) << 100 * mfu << "%";
        for (const auto& m : mem)
          line << " | peak " << m.device << " " << format_bytes(m.peak_allocated) << " (" << phase_name(m.peak_phase)
               << ")";
        if (scaler_) line << " | scale " << scaler_->current_scale() << (r.applied ? "" : " SKIPPED (inf/NaN)");
        last_metrics = line.str();
        if (!bar)
          std::cout << "step " << std::setw(5) << step_ << "/" << t.steps << last_metrics << " | " << timing << "\n"
                    << std::flush;
      }
    }
    if (bar && main) draw_bar();  // every step on a terminal
    if (t.eval_every > 0 && step_ % t.eval_every == 0 && !last) {
      const auto eval_begin = std::chrono::steady_clock::now();
      auto e = evaluate(data_->val_batches(t.micro_batch, t.eval_batches));
      tracker_->trace_span("evaluation", eval_begin, std::chrono::steady_clock::now());
      nlohmann::json j = {{"step", step_}, {"val_loss", e.loss}};
      if (e.peak_bytes >= 0) j["eval_peak_bytes"] = e.peak_bytes, j["eval_activation_peak"] = e.activation_peak;
      metrics << j.dump() << "\n" << std::flush;
      if (main) std::cout << (bar ? "\n" : "") << "eval step " << step_ << ": val loss " << std::fixed
                          << std::setprecision(4) << e.loss << "\n" << std::flush;
    }
    // The last step's save is the final one (below) unless save_final is off.
    if (config_.checkpoint.every > 0 && step_ % config_.checkpoint.every == 0 &&
        (step_ < t.steps || !config_.checkpoint.save_final))
      save_and_say();
    if (stop_requested()) {  // every rank: a collective
      const auto where = last_saved_step_ == step_ ? checkpoint_folder(ckpt_dir_, step_) : save_and_say();
      stopped_by_signal_ = true;
      write_trace();
      if (main) {
        const int sig = detail::StopSignals::received();
        std::cout << (bar ? "\n" : "") << "memtrain: stopped by " << (sig ? strsignal(sig) : "a signal to another rank")
                  << " after step " << step_ << " of " << t.steps << "; checkpoint saved to " << where
                  << "; continue with --checkpoint.resume=auto\n" << std::flush;
      }
      return;
    }
  }
  if (bar && main) std::cout << "\n";
  // The final training state first: a failure in the evaluations below loses nothing.
  if (config_.checkpoint.save_final && last_saved_step_ != step_) save_and_say();

  nlohmann::json summary = {{"steps", step_}, {"final_train_loss", last_loss}, {"world_size", world_.world_size}};
  if (first_step >= 0 && step_ > first_step) {  // throughput after the first step, all ranks together
    const double s = std::chrono::duration<double>(last_time - first_step_end).count();
    const double steps = static_cast<double>(step_ - first_step);
    summary["samples_per_s"] = samples_per_step * steps / s;
    if (model_->tokens_per_sample() > 1) summary["tokens_per_s"] = tokens_per_step * steps / s;
    if (model_->train_flops_per_sample() > 0) {
      const double flops = samples_per_step * model_->train_flops_per_sample() * steps / s;
      summary["flops_per_s"] = flops;
      if (peak.first > 0) summary["mfu"] = flops / (peak.first * world_.world_size);
    }
  }
  write_memory_snapshot();  // the training steps' history, before evaluation adds to it
  const auto eval_begin = std::chrono::steady_clock::now();
  auto val = evaluate(data_->val_batches(t.micro_batch, t.eval_batches));
  tracker_->trace_span("evaluation", eval_begin, std::chrono::steady_clock::now());
  write_trace();
  summary["val_loss"] = val.loss;
  if (val.peak_bytes >= 0) summary["eval_peak_bytes"] = val.peak_bytes, summary["eval_activation_peak"] = val.activation_peak;
  auto test_batches = data_->test_batches(256);
  // Whether there is a test split is the dataset's, not this rank's share of it: with more ranks than
  // test batches some shares are empty, and every rank must still join evaluate()'s collectives.
  bool has_test = !test_batches.empty();
  if (dp_) {
    auto any = torch::tensor({has_test ? 1.0 : 0.0}, torch::TensorOptions().dtype(torch::kDouble).device(device_));
    dp_->group_all_reduce_sum(any);
    has_test = any.item<double>() > 0;
  }
  std::ostringstream out;
  out << "final: val loss " << std::fixed << std::setprecision(4) << val.loss;
  if (val.accuracy >= 0) out << ", val accuracy " << std::setprecision(2) << 100 * val.accuracy << "%";
  if (has_test) {
    auto test = evaluate(test_batches);
    summary["test_loss"] = test.loss, summary["test_accuracy"] = test.accuracy;
    out << ", test accuracy " << std::setprecision(2) << 100 * test.accuracy << "% on " << test.samples << " images";
  }
  const auto memory = config_.memory.track ? gather_memory_summaries() : std::vector<MemoryTracker::Summary>{};
  int64_t measured_peak = -1;  // the training device's, over steps and ranks
  for (const auto& m : memory) {
    summary["peak_allocated_bytes"]["rank" + std::to_string(m.rank) + "/" + m.device] = m.max_peak;
    if (m.device == measured_device) measured_peak = std::max(measured_peak, m.max_peak);
  }
  if (config_.memory.track && config_.memory.estimate && measured_peak > 0) {
    auto e = nlohmann::json::parse(estimate_.to_json());
    e["measured_peak"] = measured_peak;
    e["measured_first_step_peak"] = step1_peak;
    e["error"] = (static_cast<double>(estimate_.peak_device()) - static_cast<double>(measured_peak)) /
                 static_cast<double>(measured_peak);
    summary["memory_estimate"] = e;
  }
  // Stage 3: every rank takes part in gathering the weights, unit by unit, for rank 0 to write.
  const auto weights_path = (fs::path(ckpt_dir_) / "model.safetensors").string();
  if (config_.checkpoint.save_final && dp_ && dp_->stage() == 3) save_weights(weights_path);
  if (main) {
    std::cout << out.str() << "\n";
    if (config_.memory.track) std::cout << MemoryTracker::format_summary_table(memory);
    if (config_.memory.track) {
      const auto allocator = tracker_->allocator_summaries();
      std::cout << MemoryTracker::format_allocator_summary(allocator, world_.rank);
      for (const auto& a : allocator) {
        auto& j = summary["memory_summary"][a.device];
        j = {{"allocated", a.allocated}, {"peak_allocated", a.peak_allocated}, {"reserved", a.reserved},
             {"peak_reserved", a.peak_reserved}, {"fragmentation", a.reserved - a.allocated},
             {"allocations", a.allocations}};
        if (a.active >= 0) j["active"] = a.active, j["peak_active"] = a.peak_active, j["alloc_retries"] = a.alloc_retries,
                           j["ooms"] = a.ooms;
      }
    }
    if (config_.memory.track && config_.memory.estimate && measured_peak > 0)
      std::cout << "memory: peak " << measured_device << " over the run " << against_estimate(measured_peak) << "\n";
    if (config_.checkpoint.save_final) {
      if (!dp_ || dp_->stage() != 3) save_weights(weights_path);
      std::cout << "saved weights to " << weights_path << " and the training state to " << checkpoint_folder(ckpt_dir_, step_)
                << "\n";
    }
    write_file_atomically((fs::path(run_dir_) / "summary.json").string(), summary.dump(2) + "\n");
  }
}

std::vector<MemoryTracker::Summary> Trainer::gather_memory_summaries() {
  auto mine = tracker_->summaries();
  if (!dp_) return mine;
  // Fixed-size rows of int64 (at most two devices per rank: cpu and its GPU), all-gathered.
  constexpr int64_t kRows = 2, kFields = 12;
  auto local = torch::zeros({kRows, kFields}, torch::kLong);
  for (size_t i = 0; i < mine.size() && i < static_cast<size_t>(kRows); ++i) {
    const auto& m = mine[i];
    const auto dev = c10::Device(m.device);
    const int64_t row[kFields] = {1, dev.is_cuda(), dev.has_index() ? dev.index() : 0, m.steps, m.max_peak,
                                  m.max_reserved, m.first_activation, m.steady_activation, static_cast<int64_t>(m.max_phase),
                                  m.resident.params, m.resident.grads, m.resident.optimizer_state};
    for (int64_t f = 0; f < kFields; ++f) local[static_cast<int64_t>(i)][f] = row[f];
  }
  const auto n = world_.world_size;
  auto input = local.flatten().to(device_);
  auto all = torch::empty({n * kRows * kFields}, input.options());
  dp_->group_all_gather(all, input);
  auto host = all.cpu().view({n, kRows, kFields});
  std::vector<MemoryTracker::Summary> rows;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < kRows; ++i) {
      auto v = host[r][i];
      if (v[0].item<int64_t>() == 0) continue;
      MemoryTracker::Summary m;
      m.rank = static_cast<int>(r);
      m.device = v[1].item<int64_t>() ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(v[2].item<int64_t>())).str()
                                      : std::string("cpu");
      m.steps = v[3].item<int64_t>(), m.max_peak = v[4].item<int64_t>(), m.max_reserved = v[5].item<int64_t>();
      m.first_activation = v[6].item<int64_t>(), m.steady_activation = v[7].item<int64_t>();
      m.max_phase = static_cast<Phase>(v[8].item<int64_t>());
      m.resident.params = v[9].item<int64_t>(), m.resident.grads = v[10].item<int64_t>();
      m.resident.optimizer_state = v[11].item<int64_t>();
      m.resident.data = m.device == "cpu" ? data_->resident_bytes() : 0;  // every rank holds the same dataset
      rows.push_back(m);
    }
  }
  return rows;
}

}  // namespace memtrain
