// GPT: a decoder-only transformer in the GPT-2 layout. Token + position embeddings, pre-LayerNorm
// blocks of causal self-attention (scaled_dot_product_attention) and a GELU MLP, a final LayerNorm,
// and an output head tied to the token embedding.
//
//   memtrain::GPT gpt(memtrain::GPTOptions::preset("gpt2"));   // 124,439,808 parameters
//   auto logits = gpt.forward(tokens);                          // (B, T) int64 -> (B, T, vocab)
#pragma once

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "memtrain/models/model.h"
#include "memtrain/models/shapes.h"

namespace memtrain {

struct GPTOptions {
  int64_t vocab_size = 256;
  int64_t block_size = 128;
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 128;
  double dropout = 0.0;
  bool bias = true;  // biases in the Linear layers (LayerNorms always have them, as in GPT-2)
  ParameterBuild build{};  // shapes only (no memory, nothing drawn) or LibTorch's initialised modules

  // tiny (2x2x64, for tests), gpt2 (124M), gpt2-medium (350M), gpt2-large (774M), gpt2-xl (1.5B);
  // the GPT-2 presets use vocab 50257 and context 1024.
  static GPTOptions preset(const std::string& name);
  // Parameters by arithmetic, without building the model: one block's (12 C^2 + 4 C, + 9 C with biases) and the
  // rest's (token and position embeddings, final LayerNorm; the head is the tied token embedding).
  int64_t block_parameter_count() const;
  int64_t root_parameter_count() const;
  // The shape the closed-form activation estimate reads (core/activation_model.h).
  TransformerShape shape() const;
};

struct ModelConfig;
// The options model.name = gpt describes (its preset's shape, or the keys'), vocabulary `vocab` where neither the key
// nor the preset gives one.
GPTOptions gpt_options(const ModelConfig& config, int64_t vocab);

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GPTOptions& o);
  torch::Tensor forward(const torch::Tensor& x);  // (B, T, C) -> (B, T, C)

  torch::nn::Linear c_attn{nullptr};  // (C, 3C): q, k, v projections in one matmul; split T: (C, 3C/T), this rank's heads
  torch::nn::Linear c_proj{nullptr};  // (C, C); split T: row-parallel (C/T, C), its bias whole
  torch::nn::Dropout resid_drop{nullptr};
  int64_t n_head;  // this rank's heads (n_head / T)
  double dropout;
  const TensorParallel* tp = nullptr;
};
TORCH_MODULE(CausalSelfAttention);

class MLPBlockImpl : public torch::nn::Module {
 public:
  explicit MLPBlockImpl(const GPTOptions& o);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Linear c_fc{nullptr};    // (C, 4C); split T: column-parallel (C, 4C/T)
  torch::nn::Linear c_proj{nullptr};  // (4C, C); split T: row-parallel (4C/T, C), its bias whole
  torch::nn::Dropout drop{nullptr};
  const TensorParallel* tp = nullptr;
};
TORCH_MODULE(MLPBlock);

class TransformerBlockImpl : public torch::nn::Module {
 public:
  explicit TransformerBlockImpl(const GPTOptions& o);
  torch::Tensor attn_part(const torch::Tensor& x);  // x + attn(ln_1(x))
  torch::Tensor mlp_part(const torch::Tensor& x);   // x + mlp(ln_2(x))
  torch::Tensor forward(const torch::Tensor& x) { return mlp_part(attn_part(x)); }

  torch::nn::LayerNorm ln_1{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::LayerNorm ln_2{nullptr};
  MLPBlock mlp{nullptr};
  const TensorParallel* tp = nullptr;
};
TORCH_MODULE(TransformerBlock);

class GPT : public Model {
 public:
  explicit GPT(const GPTOptions& options);

  torch::Tensor embed(const torch::Tensor& idx) override;  // (B, T) int64 -> (B, T, C)
  int64_t num_blocks() const override { return options_.n_layer; }
  std::vector<std::string> part_names() const override { return {"attn", "mlp"}; }
  torch::Tensor block_part(int64_t i, size_t part, const torch::Tensor& h) override;
  std::vector<torch::Tensor> block_parameters(int64_t i) const override;
  torch::Tensor head(const torch::Tensor& h) override;     // (B, T, C) -> (B, T, vocab)
  // (B, T, C) and (vocab, C); split T: this rank's tokens (sequence parallel) and vocabulary rows.
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
  const GPTOptions& options() const { return options_; }

  // 6 N + 12 L C T per token (PaLM appendix B / nanoGPT's estimate_mfu), N = parameters without
  // the position embedding (the tied token embedding counts: it is the output matmul).
  double train_flops_per_token() const;

  torch::nn::Embedding wte{nullptr};  // (vocab, C), shared with the output head; split T: this rank's rows of the vocabulary
  torch::nn::Embedding wpe{nullptr};  // (block_size, C)
  torch::nn::Dropout drop{nullptr};
  torch::nn::ModuleList h{nullptr};      // the blocks, named h.0 ... h.{L-1}
  std::vector<TransformerBlock> blocks;  // typed handles to the same modules
  torch::nn::LayerNorm ln_f{nullptr};

 protected:
  TensorSplit split_of(const std::string& name) const override;

 private:
  GPTOptions options_;
  int64_t vocab_begin_ = 0;  // split T: the first vocabulary row wte holds
};

}  // namespace memtrain
