// Hugging Face's config.json, both ways, for the decoders memtrain implements (gpt2, llama, mistral, qwen2, phi3:
// each read and written by its family, FamilyConfig in core/family_config.h). The config layer's half of
// model.init_from and `memtrain export`; the weights' names and layout are models/hugging_face.h.
//
//   auto m = memtrain::model_from_hugging_face("ckpt/Llama-3.2-1B", cfg.model);  // name, shape, rope, ...
//   std::string json = memtrain::hugging_face_config_json(m.config, "bfloat16");
#pragma once

#include <string>
#include <vector>

#include "memtrain/core/config.h"

namespace memtrain {

struct HuggingFaceModel {
  ModelConfig config;              // `base` with what config.json determines
  std::vector<std::string> keys;   // the "model.*" keys config.json determined
  std::string model_type;          // config.json's: gpt2 | llama | mistral | qwen2 | phi3
};

// Reads DIR/config.json through the family that reads its model_type. Keys of `base` that config.json does not determine (block_size for the Llama
// family, dropout, init_from) are kept. Throws ConfigError naming the folder and the key for a missing or
// malformed file, an unknown model_type, or an option memtrain does not implement (another rope scaling
// type, an activation other than the architecture's, a sliding window shorter than block_size).
HuggingFaceModel model_from_hugging_face(const std::string& dir, const ModelConfig& base);

// The config.json `save_pretrained` would write for this model (architectures, model_type and shape keys),
// with the weights stored as `torch_dtype` (float32 | bfloat16 | float16), written by model.name's family (gpt ->
// gpt2; llama -> llama, or qwen2 with attn_bias = qkv; phi3 -> phi3).
std::string hugging_face_config_json(const ModelConfig& m, const std::string& torch_dtype);

// Reads a peft adapter folder's adapter_config.json (peft_type LORA): r, lora_alpha, lora_dropout and
// target_modules into `base`'s rank, alpha, dropout and targets (`keys`: the "lora.*" keys it determined).
// An option memtrain does not implement (DoRA, rsLoRA, trained biases, modules_to_save, a regex of targets)
// is a ConfigError naming it.
struct PeftAdapter {
  LoraConfig config;
  std::vector<std::string> keys;
};
PeftAdapter lora_from_peft(const std::string& dir, const LoraConfig& base);

// The adapter_config.json peft's save_pretrained writes for these adapters on `base_model` (a folder or a
// hub name; "" when unknown), for `model` (its name decides fan_in_fan_out: GPT-2's Conv1D layout).
std::string peft_adapter_config_json(const LoraConfig& lora, const ModelConfig& model, const std::string& base_model);

}  // namespace memtrain
