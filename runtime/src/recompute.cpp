#include "memtrain/runtime/recompute.h"

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

// For its lifetime the default generators hold the forward's states (CPU, and the inputs' CUDA device
// when there is one); the caller's own states come back on exit, also when the recompute throws.
class ReplayForwardRng {
 public:
  ReplayForwardRng(const at::Tensor& cpu_state, const at::Tensor& cuda_state, const c10::Device& cuda_device)
      : cuda_device_(cuda_device), cpu_caller_(get_rng_state(c10::kCPU)) {
    if (cuda_state.defined()) cuda_caller_ = get_rng_state(cuda_device_);
    set_rng_state(c10::kCPU, cpu_state);
    if (cuda_state.defined()) set_rng_state(cuda_device_, cuda_state);
  }
  ~ReplayForwardRng() {
    set_rng_state(c10::kCPU, cpu_caller_);
    if (cuda_caller_.defined()) set_rng_state(cuda_device_, cuda_caller_);
  }
  ReplayForwardRng(const ReplayForwardRng&) = delete;
  ReplayForwardRng& operator=(const ReplayForwardRng&) = delete;

 private:
  c10::Device cuda_device_;
  at::Tensor cpu_caller_;   // the caller's CPU generator state (~5 KB)
  at::Tensor cuda_caller_;  // the caller's CUDA generator state (16 bytes), when the inputs are on a GPU
};

// Names the block in errors: run_blocks sets the id; a direct checkpoint() call has none.
std::string block_name(int64_t block_id) {
  return block_id >= 0 ? "block " + std::to_string(block_id) : "block (a direct checkpoint() call)";
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
  // options.offload: each CUDA input copied to pinned host memory (input_bytes in all, pinned), taken
  // before the block runs so that the block cannot change it in place; CPU inputs are held as they are.
  // Freed by the backward as soon as the device copies for the recompute are queued.
  std::vector<at::Tensor> offloaded;
  // The version counters of the inputs that are not copied (shared with the caller's tensors; disabled
  // for copied and inference inputs) and their versions before the block ran: a change in place between
  // the forward and the recompute, by the block or by the caller, would change what the recompute sees.
  std::vector<c10::VariableVersion> input_versions;
  std::vector<uint32_t> input_versions_at_forward;
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

// CheckpointFunction::backward's pieces, in its order.
// The inputs as the forward saw them: none changed in place since, and (memory.offload) their copies still held.
void check_inputs_unchanged(const RecomputeState& state, const std::string& block) {
  const auto n_in = state.input_requires_grad.size();
  // Before the saved inputs are unpacked, so that this message, not autograd's generic one, names it.
  for (size_t i = 0; i < n_in; ++i) {
    const auto& counter = state.input_versions[i];
    if (!counter.enabled()) continue;
    const auto now = counter.current_version();
    MEMTRAIN_CHECK(now == state.input_versions_at_forward[i], Error, "[checkpoint] ", block, ": its input ", i,
                   " was changed in place after checkpoint() recorded it (version ",
                   state.input_versions_at_forward[i], " before the block ran, ", now,
                   " at recompute), by the block itself or by the caller: the recompute would see other values "
                   "than the forward and give a wrong gradient. Change a copy (clone()) instead, or do not "
                   "checkpoint this block");
  }
  MEMTRAIN_CHECK(!state.options.offload || state.offloaded.size() == n_in, Error, "[checkpoint] ", block,
                 ": its offloaded inputs were freed by an earlier backward through this graph; a second backward "
                 "(retain_graph = true) is not supported with memory.offload");
}

// The block's inputs for the recompute, detached, from the saved tensors or (memory.offload) copied back to their
// devices; the pinned copies are freed.
std::vector<at::Tensor> recompute_inputs(torch::autograd::AutogradContext* ctx, RecomputeState& state) {
  const auto n_in = state.input_requires_grad.size();
  auto saved = ctx->get_saved_variables();
  std::vector<at::Tensor> x(n_in);
  for (size_t i = 0; i < n_in; ++i) {
    auto in = state.options.offload ? state.offloaded[i].to(state.input_devices[i], /*non_blocking=*/true)
                                    : saved[i];
    x[i] = in.detach().requires_grad_(state.input_requires_grad[i]);
  }
  // The pinned copies are not needed past the device copies just queued: the caching host allocator
  // records the copy's stream event and reuses a block only after it, so freeing now is safe.
  state.offloaded.clear();
  state.offloaded.shrink_to_fit();
  return x;
}

// The block run again on `x` with grad enabled, under the forward's generator states and autocast; counted, and
// (profile_block_activations) its allocations recorded.
std::vector<at::Tensor> rerun_block(const RecomputeState& state, const std::vector<at::Tensor>& x) {
  int64_t before = 0;
  if (g_profile != nullptr) before = read_counters(g_profile->device).allocated;

  std::vector<at::Tensor> outputs;
  {
    ReplayForwardRng rng(state.cpu_rng, state.cuda_rng, state.device);
    torch::AutoGradMode enable_grad(true);
    AutocastStateGuard autocast(state.autocast);
    AutocastCacheOff no_cache;
    outputs = state.fn(x);
  }
  g_recomputes.fetch_add(1, std::memory_order_relaxed);
  if (g_profile != nullptr && state.block_id >= 0 &&
      state.block_id < static_cast<int64_t>(g_profile->activation_bytes->size())) {
    (*g_profile->activation_bytes)[state.block_id] = read_counters(g_profile->device).allocated - before;
    (*g_profile->input_bytes)[state.block_id] = state.input_bytes;
  }
  return outputs;
}

// Gradients for the inputs and every parameter that requires one; the outer engine accumulates them.
torch::autograd::variable_list block_gradients(const RecomputeState& state, const std::vector<at::Tensor>& x,
                                               const std::vector<at::Tensor>& outputs,
                                               const torch::autograd::variable_list& grad_outputs,
                                               const std::string& block) {
  const auto n_in = state.input_requires_grad.size();
  const auto n_params = state.params.size();
  std::vector<at::Tensor> wrt;
  std::vector<size_t> slot;  // position in the returned list
  for (size_t i = 0; i < n_in; ++i)
    if (state.input_requires_grad[i]) wrt.push_back(x[i]), slot.push_back(i);
  for (size_t i = 0; i < n_params; ++i)
    if (state.params[i].requires_grad()) wrt.push_back(state.params[i]), slot.push_back(n_in + i);
  // A leaf the block uses but was not handed would silently get no gradient: refuse instead.
  for (const auto& leaf : graph_leaves(outputs)) {
    auto same = [&](const at::Tensor& t) { return t.is_same(leaf); };
    const bool known =
        std::any_of(x.begin(), x.end(), same) || std::any_of(state.params.begin(), state.params.end(), same);
    MEMTRAIN_CHECK(known, Error, "[checkpoint] ", block, " uses a tensor of shape ", leaf.sizes(),
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

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                at::TensorList params, c10::intrusive_ptr<RecomputeState> state) {
    // Runs under no-grad (Function::apply): nothing inside the block is saved.
    state->autocast = AutocastState::current();
    state->cpu_rng = get_rng_state(c10::kCPU);
    // Offloading moves device inputs to pinned host memory; inputs already in CPU memory stay as they are
    // (a copy would only double them).
    const bool offload = state->options.offload &&
                         std::any_of(inputs.begin(), inputs.end(), [](const at::Tensor& x) { return x.is_cuda(); });
    state->options.offload = offload;
    for (const auto& x : inputs) {
      state->input_devices.push_back(x.device());
      state->input_requires_grad.push_back(x.requires_grad());
      state->input_bytes += static_cast<int64_t>(x.numel() * x.element_size());
      if (x.is_cuda() && !state->cuda_rng.defined()) {
        state->device = x.device();
        state->cuda_rng = get_rng_state(x.device());
      }
      const bool copied = offload && x.is_cuda();
      // Before the block runs: the copy is queued on the current stream ahead of the block's kernels, and
      // the version is the one the recompute must find.
      if (offload)
        state->offloaded.push_back(copied ? x.to(torch::TensorOptions().device(c10::kCPU).pinned_memory(true),
                                                 /*non_blocking=*/true, /*copy=*/true)
                                          : x);
      const auto& counter = x.unsafeGetTensorImpl()->version_counter();
      const bool tracked = !copied && counter.enabled();
      state->input_versions.push_back(tracked ? counter : c10::VariableVersion());
      state->input_versions_at_forward.push_back(tracked ? counter.current_version() : 0);
    }
    state->params = params.vec();
    std::vector<at::Tensor> outputs;
    {
      // No autocast weight-cast cache here: a copy cast under no-grad has no grad_fn, and a recompute
      // that found it in the cache would leave the weight without gradient.
      AutocastCacheOff no_cache;
      outputs = state->fn(inputs.vec());
    }
    ctx->save_for_backward(offload ? std::vector<at::Tensor>{} : inputs.vec());
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
    const auto block = block_name(state->block_id);
    // The engine runs backward in grad mode exactly when create_graph is set. The recompute's inner
    // grad() does not build a graph back to the inputs and parameters, so second-order terms would be
    // missing from the result without any sign.
    MEMTRAIN_CHECK(!torch::GradMode::is_enabled(), Error, "[checkpoint] ", block,
                   ": double backward (create_graph = true) through a checkpointed block is not supported; its "
                   "second-order terms would be silently dropped. Run this block without checkpointing "
                   "(memory.recompute = none) to differentiate twice");
    check_inputs_unchanged(*state, block);
    const auto x = recompute_inputs(ctx, *state);
    const auto outputs = rerun_block(*state, x);
    return block_gradients(*state, x, outputs, grad_outputs, block);
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

int64_t detail::current_block_id() { return t_block_id; }

torch::Tensor forward_with_checkpointing(Model& model, const torch::Tensor& input, const RecomputePolicy& policy) {
  return model.head(run_blocks(model, input, policy));
}

namespace {
// Sets this thread's current block while run_blocks runs, and restores the previous one on exit, also
// when a block throws (a stale id would name the wrong block in a later checkpoint error).
class CurrentBlockScope {
 public:
  CurrentBlockScope() : previous_(t_block_id) {}
  ~CurrentBlockScope() { t_block_id = previous_; }
  CurrentBlockScope(const CurrentBlockScope&) = delete;
  CurrentBlockScope& operator=(const CurrentBlockScope&) = delete;
  void set(int64_t block) { t_block_id = block; }

 private:
  int64_t previous_;
};
}  // namespace

torch::Tensor run_blocks(Model& model, const torch::Tensor& input, const RecomputePolicy& policy, BlockHooks* hooks) {
  auto h = model.embed(input);
  const auto parts = model.part_names();
  const CheckpointOptions options{.offload = policy.offload};
  CurrentBlockScope current;
  for (int64_t i = 0; i < model.num_blocks(); ++i) {
    current.set(i);
    if (hooks) hooks->before_block(i);
    if (policy.checkpoints_block(i)) {
      h = checkpoint([&model, i](const torch::Tensor& x) { return model.block(i, x); }, h, model.block_parameters(i),
                     options);
    } else if (policy.mode == RecomputePolicy::Mode::kPart) {
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
    if (hooks) {
      hooks->after_block(i);
      if (h.requires_grad()) h.register_hook([hooks, i](const torch::Tensor&) { hooks->before_block_backward(i); });
    }
  }
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
