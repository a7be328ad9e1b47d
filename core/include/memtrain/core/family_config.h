// A model family as the config layer sees it: its model.name, its presets, the [model] keys it reads, the rules
// across them, and its Hugging Face config.json both ways. Each is defined beside its model (models/src/<family>.cpp,
// in the family's ModelFamily) and reaches core through the models layer's one registration list
// (models/src/family.cpp), so that core names no family: adding one touches models/ alone.
//
//   const FamilyConfig& f = family_config(cfg.model.name);          // ConfigError naming the known families
//   bool preset_ok = std::count(f.presets.begin(), f.presets.end(), cfg.model.preset);
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "memtrain/core/config.h"

namespace memtrain {

class ConfigJson;
struct HuggingFaceModel;

struct FamilyConfig {
  std::string name{};                        // model.name
  std::string keys{};                        // the [model] key group it reads ("gpt", "llama"); "" none of them
  std::vector<std::string> presets{};        // its model.preset values, "custom" first; empty: custom only
  std::vector<std::string> fixed_keys{};     // the keys a preset other than custom fixes
  std::vector<std::string> hf_model_types{}; // config.json model_type values it reads
  // The rules across its keys (ConfigError naming the key); null: none.
  std::function<void(const ModelConfig&)> validate = nullptr;
  // config.json into out.config / out.keys (out.model_type is set); null: no Hugging Face layout.
  std::function<void(const ConfigJson&, HuggingFaceModel&)> read_hugging_face = nullptr;
  // The config.json save_pretrained would write (shape keys, architectures; the caller adds torch_dtype), as text.
  std::function<std::string(const ModelConfig&, const std::string& torch_dtype)> hugging_face_json = nullptr;
};

// Where the families come from: set once by the models layer at static initialisation (a plain function pointer,
// read on first use, so no order between translation units matters).
using FamilySource = const std::vector<const FamilyConfig*>& (*)();
void set_family_source(FamilySource source);

// Every registered family; ConfigError when none is (memtrain::core used without memtrain::models).
const std::vector<const FamilyConfig*>& family_configs();
// The family of model.name; ConfigError naming the known ones.
const FamilyConfig& family_config(const std::string& name);
// The family whose presets hold `preset` (not custom); null when none does.
const FamilyConfig* family_with_preset(const std::string& preset);
// "a | b | c" of the registered names.
std::string family_names();

}  // namespace memtrain
