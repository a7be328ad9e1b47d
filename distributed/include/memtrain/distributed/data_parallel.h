// Data parallelism over a ProcessGroup, with ZeRO stages 0, 1, 2 and 3 (Rajbhandari et al. 2020).
//
// The model's trainable parameters are packed into flat buckets of one dtype, in reverse order of
// registration (the order backward produces their gradients), each padded to a multiple of the world
// size. Parameters become views into their bucket (their TensorImpl is kept, so
// autograd, hooks and the checkpoint function see the same leaves), and so do their gradients, which
// autograd accumulates into in place. Rank r owns elements [r S, (r + 1) S) of every bucket (S = padded
// size / N):
//
//   stage 0  gradients all-reduced (sum, then / N: Gloo has no AVG); every rank steps everything.
//   stage 1  gradients reduce-scattered into this rank's shard; optimizer state (and fp32 master
//            weights with bf16 parameters) exist for the shard only; the updated shards are all-gathered.
//   stage 2  as 1, and a bucket's full-size gradient is freed as soon as it has been reduce-scattered;
//            the reduced part is made by the bucket's first reduction and freed after the optimizer step
//            (FSDP2's sharded gradients are likewise none from zero_grad to the reduce-scatter), so the
//            forward, where the activations peak, holds no gradient at all.
//   stage 3  as 2, and the parameters too: a rank keeps only its part of each bucket between uses. The
//            buckets (still at most bucket_mib) never span two of the model's units (each block, and a root unit for everything outside the
//            blocks: embeddings, final norm, head, and any parameter two units share). A unit's buckets are
//            all-gathered into their full storage just before the unit runs (forward, and again before its
//            backward), and the storage is freed right after (forward) or once every parameter of the
//            bucket has its gradient (backward). The root stays gathered from the forward's start to the
//            end of its backward. Parameters keep their TensorImpl and even their StorageImpl: the storage
//            is resized to zero bytes and back (as PyTorch's FSDP1 does), so autograd's saved tensors, the
//            checkpoint function's parameter list and every view follow it. Parameters that do not train
//            (options.frozen: train.freeze, LoRA's base) are sharded and gathered per unit the same way, in
//            buckets of their own with no gradient, reduction or optimizer state; in backward a unit's frozen
//            buckets are freed when the block before it receives its output gradient.
//
// Offload (stages 1-3): the stepped part (fp32 masters, or a copy of the parameters' part), its reduced
// gradient and hence the optimizer state live in host memory (pinned on CUDA). Each reduced gradient is
// copied down when its bucket's reduction ends; the optimizer steps on the CPU; the updated part is
// copied back up in after_optimizer_step().
//
// Reductions start during backward as buckets fill (a post-hook on each parameter's AccumulateGrad, which
// runs once per backward even for a tied weight or a checkpointed block), strictly in bucket order so
// every rank issues the same collectives in the same order.
//
//   DataParallel dp(group, trainer_params, {.stage = 1});
//   auto opt = make_optimizer(opts, dp.decay_tensors(), dp.no_decay_tensors());   // shards, with .grad
//   for each micro-batch: dp.begin_micro_batch(last); loss.backward(); dp.end_micro_batch();
//   dp.clip_grad_norm(1.0); opt->step(); dp.after_optimizer_step();
#pragma once

#include <torch/types.h>

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "memtrain/core/memory_tracker.h"
#include "memtrain/distributed/process_group.h"

namespace memtrain {

// Whether a step's gradients are reduced after every micro-batch rather than once at its end: dist.reduce =
// micro_batch or bf16 parameters (`asked`: fp32 gradients are not kept across micro-batches for bf16 parameters), and
// always at ZeRO stage 3 (no full gradients are kept). The one rule DataParallel, the estimator and the time model read.
inline bool reduces_each_micro_batch(int stage, bool asked) { return stage == 3 || asked; }

struct DataParallelOptions {
  int stage = 0;                      // ZeRO stage: 0 | 1 | 2 | 3
  double bucket_mib = 25;             // target bucket size (DDP's default)
  bool reduce_every_micro_batch = false;  // true: reduce after every micro-batch (least memory);
                                          // false: accumulate locally, reduce after the last (least traffic)
  bool master_weights = false;        // bf16 parameters: the optimizer steps fp32 copies of this rank's part
  // Stage 3: the unit of each parameter of named_params (same order): 0..U-1 a block, -1 the root (what
  // lies outside the blocks, and any parameter used by two units). Reductions run after every micro-batch.
  std::vector<int64_t> units = {};
  int64_t prefetch = 1;               // stage 3: units gathered ahead of the one running (forward and backward)
  // Stage 3: parameters that do not train (train.freeze, LoRA's base) and their units. They are sharded and
  // gathered per unit as the others are, in buckets of their own that have no gradient, reduction or
  // optimizer state; a unit's are freed after its forward and once the backward has passed it. Other stages
  // leave them whole in the model.
  std::vector<std::pair<std::string, torch::Tensor>> frozen = {};
  std::vector<int64_t> frozen_units = {};
  bool offload = false;               // stages 1-3: the stepped part and its optimizer state in host memory
  // Each trainable parameter of at least `align_min_numel` elements and a multiple of `align` starts at a
  // multiple of `align` elements of its bucket, and each rank's part is a multiple of it: a rank's part of such
  // a parameter is then whole `align`-blocks of it, whatever the world size (low-bit optimizer state: blocks
  // never straddle two ranks; the other parameters keep fp32 state and need no alignment).
  int64_t align = 1;
  int64_t align_min_numel = 0;
  // A parameter that is a slice of a larger one (tensor parallelism): the whole's elements, which decide its alignment
  // as they decide whether its state is quantized (the slice itself must then be whole `align`-blocks).
  std::map<std::string, int64_t> whole_numel = {};
  // What the parameters hold when DataParallel takes them: rank 0's values, broadcast to all (an embedder's model);
  // the same values on every rank (filled from the seed or a checkpoint: copied in, no broadcast); or nothing yet
  // (built from shapes, models/shapes.h: no copy, no broadcast; stage 3 allocates one bucket at a time and keeps
  // its part, zeroed, as the masters; the caller fills segments() and frozen_segments(), then calls
  // parameters_from_stepped()).
  enum class Contents { kBroadcastFromRankZero, kSameOnEveryRank, kFilledLater };
  Contents contents = Contents::kBroadcastFromRankZero;
  // Tensor parallelism (dist.tensor_parallel): this group is one of the data-parallel groups, and `model_group` the
  // tensor-parallel group of this rank, over which each rank holds slices of the split parameters. The gradient norm
  // and fp16's found-inf are taken over both; the parameters named in `replicated` are whole (the same gradient) on
  // every rank of model_group and count once in the norm.
  std::shared_ptr<ProcessGroup> model_group = nullptr;
  std::set<std::string> replicated = {};
};

// Where a parameter lives: its name (FQN), its bucket, its element offset there, its shape.
struct ParamSlot {
  std::string name;
  int64_t bucket = 0;
  int64_t offset = 0;
  std::vector<int64_t> shape;
};

// What the optimizer steps on this rank for one parameter: elements [begin, end) of the flattened
// parameter `name`, as a view into this rank's part (the fp32 master with master weights); the view is
// the optimizer's key for its state.
struct SteppedSegment {
  std::string name;
  int64_t begin = 0;
  int64_t end = 0;
  torch::Tensor stepped;
};

class DataParallel {
 public:
  // `named_params`: the distinct trainable parameters (tied weights once), all on one device.
  DataParallel(std::shared_ptr<ProcessGroup> group, const std::vector<std::pair<std::string, torch::Tensor>>& named_params,
               DataParallelOptions options);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // What the optimizer steps: per parameter, its elements in this rank's part of its bucket (stage 0: all
  // of them; fp32 masters with master_weights), as views whose .grad is the reduced gradient. Split by
  // whether the parameter takes weight decay (matrices and filters) or not.
  const std::vector<torch::Tensor>& decay_tensors() const { return decay_; }
  const std::vector<torch::Tensor>& no_decay_tensors() const { return no_decay_; }
  std::vector<torch::Tensor> stepped_tensors() const;  // both lists
  const std::vector<SteppedSegment>& segments() const { return segments_; }
  // Stage 3: this rank's part of each frozen parameter (`stepped`: a view of its kept part); empty otherwise.
  const std::vector<SteppedSegment>& frozen_segments() const { return frozen_segments_; }
  // Stage 3: the frozen parameters' full shapes by name.
  const std::vector<ParamSlot>& frozen_index() const { return frozen_index_; }
  int stage() const { return options_.stage; }
  int world_size() const { return group_->size(); }

  void begin_step();                           // zero the reduced gradients
  void begin_micro_batch(bool last);           // before a backward: gradient buckets ready, hooks armed
  void end_micro_batch();                      // after it: every bucket reduced, waited for
  // Scales the reduced gradients so that their global L2 norm is at most max_norm (0: no clipping);
  // returns the norm before clipping (a device tensor; stages 1 and 2 all-reduce the squared shard norms).
  // host_waits: the all-reduce is waited for on the host (NCCL: with dist.timeout_s, a clear error), for a caller
  // that reads the result at once; else only the stream is ordered after it (a later host wait reports a failure).
  torch::Tensor clip_grad_norm(double max_norm, bool host_waits = true);
  // fp16: found-inf of this rank's gradients MAX-reduced over ranks (in place); host_waits as above.
  void all_reduce_found_inf(torch::Tensor& found_inf, bool host_waits = true);
  // Masters -> parameters; all-gather the updated parts. With `step_bucket` (offload) the update itself runs
  // here, one bucket's stepped tensors at a time, each bucket's copy up and gather started before the next
  // bucket's update.
  using StepBucket = std::function<void(const std::vector<torch::Tensor>& stepped)>;
  void after_optimizer_step(const StepBucket& step_bucket = {});
  bool offload() const { return options_.offload; }

  // Stage 3 (no-ops otherwise). begin_forward() before a forward: gathers the root unit (and prefetches
  // the first blocks). Around block i: before_block(i) gathers it (and prefetches the next), after_block(i)
  // frees it; before_block_backward(i) gathers it again when its output's gradient arrives (the blocks
  // before it are prefetched when its first bucket's gradient is complete). end_micro_batch()
  // and release_all() free everything still gathered. Collective: every rank calls them in the same order.
  void begin_forward();
  void before_block(int64_t i);
  void after_block(int64_t i);
  void before_block_backward(int64_t i);
  void release_all();
  // Stage 3: every parameter, full, copied to host memory by name when `keep` (empty otherwise), gathered
  // one unit at a time: a rank holds one gathered unit at most besides what it keeps. Collective.
  std::map<std::string, torch::Tensor> full_parameters(bool keep);
  // Stage 3: the parameters' parts from the stepped tensors (after loading a checkpoint into them).
  void parameters_from_stepped();
  // The most bytes of gathered (full) parameter storage held at once since the last call (stage 3).
  int64_t take_peak_gathered_bytes();

  // Resident bytes on `device`: parameters (full, replicated), gradients (full buckets held + reduced
  // parts), and masters + their gradients + `optimizer_state` as optimizer state.
  ResidentBytes resident(const std::vector<torch::Tensor>& optimizer_state, const c10::Device& device) const;
  // Bytes put into the step's collectives since the last call.
  int64_t take_bytes_communicated();
  // Collectives over the ranks outside the step (RankAgreement, evaluation, buffers): their bytes are not the
  // step's traffic.
  void group_all_reduce_sum(torch::Tensor& t);
  void group_all_reduce_max(torch::Tensor& t);
  void group_all_gather(torch::Tensor& output, torch::Tensor& input);
  void group_broadcast(torch::Tensor& t, int root);
  // Collectives between `mark = traffic_mark()` and not_step_traffic(mark) (stage 3's gathers in an
  // evaluation) are not counted as a step's traffic.
  int64_t traffic_mark() const { return group_->bytes_communicated(); }
  void not_step_traffic(int64_t mark) { bytes_uncounted_ += group_->bytes_communicated() - mark; }
  // Every collective of the group, once waited for (the trace's collective spans).
  void observe_collectives(CollectiveObserver observer) { group_->set_observer(std::move(observer)); }
  int64_t num_buckets() const;
  // The index name -> (bucket, offset, shape), in bucket order: what a sharded, name-keyed checkpoint
  // needs to find a parameter's part of each rank's state.
  const std::vector<ParamSlot>& index() const { return index_; }
  // Bucket k's flat parameters, (padded size,), and the element range this rank owns. Stage 3: the flat
  // tensor's storage is empty unless gathered.
  const torch::Tensor& bucket_parameters(int64_t k) const;
  std::pair<int64_t, int64_t> owned_range(int64_t k) const;
  std::string describe() const;

 private:
  struct Bucket;
  struct BucketMembers;
  // The constructor's builders, in the order it calls them (every rank the same: 2 and 2b broadcast).
  BucketMembers assign_buckets(const std::vector<std::pair<std::string, torch::Tensor>>& named_params);  // 1.
  void build_flat_storage(const BucketMembers& members);  // 2. parameters become views of flat storage
  void build_frozen_buckets();                            // 2b. stage 3: what does not train
  void register_gradient_hooks();                         // 3. "this gradient is complete"
  void on_gradient_ready(size_t bucket);
  void launch_ready_buckets();
  void launch(Bucket& b);
  void finish(Bucket& b);
  // Offload from a GPU: the reduced parts copied to pinned memory are put into `reduced` in order; with wait, all
  // of them (the host reads `reduced` next), else those whose copy has landed.
  void land_arrivals(Bucket& b, bool wait);
  void allocate_gradients(Bucket& b);
  void attach_reduced(Bucket& b);   // the stepped segments' .grad: views of `reduced`, or none
  void make_reduced(Bucket& b);     // stages 2-3: `reduced` for this step, unfilled
  void free_reduced(Bucket& b);     // stages 2-3: after the optimizer step
  void gather_unit(int64_t unit);   // stage 3: starts the gathers of a unit's buckets not yet gathered
  void wait_unit(int64_t unit);     // stage 3: waits for them
  void release(Bucket& b);          // stage 3: frees a bucket's full parameter storage
  void prefetch_backward(int64_t unit);  // stage 3: gathers the blocks before `unit`, once per backward
  int64_t num_units() const { return static_cast<int64_t>(unit_buckets_.size()); }  // blocks + the root
  // Runs a collective whose bytes are not the step's traffic (evaluation, logged losses, buffers).
  template <class Collective>
  void outside_the_step(Collective&& collective);

  std::shared_ptr<ProcessGroup> group_;
  DataParallelOptions options_;
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::vector<torch::Tensor> decay_, no_decay_;
  std::vector<ParamSlot> index_;
  std::vector<SteppedSegment> segments_;
  size_t next_to_launch_ = 0;
  bool armed_ = false;
  int64_t bytes_taken_ = 0;      // ProcessGroup::bytes_communicated() at the last take
  int64_t bytes_uncounted_ = 0;  // of which outside the step (broadcast at start, evaluation, losses)
  c10::Device device_ = c10::kCPU;
  std::vector<std::vector<size_t>> unit_buckets_;  // stage 3: per unit (blocks 0..U-1, then the root), its buckets
  // Stage 3, what does not train: buckets with parameters only (no gradient, reduction or stepped part),
  // per unit, their index and this rank's parts.
  std::vector<std::unique_ptr<Bucket>> frozen_buckets_;
  std::vector<std::vector<size_t>> unit_frozen_;
  std::vector<ParamSlot> frozen_index_;
  std::vector<SteppedSegment> frozen_segments_;
  void gather_bucket(Bucket& b);
  std::vector<bool> backward_prefetched_;          // stage 3: per unit, this backward's prefetch issued
  int64_t gathered_bytes_ = 0, peak_gathered_bytes_ = 0;
};

}  // namespace memtrain
