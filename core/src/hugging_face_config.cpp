#include "memtrain/core/hugging_face_config.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "memtrain/core/error.h"
#include "memtrain/core/files.h"

namespace memtrain {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// config.json's values, read with messages that name the file and the key.
class ConfigJson {
 public:
  explicit ConfigJson(const std::string& dir) : path_((fs::path(dir) / "config.json").string()) {
    std::error_code ec;
    MEMTRAIN_CHECK(fs::is_directory(dir, ec), ConfigError, "[config] model.init_from = ", dir,
                   ": no such folder (expected a Hugging Face model folder with config.json and *.safetensors)");
    MEMTRAIN_CHECK(fs::is_regular_file(path_, ec), ConfigError, "[config] model.init_from = ", dir,
                   ": no config.json in the folder (a Hugging Face model folder has config.json beside its weights)");
    try {
      j_ = json::parse(read_file_bytes(path_));
    } catch (const json::exception& e) {
      throw ConfigError(detail::concat("[config] ", path_, ": not valid JSON: ", e.what()));
    }
    MEMTRAIN_CHECK(j_.is_object(), ConfigError, "[config] ", path_, ": not a JSON object");
  }
  const std::string& path() const { return path_; }
  bool has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }
  const json& at(const char* key) const {
    MEMTRAIN_CHECK(has(key), ConfigError, "[config] ", path_, ": no '", key, "'");
    return j_[key];
  }
  template <class T>
  T get(const char* key) const {
    try {
      return at(key).get<T>();
    } catch (const json::exception&) {
      throw ConfigError(detail::concat("[config] ", path_, ": '", key, "' = ", at(key).dump(), " has the wrong type"));
    }
  }
  template <class T>
  T get(const char* key, T fallback) const {
    return has(key) ? get<T>(key) : fallback;
  }
  // An option memtrain does not implement: an error naming it and what is supported.
  [[noreturn]] void unsupported(const std::string& what, const std::string& expected) const {
    throw ConfigError(detail::concat("[config] ", path_, ": ", what, " is not implemented by memtrain (expected ",
                                     expected, ")"));
  }

 private:
  std::string path_;
  json j_;
};

void read_gpt2(const ConfigJson& j, HuggingFaceModel& out) {
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

void read_llama(const ConfigJson& j, HuggingFaceModel& out) {
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
    const auto& named = r.contains("rope_type") ? r["rope_type"] : r.contains("type") ? r["type"] : json("default");
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

}  // namespace

HuggingFaceModel model_from_hugging_face(const std::string& dir, const ModelConfig& base) {
  ConfigJson j(dir);
  HuggingFaceModel out{base, {}, j.get<std::string>("model_type")};
  try {
    if (out.model_type == "gpt2") read_gpt2(j, out);
    else if (out.model_type == "llama" || out.model_type == "mistral" || out.model_type == "qwen2") read_llama(j, out);
    else j.unsupported("model_type = " + out.model_type, "gpt2 | llama | mistral | qwen2");
  } catch (const json::exception& e) {  // a nested value of the wrong type (rope_scaling's)
    throw ConfigError(detail::concat("[config] ", j.path(), ": ", e.what()));
  }
  MEMTRAIN_CHECK(out.config.n_head > 0 && out.config.n_embd % out.config.n_head == 0, ConfigError, "[config] ", j.path(),
                 ": the width ", out.config.n_embd, " is not a multiple of the ", out.config.n_head, " heads");
  return out;
}

std::string hugging_face_config_json(const ModelConfig& m, const std::string& torch_dtype) {
  json j;
  if (m.name == "gpt") {
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
  } else if (m.name == "llama") {
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
  } else {
    throw ConfigError("[export] model.name = " + m.name + " has no Hugging Face layout (gpt and llama do)");
  }
  j["torch_dtype"] = torch_dtype;
  return j.dump(2) + "\n";
}

PeftAdapter lora_from_peft(const std::string& dir, const LoraConfig& base) {
  std::error_code ec;
  const auto path = (fs::path(dir) / "adapter_config.json").string();
  MEMTRAIN_CHECK(fs::is_regular_file(path, ec), ConfigError, "[config] lora.init_from = ", dir,
                 ": no adapter_config.json (a peft adapter folder holds it beside adapter_model.safetensors)");
  json j;
  try {
    j = json::parse(read_file_bytes(path));
  } catch (const json::exception& e) {
    throw ConfigError(detail::concat("[config] ", path, ": not valid JSON: ", e.what()));
  }
  MEMTRAIN_CHECK(j.is_object(), ConfigError, "[config] ", path, ": not a JSON object");
  auto unsupported = [&](const std::string& what, const std::string& expected) {
    throw ConfigError(detail::concat("[config] ", path, ": ", what, " is not implemented by memtrain (expected ", expected, ")"));
  };
  PeftAdapter out{base, {"lora.rank", "lora.alpha", "lora.dropout", "lora.targets"}};
  try {
    const auto type = j.value("peft_type", std::string("LORA"));
    if (type != "LORA") unsupported("peft_type = " + type, "LORA");
    if (j.value("use_dora", false)) unsupported("use_dora = true", "false");
    if (j.value("use_rslora", false)) unsupported("use_rslora = true", "false");
    if (j.value("bias", std::string("none")) != "none") unsupported("bias = " + j.value("bias", std::string()), "none");
    if (j.contains("modules_to_save") && !j["modules_to_save"].is_null()) unsupported("modules_to_save", "null");
    if (j.contains("layers_to_transform") && !j["layers_to_transform"].is_null()) unsupported("layers_to_transform", "null");
    if (j.contains("rank_pattern") && !j["rank_pattern"].empty()) unsupported("rank_pattern", "{}");
    if (j.contains("alpha_pattern") && !j["alpha_pattern"].empty()) unsupported("alpha_pattern", "{}");
    out.config.rank = j.at("r").get<int64_t>();
    out.config.alpha = j.at("lora_alpha").get<double>();
    out.config.dropout = j.value("lora_dropout", 0.0);
    const auto& t = j.at("target_modules");
    if (t.is_string()) unsupported("target_modules as a regular expression ('" + t.get<std::string>() + "')", "a list of names");
    std::vector<std::string> names = t.get<std::vector<std::string>>();
    std::sort(names.begin(), names.end());
    out.config.targets.clear();
    for (const auto& n : names) out.config.targets += (out.config.targets.empty() ? "" : ",") + n;
  } catch (const json::exception& e) {
    throw ConfigError(detail::concat("[config] ", path, ": ", e.what()));
  }
  MEMTRAIN_CHECK(out.config.rank > 0, ConfigError, "[config] ", path, ": r = ", out.config.rank, " is not a rank");
  return out;
}

std::string peft_adapter_config_json(const LoraConfig& lora, const ModelConfig& model, const std::string& base_model) {
  const auto targets = lora_targets(lora);
  json j = {{"peft_type", "LORA"},
            {"task_type", "CAUSAL_LM"},
            {"base_model_name_or_path", base_model.empty() ? json(nullptr) : json(base_model)},
            {"r", lora.rank},
            {"lora_alpha", lora.alpha},
            {"lora_dropout", lora.dropout},
            {"target_modules", targets},
            {"bias", "none"},
            {"fan_in_fan_out", model.name == "gpt"},
            {"inference_mode", true},
            {"init_lora_weights", true},
            {"modules_to_save", nullptr},
            {"use_rslora", false},
            {"use_dora", false}};
  return j.dump(2) + "\n";
}

}  // namespace memtrain
