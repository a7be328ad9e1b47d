// Trainer::setup(): the parts of a run built in order from the config, one numbered builder each. Where
// sharding is decided: step 5 (sharded(), after memory.budget_mib's plan, which rank 0 decides for every
// rank) and step 8 (DataParallel).
#include <c10/cuda/CUDAFunctions.h>
#include <torch/cuda.h>

#include <filesystem>
#include <iostream>
#include <map>
#include <set>

#include "memtrain/core/activation_model.h"
#include "memtrain/core/cpu_memory.h"
#include "memtrain/core/error.h"
#include "memtrain/runtime/device.h"
#include "memtrain/models/lora.h"
#include "memtrain/models/shapes.h"
#include "memtrain/models/tensor_parallel.h"
#include "memtrain/runtime/factories.h"
#include "memtrain/runtime/run_report.h"
#include "memtrain/runtime/trainer.h"
#include "step_flags.h"

namespace memtrain {

namespace fs = std::filesystem;

namespace {
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

// The collectives a split model runs (models/tensor_parallel.h), over this rank's tensor-parallel group.
class GroupCollectives : public TensorParallelGroup {
 public:
  explicit GroupCollectives(std::shared_ptr<ProcessGroup> group) : group_(std::move(group)) {}
  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }
  void all_reduce_sum(torch::Tensor& t) override { group_->all_reduce_sum_async(t).wait(); }
  void all_reduce_max(torch::Tensor& t) override { group_->all_reduce_max_async(t).wait(); }
  void all_gather(torch::Tensor& out, const torch::Tensor& in) override {
    auto input = in;
    group_->all_gather_async(out, input).wait();
  }
  void reduce_scatter(torch::Tensor& out, const torch::Tensor& in) override {
    auto input = in;
    group_->reduce_scatter_sum_async(out, input).wait();
  }

 private:
  std::shared_ptr<ProcessGroup> group_;
};

void Trainer::setup_tensor_parallel() {
  // dist.tensor_parallel = T: groups of T consecutive ranks split the model; the ranks with the same place in their
  // groups form the data-parallel groups (ZeRO runs over those). Every rank makes its tensor-parallel group, then its
  // data-parallel group, on the world's store.
  const auto dims = ParallelDims::of(config_.dist, world_.world_size);
  if (dims.tp == 1) return;
  const auto& d = config_.dist;
  const auto device = resolve_device(config_.train.device, world_.local_rank);
  group_ = ProcessGroup::create(world_, {.backend = d.backend, .timeout = std::chrono::seconds(d.timeout_s), .device = device});
  const int r = world_.rank, group = dims.dp_rank(r), place = dims.tp_rank(r);
  std::vector<int> tensor_ranks, data_ranks;
  for (int i = 0; i < dims.tp; ++i) tensor_ranks.push_back(group * dims.tp + i);
  for (int i = 0; i < dims.dp; ++i) data_ranks.push_back(i * dims.tp + place);
  tp_group_ = group_->subgroup(tensor_ranks, "tensor" + std::to_string(group));
  dp_group_ = group_->subgroup(data_ranks, "data" + std::to_string(place));
  tp_ = std::make_shared<TensorParallel>(
      TensorParallel{.group = std::make_shared<GroupCollectives>(tp_group_), .sequence_parallel = dims.sequence_parallel});
  if (world_.is_main())
    std::cout << "parallel:   " << dims.world << " ranks: " << dims.dp << " data-parallel x " << dims.tp
              << " tensor-parallel (groups of consecutive ranks)"
              << (dims.sequence_parallel ? ", sequence parallel between the split regions" : "") << "\n";
}

// A backward's end for the trace (trainer.cpp holds TraceBlocks only by pointer).
void end_backward_span(TraceBlocks* t) {
  if (t) t->end_backward();
}

void Trainer::setup() {
  setup_lora_and_freeze();                // 0. LoRA's adapters (and their init_from); which parameters train
  setup_device();                         // 1. device, threads, allocator settings, precision
  auto masters = setup_parameters();      // 2. trainable parameters; bf16 ones with fp32 masters
  hook_grads_to_masters(true);            //    (one process: each gradient into its master as it completes)
  setup_units();                          // 3. ZeRO-3's unit of each parameter (and the estimate's)
  setup_group();                          // 4. several ranks: the rendezvous and process group
  const bool sharded = setup_plan(masters);  // 5. memory.budget_mib's plan; whether the optimizer is sharded
  parameters_after_plan();                // 5b. built from shapes, a plan on several ranks: memory and values by its stage
  if (!sharded)
    optimizer_ = make_optimizer(optimizer_options(config_.train),
                                config_.train.param_dtype == "bf16" ? masters : model_->named_parameters());
  setup_recompute_and_head();             // 6. which blocks recompute; the fused head
  make_estimate();                        // 7. the memory estimate (before the buckets: the model is whole)
  if (sharded) setup_data_parallel();     // 8. buckets, the sharded optimizer
  setup_schedule_and_scaler();            // 9. learning-rate schedule; fp16's loss scaler
  setup_tracker();                        // 10. the memory tracker and what it counts
  setup_outputs();                        // 11. run and checkpoint folders; the memory limit
}

void Trainer::setup_device() {
  const auto& t = config_.train;
  if (t.threads > 0) at::set_num_threads(static_cast<int>(t.threads));
  device_ = resolve_device(t.device, world_.local_rank);
  configure_cuda_allocator(config_.memory, device_, world_.is_main());
  if (device_.is_cuda()) {
    c10::cuda::set_device(device_.index());  // this rank's GPU: LOCAL_RANK modulo the visible ones
    if (world_.world_size > 1)
      std::cout << "[dist] rank " << world_.rank << " (local rank " << world_.local_rank << ") trains on " << device_.str()
                << " of " << torch::cuda::device_count() << " visible\n" << std::flush;
  }
  precision_ = parse_precision(t.precision);
  check_precision_supported(precision_, device_);
  if (precision_ == Precision::kBf16 && device_.is_cpu() && world_.is_main() && !cpu_has_native_bf16())
    std::cerr << "memtrain: warning: [precision] train.precision = bf16 on a CPU without native bf16 (no AVX512-BF16 "
                 "or AMX): bf16 autocast runs emulated, about 10-20x slower than fp32\n";
  model_->to(device_);
  model_->train();
}

void Trainer::setup_lora_and_freeze() {
  const auto& l = config_.lora;
  const auto chosen = select_trainable(*model_, config_);
  if (l.quantize_base == "nf4") {
    // QLoRA: what stays frozen in the blocks' linear maps is stored in NF4. Built from shapes, the packed tensors have
    // no memory yet: the fill quantizes each weight from its values (one whole weight at a time on the host).
    for (auto& [name, f] : quantize_frozen_linears(*model_, nf4_options(l), /*quantize_values=*/!from_shapes_, &nf4_digests_))
      nf4_.emplace(name, f);
    MEMTRAIN_CHECK(!nf4_.empty(), ConfigError, "[config] lora.quantize_base = nf4: no frozen linear weight of this model is "
                   "whole blocks of ", l.quantize_block, l.double_quant ? " values in groups of 256 blocks" : " values",
                   " (nothing to quantize)");
  }
  if (from_shapes_ && !l.init_from.empty())  // lora.init_from's adapters, whole: the fill copies them (it gives every value)
    for (const auto& [name, t] : chosen.adapters) lora_loaded_[name] = t.to(torch::kCPU, torch::kFloat, false, /*copy=*/true);
  if (!world_.is_main()) return;
  if (l.rank > 0)
    std::cout << "lora:       rank " << l.rank << ", alpha " << format_shortest(l.alpha) << " on " << chosen.adapted.size()
              << " linear maps (" << l.targets << "); " << chosen.frozen << " base parameters frozen"
              << (l.init_from.empty() ? std::string() : "; adapters from " + l.init_from) << "\n";
  else if (!config_.train.freeze.empty())
    std::cout << "freeze:     " << chosen.frozen << " of " << model_->named_parameters().size() << " parameters match '"
              << config_.train.freeze << "' and do not train\n";
  if (!nf4_.empty()) {
    int64_t values = 0, packed = 0;
    for (const auto& [name, f] : nf4_) values += f.numel(), packed += f.packed_bytes();
    std::cout << "nf4:        " << nf4_.size() << " frozen linear weights (" << values << " values) stored in 4-bit "
              << "NormalFloat, block " << l.quantize_block << (l.double_quant ? ", double-quantized absmaxes" : "") << ": "
              << format_bytes(packed) << " (" << packed << " bytes; " << format_bytes(2 * values) << " in bf16); "
              << "the output head, embeddings, norms and other tensors stay as they are\n";
  }
}

torch::OrderedDict<std::string, torch::Tensor> Trainer::setup_parameters() {
  std::set<const void*> seen;
  for (const auto& item : model_->named_parameters()) {
    const auto& p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    if (p.requires_grad()) params_.push_back(p), param_names_.push_back(item.key());
    else frozen_.push_back(p), frozen_names_.push_back(item.key());
  }
  torch::OrderedDict<std::string, torch::Tensor> masters;
  if (from_shapes_) return parameters_from_shapes();
  if (config_.train.param_dtype != "bf16") return masters;
  // bf16 parameters and gradients in the model; the optimizer steps fp32 master copies, which are copied
  // back after each step (the bf16 rounding of an update never accumulates). Several ranks: DataParallel
  // keeps the masters (of this rank's part only from ZeRO stage 1). A plan for memory.budget_mib may turn
  // offload on or off in one process: the masters are made whenever one process might need them (from the
  // fp32 weights, before the bf16 cast), and dropped if not (setup_plan).
  param_dtype_ = torch::kBFloat16;
  const bool planning = parse_budget_mib(config_.memory.budget_mib) != 0;
  for (size_t i = 0; i < params_.size() && (!sharded(world_.world_size) || (planning && world_.world_size == 1)); ++i) {
    master_.push_back(params_[i].detach().to(torch::kFloat, /*non_blocking=*/false, /*copy=*/true).requires_grad_());
    masters.insert(param_names_[i], master_.back());
  }
  cast_to_bf16_keeping_batch_norm(*model_);
  return masters;
}

torch::OrderedDict<std::string, torch::Tensor> Trainer::parameters_from_shapes() {
  // Built from shapes: the parameters have their dtype and device and no memory; LoRA's adapters (real, fp32) take
  // the same state, as the fill gives every value. Under ZeRO-3 on several ranks DataParallel gives each rank memory
  // for its parts alone (filled after setup); otherwise every parameter is made whole here and filled.
  const auto dtype = config_.train.param_dtype == "bf16" ? torch::kBFloat16 : torch::kFloat;
  param_dtype_ = dtype;
  const ParameterBuild none{.shapes_only = true, .dtype = dtype, .device = device_};
  torch::NoGradGuard no_grad;
  for (auto* list : {&params_, &frozen_})
    for (auto& p : *list)
      if (p.scalar_type() != torch::kByte &&  // an NF4 weight's packed bytes (uint8) keep their dtype
          (!has_no_memory(p) || p.scalar_type() != dtype || p.device() != device_))
        p.set_data(shapes_only_tensor(p.sizes(), none));
  torch::OrderedDict<std::string, torch::Tensor> masters;
  // ZeRO-3 on several ranks: DataParallel gives memory to the parts. A plan for memory.budget_mib on several ranks
  // chooses the stage in step 5 without running the model (the time model ranks, no probe): the parameters wait
  // without memory until then (parameters_after_plan). One process probes its candidates: whole here.
  const bool planning = parse_budget_mib(config_.memory.budget_mib) != 0;
  if (fills_shards_ || (planning && world_.world_size > 1)) return masters;
  give_whole_memory();
  // fp32 masters as in setup_parameters: whenever one process might step them (a plan may still choose offload).
  if (dtype == torch::kBFloat16 && (!sharded(world_.world_size) || (planning && world_.world_size == 1)))
    for (size_t i = 0; i < params_.size(); ++i) {
      master_.push_back(torch::empty(params_[i].sizes(), torch::TensorOptions().device(device_)).requires_grad_());
      masters.insert(param_names_[i], master_.back());
    }
  fill_whole();
  return masters;
}

void Trainer::give_whole_memory() {
  for (auto* list : {&params_, &frozen_})
    for (auto& p : *list) p.set_data(torch::empty(p.sizes(), p.options()));
}

void Trainer::parameters_after_plan() {
  // Built from shapes with a plan on several ranks: its stage decides. ZeRO-3 fills each rank's parts after setup;
  // another stage gives every parameter whole memory and fills it now (DataParallel keeps the masters: none here).
  if (!from_shapes_ || world_.world_size == 1 || parse_budget_mib(config_.memory.budget_mib) == 0) return;
  fills_shards_ = dims_.gathers_parameters();
  if (fills_shards_) return;
  torch::NoGradGuard no_grad;
  give_whole_memory();
  fill_whole();
}

void Trainer::setup_units() {
  // Each parameter's block; -1 (the root, gathered for the whole step) for those outside every block and for
  // those two blocks share.
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
  for (const auto& p : frozen_) {
    auto it = unit.find(p.unsafeGetTensorImpl());
    frozen_units_.push_back(it == unit.end() ? -1 : it->second);
  }
}

void Trainer::setup_group() {
  // Before the plan: where ranks could decide differently (the planner's measurements, its budget), rank 0
  // decides and publishes through the group. One process makes its group of one (offload) in step 8.
  if (world_.world_size == 1 || group_) return;  // (tensor parallel: made before the model)
  const auto& d = config_.dist;
  group_ = ProcessGroup::create(world_, {.backend = d.backend, .timeout = std::chrono::seconds(d.timeout_s), .device = device_});
}

bool Trainer::setup_plan(torch::OrderedDict<std::string, torch::Tensor>& masters) {
  // memory.budget_mib: the settings read after this (micro-batch, recompute, head, stage, offload) are the plan's.
  // The degrees and the stage are fixed here, once: every later "is this stage 3?" reads dims_.
  if (parse_budget_mib(config_.memory.budget_mib) == 0) {
    dims_ = ParallelDims::of(config_.dist, world_.world_size);
    return dims_.sharded();
  }
  plan_to_budget();
  dims_ = ParallelDims::of(config_.dist, world_.world_size);
  if (dims_.sharded()) {  // one process, offload chosen: DataParallel keeps them
    hook_grads_to_masters(false);
    master_.clear(), masters.clear();
  }
  return dims_.sharded();
}

void Trainer::setup_recompute_and_head() {
  policy_ = RecomputePolicy::parse(config_.memory.recompute);
  policy_.offload = config_.memory.offload;
  if (policy_.mode == RecomputePolicy::Mode::kPart) {
    auto parts = model_->part_names();
    MEMTRAIN_CHECK(std::find(parts.begin(), parts.end(), policy_.part) != parts.end(), ConfigError,
                   "[config] memory.recompute = ", policy_.part, ": this model's blocks have no '", policy_.part,
                   "' part (selective checkpointing needs a transformer; use all or every:K)");
  }
  MEMTRAIN_CHECK(parse_head_rows(config_.memory.head) < 0 || model_->has_linear_head(), ConfigError,
                 "[config] memory.head = fused needs a model whose head is one linear map (gpt); this model's is not");
  head_rows_ = head_rows_of(config_.memory.head);
}

int64_t Trainer::head_rows_of(const std::string& head) const {
  const int64_t rows = parse_head_rows(head);
  // Split T: each chunk is a collective, so every rank cuts the same ones: automatic rows from the largest slice's
  // vocabulary (the split shape's, as the estimate counts them), not this rank's (an uneven split's last is shorter).
  if (rows == 0 && tp_ && tp_->size() > 1) return fused_head_chunk_rows(model_->transformer_shape()->vocab, device_.is_cuda());
  return rows;
}

// Low-bit optimizer state (adamw8bit / adamw4bit) of a tensor-parallel slice is quantized in blocks cut from the
// slice's start. Each must be a block of the whole parameter too, on every rank: T = 1 quantizes the same blocks, and a
// checkpoint keeps the codes and absmaxes at their places in the whole. Otherwise the refusal names the parameter and
// the block sizes that work. Every rank reasons over all ranks' slices: they refuse together.
std::string Trainer::lowbit_slices_refusal(const TrainOptions& t) const {
  const int64_t block = optimizer_block(t);
  const int T = tp_ ? tp_->size() : 1;
  if (block == 0 || T <= 1) return "";
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& name = param_names_[i];
    const auto split = model_->tensor_split(name);
    const int64_t whole = whole_numel(name, params_[i].sizes());
    if (!split.split() || whole < t.optimizer_min_quantized || whole % block != 0) continue;  // fp32 moments
    const int64_t runs = whole_run_granularity(split, params_[i].sizes(), T);
    if (runs % block == 0) continue;
    int64_t fits = 0;  // the largest even block that divides every run
    for (int64_t b = 2; b <= runs; b += 2)
      if (runs % b == 0) fits = b;
    return detail::concat(
        "[config] train.optimizer = ", t.optimizer, " with dist.tensor_parallel = ", T, ": ", name, " (", whole,
        " elements) has quantized moments in blocks of ", block, " values (train.optimizer_block), but its slices are cut "
        "in runs of ", runs, " values of the whole, so a slice's blocks would not be the whole parameter's; ",
        fits ? detail::concat("set train.optimizer_block to an even divisor of ", runs, " (", fits, ") or ") : std::string("set "),
        "train.optimizer_min_quantized above ", whole, " (its moments then stay fp32)");
  }
  return "";
}

void Trainer::setup_data_parallel() {
  // Flat buckets over the group (one process with offload: a group of one, made here); the optimizer steps the
  // buckets' parts this rank owns.
  const auto& d = config_.dist;
  if (!group_)
    group_ = ProcessGroup::create(world_, {.backend = d.backend, .timeout = std::chrono::seconds(d.timeout_s), .device = device_});
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (size_t i = 0; i < params_.size(); ++i) named.emplace_back(param_names_[i], params_[i]);
  auto options = data_parallel_options(config_, dims_, param_dtype_ != torch::kFloat, units_);
  // Built from shapes, the values are the same on every rank (filled from the seed or the checkpoint): nothing is
  // broadcast; under ZeRO-3 on several ranks there are none yet (fill_held fills each rank's parts).
  if (from_shapes_)
    options.contents = fills_shards_ ? DataParallelOptions::Contents::kFilledLater : DataParallelOptions::Contents::kSameOnEveryRank;
  if (options.stage == 3)  // what does not train is sharded too (gathered per unit, no gradient or state)
    for (size_t i = 0; i < frozen_.size(); ++i)
      options.frozen.emplace_back(frozen_names_[i], frozen_[i]), options.frozen_units.push_back(frozen_units_[i]);
  std::map<std::string, int64_t> numel;  // low-bit state: a rank's part is quantized as its whole parameter
  for (size_t i = 0; i < params_.size(); ++i)
    numel[param_names_[i]] = whole_numel(param_names_[i], params_[i].sizes());
  if (tp_) {  // over this rank's data-parallel group; the norm over the tensor-parallel group too
    options.model_group = tp_group_;
    for (const auto& name : param_names_)
      if (!model_->tensor_split(name).split()) options.replicated.insert(name);
    options.whole_numel = numel;
    if (const auto why = lowbit_slices_refusal(config_.train); !why.empty()) throw ConfigError(why);
  }
  dp_ = std::make_unique<DataParallel>(dp_group_ ? dp_group_ : group_, named, options);
  if (dims_.gathers_parameters()) block_hooks_ = std::make_unique<GatherBlocks>(*dp_);
  optimizer_ = make_optimizer(optimizer_options(config_.train), dp_->decay_tensors(), dp_->no_decay_tensors());
  for (const auto& seg : dp_->segments()) set_whole_numel(*optimizer_, seg.stepped, numel.at(seg.name));
  sync_buffers();  // an embedder's model may start with other statistics on each rank
}

void Trainer::setup_schedule_and_scaler() {
  schedule_ = std::make_unique<CosineSchedule>(schedule_options(config_.train));
  if (precision_ == Precision::kFp16) scaler_ = std::make_unique<GradScaler>(scaler_options(config_.train), device_);
  // train.host_reads: deferring needs an update the device can skip by itself (the fused AdamW's found_inf);
  // LibTorch's AdamW and SGD, the low-bit loop and the offloaded update decide on the host.
  const auto& reads = config_.train.host_reads;
  const bool device_skips = dynamic_cast<FusedAdamW*>(optimizer_.get()) != nullptr && !(dp_ && dp_->offload());
  MEMTRAIN_CHECK(reads != "deferred" || device_skips, ConfigError,
                 "[config] train.host_reads = deferred needs an update the device can skip by itself: train.optimizer = "
                 "adamw (the fused one) without dist.offload_optimizer; train.optimizer = ", config_.train.optimizer,
                 dp_ && dp_->offload() ? " with dist.offload_optimizer = cpu" : "", " decides on the host (use each_step or auto)");
  defer_reads_ = reads == "deferred" || (reads == "auto" && device_.is_cuda() && device_skips);
  flags_ = std::make_unique<detail::StepFlags>();
}

void Trainer::setup_tracker() {
  MemoryTrackerOptions mo;
  mo.rank = world_.rank;
  mo.devices.clear();
  if (cpu_memory::installed()) mo.devices.push_back(c10::kCPU);
  if (device_.is_cuda()) mo.devices.push_back(device_);
  MEMTRAIN_CHECK(!config_.memory.track || !mo.devices.empty(), Error,
                 "[memory] memory.track = true on CPU needs memtrain::cpu_memory::install() at the start of main()");
  if (!config_.memory.track) mo.devices.clear();
  tracker_ = std::make_unique<MemoryTracker>(mo);
  if (config_.log.trace && tp_group_)  // the split model's collectives, beside the data-parallel ones
    tp_group_->set_observer([tracker = tracker_.get()](const std::string& what, int64_t bytes, MemoryTracker::Clock::time_point issued,
                                                       MemoryTracker::Clock::time_point completed) {
      tracker->trace_collective("tensor-parallel " + what, bytes, issued, completed);
    });
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
    if (!frozen_sharded()) r.params += resident_bytes(frozen_, {}, d).params;  // what does not train: bytes only
    if (d.is_cpu()) r.data = data_->resident_bytes();  // datasets live in host memory
    return r;
  });
}

void Trainer::setup_outputs() {
  run_dir_ = RunReport::run_dir(config_.log.dir, config_.log.name, config_.source);
  ckpt_dir_ = config_.checkpoint.dir.empty() ? (fs::path(run_dir_) / "checkpoints").string() : config_.checkpoint.dir;
  apply_memory_limit(config_.memory.limit_mib, config_.memory.gc_threshold, device_);
}

}  // namespace memtrain
