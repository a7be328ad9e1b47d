// Phi-3 (Microsoft, 2024; transformers' Phi3ForCausalLM): a Llama-shaped decoder (RMSNorm, rotary attention with
// grouped-query heads, SwiGLU) whose checkpoints store q, k and v in one qkv_proj and gate and up in one gate_up_proj.
// memtrain builds it from its Llama blocks and maps each projection to its rows of the fused tensor, both ways; the
// family reads the llama [model] keys. Everything Phi-3 is in this file and one line of models/src/family.cpp.
//
// What memtrain does not implement is refused by name when config.json asks for it: longrope / su rope scaling (the
// 128k-context variants), a partial rotary factor, dropout. Phi-3's sliding window (2047 in the 4k models) is exact
// for any training context up to the window, so the window caps model.max_positions.
#include <nlohmann/json.hpp>

#include "memtrain/core/config_json.h"
#include "memtrain/core/error.h"
#include "memtrain/core/hugging_face_config.h"
#include "memtrain/models/family.h"
#include "memtrain/models/llama.h"

namespace memtrain {

namespace {

struct Phi3Preset {
  const char* name;
  int64_t hidden, ffn, layers, heads, kv_heads;
};
// The published config.json of microsoft/Phi-3-mini-4k-instruct (3.8B) and microsoft/Phi-3-medium-4k-instruct
// (14B): vocabulary 32064, rope_theta 10000, rms_norm_eps 1e-5, untied head, sliding_window 2047.
constexpr Phi3Preset kPhi3Presets[] = {
    {"phi-3-mini-4k", 3072, 8192, 32, 32, 32},
    {"phi-3-medium-4k", 5120, 17920, 40, 40, 10},
};
constexpr int64_t kPhi3Vocab = 32064, kPhi3Window = 2047;

std::vector<std::string> phi3_presets() {
  std::vector<std::string> out{"custom"};
  for (const auto& p : kPhi3Presets) out.emplace_back(p.name);
  return out;
}

// A preset as the llama keys it fixes; custom as given.
ModelConfig phi3_keys(const ModelConfig& c) {
  if (c.preset == "custom") return c;
  for (const auto& p : kPhi3Presets) {
    if (c.preset != p.name) continue;
    ModelConfig m = c;
    m.preset = "custom";
    m.n_embd = p.hidden, m.ffn_hidden = p.ffn, m.n_layer = p.layers, m.n_head = p.heads, m.n_kv_head = p.kv_heads;
    m.vocab_size = kPhi3Vocab, m.rope_theta = 10000.0, m.norm_eps = 1e-5, m.tie_embeddings = false;
    m.attn_bias = "none", m.rope_scaling = "none", m.max_positions = kPhi3Window;
    return m;
  }
  throw ConfigError("[model] unknown Phi-3 preset '" + c.preset + "'");
}

LlamaOptions phi3_options(const ModelConfig& c, int64_t vocab) { return llama_options(phi3_keys(c), vocab); }

void read_phi3_config(const ConfigJson& j, HuggingFaceModel& out) {
  read_llama_config(j, out);  // the same shape keys, rope and norm
  auto& m = out.config;
  m.name = "phi3";
  if (j.get<double>("partial_rotary_factor", 1.0) != 1.0)
    j.unsupported(detail::concat("partial_rotary_factor = ", j.get<double>("partial_rotary_factor")), "1.0");
  for (const char* key : {"resid_pdrop", "embd_pdrop", "attention_dropout"})
    if (j.get<double>(key, 0.0) != 0.0) j.unsupported(detail::concat(key, " = ", j.get<double>(key)), "0.0");
  if (j.has("sliding_window")) {
    const auto window = j.get<int64_t>("sliding_window");
    m.max_positions = m.max_positions > 0 ? std::min(m.max_positions, window) : window;
  }
}

std::string phi3_config_json(const ModelConfig& m, const std::string& torch_dtype) {
  auto j = nlohmann::json::parse(llama_config_json(m, torch_dtype));
  j["architectures"] = {"Phi3ForCausalLM"};
  j["model_type"] = "phi3";
  for (const char* key : {"attention_bias", "mlp_bias", "head_dim", "use_sliding_window", "max_window_layers"}) j.erase(key);
  j["sliding_window"] = j["max_position_embeddings"];  // the window changes nothing inside the positions trained
  j["original_max_position_embeddings"] = j["max_position_embeddings"];
  j["partial_rotary_factor"] = 1.0;
  j["resid_pdrop"] = 0.0, j["embd_pdrop"] = 0.0;
  j["pad_token_id"] = nullptr;  // Phi3Config's default (32000) is no token of a smaller vocabulary
  return j.dump(2) + "\n";
}

// Phi3ForCausalLM's names are Llama's, but for the fused projections: q, k, v are rows of qkv_proj (q first, then
// k and v of n_kv_head heads each), gate and up the two halves of gate_up_proj (gate first).
HuggingFaceName phi3_name(const ModelConfig& c, const std::string& parameter) {
  const auto o = phi3_options(c, std::max<int64_t>(c.vocab_size, 1));
  const int64_t q = o.n_head * o.head_dim(), kv = o.n_kv_head * o.head_dim(), F = o.ffn_hidden;
  auto fused = [&](const char* from, const char* to, int64_t begin, int64_t rows) -> std::optional<HuggingFaceName> {
    const auto at = parameter.find(from);
    if (at == std::string::npos || !parameter.ends_with(".weight")) return std::nullopt;
    auto name = parameter;
    name.replace(at, std::string(from).size(), to);
    return HuggingFaceName{name, false, begin, rows};
  };
  for (const auto& part : {fused(".self_attn.q_proj.", ".self_attn.qkv_proj.", 0, q),
                           fused(".self_attn.k_proj.", ".self_attn.qkv_proj.", q, kv),
                           fused(".self_attn.v_proj.", ".self_attn.qkv_proj.", q + kv, kv),
                           fused(".mlp.gate_proj.", ".mlp.gate_up_proj.", 0, F), fused(".mlp.up_proj.", ".mlp.gate_up_proj.", F, F)})
    if (part) return *part;
  return {parameter};
}

}  // namespace

const ModelFamily& phi3_family() {
  static const ModelFamily family{
      .config = {.name = "phi3",
                 .keys = "llama",
                 .presets = phi3_presets(),
                 .fixed_keys = llama_fixed_keys(),
                 .hf_model_types = {"phi3"},
                 .validate = [](const ModelConfig& m) { check_llama_keys(phi3_keys(m)); },  // a preset's window too
                 .read_hugging_face = read_phi3_config,
                 .hugging_face_json = phi3_config_json},
      .reads_tokens = true,
      .build = [](const ModelConfig& c, const DataInfo& data, const ParameterBuild& how) -> std::shared_ptr<Model> {
        auto o = phi3_options(c, data.vocab_size);
        check_vocabulary(o.vocab_size, data);
        o.build = how;
        return std::make_shared<Llama>(o);
      },
      .init = llama_init,  // Phi3PreTrainedModel: N(0, initializer_range = 0.02), norms one
      .context = [](const ModelConfig& c) { return c.block_size; },  // a preset leaves the training context free
      .preset_vocab = [](const ModelConfig& c) -> int64_t { return c.preset != "custom" ? kPhi3Vocab : 0; },
      .shape = [](const ModelConfig& c, int64_t vocab) { return phi3_options(c, vocab).shape(); },
      .tensors = [](const ModelConfig& c, int64_t vocab) { return llama_tensors(phi3_options(c, vocab)); },
      .resolved = [](const ModelConfig& c, int64_t vocab) {
        auto m = llama_resolved(phi3_keys(c), phi3_options(c, vocab));
        m.name = "phi3";
        return m;
      },
      .embedding = "model.embed_tokens.weight",
      .hf_name = phi3_name,
  };
  return family;
}

}  // namespace memtrain
