// Process-wide CPU memory counters: a counting allocator wrapped around c10's CPU allocator.
// Install it first thing in main(), before any tensor exists (c10::SetCPUAllocator is not thread-safe).
// Tensors created before installation are freed by the old deleter and never counted.
//
//   memtrain::cpu_memory::install();
//   auto before = memtrain::cpu_memory::current();
//   auto t = torch::empty({1024}, torch::kFloat);      // current() == before + 4096
#pragma once

#include <cstdint>

namespace memtrain::cpu_memory {

void install();          // idempotent
bool installed();
int64_t current();       // bytes held by live CPU tensors allocated since install()
int64_t peak();          // highest current() since the last reset_peak()
void reset_peak();       // peak := current
int64_t allocations();   // number of allocations since install()

}  // namespace memtrain::cpu_memory
