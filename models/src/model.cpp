#include <torch/nn/functional/loss.h>

#include <set>
#include <sstream>

#include "memtrain/core/error.h"
#include "memtrain/models/model.h"

namespace memtrain {

namespace {
const PackedLayout* g_packed = nullptr;
}  // namespace

const PackedLayout* packed_layout() { return g_packed; }

PackedScope::PackedScope(const torch::Tensor& positions, const torch::Tensor& documents) : previous_(g_packed) {
  const auto T = documents.size(1);
  const auto causal = torch::ones({T, T}, documents.options().dtype(torch::kBool)).tril();
  layout_.positions = positions;
  layout_.mask = documents.unsqueeze(2).eq(documents.unsqueeze(1)).logical_and_(causal).unsqueeze(1);  // (B, 1, T, T)
  g_packed = &layout_;
}

PackedScope::~PackedScope() { g_packed = previous_; }

namespace detail {
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  return at::linear(x, weight, bias.defined() ? std::optional<torch::Tensor>(bias) : std::nullopt);
}
}  // namespace detail

torch::Tensor Model::block(int64_t i, const torch::Tensor& h) {
  auto x = h;
  for (size_t p = 0; p < part_names().size(); ++p) x = block_part(i, p, x);
  return x;
}

torch::Tensor Model::forward(const torch::Tensor& input) {
  auto h = embed(input);
  for (int64_t i = 0; i < num_blocks(); ++i) h = block(i, h);
  return head(h);
}

torch::Tensor Model::loss(const torch::Tensor& output, const torch::Tensor& target) const {
  // Logits in bf16/fp16 (autocast) are upcast: cross-entropy in fp32, as torch.amp does.
  return torch::nn::functional::cross_entropy(output.reshape({-1, output.size(-1)}).to(torch::kFloat),
                                              target.reshape({-1}));
}

torch::Tensor Model::loss_sum(const torch::Tensor& output, const torch::Tensor& target) const {
  return torch::nn::functional::cross_entropy(
      output.reshape({-1, output.size(-1)}).to(torch::kFloat), target.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(-100));
}

TensorSplit Model::tensor_split(const std::string& name) const {
  if (!tensor_parallel()) return {};
  // LoRA's adapters (".lora_A" / ".lora_B", 7 characters): where the adapted map's weight sits decides theirs.
  if (name.ends_with(".lora_A") || name.ends_with(".lora_B"))
    return adapter_split(name, split_of(name.substr(0, name.size() - 7) + ".weight"));
  return split_of(name);
}

TransformerShape split_shape(TransformerShape shape, const TensorParallel* tp) {
  return tp ? split_transformer(shape, tp->size(), tp->sequence_parallel) : shape;
}

int64_t Model::num_parameters() const {
  std::set<const void*> seen;
  int64_t n = 0;
  for (const auto& p : parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) n += p.numel();
  return n;
}

}  // namespace memtrain
