// Hugging Face checkpoints in and out: which tensor of a checkpoint is which parameter of memtrain's GPT
// (GPT-2's layout: `transformer.` names, Conv1D weights stored (in, out), the head tied to wte) and Llama
// (named as LlamaForCausalLM already), reading a folder's weights (model.safetensors, or the shards its
// model.safetensors.index.json names) into a model, and writing a folder `from_pretrained` loads.
//
//   auto loaded = memtrain::load_hugging_face_weights(*model, "hf/Llama-3.2-1B");   // every tensor checked first
//   memtrain::save_hugging_face("out/", cfg.model, named_full_parameters, {.dtype = torch::kBFloat16});
#pragma once

#include <torch/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "memtrain/core/config.h"
#include "memtrain/models/family.h"
#include "memtrain/models/model.h"

namespace memtrain {

// The checkpoint tensor of memtrain parameter `parameter` of a model `config` describes (its family's map,
// ModelFamily::hf_name); ConfigError for a family without a Hugging Face layout.
HuggingFaceName hugging_face_name(const ModelConfig& config, const std::string& parameter);

struct HuggingFaceLoad {
  int64_t tensors = 0;     // parameters filled
  int64_t files = 0;       // safetensors files read
  int64_t bytes_read = 0;  // tensor bytes read from them
};

// The safetensors files of a Hugging Face folder: the shards model.safetensors.index.json names (each
// checked to exist), else model.safetensors. Throws DataError naming what is missing.
std::vector<std::string> hugging_face_weight_files(const std::string& dir);

// Fills every parameter of `model` (a GPT or a Llama) from the folder's weights, converting the stored
// dtype (fp32 / bf16 / fp16) to the parameter's. Everything is checked before anything is copied: a missing
// or unexpected tensor, a shape that differs, a missing shard or a truncated file is a DataError naming the
// tensor and the file, and the model is left as it was. Reads one tensor at a time (offset reads): the host
// holds the model plus one tensor. A tied head's `lm_head.weight` (which some checkpoints store besides the
// embedding) and buffers that are not parameters (GPT-2's attn.bias masks, rotary inv_freq) are skipped.
HuggingFaceLoad load_hugging_face_weights(Model& model, const std::string& dir);

// The same checks, with the data read on request: what ZeRO-3 uses to read only each rank's part.
//
//   HuggingFaceWeights w(model, dir);                       // headers read, every tensor matched and checked
//   part.copy_(w.read("model.layers.0.mlp.up_proj.weight", begin, end));   // those elements' bytes only
class HuggingFaceWeights {
 public:
  HuggingFaceWeights(Model& model, const std::string& dir);
  ~HuggingFaceWeights();
  HuggingFaceWeights(const HuggingFaceWeights&) = delete;
  HuggingFaceWeights& operator=(const HuggingFaceWeights&) = delete;
  // Elements [begin, end) of memtrain parameter `name`, flattened in memtrain's layout, in the stored dtype.
  // Reads those bytes only, except for a transposed tensor (GPT-2's Conv1D), which is read whole.
  torch::Tensor read(const std::string& name, int64_t begin, int64_t end);
  // (parameter name, its tensor) for every parameter, a tied one once.
  const std::vector<std::pair<std::string, torch::Tensor>>& parameters() const;
  int64_t files() const;
  int64_t bytes_read() const;   // so far
  int64_t total_bytes() const;  // of every parameter's tensor in the files

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct HuggingFaceSaveOptions {
  c10::ScalarType dtype = torch::kFloat;           // the weights' stored dtype
  int64_t max_shard_bytes = 5LL * 1000 * 1000 * 1000;  // save_pretrained's 5GB: above it, shards and an index
};

// Writes config.json and the weights of `parameters` (memtrain names, full tensors, a tied weight once)
// into `dir` in the Hugging Face names and layout: one model.safetensors, or model-0000K-of-0000N.safetensors
// with model.safetensors.index.json when they exceed max_shard_bytes. Written into `dir`.partial and renamed:
// a failure leaves no half folder. `dir` must not exist yet (an export never overwrites one).
// Returns the files written.
std::vector<std::string> save_hugging_face(const std::string& dir, const ModelConfig& config,
                                           const std::map<std::string, torch::Tensor>& parameters,
                                           const HuggingFaceSaveOptions& options = {});

// ---- peft adapters (LoRA) --------------------------------------------------------------------------

// peft's checkpoint name of adapter parameter `parameter` of the model `model` describes (a ConfigError for a
// projection its family stores fused, Phi-3's q_proj inside qkv_proj):
// model.layers.0.self_attn.q_proj.lora_A -> base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight,
// h.0.attn.c_attn.lora_B -> base_model.model.transformer.h.0.attn.c_attn.lora_B.weight.
std::string peft_name(const ModelConfig& model, const std::string& parameter);

// Fills every adapter of `model` (add_lora made them) from DIR/adapter_model.safetensors: each present with
// its shape, no tensor left over; otherwise a DataError naming the tensor, and nothing is copied. A model split over a
// tensor-parallel group takes its slice of each adapter (the file holds whole ones). Returns the whole adapters read,
// by memtrain name.
std::map<std::string, torch::Tensor> load_lora_adapter(Model& model, const ModelConfig& config, const std::string& dir);

// Writes a peft adapter folder: adapter_config.json and adapter_model.safetensors (fp32), from the adapters
// by memtrain name. `dir`.partial renamed; an existing `dir` is refused. Returns the files written.
std::vector<std::string> save_lora_adapter(const std::string& dir, const ModelConfig& model, const LoraConfig& lora,
                                           const std::map<std::string, torch::Tensor>& adapters,
                                           const std::string& base_model);

// The parameters with every adapter merged into its base weight (W + B A scale, in memtrain's (out, in)
// layout, in fp32) and the adapters removed: what a plain Hugging Face export of a LoRA run holds.
std::map<std::string, torch::Tensor> merge_lora(const std::map<std::string, torch::Tensor>& parameters, double scale);

}  // namespace memtrain
