#include "memtrain/runtime/checkpointing.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <mutex>
#include <numeric>
#include <sstream>
#include <unordered_set>

#include "memtrain/core/error.h"
#include "memtrain/core/memory_tracker.h"
#include "memtrain/models/model.h"
#include "memtrain/runtime/precision.h"

namespace memtrain {
namespace {

std::atomic<int64_t> g_recomputes{0};

// Set while profile_block_activations runs: recompute allocations are recorded per block.
struct ProfileSink {
  c10::Device device = c10::kCPU;
  std::vector<int64_t>* activation_bytes = nullptr;
  std::vector<int64_t>* input_bytes = nullptr;
};
ProfileSink* g_profile = nullptr;
thread_local int64_t t_block_id = -1;  // the block being run by forward_with_checkpointing

// The default generator of a device, its state saved and later restored around the recompute.
at::Generator default_generator(const c10::Device& d) { return at::globalContext().defaultGenerator(d); }

at::Tensor get_rng_state(const c10::Device& d) {
  auto g = default_generator(d);
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}

void set_rng_state(const c10::Device& d, const at::Tensor& state) {
  auto g = default_generator(d);
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

// Turns the autocast weight-cast cache off for a scope.
class AutocastCacheOff {
 public:
  AutocastCacheOff() : prev_(at::autocast::is_autocast_cache_enabled()) { at::autocast::set_autocast_cache_enabled(false); }
  ~AutocastCacheOff() { at::autocast::set_autocast_cache_enabled(prev_); }

 private:
  bool prev_;
};

// What the recompute needs, kept in the autograd context as a capsule. The parameters are held here
// rather than with save_for_backward: their version counters would then forbid the in-place optimizer
// update if a graph outlived its step, and they are leaves that autograd::grad differentiates directly.
struct RecomputeState : torch::CustomClassHolder {
  MultiBlockFn fn;
  std::vector<at::Tensor> params;
  CheckpointOptions options;
  AutocastState autocast;
  at::Tensor cpu_rng;   // CPU generator state at forward
  at::Tensor cuda_rng;  // the inputs' CUDA generator state at forward (undefined on CPU)
  c10::Device device = c10::kCPU;
  std::vector<at::Tensor> offloaded;  // the inputs, in CPU memory, when options.offload
  std::vector<c10::Device> input_devices;
  std::vector<bool> input_requires_grad;
  int64_t block_id = -1;
  int64_t input_bytes = 0;
};

// Every leaf that the outputs' graph would accumulate a gradient into.
std::vector<at::Tensor> graph_leaves(const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> leaves;
  std::vector<torch::autograd::Node*> stack;
  std::unordered_set<torch::autograd::Node*> seen;
  for (const auto& o : outputs)
    if (o.defined() && o.grad_fn()) stack.push_back(o.grad_fn().get());
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) leaves.push_back(acc->variable);
    for (const auto& edge : node->next_edges())
      if (edge.function) stack.push_back(edge.function.get());
  }
  return leaves;
}

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                at::TensorList params, c10::intrusive_ptr<RecomputeState> state) {
    // Runs under no-grad (Function::apply): nothing inside the block is saved.
    state->autocast = AutocastState::current();
    state->cpu_rng = get_rng_state(c10::kCPU);
    for (const auto& x : inputs) {
      state->input_devices.push_back(x.device());
      state->input_requires_grad.push_back(x.requires_grad());
      state->input_bytes += static_cast<int64_t>(x.numel() * x.element_size());
      if (x.is_cuda() && !state->cuda_rng.defined()) {
        state->device = x.device();
        state->cuda_rng = get_rng_state(x.device());
      }
    }
    state->params = params.vec();
    std::vector<at::Tensor> outputs;
    {
      // No autocast weight-cast cache here: a copy cast under no-grad has no grad_fn, and a recompute
      // that found it in the cache would leave the weight without gradient.
      AutocastCacheOff no_cache;
      outputs = state->fn(inputs.vec());
    }
    // Offloading moves device inputs to pinned host memory; inputs already in CPU memory stay as they are
    // (a copy would only double them).
    const bool offload = state->options.offload &&
                         std::any_of(inputs.begin(), inputs.end(), [](const at::Tensor& x) { return x.is_cuda(); });
    state->options.offload = offload;
    if (offload) {
      for (const auto& x : inputs)
        state->offloaded.push_back(x.is_cuda() ? x.to(torch::TensorOptions().device(c10::kCPU).pinned_memory(true),
                                                      /*non_blocking=*/true, /*copy=*/true)
                                               : x);
      ctx->save_for_backward({});
    } else {
      ctx->save_for_backward(inputs.vec());
    }
    // Integer outputs (indices, masks) carry no gradient.
    std::vector<at::Tensor> non_diff;
    for (const auto& o : outputs)
      if (!at::isFloatingType(o.scalar_type()) && !at::isComplexType(o.scalar_type())) non_diff.push_back(o);
    if (!non_diff.empty()) ctx->mark_non_differentiable(non_diff);
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto state = c10::static_intrusive_pointer_cast<RecomputeState>(ctx->saved_data["state"].toCapsule());
    auto saved = ctx->get_saved_variables();
    const auto n_in = state->input_requires_grad.size();
    std::vector<at::Tensor> x(n_in);
    for (size_t i = 0; i < n_in; ++i) {
      auto in = state->options.offload ? state->offloaded[i].to(state->input_devices[i], /*non_blocking=*/true)
                                       : saved[i];
      x[i] = in.detach().requires_grad_(state->input_requires_grad[i]);
    }

    int64_t before = 0;
    if (g_profile != nullptr) before = read_counters(g_profile->device).allocated;

    std::vector<at::Tensor> outputs;
    {
      // Fork the RNG: replay the forward's state, then give the caller back its own.
      auto cpu_now = get_rng_state(c10::kCPU);
      at::Tensor cuda_now;
      if (state->cuda_rng.defined()) cuda_now = get_rng_state(state->device);
      set_rng_state(c10::kCPU, state->cpu_rng);
      if (state->cuda_rng.defined()) set_rng_state(state->device, state->cuda_rng);
      {
        torch::AutoGradMode enable_grad(true);
        AutocastStateGuard autocast(state->autocast);
        AutocastCacheOff no_cache;
        outputs = state->fn(x);
      }
      set_rng_state(c10::kCPU, cpu_now);
      if (state->cuda_rng.defined()) set_rng_state(state->device, cuda_now);
    }
    g_recomputes.fetch_add(1, std::memory_order_relaxed);
    if (g_profile != nullptr && state->block_id >= 0 &&
        state->block_id < static_cast<int64_t>(g_profile->activation_bytes->size())) {
      (*g_profile->activation_bytes)[state->block_id] = read_counters(g_profile->device).allocated - before;
      (*g_profile->input_bytes)[state->block_id] = state->input_bytes;
    }

    // Gradients for the inputs and every parameter that requires one; the outer engine accumulates them.
    const auto n_params = state->params.size();
    std::vector<at::Tensor> wrt;
    std::vector<size_t> slot;  // position in the returned list
    for (size_t i = 0; i < n_in; ++i)
      if (state->input_requires_grad[i]) wrt.push_back(x[i]), slot.push_back(i);
    for (size_t i = 0; i < n_params; ++i)
      if (state->params[i].requires_grad()) wrt.push_back(state->params[i]), slot.push_back(n_in + i);
    // A leaf the block uses but was not handed would silently get no gradient: refuse instead.
    for (const auto& leaf : graph_leaves(outputs)) {
      auto same = [&](const at::Tensor& t) { return t.is_same(leaf); };
      const bool known =
          std::any_of(x.begin(), x.end(), same) || std::any_of(state->params.begin(), state->params.end(), same);
      MEMTRAIN_CHECK(known, Error, "[checkpoint] block ", state->block_id, " uses a tensor of shape ", leaf.sizes(),
                     " that requires grad but was not passed to checkpoint() as a parameter: it would get no "
                     "gradient. Pass all of the block's parameters (Model::block_parameters).");
    }
    std::vector<at::Tensor> outs, grads_in;
    for (size_t k = 0; k < outputs.size() && k < grad_outputs.size(); ++k) {
      if (outputs[k].requires_grad() && grad_outputs[k].defined()) {
        outs.push_back(outputs[k]);
        grads_in.push_back(grad_outputs[k]);
      }
    }
    torch::autograd::variable_list grads(n_in + n_params + 1);  // inputs..., params..., state (non-tensor)
    if (!wrt.empty() && !outs.empty()) {
      auto g = torch::autograd::grad(outs, wrt, grads_in, /*retain_graph=*/false, /*create_graph=*/false,
                                     /*allow_unused=*/true);
      for (size_t k = 0; k < g.size(); ++k) grads[slot[k]] = g[k];
    }
    return grads;
  }
};

}  // namespace

std::vector<torch::Tensor> checkpoint(const MultiBlockFn& fn, const std::vector<torch::Tensor>& inputs,
                                      const std::vector<torch::Tensor>& params, const CheckpointOptions& options) {
  auto needs = [](const torch::Tensor& t) { return t.requires_grad(); };
  const bool any_grad =
      std::any_of(inputs.begin(), inputs.end(), needs) || std::any_of(params.begin(), params.end(), needs);
  if (!torch::GradMode::is_enabled() || !any_grad) return fn(inputs);  // nothing to save or recompute
  for (size_t i = 0; i < inputs.size(); ++i)
    MEMTRAIN_CHECK(inputs[i].defined(), Error, "[checkpoint] input ", i,
                   " is undefined; pass only defined tensors (capture optional ones in the block function)");
  // Each tensor once: a parameter listed twice (tied weights) or also passed as an input would get its
  // gradient returned, and accumulated, twice.
  std::vector<torch::Tensor> unique;
  std::unordered_set<const void*> seen;
  for (const auto& x : inputs) seen.insert(x.unsafeGetTensorImpl());
  for (const auto& p : params)
    if (seen.insert(p.unsafeGetTensorImpl()).second) unique.push_back(p);
  auto state = c10::make_intrusive<RecomputeState>();
  state->fn = fn;
  state->options = options;
  state->block_id = t_block_id;
  return CheckpointFunction::apply(at::TensorList(inputs), at::TensorList(unique), state);
}

torch::Tensor checkpoint(const std::function<torch::Tensor(const torch::Tensor&)>& fn, const torch::Tensor& input,
                         const std::vector<torch::Tensor>& params, const CheckpointOptions& options) {
  MultiBlockFn multi = [fn](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{fn(in[0])}; };
  return checkpoint(multi, std::vector<torch::Tensor>{input}, params, options)[0];
}

int64_t checkpoint_recompute_count() { return g_recomputes.load(); }

torch::Tensor forward_with_checkpointing(Model& model, const torch::Tensor& input, const CheckpointPolicy& policy) {
  return model.head(run_blocks(model, input, policy));
}

torch::Tensor run_blocks(Model& model, const torch::Tensor& input, const CheckpointPolicy& policy) {
  auto h = model.embed(input);
  const auto parts = model.part_names();
  const CheckpointOptions options{.offload = policy.offload};
  for (int64_t i = 0; i < model.num_blocks(); ++i) {
    t_block_id = i;
    if (policy.checkpoints_block(i)) {
      h = checkpoint([&model, i](const torch::Tensor& x) { return model.block(i, x); }, h, model.block_parameters(i),
                     options);
    } else if (policy.mode == CheckpointPolicy::Mode::kPart) {
      for (size_t p = 0; p < parts.size(); ++p) {
        if (policy.checkpoints_part(parts[p])) {
          h = checkpoint([&model, i, p](const torch::Tensor& x) { return model.block_part(i, p, x); }, h,
                         model.block_parameters(i), options);
        } else {
          h = model.block_part(i, p, h);
        }
      }
    } else {
      h = model.block(i, h);
    }
  }
  t_block_id = -1;
  return h;
}

BlockActivationProfile profile_block_activations(Model& model, const std::function<torch::Tensor()>& loss_fn,
                                                 const c10::Device& device) {
  BlockActivationProfile profile;
  profile.activation_bytes.assign(model.num_blocks(), 0);
  profile.input_bytes.assign(model.num_blocks(), 0);
  ProfileSink sink{device, &profile.activation_bytes, &profile.input_bytes};
  reset_peak(device);
  const auto start = read_counters(device).allocated;
  g_profile = &sink;
  try {
    loss_fn().backward();
  } catch (...) {
    g_profile = nullptr;
    throw;
  }
  g_profile = nullptr;
  profile.all_checkpointed_peak = read_counters(device).peak_allocated - start;
  return profile;
}

std::vector<bool> plan_checkpoint_budget(const BlockActivationProfile& profile, int64_t budget_bytes) {
  const auto n = profile.activation_bytes.size();
  MEMTRAIN_CHECK(profile.all_checkpointed_peak <= budget_bytes, ConfigError, "[checkpoint] memory.recompute = budget:",
                 budget_bytes / (1024.0 * 1024.0), " MiB cannot be met: with every block checkpointed the activation "
                 "peak is ", format_bytes(profile.all_checkpointed_peak), "; the smallest feasible budget is budget:",
                 std::ceil(profile.all_checkpointed_peak / (1024.0 * 1024.0) * 100) / 100);
  // Leaving block i un-checkpointed adds what it keeps beyond its input.
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  auto extra = [&](size_t i) { return std::max<int64_t>(0, profile.activation_bytes[i] - profile.input_bytes[i]); };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return extra(a) < extra(b); });
  std::vector<bool> checkpointed(n, true);
  int64_t estimate = profile.all_checkpointed_peak;
  for (auto i : order) {
    if (estimate + extra(i) > budget_bytes) break;
    estimate += extra(i);
    checkpointed[i] = false;
  }
  return checkpointed;
}

}  // namespace memtrain
