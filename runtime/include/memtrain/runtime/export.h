// `memtrain export`: a training-state checkpoint (any world size, any ZeRO stage) to a Hugging Face folder
// that transformers' from_pretrained loads: config.json, the weights in Hugging Face's names and layout
// (sharded with model.safetensors.index.json above max_shard_bytes), and the tokenizer files of
// model.init_from's folder when the run started from one. A LoRA run's checkpoint exports as a peft adapter
// folder (PeftModel.from_pretrained on the base), or merged into a whole model.
//
//   memtrain::export_hugging_face({.checkpoint = "runs/llama/checkpoints", .out = "hf-out"});
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

#include "memtrain/core/config.h"

namespace memtrain {

struct ExportOptions {
  std::string checkpoint;  // a step-N folder, or a checkpoint.dir (its newest complete checkpoint)
  std::string out;         // the folder to create (must not exist)
  c10::ScalarType dtype = torch::kFloat;              // stored dtype: float32 | bfloat16 | float16
  int64_t max_shard_bytes = 5LL * 1000 * 1000 * 1000;  // save_pretrained's default 5GB
  // A LoRA run: false writes the peft adapter folder (adapter_config.json + adapter_model.safetensors);
  // true the whole model with the adapters merged into their weights (W + B A alpha / rank).
  bool merged = false;
};

struct ExportResult {
  std::string checkpoint;            // the step folder read
  int64_t step = 0;
  std::vector<std::string> files;    // written, in `out`
  int64_t parameters = 0;            // elements exported
};

ExportResult export_hugging_face(const ExportOptions& options);

// The model config with everything a preset or a default (vocab 0 = the data's, ffn_hidden 0 = 8/3 n_embd,
// n_kv_head 0 = n_head) leaves implicit written out, as config.json needs it; `vocab` is the embedding's rows.
ModelConfig resolved_model_config(const ModelConfig& config, int64_t vocab);

}  // namespace memtrain
