#include "memtrain/optim/optimizer.h"

#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <numbers>
#include <set>

#include "memtrain/core/error.h"

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
  if (t.kind == Kind::kAdamWLoop) return std::make_unique<torch::optim::AdamW>(std::move(groups), base);
  return std::make_unique<FusedAdamW>(std::move(groups), base);
}

FusedAdamW::FusedAdamW(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::AdamWOptions defaults)
    : Optimizer(std::move(groups), std::make_unique<torch::optim::AdamWOptions>(defaults)) {
  MEMTRAIN_CHECK(!defaults.amsgrad(), Error, "[optim] FusedAdamW does not implement amsgrad");
}

torch::Tensor FusedAdamW::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure) {
    torch::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    // One fused call per (device, dtype): the kernel takes lists of same-device, same-dtype tensors.
    std::map<std::string, std::vector<size_t>> buckets;
    for (size_t i = 0; i < group.params().size(); ++i) {
      const auto& p = group.params()[i];
      if (!p.grad().defined()) continue;
      buckets[p.device().str() + "/" + std::string(c10::toString(p.scalar_type()))].push_back(i);
    }
    for (const auto& [key, idx] : buckets) {
      std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
      for (auto i : idx) {
        auto& p = group.params()[i];
        auto state_key = p.unsafeGetTensorImpl();
        auto it = state_.find(state_key);
        if (it == state_.end()) {
          auto s = std::make_unique<torch::optim::AdamWParamState>();
          s->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
          s->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
          it = state_.emplace(state_key, std::move(s)).first;
          steps_[state_key] = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat).device(p.device()));
        }
        auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
        s.step(s.step() + 1);
        params.push_back(p);
        grads.push_back(p.grad());
        exp_avgs.push_back(s.exp_avg());
        exp_avg_sqs.push_back(s.exp_avg_sq());
        steps.push_back(steps_[state_key]);
      }
      torch::_foreach_add_(steps, 1);  // the kernel expects the count of this step, as torch.optim does
      const auto& [beta1, beta2] = o.betas();
      at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, o.lr(), beta1, beta2,
                        o.weight_decay(), o.eps(), /*amsgrad=*/false, /*maximize=*/false);
    }
  }
  return loss;
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
