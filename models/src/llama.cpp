#include "memtrain/models/llama.h"

#include <ATen/autocast_mode.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <sstream>

#include "memtrain/models/family.h"
#include "memtrain/core/config_json.h"
#include "memtrain/core/error.h"
#include "memtrain/core/hugging_face_config.h"
#include "memtrain/models/lora.h"

namespace memtrain {

namespace {
struct Preset {
  const char* name;
  int64_t vocab, hidden, ffn, layers, heads, kv_heads;
  double theta, eps;
  bool tied, qkv_bias;
  double llama3_factor;  // 0: no rope scaling
};
// The published config.json of each (meta-llama/Llama-3.2-1B, -3.2-3B, -3.1-8B; Qwen/Qwen2.5-0.5B, -7B;
// mistralai/Mistral-7B-v0.1). Llama 3.x scale rope with llama3 (low 1, high 4, original 8192).
constexpr Preset kPresets[] = {
    {"llama-3.2-1b", 128256, 2048, 8192, 16, 32, 8, 500000.0, 1e-5, true, false, 32.0},
    {"llama-3.2-3b", 128256, 3072, 8192, 28, 24, 8, 500000.0, 1e-5, true, false, 32.0},
    {"llama-3.1-8b", 128256, 4096, 14336, 32, 32, 8, 500000.0, 1e-5, false, false, 8.0},
    {"llama-3.1-70b", 128256, 8192, 28672, 80, 64, 8, 500000.0, 1e-5, false, false, 8.0},
    {"qwen2.5-0.5b", 151936, 896, 4864, 24, 14, 2, 1000000.0, 1e-6, true, true, 0.0},
    {"qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4, 1000000.0, 1e-6, false, true, 0.0},
    {"mistral-7b", 32000, 4096, 14336, 32, 32, 8, 10000.0, 1e-5, false, false, 0.0},
};
std::vector<std::string> llama_presets() {
  std::vector<std::string> out{"custom"};
  for (const auto& p : kPresets) out.emplace_back(p.name);
  return out;
}
}  // namespace

std::string LlamaOptions::preset_names() {
  std::string out;
  for (const auto& p : kPresets) out.append(out.empty() ? "" : " | ").append(p.name);
  return out;
}

LlamaOptions LlamaOptions::preset(const std::string& name) {
  for (const auto& p : kPresets) {
    if (name != p.name) continue;
    LlamaOptions o;
    o.vocab_size = p.vocab, o.n_embd = p.hidden, o.ffn_hidden = p.ffn, o.n_layer = p.layers;
    o.n_head = p.heads, o.n_kv_head = p.kv_heads, o.rope_theta = p.theta, o.norm_eps = p.eps;
    o.tie_embeddings = p.tied, o.qkv_bias = p.qkv_bias;
    if (p.llama3_factor > 0) o.rope_scaling = {.type = "llama3", .factor = p.llama3_factor};
    return o;
  }
  throw Error("[model] unknown Llama preset '" + name + "'; expected " + preset_names());
}

int64_t LlamaOptions::block_parameter_count() const {
  const int64_t C = n_embd, kv = n_kv_head * head_dim(), q = n_head * head_dim(), F = ffn_hidden;
  const int64_t attn = C * q + 2 * C * kv + q * C + (qkv_bias ? q + 2 * kv : 0) + (out_bias ? C : 0);
  const int64_t mlp = 3 * C * F + (mlp_bias ? 2 * F + C : 0);
  return attn + mlp + 2 * C;
}

TransformerShape LlamaOptions::shape() const {
  const int64_t C = n_embd;
  return {.family = TransformerShape::Family::kLlama, .layers = n_layer, .hidden = C, .heads = n_head,
          .kv_heads = n_kv_head, .ffn = ffn_hidden, .vocab = vocab_size, .context = block_size, .positions = 0,
          .bias = qkv_bias || out_bias || mlp_bias, .tied = tie_embeddings, .dropout = 0,
          .block_parameters = block_parameter_count(), .root_parameters = root_parameter_count(),
          .largest_parameter = std::max(vocab_size * C, C * ffn_hidden)};
}

int64_t LlamaOptions::root_parameter_count() const { return vocab_size * n_embd * (tie_embeddings ? 1 : 2) + n_embd; }

int64_t LlamaOptions::parameter_count() const { return n_layer * block_parameter_count() + root_parameter_count(); }

namespace {
// The tensor-parallel degree a Llama is built with (1: whole), checked against its shape.
int64_t split_degree(const LlamaOptions& o) {
  const int64_t T = o.build.tp ? o.build.tp->size() : 1;
  MEMTRAIN_CHECK(o.n_head % T == 0 && o.n_kv_head % T == 0, ConfigError, "[config] dist.tensor_parallel = ", T,
                 " must divide model.n_head = ", o.n_head, " and model.n_kv_head = ", o.n_kv_head,
                 " (attention is split by heads; grouped key/value heads are not replicated)");
  MEMTRAIN_CHECK(o.ffn_hidden % T == 0, ConfigError, "[config] dist.tensor_parallel = ", T,
                 " must divide the MLP's width model.ffn_hidden = ", o.ffn_hidden);
  return T;
}
}  // namespace

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_, const ParameterBuild& build) : eps(eps_), tp(build.tp.get()) {
  weight = register_parameter("weight", ones_or_shapes(dim, build));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  // As transformers' LlamaRMSNorm: normalised in fp32, cast back to the input's dtype, then scaled. On CUDA ATen's
  // rms_norm normalises in one fused kernel (forward and backward; fp32 arithmetic, the input's dtype out), about
  // eight kernels fewer; on a CPU it is the same ops composed, slower than these (measured: 14.3 against 11.2 ms).
  if (x.is_cuda()) return tensor_parallel_shared(weight, tp) * at::rms_norm(x, {x.size(-1)}, std::nullopt, eps);
  auto x32 = x.to(torch::kFloat);
  auto normed = x32 * torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return tensor_parallel_shared(weight, tp) * normed.to(x.scalar_type());
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaOptions& o)
    : n_head(o.n_head / split_degree(o)), n_kv_head(o.n_kv_head / split_degree(o)), head_dim(o.head_dim()),
      tp(o.build.tp.get()) {
  auto linear = [&](int64_t in, int64_t out, bool bias) { return build_linear(in, out, bias, o.build); };
  q_proj = register_module("q_proj", linear(o.n_embd, n_head * head_dim, o.qkv_bias));
  k_proj = register_module("k_proj", linear(o.n_embd, n_kv_head * head_dim, o.qkv_bias));
  v_proj = register_module("v_proj", linear(o.n_embd, n_kv_head * head_dim, o.qkv_bias));
  o_proj = register_module("o_proj", linear(n_head * head_dim, o.n_embd, o.out_bias));
}

namespace {
// (B, H, T, hd): x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1] for the halves x1, x2 of hd.
torch::Tensor apply_rotary(const torch::Tensor& x, const RotaryTables& rope) {
  const auto half = x.size(-1) / 2;
  auto rotated = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * rope.cos + rotated * rope.sin;
}
}  // namespace

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& x_in, const RotaryTables& rope) {
  const auto x = tensor_parallel_enter(x_in, tp);  // split T: whole on every rank (sequence parallel: gathered)
  const auto B = x.size(0), T = x.size(1);
  auto heads = [&](const torch::Tensor& t, int64_t n) { return t.view({B, T, n, head_dim}).transpose(1, 2); };
  auto q = apply_rotary(heads(detail::linear(x, *q_proj), n_head), rope);     // (B, nh, T, hd)
  auto k = apply_rotary(heads(detail::linear(x, *k_proj), n_kv_head), rope);  // (B, nkv, T, hd)
  auto v = heads(detail::linear(x, *v_proj), n_kv_head);
  const auto* packed = packed_layout();  // packed records: each attends to itself only
  const bool masked = packed && packed->mask.size(0) == B && packed->mask.size(-1) == T;
  auto y = at::scaled_dot_product_attention(q, k, v, masked ? std::optional<torch::Tensor>(packed->mask) : std::nullopt,
                                            /*dropout_p=*/0.0, /*is_causal=*/!masked, /*scale=*/std::nullopt,
                                            /*enable_gqa=*/n_kv_head != n_head);
  y = y.transpose(1, 2).reshape({B, T, n_head * head_dim});
  return detail::row_parallel_linear(y, *o_proj, tp);
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaOptions& o) : tp(o.build.tp.get()) {
  auto linear = [&](int64_t in, int64_t out) { return build_linear(in, out, o.mlp_bias, o.build); };
  const int64_t F = o.ffn_hidden / split_degree(o);
  gate_proj = register_module("gate_proj", linear(o.n_embd, F));
  up_proj = register_module("up_proj", linear(o.n_embd, F));
  down_proj = register_module("down_proj", linear(F, o.n_embd));
}

torch::Tensor LlamaMLPImpl::forward(const torch::Tensor& x_in) {
  const auto x = tensor_parallel_enter(x_in, tp);
  auto gate = torch::silu(detail::linear(x, *gate_proj));
  auto product = gate * detail::linear(x, *up_proj);
  return detail::row_parallel_linear(product, *down_proj, tp);
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaOptions& o) {
  input_layernorm = register_module("input_layernorm", RMSNorm(o.n_embd, o.norm_eps, o.build));
  self_attn = register_module("self_attn", LlamaAttention(o));
  post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(o.n_embd, o.norm_eps, o.build));
  mlp = register_module("mlp", LlamaMLP(o));
}

LlamaBodyImpl::LlamaBodyImpl(const LlamaOptions& o) {
  const auto rows = split_range(o.vocab_size, o.build.tp ? o.build.tp->rank() : 0, static_cast<int>(split_degree(o)));
  embed_tokens = register_module("embed_tokens", build_embedding(rows.count, o.n_embd, o.build));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.n_layer; ++i) {
    blocks.push_back(LlamaDecoderLayer(o));
    layers->push_back(blocks.back());
  }
  norm = register_module("norm", RMSNorm(o.n_embd, o.norm_eps, o.build));
}

Llama::Llama(const LlamaOptions& options) : options_(options) {
  const auto& o = options_;
  MEMTRAIN_CHECK(o.n_embd % o.n_head == 0, Error, "[model] n_embd ", o.n_embd, " is not a multiple of n_head ", o.n_head);
  MEMTRAIN_CHECK(o.head_dim() % 2 == 0, Error, "[model] the head width ", o.head_dim(), " must be even for rotary embeddings");
  MEMTRAIN_CHECK(o.n_kv_head >= 1 && o.n_head % o.n_kv_head == 0, Error, "[model] n_head ", o.n_head,
                 " is not a multiple of n_kv_head ", o.n_kv_head);
  MEMTRAIN_CHECK(o.vocab_size > 0 && o.ffn_hidden > 0, Error, "[model] vocab_size ", o.vocab_size, " and ffn_hidden ",
                 o.ffn_hidden, " must be > 0");
  MEMTRAIN_CHECK(o.rope_scaling.type == "none" || o.rope_scaling.type == "llama3", Error,
                 "[model] rope scaling '", o.rope_scaling.type, "' is not implemented; expected none | llama3");
  const int64_t T = split_degree(o);
  MEMTRAIN_CHECK(T == 1 || o.build.shapes_only, Error, "[model] a tensor-parallel Llama is built from shapes");
  const auto rows = split_range(o.vocab_size, o.build.tp ? o.build.tp->rank() : 0, static_cast<int>(T));
  vocab_begin_ = rows.begin;
  model = register_module("model", LlamaBody(o));
  if (!o.tie_embeddings)
    lm_head = register_module("lm_head", build_linear(o.n_embd, rows.count, false, o.build));
  if (o.build.shapes_only) return;  // no memory yet: the trainer fills each rank's share

  // transformers' LlamaPreTrainedModel._init_weights: N(0, initializer_range = 0.02) for every Linear and
  // the embedding, zero biases, RMSNorm weights one.
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    auto& p = item.value();
    if (item.key().find("norm") != std::string::npos) continue;
    if (item.key().ends_with(".bias")) p.zero_();
    else p.normal_(0.0, 0.02);
  }
}

torch::Tensor Llama::inverse_frequencies() const {
  const auto& o = options_;
  const int64_t d = o.head_dim();
  auto exponents = torch::arange(0, d, 2, torch::kLong).to(torch::kFloat) / static_cast<double>(d);
  auto inv_freq = 1.0 / torch::pow(o.rope_theta, exponents);  // fp32, as transformers computes it
  if (o.rope_scaling.type != "llama3") return inv_freq;
  const auto& s = o.rope_scaling;
  const double original = static_cast<double>(s.original_max_position);
  const double low_wavelen = original / s.low_freq_factor, high_wavelen = original / s.high_freq_factor;
  auto wavelen = 2 * std::numbers::pi / inv_freq;
  auto scaled = torch::where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq);
  auto smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  auto smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
  auto medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
  return torch::where(medium, smoothed, scaled);
}

const RotaryTables& Llama::rotary(int64_t T, const c10::Device& device, c10::ScalarType dtype) {
  if (rope_len_ != T || rope_device_ != device) {
    torch::NoGradGuard no_grad;
    auto positions = torch::arange(T, torch::kLong).to(torch::kFloat);
    auto freqs = torch::outer(positions, inverse_frequencies());  // (T, hd/2): one product each, as HF's matmul
    auto emb = torch::cat({freqs, freqs}, -1);                    // (T, hd)
    rope_ = {emb.cos().to(device), emb.sin().to(device)};
    rope_len_ = T, rope_device_ = device;
    rope_cast_ = {};
  }
  if (dtype == torch::kFloat) return rope_;
  // In the activations' dtype (bf16 autocast or parameters): what the products round to anyway. Made once.
  if (!rope_cast_.cos.defined() || rope_cast_.cos.scalar_type() != dtype) rope_cast_ = {rope_.cos.to(dtype), rope_.sin.to(dtype)};
  return rope_cast_;
}

torch::Tensor Llama::embed(const torch::Tensor& idx) {
  const auto T = idx.size(1);
  MEMTRAIN_CHECK(T <= options_.block_size, Error, "[model] sequence of ", T, " tokens is longer than block_size ",
                 options_.block_size);
  const auto* tp = tensor_parallel();
  if (!tp) return model->embed_tokens->forward(idx);
  // Split T: this rank's vocabulary rows, summed over the group (sequence parallel: this rank's tokens of the sum).
  return tensor_parallel_exit(vocab_parallel_lookup(idx, model->embed_tokens->weight, vocab_begin_), tp);
}

torch::Tensor Llama::block_part(int64_t i, size_t part, const torch::Tensor& h) {
  auto& layer = model->blocks[i];
  if (part == 0) {
    auto x = layer->input_layernorm->forward(h);
    const auto dtype = at::autocast::is_autocast_enabled(h.device().type())
                           ? at::autocast::get_autocast_dtype(h.device().type())
                           : x.scalar_type();
    // The rotary tables cover the whole sequence: attention runs on every token (sequence parallel: gathered).
    const auto* tp = tensor_parallel();
    const int64_t T = h.size(1) * (tp && tp->sequence_parallel ? tp->size() : 1);
    const auto& rope = rotary(T, h.device(), dtype);
    const auto* packed = packed_layout();
    if (packed && packed->positions.size(0) == h.size(0) && packed->positions.size(1) == T) {
      // Packed records: each token's row of the tables at its position in its record, (B, 1, T, hd).
      const auto at = [&](const torch::Tensor& table) {
        return table.index_select(0, packed->positions.reshape({-1})).view({h.size(0), 1, T, table.size(-1)});
      };
      return h + layer->self_attn->forward(x, RotaryTables{at(rope.cos), at(rope.sin)});
    }
    return h + layer->self_attn->forward(x, rope);
  }
  return h + layer->mlp->forward(layer->post_attention_layernorm->forward(h));
}

std::vector<torch::Tensor> Llama::block_parameters(int64_t i) const { return model->blocks[i]->parameters(); }

std::optional<std::pair<torch::Tensor, torch::Tensor>> Llama::head_features(const torch::Tensor& h) {
  return std::make_pair(model->norm->forward(h), options_.tie_embeddings ? model->embed_tokens->weight : lm_head->weight);
}

torch::Tensor Llama::head(const torch::Tensor& h) {
  auto [features, weight] = *head_features(h);
  // Split T: logits of this rank's vocabulary rows, (B, T, V_r), for vocab_parallel_cross_entropy.
  return detail::linear(tensor_parallel_enter(features, tensor_parallel()), weight);
}

torch::Tensor Llama::loss(const torch::Tensor& output, const torch::Tensor& target) const {
  const auto* tp = tensor_parallel();
  if (!tp) return Model::loss(output, target);
  return vocab_parallel_cross_entropy(output.reshape({-1, output.size(-1)}), target.reshape({-1}), vocab_begin_, tp, false);
}

torch::Tensor Llama::loss_sum(const torch::Tensor& output, const torch::Tensor& target) const {
  const auto* tp = tensor_parallel();
  if (!tp) return Model::loss_sum(output, target);
  return vocab_parallel_cross_entropy(output.reshape({-1, output.size(-1)}), target.reshape({-1}), vocab_begin_, tp, true);
}

TensorSplit Llama::split_of(const std::string& name) const {
  const auto& o = options_;
  const int64_t q = o.n_head * o.head_dim(), kv = o.n_kv_head * o.head_dim();
  auto ends = [&](const char* suffix) { return name.ends_with(suffix); };
  auto column = [&](int64_t whole) { return TensorSplit{.dim = 0, .chunks = 1, .whole = whole}; };
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return column(o.vocab_size);
  if (ends(".q_proj.weight") || ends(".q_proj.bias")) return column(q);
  if (ends(".k_proj.weight") || ends(".k_proj.bias") || ends(".v_proj.weight") || ends(".v_proj.bias")) return column(kv);
  if (ends(".o_proj.weight")) return {.dim = 1, .chunks = 1, .whole = q};
  if (ends(".gate_proj.weight") || ends(".gate_proj.bias") || ends(".up_proj.weight") || ends(".up_proj.bias"))
    return column(o.ffn_hidden);
  if (ends(".down_proj.weight")) return {.dim = 1, .chunks = 1, .whole = o.ffn_hidden};
  return {};  // norms, the row-parallel maps' biases: whole on every rank
}

double Llama::train_flops_per_token() const {
  const auto& o = options_;
  const double lookup = o.tie_embeddings ? 0.0 : static_cast<double>(o.vocab_size * o.n_embd);
  const double n = static_cast<double>(num_parameters()) - lookup;
  return 6.0 * n + 12.0 * o.n_layer * o.n_head * o.head_dim() * o.block_size;
}

double Llama::train_flops_per_sample() const { return train_flops_per_token() * options_.block_size; }

double Llama::block_activation_bytes(int64_t micro_batch, int64_t bytes_per_element) const {
  // Korthikanti et al.'s accounting (section 4.1) for this layer, with 16-bit activations and a fused
  // attention (SDPA keeps no s x s scores): per token, the two norms' inputs and outputs 4h, q and the
  // attention output 2h, k and v 2 h_kv, the MLP's gate, silu(gate), up and their product 4F; x2 bytes.
  const auto& o = options_;
  const double s = static_cast<double>(o.block_size), b = static_cast<double>(micro_batch);
  const double h = static_cast<double>(o.n_embd), hkv = static_cast<double>(o.n_kv_head * o.head_dim());
  const double f = static_cast<double>(o.ffn_hidden);
  return s * b * (2 * (4 * h + 2 * h + 2 * hkv + 4 * f)) * static_cast<double>(bytes_per_element) / 2;
}

std::string Llama::describe() const {
  const auto& o = options_;
  std::ostringstream os;
  os << "Llama " << o.n_layer << " layers x " << o.n_embd << " wide, " << o.n_head << " heads (" << o.n_kv_head
     << " kv), MLP " << o.ffn_hidden << ", context " << o.block_size << ", vocab " << o.vocab_size
     << (o.tie_embeddings ? ", tied head" : "") << ", " << num_parameters() << " parameters";
  return os.str();
}


LlamaOptions llama_options(const ModelConfig& c, int64_t vocab) {
  LlamaOptions o;
  if (c.preset != "custom") {
    o = LlamaOptions::preset(c.preset);
  } else {
    o.n_layer = c.n_layer, o.n_head = c.n_head, o.n_embd = c.n_embd;
    o.n_kv_head = c.n_kv_head > 0 ? c.n_kv_head : c.n_head;
    // SwiGLU's 8/3 width (Shazeer 2020, as Llama sizes it) rounded up to a multiple of 64.
    o.ffn_hidden = c.ffn_hidden > 0 ? c.ffn_hidden : (8 * c.n_embd / 3 + 63) / 64 * 64;
    o.rope_theta = c.rope_theta, o.norm_eps = c.norm_eps, o.tie_embeddings = c.tie_embeddings;
    o.qkv_bias = c.attn_bias != "none", o.out_bias = c.attn_bias == "all";
    o.vocab_size = c.vocab_size > 0 ? c.vocab_size : vocab;
    if (auto r = parse_rope_scaling(c.rope_scaling))
      o.rope_scaling = {.type = "llama3", .factor = r->factor, .low_freq_factor = r->low_freq_factor,
                        .high_freq_factor = r->high_freq_factor, .original_max_position = r->original_context};
  }
  o.block_size = c.block_size;
  return o;
}

// The Llama family's config.json (llama, mistral, qwen2), both ways; Phi-3 (phi3.cpp) reads and writes its shape
// keys through these too.
void read_llama_config(const ConfigJson& j, HuggingFaceModel& out) {
  auto& m = out.config;
  const auto& type = out.model_type;
  m.name = "llama", m.preset = "custom";
  m.n_layer = j.get<int64_t>("num_hidden_layers"), m.n_head = j.get<int64_t>("num_attention_heads");
  m.n_embd = j.get<int64_t>("hidden_size"), m.vocab_size = j.get<int64_t>("vocab_size");
  m.n_kv_head = j.get<int64_t>("num_key_value_heads", m.n_head);
  m.ffn_hidden = j.get<int64_t>("intermediate_size");
  m.rope_theta = j.get<double>("rope_theta", 10000.0);
  m.norm_eps = j.get<double>("rms_norm_eps", 1e-6);
  m.tie_embeddings = j.get<bool>("tie_word_embeddings", false);
  m.max_positions = j.get<int64_t>("max_position_embeddings", 0);
  out.keys = {"model.name",       "model.preset",       "model.n_layer",     "model.n_head",
              "model.n_embd",     "model.vocab_size",   "model.n_kv_head",   "model.ffn_hidden",
              "model.rope_theta", "model.rope_scaling", "model.norm_eps",    "model.tie_embeddings",
              "model.attn_bias",  "model.max_positions"};
  if (type == "qwen2") {
    m.attn_bias = "qkv";  // Qwen2's q, k and v projections always have biases; o_proj none
    if (j.get<bool>("use_sliding_window", false)) j.unsupported("use_sliding_window = true", "false");
  } else {
    m.attn_bias = j.get<bool>("attention_bias", false) ? "all" : "none";
  }
  if (j.get<bool>("mlp_bias", false)) j.unsupported("mlp_bias = true", "false");
  if (j.has("head_dim") && j.get<int64_t>("head_dim") * m.n_head != m.n_embd)
    j.unsupported(detail::concat("head_dim = ", j.get<int64_t>("head_dim")),
                  detail::concat("hidden_size / num_attention_heads = ", m.n_embd / std::max<int64_t>(m.n_head, 1)));
  const auto act = j.get<std::string>("hidden_act", "silu");
  if (act != "silu") j.unsupported("hidden_act = " + act, "silu");
  if (type == "mistral" && j.has("sliding_window") && j.get<int64_t>("sliding_window") < m.block_size)
    j.unsupported(detail::concat("sliding_window = ", j.get<int64_t>("sliding_window"), " below model.block_size = ", m.block_size),
                  "a window of at least the training context, where it changes nothing");
  m.rope_scaling = "none";
  if (j.has("rope_scaling")) {
    const auto& r = j.at("rope_scaling");
    MEMTRAIN_CHECK(r.is_object(), ConfigError, "[config] ", j.path(), ": rope_scaling = ", r.dump(), " is not an object");
    const auto& named = r.contains("rope_type") ? r["rope_type"] : r.contains("type") ? r["type"] : nlohmann::json("default");
    MEMTRAIN_CHECK(named.is_string(), ConfigError, "[config] ", j.path(), ": rope_scaling.rope_type = ", named.dump(),
                   " is not a name");
    const auto kind = named.get<std::string>();
    if (kind == "llama3") {
      auto number = [&](const char* key) {
        MEMTRAIN_CHECK(r.contains(key) && r[key].is_number(), ConfigError, "[config] ", j.path(), ": rope_scaling.", key,
                       " is missing or not a number");
        return r[key].get<double>();
      };
      m.rope_scaling = detail::concat("llama3:", format_shortest(number("factor")), ":",
                                      format_shortest(number("low_freq_factor")), ":",
                                      format_shortest(number("high_freq_factor")), ":",
                                      format_shortest(number("original_max_position_embeddings")));
    } else if (kind != "default") {
      j.unsupported("rope_scaling.rope_type = " + kind, "llama3, or no rope_scaling");
    }
  }
}

std::string llama_config_json(const ModelConfig& m, const std::string& torch_dtype) {
  nlohmann::json j;
  const bool qwen2 = m.attn_bias == "qkv";
  j = {{"architectures", {qwen2 ? "Qwen2ForCausalLM" : "LlamaForCausalLM"}},
       {"model_type", qwen2 ? "qwen2" : "llama"},
       {"vocab_size", m.vocab_size},
       {"hidden_size", m.n_embd},
       {"intermediate_size", m.ffn_hidden},
       {"num_hidden_layers", m.n_layer},
       {"num_attention_heads", m.n_head},
       {"num_key_value_heads", m.n_kv_head > 0 ? m.n_kv_head : m.n_head},
       {"head_dim", m.n_embd / m.n_head},
       {"hidden_act", "silu"},
       {"max_position_embeddings", m.max_positions > 0 ? m.max_positions : m.block_size},
       {"rms_norm_eps", m.norm_eps},
       {"rope_theta", m.rope_theta},
       {"rope_scaling", nullptr},
       {"tie_word_embeddings", m.tie_embeddings},
       {"initializer_range", 0.02},
       {"attention_dropout", 0.0},
       {"use_cache", true}};
  if (qwen2) j["use_sliding_window"] = false, j["max_window_layers"] = m.n_layer, j["sliding_window"] = nullptr;
  else j["attention_bias"] = m.attn_bias == "all", j["mlp_bias"] = false;
  if (auto r = parse_rope_scaling(m.rope_scaling))
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", r->factor},
                         {"low_freq_factor", r->low_freq_factor},
                         {"high_freq_factor", r->high_freq_factor},
                         {"original_max_position_embeddings", r->original_context}};
  j["torch_dtype"] = torch_dtype;
  return j.dump(2) + "\n";
}

void check_llama_keys(const ModelConfig& model) {
  const auto kv = model.n_kv_head == 0 ? model.n_head : model.n_kv_head;
  MEMTRAIN_CHECK(model.n_head % kv == 0, ConfigError, "[config] model.n_kv_head = ", model.n_kv_head,
                 " is out of range: expected a divisor of model.n_head = ", model.n_head);
  MEMTRAIN_CHECK((model.n_embd / model.n_head) % 2 == 0, ConfigError, "[config] model.n_embd = ", model.n_embd,
                 " is out of range: rotary embeddings need an even head width (n_embd / n_head = ",
                 model.n_embd / model.n_head, ")");
  MEMTRAIN_CHECK(model.max_positions == 0 || model.block_size <= model.max_positions, ConfigError,
                 "[config] model.block_size = ", model.block_size, " is out of range: the model is made for at most ",
                 model.max_positions, " positions (model.max_positions)");
}

std::vector<std::string> llama_fixed_keys() {
  return {"model.n_layer",   "model.n_head",     "model.n_embd",       "model.vocab_size",
          "model.n_kv_head", "model.ffn_hidden", "model.rope_theta",   "model.rope_scaling",
          "model.norm_eps",  "model.tie_embeddings", "model.attn_bias", "model.max_positions"};
}

ModelTensors llama_tensors(const LlamaOptions& o) {
  const int64_t C = o.n_embd, q = o.n_head * o.head_dim(), kv = o.n_kv_head * o.head_dim(), F = o.ffn_hidden;
  ModelTensors t;
  t.block = {C * q, C * kv, C * kv, q * C, C * F, C * F, F * C, C, C};
  if (o.qkv_bias) t.block.insert(t.block.end(), {q, kv, kv});
  if (o.out_bias) t.block.push_back(C);
  if (o.mlp_bias) t.block.insert(t.block.end(), {F, F, C});
  t.root = {o.vocab_size * C, C};
  if (!o.tie_embeddings) t.root.push_back(o.vocab_size * C);
  t.layers = o.n_layer;
  t.block_linears = 7;
  return t;
}

ModelConfig llama_resolved(const ModelConfig& c, const LlamaOptions& o) {
  ModelConfig m = c;
  m.preset = "custom";
  m.n_layer = o.n_layer, m.n_head = o.n_head, m.n_embd = o.n_embd, m.n_kv_head = o.n_kv_head;
  m.ffn_hidden = o.ffn_hidden, m.vocab_size = o.vocab_size, m.rope_theta = o.rope_theta, m.norm_eps = o.norm_eps;
  m.tie_embeddings = o.tie_embeddings, m.attn_bias = o.out_bias ? "all" : o.qkv_bias ? "qkv" : "none";
  const auto& r = o.rope_scaling;
  m.rope_scaling = r.type == "llama3" ? format_rope_scaling({r.factor, r.low_freq_factor, r.high_freq_factor,
                                                             r.original_max_position})
                                      : "none";
  return m;
}

InitSpec llama_init(const ModelConfig&, const std::string& name) {
  // transformers' LlamaPreTrainedModel._init_weights (the constructor's loop above, per slice).
  if (name.find("norm") != std::string::npos) return InitSpec::ones();
  if (name.ends_with(".bias")) return InitSpec::zeros();
  return InitSpec::normal(0.02);
}

const ModelFamily& llama_family() {
  static const ModelFamily family{
      .config = {.name = "llama",
                 .keys = "llama",
                 .presets = llama_presets(),
                 .fixed_keys = llama_fixed_keys(),
                 .hf_model_types = {"llama", "mistral", "qwen2"},
                 .validate = check_llama_keys,
                 .read_hugging_face = read_llama_config,
                 .hugging_face_json = llama_config_json},
      .reads_tokens = true,
      .build = [](const ModelConfig& c, const DataInfo& data, const ParameterBuild& how) -> std::shared_ptr<Model> {
        auto o = llama_options(c, data.vocab_size);
        check_vocabulary(o.vocab_size, data);
        o.build = how;
        return std::make_shared<Llama>(o);
      },
      .init = llama_init,
      .context = [](const ModelConfig& c) { return c.block_size; },  // a preset leaves the training context free
      .preset_vocab = [](const ModelConfig& c) -> int64_t {
        return c.preset != "custom" ? LlamaOptions::preset(c.preset).vocab_size : 0;
      },
      .shape = [](const ModelConfig& c, int64_t vocab) { return llama_options(c, vocab).shape(); },
      .tensors = [](const ModelConfig& c, int64_t vocab) { return llama_tensors(llama_options(c, vocab)); },
      .resolved = [](const ModelConfig& c, int64_t vocab) {
        auto m = llama_resolved(c, llama_options(c, vocab));
        if (c.preset != "custom" && m.max_positions == 0) m.max_positions = 131072;  // the presets' published context
        return m;
      },
      .embedding = "model.embed_tokens.weight",
      // LlamaForCausalLM's names are memtrain's.
      .hf_name = [](const ModelConfig&, const std::string& parameter) { return HuggingFaceName{parameter}; },
  };
  return family;
}

}  // namespace memtrain
