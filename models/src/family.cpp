#include "memtrain/models/family.h"

#include "memtrain/core/error.h"

namespace memtrain {

const std::vector<const ModelFamily*>& model_families() {
  // One line per family.
  static const std::vector<const ModelFamily*> all = {
      &gpt_family(),
      &llama_family(),
      &resnet_family(),
      &mlp_family(),
      &phi3_family(),
  };
  return all;
}

namespace {
// The config layer's view of the same list (core/family_config.h), handed over at static initialisation.
const std::vector<const FamilyConfig*>& config_sides() {
  static const std::vector<const FamilyConfig*> all = [] {
    std::vector<const FamilyConfig*> out;
    for (const auto* f : model_families()) out.push_back(&f->config);
    return out;
  }();
  return all;
}
[[maybe_unused]] const bool registered = (set_family_source(&config_sides), true);
}  // namespace

void check_vocabulary(int64_t model_vocab, const DataInfo& data) {
  MEMTRAIN_CHECK(model_vocab >= data.vocab_size, ConfigError, "[model] vocab_size ", model_vocab,
                 " is smaller than the data's vocabulary (", data.vocab_size, " tokens)");
}

const ModelFamily& model_family(const std::string& name) {
  std::string known;
  for (const auto* f : model_families()) {
    if (f->config.name == name) return *f;
    known += (known.empty() ? "" : " | ") + f->config.name;
  }
  throw ConfigError("[model] model.name = '" + name + "' is no model family of this build; expected " + known);
}

}  // namespace memtrain
