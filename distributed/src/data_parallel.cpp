#include "memtrain/distributed/data_parallel.h"

#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <sstream>

#include "memtrain/core/error.h"

namespace memtrain {

struct DataParallel::Bucket {
  std::vector<torch::Tensor> params;  // views into `flat`
  std::vector<int64_t> offsets;       // element offset of each parameter in the bucket
  int64_t size = 0;                   // elements, padded to a multiple of the world size
  int64_t shard = 0;                  // size / N: this rank's part is [rank * shard, (rank + 1) * shard)
  torch::Tensor flat;                 // (size,) param dtype: the parameters; replicated on every rank
  torch::Tensor grad;                 // (size,) param dtype: the full gradient; freed between backwards (stage 2)
  torch::Tensor stepped;              // what the optimizer steps: stage 0 flat (or its fp32 master),
                                      // stages 1/2 this rank's part of flat (or its fp32 master), (shard,)
  torch::Tensor reduced;              // stepped.grad(): the reduced gradient of the stepped part
  torch::Tensor scratch;              // (shard,) reduce-scatter output while one is in flight; else undefined
  bool into_reduced = false;          // the in-flight reduce-scatter writes straight into `reduced`
  int64_t reductions = 0;             // this step
  size_t ready = 0;                   // parameters whose gradient is accumulated in this backward
  PendingCollective pending;
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks;  // accumulator, hook key
  std::vector<unsigned> pre_hooks;    // stage 2: one per parameter, allocates the bucket's gradient
  // What the optimizer steps: per parameter, its elements inside `stepped` (a view) and their reduced
  // gradient (a view of `reduced`, set as the view's .grad): the weight-decay class is the parameter's.
  std::vector<std::pair<torch::Tensor, torch::Tensor>> segments;
};

namespace {
torch::Tensor part(const torch::Tensor& flat, int64_t rank, int64_t shard) { return flat.narrow(0, rank * shard, shard); }
}  // namespace

DataParallel::DataParallel(std::shared_ptr<ProcessGroup> group,
                           const std::vector<std::pair<std::string, torch::Tensor>>& named_params,
                           DataParallelOptions options)
    : group_(std::move(group)), options_(options) {
  MEMTRAIN_CHECK(options_.stage >= 0 && options_.stage <= 2, ConfigError, "[config] dist.zero_stage = ",
                 options_.stage, " is not supported here: expected 0, 1 or 2");
  MEMTRAIN_CHECK(options_.bucket_mib > 0, ConfigError, "[config] dist.bucket_mib = ", options_.bucket_mib,
                 ": expected > 0");
  MEMTRAIN_CHECK(!named_params.empty(), Error, "[dist] data parallelism needs at least one trainable parameter");
  const int64_t n = group_->size(), rank = group_->rank();
  const auto device = named_params.front().second.device();
  const auto bucket_bytes = static_cast<int64_t>(options_.bucket_mib * 1024 * 1024);

  // 1. Assign parameters to buckets, last registered first (backward's order): consecutive runs of one
  //    dtype, closed at bucket_mib. A bucket fills while backward goes on, so it can be reduced (and, in
  //    stage 2, freed) long before backward ends.
  std::vector<std::vector<torch::Tensor>> members;
  std::vector<std::vector<std::string>> member_names;
  for (auto it = named_params.rbegin(); it != named_params.rend(); ++it) {
    const auto& p = it->second;
    MEMTRAIN_CHECK(p.device() == device, Error, "[dist] parameter '", it->first, "' is on ", p.device(),
                   ", the others on ", device, ": data parallelism needs one device per rank");
    if (buckets_.empty() || members.back().front().scalar_type() != p.scalar_type() ||
        buckets_.back()->size * p.element_size() >= bucket_bytes) {
      buckets_.push_back(std::make_unique<Bucket>());
      members.emplace_back();
      member_names.emplace_back();
    }
    auto& b = *buckets_.back();
    b.offsets.push_back(b.size);
    b.size += p.numel();
    members.back().push_back(p);
    member_names.back().push_back(it->first);
  }

  // 2. Flat storage: parameters become views into it (same TensorImpl: autograd and hooks see the same
  //    leaves), replicated from rank 0 so that every rank starts from the same weights.
  for (size_t k = 0; k < buckets_.size(); ++k) {
    auto& b = *buckets_[k];
    b.size = (b.size + n - 1) / n * n;
    b.shard = b.size / n;
    const auto& first = members[k].front();
    b.flat = torch::zeros({b.size}, first.options().requires_grad(false));  // (size,) param dtype
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < members[k].size(); ++i) {
      auto p = members[k][i];
      auto view = b.flat.narrow(0, b.offsets[i], p.numel()).view(p.sizes());
      view.copy_(p.detach());
      p.set_data(view);
      b.params.push_back(p);
      index_.push_back({member_names[k][i], static_cast<int64_t>(k), b.offsets[i], p.sizes().vec()});
    }
    group_->broadcast(b.flat, 0);
    if (options_.stage > 0 || options_.master_weights) {
      auto mine = options_.stage > 0 ? part(b.flat, rank, b.shard) : b.flat;
      b.stepped = options_.master_weights ? mine.to(torch::kFloat, false, /*copy=*/true) : mine.detach();
      b.reduced = torch::zeros_like(b.stepped);  // (shard,) or (size,), the stepped dtype
    }
    if (options_.stage < 2) allocate_gradients(b);  // stage 2: when the bucket's first gradient arrives
    if (!b.stepped.defined()) {  // stage 0 without masters: the optimizer steps the bucket itself
      b.stepped = b.flat.detach();
      b.reduced = b.grad;
    }
    // Each parameter's elements in this rank's part, with the weight decay make_optimizer would give it
    // (matrices and filters only). The padding at a bucket's end belongs to no parameter: not stepped.
    const int64_t lo = options_.stage > 0 ? rank * b.shard : 0, hi = lo + b.stepped.numel();
    for (size_t i = 0; i < b.params.size(); ++i) {
      const int64_t from = std::max(lo, b.offsets[i]), to = std::min(hi, b.offsets[i] + b.params[i].numel());
      if (from >= to) continue;
      auto seg = b.stepped.narrow(0, from - lo, to - from);
      auto seg_grad = b.reduced.narrow(0, from - lo, to - from);
      seg.mutable_grad() = seg_grad;
      b.segments.emplace_back(seg, seg_grad);
      segments_.push_back({member_names[k][i], from - b.offsets[i], to - b.offsets[i], seg});
      (b.params[i].dim() >= 2 ? decay_ : no_decay_).push_back(seg);
    }
  }
  bytes_uncounted_ = group_->bytes_communicated();  // the initial broadcast is not a training step's traffic

  // 3. A post-hook on each parameter's gradient accumulator: "this gradient is complete".
  for (size_t k = 0; k < buckets_.size(); ++k) {
    for (auto& p : buckets_[k]->params) {
      auto acc = torch::autograd::impl::grad_accumulator(p);
      auto key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, k](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            on_gradient_ready(k);
            return outputs;
          }));
      buckets_[k]->hooks.emplace_back(acc, key);  // holding the accumulator keeps it (and the hook) alive
      // Stage 2: a bucket's full gradient exists from its first parameter's gradient to the end of its
      // reduce-scatter, not for the whole backward. The tensor hook runs before AccumulateGrad, which
      // then accumulates into the view it finds.
      if (options_.stage == 2)
        buckets_[k]->pre_hooks.push_back(p.register_hook([this, k](const torch::Tensor&) {
          if (!buckets_[k]->grad.defined()) allocate_gradients(*buckets_[k]);
        }));
    }
  }
}

DataParallel::~DataParallel() {
  for (auto& b : buckets_) {
    for (auto& [acc, key] : b->hooks) acc->del_post_hook(key);
    for (size_t i = 0; i < b->pre_hooks.size(); ++i) b->params[i].remove_hook(b->pre_hooks[i]);
  }
}

void DataParallel::allocate_gradients(Bucket& b) {
  if (!b.grad.defined()) b.grad = torch::zeros({b.size}, b.flat.options());  // (size,) param dtype
  for (size_t i = 0; i < b.params.size(); ++i)
    b.params[i].mutable_grad() = b.grad.narrow(0, b.offsets[i], b.params[i].numel()).view(b.params[i].sizes());
}

std::vector<torch::Tensor> DataParallel::stepped_tensors() const {
  auto all = decay_;
  all.insert(all.end(), no_decay_.begin(), no_decay_.end());
  return all;
}

int64_t DataParallel::num_buckets() const { return static_cast<int64_t>(buckets_.size()); }

const torch::Tensor& DataParallel::bucket_parameters(int64_t k) const { return buckets_.at(static_cast<size_t>(k))->flat; }

std::pair<int64_t, int64_t> DataParallel::owned_range(int64_t k) const {
  const auto& b = *buckets_.at(static_cast<size_t>(k));
  if (options_.stage == 0) return {0, b.size};
  return {group_->rank() * b.shard, (group_->rank() + 1) * b.shard};
}

void DataParallel::begin_step() {
  torch::NoGradGuard no_grad;
  for (auto& b : buckets_) {
    b->reductions = 0;
    if (b->reduced.defined() && !b->reduced.is_same(b->grad)) b->reduced.zero_();
    if (b->grad.defined()) {
      b->grad.zero_();
      allocate_gradients(*b);  // re-attach the views, in case something set a parameter's gradient to none
    }
    for (auto& [seg, seg_grad] : b->segments) seg.mutable_grad() = seg_grad;  // after a zero_grad(set_to_none)
  }
}

void DataParallel::begin_micro_batch(bool last) {
  armed_ = options_.reduce_every_micro_batch || last;
  next_to_launch_ = 0;
  for (auto& b : buckets_) b->ready = 0;
}

void DataParallel::on_gradient_ready(size_t k) {
  if (!armed_) return;  // a backward outside a micro-batch (the budget planner's probe), or not reducing now
  if (++buckets_[k]->ready == buckets_[k]->params.size()) launch_ready_buckets();
}

void DataParallel::launch_ready_buckets() {
  // In bucket order only: every rank must issue the same collectives in the same order.
  while (next_to_launch_ < buckets_.size() && buckets_[next_to_launch_]->ready == buckets_[next_to_launch_]->params.size()) {
    launch(*buckets_[next_to_launch_++]);
    // Stage 2: finish (wait for, add, free) the bucket before the one just launched, so at most two
    // full-size gradient buckets are in flight while backward goes on.
    if (options_.stage == 2 && next_to_launch_ >= 2) finish(*buckets_[next_to_launch_ - 2]);
  }
}

void DataParallel::launch(Bucket& b) {
  torch::NoGradGuard no_grad;
  if (!b.grad.defined()) allocate_gradients(b);  // stage 2: no parameter of it got a gradient (zeros)
  b.grad.div_(static_cast<double>(group_->size()));  // a mean over ranks; Gloo has no AVG
  if (options_.stage == 0) {
    b.pending = group_->all_reduce_sum_async(b.grad);
    return;
  }
  // The first reduction of a step may land in `reduced` itself; later ones (one per micro-batch) in a
  // transient buffer that finish() adds.
  b.into_reduced = b.reductions == 0 && !options_.master_weights;
  b.scratch = b.into_reduced ? b.reduced : torch::empty({b.shard}, b.grad.options());  // (shard,) param dtype
  b.pending = group_->reduce_scatter_sum_async(b.scratch, b.grad);
}

void DataParallel::finish(Bucket& b) {
  if (!b.pending.pending()) return;  // finished early (stage 2)
  b.pending.wait();
  torch::NoGradGuard no_grad;
  ++b.reductions;
  if (options_.stage == 0) {
    if (options_.master_weights) {  // fp32 accumulation of the reduced bf16 gradient
      b.reduced.add_(b.grad);
      b.grad.zero_();
    }
    return;
  }
  if (!b.into_reduced) b.reduced.add_(b.scratch);
  b.scratch = torch::Tensor();
  if (options_.stage == 1) {
    b.grad.zero_();  // kept for the next backward
  } else {           // stage 2: the full-size gradient is not kept
    for (auto& p : b.params) p.mutable_grad().reset();
    b.grad = torch::Tensor();
  }
}

void DataParallel::end_micro_batch() {
  if (armed_) {
    // Buckets with a parameter that got no gradient in this backward never filled: reduce them now.
    for (auto& b : buckets_) b->ready = b->params.size();
    launch_ready_buckets();
    for (auto& b : buckets_) finish(*b);
  }
  armed_ = false;
}

torch::Tensor DataParallel::clip_grad_norm(double max_norm) {
  std::vector<torch::Tensor> grads;
  for (const auto& b : buckets_) grads.push_back(b->reduced);
  auto norms = torch::_foreach_norm(grads, 2);
  auto sq = torch::stack(norms).to(torch::kFloat).pow(2).sum();
  if (options_.stage > 0) group_->all_reduce_sum(sq);  // stage 0: every rank holds the whole gradient
  auto total = sq.sqrt();
  if (max_norm > 0) {
    auto coef = torch::clamp_max(max_norm / (total + 1e-6), 1.0);  // no host read
    torch::_foreach_mul_(grads, coef.to(grads.front().dtype()));
  }
  return total;
}

int64_t DataParallel::take_bytes_communicated() {
  const auto now = group_->bytes_communicated() - bytes_uncounted_;
  const auto step = now - bytes_taken_;
  bytes_taken_ = now;
  return step;
}

template <class Collective>
void DataParallel::outside_the_step(Collective&& collective) {
  const auto before = group_->bytes_communicated();
  collective(*group_);
  bytes_uncounted_ += group_->bytes_communicated() - before;
}

void DataParallel::group_all_reduce_sum(torch::Tensor& t) {
  outside_the_step([&](ProcessGroup& g) { g.all_reduce_sum(t); });
}

void DataParallel::group_all_gather(torch::Tensor& output, torch::Tensor& input) {
  outside_the_step([&](ProcessGroup& g) { g.all_gather_async(output, input).wait(); });
}

void DataParallel::group_broadcast(torch::Tensor& t, int root) {
  outside_the_step([&](ProcessGroup& g) { g.broadcast(t, root); });
}

void DataParallel::all_reduce_found_inf(torch::Tensor& found_inf) { group_->all_reduce_max(found_inf); }

void DataParallel::after_optimizer_step() {
  torch::NoGradGuard no_grad;
  const int64_t rank = group_->rank();
  std::vector<PendingCollective> gathers;
  std::vector<torch::Tensor> inputs;  // kept alive until the gathers finish
  for (auto& b : buckets_) {
    auto mine = options_.stage > 0 ? part(b->flat, rank, b->shard) : b->flat;
    if (options_.master_weights) mine.copy_(b->stepped);  // fp32 -> bf16, rounded once per step
    if (options_.stage == 0) continue;
    inputs.push_back(mine.clone());  // (shard,): the gather writes over `flat`, which holds it
    gathers.push_back(group_->all_gather_async(b->flat, inputs.back()));
  }
  for (auto& g : gathers) g.wait();
}

ResidentBytes DataParallel::resident(const std::vector<torch::Tensor>& optimizer_state, const c10::Device& device) const {
  ResidentBytes r;
  auto bytes = [&](const torch::Tensor& t) {
    return t.defined() && t.device() == device ? static_cast<int64_t>(t.numel() * t.element_size()) : int64_t{0};
  };
  for (const auto& b : buckets_) {
    r.params += bytes(b->flat);
    r.grads += bytes(b->grad);
    if (options_.master_weights) {
      r.optimizer_state += bytes(b->stepped) + bytes(b->reduced);  // masters and their gradients
    } else if (!b->reduced.is_same(b->grad)) {
      r.grads += bytes(b->reduced);
    }
  }
  for (const auto& s : optimizer_state) r.optimizer_state += bytes(s);
  return r;
}

std::string DataParallel::describe() const {
  int64_t elems = 0;
  for (const auto& b : buckets_) elems += b->size;
  std::ostringstream os;
  os << "ZeRO stage " << options_.stage << " over " << group_->size() << " ranks (" << group_->backend_name() << "), "
     << buckets_.size() << " buckets of <= " << options_.bucket_mib << " MiB (" << elems << " elements), reduce "
     << (options_.reduce_every_micro_batch ? "every micro-batch" : "after the last micro-batch");
  return os.str();
}

}  // namespace memtrain
