// "This parameter's gradient is complete": a post-hook on each parameter's gradient accumulator (autograd's
// AccumulateGrad node, which runs once per backward for a leaf however often the graph uses it, and once per
// inner backward of a recomputed block). The hooks live as long as this object.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace memtrain {

class GradientReadyHooks {
 public:
  // ready(i) runs when params[i].grad() holds what this backward added to it (the callback may free it).
  GradientReadyHooks(const std::vector<torch::Tensor>& params, std::function<void(size_t)> ready) {
    hooks_.reserve(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(params[i]);
      auto key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [ready, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            ready(i);
            return outputs;
          }));
      hooks_.emplace_back(std::move(acc), key);  // holding the accumulator keeps it (and the hook) alive
    }
  }
  ~GradientReadyHooks() {
    for (auto& [acc, key] : hooks_) acc->del_post_hook(key);
  }
  GradientReadyHooks(const GradientReadyHooks&) = delete;
  GradientReadyHooks& operator=(const GradientReadyHooks&) = delete;

 private:
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks_;
};

}  // namespace memtrain
