// The model contract: a stem (embed), an ordered list of blocks, and a head. Blocks are the units
// that activation checkpointing recomputes and that ZeRO-3 will gather; a block may be split into
// named parts (a transformer block into "attn" and "mlp") for selective checkpointing.
//
//   auto model = memtrain::make_model(cfg.model, data_info);   // runtime/factories.h
//   auto logits = model->forward(batch.input);          // == head(blocks(embed(input)))
//   auto loss = model->loss(logits, batch.target);
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <memory>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "memtrain/core/activation_model.h"
#include "memtrain/core/data_info.h"
#include "memtrain/models/tensor_parallel.h"

namespace memtrain {


class Model : public torch::nn::Module {
 public:
  virtual torch::Tensor embed(const torch::Tensor& input) = 0;
  virtual int64_t num_blocks() const = 0;
  // Runs block i: the composition of its parts in order.
  virtual torch::Tensor block(int64_t i, const torch::Tensor& h);
  // Parts of every block ({"block"} when a block is not split). Each part is a function of the
  // hidden state alone, residual included, so any part can be recomputed on its own.
  virtual std::vector<std::string> part_names() const { return {"block"}; }
  virtual torch::Tensor block_part(int64_t i, size_t part, const torch::Tensor& h) = 0;
  // The parameters block i uses (the checkpoint function passes them to autograd explicitly).
  virtual std::vector<torch::Tensor> block_parameters(int64_t i) const = 0;
  virtual torch::Tensor head(const torch::Tensor& h) = 0;
  // For models whose head is one linear map to classes (a language model's tied output): the features
  // fed to it and its (classes, features) weight, so the loss can be fused with the head
  // (memory.head = fused). nullopt when the head is anything else.
  virtual std::optional<std::pair<torch::Tensor, torch::Tensor>> head_features(const torch::Tensor& h) {
    return std::nullopt;
  }
  virtual bool has_linear_head() const { return false; }
  // Split T (a vocabulary-parallel head): the first vocabulary row of this rank's head weight; else 0.
  virtual int64_t head_vocab_begin() const { return 0; }
  // Mean cross-entropy of `output` (logits, last dim = classes) against integer `target`.
  virtual torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target) const;

  // Training FLOPs (forward + backward) per sample, the usual 3x-forward matmul count; 0 = unknown
  // (no FLOP/s or MFU is reported).
  virtual double train_flops_per_sample() const { return 0; }
  // Bytes one block saves for its backward at `micro_batch` samples when it is not recomputed, by a published
  // formula, with activations of `bytes_per_element`; 0 = unknown. What the memory estimate's probe is
  // checked against before it runs (a shape that cannot fit is an error, not minutes of allocation).
  virtual double block_activation_bytes(int64_t micro_batch, int64_t bytes_per_element) const { return 0; }
  // Tokens per sample (context length for language models, 1 otherwise), for tokens/s.
  virtual int64_t tokens_per_sample() const { return 1; }
  // memtrain's transformers: the shape their activations are estimated from in closed form, without running
  // them (core/activation_model.h); nullopt for models that are probed instead.
  virtual std::optional<TransformerShape> transformer_shape() const { return std::nullopt; }
  virtual std::string describe() const = 0;
  // Masked targets (chat records, -100 not trained): the summed cross-entropy of the trained tokens.
  virtual torch::Tensor loss_sum(const torch::Tensor& output, const torch::Tensor& target) const;

  // Tensor parallelism (tensor_parallel.h): the group the model is split over (null: whole), and where parameter
  // `name`'s slice sits in the whole parameter (replicated or whole: {}). LoRA's adapters sit as the weight of the map
  // they adapt says (adapter_split); the family's own parameters as its split_of says.
  virtual const TensorParallel* tensor_parallel() const { return nullptr; }
  TensorSplit tensor_split(const std::string& name) const;

  torch::Tensor forward(const torch::Tensor& input);
  int64_t num_parameters() const;  // distinct parameters (tied weights once)

 protected:
  // A split family's parameters (asked only when tensor_parallel() is set; adapters are resolved before).
  virtual TensorSplit split_of(const std::string& name) const { return {}; }
};

// Packed sequences (data.dataset = chat): several records share a row, each attending only to its own earlier tokens,
// positions restarting at each record. The trainer sets the layout of the batch in flight for its forward and
// backward (recomputed blocks read it again); GPT's position embedding, Llama's rotary tables and both attentions
// follow it. Process-wide, not per thread: a CUDA backward (and the recomputation in it) runs on the engine's threads.
struct PackedLayout {
  torch::Tensor positions;  // (B, T) int64: each token's position within its record
  torch::Tensor mask;       // (B, 1, T, T) bool: query i may attend to key j (same record, j <= i)
};
const PackedLayout* packed_layout();  // the layout in force, or nullptr
class PackedScope {
 public:
  // documents (B, T): each token's record index in its row (padding -1: it attends to the padding before it only).
  PackedScope(const torch::Tensor& positions, const torch::Tensor& documents);
  ~PackedScope();
  PackedScope(const PackedScope&) = delete;
  PackedScope& operator=(const PackedScope&) = delete;

 private:
  PackedLayout layout_;
  const PackedLayout* previous_;
};

// A transformer's shape as one rank of a tensor-parallel group holds it: heads, kv heads, MLP width and vocabulary
// split T ways (the vocabulary rounded up); the same shape without tp.
TransformerShape split_shape(TransformerShape shape, const TensorParallel* tp);

namespace detail {
// x @ W^T + b through at::linear, as Python's nn.Linear does. LibTorch's torch::nn::Linear::forward
// (torch::nn::functional::linear) runs matmul and then a separate `+= bias` for inputs of more than two
// dimensions: one more kernel and memory pass per layer, and in bf16 a second rounding, so its results
// differ from PyTorch's.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias = {});
}  // namespace detail

}  // namespace memtrain
