// Process-wide CPU memory counters: a counting allocator wrapped around c10's CPU allocator.
// Install it first thing in main(), before any tensor exists (c10::SetCPUAllocator is not thread-safe).
// Tensors created before installation are freed by the old deleter and never counted.
//
//   memtrain::cpu_memory::install();
//   auto before = memtrain::cpu_memory::current();
//   auto t = torch::empty({1024}, torch::kFloat);      // current() == before + 4096
#pragma once

#include <array>
#include <cstdint>

namespace memtrain::cpu_memory {

void install();          // idempotent
bool installed();
int64_t current();       // bytes held by live CPU tensors allocated since install()
int64_t peak();          // highest current() since the last reset_peak()
void reset_peak();       // peak := current
int64_t allocations();   // number of allocations since install()
// An allocation that would take current() above `bytes` throws c10::OutOfMemoryError, as a full GPU
// does: what makes out-of-memory handling testable on a CPU. 0 = no limit (the default).
void set_limit(int64_t bytes);
int64_t limit();

// What the peak was made of. An owner marks live blocks of its kind (gradient buckets, a parameter's
// .grad, the fused head's saved gradient); every allocation and free is numbered, and the peak keeps the
// number at which it was reached, so bytes_at_peak() is exact: the marked blocks allocated at or
// before the peak and freed after it. A block can be marked any time while it lives (after the backward
// that made it, say). `born` counts those allocated since the last reset_peak() (the step's own).
enum class Kind { kGradient, kHeadSaved, kGathered };  // kGathered: ZeRO-3's full parameters while gathered
inline constexpr int kKinds = 3;
void mark(const void* block, Kind kind);  // `block`: the storage's base pointer; unknown pointers are ignored
struct KindBytes {
  int64_t total = 0;
  int64_t born = 0;
};
std::array<KindBytes, kKinds> bytes_at_peak();  // every kind in one pass over the blocks, indexed by Kind

// Makes glibc keep freed heap memory for reuse instead of returning it to the kernel (no trimming,
// no mmap for large blocks). A training step frees and re-allocates the same activation sizes every
// step; by default glibc gives large blocks back and the next step page-faults them in again, which
// costs 10-20% of a CPU step here (perf: page faults and brk in the kernel). Process-wide and not
// undoable: the memtrain binary calls it; an embedding application decides for itself.
void keep_freed_memory();
// Gives the heap's free memory back to the kernel once (glibc's malloc_trim): after a setup whose transient copies
// keep_freed_memory would otherwise hold resident for the whole run. Returns whether any was given back.
bool return_freed_memory();
// The process's resident set now and its high-water mark (VmRSS, VmHWM from /proc/self/status), bytes; 0 where
// the system has no such file.
int64_t resident_bytes();
int64_t resident_high_water();

}  // namespace memtrain::cpu_memory
