// The Trainer's memory estimate: the probe (one forward + backward at two small micro-batches, measured
// by the same counters the tracker reads) and the inputs of estimate_memory() from this run's parts.
#include <cuda_runtime_api.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <numeric>
#include <iostream>
#include <optional>
#include <sstream>

#include "memtrain/core/cpu_memory.h"
#include "memtrain/core/error.h"
#include "memtrain/runtime/factories.h"
#include "memtrain/runtime/device.h"
#include "memtrain/runtime/step_time.h"
#include "memtrain/runtime/target_estimate.h"
#include "memtrain/runtime/trainer.h"
#include "gradient_hooks.h"

namespace memtrain {

namespace {

// For its lifetime every parameter's gradient is freed as soon as autograd has accumulated it: the
// probe then measures activations and temporaries only (several ranks keep gradients in buckets).
class DropGradients {
 public:
  explicit DropGradients(std::vector<torch::Tensor> params)
      : params_(std::move(params)), hooks_(params_, [this](size_t i) { params_[i].mutable_grad().reset(); }) {}

 private:
  std::vector<torch::Tensor> params_;
  GradientReadyHooks hooks_;
};

// Two points on the line bytes(m): half and a quarter of the configured micro-batch (1 and the batch when it
// is 2 or 3; one point when it is 1).
std::pair<int64_t, int64_t> probe_points(int64_t micro_batch) {
  int64_t m1 = std::max<int64_t>(1, micro_batch / 2), m0 = std::max<int64_t>(1, m1 / 2);
  if (m0 == m1 && micro_batch > 1) m1 = micro_batch;  // 2 or 3: probe 1 and the batch itself
  return {m0, m1};
}

// Time can only grow with the batch, and never starts below zero: noise that says otherwise is clamped.
void clamp_probe_times(ActivationProbe& p) {
  const auto m0 = p.micro_batch[0], m1 = p.micro_batch[1];
  if (m1 <= m0) return;
  p.ms[1] = std::max(p.ms[1], p.ms[0]);
  const double slope = (p.ms[1] - p.ms[0]) / static_cast<double>(m1 - m0);
  if (p.ms[0] - slope * static_cast<double>(m0) < 0) p.ms[0] = p.ms[1] * static_cast<double>(m0) / static_cast<double>(m1);
}

}  // namespace

int64_t Trainer::probe_activations(int64_t micro_batch, bool keep_grads, double* ms) {
  const c10::Device measured = memory_device();
  // What the probe's forward changes besides gradients: BatchNorm's running statistics (restored after).
  ModelBuffers saved;
  saved.save(*model_);
  auto clear_grads = [&] {
    model_->zero_grad(/*set_to_none=*/true);
    for (auto& m : master_) m.mutable_grad().reset();
  };
  clear_grads();
  std::optional<DropGradients> drop;
  struct Restore {
    std::function<void()> f;
    ~Restore() { f(); }
  } restore{[&] {
    drop.reset();
    hook_grads_to_masters(true);
    clear_grads();
    saved.restore(*model_);
  }};
  if (!keep_grads) hook_grads_to_masters(false), drop.emplace(params_);
  if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
  reset_peak(measured);
  const int64_t start = read_counters(measured).allocated;
  const auto begin = std::chrono::steady_clock::now();
  {
    // As a step: the batch arrives after the step's start, the loss is scaled by 1 / accum_steps.
    auto batch = to_device(data_->train_batch(0, 0, micro_batch));
    auto loss = forward_loss(batch) / static_cast<double>(config_.train.accum_steps);
    grads_stay_bf16_ = keep_grads && masters_step_by_bucket();  // as the step keeps them
    loss.backward();
    if (keep_grads) move_grads_to_masters();
    grads_stay_bf16_ = false;
  }
  if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
  if (ms) *ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
  return read_counters(measured).peak_allocated - start;
}

ActivationProbe Trainer::probe(bool keep_grads) {
  auto [m0, m1] = probe_points(config_.train.micro_batch);
  if (m1 > m0) {
    // A model without a closed form (an embedder's module, the ResNet, the MLP): the larger point's cost is
    // predicted from the smaller one before it is allocated, and capped at half the free memory.
    const auto first = probe_at(m0, m0, keep_grads);
    int64_t free = free_device_bytes(memory_device());
    if (config_.memory.limit_mib > 0) {  // the limit the run will hold to (installed after the estimate)
      const int64_t used = device_.is_cuda() ? read_counters(device_).allocated : cpu_memory::current();
      const int64_t left = (config_.memory.limit_mib << 20) - used;
      free = free < 0 ? left : std::min(free, left);
    }
    const int64_t per_sample = (first.bytes[0] + m0 - 1) / m0;
    if (free > 0 && per_sample > 0 && per_sample * m1 > free / 2) {
      const int64_t capped = std::max(m0, free / 2 / per_sample);
      if (world_.is_main())
        std::cout << "memory estimate: the probe's micro-batch " << m1 << " would need about "
                  << format_bytes(per_sample * m1) << " (" << format_bytes(per_sample) << " per sample at micro-batch "
                  << m0 << "), over half of the " << format_bytes(free) << " free"
                  << (config_.memory.limit_mib > 0 ? " under memory.limit_mib" : "") << ": probing "
                  << (capped > m0 ? "micro-batch " + std::to_string(capped) : std::string("no second point"))
                  << " instead\n" << std::flush;
      if (capped == m0) return first;
      m1 = capped;
    }
    auto p = first;  // the second point only
    p.micro_batch[1] = m1;
    p.bytes[1] = probe_activations(m1, keep_grads, &p.ms[1]);
    clamp_probe_times(p);
    return p;
  }
  return probe_at(m0, m1, keep_grads);
}

ActivationProbe Trainer::probe_at(int64_t m0, int64_t m1, bool keep_grads, bool clamp) {
  ActivationProbe p;
  p.micro_batch[0] = m0, p.micro_batch[1] = m1;
  p.grads_included = keep_grads;
  for (int i = 0; i < 2; ++i) {
    if (i == 1 && m1 == m0) {
      p.bytes[1] = p.bytes[0], p.ms[1] = p.ms[0];
      continue;
    }
    p.bytes[i] = probe_activations(p.micro_batch[i], keep_grads, &p.ms[i]);
  }
  if (clamp) clamp_probe_times(p);
  return p;
}

void Trainer::retime_probe(ActivationProbe& p, bool keep_grads) {
  for (int i = 0; i < 2; ++i) {
    if (i == 1 && p.micro_batch[1] == p.micro_batch[0]) {
      p.ms[1] = p.ms[0];
      continue;
    }
    double ms = 0;
    probe_activations(p.micro_batch[i], keep_grads, &ms);
    p.ms[i] = std::min(p.ms[i], ms);  // a busy machine only ever adds time
  }
}

int64_t Trainer::budget_bytes() const {
  const double mib = parse_budget_mib(config_.memory.budget_mib);
  if (mib > 0) return static_cast<int64_t>(mib * 1024 * 1024);
  // auto: what is in use now (the estimate counts it) and 90% of what is free.
  const int64_t free = free_device_bytes(device_);
  MEMTRAIN_CHECK(free > 0, Error, "[planner] memory.budget_mib = auto: the free memory of ", device_.str(),
                 " cannot be read (cudaMemGetInfo, or MemAvailable in /proc/meminfo)");
  const int64_t in_use = device_.is_cuda() ? read_counters(device_).allocated : cpu_memory::current();
  return in_use + static_cast<int64_t>(0.9 * static_cast<double>(free));
}

// memory.budget_mib: the settings the planner tries, and what its step times need.
struct Trainer::PlanKnobs {
  int64_t global = 0;                   // the global batch: train.micro_batch x train.accum_steps
  std::vector<int64_t> micro;           // micro-batches dividing it, largest first
  std::vector<std::string> policies;    // memory.recompute
  std::vector<std::string> heads;       // memory.head
  std::vector<int> stages;              // dist.zero_stage
  bool configured_offload = false;      // dist.offload_optimizer = cpu as configured
  std::vector<bool> offloads;           // dist.offload_optimizer = cpu or not
  double cpu_update_ns = 0;             // CUDA: the CPU update timed here (offload's step time)
  std::vector<std::string> optimizers;  // train.optimizer: "" as configured, then low-bit moments
};

void Trainer::plan_to_budget() {
  // Rank 0's budget for every rank (memory.budget_mib = auto reads each machine's free memory).
  plan_budget_ = agreement().from_rank0({budget_bytes()}).front();
  const bool sharded = this->sharded(world_.world_size);
  MEMTRAIN_CHECK(device_.is_cuda() || cpu_memory::installed(), Error,
                 "[planner] memory.budget_mib on CPU needs memtrain::cpu_memory::install() at the start of main()");
  const auto knobs = plan_knobs();
  const int64_t global = knobs.global;
  const auto& micro = knobs.micro;

  // One probe per (policy, head) at two small micro-batches; bytes and times extrapolate along their lines.
  // The smallest candidate is probed itself (per-micro-batch costs do not extrapolate down well: measured),
  // the larger ones extrapolate from it and a quarter of the global batch.
  const int64_t p0 = micro.back();
  int64_t p1 = std::max<int64_t>(p0, global / 4);
  if (p1 == p0 && global > p0) p1 = micro[micro.size() >= 2 ? micro.size() - 2 : 0];
  // How candidates are ranked: one process times them by the probes; with several ranks rank 0 chooses (its choice
  // travels), ranking by the time model of step_time.h on this device's speeds where the model has a closed form.
  const bool timed = world_.world_size == 1;
  const bool closed = closed_form_applies();
  plan_timing_ = timed ? "probe" : closed ? "model" : "relative";
  std::optional<TargetSpeed> speed;
  if (plan_timing_ == "model" && world_.is_main()) {
    const auto name = target_name_of(device_);
    speed = target_speed(Target{.name = name, .cuda = device_.is_cuda(), .bytes = plan_budget_},
                         config_.train.param_dtype == "bf16" || config_.train.precision != "fp32");
    plan_speed_source_ = speed->source + (device_.is_cuda() && name.empty() ? " (this GPU is not in the table: an "
                                                                                "H100's speeds, for the ranking)"
                                                                              : "");
  }
  plan_candidates_.clear();
  std::vector<std::pair<std::string, std::string>> pairs;
  for (const auto& policy : knobs.policies)
    for (const auto& head : knobs.heads) pairs.emplace_back(policy, head);
  // A closed form (GPT, Llama, Phi-3): each candidate's activations at its own micro-batch; probes only for the
  // times (one process). Other models: the probes' bytes too.
  std::vector<ActivationProbe> probes(pairs.size());
  if (!closed || timed) probes = probe_settings(pairs, p0, p1, !sharded, timed);
  for (size_t k = 0; k < pairs.size(); ++k) {
    const auto& [policy, head] = pairs[k];
    add_plan_candidates(knobs, policy, head, probes[k], closed, sharded, speed ? &*speed : nullptr);
  }
  const auto chosen = agreed_choice(plan_candidates_, plan_budget_, "");
  apply_chosen_plan(chosen);
}

Trainer::PlanKnobs Trainer::plan_knobs() const {
  const auto& t = config_.train;
  const auto& m = config_.memory;
  // The knobs: micro-batches dividing the global batch (largest first), recompute policies, heads, stages.
  const int64_t global = t.micro_batch * t.accum_steps;
  std::vector<int64_t> micro;
  for (int64_t mb = global; mb >= 1 && micro.size() < 6; mb /= 2)
    if (global % mb == 0) micro.push_back(mb);
  std::vector<std::string> policies = {"none", "every:2", "all"};
  const auto parts = model_->part_names();
  if (std::find(parts.begin(), parts.end(), "attn") != parts.end()) policies.push_back("attn");
  std::vector<std::string> heads = {"plain"};
  if (model_->has_linear_head()) heads.push_back("fused");  // split: the vocabulary-parallel head already
  std::vector<int> stages = {static_cast<int>(config_.dist.zero_stage)};
  if (world_.world_size > 1) stages = {0, 1, 2, 3};
  // Offload is a knob where it frees the device (CUDA): the stepped part, its gradient and the optimizer
  // state move to host memory, at the price of the CPU update and the copies (offload_step_ms, with the CPU
  // update timed here). On a CPU the host is the device: it would only add the copy, so it stays as set.
  const bool configured_offload = config_.dist.offload_optimizer == "cpu";
  std::vector<bool> offloads = {configured_offload};
  if (device_.is_cuda() && t.precision != "fp16") offloads = {false, true};  // fp16's scaler: not with offload
  const double cpu_update_ns = device_.is_cuda() ? time_cpu_update() : 0;
  // Low-bit moments (memory.allow_lowbit_optimizer): ranked after every setting with the configured state.
  std::vector<std::string> optimizers = {""};
  if (m.allow_lowbit_optimizer && (t.optimizer == "adamw" || t.optimizer == "adamw_loop"))
    for (const char* low : {"adamw8bit", "adamw4bit"}) {
      auto v = t;
      v.optimizer = low;
      if (lowbit_slices_refusal(v).empty()) optimizers.push_back(low);  // split: only where slices keep whole blocks
    }
  return PlanKnobs{.global = global,
                   .micro = std::move(micro),
                   .policies = std::move(policies),
                   .heads = std::move(heads),
                   .stages = std::move(stages),
                   .configured_offload = configured_offload,
                   .offloads = std::move(offloads),
                   .cpu_update_ns = cpu_update_ns,
                   .optimizers = std::move(optimizers)};
}

void Trainer::add_plan_candidates(const PlanKnobs& knobs, const std::string& policy, const std::string& head,
                                  const ActivationProbe& pr, bool closed, bool sharded, const TargetSpeed* speed) {
  const auto& t = config_.train;
  const auto& m = config_.memory;
  const int64_t global = knobs.global;
  const auto& optimizers = knobs.optimizers;
  const bool configured_offload = knobs.configured_offload;
  const double cpu_update_ns = knobs.cpu_update_ns;
  for (auto mb : knobs.micro) {
    for (const bool offload : knobs.offloads) {
      for (int stage : knobs.stages) {
        for (size_t o = 0; o < optimizers.size(); ++o) {
          // Offload needs a sharded optimizer (stage >= 1); in one process, a group of one at stage 1.
          if (offload && stage == 0) {
            if (world_.world_size > 1) continue;
            stage = 1;
          }
          auto in = estimate_inputs(world_.world_size, optimizers[o].empty() ? t.optimizer : optimizers[o]);
          in.micro_batch = mb, in.accum_steps = global / mb, in.stage = stage, in.budget_bytes = -1;
          in.offload = offload;
          in.probe = pr;
          auto candidate_policy = RecomputePolicy::parse(policy);
          candidate_policy.offload = m.offload;
          auto candidate_train = t;
          auto candidate_dist = config_.dist;
          candidate_train.accum_steps = global / mb, candidate_dist.zero_stage = stage;
          candidate_dist.offload_optimizer = offload ? "cpu" : "none";
          const double reduced = reduced_part_bytes_per_element(candidate_train, candidate_dist, world_.world_size, device_.is_cuda());
          if (closed) in.probe = closed_form_probe(!sharded, mb, candidate_policy, parse_head_rows(head), reduced, global / mb);
          // The later micro-batches of one process find the gradients resident; what their backward adds is
          // taken as the first micro-batch's (gradients born included): an over-estimate by at most the
          // gradient bytes, which spares a second probe per setting. (A one-process offload candidate drops
          // its gradients per bucket: the kept-gradient probe over-estimates it the same way.)
          if (!sharded) in.probe_dropped = closed ? closed_form_probe(false, mb, candidate_policy, parse_head_rows(head), reduced, global / mb) : pr;
          PlanCandidate c{.micro_batch = mb, .accum_steps = global / mb, .recompute = policy, .head = head, .stage = stage,
                          .offload = offload, .optimizer = optimizers[o],
                          .lowbit_rank = optimizers[o].empty() ? 0 : optimizers[o] == "adamw8bit" ? 1 : 2,
                          .tensor_parallel = static_cast<int>(config_.dist.tensor_parallel), .estimate = estimate_memory(in)};
          const int64_t part = (in.root_elements + std::accumulate(in.block_elements.begin(), in.block_elements.end(),
                                                                   int64_t{0})) / ParallelDims::of(config_.dist, world_.world_size).dp;
          if (plan_timing_ == "probe") {
            c.step_ms = static_cast<double>(global / mb) * pr.ms_at(mb) +
                        (offload && !configured_offload ? offload_step_ms(part, in.param_bytes, in.param_bytes, cpu_update_ns)
                                                        : 0.0);
          } else if (plan_timing_ == "relative") {
            c.step_ms = plan_step_cost(mb, global / mb, recompute_fraction(policy), stage, 0.1, offload && !configured_offload);
          } else if (speed) {  // the time model, on rank 0 (the other ranks' rankings are not read)
            auto v = config_;
            c.apply_to(v);
            const auto t = predict_step(step_settings(v, world_.world_size, world_.local_world_size), *speed);
            c.step_ms = t.total_s * 1e3, c.tokens_per_s = t.tokens_per_s;
          }
          plan_candidates_.push_back(c);
        }
      }
    }
  }
}

// Writes the chosen plan into config_ (the buckets do not exist yet) and the data's accumulation.
void Trainer::apply_chosen_plan(const PlanCandidate& chosen) {
  chosen.apply_to(config_);
  data_->set_accum_steps(config_.train.accum_steps);
  plan_lowbit_rank_ = chosen.lowbit_rank;
}

PlanCandidate Trainer::agreed_choice(const std::vector<PlanCandidate>& candidates, int64_t budget,
                                     const std::string& preface) {
  // Every rank enumerates the same candidates in the same order, but their estimates come from their own
  // probes (another GPU's workspace, another machine's allocator): rank 0 chooses, and its choice travels as
  // an index, so that every rank builds the same buckets. Rank 0 finding nothing that fits stops every rank.
  std::string error;
  int64_t index = -1;
  try {
    auto plan = choose_plan(candidates, budget, config_.memory.budget_headroom);
    plan.timing = plan_timing_, plan.speed_source = plan_speed_source_;
    for (size_t i = 0; i < candidates.size() && index < 0; ++i) {
      const auto& c = candidates[i];
      if (c.micro_batch == plan.chosen.micro_batch && c.recompute == plan.chosen.recompute && c.head == plan.chosen.head &&
          c.stage == plan.chosen.stage && c.offload == plan.chosen.offload && c.optimizer == plan.chosen.optimizer)
        index = static_cast<int64_t>(i);
    }
    if (world_.is_main()) std::cout << preface << plan.explain() << std::flush;
  } catch (const ConfigError& e) {
    error = e.what();
  }
  index = agreement().from_rank0({index}).front();
  if (index < 0)
    throw ConfigError(world_.is_main() ? error
                                       : "[planner] rank 0 found no setting that fits memory.budget_mib (its message names "
                                         "the smallest budget that would)");
  return candidates[static_cast<size_t>(index)];
}

std::vector<ActivationProbe> Trainer::probe_settings(const std::vector<std::pair<std::string, std::string>>& settings,
                                                    int64_t m0, int64_t m1, bool keep_grads, bool timed) {
  auto use = [&](const std::string& policy, const std::string& head) {
    policy_ = RecomputePolicy::parse(policy);
    policy_.offload = config_.memory.offload;
    head_rows_ = head_rows_of(head);
  };
  // The times are each setting's fastest of kRounds, taken in rounds over all settings: a machine busy for a
  // while slows one round of every setting rather than every round of one.
  constexpr int kRounds = 4;
  std::vector<ActivationProbe> probes;
  for (const auto& [policy, head] : settings) {
    use(policy, head);
    if (probes.empty()) probe_activations(m0, keep_grads);  // the first forward of a process runs slower
    probes.push_back(probe_at(m0, m1, keep_grads, /*clamp=*/false));
  }
  for (int round = 1; timed && round < kRounds; ++round)
    for (size_t k = 0; k < settings.size(); ++k) use(settings[k].first, settings[k].second), retime_probe(probes[k], keep_grads);
  for (auto& pr : probes) clamp_probe_times(pr);
  return probes;
}

void Trainer::correct_plan(int64_t measured_peak) {
  if (plan_corrected_ || plan_candidates_.empty() || measured_peak <= plan_budget_) return;
  plan_corrected_ = true;
  // Activations off by the measured error; model states are counted and stay.
  const auto& est = estimate_.device;
  const double scale = est.activations > 0
                           ? std::max(1.0, static_cast<double>(measured_peak - (est.peak() - est.activations)) /
                                               static_cast<double>(est.activations))
                           : 1.0;
  std::vector<PlanCandidate> same_stage;
  for (auto c : plan_candidates_) {
    // The buckets exist: the stage and offload chosen stay.
    if (c.stage != config_.dist.zero_stage || c.offload != (config_.dist.offload_optimizer == "cpu") ||
        c.lowbit_rank != plan_lowbit_rank_)
      continue;
    c.estimate.device.activations = static_cast<int64_t>(static_cast<double>(c.estimate.device.activations) * scale);
    same_stage.push_back(c);
  }
  std::ostringstream preface;
  preface << "memory: step peak " << format_bytes(measured_peak) << " is over memory.budget_mib; activations were "
          << "under-estimated by x" << scale << ", so the plan is made again:\n";
  const auto chosen = agreed_choice(same_stage, plan_budget_, preface.str());
  chosen.apply_to(config_);  // the same stage, offload and optimizer: only the batch split, recompute and head change
  data_->set_accum_steps(config_.train.accum_steps);
  policy_ = RecomputePolicy::parse(chosen.recompute);
  policy_.offload = config_.memory.offload;
  head_rows_ = head_rows_of(chosen.head);
}

EstimateInputs Trainer::estimate_inputs(int world, const std::string& optimizer) const {
  auto train = config_.train;
  if (!optimizer.empty()) train.optimizer = optimizer;
  std::vector<int64_t> trained, whole;
  for (size_t i = 0; i < params_.size(); ++i) {
    trained.push_back(params_[i].numel());
    whole.push_back(whole_numel(param_names_[i], params_[i].sizes()));
  }
  // Tensor parallel: this rank's slices are params_ (their state quantized as their whole parameters'); estimate_settings
  // shards ZeRO over world / T data-parallel ranks.
  auto in = estimate_settings(train, config_.dist, world, param_dtype_ != torch::kFloat, trained, whole);
  in.block_elements.assign(static_cast<size_t>(model_->num_blocks()), 0);
  for (size_t i = 0; i < params_.size(); ++i)
    (units_[i] < 0 ? in.root_elements : in.block_elements[static_cast<size_t>(units_[i])]) += params_[i].numel();
  in.frozen_block_elements.assign(in.block_elements.size(), 0);
  for (size_t i = 0; i < frozen_.size(); ++i) {
    // What does not train counts by its bytes, in parameter-sized elements: an NF4 weight's packed bytes (0.5 byte
    // per value and its scales), whose setup transient is its values (the fill quantizes one whole weight at a time).
    const auto nf4 = nf4_.find(frozen_names_[i]);
    const int64_t bytes = frozen_[i].numel() * static_cast<int64_t>(frozen_[i].element_size());
    const int64_t elements = (bytes + in.param_bytes - 1) / in.param_bytes;
    in.frozen_elements += elements;
    in.largest_elements = std::max(in.largest_elements, nf4 == nf4_.end() ? frozen_[i].numel()
                                                                          : c10::multiply_integers(nf4->second.whole_shape()));
    const auto u = i < frozen_units_.size() ? frozen_units_[i] : -1;
    (u < 0 || static_cast<size_t>(u) >= in.frozen_block_elements.size() ? in.frozen_root_elements
                                                                         : in.frozen_block_elements[static_cast<size_t>(u)]) += elements;
  }
  in.data_bytes = data_->resident_bytes();
  in.cuda = device_.is_cuda();
  in.workspace_bytes = cublas_workspace_bytes(device_);
  if (policy_.budget_unresolved()) in.budget_bytes = static_cast<int64_t>(policy_.budget_mib * 1024 * 1024);
  const bool sharded = this->sharded(world);
  in.probe = sharded ? probe_drop_ : probe_keep_;
  if (!sharded) in.probe_dropped = probe_drop_;
  return in;
}

void Trainer::check_probe_fits(int64_t micro_batch) const {
  // The probe's own activations, by the model's published formula, before it allocates them: blocks the
  // policy recomputes keep their input (micro_batch x context x width elements), the others what the
  // formula says, and one recomputed block is whole again in its backward. Selective (part) policies are not
  // checked (the formula does not split a block).
  const int64_t element = precision_ == Precision::kFp32 ? 4 : 2;
  const double block = model_->block_activation_bytes(micro_batch, element);
  if (block <= 0 || policy_.mode == RecomputePolicy::Mode::kPart) {
    if (world_.is_main())
      std::cout << "memory estimate: probing the activations of one forward + backward at micro-batch " << micro_batch
                << "\n" << std::flush;
    return;
  }
  const double input = static_cast<double>(micro_batch * model_->tokens_per_sample() * element) *
                       static_cast<double>(config_.model.n_embd);
  double bytes = 0;
  bool any_recomputed = false;
  for (int64_t i = 0; i < model_->num_blocks(); ++i) {
    const bool recomputed = policy_.checkpoints_block(i);
    bytes += recomputed ? input : block;
    any_recomputed = any_recomputed || recomputed;
  }
  if (any_recomputed) bytes += block;
  const int64_t free = free_device_bytes(memory_device());
  if (world_.is_main())
    std::cout << "memory estimate: probing the activations of one forward + backward at micro-batch " << micro_batch
              << " (about " << format_bytes(static_cast<int64_t>(bytes)) << " by the model's formula; "
              << (free >= 0 ? format_bytes(free) + " free" : std::string("free memory unknown")) << ")\n"
              << std::flush;
  MEMTRAIN_CHECK(free < 0 || bytes <= static_cast<double>(free), Error, "[memory] this run cannot fit: the memory "
                 "estimate's probe, one forward + backward at micro-batch ", micro_batch, " (half of train.micro_batch = ",
                 config_.train.micro_batch, "), needs about ", format_bytes(static_cast<int64_t>(bytes)),
                 " of activations by the model's published formula (Korthikanti et al. 2022 for a transformer), and ",
                 memory_device().str(), " has ", format_bytes(free), " free (",
                 memory_device().is_cuda() ? "cudaMemGetInfo" : "MemAvailable in /proc/meminfo",
                 "); the run itself needs more. Lower train.micro_batch or the context (model.block_size), or recompute "
                 "(memory.recompute = all)");
}

bool Trainer::closed_form_applies() const {
  const auto& method = config_.memory.estimate_method;
  const bool can = model_->transformer_shape().has_value() && config_.train.freeze.empty();
  MEMTRAIN_CHECK(can || method != "closed_form", ConfigError, "[config] memory.estimate_method = closed_form: ",
                 model_->transformer_shape() ? "train.freeze is not in the closed form ([lora] is)"
                                             : "this model has none (" + closed_form_families() + " do)",
                 "; use auto or probe");
  return can && method != "probe";
}

ActivationProbe Trainer::closed_form_probe(bool keep_grads, int64_t micro_batch) const {
  return closed_form_probe(keep_grads, micro_batch, policy_, head_rows_,
                           reduced_part_bytes_per_element(config_.train, config_.dist, world_.world_size, device_.is_cuda()),
                           config_.train.accum_steps);
}

ActivationProbe Trainer::closed_form_probe(bool keep_grads, int64_t micro_batch, const RecomputePolicy& policy,
                                           int64_t head_rows, double reduced_bytes_per_element, int64_t accum_steps) const {
  // The config's precision, parameter dtype and LoRA; the policy (a resolved budget), head, reduced parts and
  // accumulation asked for.
  auto s = activation_settings(config_, device_.is_cuda(), keep_grads, micro_batch, world_.world_size);
  s.policy = policy, s.head_rows = head_rows, s.reduced_bytes_per_element = reduced_bytes_per_element;
  s.accumulates = keep_grads && accum_steps > 1;
  return as_probe(transformer_activations(*model_->transformer_shape(), s), micro_batch, keep_grads);
}

void Trainer::check_fits_before_building() const {
  const auto& c = config_;
  if (!c.memory.estimate || c.memory.estimate_method == "probe" || !has_closed_form(c.model) || !c.train.freeze.empty() ||
      parse_budget_mib(c.memory.budget_mib) != 0 || RecomputePolicy::parse(c.memory.recompute).mode == RecomputePolicy::Mode::kBudget)
    return;  // the planner sizes its own settings; train.freeze (a pattern over the built model's names) is probed
  const auto device = resolve_device(c.train.device, world_.local_rank);
  const bool limited = c.memory.limit_mib > 0;
  const int64_t limit = limited ? c.memory.limit_mib << 20 : free_device_bytes(device);
  if (limit <= 0) return;
  auto estimate = [&](int64_t micro_batch) {
    auto v = c;
    v.train.micro_batch = micro_batch;
    if (v.model.vocab_size == 0 && (v.model.preset == "custom" || v.model.preset == "tiny"))
      v.model.vocab_size = data_->info().vocab_size;  // as make_model sizes it
    auto e = estimate_for_target(v, Target{device.str(), device.is_cuda(), limit}, world_.world_size);
    if (!device.is_cuda()) e.states.device.data = data_->resident_bytes();
    return e.states;
  };
  // A step that runs out of memory in one process is retried with smaller micro-batches, down to one sample.
  const bool retries = c.train.oom == "retry" && !sharded(world_.world_size);
  const auto at_least = estimate(retries ? 1 : c.train.micro_batch);
  // The setup comes first: what the rank holds before step 1 and its transients (memory_estimate.h, SetupPeak).
  MEMTRAIN_CHECK(at_least.setup.device <= limit, Error, "[memory] this run cannot be set up: before building the model, "
                 "its setup peak per rank is ", format_bytes(at_least.setup.device), " (", at_least.setup.terms, ") and ",
                 limited ? "memory.limit_mib = " + std::to_string(c.memory.limit_mib) : device.str() + " has " + format_bytes(limit) + " free",
                 ". Shard the parameters (dist.zero_stage = 3 on more ranks), or lower dist.bucket_mib");
  if (at_least.peak_device() <= limit) {
    if (retries && c.train.micro_batch > 1 && world_.is_main()) {
      const auto configured = estimate(c.train.micro_batch);
      if (configured.peak_device() > limit)
        std::cerr << "memtrain: warning: [memory] the estimate at train.micro_batch = " << c.train.micro_batch << " is "
                  << format_bytes(configured.peak_device()) << ", over " << format_bytes(limit)
                  << (limited ? " (memory.limit_mib)" : " free") << "; train.oom = retry will split the micro-batches "
                  << "(memtrain plan --target shows settings that fit)\n";
    }
    return;
  }
  const auto& d = at_least.device;
  throw Error(detail::concat(
      "[memory] this run cannot fit: before building the model, its estimate per rank is ",
      format_bytes(at_least.peak_device()), retries ? " even at micro-batch 1 (train.oom = retry's last resort)" : "",
      " (parameters ", format_bytes(d.params), ", gradients ", format_bytes(d.grads), ", optimizer state ",
      format_bytes(d.optimizer_state), ", data ", format_bytes(d.data), ", activations ", format_bytes(d.activations),
      ", ZeRO-3 gathered ", format_bytes(d.gathered), ", bucket in flight ", format_bytes(d.buckets_in_flight), "; ",
      at_least.method, ") and ", limited ? "memory.limit_mib = " + std::to_string(c.memory.limit_mib)
                                        : device.str() + " has " + format_bytes(limit) + " free",
      ". Shard the states (dist.zero_stage, more ranks, dist.offload_optimizer = cpu), recompute (memory.recompute = "
      "all), fuse the head (memory.head = fused), shorten the context, or store AdamW's state in 8 bits "
      "(train.optimizer = adamw8bit); memtrain plan --target shows what fits"));
}

void Trainer::make_estimate() {
  if (config_.memory.estimate && !policy_.budget_unresolved() && closed_form_applies()) {
    const bool sharded = this->sharded(world_.world_size);
    const auto mb = config_.train.micro_batch;
    (sharded ? probe_drop_ : probe_keep_) = closed_form_probe(/*keep_grads=*/!sharded, mb);
    if (!sharded && config_.train.accum_steps > 1) probe_drop_ = closed_form_probe(/*keep_grads=*/false, mb);
  } else if (config_.memory.estimate && can_measure() && !policy_.budget_unresolved()) {
    const bool sharded = this->sharded(world_.world_size);
    check_probe_fits(probe_points(config_.train.micro_batch).second);
    try {
      (sharded ? probe_drop_ : probe_keep_) = probe(/*keep_grads=*/!sharded);
      if (!sharded && config_.train.accum_steps > 1) probe_drop_ = probe(/*keep_grads=*/false);
    } catch (const c10::OutOfMemoryError& e) {
      // The run itself may still fit (the probe's batch is smaller, but nothing is sharded yet).
      if (world_.is_main())
        std::cerr << "memtrain: warning: [memory] the estimate's probe ran out of memory ("
                  << e.what_without_backtrace() << "); no activation estimate\n";
    }
  }
  estimate_ = estimate_memory(estimate_inputs(world_.world_size));
}

EstimateInputs Trainer::estimate_inputs_for(int world) {
  const bool sharded = this->sharded(world);
  auto& probe_for = sharded ? probe_drop_ : probe_keep_;
  MEMTRAIN_CHECK(!dp_ || world == world_.world_size, Error,
                 "[memory] estimate_inputs_for(", world, "): a multi-process trainer estimates its own world only");
  if (!probe_for.measured() && !policy_.budget_unresolved() && closed_form_applies())
    probe_for = closed_form_probe(/*keep_grads=*/!sharded, config_.train.micro_batch);
  else if (!probe_for.measured() && can_measure() && !policy_.budget_unresolved())
    probe_for = probe(/*keep_grads=*/!sharded);
  return estimate_inputs(world);
}

}  // namespace memtrain
