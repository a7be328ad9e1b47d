// Trainer: builds a run from a Config (or takes an embedder's own model and data) and trains it with
// the configured memory techniques, measuring memory every step.
//
//   memtrain::cpu_memory::install();                     // first thing in main()
//   auto cfg = memtrain::Config::load("examples/configs/gpt_austen_cpu.ini");
//   memtrain::Trainer trainer(cfg);
//   trainer.fit();                                       // logs, evaluates, saves
//
//   // or one step at a time:
//   memtrain::StepResult r = trainer.step();
//   double loss = r.loss.item<double>();                 // reading it syncs: do it when logging
#pragma once

#include <torch/optim/optimizer.h>

#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "memtrain/runtime/recompute.h"
#include "memtrain/core/config.h"
#include "memtrain/core/cpu_memory.h"
#include "memtrain/data/datasets.h"
#include "memtrain/distributed/data_parallel.h"
#include "memtrain/distributed/parallel_dims.h"
#include "memtrain/distributed/rank_agreement.h"
#include "memtrain/distributed/world.h"
#include "memtrain/core/memory_tracker.h"
#include "memtrain/core/state_checkpoint.h"
#include "memtrain/models/model.h"
#include "memtrain/models/nf4.h"
#include "memtrain/optim/optimizer.h"
#include "memtrain/runtime/memory_estimate.h"
#include "memtrain/runtime/device.h"
#include "memtrain/runtime/planner.h"
#include "memtrain/runtime/precision.h"

namespace memtrain {

class TraceBlocks;  // log.trace_blocks (trainer_setup.cpp)
class GradientReadyHooks;  // runtime/src/gradient_hooks.h
namespace detail {
class StepFlags;   // train.host_reads = deferred (runtime/src/step_flags.h)
}
class RunReport;    // run_report.h
struct TargetSpeed;  // step_time.h (the planner's time model)

// A model's buffers (BatchNorm's running statistics and its num_batches_tracked count) kept aside and put back: a
// step retried after running out of memory, and the estimator's probe, leave them as they found them.
class ModelBuffers {
 public:
  void save(torch::nn::Module& module);     // copies them (storage reused from the last save)
  void restore(torch::nn::Module& module);  // copies them back; nothing if never saved
  bool empty() const { return saved_.empty(); }

 private:
  std::vector<torch::Tensor> saved_;
};

struct StepResult {
  int64_t step = 0;
  torch::Tensor loss;       // () fp32 on the device: mean over the step's micro-batches
  torch::Tensor grad_norm;  // () fp32 on the device: before clipping (global over ranks)
  int64_t comm_bytes = 0;   // bytes this rank put into collectives during the step
  int64_t gathered_peak_bytes = 0;  // ZeRO stage 3: most full (gathered) parameter bytes held at once in the step
  double lr = 0;
  bool applied = true;      // false when the step was skipped: fp16's scaler or train.on_nonfinite (inf/NaN)
  bool nonfinite = false;   // without fp16: the loss or the gradient norm was inf/NaN (the update was skipped)
};

struct EvalResult {
  double loss = 0;
  double accuracy = -1;  // classifiers only
  int64_t samples = 0;
  int64_t peak_bytes = -1;       // the training device's peak during the evaluation (-1: not tracked)
  int64_t activation_peak = -1;  // of which the evaluation added over what was resident
};

class InitialValues;  // trainer.cpp: every parameter's initial values, a slice at a time

class Trainer {
 public:
  // ---- What an embedder uses -----------------------------------------------------------------------
  // Everything from the config: model, data, optimizer, precision, recompute, tracker.
  explicit Trainer(const Config& config, const World& world = World::from_env());
  // An embedder's own model and data; the config supplies the rest.
  Trainer(const Config& config, std::shared_ptr<Model> model, std::shared_ptr<Dataset> data,
          const World& world = World::from_env());
  // Neither copied nor moved: the tracker's resident-bytes callback holds `this`.
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;
  Trainer(Trainer&&) = delete;
  Trainer& operator=(Trainer&&) = delete;
  ~Trainer();

  // One optimizer step: micro-batches, reduce, clip, update, memory. Its result is read on the host at its end
  // (applied, nonfinite); fit() defers that read to the next step with train.host_reads = deferred.
  StepResult step();
  // The mean loss (and accuracy) over `batches`, on the same forward as training. Collective with ranks.
  EvalResult evaluate(const std::vector<Batch>& batches);
  // evaluate() over the validation windows: train.eval_batches micro-batches, non-overlapping from the start
  // of the held-out data (what fit() logs as val loss, and `memtrain eval` prints). Collective with ranks.
  EvalResult validate();
  // config.train.steps steps with logging, evaluation and saving (a RunReport writes every output);
  // resumes first when checkpoint.resume says so. SIGTERM / SIGINT while it runs: the current step ends, a
  // checkpoint is saved, fit() returns (stopped_by_signal()); a second signal exits the process at once.
  // With ranks, fit() ends with a barrier and the process group's shutdown: no collective after it.
  void fit();
  // Parameters and buffers by name, as safetensors. ZeRO stage 3 holds no full parameters: there every
  // rank must call it (the parameters are gathered unit by unit; rank 0 writes).
  void save_weights(const std::string& path);
  // The whole training state (core/state_checkpoint.h): parameters (fp32 masters where they exist),
  // buffers, optimizer state by parameter name, the loss scaler, the step, the recompute plan and the
  // config, as checkpoint.dir/step-N/. Collective when there are ranks (each writes its own part).
  // Throws Error when any rank cannot write; the previous checkpoints are left as they were.
  std::string save_checkpoint();
  // Continues from a checkpoint saved at any world size and ZeRO stage (each rank takes its part).
  // A checkpoint of another model, optimizer or shape is an error naming the tensor; nothing is changed then.
  void load_checkpoint(const std::string& path);

  Model& model() { return *model_; }
  Dataset& data() { return *data_; }
  MemoryTracker& tracker() { return *tracker_; }
  const Config& config() const { return config_; }
  const World& world() const { return world_; }
  // The degrees of parallelism and ZeRO stage this run trains with (after memory.budget_mib's plan).
  const ParallelDims& dims() const { return dims_; }
  const c10::Device& device() const { return device_; }
  int64_t current_step() const { return step_; }
  const std::string& run_dir() const { return run_dir_; }
  const std::string& checkpoint_dir() const { return ckpt_dir_; }
  bool stopped_by_signal() const { return stopped_by_signal_; }

  // ---- Inspection: what tests, tools and the run report read ---------------------------------------
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  const RecomputePolicy& recompute_policy() const { return policy_; }
  const GradScaler* scaler() const { return scaler_.get(); }
  Precision precision() const { return precision_; }
  // Pieces each micro-batch is cut into after out-of-memory retries (1: none).
  int64_t micro_batch_split() const { return split_; }
  // Distinct trainable parameters (tied weights once).
  const std::vector<torch::Tensor>& parameters() const { return params_; }
  // The data-parallel engine of a multi-process run (ZeRO stages 0-3) or of offload; null otherwise.
  DataParallel* data_parallel() { return dp_.get(); }
  const DataParallel* data_parallel() const { return dp_.get(); }
  // fp32 master copies of parameters() when train.param_dtype = bf16 (the optimizer steps these); else empty.
  // BatchNorm's parameters and running statistics stay fp32 in the model then (their masters exist too).
  const std::vector<torch::Tensor>& master_weights() const { return master_; }
  // The memory estimate made before step 1 (memory.estimate): this rank's peak by component.
  const MemoryEstimate& memory_estimate() const { return estimate_; }
  // What estimate_memory() needs for the same model and config on `world` ranks (the ZeRO stage, offload
  // and prefetch of the config): `memtrain estimate --ranks N` varies its stage and offload. A probe with
  // gradients dropped as they arrive is run the first time (several ranks keep gradients in buckets,
  // counted apart).
  EstimateInputs estimate_inputs_for(int world);
  // The device whose counters measure this run's memory (the GPU, else the CPU), and the last step's peak
  // there (-1: not tracked).
  c10::Device memory_device() const { return device_.is_cuda() ? device_ : c10::Device(c10::kCPU); }
  int64_t last_peak() const;
  // The checkpoint this run resumed from ("" for a fresh run).
  const std::string& resumed_from() const { return resumed_from_; }
  // Ranks agreeing on host values outside the step (a collective per call when there are ranks).
  // Tensor parallel: over the world's group (DataParallel's is one data-parallel group).
  RankAgreement agreement() const { return RankAgreement(tp_ ? nullptr : dp_.get(), group_.get(), device_); }

 private:
  // setup(), in numbered steps (trainer_setup.cpp).
  void setup();
  void setup_device();                                           // 1
  torch::OrderedDict<std::string, torch::Tensor> setup_parameters();  // 2: returns the fp32 masters by name
  torch::OrderedDict<std::string, torch::Tensor> parameters_from_shapes();  // 2, built from shapes
  void give_whole_memory();       // every parameter: memory for the whole of it (no values yet)
  void parameters_after_plan();   // 5b: a plan on several ranks chose the stage
  void setup_units();                                            // 3
  void setup_group();                                            // 4
  bool setup_plan(torch::OrderedDict<std::string, torch::Tensor>& masters);  // 5: returns sharded
  void setup_recompute_and_head();                               // 6
  void setup_data_parallel();                                    // 8
  void setup_schedule_and_scaler();                              // 9
  void setup_tracker();                                          // 10
  void setup_outputs();                                          // 11

  StepResult run_step(bool read_flags_now);  // step(), or fit()'s with the read deferred where it may be
  StepResult profiled_step();  // log.profile_step: run_step, its flags read and its kernels done, recorded by Kineto
  StepResult attempt_step();
  // train.host_reads = deferred: the update skipped on the device when found-inf, and the step's flags recorded.
  void update_deciding_on_device(StepResult& r, const torch::Tensor& loss_sum);
  // The recorded flags of an earlier step (or this one's, into *r): the non-finite count, warning or stop, and a
  // stop request. Nothing when none are pending.
  void read_step_flags(StepResult* r);
  // A step's non-finite loss or gradient norm (the update was skipped): counted, warned of, or the run stopped.
  void on_nonfinite_step(int64_t step, const std::string& what);
  torch::Tensor run_micro_batches();                           // attempt_step's 1-2: the summed loss
  void clip_and_update(StepResult& r, const torch::Tensor& loss_sum);  // attempt_step's 3-4
  void recover_from_oom(const std::string& what);  // throws when the step cannot be retried
  void resume_or_refuse();                          // fit(): checkpoint.resume and log.overwrite
  // resume_or_refuse's pieces, collective: without checkpoint.resume, a run folder holding a run refused (or
  // cleared: log.overwrite); with it, the checkpoint every rank found ("" = start fresh).
  void refuse_or_overwrite_run();
  std::string agreed_resume_path();
  void make_output_folders() const;                 // fit(): every folder it writes, probed before step 1
  bool agree(bool ok) { return agreement().all(ok); }
  bool stop_requested();                            // a stop signal on any rank (collective)
  void fill_whole();  // setup step 2, built from shapes: every parameter whole on this rank, with its values
  void fill_held();   // after setup: the segments this rank steps (and holds, under ZeRO-3), with their values
  void setup_lora_and_freeze();                     // 0. LoRA's adapters; what does not train
  // fit()'s pieces: a save (its line in the report), traced; the end of the run.
  std::string save_reported(RunReport& report);    // the checkpoint's folder
  void finish(RunReport& report);
  std::vector<ShardPiece> state_pieces() const;
  // load_checkpoint's checks, before anything is copied (DataError naming the tensor): the parameters that have
  // optimizer state in it.
  std::set<std::string> check_checkpoint(const std::string& path, const LoadedCheckpoint& ck) const;
  // "resumed: step N from ..." and the settings that differ from the checkpoint's run (rank 0).
  void say_resumed(const std::string& path, const LoadedCheckpoint& ck, double seconds) const;
  // The forward of training and evaluation: autocast, ZeRO-3's gathers, the blocks (recomputed as the
  // policy says), the head; the loss, and the logits in *logits when asked (none with the fused head).
  torch::Tensor forward_loss(const Batch& batch, torch::Tensor* logits = nullptr);
  Batch to_device(Batch batch) const;
  // ZeRO-3: the collectives of one forward (the root's gather, each block's gather and prefetch) without the
  // forward, for a rank whose share of an evaluation has fewer batches than another's. No-op otherwise.
  void gathers_of_a_forward();
  // Several ranks, or one whose optimizer state is offloaded (a group of one), train through DataParallel and its
  // sharded optimizer; `world` ranks under this config.
  bool sharded(int world) const { return ParallelDims::of(config_.dist, world).sharded(); }
  void mark_gradients() const;   // this backward's gradient blocks, for the tracker's peak breakdown (CPU)
  // bf16 parameters with fp32 masters (one process): params_[i]'s gradient added into (or cast to) master_[i]'s and
  // freed. The hooks do it as each gradient completes; move_grads_to_masters takes whatever is left after a backward.
  void grad_into_master(size_t i);
  void move_grads_to_masters();
  void hook_grads_to_masters(bool on);
  // One process, bf16 parameters with masters, one micro-batch per step and an element-wise optimizer (fused or
  // low-bit AdamW): the gradients stay bf16 through backward and the optimizer steps the masters bucket by bucket
  // (dist.bucket_mib), each bucket's fp32 gradients cast, clipped, stepped and freed before the next. Otherwise the
  // fp32 master gradients accumulate every micro-batch (grad_into_master).
  bool masters_step_by_bucket() const;
  torch::Tensor bf16_grad_norm(double max_norm);  // the global norm of the fp32 values; sets clip_coef_
  void step_masters_by_bucket();
  void resolve_budget_policy();
  void sync_buffers();  // several ranks: floating buffers (BatchNorm statistics) from rank 0
  bool can_measure() const { return config_.memory.track && (device_.is_cuda() || cpu_memory::installed()); }
  void write_memory_snapshot();     // memory.snapshot: the allocator's pickled history, for memory_viz
  // Activation bytes of one forward + backward at micro-batch m on the training device (the tracker's
  // activation_peak of a step): gradients kept as a single process keeps them, or dropped as they arrive
  // (several ranks hold them in buckets). Leaves parameters, gradients and buffers as they were.
  int64_t probe_activations(int64_t micro_batch, bool keep_grads, double* ms = nullptr);
  ActivationProbe probe(bool keep_grads);  // at two micro-batches up to half the configured one
  // Bytes and time at m0 and m1. `clamp`: noise that makes time fall with the batch, or start below zero, is
  // clamped now (the planner clamps after its later timing rounds, retime_probe, instead).
  ActivationProbe probe_at(int64_t m0, int64_t m1, bool keep_grads, bool clamp = true);
  void retime_probe(ActivationProbe& p, bool keep_grads);  // times both points again, keeping the faster
  // The planner's probes: one per (recompute policy, head) setting at m0 and m1, timed in rounds when `timed`.
  // Leaves policy_ and head_rows_ at the last setting (the plan sets them).
  std::vector<ActivationProbe> probe_settings(const std::vector<std::pair<std::string, std::string>>& settings, int64_t m0,
                                              int64_t m1, bool keep_grads, bool timed);
  // memory.budget_mib: chooses micro-batch / accumulation, recompute policy, head and (several ranks) ZeRO
  // stage, writes them into config_ (setup, before the buckets exist). The candidates stay for correct_plan().
  void plan_to_budget();
  // plan_to_budget's pieces: the settings it tries; the candidates of one (recompute policy, head) setting whose
  // probe is `pr`, appended to plan_candidates_; the chosen one written into config_.
  struct PlanKnobs;
  PlanKnobs plan_knobs() const;
  void add_plan_candidates(const PlanKnobs& knobs, const std::string& policy, const std::string& head,
                           const ActivationProbe& pr, bool closed, bool sharded, const TargetSpeed* speed);
  void apply_chosen_plan(const PlanCandidate& chosen);
  // After a steady step: when the measured peak is over the budget, the plan is made again once with the
  // activations scaled by the measured error (same ZeRO stage) and applied from the next step.
  void correct_plan(int64_t measured_peak);
  int64_t budget_bytes() const;
  // The plan among `candidates` for `budget`, chosen by rank 0 and applied by every rank (printed by rank 0,
  // after `preface`); ConfigError on every rank when rank 0 finds nothing that fits.
  PlanCandidate agreed_choice(const std::vector<PlanCandidate>& candidates, int64_t budget, const std::string& preface);
  // `optimizer`: the train.optimizer whose state to count; "" = the configured one.
  EstimateInputs estimate_inputs(int world, const std::string& optimizer = "") const;
  void make_estimate();                    // setup(): estimate_ for this run
  // The activations in closed form (core/activation_model.h) where this run's model has a transformer shape and
  // memory.estimate_method allows it (nothing frozen: LoRA and train.freeze are probed); nullopt otherwise.
  bool closed_form_applies() const;
  // Before the model is built: a gpt or llama whose closed-form estimate cannot fit memory.limit_mib (or the free
  // memory of the device), even at the micro-batch train.oom = retry could fall back to, stops here with the terms.
  void check_fits_before_building() const;
  ActivationProbe closed_form_probe(bool keep_grads, int64_t micro_batch) const;  // this run's policy and head
  ActivationProbe closed_form_probe(bool keep_grads, int64_t micro_batch, const RecomputePolicy& policy, int64_t head_rows,
                                    double reduced_bytes_per_element, int64_t accum_steps) const;
  // Before the probe at micro_batch: says what it measures, and stops with an error naming the free memory
  // when the model's published formula puts its activations above it.
  void check_probe_fits(int64_t micro_batch) const;

  Config config_;
  World world_;
  c10::Device device_ = c10::kCPU;
  std::shared_ptr<Model> model_;
  std::shared_ptr<Dataset> data_;
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> master_;  // param_dtype bf16: fp32 copies, same order as params_
  // One process with masters: each bf16 gradient goes into its master's fp32 gradient as autograd completes it
  // (and is freed), so the bf16 gradients of the whole model never coexist with the fp32 ones.
  std::unique_ptr<GradientReadyHooks> master_hooks_;
  bool grads_stay_bf16_ = false;  // this step: masters_step_by_bucket()
  torch::Tensor clip_coef_;       // its clipping coefficient (fp32, on the device); undefined without train.grad_clip
  c10::ScalarType param_dtype_ = torch::kFloat;
  std::shared_ptr<ProcessGroup> group_;  // several ranks (setup step 4), or offload (a group of one, step 8)
  // dist.tensor_parallel > 1 (made before the model): this rank's tensor-parallel group (T consecutive ranks), its
  // data-parallel group (the ranks of its tensor-parallel rank across the groups, DataParallel's), and the model's split.
  std::shared_ptr<ProcessGroup> tp_group_, dp_group_;
  std::shared_ptr<TensorParallel> tp_;
  void setup_tensor_parallel();
  // Why low-bit state (train `t`'s optimizer) cannot keep whole blocks on this split model's slices; "" when it can.
  std::string lowbit_slices_refusal(const TrainOptions& t) const;
  int tp_rank() const { return tp_ ? tp_->rank() : 0; }
  int dp_rank() const { return ParallelDims::of(config_.dist, world_.world_size).dp_rank(world_.rank); }
  // The element count of parameter `name` whole, from this rank's slice's sizes (not split: their product).
  int64_t whole_numel(const std::string& name, c10::IntArrayRef local_sizes) const;
  // Parameter `name` whole from this rank's slice `local` (a collective over the tensor-parallel group; others: local).
  torch::Tensor whole_parameter(const std::string& name, const torch::Tensor& local);
  // Elements [begin, end) of the slice of `name` (sizes `local_sizes`) this rank holds, from the whole tensor. k > 1:
  // a field of k elements per value (low-bit state's codes and absmaxes), whose values [begin / k, end / k) it gives.
  torch::Tensor local_slice(const std::string& name, const torch::Tensor& whole, c10::IntArrayRef local_sizes, int64_t begin,
                            int64_t end, int64_t k = 1) const;
  std::unique_ptr<DataParallel> dp_;     // several ranks, or offload
  std::unique_ptr<BlockHooks> block_hooks_;  // ZeRO stage 3: gathers each block's parameters around it
  TraceBlocks* trace_blocks_ = nullptr;      // log.trace_blocks: block_hooks_ itself, around any gathers
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<CosineSchedule> schedule_;
  Precision precision_ = Precision::kFp32;
  std::unique_ptr<GradScaler> scaler_;
  RecomputePolicy policy_;
  int64_t head_rows_ = -1;  // memory.head: -1 plain, 0 fused (automatic chunks), > 0 rows per chunk
  int64_t head_rows_of(const std::string& head) const;  // memory.head's head_rows_ (split T: automatic rows resolved)
  std::unique_ptr<MemoryTracker> tracker_;
  std::string run_dir_;
  std::string ckpt_dir_;
  std::vector<std::string> param_names_;  // of params_
  // Parameters that do not train (train.freeze, or everything but LoRA's adapters), distinct: no gradient,
  // optimizer state or master; whole on every rank, except under ZeRO-3, which shards them too; saved as frozen/<name>.
  std::vector<torch::Tensor> frozen_;
  std::vector<std::string> frozen_names_;
  int64_t step_ = 0;
  int64_t split_ = 1;
  int64_t nonfinite_run_ = 0;     // consecutive skipped non-finite steps
  int64_t last_saved_step_ = -1;
  bool in_optimizer_ = false;     // between optimizer step's start and end (out-of-memory retries)
  ModelBuffers buffer_backup_;  // the model's buffers at the step's start (out-of-memory retries)
  std::string resumed_from_;
  std::vector<int64_t> units_;        // per params_ entry: its block, or -1 (the root: outside every block, or shared)
  std::vector<int64_t> frozen_units_; // per frozen_ entry, the same
  // Whether DataParallel holds the frozen parameters (ZeRO-3 shards them; other stages leave them whole here).
  // Built from shapes (a family with a table of initial values): setup gives memory and values to what this rank
  // holds, the whole model (fill_whole) or, under ZeRO-3 on several ranks, its parts only (fill_held).
  bool from_shapes_ = false;
  bool fills_shards_ = false;
  std::map<std::string, torch::Tensor> lora_loaded_;  // lora.init_from's adapters (fp32, CPU), which the fill copies
  // lora.quantize_base = nf4: the frozen weights stored in NF4 (models/nf4.h), by name, and a digest of the bf16
  // values each was quantized from (the checkpoint's record of the base it trained on).
  std::map<std::string, Nf4Format> nf4_;
  std::map<std::string, uint64_t> nf4_digests_;
  // The bf16 values an NF4 weight is quantized from (its initial values, whole, on `device`); records their digest.
  torch::Tensor nf4_values(InitialValues& values, const std::string& name, const c10::Device& device);
  std::string nf4_record() const;  // "nf4 block 64 ... <digest>" for the manifest; "" without NF4
  int64_t random_drawn_ = 0;     // random values this rank drew for initial weights
  int64_t setup_host_peak_ = 0;  // counted host bytes, from the Trainer's start to the end of setup
  ParallelDims dims_;  // the run's degrees and ZeRO stage, made once after the plan (setup_plan)
  bool frozen_sharded() const { return dp_ && !dp_->frozen_segments().empty(); }
  MemoryEstimate estimate_;
  std::vector<PlanCandidate> plan_candidates_;  // memory.budget_mib: every setting estimated
  int64_t plan_budget_ = 0;
  std::string plan_timing_ = "probe";  // Plan::timing: probe | model | relative
  std::string plan_speed_source_;       // the time model's speeds (timing = model)
  int plan_lowbit_rank_ = 0;  // the chosen plan's (memory.allow_lowbit_optimizer): corrections keep its state
  bool plan_corrected_ = false;
  ActivationProbe probe_keep_, probe_drop_;
  bool stopped_by_signal_ = false;
  bool defer_reads_ = false;  // train.host_reads resolved: the fused AdamW skips non-finite updates on the device
  bool read_now_ = true;      // this step's flags are read at its end
  bool stop_seen_ = false;    // deferred: a stop request read from the flags of a finished step
  std::unique_ptr<detail::StepFlags> flags_;
};


}  // namespace memtrain
