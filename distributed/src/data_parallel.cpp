#include "memtrain/distributed/data_parallel.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <deque>
#include <numeric>
#include <sstream>

#include "memtrain/core/cpu_memory.h"
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
  torch::Tensor reduced;              // stepped.grad(): the reduced gradient of the stepped part. Stages 2-3:
                                      // exists from the bucket's first reduction to the optimizer step only
  torch::Tensor scratch;              // (shard,) reduce-scatter output while one is in flight; else undefined
  bool into_reduced = false;          // the in-flight reduce-scatter writes straight into `reduced`
  // Offload from a GPU: reduced parts on their way to host memory (a pinned copy and the event after it), in
  // order; each is copied or added into `reduced` on the host once it has landed.
  struct Arrival {
    torch::Tensor staged;  // (shard,) pinned host, the parameters' dtype
    std::shared_ptr<c10::Event> landed;
    bool first = false;    // the step's first reduction: copied, not added
  };
  std::deque<Arrival> arrivals;
  int64_t reductions = 0;             // this step
  size_t ready = 0;                   // parameters whose gradient is accumulated in this backward
  PendingCollective pending;
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks;  // accumulator, hook key
  std::vector<unsigned> pre_hooks;    // stage 2: one per parameter, allocates the bucket's gradient
  // What the optimizer steps: per parameter, its elements inside `stepped` (a view) and where they start
  // there; their reduced gradient is the same range of `reduced`, set as the view's .grad.
  std::vector<std::pair<torch::Tensor, int64_t>> segments;
  bool reduced_per_step = false;      // stages 2-3: `reduced` is made by the first reduction and freed by the step
  bool stepped_is_copy = false;       // `stepped` is its own storage (fp32 masters, or offloaded): copied back after a step
  // Stage 3.
  int64_t unit = -1;                  // index into unit_buckets_
  torch::Tensor part;                 // (shard,) param dtype: this rank's part of the parameters, kept between uses
  bool gathered = false;              // `flat` has its full storage (a gather may still be in flight)
  PendingCollective gather;
  uint32_t version_before_gather = 0;
};

namespace {
// The tracker's breakdown of the peak: gradient buckets, reduced parts and reduce-scatter outputs are gradients.
void mark_gradient(const torch::Tensor& t) {
  if (t.is_cpu()) cpu_memory::mark(t.storage().data(), cpu_memory::Kind::kGradient);
}

torch::Tensor part(const torch::Tensor& flat, int64_t rank, int64_t shard) { return flat.narrow(0, rank * shard, shard); }

// Gives a tensor's storage `bytes` bytes from its own allocator (the contents are undefined), or none. Every
// tensor sharing the StorageImpl (the parameters, their views, what autograd saved) follows it.
void resize_storage(const torch::Tensor& t, size_t bytes) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() == bytes) return;
  impl->set_data_ptr_noswap(impl->allocator()->allocate(bytes));
  impl->set_nbytes(bytes);
}

// Puts a tensor's version counter (shared with its views) back to `version`.
void restore_version(const torch::Tensor& t, uint32_t version) {
  auto counter = torch::autograd::impl::version_counter(t);  // a handle on the shared counter
  counter.set_version(version);
}

// The bucket size bucket_mib asks for, in bytes.
int64_t bucket_bytes_of(const DataParallelOptions& options) {
  return static_cast<int64_t>(options.bucket_mib * 1024 * 1024);
}
}  // namespace

// While the buckets are built: each bucket's parameters and their names, in bucket order.
struct DataParallel::BucketMembers {
  std::vector<std::vector<torch::Tensor>> params;
  std::vector<std::vector<std::string>> names;
};

DataParallel::DataParallel(std::shared_ptr<ProcessGroup> group,
                           const std::vector<std::pair<std::string, torch::Tensor>>& named_params,
                           DataParallelOptions options)
    : group_(std::move(group)), options_(options) {
  MEMTRAIN_CHECK(options_.stage >= 0 && options_.stage <= 3, ConfigError, "[config] dist.zero_stage = ",
                 options_.stage, " is not supported here: expected 0, 1, 2 or 3");
  MEMTRAIN_CHECK(!options_.offload || options_.stage >= 1, ConfigError,
                 "[config] dist.offload_optimizer = cpu needs dist.zero_stage = 1, 2 or 3");
  MEMTRAIN_CHECK(options_.bucket_mib > 0, ConfigError, "[config] dist.bucket_mib = ", options_.bucket_mib,
                 ": expected > 0");
  MEMTRAIN_CHECK(!named_params.empty(), Error, "[dist] data parallelism needs at least one trainable parameter");
  device_ = named_params.front().second.device();
  const bool zero3 = options_.stage == 3;
  options_.reduce_every_micro_batch = reduces_each_micro_batch(options_.stage, options_.reduce_every_micro_batch);

  // Collective: every rank builds the same buckets and broadcasts them in the same order (2, then 2b).
  const auto members = assign_buckets(named_params);              // 1. parameters to buckets, backward's order
  build_flat_storage(members);                                    // 2. parameters become views of flat storage
  if (zero3 && !options_.frozen.empty()) build_frozen_buckets();  // 2b. stage 3: what does not train
  bytes_uncounted_ = group_->bytes_communicated();  // the initial broadcast is not a training step's traffic
  backward_prefetched_.assign(unit_buckets_.size(), false);  // a backward outside a micro-batch (a probe) uses it too
  register_gradient_hooks();                                      // 3. "this gradient is complete"
}

// 1. Assign parameters to buckets, last registered first (backward's order): consecutive runs of one
//    dtype, closed at bucket_mib. A bucket fills while backward goes on, so it can be reduced (and, in
//    stage 2, freed) long before backward ends. Stage 3: buckets never span two units (a unit is gathered
//    as its buckets), the last block's first and the root's last (its tied embedding's gradient completes at
//    the very end of backward). A bucket's parameters are freed as soon as it is complete: with buckets
//    smaller than a block, part of a block's storage goes before the rest of its backward has run.
DataParallel::BucketMembers DataParallel::assign_buckets(
    const std::vector<std::pair<std::string, torch::Tensor>>& named_params) {
  const auto device = device_;
  const auto bucket_bytes = bucket_bytes_of(options_);
  const bool zero3 = options_.stage == 3;
  std::vector<size_t> order;  // indices into named_params
  std::vector<int64_t> unit_of(named_params.size(), 0);
  if (zero3) {
    MEMTRAIN_CHECK(options_.units.size() == named_params.size(), Error, "[dist] ZeRO stage 3 needs the unit of each of the ",
                   named_params.size(), " parameters; got ", options_.units.size());
    MEMTRAIN_CHECK(options_.frozen_units.size() == options_.frozen.size(), Error, "[dist] ZeRO stage 3 needs the unit of each of the ",
                   options_.frozen.size(), " frozen parameters; got ", options_.frozen_units.size());
    int64_t blocks = options_.units.empty() ? 0 : *std::max_element(options_.units.begin(), options_.units.end()) + 1;
    for (auto u : options_.frozen_units) blocks = std::max(blocks, u + 1);
    unit_buckets_.resize(static_cast<size_t>(blocks + 1));
    unit_frozen_.resize(static_cast<size_t>(blocks + 1));
    for (int64_t u = blocks - 1; u >= -1; --u)
      for (size_t i = named_params.size(); i-- > 0;)
        if (options_.units[i] == u) order.push_back(i), unit_of[i] = u < 0 ? blocks : u;
  } else {
    for (size_t i = named_params.size(); i-- > 0;) order.push_back(i);
  }
  BucketMembers bucket_members;
  auto& members = bucket_members.params;
  auto& member_names = bucket_members.names;
  for (auto i : order) {
    const auto& [name, p] = named_params[i];
    MEMTRAIN_CHECK(p.device() == device, Error, "[dist] parameter '", name, "' is on ", p.device(),
                   ", the others on ", device, ": data parallelism needs one device per rank");
    if (buckets_.empty() || members.back().front().scalar_type() != p.scalar_type() ||
        (zero3 && buckets_.back()->unit != unit_of[i]) || buckets_.back()->size * p.element_size() >= bucket_bytes) {
      buckets_.push_back(std::make_unique<Bucket>());
      members.emplace_back();
      member_names.emplace_back();
      if (zero3) {
        buckets_.back()->unit = unit_of[i];
        unit_buckets_[static_cast<size_t>(unit_of[i])].push_back(buckets_.size() - 1);
      }
    }
    auto& b = *buckets_.back();
    const auto whole = options_.whole_numel.find(name);
    const int64_t numel = whole == options_.whole_numel.end() ? p.numel() : whole->second;
    const int64_t align = options_.align > 1 && numel >= options_.align_min_numel && numel % options_.align == 0 &&
                                  p.numel() % options_.align == 0
                              ? options_.align
                              : 1;
    b.offsets.push_back((b.size + align - 1) / align * align);
    b.size = b.offsets.back() + p.numel();
    members.back().push_back(p);
    member_names.back().push_back(name);
  }
  return bucket_members;
}

// 2. Flat storage: parameters become views into it (same TensorImpl: autograd and hooks see the same
//    leaves), replicated from rank 0 so that every rank starts from the same weights.
void DataParallel::build_flat_storage(const BucketMembers& bucket_members) {
  const int64_t n = group_->size(), rank = group_->rank();
  const auto device = device_;
  const bool zero3 = options_.stage == 3;
  const auto& members = bucket_members.params;
  const auto& member_names = bucket_members.names;
  const bool later = options_.contents == DataParallelOptions::Contents::kFilledLater;
  const bool broadcast = options_.contents == DataParallelOptions::Contents::kBroadcastFromRankZero;
  for (size_t k = 0; k < buckets_.size(); ++k) {
    auto& b = *buckets_[k];
    const int64_t unit = n * std::max<int64_t>(1, options_.align);
    b.size = (b.size + unit - 1) / unit * unit;
    b.shard = b.size / n;
    const auto& first = members[k].front();
    const auto flat_options = first.options().requires_grad(false);
    // Filled later at stage 3: the full storage is only where the views are cut (one bucket at a time), never
    // written or sent; the kept part starts at zero (its padding stays zero).
    b.flat = later && zero3 ? torch::empty({b.size}, flat_options) : torch::zeros({b.size}, flat_options);  // (size,)
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < members[k].size(); ++i) {
      auto p = members[k][i];
      auto view = b.flat.narrow(0, b.offsets[i], p.numel()).view(p.sizes());
      if (!later) view.copy_(p.detach());
      p.set_data(view);
      b.params.push_back(p);
      index_.push_back({member_names[k][i], static_cast<int64_t>(k), b.offsets[i], p.sizes().vec()});
    }
    if (broadcast) group_->broadcast(b.flat, 0);
    if (zero3) {
      // (shard,) param dtype: all that stays between uses
      b.part = later ? torch::zeros({b.shard}, flat_options) : part(b.flat, rank, b.shard).clone();
      resize_storage(b.flat, 0);
    }
    if (options_.stage > 0 || options_.master_weights) {
      auto mine = zero3 ? b.part : options_.stage > 0 ? part(b.flat, rank, b.shard) : b.flat;
      b.stepped_is_copy = options_.master_weights || options_.offload;
      if (b.stepped_is_copy) {
        // fp32 masters, or the offloaded part: (shard,) in host memory, pinned when the device is a GPU
        auto where = torch::TensorOptions()
                         .dtype(options_.master_weights ? torch::kFloat : mine.scalar_type())
                         .device(options_.offload ? c10::Device(c10::kCPU) : device);
        if (options_.offload && device.is_cuda()) where = where.pinned_memory(true);
        b.stepped = torch::empty(mine.sizes(), where);
        if (later) b.stepped.zero_();
        else b.stepped.copy_(mine);
      } else {
        b.stepped = mine.detach();
      }
      // Stages 2-3 make the reduced gradient at the bucket's first reduction and free it after the optimizer
      // step (as FSDP2's sharded gradients, set to none at zero_grad): it is not held through the forward.
      b.reduced_per_step = options_.stage >= 2;
      if (!b.reduced_per_step) b.reduced = torch::zeros_like(b.stepped), mark_gradient(b.reduced);  // (shard,) or (size,), the stepped dtype and device
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
      b.segments.emplace_back(seg, from - lo);
      segments_.push_back({member_names[k][i], from - b.offsets[i], to - b.offsets[i], seg});
      (b.params[i].dim() >= 2 ? decay_ : no_decay_).push_back(seg);
    }
    attach_reduced(b);
  }
}

// 2b. Stage 3, what does not train: the same packing per unit (last block first), flat storage replicated
//     from rank 0, this rank's part kept, the rest freed. No gradient, reduction or optimizer state.
void DataParallel::build_frozen_buckets() {
  const int64_t n = group_->size(), rank = group_->rank();
  const auto device = device_;
  const auto bucket_bytes = bucket_bytes_of(options_);
  const int64_t blocks = static_cast<int64_t>(unit_buckets_.size()) - 1;
  const bool later = options_.contents == DataParallelOptions::Contents::kFilledLater;
  const bool broadcast = options_.contents == DataParallelOptions::Contents::kBroadcastFromRankZero;
  for (int64_t u = blocks - 1; u >= -1; --u) {
    const auto unit = u < 0 ? blocks : u;
    std::vector<size_t> mine;
    for (size_t i = options_.frozen.size(); i-- > 0;)
      if (options_.frozen_units[i] == u) mine.push_back(i);
    Bucket* b = nullptr;
    std::vector<size_t> members_of;
    auto close = [&] {
      if (!b) return;
      b->size = (b->size + n - 1) / n * n;
      b->shard = b->size / n;
      const auto flat_options = b->params.front().options().requires_grad(false);
      b->flat = later ? torch::empty({b->size}, flat_options) : torch::zeros({b->size}, flat_options);  // (size,)
      torch::NoGradGuard no_grad;
      const auto k = static_cast<int64_t>(frozen_buckets_.size() - 1);
      for (size_t j = 0; j < b->params.size(); ++j) {
        auto p = b->params[j];
        auto view = b->flat.narrow(0, b->offsets[j], p.numel()).view(p.sizes());
        if (!later) view.copy_(p.detach());
        p.set_data(view);
        const auto& name = options_.frozen[members_of[j]].first;
        frozen_index_.push_back({name, k, b->offsets[j], p.sizes().vec()});
      }
      if (broadcast) group_->broadcast(b->flat, 0);
      // (shard,) param dtype: all that stays between uses
      b->part = later ? torch::zeros({b->shard}, flat_options) : part(b->flat, rank, b->shard).clone();
      resize_storage(b->flat, 0);
      const int64_t lo = rank * b->shard, hi = lo + b->shard;
      for (size_t j = 0; j < b->params.size(); ++j) {
        const int64_t from = std::max(lo, b->offsets[j]), to = std::min(hi, b->offsets[j] + b->params[j].numel());
        if (from < to)
          frozen_segments_.push_back({options_.frozen[members_of[j]].first, from - b->offsets[j], to - b->offsets[j],
                                      b->part.narrow(0, from - lo, to - from)});
      }
      b = nullptr;
      members_of.clear();
    };
    for (auto i : mine) {
      const auto& p = options_.frozen[i].second;
      MEMTRAIN_CHECK(p.device() == device, Error, "[dist] parameter '", options_.frozen[i].first, "' is on ", p.device(),
                     ", the others on ", device);
      if (!b || b->params.front().scalar_type() != p.scalar_type() || b->size * p.element_size() >= bucket_bytes) {
        close();
        frozen_buckets_.push_back(std::make_unique<Bucket>());
        b = frozen_buckets_.back().get();
        b->unit = unit;
        unit_frozen_[static_cast<size_t>(unit)].push_back(frozen_buckets_.size() - 1);
      }
      b->offsets.push_back(b->size);
      b->size += p.numel();
      b->params.push_back(p);
      members_of.push_back(i);
    }
    close();
  }
}

// 3. A post-hook on each parameter's gradient accumulator: "this gradient is complete".
void DataParallel::register_gradient_hooks() {
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
      if (options_.stage >= 2)
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
  if (!b.grad.defined()) b.grad = torch::zeros({b.size}, b.flat.options()), mark_gradient(b.grad);  // (size,) param dtype
  for (size_t i = 0; i < b.params.size(); ++i)
    b.params[i].mutable_grad() = b.grad.narrow(0, b.offsets[i], b.params[i].numel()).view(b.params[i].sizes());
}

void DataParallel::attach_reduced(Bucket& b) {
  for (auto& [seg, from] : b.segments)
    if (b.reduced.defined()) seg.mutable_grad() = b.reduced.narrow(0, from, seg.numel());
    else seg.mutable_grad().reset();
}

void DataParallel::make_reduced(Bucket& b) {
  if (b.reduced.defined()) return;
  auto where = b.stepped.options();
  if (options_.offload && device_.is_cuda()) where = where.pinned_memory(true);
  b.reduced = torch::empty(b.stepped.sizes(), where);  // (shard,) the stepped dtype; the first reduction fills it
  mark_gradient(b.reduced);
  attach_reduced(b);
}

void DataParallel::free_reduced(Bucket& b) {
  if (!b.reduced_per_step) return;
  b.reduced = torch::Tensor();
  attach_reduced(b);
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
    free_reduced(*b);  // stages 2-3: left by a skipped step
    // Stage 0 with masters adds each reduction into `reduced`; stages 1-3 overwrite it with the step's first
    // (every bucket is reduced at least once a step: end_micro_batch reduces those that never filled).
    if (options_.stage == 0 && b->reduced.defined() && !b->reduced.is_same(b->grad)) b->reduced.zero_();
    if (b->grad.defined()) {
      b->grad.zero_();
      allocate_gradients(*b);  // re-attach the views, in case something set a parameter's gradient to none
    }
    if (!b->reduced_per_step) attach_reduced(*b);  // after a zero_grad(set_to_none)
  }
}

void DataParallel::begin_micro_batch(bool last) {
  armed_ = options_.reduce_every_micro_batch || last;
  next_to_launch_ = 0;
  for (auto& b : buckets_) b->ready = 0;
  backward_prefetched_.assign(unit_buckets_.size(), false);
}

void DataParallel::on_gradient_ready(size_t k) {
  if (!armed_) return;  // a backward outside a micro-batch (the budget planner's probe), or not reducing now
  if (++buckets_[k]->ready == buckets_[k]->params.size()) {
    // Stage 3: every parameter of the bucket has its gradient, so no node left in this backward uses them.
    if (options_.stage == 3) release(*buckets_[k]);
    launch_ready_buckets();
    if (options_.stage == 3) prefetch_backward(buckets_[k]->unit);
  }
}

void DataParallel::launch_ready_buckets() {
  // In bucket order only: every rank must issue the same collectives in the same order.
  while (next_to_launch_ < buckets_.size() && buckets_[next_to_launch_]->ready == buckets_[next_to_launch_]->params.size()) {
    launch(*buckets_[next_to_launch_++]);
    // Stage 2: finish (wait for, add, free) the bucket before the one just launched, so at most two
    // full-size gradient buckets are in flight while backward goes on; and any earlier one whose
    // reduce-scatter has already completed, without waiting, so its full gradient goes at once.
    if (options_.stage >= 2 && next_to_launch_ >= 2) finish(*buckets_[next_to_launch_ - 2]);
  }
  if (options_.stage >= 2)
    for (size_t k = next_to_launch_ >= 2 ? next_to_launch_ - 2 : 0; k < next_to_launch_; ++k)
      if (buckets_[k]->pending.completed()) finish(*buckets_[k]);
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
  make_reduced(b);
  b.into_reduced = b.reductions == 0 && !b.stepped_is_copy;
  b.scratch = b.into_reduced ? b.reduced : torch::empty({b.shard}, b.grad.options());  // (shard,) param dtype
  mark_gradient(b.scratch);
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
  if (!b.into_reduced && b.scratch.is_cuda() && b.reduced.is_cpu()) {
    // Offload from a GPU: a blocking device-to-host copy here would stall backward once per bucket. The part
    // goes to pinned memory asynchronously (stream-ordered after the reduce-scatter; its device buffer can be
    // freed at once, the caching allocator orders reuse on the stream); the host adds it once the copy has landed.
    Bucket::Arrival a{torch::empty(b.scratch.sizes(), b.scratch.options().device(c10::kCPU).pinned_memory(true)),
                      std::make_shared<c10::Event>(c10::DeviceType::CUDA), b.reductions == 1};
    a.staged.copy_(b.scratch, /*non_blocking=*/true);
    a.landed->record(c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(b.scratch.device()));
    b.arrivals.push_back(std::move(a));
    for (auto& other : buckets_) land_arrivals(*other, /*wait=*/false);  // those already landed, while backward goes on
  } else if (!b.into_reduced) {
    auto here = b.reduced.device() == b.scratch.device() ? b.scratch : b.scratch.to(b.reduced.device());
    if (b.reductions == 1) b.reduced.copy_(here);  // the step's first: `reduced` holds nothing yet
    else b.reduced.add_(here);
  }
  b.scratch = torch::Tensor();
  if (options_.stage == 1) {
    b.grad.zero_();  // kept for the next backward
  } else {           // stage 2: the full-size gradient is not kept
    for (auto& p : b.params) p.mutable_grad().reset();
    b.grad = torch::Tensor();
  }
}

void DataParallel::land_arrivals(Bucket& b, bool wait) {
  torch::NoGradGuard no_grad;
  while (!b.arrivals.empty()) {
    auto& a = b.arrivals.front();
    if (!wait && !a.landed->query()) return;  // in order: a later one is never added before an earlier one
    a.landed->synchronize();
    if (a.first) b.reduced.copy_(a.staged);  // the parameters' dtype -> the stepped (fp32) dtype, on the host
    else b.reduced.add_(a.staged);
    b.arrivals.pop_front();
  }
}

void DataParallel::end_micro_batch() {
  if (armed_) {
    // Buckets with a parameter that got no gradient in this backward never filled: reduce them now.
    for (auto& b : buckets_) b->ready = b->params.size();
    launch_ready_buckets();
    for (auto& b : buckets_) finish(*b);
    for (auto& b : buckets_) land_arrivals(*b, /*wait=*/true);  // the host reads `reduced` next (norm, update)
  }
  armed_ = false;
  release_all();
}

torch::Tensor DataParallel::clip_grad_norm(double max_norm, bool host_waits) {
  std::vector<torch::Tensor> grads;
  for (const auto& b : buckets_) grads.push_back(b->reduced);
  auto norms = torch::_foreach_norm(grads, 2);
  auto sq = torch::stack(norms).to(device_, torch::kFloat).pow(2).sum();  // offload: the sum goes up to the device
  const auto& model = options_.model_group;
  if (model && model->size() > 1) {
    // Tensor parallel: a replicated parameter's gradient is on every rank of the model group; it counts 1/T on each,
    // so that the sum over the group counts it once.
    std::vector<torch::Tensor> replicated;
    for (const auto& seg : segments_)
      if (options_.replicated.count(seg.name) && seg.stepped.grad().defined()) replicated.push_back(seg.stepped.grad());
    if (!replicated.empty()) {
      auto rep = torch::stack(torch::_foreach_norm(replicated, 2)).to(device_, torch::kFloat).pow(2).sum();
      sq = sq - rep * (1.0 - 1.0 / static_cast<double>(model->size()));
    }
  }
  if (options_.stage > 0) {  // stage 0: every rank holds the whole gradient
    auto sum = group_->all_reduce_sum_async(sq);
    host_waits ? sum.wait_for_host() : sum.wait();
  }
  if (model && model->size() > 1) {
    auto sum = model->all_reduce_sum_async(sq);
    host_waits ? sum.wait_for_host() : sum.wait();
  }
  auto total = sq.sqrt();
  if (max_norm > 0) {
    auto coef = torch::clamp_max(max_norm / (total + 1e-6), 1.0);  // no host read (but offload's own copy down)
    torch::_foreach_mul_(grads, coef.to(grads.front().device(), grads.front().scalar_type()));
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

void DataParallel::group_all_reduce_max(torch::Tensor& t) {
  outside_the_step([&](ProcessGroup& g) { g.all_reduce_max(t); });
}

void DataParallel::group_all_gather(torch::Tensor& output, torch::Tensor& input) {
  outside_the_step([&](ProcessGroup& g) { g.all_gather_async(output, input).wait_for_host(); });
}

void DataParallel::group_broadcast(torch::Tensor& t, int root) {
  outside_the_step([&](ProcessGroup& g) { g.broadcast(t, root); });
}

void DataParallel::all_reduce_found_inf(torch::Tensor& found_inf, bool host_waits) {
  auto max = group_->all_reduce_max_async(found_inf);
  host_waits ? max.wait_for_host() : max.wait();
  if (options_.model_group && options_.model_group->size() > 1) {  // every rank of the grid skips, or none
    auto grid = options_.model_group->all_reduce_max_async(found_inf);
    host_waits ? grid.wait_for_host() : grid.wait();
  }
}

void DataParallel::after_optimizer_step(const StepBucket& step_bucket) {
  torch::NoGradGuard no_grad;
  const int64_t rank = group_->rank();
  std::vector<PendingCollective> gathers;
  std::vector<torch::Tensor> inputs;  // kept alive until the gathers finish
  std::vector<torch::Tensor> stepped;
  for (auto& b : buckets_) {
    // Offload, bucket by bucket: this bucket's update on the CPU, then its copy up (asynchronous from pinned
    // memory) and all-gather (stages 1-2) run while the CPU updates the next bucket (DeepSpeed's CPU Adam does
    // the same tile by tile).
    if (step_bucket) {
      stepped.clear();
      for (auto& [seg, from] : b->segments) stepped.push_back(seg);
      if (!stepped.empty()) step_bucket(stepped);
    }
    // Stage 3: the part only; the next forward gathers it.
    auto mine = options_.stage == 3 ? b->part : options_.stage > 0 ? part(b->flat, rank, b->shard) : b->flat;
    if (b->stepped_is_copy) {  // fp32 -> the parameters' dtype, rounded once per step
      if (b->stepped.device() != mine.device() && b->stepped.scalar_type() != mine.scalar_type()) {
        // Offload with bf16 parameters: a pinned fp32 -> device bf16 copy_ converts through a pageable host
        // temporary and synchronizes. Up in fp32 (asynchronous from pinned memory), then cast on the device.
        mine.copy_(b->stepped.to(mine.device(), /*non_blocking=*/b->stepped.is_pinned()));
      } else {
        mine.copy_(b->stepped, /*non_blocking=*/b->stepped.is_pinned());
      }
    }
    free_reduced(*b);  // stages 2-3: stepped; the next step's first reduction makes it again
    if (options_.stage == 0 || options_.stage == 3) continue;
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
    // Stage 3: this rank's part, and the full storage while it is gathered.
    r.params += options_.stage == 3 ? bytes(b->part) + (b->flat.device() == device ? static_cast<int64_t>(b->flat.storage().nbytes()) : 0)
                                    : bytes(b->flat);
    r.grads += bytes(b->grad);
    if (b->stepped_is_copy) {
      r.optimizer_state += bytes(b->stepped) + bytes(b->reduced);  // masters (or offloaded parts) and their gradients
    } else if (!b->reduced.is_same(b->grad)) {
      r.grads += bytes(b->reduced);
    }
  }
  for (const auto& b : frozen_buckets_)  // stage 3's frozen parts, and their full storage while gathered
    r.params += bytes(b->part) + (b->flat.device() == device ? static_cast<int64_t>(b->flat.storage().nbytes()) : 0);
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
  if (options_.stage == 3) os << "; parameters gathered per unit (" << num_units() - 1 << " blocks + root), prefetch " << options_.prefetch;
  if (!frozen_buckets_.empty()) os << "; " << frozen_buckets_.size() << " buckets of frozen parameters, sharded the same way";
  if (options_.offload) os << "; optimizer offloaded to " << (device_.is_cuda() ? "pinned " : "") << "host memory";
  return os.str();
}

void DataParallel::gather_bucket(Bucket& b) {
  if (b.gathered) return;
  // resize_storage swaps the storage's memory: a gather still writing into it would write into freed memory.
  // release() waits for a bucket's gather before it frees, so none can be pending here.
  TORCH_INTERNAL_ASSERT(!b.gather.pending(), "stage 3: a bucket is gathered again while its last gather is pending");
  const auto bytes = static_cast<size_t>(b.size) * b.flat.element_size();
  resize_storage(b.flat, bytes);
  if (b.flat.is_cpu()) cpu_memory::mark(b.flat.storage().data(), cpu_memory::Kind::kGathered);
  gathered_bytes_ += static_cast<int64_t>(bytes);
  peak_gathered_bytes_ = std::max(peak_gathered_bytes_, gathered_bytes_);
  b.gathered = true;
  // The gather writes the parameters' storage behind autograd's back: what a forward saved of them is
  // the same values again, so their version counter is put back as it was (FSDP does the same).
  b.version_before_gather = torch::autograd::impl::version_counter(b.flat).current_version();
  b.gather = group_->all_gather_async(b.flat, b.part);
}

void DataParallel::gather_unit(int64_t unit) {
  torch::NoGradGuard no_grad;
  for (auto k : unit_buckets_[static_cast<size_t>(unit)]) gather_bucket(*buckets_[k]);
  for (auto k : unit_frozen_[static_cast<size_t>(unit)]) gather_bucket(*frozen_buckets_[k]);
}

void DataParallel::wait_unit(int64_t unit) {
  auto wait = [](Bucket& b) {
    if (!b.gather.pending()) return;
    b.gather.wait();
    restore_version(b.flat, b.version_before_gather);
  };
  for (auto k : unit_buckets_[static_cast<size_t>(unit)]) wait(*buckets_[k]);
  for (auto k : unit_frozen_[static_cast<size_t>(unit)]) wait(*frozen_buckets_[k]);
}

void DataParallel::release(Bucket& b) {
  if (!b.gathered) return;
  if (b.gather.pending()) {
    b.gather.wait();
    restore_version(b.flat, b.version_before_gather);
  }
  gathered_bytes_ -= static_cast<int64_t>(b.flat.storage().nbytes());
  resize_storage(b.flat, 0);
  b.gathered = false;
}

void DataParallel::begin_forward() {
  if (options_.stage != 3) return;
  const int64_t root = num_units() - 1;
  gather_unit(root);
  for (int64_t j = 0; j < std::min(options_.prefetch, root); ++j) gather_unit(j);
  wait_unit(root);
}

void DataParallel::before_block(int64_t i) {
  if (options_.stage != 3) return;
  const int64_t blocks = num_units() - 1;
  gather_unit(i);
  for (int64_t j = i + 1; j <= std::min(i + options_.prefetch, blocks - 1); ++j) gather_unit(j);
  wait_unit(i);
}

void DataParallel::after_block(int64_t i) {
  if (options_.stage != 3) return;
  for (auto k : unit_buckets_[static_cast<size_t>(i)]) release(*buckets_[k]);
  for (auto k : unit_frozen_[static_cast<size_t>(i)]) release(*frozen_buckets_[k]);
}

void DataParallel::before_block_backward(int64_t i) {
  if (options_.stage != 3) return;
  // Block i + 1's backward has produced block i's output gradient: its input gradient no longer needs its
  // frozen weights (its trainable ones are freed as their gradients complete).
  if (i + 1 < num_units() - 1)
    for (auto k : unit_frozen_[static_cast<size_t>(i + 1)]) release(*frozen_buckets_[k]);
  gather_unit(i);  // already in flight when block i + 1 prefetched it
  if (unit_buckets_[static_cast<size_t>(i)].size() <= 1) prefetch_backward(i);  // else: at its first bucket's end
  wait_unit(i);
}

void DataParallel::prefetch_backward(int64_t unit) {
  // The blocks before `unit` are gathered once its first bucket is complete (reduce-scattered, its storage
  // and full gradient freed), not at its backward's start: the backward's start is where the activations
  // peak, and a block gathered there adds to that peak (FSDP2 on Gloo holds one less there). The gather still
  // overlaps the rest of the block's backward; a block of one bucket prefetches at its start instead.
  if (unit < 0 || unit >= num_units() - 1 || backward_prefetched_[static_cast<size_t>(unit)]) return;  // root: nothing before it
  backward_prefetched_[static_cast<size_t>(unit)] = true;
  // The reductions in flight end first, so their full gradients are gone before the gathered block comes.
  for (size_t k = 0; k < next_to_launch_; ++k) finish(*buckets_[k]);
  for (int64_t j = unit - 1; j >= std::max<int64_t>(0, unit - options_.prefetch); --j) gather_unit(j);
}

std::map<std::string, torch::Tensor> DataParallel::full_parameters(bool keep) {
  std::map<std::string, torch::Tensor> out;
  if (options_.stage != 3) return out;
  torch::NoGradGuard no_grad;
  // One unit's buckets (trainable, or frozen with their own index): copied to the host when `keep`, then freed.
  auto take = [&](const std::vector<size_t>& ks, std::vector<std::unique_ptr<Bucket>>& buckets,
                  const std::vector<ParamSlot>& index) {
    for (auto k : ks) {
      if (keep)
        for (const auto& slot : index)
          if (slot.bucket == static_cast<int64_t>(k)) {
            const int64_t numel = c10::multiply_integers(slot.shape);
            out[slot.name] = buckets[k]->flat.narrow(0, slot.offset, numel).view(slot.shape).to(
                torch::kCPU, /*non_blocking=*/false, /*copy=*/true);
          }
      release(*buckets[k]);
    }
  };
  outside_the_step([&](ProcessGroup&) {
    for (int64_t u = 0; u < num_units(); ++u) {
      gather_unit(u);
      wait_unit(u);
      take(unit_buckets_[static_cast<size_t>(u)], buckets_, index_);
      take(unit_frozen_[static_cast<size_t>(u)], frozen_buckets_, frozen_index_);
    }
  });
  return out;
}

void DataParallel::release_all() {
  if (options_.stage != 3) return;
  for (auto& b : buckets_) release(*b);
  for (auto& b : frozen_buckets_) release(*b);
  backward_prefetched_.assign(unit_buckets_.size(), false);
}

void DataParallel::parameters_from_stepped() {
  torch::NoGradGuard no_grad;
  for (auto& b : buckets_)
    if (options_.stage == 3 && b->stepped_is_copy) b->part.copy_(b->stepped);
}

int64_t DataParallel::take_peak_gathered_bytes() {
  const auto peak = peak_gathered_bytes_;
  peak_gathered_bytes_ = gathered_bytes_;
  return peak;
}

}  // namespace memtrain
