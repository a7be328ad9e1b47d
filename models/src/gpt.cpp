#include "memtrain/models/gpt.h"

#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "memtrain/models/family.h"
#include "memtrain/core/config_json.h"
#include "memtrain/core/error.h"
#include "memtrain/core/hugging_face_config.h"
#include "memtrain/models/lora.h"
#include "memtrain/models/tensor_parallel.h"

namespace memtrain {

GPTOptions GPTOptions::preset(const std::string& name) {
  GPTOptions o;
  auto gpt2 = [&](int64_t layers, int64_t heads, int64_t embd) {
    o.vocab_size = 50257;
    o.block_size = 1024;
    o.n_layer = layers;
    o.n_head = heads;
    o.n_embd = embd;
  };
  if (name == "tiny") {
    o.n_layer = 2, o.n_head = 2, o.n_embd = 64, o.block_size = 32;
  } else if (name == "gpt2") {
    gpt2(12, 12, 768);
  } else if (name == "gpt2-medium") {
    gpt2(24, 16, 1024);
  } else if (name == "gpt2-large") {
    gpt2(36, 20, 1280);
  } else if (name == "gpt2-xl") {
    gpt2(48, 25, 1600);
  } else {
    throw Error("[model] unknown GPT preset '" + name + "'; expected tiny | gpt2 | gpt2-medium | gpt2-large | gpt2-xl");
  }
  return o;
}

namespace {
// The tensor-parallel degree a GPT is built with (1: whole), checked against its shape.
int64_t split_degree(const GPTOptions& o) {
  const int64_t T = o.build.tp ? o.build.tp->size() : 1;
  MEMTRAIN_CHECK(o.n_head % T == 0, ConfigError, "[config] dist.tensor_parallel = ", T, " must divide model.n_head = ",
                 o.n_head, " (attention is split by heads)");
  return T;
}

// A LayerNorm whose weight and bias are used on this rank's tokens (sequence parallel): their gradients summed over
// the group. Otherwise the module's own forward.
torch::Tensor layer_norm(torch::nn::LayerNormImpl& ln, const torch::Tensor& x, const TensorParallel* tp) {
  if (!tp || !tp->sequence_parallel) return ln.forward(x);
  return torch::layer_norm(x, ln.options.normalized_shape(), tensor_parallel_shared(ln.weight, tp),
                           tensor_parallel_shared(ln.bias, tp), ln.options.eps());
}

}  // namespace

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GPTOptions& o)
    : n_head(o.n_head / split_degree(o)), dropout(o.dropout), tp(o.build.tp.get()) {
  const int64_t T = split_degree(o), local = o.n_embd / T;
  c_attn = register_module("c_attn", build_linear(o.n_embd, 3 * local, o.bias, o.build));
  c_proj = register_module("c_proj", build_linear(local, o.n_embd, o.bias, o.build));
  resid_drop = register_module("resid_drop", torch::nn::Dropout(o.dropout));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x_in) {
  const auto x = tensor_parallel_enter(x_in, tp);  // split T: whole on every rank (sequence parallel: gathered)
  const auto B = x.size(0), T = x.size(1);
  const auto C = x.size(2) / (tp ? tp->size() : 1);  // this rank's heads' width
  auto qkv = detail::linear(x, *c_attn).split(C, /*dim=*/2);  // 3 x (B, T, C)
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, n_head, C / n_head}).transpose(1, 2); };
  const auto* packed = packed_layout();  // packed records: each attends to itself only
  const bool masked = packed && packed->mask.size(0) == B && packed->mask.size(-1) == T;
  auto y = at::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]),
                                            masked ? std::optional<torch::Tensor>(packed->mask) : std::nullopt,
                                            is_training() ? dropout : 0.0, /*is_causal=*/!masked);  // (B, nh, T, hs)
  y = y.transpose(1, 2).contiguous().view({B, T, C});
  return resid_drop->forward(detail::row_parallel_linear(y, *c_proj, tp));
}

MLPBlockImpl::MLPBlockImpl(const GPTOptions& o) : tp(o.build.tp.get()) {
  const int64_t T = split_degree(o);
  MEMTRAIN_CHECK(4 * o.n_embd % T == 0, ConfigError, "[config] dist.tensor_parallel = ", T, " must divide the MLP's width ",
                 4 * o.n_embd);
  c_fc = register_module("c_fc", build_linear(o.n_embd, 4 * o.n_embd / T, o.bias, o.build));
  c_proj = register_module("c_proj", build_linear(4 * o.n_embd / T, o.n_embd, o.bias, o.build));
  drop = register_module("drop", torch::nn::Dropout(o.dropout));
}

torch::Tensor MLPBlockImpl::forward(const torch::Tensor& x) {
  // GPT-2's GELU is the tanh approximation.
  auto h = torch::gelu(detail::linear(tensor_parallel_enter(x, tp), *c_fc), "tanh");
  return drop->forward(detail::row_parallel_linear(h, *c_proj, tp));
}

TransformerBlockImpl::TransformerBlockImpl(const GPTOptions& o) : tp(o.build.tp.get()) {
  ln_1 = register_module("ln_1", build_layer_norm(o.n_embd, o.build));
  attn = register_module("attn", CausalSelfAttention(o));
  ln_2 = register_module("ln_2", build_layer_norm(o.n_embd, o.build));
  mlp = register_module("mlp", MLPBlock(o));
}

torch::Tensor TransformerBlockImpl::attn_part(const torch::Tensor& x) { return x + attn->forward(layer_norm(*ln_1, x, tp)); }
torch::Tensor TransformerBlockImpl::mlp_part(const torch::Tensor& x) { return x + mlp->forward(layer_norm(*ln_2, x, tp)); }

GPT::GPT(const GPTOptions& options) : options_(options) {
  const auto& o = options_;
  MEMTRAIN_CHECK(o.n_embd % o.n_head == 0, Error, "[model] n_embd ", o.n_embd, " is not a multiple of n_head ", o.n_head);
  MEMTRAIN_CHECK(o.vocab_size > 0, Error, "[model] vocab_size must be > 0, got ", o.vocab_size);
  const int64_t T = split_degree(o);
  MEMTRAIN_CHECK(T == 1 || o.build.shapes_only, Error, "[model] a tensor-parallel GPT is built from shapes");
  const auto rows = split_range(o.vocab_size, o.build.tp ? o.build.tp->rank() : 0, static_cast<int>(T));
  vocab_begin_ = rows.begin;
  wte = register_module("wte", build_embedding(rows.count, o.n_embd, o.build));
  wpe = register_module("wpe", build_embedding(o.block_size, o.n_embd, o.build));
  drop = register_module("drop", torch::nn::Dropout(o.dropout));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.n_layer; ++i) {
    blocks.push_back(TransformerBlock(o));
    h->push_back(blocks.back());
  }
  ln_f = register_module("ln_f", build_layer_norm(o.n_embd, o.build));
  if (o.build.shapes_only) return;  // no memory yet: the trainer fills each rank's share

  // GPT-2 initialisation: N(0, 0.02) for weights, zero biases, and the residual projections scaled
  // by 1/sqrt(2 L) so that the residual stream's variance does not grow with depth.
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    const auto& name = item.key();
    auto& p = item.value();
    if (name.find("ln_") != std::string::npos) continue;  // LayerNorm keeps weight 1, bias 0
    if (name.ends_with(".bias")) {
      p.zero_();
    } else if (name.ends_with("c_proj.weight")) {
      p.normal_(0.0, 0.02 / std::sqrt(2.0 * o.n_layer));
    } else {
      p.normal_(0.0, 0.02);
    }
  }
}

torch::Tensor GPT::embed(const torch::Tensor& idx) {
  const auto T = idx.size(1);
  MEMTRAIN_CHECK(T <= options_.block_size, Error, "[model] sequence of ", T, " tokens is longer than block_size ",
                 options_.block_size);
  const auto* packed = packed_layout();  // packed records: positions restart at each record
  auto pos = packed && packed->positions.sizes() == idx.sizes()
                 ? packed->positions
                 : torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(idx.device()));
  const auto* tp = tensor_parallel();
  if (!tp) return drop->forward(wte->forward(idx) + wpe->forward(pos));
  // Split T: this rank's vocabulary rows, summed over the group (sequence parallel: this rank's tokens of the sum).
  auto tokens = tensor_parallel_exit(vocab_parallel_lookup(idx, wte->weight, vocab_begin_), tp);
  auto positions = at::embedding(tensor_parallel_shared(wpe->weight, tp), tensor_parallel_local_tokens(pos.expand(idx.sizes()), tp));
  return drop->forward(tokens + positions);
}

torch::Tensor GPT::block_part(int64_t i, size_t part, const torch::Tensor& h) {
  return part == 0 ? blocks[i]->attn_part(h) : blocks[i]->mlp_part(h);
}

std::vector<torch::Tensor> GPT::block_parameters(int64_t i) const { return blocks[i]->parameters(); }

std::optional<std::pair<torch::Tensor, torch::Tensor>> GPT::head_features(const torch::Tensor& h) {
  return std::make_pair(layer_norm(*ln_f, h, tensor_parallel()), wte->weight);  // the tied output head
}

torch::Tensor GPT::head(const torch::Tensor& h) {
  auto [features, weight] = *head_features(h);
  // Split T: logits of this rank's vocabulary rows, (B, T, V_r), for vocab_parallel_cross_entropy.
  return detail::linear(tensor_parallel_enter(features, tensor_parallel()), weight);
}

torch::Tensor GPT::loss(const torch::Tensor& output, const torch::Tensor& target) const {
  const auto* tp = tensor_parallel();
  if (!tp) return Model::loss(output, target);
  return vocab_parallel_cross_entropy(output.reshape({-1, output.size(-1)}), target.reshape({-1}), vocab_begin_, tp, false);
}

torch::Tensor GPT::loss_sum(const torch::Tensor& output, const torch::Tensor& target) const {
  const auto* tp = tensor_parallel();
  if (!tp) return Model::loss_sum(output, target);
  return vocab_parallel_cross_entropy(output.reshape({-1, output.size(-1)}), target.reshape({-1}), vocab_begin_, tp, true);
}

TensorSplit GPT::split_of(const std::string& name) const {
  const int64_t C = options_.n_embd;
  auto ends = [&](const char* suffix) { return name.ends_with(suffix); };
  if (name == "wte.weight") return {.dim = 0, .chunks = 1, .whole = options_.vocab_size};
  if (ends(".attn.c_attn.weight") || ends(".attn.c_attn.bias")) return {.dim = 0, .chunks = 3, .whole = 3 * C};
  if (ends(".attn.c_proj.weight")) return {.dim = 1, .chunks = 1, .whole = C};
  if (ends(".mlp.c_fc.weight") || ends(".mlp.c_fc.bias")) return {.dim = 0, .chunks = 1, .whole = 4 * C};
  if (ends(".mlp.c_proj.weight")) return {.dim = 1, .chunks = 1, .whole = 4 * C};
  return {};  // norms, position embeddings, the row-parallel maps' biases: whole on every rank
}

double GPT::train_flops_per_token() const {
  const auto& o = options_;
  const double n = static_cast<double>(num_parameters() - wpe->weight.numel());
  return 6.0 * n + 12.0 * o.n_layer * o.n_embd * o.block_size;
}

double GPT::block_activation_bytes(int64_t micro_batch, int64_t bytes_per_element) const {
  // Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.1):
  // a transformer layer stores s b h (34 + 5 a s / h) bytes with 16-bit activations (s the sequence, b the
  // batch, h the width, a the heads; the 5 a s^2 b term is the attention scores, their softmax and its
  // dropout mask). Scaled by the element size for fp32.
  const double s = static_cast<double>(options_.block_size), b = static_cast<double>(micro_batch);
  const double h = static_cast<double>(options_.n_embd), a = static_cast<double>(options_.n_head);
  return s * b * h * (34 + 5 * a * s / h) * static_cast<double>(bytes_per_element) / 2;
}

double GPT::train_flops_per_sample() const { return train_flops_per_token() * options_.block_size; }

std::string GPT::describe() const {
  std::ostringstream os;
  os << "GPT " << options_.n_layer << " layers x " << options_.n_embd << " wide, " << options_.n_head
     << " heads, context " << options_.block_size << ", vocab " << options_.vocab_size << ", "
     << num_parameters() << " parameters";
  return os.str();
}

int64_t GPTOptions::block_parameter_count() const {
  const int64_t C = n_embd;
  return 12 * C * C + 4 * C + (bias ? 9 * C : 0);  // qkv 3C^2, proj C^2, fc 4C^2, proj 4C^2; two LayerNorms 4C
}

TransformerShape GPTOptions::shape() const {
  const int64_t C = n_embd;
  return {.family = TransformerShape::Family::kGpt, .layers = n_layer, .hidden = C, .heads = n_head, .kv_heads = n_head,
          .ffn = 4 * C, .vocab = vocab_size, .context = block_size, .positions = block_size, .bias = bias, .tied = true,
          .dropout = dropout, .block_parameters = block_parameter_count(), .root_parameters = root_parameter_count(),
          .largest_parameter = std::max({vocab_size * C, block_size * C, 4 * C * C})};
}

int64_t GPTOptions::root_parameter_count() const { return vocab_size * n_embd + block_size * n_embd + 2 * n_embd; }


GPTOptions gpt_options(const ModelConfig& c, int64_t vocab) {
  GPTOptions o;
  if (c.preset != "custom") {
    o = GPTOptions::preset(c.preset);
  } else {
    o.n_layer = c.n_layer, o.n_head = c.n_head, o.n_embd = c.n_embd, o.block_size = c.block_size;
  }
  o.dropout = c.dropout;
  o.bias = c.bias;
  if (c.vocab_size > 0) o.vocab_size = c.vocab_size;
  else if (c.preset == "custom" || c.preset == "tiny") o.vocab_size = vocab;
  return o;
}

namespace {

// GPT-2's config.json (GPT2LMHeadModel), both ways.
void read_gpt2_config(const ConfigJson& j, HuggingFaceModel& out) {
  auto& m = out.config;
  m.name = "gpt";
  m.n_layer = j.get<int64_t>("n_layer"), m.n_head = j.get<int64_t>("n_head"), m.n_embd = j.get<int64_t>("n_embd");
  m.block_size = j.get<int64_t>("n_positions"), m.vocab_size = j.get<int64_t>("vocab_size");
  out.keys = {"model.name", "model.preset", "model.n_layer", "model.n_head", "model.n_embd", "model.block_size",
              "model.vocab_size", "model.bias"};
  m.preset = "custom", m.bias = true;
  if (j.has("n_inner") && j.get<int64_t>("n_inner") != 4 * m.n_embd)
    j.unsupported(detail::concat("n_inner = ", j.get<int64_t>("n_inner")), detail::concat("null or 4 n_embd = ", 4 * m.n_embd));
  const auto act = j.get<std::string>("activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh") j.unsupported("activation_function = " + act, "gelu_new");
  if (j.get<double>("layer_norm_epsilon", 1e-5) != 1e-5)
    j.unsupported(detail::concat("layer_norm_epsilon = ", j.get<double>("layer_norm_epsilon")), "1e-05");
  if (!j.get<bool>("tie_word_embeddings", true)) j.unsupported("tie_word_embeddings = false", "true for gpt2");
  if (j.get<bool>("scale_attn_by_inverse_layer_idx", false)) j.unsupported("scale_attn_by_inverse_layer_idx = true", "false");
  if (!j.get<bool>("scale_attn_weights", true)) j.unsupported("scale_attn_weights = false", "true");
  if (j.get<bool>("add_cross_attention", false)) j.unsupported("add_cross_attention = true", "false");
}

std::string gpt2_config_json(const ModelConfig& m, const std::string& torch_dtype) {
  nlohmann::json j;
  j = {{"architectures", {"GPT2LMHeadModel"}},
       {"model_type", "gpt2"},
       {"vocab_size", m.vocab_size},
       {"n_positions", m.block_size},
       {"n_ctx", m.block_size},
       {"n_embd", m.n_embd},
       {"n_layer", m.n_layer},
       {"n_head", m.n_head},
       {"n_inner", nullptr},
       {"activation_function", "gelu_new"},
       {"layer_norm_epsilon", 1e-5},
       {"initializer_range", 0.02},
       {"resid_pdrop", m.dropout},
       {"embd_pdrop", m.dropout},
       {"attn_pdrop", m.dropout},
       {"tie_word_embeddings", true}};
  j["torch_dtype"] = torch_dtype;
  return j.dump(2) + "\n";
}

// GPT-2's names: `transformer.` before memtrain's; c_attn, c_proj and c_fc are Conv1D, whose weight is stored
// (in, out), nn.Linear's transpose.
HuggingFaceName gpt2_name(const ModelConfig&, const std::string& parameter) {
  const bool conv1d = parameter.ends_with(".weight") && (parameter.find(".c_attn.") != std::string::npos ||
                                                         parameter.find(".c_proj.") != std::string::npos ||
                                                         parameter.find(".c_fc.") != std::string::npos);
  return {"transformer." + parameter, conv1d};
}

}  // namespace

const ModelFamily& gpt_family() {
  static const ModelFamily family{
      .config = {.name = "gpt",
                 .keys = "gpt",
                 .presets = {"custom", "tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"},
                 .fixed_keys = {"model.n_layer", "model.n_head", "model.n_embd", "model.block_size"},
                 .hf_model_types = {"gpt2"},
                 .read_hugging_face = read_gpt2_config,
                 .hugging_face_json = gpt2_config_json},
      .reads_tokens = true,
      .build = [](const ModelConfig& c, const DataInfo& data, const ParameterBuild& how) -> std::shared_ptr<Model> {
        auto o = gpt_options(c, data.vocab_size);
        check_vocabulary(o.vocab_size, data);
        o.build = how;
        return std::make_shared<GPT>(o);
      },
      // GPT-2's initialisation (the constructor's loop below, per slice): N(0, 0.02) for weights, zero biases,
      // LayerNorm 1 and 0, and the residual projections scaled by 1/sqrt(2 L).
      .init = [](const ModelConfig& c, const std::string& name) {
        if (name.find("ln_") != std::string::npos) return name.ends_with(".weight") ? InitSpec::ones() : InitSpec::zeros();
        if (name.ends_with(".bias")) return InitSpec::zeros();
        const auto layers = gpt_options(c, std::max<int64_t>(c.vocab_size, 1)).n_layer;
        return InitSpec::normal(name.ends_with("c_proj.weight") ? 0.02 / std::sqrt(2.0 * static_cast<double>(layers)) : 0.02);
      },
      .context = [](const ModelConfig& c) { return c.preset != "custom" ? GPTOptions::preset(c.preset).block_size : c.block_size; },
      .preset_vocab = [](const ModelConfig& c) -> int64_t {
        return c.preset != "custom" && c.preset != "tiny" ? GPTOptions::preset(c.preset).vocab_size : 0;
      },
      .shape = [](const ModelConfig& c, int64_t vocab) { return gpt_options(c, vocab).shape(); },
      .tensors = [](const ModelConfig& c, int64_t vocab) {
        const auto o = gpt_options(c, vocab);
        const int64_t C = o.n_embd;
        ModelTensors t;
        t.block = {3 * C * C, C * C, 4 * C * C, 4 * C * C, C, C, C, C};  // qkv, proj, fc, proj; two LayerNorms
        if (o.bias) t.block.insert(t.block.end(), {3 * C, C, 4 * C, C});
        t.root = {o.vocab_size * C, o.block_size * C, C, C};             // tied head
        t.layers = o.n_layer;
        t.block_linears = 4;
        return t;
      },
      .resolved = [](const ModelConfig& c, int64_t vocab) {
        ModelConfig m = c;
        m.preset = "custom";
        GPTOptions o = c.preset == "custom" ? GPTOptions{} : GPTOptions::preset(c.preset);
        if (c.preset == "custom") o.n_layer = c.n_layer, o.n_head = c.n_head, o.n_embd = c.n_embd, o.block_size = c.block_size;
        m.n_layer = o.n_layer, m.n_head = o.n_head, m.n_embd = o.n_embd, m.block_size = o.block_size;
        m.vocab_size = vocab;
        return m;
      },
      .embedding = "wte.weight",
      .hf_name = gpt2_name,
      .hf_optional_prefix = "transformer.",
  };
  return family;
}

}  // namespace memtrain
