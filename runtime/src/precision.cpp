#include "memtrain/runtime/precision.h"

#include <ATen/autocast_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/DeviceGuard.h>
#include <torch/nn/modules/batchnorm.h>

#include <map>
#include <set>

#include "memtrain/core/error.h"

namespace memtrain {

void cast_to_bf16_keeping_batch_norm(torch::nn::Module& module) {
  std::set<const void*> keep_fp32;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    const auto* mod = m.get();
    const bool batch_norm = dynamic_cast<const torch::nn::BatchNorm1dImpl*>(mod) != nullptr ||
                            dynamic_cast<const torch::nn::BatchNorm2dImpl*>(mod) != nullptr ||
                            dynamic_cast<const torch::nn::BatchNorm3dImpl*>(mod) != nullptr;
    if (!batch_norm) continue;
    for (const auto& p : m->parameters(/*recurse=*/false)) keep_fp32.insert(p.unsafeGetTensorImpl());
    for (const auto& b : m->buffers(/*recurse=*/false)) keep_fp32.insert(b.unsafeGetTensorImpl());
  }
  auto to_bf16 = [&](torch::Tensor& t) {
    if (t.is_floating_point() && !keep_fp32.count(t.unsafeGetTensorImpl())) t.set_data(t.data().to(torch::kBFloat16));
  };
  for (auto& p : module.parameters()) to_bf16(p);
  for (auto& b : module.buffers()) to_bf16(b);
}

Precision parse_precision(const std::string& name) {
  if (name == "fp32") return Precision::kFp32;
  if (name == "bf16") return Precision::kBf16;
  if (name == "fp16") return Precision::kFp16;
  throw ConfigError("[precision] unknown precision '" + name + "'; expected fp32 | bf16 | fp16");
}

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::kFp32: return "fp32";
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
  }
  return "?";
}

std::optional<c10::ScalarType> autocast_dtype(Precision p) {
  switch (p) {
    case Precision::kFp32: return std::nullopt;
    case Precision::kBf16: return c10::kBFloat16;
    case Precision::kFp16: return c10::kHalf;
  }
  return std::nullopt;
}

void check_precision_supported(Precision p, const c10::Device& device) {
  if (!(p == Precision::kBf16 && device.is_cuda())) return;
  const auto& cuda = at::detail::getCUDAHooks();
  const int n = cuda.hasCUDA() ? cuda.getNumGPUs() : 0;
  MEMTRAIN_CHECK(device.index() < n, ConfigError, "[precision] train.precision = bf16 on ", device.str(),
                 ": that device is not available (", n, " CUDA devices visible)");
  // CUDAHooks answers from the compute capability (>= 8.0, with cuDNN: native bf16) of the *current*
  // device; the guard makes that the requested one for the question (a CPU source file cannot include
  // the CUDA runtime headers that at::cuda::getDeviceProperties(index) needs).
  const c10::DeviceGuard on_device(device);
  MEMTRAIN_CHECK(cuda.supportsBFloat16ConvolutionWithCuDNNv8(), ConfigError, "[precision] train.precision = bf16: ",
                 device.str(), " has no native bf16 (compute capability < 8.0); use fp16");
}

AutocastGuard::AutocastGuard(c10::DeviceType device, std::optional<c10::ScalarType> dtype,
                             std::optional<bool> cache_enabled)
    : device_(device),
      prev_enabled_(at::autocast::is_autocast_enabled(device)),
      prev_dtype_(at::autocast::get_autocast_dtype(device)),
      prev_cache_(at::autocast::is_autocast_cache_enabled()) {
  // LibTorch checks nothing here (Python's autocast does): refuse dtypes autocast cannot use.
  MEMTRAIN_CHECK(!dtype || *dtype == c10::kBFloat16 || *dtype == c10::kHalf, Error,
                 "[precision] autocast dtype must be bf16 or fp16, got ", *dtype);
  at::autocast::set_autocast_enabled(device, dtype.has_value());
  if (dtype) at::autocast::set_autocast_dtype(device, *dtype);
  at::autocast::increment_nesting();
  at::autocast::set_autocast_cache_enabled(cache_enabled.value_or(prev_cache_));
}

AutocastGuard::~AutocastGuard() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_, prev_dtype_);
  at::autocast::set_autocast_cache_enabled(prev_cache_);
}

AutocastState AutocastState::current() {
  AutocastState s;
  s.cpu_enabled = at::autocast::is_autocast_enabled(c10::kCPU);
  s.cpu_dtype = at::autocast::get_autocast_dtype(c10::kCPU);
  s.cuda_enabled = at::autocast::is_autocast_enabled(c10::kCUDA);
  s.cuda_dtype = at::autocast::get_autocast_dtype(c10::kCUDA);
  return s;
}

AutocastStateGuard::AutocastStateGuard(const AutocastState& s)
    : cpu_(c10::kCPU, s.cpu_enabled ? std::optional(s.cpu_dtype) : std::nullopt),
      cuda_(c10::kCUDA, s.cuda_enabled ? std::optional(s.cuda_dtype) : std::nullopt) {}

GradScaler::GradScaler(GradScalerOptions options, c10::Device device) : options_(options) {
  MEMTRAIN_CHECK(options_.init_scale > 0, Error, "[precision] GradScaler init_scale must be > 0, got ", options_.init_scale);
  MEMTRAIN_CHECK(options_.growth_factor > 1, Error, "[precision] GradScaler growth_factor must be > 1, got ",
                 options_.growth_factor);
  MEMTRAIN_CHECK(options_.backoff_factor > 0 && options_.backoff_factor < 1, Error,
                 "[precision] GradScaler backoff_factor must be in (0, 1), got ", options_.backoff_factor);
  MEMTRAIN_CHECK(options_.growth_interval >= 1, Error, "[precision] GradScaler growth_interval must be >= 1, got ",
                 options_.growth_interval);
  auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(device);
  scale_ = torch::full({}, options_.init_scale, f32);
  growth_tracker_ = torch::zeros({}, f32.dtype(torch::kInt));
  found_inf_ = torch::zeros({}, f32);
}

torch::Tensor GradScaler::scale(const torch::Tensor& loss) {
  if (!options_.enabled) return loss;
  return loss * scale_.to(loss.dtype());
}

void GradScaler::unscale(const std::vector<torch::Tensor>& params) {
  if (!options_.enabled || unscaled_) return;  // once per optimizer step, however many micro-batches
  found_inf_.zero_();
  auto inv_scale = scale_.reciprocal();
  // _amp_foreach_non_finite_check_and_unscale_ needs one dtype/device per call: group the gradients.
  std::map<std::string, std::vector<torch::Tensor>> groups;  // key: "<dtype>/<device>"
  for (const auto& p : params) {
    const auto& g = p.grad();
    if (g.defined()) groups[std::string(c10::toString(g.scalar_type())) + "/" + g.device().str()].push_back(g);
  }
  for (auto& [key, grads] : groups) at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf_, inv_scale);
  unscaled_ = true;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer, const std::vector<torch::Tensor>& params) {
  if (!options_.enabled) {
    optimizer.step();
    return true;
  }
  // As torch.amp: a second step() before update() would step on gradients of a finished step.
  MEMTRAIN_CHECK(!stepped_, Error, "[precision] GradScaler::step() called twice without update() in between");
  stepped_ = true;
  unscale(params);
  const bool finite = found_inf_.item<float>() == 0.0f;  // the one host sync, as in torch.amp
  if (finite) optimizer.step();
  return finite;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, options_.growth_factor, options_.backoff_factor,
                         options_.growth_interval);
  unscaled_ = false;
  stepped_ = false;
}

void GradScaler::discard_step() {
  unscaled_ = false;
  stepped_ = false;
  found_inf_.zero_();
}

void GradScaler::load_state(const torch::Tensor& scale, const torch::Tensor& growth_tracker) {
  MEMTRAIN_CHECK(scale.numel() == 1 && growth_tracker.numel() == 1, Error,
                 "[precision] loss-scaler state must be two scalars, got ", scale.sizes(), " and ", growth_tracker.sizes());
  scale_.copy_(scale.reshape({}));
  growth_tracker_.copy_(growth_tracker.reshape({}));
  discard_step();
}

double GradScaler::current_scale() const { return options_.enabled ? scale_.item<double>() : 1.0; }

}  // namespace memtrain
