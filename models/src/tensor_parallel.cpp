#include "memtrain/models/tensor_parallel.h"

#include <torch/autograd.h>

#include <algorithm>
#include <numeric>

#include "memtrain/core/error.h"

namespace memtrain {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

SplitRange split_range(int64_t whole, int rank, int size) {
  const int64_t piece = (whole + size - 1) / size;
  const int64_t begin = std::min<int64_t>(whole, piece * rank);
  return {begin, std::min<int64_t>(piece, whole - begin)};
}

int64_t split_size(const TensorSplit& s, int rank, int size) {
  if (!s.split()) return s.whole;
  if (s.chunks == 1) return split_range(s.whole, rank, size).count;
  MEMTRAIN_CHECK(s.whole % (s.chunks * size) == 0, ConfigError, "[tensor parallel] a dimension of ", s.whole, " in ",
                 s.chunks, " blocks cannot be split over ", size, " ranks (each block's ", s.whole / s.chunks,
                 " must be a multiple of ", size, ")");
  return s.whole / size;
}

std::vector<int64_t> whole_sizes(const TensorSplit& s, c10::IntArrayRef local_sizes) {
  auto out = local_sizes.vec();
  if (s.split()) out.at(static_cast<size_t>(s.dim)) = s.whole;
  return out;
}

void for_each_whole_run(const TensorSplit& s, c10::IntArrayRef local_sizes, int rank, int size, int64_t begin, int64_t end,
                        const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  if (begin >= end) return;
  if (!s.split()) return fn(begin, begin, end - begin);
  const auto d = static_cast<size_t>(s.dim);
  int64_t inner = 1;
  for (size_t i = d + 1; i < local_sizes.size(); ++i) inner *= local_sizes[i];
  const int64_t local_d = local_sizes[d];
  // Rank r's piece of each block: `piece` rows starting at `start` within the block.
  const int64_t piece = s.chunks == 1 ? local_d : local_d / s.chunks;
  const int64_t block = s.whole / s.chunks;
  const int64_t start = s.chunks == 1 ? split_range(s.whole, rank, size).begin : piece * rank;
  for (int64_t i = begin; i < end;) {
    const int64_t outer = i / (local_d * inner), rem = i % (local_d * inner);
    const int64_t k = rem / inner, j = rem % inner;
    const int64_t c = k / piece, q = k % piece;
    const int64_t whole_k = c * block + start + q;
    const int64_t run = std::min(end - i, (piece - q) * inner - j);  // to the end of this piece's rows
    fn(i, (outer * s.whole + whole_k) * inner + j, run);
    i += run;
  }
}

torch::Tensor slice_of_whole(const TensorSplit& s, c10::IntArrayRef local_sizes, int rank, int size,
                             const torch::Tensor& whole, int64_t begin, int64_t end, int64_t k) {
  const auto flat = whole.reshape({-1});
  auto out = torch::empty({(end - begin) / k}, flat.options());
  for_each_whole_run(s, local_sizes, rank, size, begin, end, [&](int64_t l, int64_t w, int64_t n) {
    out.slice(0, (l - begin) / k, (l - begin + n) / k).copy_(flat.slice(0, w / k, (w + n) / k));
  });
  return out;
}

int64_t whole_run_granularity(const TensorSplit& s, c10::IntArrayRef local_sizes, int size) {
  int64_t g = 0;
  auto sizes = local_sizes.vec();
  for (int r = 0; r < size; ++r) {
    if (s.split()) sizes.at(static_cast<size_t>(s.dim)) = split_size(s, r, size);
    for_each_whole_run(s, sizes, r, size, 0, c10::multiply_integers(sizes), [&](int64_t l, int64_t w, int64_t n) {
      g = std::gcd(g, std::gcd(l, std::gcd(w, n)));
    });
  }
  return g;
}

namespace {

// (B, t, C) from every rank -> (B, T t, C), the ranks' tokens in rank order.
torch::Tensor gather_tokens(const torch::Tensor& x, TensorParallelGroup& g) {
  auto in = x.transpose(0, 1).contiguous();  // (t, B, C): one rank's tokens are one contiguous block
  auto sizes = in.sizes().vec();
  sizes[0] *= g.size();
  auto out = torch::empty(sizes, in.options());
  g.all_gather(out, in);
  return out.transpose(0, 1).contiguous();
}

// (B, T t, C) partial sums -> this rank's (B, t, C) of their sum.
torch::Tensor reduce_scatter_tokens(const torch::Tensor& x, TensorParallelGroup& g) {
  MEMTRAIN_CHECK(x.size(1) % g.size() == 0, Error, "[tensor parallel] sequence parallelism: a sequence of ", x.size(1),
                 " tokens does not split over ", g.size(), " ranks (make model.block_size a multiple of it)");
  auto in = x.transpose(0, 1).contiguous();  // (T t, B, C)
  auto sizes = in.sizes().vec();
  sizes[0] /= g.size();
  auto out = torch::empty(sizes, in.options());
  g.reduce_scatter(out, in);
  return out.transpose(0, 1).contiguous();
}

torch::Tensor all_reduced(const torch::Tensor& x, TensorParallelGroup& g) {
  auto out = x.contiguous().clone();
  g.all_reduce_sum(out);
  return out;
}

TensorParallelGroup* group_of(AutogradContext* ctx) {
  return reinterpret_cast<TensorParallelGroup*>(ctx->saved_data["group"].toInt());
}
void keep_group(AutogradContext* ctx, TensorParallelGroup* g, bool sequence) {
  ctx->saved_data["group"] = reinterpret_cast<int64_t>(g);
  ctx->saved_data["sequence"] = sequence;
}

struct Enter : torch::autograd::Function<Enter> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, TensorParallelGroup* g, bool sequence) {
    keep_group(ctx, g, sequence);
    return sequence ? gather_tokens(x, *g) : x;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto* g = group_of(ctx);
    const auto& dy = grads[0];
    return {ctx->saved_data["sequence"].toBool() ? reduce_scatter_tokens(dy, *g) : all_reduced(dy, *g), {}, {}};
  }
};

struct Exit : torch::autograd::Function<Exit> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, TensorParallelGroup* g, bool sequence) {
    keep_group(ctx, g, sequence);
    return sequence ? reduce_scatter_tokens(x, *g) : all_reduced(x, *g);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto* g = group_of(ctx);
    return {ctx->saved_data["sequence"].toBool() ? gather_tokens(grads[0], *g) : grads[0], {}, {}};
  }
};

struct Shared : torch::autograd::Function<Shared> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& p, TensorParallelGroup* g) {
    keep_group(ctx, g, true);
    return p;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    return {all_reduced(grads[0], *group_of(ctx)), {}};
  }
};

bool active(const TensorParallel* tp) { return tp && tp->group && tp->group->size() > 1; }

// Cross-entropy over vocabulary slices (Megatron's vocab-parallel cross-entropy): per row the max, the sum of
// exponentials and the target's logit are each added (max-ed) over the group; the softmax of this rank's slice is
// kept for the backward, (N, V_r) fp32.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& target,
                               int64_t vocab_begin, TensorParallelGroup* g, bool sum) {
    auto l = logits.to(torch::kFloat);                       // (N, V_r)
    const int64_t rows = l.size(1);
    auto m = std::get<0>(l.max(1)).contiguous();             // (N)
    if (g) g->all_reduce_max(m);
    auto e = (l - m.unsqueeze(1)).exp_();                    // (N, V_r)
    auto s = e.sum(1).contiguous();                          // (N)
    if (g) g->all_reduce_sum(s);
    const auto valid = target.ne(-100);
    auto local = target - vocab_begin;
    const auto inside = local.ge(0).logical_and(local.lt(rows)).logical_and(valid);
    local = local.clamp(0, std::max<int64_t>(rows - 1, 0)).masked_fill(inside.logical_not(), 0);
    auto picked = rows > 0 ? l.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(inside.logical_not(), 0.0)
                           : torch::zeros_like(m);
    picked = picked.contiguous();
    if (g) g->all_reduce_sum(picked);
    const auto per = (s.log() + m - picked).masked_fill(valid.logical_not(), 0.0);
    // The mean's count stays on the device (no host read per loss).
    const auto count = sum ? torch::ones({}, l.options()) : valid.sum().clamp_min(1).to(torch::kFloat);
    e.div_(s.unsqueeze(1));                                   // the softmax of this slice
    ctx->save_for_backward({e, local, inside, valid, count});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return per.sum() / count;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    auto grad = saved[0];  // the softmax, (N, V_r): made into the gradient in place (used once)
    const auto& local = saved[1];
    const auto& inside = saved[2];
    const auto& valid = saved[3];
    const auto& count = saved[4];
    if (grad.size(1) > 0) grad.scatter_add_(1, local.unsqueeze(1), -inside.to(grad.scalar_type()).unsqueeze(1));
    grad.mul_((valid.to(grad.scalar_type()) * (grads[0] / count)).unsqueeze(1));
    const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype), {}, {}, {}, {}};
  }
};

}  // namespace

torch::Tensor tensor_parallel_enter(const torch::Tensor& x, const TensorParallel* tp) {
  if (!active(tp)) return x;
  return Enter::apply(x, tp->group.get(), tp->sequence_parallel);
}

torch::Tensor tensor_parallel_exit(const torch::Tensor& x, const TensorParallel* tp) {
  if (!active(tp)) return x;
  return Exit::apply(x, tp->group.get(), tp->sequence_parallel);
}

torch::Tensor tensor_parallel_sum(const torch::Tensor& x, const TensorParallel* tp) {
  if (!active(tp)) return x;
  return Exit::apply(x, tp->group.get(), false);
}

torch::Tensor tensor_parallel_shared(const torch::Tensor& p, const TensorParallel* tp) {
  if (!active(tp) || !tp->sequence_parallel) return p;
  return Shared::apply(p, tp->group.get());
}

torch::Tensor tensor_parallel_summed_gradient(const torch::Tensor& p, const TensorParallel* tp) {
  if (!active(tp)) return p;
  return Shared::apply(p, tp->group.get());
}

TensorSplit adapter_split(const std::string& name, const TensorSplit& weight) {
  if (name.ends_with("lora_A")) return weight.dim == 1 ? weight : TensorSplit{};
  if (name.ends_with("lora_B")) return weight.dim == 0 ? weight : TensorSplit{};
  return {};
}

torch::Tensor tensor_parallel_local_tokens(const torch::Tensor& x, const TensorParallel* tp) {
  if (!active(tp) || !tp->sequence_parallel) return x;
  const int64_t T = x.size(1), n = tp->size();
  MEMTRAIN_CHECK(T % n == 0, Error, "[tensor parallel] sequence parallelism: a sequence of ", T,
                 " tokens does not split over ", n, " ranks (make model.block_size a multiple of it)");
  return x.narrow(1, tp->rank() * (T / n), T / n);
}

torch::Tensor row_parallel_output(const torch::Tensor& partial, const torch::Tensor& bias, const TensorParallel* tp) {
  auto out = tensor_parallel_exit(partial, tp);
  return bias.defined() ? out + tensor_parallel_shared(bias, tp) : out;
}

torch::Tensor vocab_parallel_lookup(const torch::Tensor& ids, const torch::Tensor& weight, int64_t vocab_begin) {
  const int64_t rows = weight.size(0);
  auto local = ids - vocab_begin;
  const auto outside = local.lt(0).logical_or(local.ge(rows));
  local = local.masked_fill(outside, 0);
  if (rows == 0) return torch::zeros({ids.size(0), ids.size(1), weight.size(1)}, weight.options());
  return at::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0.0);
}

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& target, int64_t vocab_begin,
                                           const TensorParallel* tp, bool sum) {
  MEMTRAIN_CHECK(logits.dim() == 2 && target.dim() == 1 && logits.size(0) == target.size(0), Error,
                 "[tensor parallel] cross-entropy of logits ", logits.sizes(), " against targets ", target.sizes());
  return VocabParallelCrossEntropy::apply(logits, target, vocab_begin, active(tp) ? tp->group.get() : nullptr, sum);
}

}  // namespace memtrain
