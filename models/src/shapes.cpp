#include "memtrain/models/shapes.h"

#include "memtrain/core/counter_rng.h"
#include "memtrain/core/error.h"

namespace memtrain {

torch::Tensor shapes_only_tensor(c10::IntArrayRef sizes, const ParameterBuild& b) {
  auto t = torch::empty({0}, torch::TensorOptions().dtype(b.dtype).device(b.device));  // the real allocator, 0 bytes
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

bool has_no_memory(const torch::Tensor& t) {
  return t.defined() && t.numel() > 0 && t.storage().nbytes() == 0;
}

namespace {
// Replaces a registered parameter's tensor keeping its identity (set_data: dense to dense), with requires_grad.
void give_shape(torch::Tensor& p, c10::IntArrayRef sizes, const ParameterBuild& b) {
  torch::NoGradGuard no_grad;
  p.set_data(shapes_only_tensor(sizes, b));
}
}  // namespace

torch::nn::Linear build_linear(int64_t in, int64_t out, bool bias, const ParameterBuild& b) {
  if (!b.shapes_only) return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
  torch::nn::Linear m(torch::nn::LinearOptions(in, 0).bias(bias));  // a (0, in) weight: nothing drawn
  m->options.out_features(out);
  give_shape(m->weight, {out, in}, b);
  if (bias) give_shape(m->bias, {out}, b);
  return m;
}

torch::nn::Embedding build_embedding(int64_t count, int64_t dim, const ParameterBuild& b) {
  if (!b.shapes_only) return torch::nn::Embedding(count, dim);
  torch::nn::Embedding m(torch::nn::EmbeddingOptions(0, dim));
  m->options.num_embeddings(count);
  give_shape(m->weight, {count, dim}, b);
  return m;
}

torch::nn::LayerNorm build_layer_norm(int64_t dim, const ParameterBuild& b) {
  if (!b.shapes_only) return torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}));
  torch::nn::LayerNorm m(torch::nn::LayerNormOptions({0}));
  m->options.normalized_shape({dim});
  give_shape(m->weight, {dim}, b);
  give_shape(m->bias, {dim}, b);
  return m;
}

torch::Tensor ones_or_shapes(int64_t dim, const ParameterBuild& b) {
  return b.shapes_only ? shapes_only_tensor({dim}, b) : torch::ones({dim});
}

void fill_initial(const torch::Tensor& out, const InitSpec& spec, uint64_t seed, const std::string& name, int64_t begin) {
  MEMTRAIN_CHECK(out.is_cpu() && out.scalar_type() == torch::kFloat && out.is_contiguous(), Error,
                 "[model] initial values of '", name, "' are made in a contiguous fp32 CPU tensor");
  switch (spec.kind) {
    case InitSpec::Kind::kZeros: out.zero_(); break;
    case InitSpec::Kind::kOnes: out.fill_(1.0); break;
    case InitSpec::Kind::kNormal: fill_normal(out, seed, name, begin, spec.a, spec.b); break;
    case InitSpec::Kind::kUniform: fill_uniform(out, seed, name, begin, spec.a, spec.b); break;
  }
}

}  // namespace memtrain
