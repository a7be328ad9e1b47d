#include "memtrain/core/hugging_face_config.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "memtrain/core/config_json.h"
#include "memtrain/core/error.h"
#include "memtrain/core/family_config.h"
#include "memtrain/core/files.h"

namespace memtrain {

namespace fs = std::filesystem;
using nlohmann::json;

ConfigJson::ConfigJson(const std::string& dir) : path_((fs::path(dir) / "config.json").string()) {
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

HuggingFaceModel model_from_hugging_face(const std::string& dir, const ModelConfig& base) {
  ConfigJson j(dir);
  HuggingFaceModel out{base, {}, j.get<std::string>("model_type")};
  const FamilyConfig* family = nullptr;
  std::string known;
  for (const auto* f : family_configs()) {
    if (!f->read_hugging_face) continue;
    for (const auto& type : f->hf_model_types) {
      if (type == out.model_type) family = f;
      known += (known.empty() ? "" : " | ") + type;
    }
  }
  if (!family) j.unsupported("model_type = " + out.model_type, known);
  try {
    family->read_hugging_face(j, out);
  } catch (const json::exception& e) {  // a nested value of the wrong type (rope_scaling's)
    throw ConfigError(detail::concat("[config] ", j.path(), ": ", e.what()));
  }
  MEMTRAIN_CHECK(out.config.n_head > 0 && out.config.n_embd % out.config.n_head == 0, ConfigError, "[config] ", j.path(),
                 ": the width ", out.config.n_embd, " is not a multiple of the ", out.config.n_head, " heads");
  return out;
}

std::string hugging_face_config_json(const ModelConfig& m, const std::string& torch_dtype) {
  const auto& family = family_config(m.name);
  MEMTRAIN_CHECK(family.hugging_face_json != nullptr, ConfigError, "[export] model.name = ", m.name,
                 " has no Hugging Face layout");
  return family.hugging_face_json(m, torch_dtype);
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
