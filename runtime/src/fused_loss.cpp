#include "memtrain/runtime/fused_loss.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <limits>

#include "memtrain/core/activation_model.h"
#include "memtrain/core/cpu_memory.h"
#include "memtrain/core/error.h"
#include "memtrain/models/tensor_parallel.h"
#include "memtrain/runtime/precision.h"

namespace memtrain {
namespace {

// fp16 GEMM outputs saturate at 65504, and loss scaling cannot help: these are forward values, formed
// before any scale applies. A chunk's weight-gradient product (softmax - one-hot)^T x sums, for each
// class, over the chunk's rows; each term is at most |x| (the factor lies in [-1, 1]), so a chunk of n
// rows stays finite while n * max|x| < 65504. With at most 1024 rows that holds for features up to
// 63 in magnitude: the final LayerNorm's output, |x| <= |gamma| sqrt(C) + |beta| (28 |gamma| for
// GPT-2's C = 768), stays well inside it. The chunks' fp32 sum then holds any number of rows. The
// other two products do not grow with the rows: a logit sums C terms x w (|x| |w| C < 65504, as for
// PyTorch's own fp16 linear), and a row of the input gradient is at most 2 max|w|.
constexpr int64_t kMaxFp16ChunkRows = 1024;

// The matmul dtype: autocast's if it is on for x's device, else the inputs' own.
c10::ScalarType compute_dtype(const torch::Tensor& x) {
  const auto dev = x.device().type();
  return at::autocast::is_autocast_enabled(dev) ? at::autocast::get_autocast_dtype(dev) : x.scalar_type();
}

// Without gradients (evaluation): the same chunks and dtypes, the loss only.
// Rows whose target is -100 carry no loss: their target is read as class 0 and their terms multiplied by 0.
torch::Tensor kept_rows(const torch::Tensor& target) { return target.ne(-100); }

// One chunk's loss of each row, (n, 1) (0 on rows without one), from its logits (n, V) in fp32 and targets (n, 1).
// With `gradient` `logits` becomes d(sum CE)/d(logits): softmax - one-hot, 0 on rows without a loss (in place over a
// vocabulary slice; one process: a log-softmax's output takes the logits' place).
// A vocabulary slice (V = V_r columns of the whole) takes the log-sum-exp and the target's logit over its group: a
// maximum, then one sum of (the exponentials' sum, the target logit where this slice holds it).
torch::Tensor chunk_terms(torch::Tensor& logits, const torch::Tensor& target, const VocabSlice& vocab, bool masked,
                          bool gradient) {
  const int64_t n = logits.size(0), V = logits.size(1);
  const auto keep = masked ? kept_rows(target) : torch::Tensor();  // (n, 1) rows with a loss
  auto local = target - vocab.begin;
  torch::Tensor inside;  // a slice: the row's target is one of its classes (and the row has a loss)
  if (vocab.group) {
    inside = local.ge(0).logical_and(local.lt(V));
    if (masked) inside = inside.logical_and(keep);
    local = local.clamp(0, std::max<int64_t>(V - 1, 0)).masked_fill(inside.logical_not(), 0);
  } else if (masked) {
    local = local.clamp_min(0);  // a -100 row reads class 0; its terms are multiplied by 0
  }
  torch::Tensor terms;
  if (!vocab.group && gradient) {
    // One fused log-softmax pass gives each row's log-probabilities: the loss is minus the target's, their
    // exponentials (in place) the softmax. Its output replaces the logits (two chunk buffers at once, as logsumexp's
    // temporary made; three fewer passes over the chunk than logsumexp, subtract and exp).
    logits = at::_log_softmax(logits, 1, /*half_to_float=*/false);
    terms = -logits.gather(1, local);
    logits.exp_();
  } else if (!vocab.group) {
    terms = logits.logsumexp(1, /*keepdim=*/true) - logits.gather(1, local);
  } else {
    auto picked = V > 0 ? logits.gather(1, local) : torch::zeros({n, 1}, logits.options());
    auto m = V > 0 ? std::get<0>(logits.max(1, /*keepdim=*/true)).contiguous()
                   : torch::full({n, 1}, -std::numeric_limits<float>::infinity(), logits.options());
    vocab.group->all_reduce_max(m);
    logits.sub_(m).exp_();
    auto sums = torch::cat({logits.sum(1, /*keepdim=*/true), picked.masked_fill(inside.logical_not(), 0.0)}, 1).contiguous();
    vocab.group->all_reduce_sum(sums);  // (n, 2): the whole vocabulary's sum of exponentials, the target's logit
    const auto s = sums.slice(1, 0, 1);
    terms = s.log() + m - sums.slice(1, 1, 2);
    if (gradient) logits.div_(s);
  }
  if (masked) terms = terms * keep;
  if (gradient && V > 0) {  // (a slice may hold no rows of a tiny vocabulary)
    logits.scatter_add_(1, local, inside.defined() ? -inside.to(logits.scalar_type()) : torch::full_like(local, -1.0, logits.options()));
    if (masked) logits.mul_(keep);  // a row without a loss has no gradient
  }
  return terms;
}

torch::Tensor chunked_loss(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& target,
                           int64_t chunk_rows, bool masked, double denominator, const VocabSlice& vocab) {
  // No fp16 row cap here: it bounds the weight-gradient product, which this path does not form.
  const auto compute = compute_dtype(x);
  AutocastGuard plain(x.device().type(), std::nullopt);  // casts are explicit below
  const auto N = x.size(0);
  auto w = weight.to(compute);  // (V, C)
  auto loss = torch::zeros({}, x.options().dtype(torch::kFloat));
  for (int64_t s = 0; s < N; s += chunk_rows) {
    const auto e = std::min(N, s + chunk_rows);
    auto logits = torch::matmul(x.slice(0, s, e).to(compute), w.t()).to(torch::kFloat);  // (n, V), per chunk
    loss += chunk_terms(logits, target.slice(0, s, e).unsqueeze(1), vocab, masked, /*gradient=*/false).sum();
  }
  return loss / denominator;
}

struct FusedLinearCrossEntropy : public torch::autograd::Function<FusedLinearCrossEntropy> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                                const torch::Tensor& weight, const torch::Tensor& target,
                                                int64_t chunk_rows, bool masked, double denominator, int64_t vocab_begin,
                                                int64_t group) {
    const VocabSlice vocab{vocab_begin, reinterpret_cast<TensorParallelGroup*>(group)};
    const auto dev = x.device().type();
    const auto compute = compute_dtype(x);
    AutocastGuard plain(dev, std::nullopt);  // casts are explicit below
    if (compute == torch::kHalf) chunk_rows = std::min(chunk_rows, kMaxFp16ChunkRows);
    const auto N = x.size(0);
    // A frozen head (LoRA, train.freeze) gets no gradient: neither its (V, C) accumulator nor its product is formed.
    const bool weight_grad = weight.requires_grad();
    auto w = weight.to(compute);                          // (V, C)
    auto grad_x = torch::empty(x.sizes(), x.options().dtype(torch::kFloat));  // (N, C) fp32
    torch::Tensor grad_w;                                 // (V, C) fp32 accumulator, when the head trains
    if (weight_grad) grad_w = torch::zeros(weight.sizes(), weight.options().dtype(torch::kFloat));
    auto loss = torch::zeros({}, x.options().dtype(torch::kFloat));
    for (int64_t s = 0; s < N; s += chunk_rows) {
      const auto e = std::min(N, s + chunk_rows);
      auto xc = x.slice(0, s, e).to(compute);                        // (n, C)
      auto d = torch::matmul(xc, w.t()).to(torch::kFloat);          // (n, V) logits: the only big buffer, per chunk
      // d(sum CE)/d(logits) = softmax - one-hot, formed in place over the logits. Kept in [-1, 1] for the
      // low-precision matmuls; the 1/N of the mean is applied to the fp32 results (1/N before an fp16
      // cast would flush most entries to zero: softmax/N is ~1e-9 for GPT-2 at 16k tokens).
      loss += chunk_terms(d, target.slice(0, s, e).unsqueeze(1), vocab, masked, /*gradient=*/true).sum();
      auto dc = d.to(compute);
      grad_x.slice(0, s, e).copy_(torch::matmul(dc, w));            // (n, V) @ (V, C), into fp32
      if (weight_grad) grad_w.add_(torch::matmul(dc.t(), xc));       // (V, n) @ (n, C), accumulated in fp32
    }
    const double inv_n = 1.0 / denominator;
    auto saved_x = grad_x.mul_(inv_n).to(x.scalar_type());
    auto saved_w = weight_grad ? grad_w.mul_(inv_n).to(weight.scalar_type()) : torch::Tensor();
    if (saved_x.is_cpu()) {  // the tracker tells these apart from activations at the peak
      cpu_memory::mark(saved_x.storage().data(), cpu_memory::Kind::kHeadSaved);
      if (weight_grad) cpu_memory::mark(saved_w.storage().data(), cpu_memory::Kind::kHeadSaved);
    }
    ctx->save_for_backward({saved_x, saved_w});
    return {loss / denominator};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto saved = ctx->get_saved_variables();
    auto g = grad_out[0];
    auto grad_w = saved[1].defined() ? saved[1] * g.to(saved[1].dtype()) : torch::Tensor();
    return {saved[0] * g.to(saved[0].dtype()), grad_w, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor fused_linear_cross_entropy(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& target,
                                         int64_t chunk_rows, bool masked, const VocabSlice& vocab) {
  MEMTRAIN_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), Error,
                 "[loss] fused_linear_cross_entropy: expected x (N, C) and weight (V, C), got ", x.sizes(), " and ",
                 weight.sizes());
  MEMTRAIN_CHECK(target.dim() == 1 && target.size(0) == x.size(0), Error,
                 "[loss] fused_linear_cross_entropy: target must be (N,) = (", x.size(0), "), got ", target.sizes());
  // Automatic: about 2^24 logits per chunk (64 MiB in fp32) on a CPU. A GPU's matmuls want long tiles: 2^27
  // (512 MiB in fp32, a small share of a data-centre GPU), in multiples of 64 rows (tensor-core tiles). A vocabulary
  // slice's caller gives the rows (every rank of its group must cut the same chunks).
  MEMTRAIN_CHECK(chunk_rows > 0 || !vocab.group, Error, "[loss] fused_linear_cross_entropy over a vocabulary slice needs "
                 "its chunk rows (the same on every rank of the group)");
  if (chunk_rows <= 0) chunk_rows = fused_head_chunk_rows(weight.size(0), x.is_cuda());
  // No grad mode: nothing would use the gradients that the autograd path forms in forward.
  // The mean over the rows; masked: the sum over the kept ones (the caller normalises).
  const double denominator = masked ? 1.0 : static_cast<double>(x.size(0));
  if (!torch::GradMode::is_enabled()) return chunked_loss(x, weight, target, chunk_rows, masked, denominator, vocab);
  return FusedLinearCrossEntropy::apply(x, weight, target, chunk_rows, masked, denominator, vocab.begin,
                                        reinterpret_cast<int64_t>(vocab.group))[0];
}

}  // namespace memtrain
