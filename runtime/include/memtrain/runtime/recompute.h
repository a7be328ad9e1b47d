// Activation (gradient) checkpointing: run a block without keeping its activations, keep only its
// input, and recompute it in backward. The policy says which blocks (or block parts) are recomputed.
//
//   memtrain::RecomputePolicy policy = memtrain::RecomputePolicy::parse("every:2");
//   auto logits = memtrain::forward_with_checkpointing(*model, tokens, policy);
//
// The recompute restores the forward's RNG state (CPU, and CUDA when the input is on a GPU) and its
// autocast state, so dropout masks and dtypes match. Parameters are passed to autograd explicitly and
// their gradients come from torch::autograd::grad, so each parameter's gradient is accumulated
// exactly once by the outer backward (no reentrant-backward pitfalls). Caveats: a tensor pre-hook
// registered on a parameter (Tensor::register_hook) also runs during the recompute's inner grad(), so it
// fires twice per backward; and a BatchNorm inside a checkpointed block updates its running statistics
// twice per step (forward and recompute), as with torch.utils.checkpoint.
//
// Refused with an error naming the block, where they would otherwise give a silently wrong gradient:
// an input changed in place between the forward and the recompute (by the block itself, which runs
// under no-grad in the forward, or by the caller), and a double backward (create_graph = true).
#pragma once

#include <torch/types.h>

#include <functional>
#include <string>
#include <vector>

#include "memtrain/core/recompute_policy.h"

namespace memtrain {

class Model;

struct CheckpointOptions {
  // Keep saved CUDA inputs in pinned CPU memory, bring them back for the recompute (no-op on CPU).
  // The pinned copy is taken before the block runs and freed by the recompute; the tracker reports
  // pinned memory as pinned_host_bytes. One backward per forward: retain_graph is refused.
  bool offload = false;
};

// A block of several inputs and outputs. Integer outputs are non-differentiable; inputs must be defined
// (capture optional ones in the function).
using MultiBlockFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;
std::vector<torch::Tensor> checkpoint(const MultiBlockFn& fn, const std::vector<torch::Tensor>& inputs,
                                      const std::vector<torch::Tensor>& params, const CheckpointOptions& options = {});

// Runs fn(input) under checkpointing. `params` must hold every parameter fn uses that should receive
// a gradient; an fn that uses a parameter requiring grad which is missing from `params` would leave it
// without gradient, and is reported as an error at recompute time.
torch::Tensor checkpoint(const std::function<torch::Tensor(const torch::Tensor&)>& fn, const torch::Tensor& input,
                         const std::vector<torch::Tensor>& params, const CheckpointOptions& options = {});

// Counts block recomputations in this process (tests check that checkpointing really recomputed).
int64_t checkpoint_recompute_count();

// Called by run_blocks around each block: ZeRO stage 3 gathers a block's parameters just before it runs
// and frees them after, and gathers them again when the gradient of the block's output arrives in
// backward (a hook on that output, which runs before any of the block's backward, recompute included).
class BlockHooks {
 public:
  virtual ~BlockHooks() = default;
  virtual void before_block(int64_t block) = 0;
  virtual void after_block(int64_t block) = 0;
  virtual void before_block_backward(int64_t block) = 0;
};

// blocks(embed(input)) with the policy applied: the hidden state the head takes. Under no-grad it runs
// plainly. `hooks` (may be null) must outlive the backward of what this returns.
torch::Tensor run_blocks(Model& model, const torch::Tensor& input, const RecomputePolicy& policy,
                         BlockHooks* hooks = nullptr);
// head(run_blocks(input)).
torch::Tensor forward_with_checkpointing(Model& model, const torch::Tensor& input, const RecomputePolicy& policy);

// Activation bytes of each block, measured while recomputing blocks in backward (every block
// checkpointed), and the bytes of each block's saved input.
struct BlockActivationProfile {
  std::vector<int64_t> activation_bytes;  // per block: what a non-checkpointed block keeps for backward
  std::vector<int64_t> input_bytes;       // per block: what a checkpointed block keeps
  int64_t all_checkpointed_peak = 0;      // measured activation peak of the step, every block checkpointed
};
// Runs one forward + backward of `loss_fn` with every block checkpointed and measures each block's
// recompute allocation on `device`. Gradients it produces are left in place (callers zero them).
BlockActivationProfile profile_block_activations(Model& model, const std::function<torch::Tensor()>& loss_fn,
                                                 const c10::Device& device);
// The fewest checkpointed blocks whose estimated activation peak fits `budget_bytes`. The estimate
// starts from the measured all-checkpointed peak and adds (activation - input) bytes for each block
// left un-checkpointed; blocks that add least are left un-checkpointed first. Throws, naming the smallest feasible budget, when even
// checkpointing every block does not fit.
std::vector<bool> plan_checkpoint_budget(const BlockActivationProfile& profile, int64_t budget_bytes);

namespace detail {
// The block run_blocks is running on this thread (-1 outside run_blocks): named in checkpoint errors.
int64_t current_block_id();
}  // namespace detail

}  // namespace memtrain
