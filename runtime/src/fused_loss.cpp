#include "memtrain/runtime/fused_loss.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include "memtrain/core/cpu_memory.h"
#include "memtrain/core/error.h"
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

torch::Tensor chunked_loss(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& target,
                           int64_t chunk_rows, bool masked, double denominator) {
  // No fp16 row cap here: it bounds the weight-gradient product, which this path does not form.
  const auto compute = compute_dtype(x);
  AutocastGuard plain(x.device().type(), std::nullopt);  // casts are explicit below
  const auto N = x.size(0);
  auto w = weight.to(compute);  // (V, C)
  auto loss = torch::zeros({}, x.options().dtype(torch::kFloat));
  for (int64_t s = 0; s < N; s += chunk_rows) {
    const auto e = std::min(N, s + chunk_rows);
    auto logits = torch::matmul(x.slice(0, s, e).to(compute), w.t()).to(torch::kFloat);  // (n, V), per chunk
    auto tc = target.slice(0, s, e).unsqueeze(1);
    torch::Tensor keep;  // masked: (n, 1) rows with a loss
    if (masked) keep = kept_rows(tc), tc = tc.clamp_min(0);
    const auto terms = logits.logsumexp(1, /*keepdim=*/true) - logits.gather(1, tc);
    loss += masked ? (terms * keep).sum() : terms.sum();
  }
  return loss / denominator;
}

struct FusedLinearCrossEntropy : public torch::autograd::Function<FusedLinearCrossEntropy> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                                const torch::Tensor& weight, const torch::Tensor& target,
                                                int64_t chunk_rows, bool masked, double denominator) {
    const auto dev = x.device().type();
    const auto compute = compute_dtype(x);
    AutocastGuard plain(dev, std::nullopt);  // casts are explicit below
    if (compute == torch::kHalf) chunk_rows = std::min(chunk_rows, kMaxFp16ChunkRows);
    const auto N = x.size(0), V = weight.size(0);
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
      auto tc = target.slice(0, s, e).unsqueeze(1);                  // (n, 1)
      torch::Tensor keep;                                            // masked: (n, 1) rows with a loss
      if (masked) keep = kept_rows(tc), tc = tc.clamp_min(0);
      auto logits = torch::matmul(xc, w.t()).to(torch::kFloat);     // (n, V): the only big buffer, per chunk
      auto lse = logits.logsumexp(1, /*keepdim=*/true);              // (n, 1)
      loss += masked ? ((lse - logits.gather(1, tc)) * keep).sum() : (lse - logits.gather(1, tc)).sum();
      // d(sum CE)/d(logits) = softmax - one-hot, formed in place over the logits. Kept in [-1, 1] for the
      // low-precision matmuls; the 1/N of the mean is applied to the fp32 results (1/N before an fp16
      // cast would flush most entries to zero: softmax/N is ~1e-9 for GPT-2 at 16k tokens).
      auto d = logits.sub_(lse).exp_();
      d.scatter_add_(1, tc, torch::full_like(tc, -1.0, d.options()));
      if (masked) d.mul_(keep);  // a row without a loss has no gradient
      auto dc = d.to(compute);
      grad_x.slice(0, s, e).copy_(torch::matmul(dc, w));            // (n, V) @ (V, C), into fp32
      if (weight_grad) grad_w.add_(torch::matmul(dc.t(), xc));       // (V, n) @ (n, C), accumulated in fp32
    }
    (void)V;
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
    return {saved[0] * g.to(saved[0].dtype()), grad_w, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor fused_linear_cross_entropy(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& target,
                                         int64_t chunk_rows, bool masked) {
  MEMTRAIN_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), Error,
                 "[loss] fused_linear_cross_entropy: expected x (N, C) and weight (V, C), got ", x.sizes(), " and ",
                 weight.sizes());
  MEMTRAIN_CHECK(target.dim() == 1 && target.size(0) == x.size(0), Error,
                 "[loss] fused_linear_cross_entropy: target must be (N,) = (", x.size(0), "), got ", target.sizes());
  if (chunk_rows <= 0) {
    // Automatic: about 2^24 logits per chunk (64 MiB in fp32) on a CPU. A GPU's matmuls want long tiles: 2^27
    // (512 MiB in fp32, a small share of a data-centre GPU), in multiples of 64 rows (tensor-core tiles).
    const bool gpu = x.is_cuda();
    chunk_rows = ((gpu ? int64_t{1} << 27 : int64_t{1} << 24)) / weight.size(0);
    chunk_rows = gpu ? std::max<int64_t>(64, chunk_rows / 64 * 64) : std::max<int64_t>(1, chunk_rows);
  }
  // No grad mode: nothing would use the gradients that the autograd path forms in forward.
  // The mean over the rows; masked: the sum over the kept ones (the caller normalises).
  const double denominator = masked ? 1.0 : static_cast<double>(x.size(0));
  if (!torch::GradMode::is_enabled()) return chunked_loss(x, weight, target, chunk_rows, masked, denominator);
  return FusedLinearCrossEntropy::apply(x, weight, target, chunk_rows, masked, denominator)[0];
}

}  // namespace memtrain
