// Tensor parallelism inside a transformer block (Megatron-LM: Shoeybi et al. 2019), with sequence parallelism between
// blocks (Korthikanti et al. 2022). The T ranks of a tensor-parallel group each hold a slice of every large matrix:
//
//   column-parallel  q, k, v (by head; GQA's kv heads split too), the MLP's up (and gate) maps, their biases:
//                    the output features split, rank r computes its heads / its slice of the MLP's width;
//   row-parallel     the attention output and MLP down maps: the input features split, each rank's product is a
//                    partial sum, added over the group (the bias, whole on every rank, after the sum);
//   vocabulary       the token embedding and the output head by rows of the vocabulary: the lookup is a partial sum
//                    (a rank's rows, zeros elsewhere), the cross-entropy is taken over slices of the logits (a max, a
//                    sum of exponentials and the target's logit added over the group), never gathering (tokens, V).
//
// Between the splits the activations are whole on every rank (replicated), or with sequence parallelism 1/T of the
// tokens on each: then the entry to a block's split region is an all-gather of the tokens and its exit a reduce-
// scatter (instead of identity and all-reduce), and the norms, residuals and dropout run on 1/T of the tokens. The
// parameters used on those split tokens (norm weights, the row-parallel biases, position embeddings) are whole on
// every rank; their gradients are summed over the group in backward (tensor_parallel_shared), so every rank's copy
// gets the whole model's gradient and stays identical.
//
// The collectives run in the forward, and their transposes in the backward (autograd functions below); a block that is
// recomputed runs its forward collectives again, in the same order on every rank of the group.
//
//   TensorParallel tp{.group = my_group, .sequence_parallel = true};
//   ParameterBuild how{.shapes_only = true, .tp = std::make_shared<TensorParallel>(tp)};
//   auto model = make_model(cfg.model, data, how);         // every split matrix is this rank's slice
//   model->tensor_split("h.0.attn.c_attn.weight");        // {dim 0, 3 chunks}: where the slice sits in the whole
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace memtrain {

// The collectives over one tensor-parallel group (the runtime implements them with c10d: Gloo on CPU, NCCL on CUDA).
// Every call is collective over the group; inputs contiguous.
class TensorParallelGroup {
 public:
  virtual ~TensorParallelGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void all_reduce_sum(torch::Tensor& t) = 0;  // in place
  virtual void all_reduce_max(torch::Tensor& t) = 0;  // in place
  // out (size * in.numel() elements) = every rank's `in`, concatenated in rank order.
  virtual void all_gather(torch::Tensor& out, const torch::Tensor& in) = 0;
  // in (size * out.numel()) summed over ranks; this rank keeps elements [rank n, (rank + 1) n) in out.
  virtual void reduce_scatter(torch::Tensor& out, const torch::Tensor& in) = 0;
};

// What a model is built with when it is split (ParameterBuild::tp).
struct TensorParallel {
  std::shared_ptr<TensorParallelGroup> group;
  bool sequence_parallel = false;  // the activations between blocks hold 1/T of each row's tokens
  int size() const { return group ? group->size() : 1; }
  int rank() const { return group ? group->rank() : 0; }
};

// Where a parameter's slice sits in the whole parameter. dim < 0: whole on every rank (replicated). Otherwise dimension
// `dim` of the whole (of size `whole`) is `chunks` equal blocks (a fused q, k, v: 3), each split in T pieces; rank r
// holds piece r of every block, in block order. With one block the split may be uneven (a vocabulary that T does not
// divide): pieces of ceil(whole / T), the last ones shorter.
struct TensorSplit {
  int dim = -1;
  int64_t chunks = 1;
  int64_t whole = 0;
  bool split() const { return dim >= 0; }
};

// Rows [begin, begin + count) of a one-block split of `whole` on `rank` of `size`.
struct SplitRange {
  int64_t begin = 0, count = 0;
};
SplitRange split_range(int64_t whole, int rank, int size);
// The size of the split dimension on `rank` (chunks > 1: whole / size, which must divide).
int64_t split_size(const TensorSplit& s, int rank, int size);
// The whole parameter's sizes from a slice's.
std::vector<int64_t> whole_sizes(const TensorSplit& s, c10::IntArrayRef local_sizes);
// Calls fn(local_offset, whole_offset, length) for each run of elements [begin, end) of the flattened slice on `rank`
// that is contiguous in the flattened whole too (a row-parallel weight: one run per row; a column split: long runs).
void for_each_whole_run(const TensorSplit& s, c10::IntArrayRef local_sizes, int rank, int size, int64_t begin, int64_t end,
                        const std::function<void(int64_t local, int64_t whole, int64_t length)>& fn);
// Elements [begin, end) of the flattened slice on `rank`, copied from `whole`, which holds the whole parameter with k
// of its elements per value (k = 1: its values; a low-bit state field: one code or absmax per k elements): a flat
// tensor of (end - begin) / k values. begin and every run's bounds must be multiples of k (whole_run_granularity).
torch::Tensor slice_of_whole(const TensorSplit& s, c10::IntArrayRef local_sizes, int rank, int size,
                             const torch::Tensor& whole, int64_t begin, int64_t end, int64_t k = 1);

// The largest length g such that, on every rank of `size`, each run of for_each_whole_run over the whole slice starts
// (in the slice and in the whole) and ends at multiples of g: blocks of any divisor of g cut from the start of a slice
// are blocks of the whole parameter too (low-bit optimizer state keeps whole coordinates). `local_sizes` are any rank's.
int64_t whole_run_granularity(const TensorSplit& s, c10::IntArrayRef local_sizes, int size);

// The autograd functions (group == nullptr or size 1: identities).
// Entry to a split region: forward identity (sequence parallel: all-gather the tokens, dim 1); backward all-reduce
// (sequence parallel: reduce-scatter).
torch::Tensor tensor_parallel_enter(const torch::Tensor& x, const TensorParallel* tp);
// Exit of a split region (a row-parallel product's partial sums): forward all-reduce (sequence parallel: reduce-
// scatter over the tokens, dim 1); backward identity (all-gather).
torch::Tensor tensor_parallel_exit(const torch::Tensor& x, const TensorParallel* tp);
// A sum over the group in forward, identity in backward, whatever the sequence mode (a LoRA adapter's (tokens, r)
// product over a row-parallel input).
torch::Tensor tensor_parallel_sum(const torch::Tensor& x, const TensorParallel* tp);
// A whole parameter used on this rank's tokens only (sequence parallel): identity forward, its gradient summed over the
// group in backward. Without sequence parallelism: the parameter itself.
torch::Tensor tensor_parallel_shared(const torch::Tensor& p, const TensorParallel* tp);
// A whole parameter whose gradient each rank computes only in part (a LoRA A beside a column-parallel map: each rank's
// B slice contributes): identity forward, its gradient summed over the group in backward, whatever the sequence mode.
torch::Tensor tensor_parallel_summed_gradient(const torch::Tensor& p, const TensorParallel* tp);
// The tokens of this rank (sequence parallel): x.narrow(1, rank t, t); else x.
torch::Tensor tensor_parallel_local_tokens(const torch::Tensor& x, const TensorParallel* tp);

// A row-parallel linear map's end: this rank's partial product (y (..., in / T) times its columns of the weight, however
// the weight is stored) summed over the group (tensor_parallel_exit), then the whole bias (a shared parameter) if defined.
torch::Tensor row_parallel_output(const torch::Tensor& partial, const torch::Tensor& bias, const TensorParallel* tp);

// Where LoRA's adapter of a split linear map sits (`weight`: the map's weight's split): lora_A (rank, in) splits as a
// row-parallel weight's input features, lora_B (out, rank) as a column-parallel weight's output features (a fused
// q, k, v: by block); the other one is whole on every rank.
TensorSplit adapter_split(const std::string& name, const TensorSplit& weight);

// The vocabulary-parallel embedding: rows [vocab_begin, vocab_begin + rows) of the table on this rank; the result holds
// the rows of the ids in that range and zeros elsewhere (a partial sum; tensor_parallel_exit completes it).
torch::Tensor vocab_parallel_lookup(const torch::Tensor& ids, const torch::Tensor& weight, int64_t vocab_begin);
// Cross-entropy of slices of logits: `logits` (N, V_r) are columns [vocab_begin, vocab_begin + V_r) of the whole
// (N, V); target (N) int64 with -100 ignored. The mean over the targets not ignored, or their sum (`sum`). In fp32
// whatever the logits' dtype; the gradient in the logits' dtype. Collective over the group.
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& target, int64_t vocab_begin,
                                           const TensorParallel* tp, bool sum);

}  // namespace memtrain
