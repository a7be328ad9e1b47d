// A model family: what the rest of memtrain needs of one kind of model, defined beside the model and registered once
// (model_families(), models/src/family.cpp), as torchtitan registers a TrainSpec per model folder. The config layer
// reads its `config` part (presets, keys, config.json both ways: core/family_config.h); the runtime's factories, the
// estimator, `--target` and the Hugging Face loader and writer read the rest, never a family's name.
//
//   const ModelFamily& f = model_family(cfg.model.name);     // ConfigError naming the families for an unknown one
//   auto model = f.build(cfg.model, data->info());
//   if (f.shape) TransformerShape s = f.shape(cfg.model, vocab);   // a closed form for its activations
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "memtrain/core/activation_model.h"
#include "memtrain/core/config.h"
#include "memtrain/core/family_config.h"
#include "memtrain/core/data_info.h"
#include "memtrain/models/model.h"
#include "memtrain/models/shapes.h"

namespace memtrain {

// Each tensor's elements, from shapes alone: one block's (every block alike) and the rest's (the root unit:
// embeddings, final norm, an untied head).
struct ModelTensors {
  std::vector<int64_t> block, root;
  int64_t layers = 0;
  int64_t block_linears = 0;  // the first block_linears entries of `block` are its linear maps' weights
};

// A parameter's tensor in a Hugging Face checkpoint.
struct HuggingFaceName {
  std::string name;         // transformer.h.0.attn.c_attn.weight
  bool transposed = false;  // stored as the transpose of memtrain's (GPT-2's Conv1D weights)
  // A block of rows of the stored tensor (a fused projection: Phi-3's qkv_proj holds q, k and v); rows = 0: all.
  int64_t row_begin = 0, rows = 0;
};

struct ModelFamily {
  FamilyConfig config{};       // config.name is model.name
  bool reads_tokens = false;   // a language model: token ids in, a loss over the vocabulary out
  // The model the config describes, for the data's vocabulary or image shape.
  // `how`: LibTorch's initialised modules, or shapes only (models/shapes.h), which a family with `init` builds.
  std::function<std::shared_ptr<Model>(const ModelConfig&, const DataInfo&, const ParameterBuild& how)> build = nullptr;
  // A parameter's initial values when no checkpoint gives them (the trainer draws them per slice, shapes.h); null: the
  // family is built whole, initialised by its modules, and never from shapes.
  std::function<InitSpec(const ModelConfig&, const std::string& parameter)> init = nullptr;
  // Tokens per sample (language models; null: model.block_size).
  std::function<int64_t(const ModelConfig&)> context = nullptr;
  // The preset's vocabulary, 0 where the preset fixes none (custom; null: the family has no presets).
  std::function<int64_t(const ModelConfig&)> preset_vocab = nullptr;
  // What the estimator reads without building the model (null: estimated by building it and probing): the shape
  // its activations are computed from in closed form (core/activation_model.h) and each tensor's elements.
  std::function<TransformerShape(const ModelConfig&, int64_t vocab)> shape = nullptr;
  std::function<ModelTensors(const ModelConfig&, int64_t vocab)> tensors = nullptr;
  // The custom keys that describe the model `c` builds with vocabulary `vocab` (a preset spelled out, for an export's
  // config.json), and the parameter that holds the embedding (its rows are the vocabulary); null / "": not exported.
  std::function<ModelConfig(const ModelConfig& c, int64_t vocab)> resolved = nullptr;
  std::string embedding{};
  // The checkpoint tensor of memtrain parameter `parameter` (null: no Hugging Face layout). A prefix the family's
  // older checkpoints leave out ("transformer." for GPT-2's own), tried when the prefixed names are absent.
  std::function<HuggingFaceName(const ModelConfig&, const std::string& parameter)> hf_name = nullptr;
  std::string hf_optional_prefix{};
};

// A language model's build: its vocabulary must hold the data's tokens (ConfigError naming both).
void check_vocabulary(int64_t model_vocab, const DataInfo& data);

// Every family this build knows, in registration order.
const std::vector<const ModelFamily*>& model_families();
// The family of model.name; ConfigError naming the known ones.
const ModelFamily& model_family(const std::string& name);

// The registrations, each defined beside its model (gpt.cpp, llama.cpp, resnet.cpp, mlp.cpp, phi3.cpp).
const ModelFamily& gpt_family();
const ModelFamily& llama_family();
const ModelFamily& resnet_family();
const ModelFamily& mlp_family();
const ModelFamily& phi3_family();

}  // namespace memtrain
