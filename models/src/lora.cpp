#include "memtrain/models/lora.h"

#include <torch/nn/functional/dropout.h>
#include <torch/nn/init.h>

#include <cmath>
#include <regex>
#include <set>

#include "memtrain/core/error.h"
#include "memtrain/models/nf4.h"
#include "memtrain/models/tensor_parallel.h"

namespace memtrain {

namespace {
// What an adapted module carries besides its two parameters: the scale and the dropout.
struct Adapter : torch::nn::Module {
  double scale = 1.0;
  double dropout = 0.0;
  const TensorParallel* tp = nullptr;  // the model's, when its map is split: column (split_dim 0) or row (1)
  int split_dim = -1;
};

std::string last_part(const std::string& path) { return path.substr(path.rfind('.') + 1); }
}  // namespace

std::vector<std::string> add_lora(Model& model, const LoraOptions& o) {
  MEMTRAIN_CHECK(o.rank > 0, ConfigError, "[lora] lora.rank must be > 0, got ", o.rank);
  std::vector<std::string> adapted;
  std::set<std::string> linear_names, hit;
  torch::NoGradGuard no_grad;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto* linear = dynamic_cast<torch::nn::LinearImpl*>(item.value().get());
    if (!linear) continue;
    const auto name = last_part(item.key());
    linear_names.insert(name);
    MEMTRAIN_CHECK(name != "lm_head" || std::find(o.targets.begin(), o.targets.end(), name) == o.targets.end(),
                   ConfigError, "[config] lora.targets: adapters on the output head (lm_head) are not supported");
    if (std::find(o.targets.begin(), o.targets.end(), name) == o.targets.end()) continue;
    const auto out = linear->weight.size(0), in = linear->weight.size(1);
    // peft's init: A as nn.Linear's default (kaiming_uniform_ with a = sqrt 5, i.e. U(-1/sqrt(in), 1/sqrt(in))), B zero.
    auto a = torch::empty({o.rank, in}, linear->weight.options().dtype(torch::kFloat));
    torch::nn::init::kaiming_uniform_(a, std::sqrt(5.0));
    linear->register_parameter("lora_A", a);                                                   // (rank, in)
    linear->register_parameter("lora_B", torch::zeros({out, o.rank}, a.options()));            // (out, rank)
    auto adapter = std::make_shared<Adapter>();
    adapter->scale = o.alpha / static_cast<double>(o.rank), adapter->dropout = o.dropout;
    // Tensor parallel: the local weight's sizes give A and B theirs (a column-parallel map's B has its rows, a
    // row-parallel map's A its columns); the forward needs to know which.
    if (const auto* tp = model.tensor_parallel(); tp && tp->size() > 1)
      adapter->tp = tp, adapter->split_dim = model.tensor_split(item.key() + ".weight").dim;
    linear->register_module("lora_settings", adapter);
    adapted.push_back(item.key());
    hit.insert(name);
  }
  for (const auto& t : o.targets) {
    if (hit.count(t)) continue;
    std::string known;
    for (const auto& n : linear_names) known += (known.empty() ? "" : ", ") + n;
    throw ConfigError(detail::concat("[config] lora.targets: '", t, "' names no linear map of this model; its are: ", known));
  }
  return adapted;
}

bool is_lora_parameter(const std::string& name) {
  return name.ends_with(".lora_A") || name.ends_with(".lora_B") || name == "lora_A" || name == "lora_B";
}

int64_t freeze_all_but_lora(Model& model) {
  int64_t frozen = 0;
  for (auto& item : model.named_parameters())
    if (!is_lora_parameter(item.key()) && item.value().requires_grad()) item.value().requires_grad_(false), ++frozen;
  return frozen;
}

int64_t freeze_matching(Model& model, const std::string& pattern) {
  const std::regex re(pattern);
  int64_t matched = 0, total = 0;
  for (auto& item : model.named_parameters()) {
    ++total;
    if (std::regex_match(item.key(), re)) item.value().requires_grad_(false), ++matched;
  }
  MEMTRAIN_CHECK(matched > 0, ConfigError, "[config] train.freeze = '", pattern, "' matches none of the model's ", total,
                 " parameters (it must match whole names; memtrain --print-parameters lists them)");
  MEMTRAIN_CHECK(matched < total, ConfigError, "[config] train.freeze = '", pattern, "' matches all ", total,
                 " parameters: nothing would train");
  return matched;
}

namespace detail {
namespace {
const Adapter* adapter_of(torch::nn::LinearImpl& m) {
  const auto children = m.named_children();
  const auto* settings = children.find("lora_settings");
  return settings ? static_cast<const Adapter*>(settings->get()) : nullptr;
}
torch::Tensor adapter_input(const torch::Tensor& x, const Adapter& s, const torch::nn::LinearImpl& m) {
  return s.dropout > 0 && m.is_training() ? torch::dropout(x, s.dropout, /*train=*/true) : x;
}
}  // namespace

torch::Tensor linear(const torch::Tensor& x, torch::nn::LinearImpl& m) {
  const auto* nf4 = nf4_format_of(m);  // a frozen weight stored in NF4: dequantized inside the product
  auto y = nf4 ? nf4_linear(x, m.weight, *nf4, m.bias) : detail::linear(x, m.weight, m.bias);
  const auto* s = adapter_of(m);
  if (!s) return y;
  const auto params = m.named_parameters(/*recurse=*/false);
  auto a = params["lora_A"];
  if (s->split_dim == 0) a = tensor_parallel_summed_gradient(a, s->tp);
  // peft's order: lora_B(lora_A(dropout(x))) * scaling, added to the base output.
  return y + detail::linear(detail::linear(adapter_input(x, *s, m), a), params["lora_B"]) * s->scale;
}

torch::Tensor row_parallel_linear(const torch::Tensor& y, torch::nn::LinearImpl& m, const TensorParallel* tp) {
  if (!tp || tp->size() == 1) return linear(y, m);
  const auto* nf4 = nf4_format_of(m);  // an NF4 slice: this rank's columns dequantized inside the partial product
  auto out = row_parallel_output(nf4 ? nf4_linear(y, m.weight, *nf4) : at::linear(y, m.weight), m.bias, tp);
  const auto* s = adapter_of(m);
  if (!s) return out;
  const auto params = m.named_parameters(/*recurse=*/false);
  // A's columns are this rank's input features: A y is a partial sum, completed as the base's product is (its tokens
  // scattered with sequence parallelism); B is whole, used on this rank's tokens (tensor_parallel_shared).
  const auto u = tensor_parallel_exit(at::linear(adapter_input(y, *s, m), params["lora_A"]), tp);
  return out + at::linear(u, tensor_parallel_shared(params["lora_B"], tp)) * s->scale;
}
}  // namespace detail

}  // namespace memtrain
