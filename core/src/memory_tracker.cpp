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
  for (size_t i = 0; i < options_.devices.size(); ++i) {
    reset_peak(options_.devices[i]);
    start_allocated_[i] = read_counters(options_.devices[i]).allocated;
    marks_[i].clear();
  }
}

void MemoryTracker::end_phase(Phase phase) {
  // The peak so far, at each phase boundary: the first boundary at which it reaches the step's final
  // peak names the phase in which the peak happened. Costs one counter read, no allocation hook.
  for (size_t i = 0; i < options_.devices.size(); ++i)
    marks_[i].push_back({phase, read_counters(options_.devices[i]).peak_allocated});
}

const std::vector<DeviceMemorySample>& MemoryTracker::end_step() {
  last_.clear();
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
    if (device.is_cpu()) s.pinned_host_bytes = pinned_host_bytes();
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
      if (device.is_cpu()) j["pinned_host_bytes"] = s.pinned_host_bytes;
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
