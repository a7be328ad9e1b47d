#include <torch/nn/functional/loss.h>

#include <set>
#include <sstream>

#include "memtrain/config.h"
#include "memtrain/error.h"
#include "memtrain/models/gpt.h"
#include "memtrain/models/mlp.h"
#include "memtrain/models/resnet.h"

namespace memtrain {

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

int64_t Model::num_parameters() const {
  std::set<const void*> seen;
  int64_t n = 0;
  for (const auto& p : parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) n += p.numel();
  return n;
}

std::shared_ptr<Model> make_model(const ModelConfig& c, const DataInfo& data) {
  if (c.name == "gpt") {
    GPTOptions o;
    if (c.preset != "custom") {
      o = GPTOptions::preset(c.preset);
    } else {
      o.n_layer = c.n_layer, o.n_head = c.n_head, o.n_embd = c.n_embd, o.block_size = c.block_size;
    }
    o.dropout = c.dropout;
    o.bias = c.bias;
    if (c.vocab_size > 0) o.vocab_size = c.vocab_size;
    else if (c.preset == "custom" || c.preset == "tiny") o.vocab_size = data.vocab_size;
    MEMTRAIN_CHECK(o.vocab_size >= data.vocab_size, Error, "[model] vocab_size ", o.vocab_size,
                   " is smaller than the data's vocabulary (", data.vocab_size, " tokens)");
    return std::make_shared<GPT>(o);
  }
  if (c.name == "resnet") {
    ResNetOptions o;
    o.depth = c.depth, o.width = c.width, o.stem = c.stem;
    o.in_channels = data.channels, o.num_classes = data.num_classes, o.image_size = data.image_size;
    return std::make_shared<ResNet>(o);
  }
  if (c.name == "mlp") {
    MLPOptions o;
    o.in_features = data.channels * data.image_size * data.image_size;
    o.num_classes = data.num_classes;
    o.hidden.clear();
    std::stringstream ss(c.hidden);
    for (std::string item; std::getline(ss, item, ',');) o.hidden.push_back(std::stoll(item));
    return std::make_shared<MLP>(o);
  }
  throw Error("[model] unknown model '" + c.name + "'; expected gpt | resnet | mlp");
}

}  // namespace memtrain
