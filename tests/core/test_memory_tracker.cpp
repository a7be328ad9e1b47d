#include <gtest/gtest.h>

#include <ATen/core/CachingHostAllocator.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "helpers.h"
#include "memtrain/core/cpu_memory.h"
#include "memtrain/core/memory_tracker.h"
#include "memtrain/runtime/trainer.h"

namespace memtrain {
namespace {

TEST(CpuMemory, CountsExactBytesOfKnownTensors) {
  ASSERT_TRUE(cpu_memory::installed());
  const auto before = cpu_memory::current();
  {
    auto a = torch::empty({1000}, torch::kFloat);  // 4000 bytes
    EXPECT_EQ(cpu_memory::current() - before, 4000);
    auto b = torch::empty({25, 40}, torch::kDouble);  // 8000 bytes
    EXPECT_EQ(cpu_memory::current() - before, 12000);
  }
  EXPECT_EQ(cpu_memory::current(), before);
}

TEST(CpuMemory, PeakSinceReset) {
  const auto before = cpu_memory::current();
  cpu_memory::reset_peak();
  EXPECT_EQ(cpu_memory::peak(), before);
  {
    auto a = torch::empty({1000}, torch::kFloat);   // +4000
    auto b = torch::empty({2000}, torch::kFloat);   // +8000 -> 12000
    a.reset();                                       // -4000 -> 8000
    auto c = torch::empty({500}, torch::kFloat);    // +2000 -> 10000
    EXPECT_EQ(cpu_memory::peak() - before, 12000);
    EXPECT_EQ(cpu_memory::current() - before, 10000);
  }
  EXPECT_EQ(cpu_memory::peak() - before, 12000);
}

TEST(MemoryTracker, StepPeakActivationAndPhase) {
  MemoryTracker tracker({});
  torch::Tensor resident = torch::empty({256}, torch::kFloat);  // 1 KiB held across the step
  tracker.begin_step(0);
  const auto start = cpu_memory::current();
  {
    auto fwd = torch::empty({1 << 18}, torch::kFloat);  // 1 MiB during "forward"
    tracker.end_phase(Phase::kForward);
  }
  {
    auto bwd = torch::empty({3 << 18}, torch::kFloat);  // 3 MiB during "backward"
    tracker.end_phase(Phase::kBackward);
  }
  tracker.end_phase(Phase::kOptimizer);
  const auto& s = tracker.end_step();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].device, "cpu");
  EXPECT_EQ(s[0].start_allocated, start);
  EXPECT_EQ(s[0].activation_peak, 3 << 20);
  EXPECT_EQ(s[0].peak_allocated, start + (3 << 20));
  EXPECT_EQ(s[0].peak_phase, Phase::kBackward);
  EXPECT_EQ(s[0].end_allocated, start);
}

TEST(MemoryTracker, ForwardPeakIsAttributedToForward) {
  MemoryTracker tracker({});
  tracker.begin_step(0);
  {
    auto big = torch::empty({1 << 20}, torch::kFloat);
    tracker.end_phase(Phase::kForward);
  }
  auto small = torch::empty({1 << 10}, torch::kFloat);
  tracker.end_phase(Phase::kBackward);
  EXPECT_EQ(tracker.end_step()[0].peak_phase, Phase::kForward);
}

TEST(MemoryTracker, ResidentBreakdownIsArithmetic) {
  // After one AdamW step: parameters P bytes, gradients P bytes, state exp_avg + exp_avg_sq = 2P.
  auto c = test::tiny_gpt_config();
  Trainer trainer(c);
  trainer.step();
  const auto& s = trainer.tracker().last();
  ASSERT_EQ(s.size(), 1u);
  const int64_t p_bytes = trainer.model().num_parameters() * 4;  // fp32, tied embedding once
  // The GPT's formula: V C + T C + L (12 C^2 + 13 C) + 2 C with V = 256, T = 32, C = 32, L = 2.
  const int64_t V = 256, T = 32, C = 32, L = 2;
  EXPECT_EQ(trainer.model().num_parameters(), V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C);
  EXPECT_EQ(s[0].resident.params, p_bytes);
  EXPECT_EQ(s[0].resident.grads, p_bytes);
  EXPECT_EQ(s[0].resident.optimizer_state, 2 * p_bytes);
}

TEST(MemoryTracker, WritesOneJsonLinePerStep) {
  test::TempDir dir;
  auto c = test::tiny_gpt_config();
  Trainer trainer(c);
  trainer.tracker().write_jsonl(dir.path("memory.rank0.jsonl"));
  trainer.step();
  trainer.step();
  std::ifstream in(dir.path("memory.rank0.jsonl"));
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["step"].get<int>(), n + 1);  // steps are numbered from 1, as in metrics.jsonl
    EXPECT_EQ(j["device"], "cpu");
    EXPECT_GT(j["peak_allocated"].get<int64_t>(), j["start_allocated"].get<int64_t>());
    EXPECT_EQ(j["activation_peak"].get<int64_t>(),
              j["peak_allocated"].get<int64_t>() - j["start_allocated"].get<int64_t>());
    for (const char* k : {"peak_reserved", "params", "grads", "optimizer_state", "data", "peak_phase", "rank"})
      EXPECT_TRUE(j.contains(k)) << k;
    ++n;
  }
  EXPECT_EQ(n, 2);
  EXPECT_NE(trainer.tracker().summary_table().find("cpu"), std::string::npos);
}

TEST(MemoryTracker, PinnedHostBytesAreTheirOwnField) {
  // Pinned host memory (offloaded checkpoint inputs) comes from the CUDA host allocator, which the
  // counting CPU allocator never sees: the CPU sample reports it in its own field, 0 without CUDA.
  test::TempDir dir;
  MemoryTracker tracker({.rank = 0, .devices = {c10::kCPU}, .jsonl_path = dir.path("m.jsonl")});
  tracker.begin_step(0);
  const auto& s = tracker.end_step();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].pinned_host_bytes, pinned_host_bytes());
  if (!torch::cuda::is_available()) {
    EXPECT_EQ(s[0].pinned_host_bytes, 0);
  }
  std::ifstream in(dir.path("m.jsonl"));
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  auto j = nlohmann::json::parse(line);
  ASSERT_TRUE(j.contains("pinned_host_bytes")) << line;
  EXPECT_EQ(j["pinned_host_bytes"].get<int64_t>(), s[0].pinned_host_bytes);
}

TEST(MemoryTracker, CudaPinnedHostBytesSkipWithoutGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto* host = at::getHostAllocator(c10::kCUDA);
  host->empty_cache();  // no cached blocks: what is held is what live tensors use
  const auto before = pinned_host_bytes();
  const auto cpu_before = cpu_memory::current();
  {
    auto t = torch::empty({1 << 18}, torch::TensorOptions().pinned_memory(true));  // 1 MiB pinned
    EXPECT_EQ(pinned_host_bytes() - before, 1 << 20);
    EXPECT_EQ(cpu_memory::current(), cpu_before);
  }
  EXPECT_EQ(pinned_host_bytes() - before, 1 << 20);  // freed, but cached: still page-locked
  host->empty_cache();
  EXPECT_EQ(pinned_host_bytes(), before);
}

TEST(MemoryTracker, CudaStatsSkipWithoutGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const c10::Device dev(c10::kCUDA, 0);
  MemoryTracker tracker({.rank = 0, .devices = {dev}});
  tracker.begin_step(0);
  const auto start = read_counters(dev).allocated;
  {
    auto t = torch::empty({1 << 20}, torch::TensorOptions().device(dev));  // 4 MiB
    tracker.end_phase(Phase::kForward);
  }
  const auto& s = tracker.end_step();
  EXPECT_EQ(s[0].start_allocated, start);
  EXPECT_EQ(s[0].activation_peak, 4 << 20);
  EXPECT_GE(s[0].peak_reserved, s[0].peak_allocated);
}

}  // namespace
}  // namespace memtrain
