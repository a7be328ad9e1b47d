// Mixed precision: an RAII autocast guard and an fp16 gradient scaler.
//
//   {
//     memtrain::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);   // forward in bf16
//     loss = model->loss(model->forward(x), y);
//   }                                                // outermost guard exits: weight-cast cache cleared
//   scaler.scale(loss).backward();                  // backward outside autocast
//   scaler.unscale(params); clip...; scaler.step(optimizer); scaler.update();
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <optional>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace memtrain {

enum class Precision { kFp32, kBf16, kFp16 };
Precision parse_precision(const std::string& name);  // fp32 | bf16 | fp16
const char* precision_name(Precision p);
// The autocast dtype of a precision (nullopt for fp32).
std::optional<c10::ScalarType> autocast_dtype(Precision p);
// Refuses combinations the hardware cannot run: bf16 on a CUDA device without native bf16 (compute capability < 8.0):
// the capability of `device` itself, not of the thread's current CUDA device. fp16 runs anywhere: CPU autocast casts
// to fp16 as torch.autocast("cpu", torch.float16) does, and the loss scaler's ATen kernels run on a CPU as
// torch.amp.GradScaler("cpu") does (fast only where the CPU has fp16 arithmetic, as bf16).
void check_precision_supported(Precision p, const c10::Device& device);

// train.param_dtype = bf16: the module's floating parameters and buffers become bf16 in place (their
// TensorImpl kept), except BatchNorm's affine parameters and running statistics, which stay fp32 as PyTorch
// FSDP's MixedPrecision keeps them by default: running statistics averaged in bf16 lose most of each update
// (8 bits of mantissa against momentum 0.1), and ATen's batch_norm takes a bf16 input with fp32 weight and
// statistics (CPU and CUDA), returning bf16. They cost 4 bytes each instead of 2: 2 x channels parameters
// and 2 x channels statistics per BatchNorm, small beside the convolutions. Integer buffers (BatchNorm's
// step counter) are left alone, which Module::to(dtype) would not do.
void cast_to_bf16_keeping_batch_norm(torch::nn::Module& module);

// Enables autocast for one device type in this thread, with `dtype`; nullopt disables it (a region
// that must stay fp32 inside an autocast one). `cache_enabled`: the weight-cast cache setting; nullopt
// keeps the current one, as torch.autocast(cache_enabled=None) does, so a guard opened inside a
// checkpointed block does not turn back on the cache that checkpointing turned off. Restores the
// previous state on exit, and clears the weight-cast cache when the outermost guard exits, so no
// stale low-precision copy of a weight outlives the forward pass that made it. Not copyable; nests.
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, std::optional<c10::ScalarType> dtype,
                std::optional<bool> cache_enabled = std::nullopt);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
  bool prev_cache_;
};

// The autocast state of this thread for CPU and CUDA, to be re-entered later (checkpoint recompute).
struct AutocastState {
  bool cpu_enabled = false;
  c10::ScalarType cpu_dtype = c10::kBFloat16;
  bool cuda_enabled = false;
  c10::ScalarType cuda_dtype = c10::kHalf;
  static AutocastState current();
};

// Re-enters a recorded AutocastState for its lifetime.
class AutocastStateGuard {
 public:
  explicit AutocastStateGuard(const AutocastState& state);
  AutocastStateGuard(const AutocastStateGuard&) = delete;
  AutocastStateGuard& operator=(const AutocastStateGuard&) = delete;

 private:
  AutocastGuard cpu_, cuda_;
};

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16, torch.amp.GradScaler's default
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;
};

// Dynamic loss scaling for fp16, on ATen's _amp_foreach_non_finite_check_and_unscale_ and
// _amp_update_scale_: the same arithmetic as torch.amp.GradScaler. Scale and growth tracker live on
// the gradients' device; the only host read is the found-inf flag in step().
class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {}, c10::Device device = c10::kCPU);

  torch::Tensor scale(const torch::Tensor& loss);  // loss * scale
  // Divides the gradients by the scale (once per optimizer step) and records whether any is inf/NaN.
  void unscale(const std::vector<torch::Tensor>& params);
  // Runs optimizer.step() unless a non-finite gradient was found; returns whether it stepped.
  bool step(torch::optim::Optimizer& optimizer, const std::vector<torch::Tensor>& params);
  // Backs the scale off after a non-finite step, grows it after growth_interval finite ones.
  void update();

  // Forgets a step that was abandoned part way (an out-of-memory retry): without it, an exception between
  // unscale() and update() leaves the next step's gradients un-unscaled and step() refusing to run.
  void discard_step();

  double current_scale() const;  // host read, for logging
  // The state a training checkpoint keeps: () fp32 scale and () int32 count of finite steps since the
  // last change; load_state copies them in (onto this scaler's device).
  const torch::Tensor& scale_tensor() const { return scale_; }
  const torch::Tensor& growth_tracker() const { return growth_tracker_; }
  void load_state(const torch::Tensor& scale, const torch::Tensor& growth_tracker);
  // This step's found-inf flag, () fp32, set by unscale(): several ranks MAX-reduce it before step().
  torch::Tensor& found_inf() { return found_inf_; }
  bool enabled() const { return options_.enabled; }
  const GradScalerOptions& options() const { return options_; }

 private:
  GradScalerOptions options_;
  torch::Tensor scale_;           // () fp32
  torch::Tensor growth_tracker_;  // () int32: finite steps since the last change
  torch::Tensor found_inf_;       // () fp32: 1 if this step's gradients had inf/NaN
  bool unscaled_ = false;
  bool stepped_ = false;
};

}  // namespace memtrain
