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
  };
  return all;
}

void check_vocabulary(int64_t model_vocab, const DataInfo& data) {
  MEMTRAIN_CHECK(model_vocab >= data.vocab_size, ConfigError, "[model] vocab_size ", model_vocab,
                 " is smaller than the data's vocabulary (", data.vocab_size, " tokens)");
}

const ModelFamily& model_family(const std::string& name) {
  std::string known;
  for (const auto* f : model_families()) {
    if (f->name == name) return *f;
    known += (known.empty() ? "" : " | ") + f->name;
  }
  throw ConfigError("[model] model.name = '" + name + "' is no model family of this build; expected " + known);
}

}  // namespace memtrain
