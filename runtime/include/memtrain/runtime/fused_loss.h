// Fused linear + cross-entropy: the language-model head and its loss computed chunk by chunk, with
// the gradients formed in the forward pass (softmax - one-hot is known there), so the (tokens x vocab)
// logits never exist whole and nothing of them is kept for backward. For GPT-2 124M at 16 x 1024
// tokens that is ~3.3 GB of fp32 logits, plus their log-softmax and gradient, that no block
// checkpointing policy can reach. Same arithmetic as linear + cross_entropy (mean over tokens).
//
//   auto loss = memtrain::fused_linear_cross_entropy(x.reshape({-1, C}), wte->weight, target.reshape({-1}));
#pragma once

#include <torch/types.h>

#include <string>

namespace memtrain {

class TensorParallelGroup;

// A vocabulary-parallel head (tensor parallelism): the weight holds rows [begin, begin + V_r) of the whole head on this
// rank of `group`. Each chunk's log-sum-exp and target logits are then reduced over the group (a maximum, and one sum
// of the exponentials' sums and the target logits), so every rank has the whole vocabulary's loss of each row, and the
// gradient of its own rows and its part of the features' (which the entry to the split region sums in backward).
struct VocabSlice {
  int64_t begin = 0;
  TensorParallelGroup* group = nullptr;  // nullptr: the whole vocabulary
};

// x: (N, C) features, weight: (V, C), target: (N,) int64 class indices. Returns the mean loss, a 0-dim
// fp32 tensor whose backward gives x and weight their gradients. Under autocast the matmuls run in
// the autocast dtype and the softmax in fp32, as autocast does for linear + cross_entropy.
// chunk_rows = 0 picks chunks of about 16 Mi logits (64 MiB in fp32; 333 tokens for GPT-2's vocabulary).
// Under no-grad (evaluation) only the loss is computed, chunk by chunk as well.
// `masked`: targets of -100 carry no loss (cross_entropy's ignore_index) and the result is the sum over the others,
// not a mean: the caller divides by the trained tokens of its whole step (no count, and no host read, here).
// `vocab`: a slice of the vocabulary (above); the loss is the whole vocabulary's on every rank of its group.
torch::Tensor fused_linear_cross_entropy(const torch::Tensor& x, const torch::Tensor& weight,
                                         const torch::Tensor& target, int64_t chunk_rows = 0, bool masked = false,
                                         const VocabSlice& vocab = {});

}  // namespace memtrain
