// The Trainer's memory estimate: the probe (one forward + backward at two small micro-batches, measured
// by the same counters the tracker reads) and the inputs of estimate_memory() from this run's parts.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <functional>
#include <iostream>
#include <optional>

#include "memtrain/core/cpu_memory.h"
#include "memtrain/core/error.h"
#include "memtrain/runtime/trainer.h"

namespace memtrain {

namespace {

// For its lifetime every parameter's gradient is freed as soon as autograd has accumulated it: the
// probe then measures activations and temporaries only (several ranks keep gradients in buckets).
class DropGradients {
 public:
  explicit DropGradients(const std::vector<torch::Tensor>& params) {
    for (const auto& p : params) {
      auto acc = torch::autograd::impl::grad_accumulator(p);
      auto key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [p](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) mutable {
            p.mutable_grad().reset();
            return outputs;
          }));
      hooks_.emplace_back(acc, key);
    }
  }
  ~DropGradients() {
    for (auto& [acc, key] : hooks_) acc->del_post_hook(key);
  }
  DropGradients(const DropGradients&) = delete;
  DropGradients& operator=(const DropGradients&) = delete;

 private:
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks_;
};

}  // namespace

int64_t Trainer::probe_activations(int64_t micro_batch, bool keep_grads) {
  const c10::Device measured = device_.is_cuda() ? device_ : c10::Device(c10::kCPU);
  // What the probe's forward changes besides gradients: BatchNorm's running statistics (restored after).
  std::vector<torch::Tensor> buffers, saved;
  {
    torch::NoGradGuard no_grad;
    for (const auto& b : model_->buffers())
      if (b.is_floating_point()) buffers.push_back(b), saved.push_back(b.clone());
  }
  auto clear_grads = [&] {
    model_->zero_grad(/*set_to_none=*/true);
    for (auto& m : master_) m.mutable_grad().reset();
  };
  clear_grads();
  struct Restore {
    std::function<void()> f;
    ~Restore() { f(); }
  } restore{[&] {
    clear_grads();
    torch::NoGradGuard no_grad;
    if (!buffers.empty()) torch::_foreach_copy_(buffers, saved);
  }};
  std::optional<DropGradients> drop;
  if (!keep_grads) drop.emplace(params_);
  if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
  reset_peak(measured);
  const int64_t start = read_counters(measured).allocated;
  {
    // As a step: the batch arrives after the step's start, the loss is scaled by 1 / accum_steps.
    auto batch = to_device(data_->train_batch(0, 0, micro_batch));
    auto loss = forward_loss(batch) / static_cast<double>(config_.train.accum_steps);
    loss.backward();
    if (keep_grads) move_grads_to_masters();
  }
  if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
  return read_counters(measured).peak_allocated - start;
}

ActivationProbe Trainer::probe(bool keep_grads) {
  // Two points on the line bytes(m): half and a quarter of the configured micro-batch (1 and the batch when it
  // is 2 or 3; one point when it is 1).
  ActivationProbe p;
  const int64_t mb = config_.train.micro_batch;
  p.micro_batch[1] = std::max<int64_t>(1, mb / 2);
  p.micro_batch[0] = std::max<int64_t>(1, p.micro_batch[1] / 2);
  if (p.micro_batch[0] == p.micro_batch[1] && mb > 1) p.micro_batch[1] = mb;  // 2 or 3: probe 1 and the batch itself
  p.grads_included = keep_grads;
  for (int i = 0; i < 2; ++i)
    p.bytes[i] = i == 1 && p.micro_batch[1] == p.micro_batch[0] ? p.bytes[0] : probe_activations(p.micro_batch[i], keep_grads);
  return p;
}

EstimateInputs Trainer::estimate_inputs(int world) const {
  const auto& d = config_.dist;
  EstimateInputs in;
  in.block_elements.assign(static_cast<size_t>(model_->num_blocks()), 0);
  for (size_t i = 0; i < params_.size(); ++i)
    (units_[i] < 0 ? in.root_elements : in.block_elements[static_cast<size_t>(units_[i])]) += params_[i].numel();
  in.param_bytes = param_dtype_ == torch::kFloat ? 4 : 2;
  in.master_weights = param_dtype_ != torch::kFloat;
  const auto& opt = config_.train.optimizer;
  in.state_bytes = opt == "sgd" ? (config_.train.momentum != 0 ? 4 : 0) : 8;
  in.data_bytes = data_->resident_bytes();
  in.cuda = device_.is_cuda();
  in.world = world;
  in.stage = static_cast<int>(d.zero_stage);
  in.offload = d.offload_optimizer == "cpu";
  in.bucket_mib = d.bucket_mib;
  in.prefetch = d.prefetch;
  in.micro_batch = config_.train.micro_batch;
  in.accum_steps = config_.train.accum_steps;
  if (policy_.budget_unresolved()) in.budget_bytes = static_cast<int64_t>(policy_.budget_mib * 1024 * 1024);
  const bool sharded = world > 1 || in.offload;
  in.probe = sharded ? probe_drop_ : probe_keep_;
  if (!sharded) in.probe_dropped = probe_drop_;
  return in;
}

void Trainer::make_estimate() {
  const bool can_measure = config_.memory.track && (device_.is_cuda() || cpu_memory::installed());
  if (config_.memory.estimate && can_measure && !policy_.budget_unresolved()) {
    const bool sharded = world_.world_size > 1 || config_.dist.offload_optimizer == "cpu";
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
  const bool sharded = world > 1 || config_.dist.offload_optimizer == "cpu";
  auto& probe_for = sharded ? probe_drop_ : probe_keep_;
  MEMTRAIN_CHECK(!dp_ || world == world_.world_size, Error,
                 "[memory] estimate_for(", world, "): a multi-process trainer estimates its own world only");
  if (!probe_for.measured() && config_.memory.track && !policy_.budget_unresolved() &&
      (device_.is_cuda() || cpu_memory::installed()))
    probe_for = probe(/*keep_grads=*/!sharded);
  return estimate_inputs(world);
}

}  // namespace memtrain
