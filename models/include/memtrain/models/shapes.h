// Parameters built from shapes alone (issue 36's construction): each has its real sizes, dtype and device but a
// zero-byte storage, the state a ZeRO-3 parameter is in between gathers. Nothing is allocated and no random number
// is drawn; the trainer gives each rank memory for its share and fills it (from model.init_from or the counter-based
// generator, core/counter_rng.h). LibTorch 2.11 cannot set_data between a meta tensor and a dense one
// (TensorImpl::has_compatible_shallow_copy_type lists no Meta), so a meta-built model could never be materialised in
// place; a zero-byte dense tensor can, through set_data or a view into a bucket, as ZeRO-3 already does.
//
//   ParameterBuild b{.shapes_only = true, .dtype = torch::kBFloat16};
//   auto fc = build_linear(4096, 14336, /*bias=*/false, b);   // fc->weight: (14336, 4096), 0 bytes
//   has_no_memory(fc->weight);                                  // true
#pragma once

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/types.h>

#include <memory>
#include <string>

namespace memtrain {

struct TensorParallel;  // tensor_parallel.h

struct ParameterBuild {
  bool shapes_only = false;             // sizes without memory; false: LibTorch's modules as they initialise
  c10::ScalarType dtype = torch::kFloat;  // shapes_only: the parameters' dtype (train.param_dtype)
  c10::Device device = torch::kCPU;     // shapes_only: where their memory will be
  // dist.tensor_parallel > 1: the group this model is split over; its split matrices are built as this rank's slices
  // (GPT and the Llama family; others refuse it). Null: whole.
  std::shared_ptr<const TensorParallel> tp = nullptr;
};

// A tensor of `sizes` whose storage holds no bytes (never read it before it is given memory).
torch::Tensor shapes_only_tensor(c10::IntArrayRef sizes, const ParameterBuild& b);
// Whether a tensor with elements has no memory behind it (built from shapes, or a ZeRO-3 parameter between gathers).
bool has_no_memory(const torch::Tensor& t);

// The modules memtrain's models are made of: LibTorch's own, with their parameters from shapes when b.shapes_only
// (built at size 0 first, so LibTorch's reset() allocates and draws nothing), else exactly LibTorch's.
torch::nn::Linear build_linear(int64_t in, int64_t out, bool bias, const ParameterBuild& b);
torch::nn::Embedding build_embedding(int64_t count, int64_t dim, const ParameterBuild& b);
torch::nn::LayerNorm build_layer_norm(int64_t dim, const ParameterBuild& b);
// A norm's scale: ones, or from shapes.
torch::Tensor ones_or_shapes(int64_t dim, const ParameterBuild& b);

// How a parameter starts when no checkpoint gives it (a family's table, ModelFamily::init): its values are drawn
// from the counter-based stream of (train.seed, its name), so any slice is computed alone and equals the same
// slice of the whole, at every world size, ZeRO stage, bucket size and device.
struct InitSpec {
  enum class Kind { kZeros, kOnes, kNormal, kUniform };
  Kind kind = Kind::kZeros;
  double a = 0, b = 0;  // normal: mean, standard deviation; uniform: [low, high)
  static InitSpec zeros() { return {}; }
  static InitSpec ones() { return {Kind::kOnes}; }
  static InitSpec normal(double stddev) { return {Kind::kNormal, 0.0, stddev}; }
  static InitSpec uniform(double low, double high) { return {Kind::kUniform, low, high}; }
};
// `out` (contiguous fp32 on the CPU) receives elements [begin, begin + out.numel()) of parameter `name`'s
// flattened initial values.
void fill_initial(const torch::Tensor& out, const InitSpec& spec, uint64_t seed, const std::string& name, int64_t begin);

}  // namespace memtrain
