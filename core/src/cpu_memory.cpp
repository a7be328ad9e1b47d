#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <string>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "memtrain/core/cpu_memory.h"

namespace memtrain::cpu_memory {
namespace {

// Sizes live in a side table, so every block is exactly the size c10's own allocator would request:
// an earlier version kept the size in a 64-byte header in front of each block, and the shifted sizes
// made glibc trim and re-fault its heap every step (15-25% of a CPU step, measured with perf).
// Everything below is guarded by g_mutex; current() and peak() are also atomics, read without it.
std::mutex g_mutex;
struct Block {
  size_t bytes = 0;
  int64_t born = 0;    // the event number of its allocation
  int marked = -1;     // a Kind, or -1
};
std::unordered_map<void*, Block>& blocks() {
  static auto* table = new std::unordered_map<void*, Block>();  // never destroyed: frees can come late
  return *table;
}
// Marked blocks freed since the last reset_peak(): they may have been alive at the peak.
struct Freed {
  Block block;
  int64_t died = 0;
};
std::vector<Freed>& freed_marked() {
  static auto* list = new std::vector<Freed>();
  return *list;
}
int64_t g_event = 0;       // allocations and frees, numbered
int64_t g_peak_event = 0;  // the event at which the peak was reached (or the last reset)
int64_t g_reset_event = 0;

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_allocations{0};
std::atomic<bool> g_installed{false};
std::atomic<int64_t> g_limit{0};  // 0: none

void count_free(void* data) {
  if (data == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = blocks().find(data);
    if (it != blocks().end()) {
      ++g_event;
      // Born after the peak: it can be alive at no peak to come (they come after this free).
      if (it->second.marked >= 0 && it->second.born <= g_peak_event) freed_marked().push_back({it->second, g_event});
      g_current.fetch_sub(static_cast<int64_t>(it->second.bytes), std::memory_order_relaxed);
      blocks().erase(it);
    }
  }
  c10::free_cpu(data);
}

class CountingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return {nullptr, nullptr, &count_free, c10::Device(c10::kCPU)};
    const auto limit = g_limit.load(std::memory_order_relaxed);
    const auto in_use = g_current.load(std::memory_order_relaxed);
    // The same exception type as the CUDA caching allocator's, so one handler serves both devices.
    TORCH_CHECK_WITH(OutOfMemoryError, limit == 0 || in_use + static_cast<int64_t>(nbytes) <= limit,
                     "CPU out of memory: tried to allocate ", nbytes, " bytes with ", in_use,
                     " in use; the limit (memory.limit_mib) is ", limit, " bytes");
    void* data = c10::alloc_cpu(nbytes);
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      blocks()[data] = {nbytes, ++g_event, -1};
      const auto now = g_current.fetch_add(static_cast<int64_t>(nbytes), std::memory_order_relaxed) +
                       static_cast<int64_t>(nbytes);
      if (now > g_peak.load(std::memory_order_relaxed)) {
        g_peak.store(now, std::memory_order_relaxed);
        g_peak_event = g_event;
        freed_marked().clear();  // all died before this new peak
      }
    }
    g_allocations.fetch_add(1, std::memory_order_relaxed);
    // data == context: required by raw_allocate() and copy-on-write's is_simple_data_ptr().
    return {data, data, &count_free, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &count_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingCpuAllocator g_allocator;  // static lifetime: DataPtrs point at its deleter until exit

}  // namespace

void install() {
  if (g_installed.exchange(true)) return;
  // Priority above the default (0) so that no later default registration replaces it.
  c10::SetCPUAllocator(&g_allocator, /*priority=*/10);
}
void keep_freed_memory() {
  mallopt(M_MMAP_MAX, 0);                    // large blocks from the heap, reusable after free
  mallopt(M_TRIM_THRESHOLD, 1 << 30);        // keep up to 1 GiB of free heap top instead of trimming
}

bool return_freed_memory() { return malloc_trim(0) != 0; }

namespace {
int64_t status_kib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(in, line))
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(key.size())) * 1024;  // "VmHWM:   123456 kB"
  return 0;
}
}  // namespace

int64_t resident_bytes() { return status_kib("VmRSS"); }
// The kernel updates VmHWM lazily (per-thread RSS counters are folded in batches): it can read below VmRSS.
int64_t resident_high_water() { return std::max(status_kib("VmHWM"), status_kib("VmRSS")); }

bool installed() { return g_installed.load(); }
int64_t current() { return g_current.load(std::memory_order_relaxed); }
int64_t peak() { return g_peak.load(std::memory_order_relaxed); }
void reset_peak() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_peak.store(g_current.load(std::memory_order_relaxed), std::memory_order_relaxed);
  g_peak_event = g_reset_event = g_event;
  freed_marked().clear();  // freed before the new window: never alive at its peak
}

void mark(const void* block, Kind kind) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = blocks().find(const_cast<void*>(block));
  if (it != blocks().end()) it->second.marked = static_cast<int>(kind);
}

std::array<KindBytes, kKinds> bytes_at_peak() {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::array<KindBytes, kKinds> out;
  auto add = [&](const Block& b) {
    if (b.marked < 0 || b.marked >= kKinds || b.born > g_peak_event) return;
    auto& o = out[static_cast<size_t>(b.marked)];
    o.total += static_cast<int64_t>(b.bytes);
    if (b.born > g_reset_event) o.born += static_cast<int64_t>(b.bytes);
  };
  for (const auto& [ptr, b] : blocks()) add(b);  // alive now, so alive at the peak if born by then
  for (const auto& f : freed_marked())
    if (f.died > g_peak_event) add(f.block);
  return out;
}
void set_limit(int64_t bytes) { g_limit.store(bytes < 0 ? 0 : bytes, std::memory_order_relaxed); }
int64_t limit() { return g_limit.load(std::memory_order_relaxed); }
int64_t allocations() { return g_allocations.load(std::memory_order_relaxed); }

}  // namespace memtrain::cpu_memory
