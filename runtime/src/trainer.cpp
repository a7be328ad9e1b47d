// The Trainer: construction, the step (attempt_step's numbered phases), out-of-memory recovery, evaluation
// on the training forward, and fit(), which reads like torchtitan's train(): resume, then per step report,
// re-plan, evaluate, save, stop. Where the rest lives (docs/ARCHITECTURE.md has the map):
//   trainer_setup.cpp     setup(): the parts in numbered steps; where sharding is decided
//   trainer_state.cpp     training-state checkpoints: save, load at any world size, resume
//   trainer_estimate.cpp  the memory estimate's probe and the budget planner
//   run_report.cpp        every output file and console line of a run
#include "memtrain/runtime/trainer.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/memory_snapshot.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <iostream>
#include <optional>
#include <sstream>

#include "memtrain/core/cpu_memory.h"
#include "memtrain/core/error.h"
#include "memtrain/core/files.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/models/hugging_face.h"
#include "memtrain/models/lora.h"
#include "memtrain/models/shapes.h"
#include "memtrain/runtime/factories.h"
#include "memtrain/runtime/fused_loss.h"
#include "memtrain/runtime/run_report.h"
#include "memtrain/runtime/step_profile.h"
#include "gradient_hooks.h"
#include "step_flags.h"
#include "stop_signals.h"

namespace memtrain {

namespace fs = std::filesystem;

void end_backward_span(TraceBlocks* t);  // trainer_setup.cpp

namespace {
std::vector<torch::Tensor> all_buffers(torch::nn::Module& module) {
  // Every buffer, integer ones too: a probe's forward in training mode also counts BatchNorm's num_batches_tracked.
  auto out = module.buffers();
  out.erase(std::remove_if(out.begin(), out.end(), [](const torch::Tensor& b) { return !b.defined(); }), out.end());
  return out;
}
}  // namespace

void ModelBuffers::save(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  const auto buffers = all_buffers(module);
  if (saved_.size() != buffers.size()) {
    saved_.clear();
    for (const auto& b : buffers) saved_.push_back(torch::empty_like(b));
  }
  if (!buffers.empty()) torch::_foreach_copy_(saved_, buffers);
}

void ModelBuffers::restore(torch::nn::Module& module) {
  if (saved_.empty()) return;
  torch::NoGradGuard no_grad;
  auto buffers = all_buffers(module);
  torch::_foreach_copy_(buffers, saved_);
}

// Every parameter's initial values, a slice at a time, in fp32 on the CPU: model.init_from's tensors (read at their
// offset), lora.init_from's adapters, or the family's table drawn from the counter-based stream of (train.seed,
// the parameter's name), whose every slice equals the same slice of the whole (models/shapes.h).
class InitialValues {
 public:
  InitialValues(const Config& config, Model& model, const std::map<std::string, torch::Tensor>& adapters)
      : config_(config), model_(model), adapters_(adapters), init_(model_family(config.model.name).init) {
    for (const auto& item : model.named_parameters()) shapes_[item.key()] = item.value().sizes().vec();
    if (!config.model.init_from.empty()) weights_ = std::make_unique<HuggingFaceWeights>(model, config.model.init_from);
  }
  torch::Tensor operator()(const std::string& name, int64_t begin, int64_t end) {
    auto out = torch::empty({end - begin});  // (end - begin,) fp32
    into(out, name, begin);
    return out;
  }
  // The same into `out` (fp32, contiguous, on the CPU): elements [begin, begin + out.numel()). A tensor-parallel slice's
  // elements are those of the whole parameter at the slice's place in it, so that a split model starts as the whole.
  void into(const torch::Tensor& out, const std::string& name, int64_t begin) {
    const auto split = model_.tensor_split(name);
    if (!split.split()) return into_whole(out, name, begin);
    const auto* tp = model_.tensor_parallel();
    const auto flat = out.view({-1});
    for_each_whole_run(split, shapes_.at(name), tp->rank(), tp->size(), begin, begin + out.numel(),
                       [&](int64_t local, int64_t whole, int64_t n) { into_whole(flat.slice(0, local - begin, local - begin + n), name, whole); });
  }
  // The whole parameter's `numel` values (fp32, on the CPU), whatever slice of it this rank holds.
  torch::Tensor whole(const std::string& name, int64_t numel) {
    auto out = torch::empty({numel});
    into_whole(out, name, 0);
    return out;
  }
  HuggingFaceWeights* weights() { return weights_.get(); }
  int64_t drawn() const { return drawn_; }  // random values drawn so far

 private:
  void into_whole(const torch::Tensor& out, const std::string& name, int64_t begin) {
    const int64_t end = begin + out.numel();
    if (weights_ && !is_lora_parameter(name)) {
      out.copy_(weights_->read(name, begin, end).reshape({-1}));
      return;
    }
    if (auto it = adapters_.find(name); it != adapters_.end()) {
      out.copy_(it->second.reshape({-1}).slice(0, begin, end));
      return;
    }
    InitSpec spec;
    if (name.ends_with("lora_A")) {  // peft: nn.Linear's default, U(-1/sqrt(in), 1/sqrt(in)); `in` of the whole map
      const auto split = model_.tensor_split(name);
      const auto& local = shapes_.at(name);
      const int64_t in = split.split() ? whole_sizes(split, local).at(1) : local.at(1);
      const double bound = 1.0 / std::sqrt(static_cast<double>(in));
      spec = InitSpec::uniform(-bound, bound);
    } else if (!name.ends_with("lora_B")) {  // lora_B: zero
      spec = init_(config_.model, name);
    }
    fill_initial(out, spec, static_cast<uint64_t>(config_.train.seed), name, begin);
    if (spec.kind == InitSpec::Kind::kNormal || spec.kind == InitSpec::Kind::kUniform) drawn_ += end - begin;
  }

  const Config& config_;
  const Model& model_;
  const std::map<std::string, torch::Tensor>& adapters_;
  std::function<InitSpec(const ModelConfig&, const std::string&)> init_;
  std::map<std::string, std::vector<int64_t>> shapes_;
  std::unique_ptr<HuggingFaceWeights> weights_;
  int64_t drawn_ = 0;
};

Trainer::Trainer(const Config& config, const World& world) : config_(config), world_(world) {
  const auto begin = std::chrono::steady_clock::now();
  cpu_memory::reset_peak();  // the setup's host peak: from here to the end of setup, the data included
  const int64_t resident_at_start = cpu_memory::resident_bytes();
  const auto run_device = resolve_device(config_.train.device, world_.local_rank);
  if (run_device.is_cuda()) reset_peak(run_device);  // and the device's: the setup's own
  // Tensor parallel: the ranks of one group train on the same samples; the data is split over the data-parallel ranks.
  const auto dims = ParallelDims::of(config_.dist, world_.world_size);
  data_ = make_dataset(config_, {dims.dp_rank(world_.rank), dims.dp});
  check_fits_before_building();  // nothing of the model allocated yet
  torch::manual_seed(static_cast<uint64_t>(config_.train.seed));  // what the table does not cover depends on the seed alone
  // A family with a table of initial values (GPT, Llama, Phi-3) is built from shapes, in train.param_dtype on the
  // run's device: setup gives memory to what this rank holds (under ZeRO-3 on several ranks, its parts only) and
  // fills it, never the whole model. Others (ResNet, MLP) are built whole, initialised by their modules.
  from_shapes_ = model_family(config_.model.name).init != nullptr;
  // With memory.budget_mib on several ranks the stage is the plan's: decided in setup step 5 (setup_plan).
  fills_shards_ = from_shapes_ && ParallelDims::of(config_.dist, world_.world_size).gathers_parameters() &&
                  world_.world_size > 1 && parse_budget_mib(config_.memory.budget_mib) == 0;
  ParameterBuild how;
  if (from_shapes_)
    how = {.shapes_only = true,
           .dtype = config_.train.param_dtype == "bf16" ? torch::kBFloat16 : torch::kFloat,
           .device = run_device};
  setup_tensor_parallel();  // dist.tensor_parallel: the groups, before the model that is split over one
  how.tp = tp_;
  model_ = make_model(config_.model, data_->info(), how);
  setup();
  // The masters (bf16 parameters: fp32, from the fp32 values) and, under ZeRO-3, the parts: this rank's segments.
  if (from_shapes_ && dp_ && (fills_shards_ || param_dtype_ != torch::kFloat)) fill_held();
  setup_host_peak_ = std::max(setup_host_peak_, cpu_memory::peak());
  cpu_memory::return_freed_memory();  // setup's transients: not resident for the whole run
  const int64_t device_peak = run_device.is_cuda() ? read_counters(run_device).peak_allocated : 0;
  const int64_t grown = std::max<int64_t>(0, cpu_memory::resident_high_water() - resident_at_start);
  if (from_shapes_)
    std::cout << "setup:      rank " << world_.rank << " in "
              << std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count() << " s; host peak "
              << format_bytes(setup_host_peak_) << " counted (" << setup_host_peak_ << " bytes), resident high-water +"
              << format_bytes(grown) << " over the start (" << grown << " bytes); " << random_drawn_
              << " random values drawn"
              << (run_device.is_cuda() ? detail::concat("; ", run_device.str(), " peak ", format_bytes(device_peak), " (",
                                                        device_peak, " bytes)")
                                       : std::string())
              << "\n" << std::flush;
}

void Trainer::fill_whole() {
  // Setup step 2, everything but ZeRO-3 on several ranks: every parameter whole on this rank, in its dtype on the
  // device; the fp32 masters from the fp32 values (the parameters are rounded once, from the same values).
  const auto begin = std::chrono::steady_clock::now();
  InitialValues values(config_, *model_, lora_loaded_);
  torch::NoGradGuard no_grad;
  auto fill = [&](const torch::Tensor& p, const std::string& name, const torch::Tensor* master) {
    // Straight into the fp32 tensor where it is on the CPU (no copy of the values), else through one on the host.
    const auto& first = master ? *master : p;
    const bool direct = first.is_cpu() && first.scalar_type() == torch::kFloat && first.is_contiguous();
    const auto v = direct ? first : values(name, 0, p.numel()).view(p.sizes());
    if (direct) values.into(first.view({-1}), name, 0);
    if (master && !direct) master->copy_(v);
    if (master || !direct) p.copy_(v);
  };
  for (size_t i = 0; i < params_.size(); ++i) fill(params_[i], param_names_[i], master_.empty() ? nullptr : &master_[i]);
  for (size_t i = 0; i < frozen_.size(); ++i) {
    if (nf4_.count(frozen_names_[i]))
      frozen_[i].copy_(nf4_pack(nf4_values(values, frozen_names_[i], frozen_[i].device()), nf4_.at(frozen_names_[i])));
    else fill(frozen_[i], frozen_names_[i], nullptr);
  }
  random_drawn_ += values.drawn();
  if (values.weights() && world_.is_main())
    std::cout << "init_from:  " << config_.model.init_from << ": " << values.weights()->parameters().size() << " tensors, "
              << format_bytes(values.weights()->bytes_read()) << " from " << values.weights()->files()
              << (values.weights()->files() == 1 ? " file" : " files") << " in "
              << std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count() << " s\n";
}

void Trainer::fill_held() {
  // After setup: each segment this rank steps is its part of one parameter, elements [begin, end) of it, filled
  // into the stepped tensor (the fp32 master with bf16 parameters); the parameters' parts follow from those, as
  // after loading a checkpoint. Under ZeRO-3 the frozen parts too. With model.init_from, those elements are read
  // at their offset in the file: a rank reads its share.
  const auto begin = std::chrono::steady_clock::now();
  const int64_t resident = cpu_memory::current();
  const int64_t peak_before = cpu_memory::peak();
  cpu_memory::reset_peak();
  InitialValues values(config_, *model_, lora_loaded_);
  {
    torch::NoGradGuard no_grad;
    for (const auto& seg : dp_->segments()) {
      if (seg.stepped.is_cpu() && seg.stepped.scalar_type() == torch::kFloat && seg.stepped.is_contiguous())
        values.into(seg.stepped, seg.name, seg.begin);  // straight into this rank's part
      else
        seg.stepped.copy_(values(seg.name, seg.begin, seg.end));
    }
    dp_->parameters_from_stepped();
    if (fills_shards_) {
      // An NF4 weight's part is bytes [begin, end) of its packed tensor: the weight's bf16 values are read whole (one
      // weight at a time: every absmax enters the mean of the double quantization), and only the codes of this part
      // are quantized. Every rank records the digest of each weight it holds a part of; the maximum over ranks gives
      // every rank all of them (the manifest's record of the base).
      for (const auto& seg : dp_->frozen_segments()) {
        if (!nf4_.count(seg.name)) {
          seg.stepped.copy_(values(seg.name, seg.begin, seg.end));
          continue;
        }
        seg.stepped.copy_(nf4_pack_range(nf4_values(values, seg.name, seg.stepped.device()), nf4_.at(seg.name), seg.begin, seg.end));
      }
      if (!nf4_.empty()) {
        std::vector<int64_t> known;
        for (const auto& [name, f] : nf4_) {
          auto it = nf4_digests_.find(name);
          known.push_back(it == nf4_digests_.end() ? 0 : static_cast<int64_t>(it->second));
        }
        auto all = torch::tensor(known, torch::TensorOptions().dtype(torch::kLong).device(device_));
        dp_->group_all_reduce_max(all);
        all = all.to(torch::kCPU);
        size_t k = 0;
        for (const auto& [name, f] : nf4_) nf4_digests_[name] = static_cast<uint64_t>(all[static_cast<int64_t>(k++)].item<int64_t>());
      }
    }
  }
  random_drawn_ += values.drawn();
  const int64_t added = cpu_memory::peak() - resident;
  setup_host_peak_ = std::max({setup_host_peak_, peak_before, cpu_memory::peak()});
  if (auto* weights = values.weights(); weights && fills_shards_)
    std::cout << "init_from:  " << config_.model.init_from << ": rank " << world_.rank << " read "
              << format_bytes(weights->bytes_read()) << " of " << format_bytes(weights->total_bytes())
              << " (its shard), host +" << format_bytes(added) << " at most during the load (" << added << " bytes; read "
              << weights->bytes_read() << " of " << weights->total_bytes() << "), in "
              << std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count() << " s\n" << std::flush;
}

torch::Tensor Trainer::nf4_values(InitialValues& values, const std::string& name, const c10::Device& device) {
  const auto& f = nf4_.at(name);
  // fp32 values on the host -> the format's dtype (bf16) on the device, which torchao's to_nf4 quantizes; their digest.
  // A tensor-parallel slice: its whole weight's values (quantized whole, as one process does; the digest is the same).
  const auto shape = f.whole_shape();
  auto v = (f.is_slice() ? values.whole(name, c10::multiply_integers(shape)) : values(name, 0, f.numel())).view(shape).to(device, f.dtype);
  nf4_digests_[name] = nf4_digest(v);
  return v;
}

std::string Trainer::nf4_record() const {
  if (nf4_.empty()) return "";
  const auto& l = config_.lora;
  return nf4_base_record(nf4_digests_, l.quantize_block, l.double_quant, nf4_source(config_));
}

Trainer::Trainer(const Config& config, std::shared_ptr<Model> model, std::shared_ptr<Dataset> data, const World& world)
    : config_(config), world_(world), model_(std::move(model)), data_(std::move(data)) {
  MEMTRAIN_CHECK(model_ && data_, Error, "[trainer] a model and a dataset are required");
  MEMTRAIN_CHECK(config_.dist.tensor_parallel == 1, ConfigError, "[config] dist.tensor_parallel = ",
                 config_.dist.tensor_parallel, " needs a model memtrain builds from the config (gpt, llama): an embedder's "
                 "own model is not split");
  setup();
}

torch::Tensor Trainer::forward_loss(const Batch& batch, torch::Tensor* logits) {
  // Training and evaluation run this one forward. The loss is taken under autocast, where cross-entropy
  // runs in fp32 (no-grad in evaluation: nothing is recomputed).
  AutocastGuard autocast(device_.type(), autocast_dtype(precision_));
  if (dp_) dp_->begin_forward();  // stage 3: the root unit (embeddings, head) gathered
  auto h = run_blocks(*model_, batch.input, policy_, block_hooks_.get());
  // Masked targets (chat records): the sum over trained tokens, not a mean; the caller divides by the step's (or the
  // evaluation's) trained tokens.
  const bool masked = data_ && data_->masks_targets();
  if (head_rows_ >= 0) {  // memory.head = fused: the loss chunk by chunk, the logits never whole
    auto [features, weight] = *model_->head_features(h);
    VocabSlice vocab;  // split T: this rank's vocabulary rows; the features entered into the split region (all tokens)
    if (tp_ && tp_->size() > 1) {
      features = tensor_parallel_enter(features, tp_.get());
      vocab = {.begin = model_->head_vocab_begin(), .group = tp_->group.get()};
    }
    return fused_linear_cross_entropy(features.reshape({-1, features.size(-1)}), weight, batch.target.reshape({-1}),
                                      head_rows_, masked, vocab);
  }
  auto out = model_->head(h);
  if (logits) *logits = out;
  return masked ? model_->loss_sum(out, batch.target) : model_->loss(out, batch.target);
}

void Trainer::mark_gradients() const {
  // The counting allocator takes the peak apart by marked blocks: the gradients this backward made (a
  // parameter's .grad). With DataParallel the .grad are views of its buckets, which it marks itself.
  if (dp_ || !device_.is_cpu() || !cpu_memory::installed()) return;
  for (const auto& p : params_)
    if (p.grad().defined()) cpu_memory::mark(p.grad().storage().data(), cpu_memory::Kind::kGradient);
}

void Trainer::grad_into_master(size_t i) {
  auto& g = params_[i].mutable_grad();
  if (!g.defined() || grads_stay_bf16_) return;
  torch::NoGradGuard no_grad;
  auto& m = master_[i].mutable_grad();
  if (m.defined()) {
    m.add_(g);  // fp32 += bf16, a later micro-batch (or a later inner backward of a recomputed block)
  } else {
    m = g.to(torch::kFloat);
    if (device_.is_cpu() && cpu_memory::installed()) cpu_memory::mark(m.storage().data(), cpu_memory::Kind::kGradient);
  }
  g.reset();  // the next micro-batch starts from zero
}

void Trainer::move_grads_to_masters() {
  for (size_t i = 0; i < master_.size(); ++i) grad_into_master(i);
}

bool Trainer::masters_step_by_bucket() const {
  return !master_.empty() && !dp_ && !scaler_ && config_.train.accum_steps == 1 && split_ == 1 &&
         steps_in_parts(config_.train.optimizer);
}

torch::Tensor Trainer::bf16_grad_norm(double max_norm) {
  // The per-tensor norms of the fp32 values, a bucket of casts at a time: the numbers clip_grad_norm gives on the
  // fp32 gradients (the same kernel on the same values), without a whole fp32 copy.
  torch::NoGradGuard no_grad;
  const auto cap = static_cast<int64_t>(config_.dist.bucket_mib * 1024 * 1024);
  std::vector<torch::Tensor> norms, bucket;
  int64_t bytes = 0;
  auto flush = [&] {
    if (bucket.empty()) return;
    for (auto& n : torch::_foreach_norm(bucket, 2)) norms.push_back(n);
    bucket.clear(), bytes = 0;
  };
  for (const auto& p : params_) {
    if (!p.grad().defined()) continue;
    bucket.push_back(p.grad().to(torch::kFloat));
    bytes += 4 * p.numel();
    if (bytes >= cap) flush();
  }
  flush();
  clip_coef_ = torch::Tensor();
  if (norms.empty()) return torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat).device(device_));
  auto total = torch::stack(norms).to(torch::kFloat).norm(2);
  if (max_norm > 0) clip_coef_ = torch::clamp_max(max_norm / (total + 1e-6), 1.0).to(torch::kFloat);
  return total;
}

void Trainer::step_masters_by_bucket() {
  // Bucket by bucket (dist.bucket_mib of fp32, or one tensor above it): the fp32 gradients from the bf16 ones (each
  // bf16 gradient freed once cast), clipped, stepped (PartialStepOptimizer: the same bits as one step()), the
  // parameters rounded from their masters, the fp32 gradients freed. The transient is one bucket, not the model.
  torch::NoGradGuard no_grad;
  auto& partial = dynamic_cast<PartialStepOptimizer&>(*optimizer_);
  const bool mark = device_.is_cpu() && cpu_memory::installed();
  const auto cap = static_cast<int64_t>(config_.dist.bucket_mib * 1024 * 1024);
  for (size_t i = 0; i < params_.size();) {
    std::vector<torch::Tensor> masters, grads, params;
    int64_t bytes = 0;
    for (; i < params_.size() && bytes < cap; ++i) {
      auto& g = params_[i].mutable_grad();
      if (!g.defined()) continue;
      auto& m = master_[i].mutable_grad();
      m = g.to(torch::kFloat);
      if (mark) cpu_memory::mark(m.storage().data(), cpu_memory::Kind::kGradient);
      g.reset();
      bytes += 4 * m.numel();
      masters.push_back(master_[i]), grads.push_back(m), params.push_back(params_[i]);
    }
    if (masters.empty()) continue;
    if (clip_coef_.defined()) torch::_foreach_mul_(grads, clip_coef_);
    partial.step_only(masters);
    torch::_foreach_copy_(params, masters);  // fp32 -> bf16, rounded once per step
    for (auto& m : masters) m.mutable_grad().reset();
  }
}

void Trainer::hook_grads_to_masters(bool on) {
  // A gradient is complete when its accumulator has run (gradient_hooks.h): the bf16 gradient lives from its
  // block's backward to the end of that accumulation, so at most the gradients of the block in flight are held in
  // bf16 besides the fp32 ones (the step's whole-model bf16 copy is gone; the fp32 gradients are whole, as the
  // optimizer steps them).
  master_hooks_.reset();
  if (on && !master_.empty()) master_hooks_ = std::make_unique<GradientReadyHooks>(params_, [this](size_t i) { grad_into_master(i); });
}

Batch Trainer::to_device(Batch b) const {
  b.input = b.input.to(device_, /*non_blocking=*/true);
  if (b.input.is_floating_point()) b.input = b.input.to(param_dtype_);
  b.target = b.target.to(device_, /*non_blocking=*/true);
  if (b.positions.defined()) b.positions = b.positions.to(device_, /*non_blocking=*/true);
  if (b.documents.defined()) b.documents = b.documents.to(device_, /*non_blocking=*/true);
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
  // Rank 0's plan on every rank: each measured its own blocks, and ranks that recompute different blocks would
  // issue stage 3's gathers in different orders.
  const auto blocks = plan_checkpoint_budget(profile, static_cast<int64_t>(policy_.budget_mib * 1024 * 1024));
  std::vector<int64_t> flags(blocks.begin(), blocks.end());
  flags = agreement().from_rank0(flags);
  policy_.blocks.assign(flags.begin(), flags.end());
}

Trainer::~Trainer() = default;

StepResult Trainer::step() { return run_step(/*read_flags_now=*/true); }

StepResult Trainer::run_step(bool read_flags_now) {
  read_now_ = read_flags_now || !defer_reads_;
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
  buffer_backup_.restore(*model_);
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
  if (t.oom == "retry" && !dp_) buffer_backup_.save(*model_);  // as the step found them, for a retry
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
                     static_cast<uint64_t>(dims_.dp_rank(world_.rank)) * 0x9E3779B97F4A7C15ull);
  // 1-2. Micro-batches (forward, backward; several ranks: the buckets reduced as they fill).
  const auto loss_sum = run_micro_batches();
  // Deferred reads: the last step's flags, now that this step's forward and backward are queued (on a GPU
  // they have long landed). A non-finite stop is raised here, before this step updates anything.
  if (defer_reads_) read_step_flags(nullptr);
  tracker_->before_optimizer();
  // 3-4. Unscale (fp16), clip, skip a non-finite step; the optimizer step.
  clip_and_update(r, loss_sum);
  if (dp_) {
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

torch::Tensor Trainer::run_micro_batches() {
  // 1. Micro-batches: forward under autocast, loss scaled to the mean over the step, backward. After an
  //    out-of-memory retry each micro-batch runs in split_ pieces, weighted by their share of it.
  const auto& t = config_.train;
  auto loss_sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat).device(device_));
  grads_stay_bf16_ = masters_step_by_bucket();
  // Masked targets (chat records): the step's loss is the sum over its trained tokens divided by their count over
  // every micro-batch and rank (one small all-reduce, the same on every rank whatever its data). Each piece's summed
  // loss is weighed by world / total: DataParallel averages over the ranks.
  std::vector<Batch> wholes;
  for (int64_t micro = 0; micro < t.accum_steps; ++micro) wholes.push_back(data_->train_batch(step_, micro, t.micro_batch));
  double step_tokens = 0;
  if (data_->masks_targets()) {
    for (const auto& w : wholes) step_tokens += static_cast<double>(w.target.ne(-100).sum().item<int64_t>());
    if (dp_ && world_.world_size > 1) {
      auto total = torch::tensor({step_tokens}, torch::TensorOptions().dtype(torch::kDouble).device(device_));
      dp_->group_all_reduce_sum(total);
      step_tokens = total.item<double>();
    }
    step_tokens = std::max(step_tokens, 1.0);
  }
  for (int64_t micro = 0; micro < t.accum_steps; ++micro) {
    const auto& whole = wholes[static_cast<size_t>(micro)];
    auto pieces = [&](const torch::Tensor& x) {
      return !x.defined() ? std::vector<torch::Tensor>(static_cast<size_t>(split_)) : split_ == 1 ? std::vector<torch::Tensor>{x} : x.tensor_split(split_);
    };
    const auto inputs = pieces(whole.input), targets = pieces(whole.target);
    const auto positions = pieces(whole.positions), documents = pieces(whole.documents);
    for (size_t piece = 0; piece < inputs.size(); ++piece) {
      auto batch = to_device({inputs[piece], targets[piece], positions[piece], documents[piece]});
      std::optional<PackedScope> packed;  // packed records: their layout for this forward and its backward
      if (batch.positions.defined()) packed.emplace(batch.positions, batch.documents);
      auto loss = step_tokens > 0
                      ? forward_loss(batch) * (static_cast<double>(dims_.dp) / step_tokens)
                  : split_ == 1 ? forward_loss(batch) / static_cast<double>(t.accum_steps)
                                : forward_loss(batch) * (static_cast<double>(inputs[piece].size(0)) /
                                                         static_cast<double>(whole.input.size(0) * t.accum_steps));
      tracker_->end_phase(Phase::kForward);
      // 2. Several ranks: buckets are reduced as they fill during this backward (every micro-batch, or the
      //    last only with dist.reduce = step); end_micro_batch waits for them.
      if (dp_) dp_->begin_micro_batch(/*last=*/micro + 1 == t.accum_steps && piece + 1 == inputs.size());
      (scaler_ ? scaler_->scale(loss) : loss).backward();
      if (dp_) dp_->end_micro_batch();
      end_backward_span(trace_blocks_);
      mark_gradients();         // for the tracker's breakdown of the peak (CPU)
      move_grads_to_masters();  // bf16 parameters: accumulate in fp32, not across micro-batches in bf16
      tracker_->end_phase(Phase::kBackward);
      loss_sum += loss.detach();
    }
  }
  return loss_sum;
}

void Trainer::clip_and_update(StepResult& r, const torch::Tensor& loss_sum) {
  const auto& t = config_.train;
  // 3. Unscale (fp16), clip; the norm stays on the device (fp32 master gradients when there are masters;
  //    several ranks: this rank's reduced part, and the norm is global).
  const auto stepped = dp_ ? dp_->stepped_tensors() : (master_.empty() ? params_ : master_);
  if (scaler_) {
    scaler_->unscale(stepped);
    if (dp_) dp_->all_reduce_found_inf(scaler_->found_inf(), /*host_waits=*/!defer_reads_);  // every rank skips, or none
  }
  r.grad_norm = dp_                ? dp_->clip_grad_norm(t.grad_clip, /*host_waits=*/!defer_reads_)
                 : grads_stay_bf16_ ? bf16_grad_norm(t.grad_clip)
                                    : clip_grad_norm(stepped, t.grad_clip);
  if (defer_reads_) return update_deciding_on_device(r, loss_sum);
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
    on_nonfinite_step(step_ + 1, std::string(dp_ ? "" : "loss " + std::to_string(loss_sum.item<double>()) + " or ") +
                                     "gradient norm " + std::to_string(r.grad_norm.item<double>()));
  } else if (scaler_) {
    nonfinite_run_ = 0;
    in_optimizer_ = true;
    r.applied = scaler_->step(*optimizer_, stepped);
    scaler_->update();
  } else {
    nonfinite_run_ = 0;
    in_optimizer_ = true;
    // Offload with an element-wise AdamW (fused, low-bit): the CPU update runs bucket by bucket inside
    // after_optimizer_step, each bucket's copy up and gather overlapping the next bucket's update.
    auto* partial = dp_ && dp_->offload() ? dynamic_cast<PartialStepOptimizer*>(optimizer_.get()) : nullptr;
    if (partial) {
      dp_->after_optimizer_step([partial](const std::vector<torch::Tensor>& stepped) { partial->step_only(stepped); });
      updated_in_place = true;
    } else if (grads_stay_bf16_) {
      step_masters_by_bucket();  // the parameters rounded bucket by bucket too
    } else {
      optimizer_->step();
    }
  }
  in_optimizer_ = false;
  if (r.applied && !master_.empty() && !grads_stay_bf16_) {
    torch::NoGradGuard no_grad;
    torch::_foreach_copy_(params_, master_);  // fp32 -> bf16, rounded once per step
  }
  if (dp_ && r.applied && !updated_in_place) dp_->after_optimizer_step();  // masters -> parameters, parts all-gathered
}

void Trainer::on_nonfinite_step(int64_t step, const std::string& what) {
  const auto& t = config_.train;
  ++nonfinite_run_;
  const bool stop = t.on_nonfinite == "stop" || nonfinite_run_ >= t.max_nonfinite;
  MEMTRAIN_CHECK(!stop, Error, "[train] step ", step, ": non-finite ", what, "; stopping (",
                 t.on_nonfinite == "stop" ? std::string("train.on_nonfinite = stop")
                                          : std::to_string(nonfinite_run_) + " consecutive such steps, train.max_nonfinite = " +
                                                std::to_string(t.max_nonfinite),
                 "). The parameters are those after step ", step - 1, " (step ", step, "'s update was skipped",
                 step_ + 1 > step ? "; step " + std::to_string(step_ + 1) + " was stopped before its update" : std::string(),
                 "); lower train.lr or check the data");
  if (world_.is_main())
    std::cerr << "memtrain: warning: step " << step << ": non-finite " << what << ": update skipped (" << nonfinite_run_
              << " in a row; the run stops at " << t.max_nonfinite << ")\n";
}

void Trainer::update_deciding_on_device(StepResult& r, const torch::Tensor& loss_sum) {
  // 4. train.host_reads = deferred: whether the update happens is decided on the device. The fused AdamW reads
  //    found-inf itself (fp16: the scaler's, MAX over ranks; else a non-finite gradient norm, which is global, or
  //    loss) and leaves parameters, moments and counts as they were; the copies to bf16 parameters and the
  //    gathers of stages 1-2 then move what did not change. The host learns of it a step later.
  auto found = scaler_ ? scaler_->found_inf()
                       : (dp_ ? torch::isfinite(r.grad_norm) : torch::isfinite(r.grad_norm).logical_and(torch::isfinite(loss_sum)))
                             .logical_not()
                             .to(torch::kFloat);
  auto& fused = static_cast<FusedAdamW&>(*optimizer_);  // setup checked that it is one
  fused.skip_when(found);
  in_optimizer_ = true;
  if (grads_stay_bf16_) step_masters_by_bucket();
  else optimizer_->step();
  in_optimizer_ = false;
  fused.skip_when({});
  if (scaler_) scaler_->update();
  if (!master_.empty() && !grads_stay_bf16_) {
    torch::NoGradGuard no_grad;
    torch::_foreach_copy_(params_, master_);  // fp32 -> bf16; unchanged masters give the same parameters
  }
  if (dp_) dp_->after_optimizer_step();
  const float stop = detail::StopSignals::received() != 0 ? 1.0f : 0.0f;  // this rank's, sampled at the same step on every rank
  auto flags = torch::stack({found.reshape({}), torch::full({}, stop, found.options()), r.grad_norm.to(torch::kFloat).reshape({}),
                             loss_sum.to(torch::kFloat).reshape({})});
  flags_->record(step_ + 1, flags, dp_ ? group_.get() : nullptr);
  if (read_now_) read_step_flags(&r);
}

void Trainer::read_step_flags(StepResult* r) {
  const auto v = flags_->take();
  if (!v) return;
  if (v->stop) stop_seen_ = true;
  const bool nonfinite = v->found_inf && !scaler_;
  if (r) r->applied = !v->found_inf, r->nonfinite = nonfinite;
  if (!nonfinite) {
    nonfinite_run_ = 0;  // a finite step, or fp16's scaler skipping one (which it counts itself)
    return;
  }
  on_nonfinite_step(v->step, std::string(dp_ ? "" : "loss " + std::to_string(v->loss) + " or ") + "gradient norm " +
                                 std::to_string(v->grad_norm));
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
  // Every rank issues the same collectives whatever its share of the data: ZeRO-3 gathers each block in
  // every forward, so a rank with fewer batches (uneven shares, or none) runs the gathers of the missing
  // forwards without computing them, after its own. Stages 0-2 issue none in a forward: no count to agree on.
  const bool gathering = dp_ && dims_.gathers_parameters();
  const auto own = static_cast<int64_t>(batches.size());
  const auto forwards = gathering ? static_cast<int64_t>(agreement().max(static_cast<double>(own))) : own;
  torch::NoGradGuard no_grad;
  model_->eval();
  // Evaluation's own peak on the training device (between steps: the step's peaks are reset at its start).
  const c10::Device measured = memory_device();
  const bool track = can_measure();
  const int64_t eval_start = track ? read_counters(measured).allocated : 0;
  if (track) reset_peak(measured);
  const int64_t traffic = dp_ ? dp_->traffic_mark() : 0;
  EvalResult e;
  bool classifier = false;
  // Sums stay on the device (fp64) until the end: one host read per evaluation, not one per batch.
  std::vector<torch::Tensor> losses, hits;
  const bool masked = data_->masks_targets();  // chat records: weighed by trained tokens, not samples
  for (const auto& b : batches) {
    const auto moved = to_device(b);
    std::optional<PackedScope> packed;
    if (moved.positions.defined()) packed.emplace(moved.positions, moved.documents);
    // Masked: the loss is already a sum, over n trained tokens (counted on the host copy of the targets).
    const auto n = masked ? b.target.ne(-100).sum().item<int64_t>() : moved.target.size(0);
    torch::Tensor logits;
    losses.push_back(forward_loss(moved, &logits).to(torch::kDouble) * (masked ? 1.0 : static_cast<double>(n)));
    if (logits.defined() && logits.dim() == 2) {
      classifier = true;
      hits.push_back(logits.argmax(1).eq(moved.target).sum());
    }
    e.samples += n;
  }
  double loss_sum = losses.empty() ? 0.0 : torch::stack(losses).sum().item<double>();
  double correct = hits.empty() ? 0.0 : static_cast<double>(torch::stack(hits).sum().item<int64_t>());
  for (auto i = own; i < forwards; ++i) gathers_of_a_forward();
  model_->train();
  if (track) e.peak_bytes = read_counters(measured).peak_allocated, e.activation_peak = e.peak_bytes - eval_start;
  if (dp_) dp_->release_all(), dp_->not_step_traffic(traffic);
  // Every rank evaluated its own part: sums over ranks.
  const auto sums = agreement().sum({loss_sum, correct, static_cast<double>(e.samples)});
  // Tensor parallel: the ranks of a group evaluated the same samples; each counted them once.
  loss_sum = sums[0] / dims_.tp;
  e.samples = static_cast<int64_t>(sums[2]) / dims_.tp;
  e.loss = std::numeric_limits<double>::quiet_NaN();  // no held-out data (val_fraction = 0)
  if (e.samples > 0) {
    e.loss = loss_sum / static_cast<double>(e.samples);
    if (classifier) e.accuracy = sums[1] / static_cast<double>(e.samples);
  }
  return e;
}

void Trainer::gathers_of_a_forward() {
  if (!dp_ || !dims_.gathers_parameters()) return;  // stages 0-2: a forward issues no collective
  dp_->begin_forward();
  for (int64_t i = 0; i < model_->num_blocks(); ++i) block_hooks_->before_block(i), block_hooks_->after_block(i);
}

int64_t Trainer::last_peak() const {
  const auto device = memory_device().str();
  int64_t peak = -1;
  for (const auto& m : tracker_->last())
    if (m.device == device) peak = m.peak_allocated;
  return peak;
}

void Trainer::write_memory_snapshot() {
  if (!config_.memory.snapshot || !device_.is_cuda()) return;
  const auto path = RunReport::snapshot_file(run_dir_, world_.rank);
  const auto begin = std::chrono::steady_clock::now();
  write_file_atomically(path, torch::cuda::_memory_snapshot_pickled());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  if (world_.is_main())
    std::cout << "memory snapshot: " << path << ", written in " << seconds << " s (python -m torch.cuda._memory_viz "
              << "trace_plot " << path << " -o memory_viz.html)\n";
}

StepResult Trainer::profiled_step() {
  if (device_.is_cuda()) torch::cuda::synchronize();  // the previous step's kernels are not this one's
  const auto begin = std::chrono::steady_clock::now();
  StepProfiler profiler(device_.is_cuda());
  const auto r = run_step(/*read_flags_now=*/true);
  if (device_.is_cuda()) torch::cuda::synchronize();
  const auto wall = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - begin).count();
  const auto stem = RunReport::profile_stem(run_dir_, world_.rank, world_.world_size);
  auto table = profiler.stop(stem + ".json", wall);
  table.step = step_;
  write_file_atomically(stem + ".md", table.markdown());
  if (world_.is_main()) std::cout << "profile:    step " << step_ << ", " << table.one_line() << " (" << stem << ".md)\n";
  return r;
}

void Trainer::fit() {
  const auto& t = config_.train;
  const auto& ck = config_.checkpoint;
  make_output_folders();  // an unwritable folder found after the last step would lose the run's work
  resume_or_refuse();
  if (ck.save_initial && step_ == 0) {  // stage 3: every rank takes part in gathering, rank 0 writes
    const auto path = (fs::path(ckpt_dir_) / "initial.safetensors").string();
    if ((dp_ && dims_.gathers_parameters()) || tp_ || world_.is_main()) save_weights(path);
    if (world_.is_main()) std::cout << "initial weights: " << path << "\n";
  }
  const detail::StopSignals signals;  // SIGTERM / SIGINT: save after this step and return
  stop_seen_ = false;
  RunReport report(*this);
  const int64_t first = step_;
  const auto& lg = config_.log;
  while (step_ < t.steps) {
    // Deferred reads: a step whose flags the loop needs at once (logged, evaluated, saved, the last) reads them at
    // its end; the others' are read during the next step.
    const int64_t n = step_ + 1;
    const bool read_now = n == 1 || n == t.steps || n % lg.every == 0 || (t.eval_every > 0 && n % t.eval_every == 0) ||
                          (ck.every > 0 && n % ck.every == 0);
    const auto r = n == lg.profile_step ? profiled_step() : run_step(read_now);
    // memory.budget_mib: the plan against the first steady step's peak (the optimizer state exists from the
    // first step on); several ranks decide on their mean peak, so that they change together.
    if (!plan_candidates_.empty() && step_ == first + 2) correct_plan(static_cast<int64_t>(agreement().mean(static_cast<double>(last_peak()))));
    report.step(r);
    const bool last = step_ == t.steps;
    if (t.eval_every > 0 && step_ % t.eval_every == 0 && !last) report.evaluation(validate());
    // The last step's save is the final one (finish) unless save_final is off.
    if (ck.every > 0 && step_ % ck.every == 0 && (!last || !ck.save_final)) save_reported(report);
    if (defer_reads_ ? stop_seen_ : stop_requested()) {  // every rank: a collective, or the flags read
      const auto where = last_saved_step_ == step_ ? checkpoint_folder(ckpt_dir_, step_) : save_reported(report);
      stopped_by_signal_ = true;
      report.stopped(where);
      if (group_) group_->shutdown();  // every rank: the run's last collective
      return;
    }
  }
  finish(report);
}

void Trainer::finish(RunReport& report) {
  const auto& ck = config_.checkpoint;
  report.end_of_steps();
  // The final training state first: a failure in the evaluations below loses nothing.
  if (ck.save_final && last_saved_step_ != step_) save_reported(report);
  write_memory_snapshot();  // the training steps' history, before evaluation adds to it
  const auto val = validate();
  // Whether there is a test split is the dataset's, not this rank's share of it: with more ranks than test
  // batches some shares are empty, and every rank must still join evaluate()'s collectives.
  const auto test_batches = data_->test_batches(256);
  std::optional<EvalResult> test;
  if (agreement().any(!test_batches.empty())) test = evaluate(test_batches);
  // Stage 3: every rank takes part in gathering the weights, unit by unit, for rank 0 to write.
  const auto weights = (fs::path(ckpt_dir_) / "model.safetensors").string();
  const bool stage3 = (dp_ && dims_.gathers_parameters()) || tp_;  // (or tensor parallel: the slices gathered)
  if (ck.save_final && stage3) save_weights(weights);
  report.finish(val, test);
  if (ck.save_final && !stage3 && world_.is_main()) save_weights(weights);
  report.close(ck.save_final ? weights : "");
  if (group_) group_->shutdown();  // every rank: the run's last collective, then the backend's orderly end
}

EvalResult Trainer::validate() {
  const auto begin = std::chrono::steady_clock::now();
  auto e = evaluate(data_->val_batches(config_.train.micro_batch, config_.train.eval_batches));
  tracker_->trace_span("evaluation", begin, std::chrono::steady_clock::now());
  return e;
}

std::string Trainer::save_reported(RunReport& report) {
  const auto begin = std::chrono::steady_clock::now();
  const auto folder = save_checkpoint();
  const auto end = std::chrono::steady_clock::now();
  tracker_->trace_span("checkpoint save", begin, end);
  report.checkpoint_saved(folder, std::chrono::duration<double>(end - begin).count());
  return folder;
}

void Trainer::make_output_folders() const {
  // Every folder the run will write is created and probed now.
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
  if (config_.checkpoint.save_final || config_.checkpoint.save_initial || config_.checkpoint.every > 0)
    probe(ckpt_dir_, "checkpoint.dir");
}

torch::Tensor Trainer::whole_parameter(const std::string& name, const torch::Tensor& local) {
  const auto split = model_->tensor_split(name);
  if (!tp_ || !split.split()) return local;
  // Every rank's slice, flattened and padded to the longest (an uneven vocabulary), all-gathered; then each slice's
  // runs put at their place in the whole.
  const int T = tp_->size();
  auto sizes_of = [&](int r) {
    auto sizes = local.sizes().vec();
    sizes[static_cast<size_t>(split.dim)] = split_size(split, r, T);
    return sizes;
  };
  int64_t longest = 0;
  for (int r = 0; r < T; ++r) longest = std::max(longest, c10::multiply_integers(sizes_of(r)));
  auto mine = torch::zeros({longest}, local.options());
  mine.slice(0, 0, local.numel()).copy_(local.reshape({-1}));
  auto all = torch::empty({T * longest}, local.options());
  tp_->group->all_gather(all, mine);
  auto whole = torch::empty(whole_sizes(split, local.sizes()), local.options());
  auto flat = whole.view({-1});
  for (int r = 0; r < T; ++r) {
    const auto sizes = sizes_of(r);
    for_each_whole_run(split, sizes, r, T, 0, c10::multiply_integers(sizes), [&](int64_t l, int64_t w, int64_t n) {
      flat.slice(0, w, w + n).copy_(all.slice(0, r * longest + l, r * longest + l + n));
    });
  }
  return whole;
}

int64_t Trainer::whole_numel(const std::string& name, c10::IntArrayRef local_sizes) const {
  return c10::multiply_integers(whole_sizes(model_->tensor_split(name), local_sizes));
}

torch::Tensor Trainer::local_slice(const std::string& name, const torch::Tensor& whole, c10::IntArrayRef local_sizes,
                                   int64_t begin, int64_t end, int64_t k) const {
  const auto flat = whole.reshape({-1});
  const auto split = model_->tensor_split(name);
  if (!tp_ || !split.split()) return flat.slice(0, begin / k, end / k);
  return slice_of_whole(split, local_sizes, tp_->rank(), tp_->size(), flat, begin, end, k);
}

void Trainer::save_weights(const std::string& path) {
  // Stage 3: full copies by the trainer's parameter names; a tied parameter's other names find its copy
  // by TensorImpl.
  // Tensor parallel: the first data-parallel rank of each tensor-parallel rank keeps its slices, which its group gathers.
  const bool keeps = tp_ ? dp_rank() == 0 : world_.is_main();
  auto full = dp_ ? dp_->full_parameters(keeps) : std::map<std::string, torch::Tensor>{};
  if (!keeps && dp_ && (dims_.gathers_parameters() || tp_)) return;
  std::map<const void*, torch::Tensor> by_impl;
  for (size_t i = 0; i < params_.size(); ++i)
    if (auto it = full.find(param_names_[i]); it != full.end()) by_impl[params_[i].unsafeGetTensorImpl()] = it->second;
  for (size_t i = 0; i < frozen_.size(); ++i)
    if (auto it = full.find(frozen_names_[i]); it != full.end()) by_impl[frozen_[i].unsafeGetTensorImpl()] = it->second;
  std::map<std::string, torch::Tensor> tensors;
  std::set<const void*> seen;
  for (const auto& item : model_->named_parameters()) {
    auto it = by_impl.find(item.value().unsafeGetTensorImpl());
    const auto& value = it != by_impl.end() ? it->second : item.value();
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;  // a tied weight: whole once, below
    if (tp_ && nf4_.count(item.key())) continue;  // a split NF4 base: init_from's (memtrain export --merged remakes it)
    tensors.emplace(item.key(), tp_ ? whole_parameter(item.key(), value) : value);
  }
  for (const auto& item : model_->named_parameters())  // tied names: the same whole tensor
    if (!tensors.count(item.key()))
      for (const auto& other : model_->named_parameters())
        if (other.value().unsafeGetTensorImpl() == item.value().unsafeGetTensorImpl() && tensors.count(other.key())) {
          tensors.emplace(item.key(), tensors.at(other.key()));
          break;
        }
  if (!world_.is_main()) return;  // tensor parallel: the others gave their slices
  for (const auto& item : model_->named_buffers()) tensors.emplace(item.key(), item.value());
  save_safetensors(path, tensors, {{"format", "memtrain-weights"}, {"version", "1"}, {"step", std::to_string(step_)}});
}

}  // namespace memtrain
