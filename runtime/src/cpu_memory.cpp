#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>

#include "memtrain/memory.h"

namespace memtrain::cpu_memory {
namespace {

// Each block carries its size in a 64-byte header in front of the data, so the deleter needs no
// side table and stays lock-free; 64 keeps c10's 64-byte alignment of the data pointer.
constexpr size_t kHeader = 64;

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_allocations{0};
std::atomic<bool> g_installed{false};

void count_free(void* data) {
  if (data == nullptr) return;
  auto* base = static_cast<char*>(data) - kHeader;
  g_current.fetch_sub(static_cast<int64_t>(*reinterpret_cast<size_t*>(base)), std::memory_order_relaxed);
  c10::free_cpu(base);
}

class CountingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return {nullptr, nullptr, &count_free, c10::Device(c10::kCPU)};
    auto* base = static_cast<char*>(c10::alloc_cpu(nbytes + kHeader));
    *reinterpret_cast<size_t*>(base) = nbytes;
    auto now = g_current.fetch_add(static_cast<int64_t>(nbytes), std::memory_order_relaxed) +
               static_cast<int64_t>(nbytes);
    auto seen = g_peak.load(std::memory_order_relaxed);
    while (now > seen && !g_peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
    g_allocations.fetch_add(1, std::memory_order_relaxed);
    void* data = base + kHeader;
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
bool installed() { return g_installed.load(); }
int64_t current() { return g_current.load(std::memory_order_relaxed); }
int64_t peak() { return g_peak.load(std::memory_order_relaxed); }
void reset_peak() { g_peak.store(g_current.load(std::memory_order_relaxed), std::memory_order_relaxed); }
int64_t allocations() { return g_allocations.load(std::memory_order_relaxed); }

}  // namespace memtrain::cpu_memory
