// Optimizers (LibTorch's AdamW and SGD), the warm-up + cosine learning-rate schedule, and gradient
// clipping that keeps the norm on the device (no host sync in the step).
//
//   auto opt = memtrain::make_optimizer({.lr = 3e-4}, model->named_parameters());
//   memtrain::CosineSchedule lr({.peak = 1e-3, .min = 1e-4, .warmup_steps = 20, .total_steps = 200});
//   memtrain::set_learning_rate(*opt, lr.at(step));
//   auto norm = memtrain::clip_grad_norm(params, 1.0);   // device tensor, read only when logging
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <optional>
#include <set>
#include <memory>
#include <string>
#include <vector>

namespace memtrain {

// What make_optimizer builds. The runtime's factory fills it from [train].
struct OptimizerOptions {
  enum class Kind { kAdamW, kAdamWLoop, kSgd, kAdamW8bit, kAdamW4bit };
  Kind kind = Kind::kAdamW;    // kAdamW: FusedAdamW; kAdamWLoop: LibTorch's per-parameter AdamW; kSgd;
                               // kAdamW8bit / kAdamW4bit: LowBitAdamW (lowbit_adamw.h)
  double lr = 1e-3;
  double weight_decay = 0.1;   // matrices and filters only
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double momentum = 0.9;       // sgd
  int64_t block = 0;           // low-bit: values per absmax; 0 = the kind's default (8-bit 256, 4-bit 128)
  int64_t min_quantized = 4096;  // low-bit: smaller parameters keep fp32 moments
};

// An optimizer whose update is element-wise with a step count per tensor, so that stepping some of its tensors at
// a time (offload's update, bucket by bucket) gives the same bits as one step(): FusedAdamW, LowBitAdamW. The
// closure and the partial steps are handled here; a subclass updates.
class PartialStepOptimizer : public torch::optim::Optimizer {
 public:
  using Optimizer::Optimizer;
  torch::Tensor step(LossClosure closure = nullptr) override;
  // Steps only `params` (some of this optimizer's), exactly as step() would step them.
  void step_only(const std::vector<torch::Tensor>& params);

 protected:
  // Updates every tensor with a gradient (only those in `only`, when given), all missing state allocated first.
  virtual void update(const std::set<const void*>* only) = 0;
};

// AdamW on ATen's fused multi-tensor kernel (_fused_adamw_, CPU and CUDA): one kernel per step
// and parameter group instead of ~10 per parameter. The same arithmetic as torch.optim.AdamW (and
// LibTorch's AdamW). State per parameter: exp_avg and exp_avg_sq (AdamWParamState, like LibTorch's)
// plus a 0-dim fp32 step counter on the parameter's device.
// All missing state is allocated before any parameter is updated: an out-of-memory error in step() leaves every
// parameter and moment as it was.
class FusedAdamW : public PartialStepOptimizer {
 public:
  FusedAdamW(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::AdamWOptions defaults);

  // The () fp32 step count the kernel reads for `param`; undefined before its first step.
  torch::Tensor step_count(const torch::Tensor& param) const;
  void set_step_count(const torch::Tensor& param, double count);
  // The next update is decided on the device: where `found_inf` (() fp32, on the parameters' device) is
  // nonzero the kernel leaves parameters and moments as they are and the step counts are taken back, as
  // torch.amp's GradScaler does with the fused kernels; the host need not read it. Undefined: always update.
  void skip_when(torch::Tensor found_inf) { found_inf_ = std::move(found_inf); }

 private:
  void update(const std::set<const void*>* only) override;
  std::map<const void*, torch::Tensor> steps_;  // per parameter: () fp32 step count
  torch::Tensor found_inf_;
};

struct LowBitOptions;
// kAdamW8bit / kAdamW4bit: the bits, block and threshold of their state; nullopt for the other kinds.
std::optional<LowBitOptions> lowbit_options(const OptimizerOptions& options);

// Weight decay goes to matrices and filters (dim >= 2) only; biases, norms and other vectors get none.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerOptions& options,
                                                        const torch::OrderedDict<std::string, torch::Tensor>& params);

// The same, with the decay / no-decay split already made (flat buckets, whose tensors are all 1-D).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerOptions& options,
                                                        const std::vector<torch::Tensor>& decay,
                                                        const std::vector<torch::Tensor>& no_decay);

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr);



// The optimizer's state for one stepped tensor, by field: AdamW (both kinds) "exp_avg", "exp_avg_sq" (the
// tensor's shape) and "step" (() int64 count of applied steps); SGD "momentum_buffer"; low-bit AdamW, for
// a quantized tensor, "exp_avg_codes", "exp_avg_sq_codes" (uint8, a value per element, or per two at 4 bits),
// "exp_avg_absmax", "exp_avg_sq_absmax" (fp32, one per block) and "step", else as AdamW. Empty before the
// tensor's first step. What a name-keyed checkpoint saves: it holds no TensorImpl address.
std::map<std::string, torch::Tensor> get_param_state(const torch::optim::Optimizer& optimizer, const torch::Tensor& param);
// Replaces that state with copies of `state` (the same fields; every tensor of the parameter's shape, or
// as many elements), on the parameter's device and dtype. Throws Error naming a missing field.
void set_param_state(torch::optim::Optimizer& optimizer, const torch::Tensor& param,
                     const std::map<std::string, torch::Tensor>& state);
// The fields get_param_state returns for a parameter of `whole_numel` elements (what a checkpoint must hold),
// each with the parameter's elements per saved value: 1 for a moment, 2 for 4-bit codes, the block for an
// absmax, 0 for the () step count. A part [begin, end) of the parameter holds values [begin / k, end / k).
struct StateField {
  std::string name;
  int64_t per_value = 1;
};
std::vector<StateField> param_state_fields(const torch::optim::Optimizer& optimizer, int64_t whole_numel = 0);
// Low-bit AdamW: the stepped tensor that is a part of a parameter of `whole_numel` elements (a ZeRO segment);
// other optimizers ignore it.
void set_whole_numel(torch::optim::Optimizer& optimizer, const torch::Tensor& stepped, int64_t whole_numel);

// Every tensor the optimizer keeps as state (AdamW: exp_avg, exp_avg_sq; SGD: momentum buffer; low-bit
// AdamW: codes and absmaxes, or the fp32 moments of what it does not quantize).
std::vector<torch::Tensor> optimizer_state_tensors(const torch::optim::Optimizer& optimizer);

struct CosineScheduleOptions {
  double peak = 1e-3;
  double min = 1e-4;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
};

// Linear warm-up from peak/warmup to peak over warmup_steps, then cosine decay to min at total_steps.
class CosineSchedule {
 public:
  explicit CosineSchedule(CosineScheduleOptions options);
  double at(int64_t step) const;  // step counts from 0

 private:
  CosineScheduleOptions options_;
};

// Scales the gradients so that their global L2 norm is at most max_norm (when max_norm > 0) and
// returns the norm before clipping, as a 0-dim fp32 tensor on the gradients' device.
torch::Tensor clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm);

}  // namespace memtrain
