#include "memtrain/optim/optimizer.h"

#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <numbers>
#include <set>

#include "memtrain/core/error.h"
#include "memtrain/optim/lowbit_adamw.h"

namespace memtrain {

namespace {
// Two parameter groups sharing `base`: one with weight decay, one without.
template <class Options>
std::vector<torch::optim::OptimizerParamGroup> decay_groups(const std::vector<torch::Tensor>& decay,
                                                            const std::vector<torch::Tensor>& no_decay,
                                                            const Options& base, double weight_decay) {
  auto with_decay = std::make_unique<Options>(base);
  with_decay->weight_decay(weight_decay);
  auto without = std::make_unique<Options>(base);
  without->weight_decay(0.0);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::move(with_decay));
  groups.emplace_back(no_decay, std::move(without));
  return groups;
}
}  // namespace

std::optional<LowBitOptions> lowbit_options(const OptimizerOptions& t) {
  using Kind = OptimizerOptions::Kind;
  if (t.kind != Kind::kAdamW8bit && t.kind != Kind::kAdamW4bit) return std::nullopt;
  const int bits = t.kind == Kind::kAdamW8bit ? 8 : 4;
  return LowBitOptions{bits, t.block > 0 ? t.block : bits == 8 ? 256 : 128, t.min_quantized};
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerOptions& t,
                                                        const torch::OrderedDict<std::string, torch::Tensor>& named) {
  std::vector<torch::Tensor> decay, no_decay;
  std::set<const void*> seen;  // tied parameters appear once
  for (const auto& item : named) {
    const auto& p = item.value();
    if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    (p.dim() >= 2 ? decay : no_decay).push_back(p);
  }
  return make_optimizer(t, decay, no_decay);
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerOptions& t, const std::vector<torch::Tensor>& decay,
                                                        const std::vector<torch::Tensor>& no_decay) {
  using Kind = OptimizerOptions::Kind;
  if (t.kind == Kind::kSgd) {
    auto base = torch::optim::SGDOptions(t.lr).momentum(t.momentum);
    return std::make_unique<torch::optim::SGD>(decay_groups(decay, no_decay, base, t.weight_decay), base);
  }
  auto base = torch::optim::AdamWOptions(t.lr).betas({t.beta1, t.beta2}).eps(t.eps);
  auto groups = decay_groups(decay, no_decay, base, t.weight_decay);
  if (auto low = lowbit_options(t)) return std::make_unique<LowBitAdamW>(std::move(groups), base, *low);
  if (t.kind == Kind::kAdamWLoop) return std::make_unique<torch::optim::AdamW>(std::move(groups), base);
  return std::make_unique<FusedAdamW>(std::move(groups), base);
}

FusedAdamW::FusedAdamW(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::AdamWOptions defaults)
    : PartialStepOptimizer(std::move(groups), std::make_unique<torch::optim::AdamWOptions>(defaults)) {
  MEMTRAIN_CHECK(!defaults.amsgrad(), Error, "[optim] FusedAdamW does not implement amsgrad");
}

torch::Tensor PartialStepOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    torch::AutoGradMode enable_grad(true);
    loss = closure();
  }
  torch::NoGradGuard no_grad;
  update(nullptr);
  return loss;
}

void PartialStepOptimizer::step_only(const std::vector<torch::Tensor>& params) {
  std::set<const void*> only;
  for (const auto& p : params) only.insert(p.unsafeGetTensorImpl());
  torch::NoGradGuard no_grad;
  update(&only);
}

void FusedAdamW::update(const std::set<const void*>* only) {
  // 1. Missing state first, for every group: an allocation that fails leaves nothing updated.
  struct Call {
    const torch::optim::AdamWOptions* options;
    std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
  };
  std::vector<Call> calls;
  for (auto& group : param_groups_) {
    // One fused call per (device, dtype): the kernel takes lists of same-device, same-dtype tensors.
    std::map<std::string, size_t> by_kind;
    for (auto& p : group.params()) {
      if (!p.grad().defined() || (only && !only->count(p.unsafeGetTensorImpl()))) continue;
      auto state_key = p.unsafeGetTensorImpl();
      auto it = state_.find(state_key);
      if (it == state_.end()) {
        auto s = std::make_unique<torch::optim::AdamWParamState>();
        s->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        s->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        auto count = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat).device(p.device()));
        it = state_.emplace(state_key, std::move(s)).first;
        steps_[state_key] = count;
      }
      const auto kind = p.device().str() + "/" + std::string(c10::toString(p.scalar_type()));
      auto [slot, added] = by_kind.emplace(kind, calls.size());
      if (added) calls.push_back({&static_cast<const torch::optim::AdamWOptions&>(group.options()), {}, {}, {}, {}, {}});
      auto& c = calls[slot->second];
      auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
      c.params.push_back(p);
      c.grads.push_back(p.grad());
      c.exp_avgs.push_back(s.exp_avg());
      c.exp_avg_sqs.push_back(s.exp_avg_sq());
      c.steps.push_back(steps_[state_key]);
    }
  }
  // 2. The update.
  for (auto& c : calls) {
    for (auto& p : c.params) {
      auto& s = static_cast<torch::optim::AdamWParamState&>(*state_.at(p.unsafeGetTensorImpl()));
      s.step(s.step() + 1);
    }
    torch::_foreach_add_(c.steps, 1);  // the kernel expects the count of this step, as torch.optim does
    const auto& o = *c.options;
    const auto& [beta1, beta2] = o.betas();
    std::optional<torch::Tensor> found;
    if (found_inf_.defined()) found = found_inf_.device() == c.params.front().device() ? found_inf_ : found_inf_.to(c.params.front().device());
    at::_fused_adamw_(c.params, c.grads, c.exp_avgs, c.exp_avg_sqs, /*max_exp_avg_sqs=*/{}, c.steps, o.lr(), beta1,
                      beta2, o.weight_decay(), o.eps(), /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/std::nullopt,
                      found);
    // A skipped update counts no step (torch.optim's fused Adam subtracts found_inf the same way).
    if (found) torch::_foreach_sub_(c.steps, std::vector<torch::Tensor>(c.steps.size(), *found));
  }
}

torch::Tensor FusedAdamW::step_count(const torch::Tensor& param) const {
  auto it = steps_.find(param.unsafeGetTensorImpl());
  return it == steps_.end() ? torch::Tensor() : it->second;
}

void FusedAdamW::set_step_count(const torch::Tensor& param, double count) {
  steps_[param.unsafeGetTensorImpl()] =
      torch::full({}, count, torch::TensorOptions().dtype(torch::kFloat).device(param.device()));
}

std::vector<StateField> param_state_fields(const torch::optim::Optimizer& optimizer, int64_t whole_numel) {
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return {{"momentum_buffer", 1}};
  if (auto* low = dynamic_cast<const LowBitAdamW*>(&optimizer); low && low->quantizes(whole_numel)) {
    const int64_t code = low->lowbit().bits == 8 ? 1 : 2, block = low->lowbit().block;
    return {{"exp_avg_codes", code}, {"exp_avg_absmax", block}, {"exp_avg_sq_codes", code}, {"exp_avg_sq_absmax", block}, {"step", 0}};
  }
  return {{"exp_avg", 1}, {"exp_avg_sq", 1}, {"step", 0}};
}

void set_whole_numel(torch::optim::Optimizer& optimizer, const torch::Tensor& stepped, int64_t whole_numel) {
  if (auto* low = dynamic_cast<LowBitAdamW*>(&optimizer)) low->set_whole_numel(stepped, whole_numel);
}

std::map<std::string, torch::Tensor> get_param_state(const torch::optim::Optimizer& optimizer, const torch::Tensor& param) {
  std::map<std::string, torch::Tensor> out;
  auto it = optimizer.state().find(param.unsafeGetTensorImpl());
  if (it == optimizer.state().end()) return out;
  if (auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(it->second.get())) {
    out["exp_avg"] = s->exp_avg();
    out["exp_avg_sq"] = s->exp_avg_sq();
    // The fused kernel's count is the truth: an update skipped on the device (skip_when) took its step back
    // there, not in the host's count.
    auto* fused = dynamic_cast<const FusedAdamW*>(&optimizer);
    auto count = fused ? fused->step_count(param) : torch::Tensor();
    out["step"] = count.defined() ? count.to(torch::kCPU, torch::kLong) : torch::tensor(s->step(), torch::kLong);
  } else if (auto* m = dynamic_cast<const torch::optim::SGDParamState*>(it->second.get())) {
    if (m->momentum_buffer().defined()) out["momentum_buffer"] = m->momentum_buffer();
  } else if (auto* l = dynamic_cast<const LowBitAdamWParamState*>(it->second.get())) {
    if (l->quantized()) {
      out["exp_avg_codes"] = l->exp_avg_codes, out["exp_avg_absmax"] = l->exp_avg_absmax;
      out["exp_avg_sq_codes"] = l->exp_avg_sq_codes, out["exp_avg_sq_absmax"] = l->exp_avg_sq_absmax;
    } else {
      out["exp_avg"] = l->exp_avg.view(param.sizes()), out["exp_avg_sq"] = l->exp_avg_sq.view(param.sizes());
    }
    out["step"] = torch::tensor(l->step, torch::kLong);
  }
  return out;
}

void set_param_state(torch::optim::Optimizer& optimizer, const torch::Tensor& param,
                     const std::map<std::string, torch::Tensor>& state) {
  auto field = [&](const std::string& name) {
    auto it = state.find(name);
    MEMTRAIN_CHECK(it != state.end(), Error, "[optim] no '", name, "' in the state given for a parameter of shape ",
                   param.sizes());
    return it->second;
  };
  auto like_param = [&](const std::string& name, torch::ScalarType dtype) {
    auto t = field(name);
    MEMTRAIN_CHECK(t.numel() == param.numel(), Error, "[optim] state '", name, "' has ", t.numel(),
                   " elements, the parameter ", param.numel());
    return t.reshape(param.sizes()).to(param.device(), dtype, /*non_blocking=*/false, /*copy=*/true);
  };
  void* key = param.unsafeGetTensorImpl();
  if (dynamic_cast<torch::optim::SGD*>(&optimizer)) {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(like_param("momentum_buffer", param.scalar_type()));
    optimizer.state()[key] = std::move(s);
    return;
  }
  if (auto* low = dynamic_cast<LowBitAdamW*>(&optimizer)) {
    auto s = std::make_unique<LowBitAdamWParamState>();
    if (state.count("exp_avg_codes")) {
      MEMTRAIN_CHECK(param.numel() % low->lowbit().block == 0, Error, "[optim] quantized state for a part of ", param.numel(),
                     " elements, not whole blocks of ", low->lowbit().block);
      auto sized = [&](const std::string& name, int64_t count, torch::ScalarType dtype) {
        auto t = field(name);
        MEMTRAIN_CHECK(t.numel() == count && t.scalar_type() == dtype, Error, "[optim] state '", name, "' has ", t.numel(),
                       " values of ", t.scalar_type(), "; a part of ", param.numel(), " elements needs ", count, " of ", dtype);
        return t.reshape({-1}).to(param.device(), dtype, /*non_blocking=*/false, /*copy=*/true);
      };
      const int64_t codes = low->lowbit().bits == 8 ? param.numel() : param.numel() / 2, blocks = param.numel() / low->lowbit().block;
      s->exp_avg_codes = sized("exp_avg_codes", codes, torch::kUInt8);
      s->exp_avg_sq_codes = sized("exp_avg_sq_codes", codes, torch::kUInt8);
      s->exp_avg_absmax = sized("exp_avg_absmax", blocks, torch::kFloat);
      s->exp_avg_sq_absmax = sized("exp_avg_sq_absmax", blocks, torch::kFloat);
    } else {
      s->exp_avg = like_param("exp_avg", torch::kFloat).reshape({-1});  // fp32 whatever the parameter's dtype
      s->exp_avg_sq = like_param("exp_avg_sq", torch::kFloat).reshape({-1});
    }
    s->step = field("step").to(torch::kLong).item<int64_t>();
    optimizer.state()[key] = std::move(s);
    return;
  }
  auto s = std::make_unique<torch::optim::AdamWParamState>();
  s->exp_avg(like_param("exp_avg", param.scalar_type()));
  s->exp_avg_sq(like_param("exp_avg_sq", param.scalar_type()));
  const auto count = field("step").to(torch::kLong).item<int64_t>();
  s->step(count);
  optimizer.state()[key] = std::move(s);
  if (auto* fused = dynamic_cast<FusedAdamW*>(&optimizer)) fused->set_step_count(param, static_cast<double>(count));
}

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

std::vector<torch::Tensor> optimizer_state_tensors(const torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> out;
  for (const auto& [key, state] : optimizer.state()) {
    if (auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(state.get())) {
      out.push_back(s->exp_avg());
      out.push_back(s->exp_avg_sq());
      if (s->max_exp_avg_sq().defined()) out.push_back(s->max_exp_avg_sq());
    } else if (auto* m = dynamic_cast<const torch::optim::SGDParamState*>(state.get())) {
      out.push_back(m->momentum_buffer());
    } else if (auto* l = dynamic_cast<const LowBitAdamWParamState*>(state.get())) {
      for (const auto* t : {&l->exp_avg, &l->exp_avg_sq, &l->exp_avg_codes, &l->exp_avg_absmax, &l->exp_avg_sq_codes, &l->exp_avg_sq_absmax})
        if (t->defined()) out.push_back(*t);
    }
  }
  return out;
}

CosineSchedule::CosineSchedule(CosineScheduleOptions options) : options_(options) {
  MEMTRAIN_CHECK(options_.total_steps >= 1, Error, "[optim] total_steps must be >= 1, got ", options_.total_steps);
  MEMTRAIN_CHECK(options_.min <= options_.peak, Error, "[optim] min lr ", options_.min, " exceeds peak lr ", options_.peak);
}

double CosineSchedule::at(int64_t step) const {
  const auto& o = options_;
  if (step < o.warmup_steps) return o.peak * static_cast<double>(step + 1) / static_cast<double>(o.warmup_steps);
  if (step >= o.total_steps) return o.min;
  const double span = std::max<int64_t>(1, o.total_steps - o.warmup_steps);
  const double progress = static_cast<double>(step - o.warmup_steps) / span;
  return o.min + 0.5 * (o.peak - o.min) * (1.0 + std::cos(std::numbers::pi * progress));
}

torch::Tensor clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return torch::zeros({}, torch::kFloat);
  auto norms = torch::_foreach_norm(grads, 2);  // per-tensor L2 norms, on the device
  auto total = torch::stack(norms).to(torch::kFloat).norm(2);
  if (max_norm > 0) {
    // min(1, max_norm / (norm + 1e-6)), applied without reading the norm on the host.
    auto coef = torch::clamp_max(max_norm / (total + 1e-6), 1.0);
    torch::_foreach_mul_(grads, coef.to(grads.front().dtype()));
  }
  return total;
}

}  // namespace memtrain
