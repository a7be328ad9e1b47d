#include "memtrain/core/memory_tracker.h"

#include <ATen/Context.h>
#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <iomanip>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "memtrain/core/error.h"
#include "memtrain/core/cpu_memory.h"
#include "memtrain/core/files.h"

namespace memtrain {

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::kStart: return "start";
    case Phase::kForward: return "forward";
    case Phase::kBackward: return "backward";
    case Phase::kOptimizer: return "optimizer";
  }
  return "?";
}

namespace {
// The CUDA caching allocator exists only once CUDA is initialised; asking it for statistics before
// that fails with "Invalid device argument".
c10::DeviceAllocator* cuda_allocator() {
  at::globalContext().lazyInitDevice(c10::kCUDA);
  return c10::getDeviceAllocator(c10::kCUDA);
}

int64_t add_unique(std::set<const void*>& seen, const torch::Tensor& t, const c10::Device& device) {
  if (!t.defined() || t.device() != device || !t.has_storage()) return 0;
  const void* key = t.storage().unsafeGetStorageImpl();
  if (!seen.insert(key).second) return 0;
  return static_cast<int64_t>(t.storage().nbytes());
}
}  // namespace

ResidentBytes resident_bytes(const std::vector<torch::Tensor>& params,
                             const std::vector<torch::Tensor>& optimizer_state, const c10::Device& device) {
  ResidentBytes r;
  std::set<const void*> seen;
  for (const auto& p : params) r.params += add_unique(seen, p, device);
  for (const auto& p : params) r.grads += add_unique(seen, p.grad(), device);
  for (const auto& t : optimizer_state) r.optimizer_state += add_unique(seen, t, device);
  return r;
}

DeviceCounters read_counters(const c10::Device& device) {
  DeviceCounters c;
  if (device.is_cpu()) {
    c.allocated = c.reserved = cpu_memory::current();
    c.peak_allocated = c.peak_reserved = cpu_memory::peak();
    return c;
  }
  MEMTRAIN_CHECK(device.is_cuda(), Error, "[memory] unsupported device ", device.str());
  auto stats = cuda_allocator()->getDeviceStats(device.index());
  constexpr size_t kAll = 0;  // StatType::AGGREGATE; its namespace moved between versions
  c.allocated = stats.allocated_bytes[kAll].current;
  c.peak_allocated = stats.allocated_bytes[kAll].peak;
  c.reserved = stats.reserved_bytes[kAll].current;
  c.peak_reserved = stats.reserved_bytes[kAll].peak;
  return c;
}

int64_t pinned_host_bytes() {
  // The CUDA host allocator is registered by libtorch_cuda whether or not a GPU is present; without
  // one nothing can have been pinned, and asking is skipped.
  if (!at::hasCUDA()) return 0;
  return at::getHostAllocator(c10::kCUDA)->get_stats().allocated_bytes.current;
}

void reset_peak(const c10::Device& device) {
  if (device.is_cpu()) {
    cpu_memory::reset_peak();
  } else {
    cuda_allocator()->resetPeakStats(device.index());
  }
}

MemoryTracker::MemoryTracker(MemoryTrackerOptions options) : options_(std::move(options)) {
  for (const auto& d : options_.devices) {
    MEMTRAIN_CHECK(!d.is_cpu() || cpu_memory::installed(), Error,
                   "[memory] CPU tracking needs memtrain::cpu_memory::install() at the start of main()");
  }
  if (!options_.jsonl_path.empty()) write_jsonl(options_.jsonl_path);
  start_allocated_.resize(options_.devices.size());
  grads_at_optimizer_.resize(options_.devices.size());
  marks_.resize(options_.devices.size());
}

void MemoryTracker::write_jsonl(const std::string& path, bool append) {
  if (jsonl_.is_open()) jsonl_.close();
  jsonl_.open(path, std::ios::out | (append ? std::ios::app : std::ios::trunc));
  MEMTRAIN_CHECK(jsonl_.good(), Error, "[memory] cannot write ", path);
  options_.jsonl_path = path;
}

void MemoryTracker::set_resident_source(std::function<ResidentBytes(const c10::Device&)> source) {
  resident_source_ = std::move(source);
}

void MemoryTracker::begin_step(int64_t step) {
  step_ = step;
  step_begin_ = phase_begin_ = Clock::now();
  micro_ = 0;
  for (size_t i = 0; i < options_.devices.size(); ++i) {
    reset_peak(options_.devices[i]);
    start_allocated_[i] = read_counters(options_.devices[i]).allocated;
    marks_[i].clear();
    grads_at_optimizer_[i] = 0;
  }
}

void MemoryTracker::before_optimizer() {
  if (!resident_source_) return;
  for (size_t i = 0; i < options_.devices.size(); ++i)
    grads_at_optimizer_[i] = resident_source_(options_.devices[i]).grads;
}

void MemoryTracker::end_phase(Phase phase) {
  // The peak so far, at each phase boundary: the first boundary at which it reaches the step's final
  // peak names the phase in which the peak happened. Costs one counter read, no allocation hook.
  for (size_t i = 0; i < options_.devices.size(); ++i) {
    marks_[i].push_back({phase, read_counters(options_.devices[i]).peak_allocated});
  }
  if (!tracing_) return;
  const auto now = Clock::now();
  const bool per_micro = phase == Phase::kForward || phase == Phase::kBackward;
  spans_.push_back({phase_name(phase), step_, per_micro ? micro_ : -1, micros(phase_begin_), micros(now)});
  if (phase == Phase::kBackward) ++micro_;
  for (size_t i = 0; i < options_.devices.size(); ++i) counters_.push_back({micros(now), i, marks_[i].back().peak});
  phase_begin_ = now;
}

int64_t MemoryTracker::micros(Clock::time_point t) const {
  return std::chrono::duration_cast<std::chrono::microseconds>(t - origin_).count();
}

void MemoryTracker::trace_span(const std::string& name, Clock::time_point begin, Clock::time_point end) {
  if (tracing_) spans_.push_back({name, step_, -1, micros(begin), micros(end)});
}

void MemoryTracker::trace_collective(const std::string& name, int64_t bytes, Clock::time_point issued,
                                     Clock::time_point completed) {
  if (tracing_) collectives_.push_back({name, bytes, step_, micros(issued), micros(completed)});
}

void MemoryTracker::write_trace(const std::string& path) const {
  auto events = nlohmann::json::array();
  const int pid = options_.rank;
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"args", {{"name", "rank " + std::to_string(pid)}}}});
  for (const auto& s : spans_) {
    nlohmann::json args = {{"step", s.step}};
    if (s.micro >= 0) args["micro_batch"] = s.micro;
    // Steps on one row, their phases on the next: Perfetto nests spans of one thread by time.
    const bool step_span = s.name.rfind("step ", 0) == 0;
    events.push_back({{"name", s.name}, {"cat", step_span ? "step" : "phase"}, {"ph", "X"}, {"ts", s.begin_us},
                      {"dur", std::max<int64_t>(0, s.end_us - s.begin_us)}, {"pid", pid}, {"tid", 0}, {"args", args}});
  }
  for (size_t k = 0; k < collectives_.size(); ++k) {
    // Nestable async events ("b"/"e" with an id): Perfetto draws overlapping collectives on tracks of their own.
    const auto& c = collectives_[k];
    const nlohmann::json args = {{"step", c.step}, {"bytes", c.bytes}};
    events.push_back({{"name", c.name}, {"cat", "collective"}, {"ph", "b"}, {"id", k}, {"ts", c.begin_us}, {"pid", pid},
                      {"tid", 0}, {"args", args}});
    events.push_back({{"name", c.name}, {"cat", "collective"}, {"ph", "e"}, {"id", k},
                      {"ts", std::max(c.begin_us, c.end_us)}, {"pid", pid}, {"tid", 0}});
  }
  for (const auto& c : counters_)
    events.push_back({{"name", "peak " + options_.devices[c.device].str()}, {"ph", "C"}, {"ts", c.time_us}, {"pid", pid},
                      {"args", {{"MiB", static_cast<double>(c.peak) / (1024.0 * 1024.0)}}}});
  write_file_atomically(path, nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() + "\n");
}

const std::vector<DeviceMemorySample>& MemoryTracker::end_step() {
  last_.clear();
  if (tracing_) spans_.push_back({"step " + std::to_string(step_), step_, -1, micros(step_begin_), micros(Clock::now())});
  for (size_t i = 0; i < options_.devices.size(); ++i) {
    const auto& device = options_.devices[i];
    auto c = read_counters(device);
    DeviceMemorySample s;
    s.step = step_;
    s.rank = options_.rank;
    s.device = device.str();
    s.start_allocated = start_allocated_[i];
    s.peak_allocated = c.peak_allocated;
    s.peak_reserved = c.peak_reserved;
    s.end_allocated = c.allocated;
    s.activation_peak = c.peak_allocated - start_allocated_[i];
    for (const auto& m : marks_[i]) {
      if (m.peak >= c.peak_allocated) {
        s.peak_phase = m.phase;
        break;
      }
    }
    if (resident_source_) s.resident = resident_source_(device);
    s.grads_at_optimizer = grads_at_optimizer_[i];
    if (device.is_cpu()) {
      s.pinned_host_bytes = pinned_host_bytes();
      const auto kinds = cpu_memory::bytes_at_peak();
      const auto& grads = kinds[static_cast<size_t>(cpu_memory::Kind::kGradient)];
      const auto& head = kinds[static_cast<size_t>(cpu_memory::Kind::kHeadSaved)];
      const auto& gathered = kinds[static_cast<size_t>(cpu_memory::Kind::kGathered)];
      s.at_peak = {.known = true, .grads = grads.total, .grads_born = grads.born, .head_saved = head.born,
                   .gathered = gathered.born,
                   .activations = s.activation_peak - grads.born - head.born - gathered.born};
    }
    last_.push_back(s);

    auto& t = totals_[s.device];
    t.steps++;
    if (s.peak_allocated >= t.max_peak) t.max_peak = s.peak_allocated, t.max_phase = s.peak_phase;
    // The first step also allocates the optimizer state (and the gradient buffers): kept apart, so the
    // activation figure is the steady one.
    if (t.steps == 1) t.first_activation = s.activation_peak;
    else t.steady_activation = std::max(t.steady_activation, s.activation_peak);
    t.max_reserved = std::max(t.max_reserved, s.peak_reserved);
    t.resident = s.resident;

    if (jsonl_.is_open()) {
      nlohmann::json j = {{"step", s.step},
                          {"rank", s.rank},
                          {"device", s.device},
                          {"start_allocated", s.start_allocated},
                          {"peak_allocated", s.peak_allocated},
                          {"peak_reserved", s.peak_reserved},
                          {"end_allocated", s.end_allocated},
                          {"activation_peak", s.activation_peak},
                          {"peak_phase", phase_name(s.peak_phase)},
                          {"params", s.resident.params},
                          {"grads", s.resident.grads},
                          {"optimizer_state", s.resident.optimizer_state},
                          {"data", s.resident.data}};
      j["grads_at_optimizer"] = s.grads_at_optimizer;
      if (device.is_cpu()) j["pinned_host_bytes"] = s.pinned_host_bytes;
      if (s.at_peak.known)
        j["at_peak"] = {{"gradients", s.at_peak.grads}, {"gradients_born", s.at_peak.grads_born},
                        {"head_saved", s.at_peak.head_saved}, {"gathered", s.at_peak.gathered},
                        {"activations", s.at_peak.activations}};
      jsonl_ << j.dump() << '\n';
    }
  }
  if (jsonl_.is_open()) jsonl_.flush();
  return last_;
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (std::abs(v) >= 1024 && u < 4) v /= 1024, ++u;
  std::ostringstream os;
  os << std::fixed << std::setprecision(u == 0 ? 0 : 1) << v << " " << units[u];
  return os.str();
}

std::vector<MemoryTracker::Summary> MemoryTracker::summaries() const {
  std::vector<Summary> out;
  for (const auto& [device, t] : totals_) {
    Summary r;
    r.rank = options_.rank;
    r.device = device;
    r.steps = t.steps;
    r.max_peak = t.max_peak;
    r.max_reserved = t.max_reserved;
    r.first_activation = t.first_activation;
    r.steady_activation = t.steps > 1 ? t.steady_activation : t.first_activation;
    r.max_phase = t.max_phase;
    r.resident = t.resident;
    out.push_back(r);
  }
  return out;
}

std::vector<MemoryTracker::AllocatorSummary> MemoryTracker::allocator_summaries() const {
  std::vector<AllocatorSummary> out;
  for (const auto& device : options_.devices) {
    AllocatorSummary a;
    a.device = device.str();
    const auto c = read_counters(device);
    a.allocated = c.allocated, a.reserved = c.reserved;
    auto t = totals_.find(a.device);
    a.peak_allocated = t == totals_.end() ? c.peak_allocated : t->second.max_peak;
    a.peak_reserved = t == totals_.end() ? c.peak_reserved : std::max(t->second.max_reserved, t->second.max_peak);
    if (device.is_cpu()) {
      a.allocations = cpu_memory::allocations();
      a.peak_reserved = a.peak_allocated;  // the counting allocator caches nothing
    } else {
      auto stats = cuda_allocator()->getDeviceStats(device.index());
      constexpr size_t kAll = 0;
      a.active = stats.active_bytes[kAll].current, a.peak_active = stats.active_bytes[kAll].peak;
      a.allocations = stats.allocation[kAll].allocated;
      a.alloc_retries = stats.num_alloc_retries, a.ooms = stats.num_ooms;
      if (t != totals_.end()) a.peak_reserved = t->second.max_reserved;
    }
    out.push_back(a);
  }
  return out;
}

std::string MemoryTracker::format_allocator_summary(const std::vector<AllocatorSummary>& rows, int rank) {
  std::ostringstream os;
  for (const auto& a : rows) {
    os << "memory summary, rank " << rank << ", " << a.device << " (like torch.cuda.memory_summary; peak: highest step)\n";
    os << "  " << std::left << std::setw(26) << "metric" << std::right << std::setw(12) << "current" << std::setw(12)
       << "peak" << "\n";
    auto row = [&](const char* name, int64_t now, int64_t peak) {
      os << "  " << std::left << std::setw(26) << name << std::right << std::setw(12) << format_bytes(now) << std::setw(12)
         << format_bytes(peak) << "\n";
    };
    row("allocated", a.allocated, a.peak_allocated);
    row(a.active >= 0 ? "reserved" : "reserved (= allocated)", a.reserved, a.peak_reserved);
    if (a.active >= 0) row("active", a.active, a.peak_active);
    row("fragmentation (res - alloc)", a.reserved - a.allocated, a.peak_reserved - a.peak_allocated);
    os << "  " << std::left << std::setw(26) << "allocations" << std::right << std::setw(12) << a.allocations << "\n";
    if (a.ooms >= 0)
      os << "  " << std::left << std::setw(26) << "alloc retries / OOMs" << std::right << std::setw(12)
         << (std::to_string(a.alloc_retries) + " / " + std::to_string(a.ooms)) << "\n";
  }
  return os.str();
}

std::string MemoryTracker::format_summary_table(const std::vector<Summary>& rows) {
  std::ostringstream os;
  os << "memory per step (max over steps; activations: steady, after the first step)\n";
  os << std::left << std::setw(6) << "rank" << std::setw(9) << "device" << std::right << std::setw(11) << "peak"
     << std::setw(11) << "reserved" << std::setw(12) << "activations" << std::setw(11) << "1st step" << std::setw(11)
     << "params" << std::setw(11) << "grads" << std::setw(11) << "optim" << std::setw(11) << "data"
     << "  peak phase\n";
  bool cpu = false;
  for (const auto& r : rows) {
    const bool is_cpu = r.device == "cpu";
    cpu = cpu || is_cpu;
    os << std::left << std::setw(6) << r.rank << std::setw(9) << r.device << std::right << std::setw(11)
       << format_bytes(r.max_peak) << std::setw(11) << (is_cpu ? std::string("-") : format_bytes(r.max_reserved))
       << std::setw(12) << format_bytes(r.steady_activation) << std::setw(11) << format_bytes(r.first_activation)
       << std::setw(11) << format_bytes(r.resident.params) << std::setw(11) << format_bytes(r.resident.grads)
       << std::setw(11) << format_bytes(r.resident.optimizer_state) << std::setw(11) << format_bytes(r.resident.data)
       << "  " << phase_name(r.max_phase) << "\n";
  }
  if (cpu) os << "(cpu: reserved is not shown; the CPU allocator caches nothing, so it equals the peak)\n";
  return os.str();
}

}  // namespace memtrain
