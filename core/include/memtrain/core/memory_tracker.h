// MemoryTracker: peak memory of every step on every device this rank uses, with the resident
// breakdown (parameters, gradients, optimizer state), the activation peak and the phase of the peak.
//
//   MemoryTracker tracker({.rank = 0, .devices = {torch::kCPU}, .jsonl_path = "runs/x/memory.rank0.jsonl"});
//   tracker.begin_step(step);
//   ... forward ...;  tracker.end_phase(Phase::kForward);
//   ... backward ...; tracker.end_phase(Phase::kBackward);
//   ... optimizer ...; tracker.end_phase(Phase::kOptimizer);
//   tracker.end_step();                      // one JSON line per device
//   std::cout << tracker.summary_table();
//
// CPU numbers come from memtrain's counting allocator (cpu_memory::install()); "reserved" equals
// "allocated" there, as the CPU allocator caches nothing. CUDA numbers come from the caching
// allocator's statistics, whose peaks are reset at each step start. Pinned host memory (the CUDA host
// allocator's, e.g. offloaded checkpoint inputs) is not in the CPU counters: the CPU sample reports it
// as pinned_host_bytes.
#pragma once

#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace memtrain {

enum class Phase { kStart, kForward, kBackward, kOptimizer };
const char* phase_name(Phase p);

// Bytes that live across steps, by owner. All fields in bytes.
struct ResidentBytes {
  int64_t params = 0;
  int64_t grads = 0;
  int64_t optimizer_state = 0;  // moments, momentum, fp32 master weights and their gradients
  int64_t data = 0;             // the dataset held in memory (the text corpus, the images)
};

// Bytes of parameters, their gradients and the optimizer's state tensors that live on `device`.
// Tensors that share a storage (tied embeddings) are counted once.
ResidentBytes resident_bytes(const std::vector<torch::Tensor>& params,
                             const std::vector<torch::Tensor>& optimizer_state, const c10::Device& device);

// Current and peak bytes of one device right now (CPU: counting allocator; CUDA: caching allocator).
struct DeviceCounters {
  int64_t allocated = 0;
  int64_t peak_allocated = 0;
  int64_t reserved = 0;
  int64_t peak_reserved = 0;
};
DeviceCounters read_counters(const c10::Device& device);
void reset_peak(const c10::Device& device);

// Bytes of pinned (page-locked) host memory that the CUDA host allocator holds: offloaded checkpoint
// inputs and other pinned_memory tensors, and the freed blocks it caches for reuse (page-locked all the
// same). The counting CPU allocator never sees this memory, so it is reported on its own. 0 where CUDA
// is not available. (The allocator's "active" statistic is not used: in torch 2.11 a block freed
// without pending stream events is never subtracted from it.)
int64_t pinned_host_bytes();

struct DeviceMemorySample {
  int64_t step = 0;
  int rank = 0;
  std::string device;
  int64_t start_allocated = 0;  // resident when the step began
  int64_t peak_allocated = 0;
  int64_t peak_reserved = 0;
  int64_t end_allocated = 0;
  int64_t activation_peak = 0;  // peak_allocated - start_allocated: what the step itself added
  Phase peak_phase = Phase::kStart;
  ResidentBytes resident;       // at step end
  int64_t pinned_host_bytes = 0;  // CPU sample only: pinned_host_bytes() at step end
  // Gradient bytes held when the optimizer step began (the resident source at the last backward's end):
  // one process the whole gradient; ZeRO-2/3 this rank's reduced part only, which the step then frees.
  int64_t grads_at_optimizer = 0;
  // What the step added by its peak, taken apart (CPU only: the counting allocator numbers allocations and
  // frees, so the blocks alive at the peak are known; CUDA's caching allocator keeps no such history):
  // activation_peak = grads_born + head_saved + gathered + activations.
  struct AtPeak {
    bool known = false;
    int64_t grads = 0;        // every gradient byte alive at the peak (buckets, .grad, reduced parts, masters')
    int64_t grads_born = 0;   // of which allocated in this step
    int64_t head_saved = 0;   // the fused head's input and weight gradients, saved by its forward for backward
    int64_t gathered = 0;     // ZeRO-3: full parameter storage gathered for the units running (and prefetched)
    int64_t activations = 0;  // the rest: saved activations, and the temporaries of the phase of the peak
  } at_peak;
};

struct MemoryTrackerOptions {
  int rank = 0;
  std::vector<c10::Device> devices = {c10::Device(c10::kCPU)};
  std::string jsonl_path = "";  // "" = keep samples in memory only
};

class MemoryTracker {
 public:
  explicit MemoryTracker(MemoryTrackerOptions options);

  // Where the resident breakdown comes from (the trainer's parameters and optimizer).
  void set_resident_source(std::function<ResidentBytes(const c10::Device&)> source);
  // Starts (or restarts) writing one JSON line per step and device to `path`.
  void write_jsonl(const std::string& path, bool append = false);  // append: a resumed run's file

  void begin_step(int64_t step);
  void end_phase(Phase phase);
  // After the last backward of the step, before the update: the gradient bytes resident now (grads_at_optimizer).
  void before_optimizer();
  // Closes the step: one sample per device, appended to the JSONL file and to the summary.
  const std::vector<DeviceMemorySample>& end_step();

  const std::vector<DeviceMemorySample>& last() const { return last_; }

  // A Chrome / Perfetto trace (chrome://tracing, ui.perfetto.dev): each step and each of its phases as a
  // span on this rank's timeline (host time: on CUDA a phase ends when its work is queued, as the step does
  // not synchronise), and each device's running peak at every phase boundary as a counter.
  using Clock = std::chrono::steady_clock;
  void record_trace(bool on) { tracing_ = on; }
  // A span outside the steps (an evaluation, a checkpoint save).
  void trace_span(const std::string& name, Clock::time_point begin, Clock::time_point end);
  // A collective, from its issue to its completion: an async span on the rank's "collectives" track
  // (collectives overlap each other and the phases), with its bytes and step.
  void trace_collective(const std::string& name, int64_t bytes, Clock::time_point issued, Clock::time_point completed);
  // The recorded trace as JSON ({"traceEvents": [...]}), written atomically to `path`.
  void write_trace(const std::string& path) const;

  // One device of one rank over the run, for the end-of-run table. Bytes.
  struct Summary {
    int rank = 0;
    std::string device;
    int64_t steps = 0;
    int64_t max_peak = 0;
    int64_t max_reserved = 0;         // CUDA only (the CPU allocator caches nothing: reserved == allocated)
    int64_t first_activation = 0;     // the first step's activation peak: it also creates the optimizer state
    int64_t steady_activation = 0;    // the largest activation peak of the later steps (the first's if only one)
    Phase max_phase = Phase::kStart;
    ResidentBytes resident;           // at the last step's end
  };
  std::vector<Summary> summaries() const;
  // Like torch.cuda.memory_summary(), per tracked device of this rank: allocated, reserved and (CUDA)
  // active bytes, now and at the highest step peak; the number of allocations; fragmentation = reserved -
  // allocated; CUDA's allocation retries and out-of-memory count. The peaks are the max over the steps'
  // peak_allocated / peak_reserved of the JSONL (the allocator's peaks are reset at each step's start).
  struct AllocatorSummary {
    std::string device;
    int64_t allocated = 0, peak_allocated = 0;
    int64_t reserved = 0, peak_reserved = 0;
    int64_t active = -1, peak_active = -1;  // CUDA only
    int64_t allocations = 0;                // since the process started (CPU: since cpu_memory::install())
    int64_t alloc_retries = -1, ooms = -1;  // CUDA only
  };
  std::vector<AllocatorSummary> allocator_summaries() const;
  static std::string format_allocator_summary(const std::vector<AllocatorSummary>& rows, int rank);
  std::string summary_table() const { return format_summary_table(summaries()); }
  // A table of several ranks' summaries (rank 0 prints every rank's after gathering them).
  static std::string format_summary_table(const std::vector<Summary>& rows);

 private:
  struct PhaseMark {
    Phase phase;
    int64_t peak;
  };
  struct Totals {
    int64_t steps = 0;
    int64_t max_peak = 0;
    int64_t first_activation = 0;
    int64_t steady_activation = 0;
    int64_t max_reserved = 0;
    Phase max_phase = Phase::kStart;
    ResidentBytes resident;
  };

  MemoryTrackerOptions options_;
  std::function<ResidentBytes(const c10::Device&)> resident_source_;
  std::ofstream jsonl_;
  int64_t step_ = 0;
  std::vector<int64_t> start_allocated_;         // per device
  std::vector<int64_t> grads_at_optimizer_;      // per device, this step
  std::vector<std::vector<PhaseMark>> marks_;    // per device, this step
  std::vector<DeviceMemorySample> last_;
  std::map<std::string, Totals> totals_;
  // The trace: spans and counters, in microseconds since the tracker was made.
  struct TraceSpan {
    std::string name;
    int64_t step = 0, micro = -1;  // micro-batch of a forward / backward span
    int64_t begin_us = 0, end_us = 0;
  };
  struct TraceCounter {
    int64_t time_us = 0;
    size_t device = 0;
    int64_t peak = 0;
  };
  struct TraceCollective {
    std::string name;
    int64_t bytes = 0, step = 0;
    int64_t begin_us = 0, end_us = 0;
  };
  std::vector<TraceCollective> collectives_;
  int64_t micros(Clock::time_point t) const;
  bool tracing_ = false;
  Clock::time_point origin_ = Clock::now();
  Clock::time_point step_begin_, phase_begin_;
  int64_t micro_ = 0;
  std::vector<TraceSpan> spans_;
  std::vector<TraceCounter> counters_;
};

std::string format_bytes(int64_t bytes);

}  // namespace memtrain
