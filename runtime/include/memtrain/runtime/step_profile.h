#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace memtrain {

// log.profile_step: one training step recorded by the Kineto profiler that ships in LibTorch (torch.profiler's C++
// side): a Chrome trace of its ATen ops and, on CUDA, its kernels; and a table of where the step's time went.

// One recorded interval: a kernel, copy or set on the device, or an ATen op on a host thread.
struct ProfiledEvent {
  std::string name;
  uint64_t thread = 0;  // the host thread of an op (ops nest within one thread)
  int64_t begin_ns = 0, end_ns = 0;
};

struct ProfileRow {
  std::string name;  // a kernel's or op's name; in StepProfileTable::kinds, the kind
  std::string kind;  // profile_kind(name)
  int64_t calls = 0;
  int64_t self_ns = 0;  // device: the kernels' time; host: the op's time less that of the ops nested in it
};

struct StepProfileTable {
  int64_t step = 0;
  bool device = false;           // rows are CUDA kernels, copies and sets; else host ATen ops by self time
  int64_t wall_ns = 0;           // the step, from its start to its synchronised end
  int64_t busy_ns = 0;           // the rows' sum (device: the GPU's busy time, kernels do not overlap on one stream)
  std::vector<ProfileRow> rows;  // by name, largest first
  std::vector<ProfileRow> kinds; // the rows summed by kind, largest first
  std::string markdown(size_t top = 40) const;
  std::string one_line() const;  // the kinds' shares, for the log
};

// What a kernel or op does, from its name: GEMM, attention, loss (softmax, cross-entropy), normalization, optimizer,
// copy/cast/fill, reduction, elementwise, communication, or other.
std::string profile_kind(const std::string& name);

// Sums the events by name. Device events count whole (kernels do not nest); host events count their self time: their
// span less the spans of the events nested in them on the same thread.
StepProfileTable summarize_profile(const std::vector<ProfiledEvent>& events, bool device, int64_t wall_ns);

// Records from construction to stop(): host ops, and with `cuda` the device's kernels, copies and sets.
class StepProfiler {
 public:
  explicit StepProfiler(bool cuda);
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;
  ~StepProfiler();
  // Stops recording, writes the Chrome trace to trace_path, returns the table of the step (wall_ns long).
  StepProfileTable stop(const std::string& trace_path, int64_t wall_ns);

 private:
  bool cuda_;
  bool running_ = true;
};

}  // namespace memtrain
