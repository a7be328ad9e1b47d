// Llama: the decoder of the Llama family (Llama 2/3, Mistral, Qwen2), laid out as Hugging Face's
// LlamaForCausalLM so that parameter names are the checkpoint's own (model.layers.3.self_attn.q_proj.weight):
// token embedding, pre-RMSNorm blocks of grouped-query causal attention with rotary position embeddings
// and a SwiGLU MLP, a final RMSNorm, and an output head (its own lm_head, or tied to the embedding).
//
//   memtrain::Llama llama(memtrain::LlamaOptions::preset("llama-3.2-1b"));  // 1,235,814,400 parameters
//   auto logits = llama.forward(tokens);                                   // (B, T) int64 -> (B, T, vocab)
#pragma once

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <string>

#include "memtrain/models/model.h"
#include "memtrain/models/shapes.h"

namespace memtrain {

// Rotary embeddings' frequency scaling. none: inv_freq = theta^(-2i/d). llama3 (Llama 3.1's long-context
// scaling, transformers' _compute_llama3_parameters): wavelengths above original/low_freq_factor are
// divided by `factor`, those below original/high_freq_factor kept, and those between interpolated.
struct RopeScaling {
  std::string type = "none";  // none | llama3
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
};

struct LlamaOptions {
  int64_t vocab_size = 256;
  int64_t block_size = 128;         // the training context (rotary tables are made for it)
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_kv_head = 4;            // grouped-query attention: n_head / n_kv_head query heads share a k, v head
  int64_t n_embd = 128;             // hidden_size
  int64_t ffn_hidden = 344;         // intermediate_size of the SwiGLU MLP
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  double norm_eps = 1e-5;           // rms_norm_eps
  bool tie_embeddings = false;      // the head is the token embedding (Llama 3.2 1B/3B, Qwen2.5 0.5B)
  bool qkv_bias = false;            // biases on q, k, v (Qwen2; Llama's attention_bias)
  bool out_bias = false;            // a bias on o_proj (Llama's attention_bias)
  bool mlp_bias = false;            // biases on gate, up, down (Llama's mlp_bias)
  ParameterBuild build{};           // shapes only (no memory, nothing drawn) or LibTorch's initialised modules

  int64_t head_dim() const { return n_embd / n_head; }
  // Parameters by arithmetic, without building the model (tied embeddings once): the whole model, one block,
  // and the rest (embedding, final norm, an untied head).
  int64_t parameter_count() const;
  int64_t block_parameter_count() const;
  int64_t root_parameter_count() const;
  // The shape the closed-form activation estimate reads (core/activation_model.h).
  TransformerShape shape() const;
  // llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, llama-3.1-70b, qwen2.5-0.5b, qwen2.5-7b, mistral-7b (v0.1): the published
  // shapes; block_size stays whatever the caller sets (the training context, not the model's longest).
  static LlamaOptions preset(const std::string& name);
  // The names preset() knows, for messages.
  static std::string preset_names();
};

struct ModelConfig;
// The options model.name = llama describes (its preset's shape, or the keys'), vocabulary `vocab` where neither
// gives one.
LlamaOptions llama_options(const ModelConfig& config, int64_t vocab);

// The Llama family's pieces that a Llama-shaped family (Phi-3, phi3.cpp) registers too.
struct ModelTensors;
class ConfigJson;
struct HuggingFaceModel;
// config.json of llama / mistral / qwen2 into model.* (HuggingFaceModel: core/hugging_face_config.h), and back.
void read_llama_config(const ConfigJson& j, HuggingFaceModel& out);
std::string llama_config_json(const ModelConfig& m, const std::string& torch_dtype);
// The rules across the llama keys (n_kv_head divides n_head, even head width, block_size <= max_positions).
void check_llama_keys(const ModelConfig& model);
// The keys a Llama-shaped preset fixes.
std::vector<std::string> llama_fixed_keys();
// Each tensor's elements (ModelFamily::tensors) and the custom keys that describe `o` (for export).
ModelTensors llama_tensors(const LlamaOptions& o);
// The Llama family's initial values by parameter name (ModelFamily::init): norms one, biases zero, else N(0, 0.02).
InitSpec llama_init(const ModelConfig& config, const std::string& parameter);
ModelConfig llama_resolved(const ModelConfig& c, const LlamaOptions& o);

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps, const ParameterBuild& build = {});
  torch::Tensor forward(const torch::Tensor& x);  // (..., dim): weight * x / sqrt(mean(x^2) + eps)

  torch::Tensor weight;  // (dim,), ones
  double eps;
  const TensorParallel* tp = nullptr;  // sequence parallel: the weight's gradient summed over the group
};
TORCH_MODULE(RMSNorm);

// Rotary tables for positions 0..T-1: cos and sin, (T, head_dim), fp32, concatenated halves as
// transformers lays them out (rotate_half pairs element j with j + head_dim/2).
struct RotaryTables {
  torch::Tensor cos, sin;
};

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  explicit LlamaAttentionImpl(const LlamaOptions& o);
  torch::Tensor forward(const torch::Tensor& x, const RotaryTables& rope);  // (B, T, C) -> (B, T, C)

  // Split T: q, k, v column-parallel by head ((n_head / T) hd, C), o row-parallel (C, (n_head / T) hd), its bias whole.
  torch::nn::Linear q_proj{nullptr};  // (n_head * hd, C)
  torch::nn::Linear k_proj{nullptr};  // (n_kv_head * hd, C)
  torch::nn::Linear v_proj{nullptr};  // (n_kv_head * hd, C)
  torch::nn::Linear o_proj{nullptr};  // (C, n_head * hd)
  int64_t n_head, n_kv_head, head_dim;  // this rank's heads (split T: n_head / T, n_kv_head / T)
  const TensorParallel* tp = nullptr;
};
TORCH_MODULE(LlamaAttention);

class LlamaMLPImpl : public torch::nn::Module {
 public:
  explicit LlamaMLPImpl(const LlamaOptions& o);
  torch::Tensor forward(const torch::Tensor& x);  // down(silu(gate(x)) * up(x))

  torch::nn::Linear gate_proj{nullptr};  // (F, C); split T: (F / T, C)
  torch::nn::Linear up_proj{nullptr};    // (F, C); split T: (F / T, C)
  torch::nn::Linear down_proj{nullptr};  // (C, F); split T: row-parallel (C, F / T), its bias whole
  const TensorParallel* tp = nullptr;
};
TORCH_MODULE(LlamaMLP);

class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  explicit LlamaDecoderLayerImpl(const LlamaOptions& o);

  RMSNorm input_layernorm{nullptr};
  LlamaAttention self_attn{nullptr};
  RMSNorm post_attention_layernorm{nullptr};
  LlamaMLP mlp{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

// The body Hugging Face calls `model`: what the names model.embed_tokens / model.layers.N / model.norm hang off.
class LlamaBodyImpl : public torch::nn::Module {
 public:
  explicit LlamaBodyImpl(const LlamaOptions& o);

  torch::nn::Embedding embed_tokens{nullptr};  // (vocab, C)
  torch::nn::ModuleList layers{nullptr};
  std::vector<LlamaDecoderLayer> blocks;       // typed handles to the same modules
  RMSNorm norm{nullptr};
};
TORCH_MODULE(LlamaBody);

class Llama : public Model {
 public:
  explicit Llama(const LlamaOptions& options);

  torch::Tensor embed(const torch::Tensor& idx) override;  // (B, T) int64 -> (B, T, C)
  int64_t num_blocks() const override { return options_.n_layer; }
  std::vector<std::string> part_names() const override { return {"attn", "mlp"}; }
  torch::Tensor block_part(int64_t i, size_t part, const torch::Tensor& h) override;
  std::vector<torch::Tensor> block_parameters(int64_t i) const override;
  torch::Tensor head(const torch::Tensor& h) override;  // (B, T, C) -> (B, T, vocab)
  std::optional<std::pair<torch::Tensor, torch::Tensor>> head_features(const torch::Tensor& h) override;
  bool has_linear_head() const override { return true; }
  int64_t head_vocab_begin() const override { return vocab_begin_; }
  double train_flops_per_sample() const override;
  int64_t tokens_per_sample() const override { return options_.block_size; }
  double block_activation_bytes(int64_t micro_batch, int64_t bytes_per_element) const override;
  // Split T: the shape of this rank's slice (heads, kv heads, MLP width and vocabulary / T), what its activations are.
  std::optional<TransformerShape> transformer_shape() const override { return split_shape(options_.shape(), tensor_parallel()); }
  std::string describe() const override;
  torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target) const override;
  torch::Tensor loss_sum(const torch::Tensor& output, const torch::Tensor& target) const override;
  const TensorParallel* tensor_parallel() const override { return options_.build.tp.get(); }
  const LlamaOptions& options() const { return options_; }

  // 6 N + 12 L (n_head hd) T per token (PaLM appendix B), N = every parameter but the input embedding's
  // lookup table (a tied embedding counts once: it is the output matmul).
  double train_flops_per_token() const;
  // inv_freq (head_dim / 2,), fp32, computed as transformers computes it (rope_theta, then llama3 scaling).
  torch::Tensor inverse_frequencies() const;

  LlamaBody model{nullptr};
  torch::nn::Linear lm_head{nullptr};  // (vocab, C); none when tied

 protected:
  TensorSplit split_of(const std::string& name) const override;

 private:
  // The tables for T positions on `device` in `dtype`, made once (fp32) and cast once per other dtype.
  const RotaryTables& rotary(int64_t T, const c10::Device& device, c10::ScalarType dtype);

  LlamaOptions options_;
  int64_t vocab_begin_ = 0;  // split T: the first vocabulary row the embedding (and head) hold
  RotaryTables rope_;       // (T, hd) fp32 for rope_len_ positions on rope_device_: not parameters, never saved
  RotaryTables rope_cast_;  // the same in the activations' dtype, when that is not fp32
  int64_t rope_len_ = 0;
  c10::Device rope_device_ = c10::kCPU;
};

}  // namespace memtrain
