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

TEST(CpuMemory, ThePeakKnowsWhichMarkedBlocksWereAliveAtIt) {
  cpu_memory::reset_peak();
  auto before_window = torch::empty({100}, torch::kFloat);  // 400 bytes, marked, resident: total, not born
  cpu_memory::mark(before_window.storage().data(), cpu_memory::Kind::kGradient);
  cpu_memory::reset_peak();
  auto gone = torch::empty({1000}, torch::kFloat);  // 4000, marked, freed before the peak: not counted
  cpu_memory::mark(gone.storage().data(), cpu_memory::Kind::kGradient);
  gone.reset();
  auto a = torch::empty({1 << 18}, torch::kFloat);  // 1 MiB, marked: alive at the peak
  auto b = torch::empty({1 << 19}, torch::kFloat);  // 2 MiB, not marked
  auto c = torch::empty({1 << 16}, torch::kFloat);  // 256 KiB, marked after the fact, freed after the peak
  auto h = torch::empty({1 << 10}, torch::kFloat);  // 4 KiB, another kind
  b.reset();                                         // the peak was just before this
  auto late = torch::empty({1 << 17}, torch::kFloat);  // 512 KiB, born after the peak: not counted
  cpu_memory::mark(a.storage().data(), cpu_memory::Kind::kGradient);
  cpu_memory::mark(c.storage().data(), cpu_memory::Kind::kGradient);
  cpu_memory::mark(late.storage().data(), cpu_memory::Kind::kGradient);
  cpu_memory::mark(h.storage().data(), cpu_memory::Kind::kHeadSaved);
  c.reset();
  const auto kinds = cpu_memory::bytes_at_peak();
  const auto& g = kinds[static_cast<size_t>(cpu_memory::Kind::kGradient)];
  EXPECT_EQ(g.total, 400 + (1 << 20) + (1 << 18));
  EXPECT_EQ(g.born, (1 << 20) + (1 << 18));
  EXPECT_EQ(kinds[static_cast<size_t>(cpu_memory::Kind::kHeadSaved)].total, 4096);
  int x = 0;
  cpu_memory::mark(&x, cpu_memory::Kind::kGradient);  // not a tensor block: ignored
}

// One process: the peak of a GPT step taken apart. With the fused head, its saved input and weight
// gradients are alive from its forward to its backward; with a 4096-token vocabulary they are big enough
// that the step peaks while they live (at the head): exactly (tokens x C + V x C) fp32 bytes. Without
// the fused head, none; and the gradients born by the peak are the parameters' at most.
TEST(MemoryTracker, AGptPeakIsTakenApartIntoGradientsTheFusedHeadAndActivations) {
  for (const char* head : {"fused:32", "plain"}) {
    SCOPED_TRACE(head);
    auto c = test::tiny_gpt_config(2);
    c.train.micro_batch = 8;
    c.model.vocab_size = 4096;
    c.memory.head = head;
    Trainer t(c);
    t.step();
    t.step();  // steady: the optimizer state exists
    const auto& s = t.tracker().last()[0];
    ASSERT_TRUE(s.at_peak.known);
    const auto& p = t.model().named_parameters();
    const int64_t C = c.model.n_embd, tokens = c.train.micro_batch * c.model.block_size;
    const int64_t V = p["wte.weight"].size(0);
    int64_t param_bytes = 0;
    for (const auto& item : p) param_bytes += item.value().numel() * 4;
    EXPECT_EQ(s.at_peak.head_saved, std::string(head) == "plain" ? 0 : (tokens * C + V * C) * 4);
    EXPECT_LE(s.at_peak.grads_born, param_bytes);
    EXPECT_EQ(s.at_peak.grads, s.at_peak.grads_born);  // zero_grad(set_to_none) before the step: none resident
    EXPECT_GT(s.at_peak.activations, 0);
    EXPECT_EQ(s.at_peak.gathered, 0);  // ZeRO-3 only
    EXPECT_EQ(s.at_peak.activations + s.at_peak.grads_born + s.at_peak.head_saved, s.activation_peak);
    EXPECT_EQ(s.grads_at_optimizer, param_bytes);  // every parameter has its gradient when the step begins
  }
}

// LoRA freezes the tied head: the fused head forms no (V, C) weight-gradient accumulator and saves only its
// input's gradient, tokens x C fp32 bytes (before: tokens x C + V x C), and the loss is the plain head's.
TEST(MemoryTracker, AFrozenFusedHeadKeepsNoWeightGradient) {
  std::map<std::string, double> first_loss;
  for (const char* head : {"fused:32", "plain"}) {
    SCOPED_TRACE(head);
    auto c = test::tiny_gpt_config(2);
    c.train.micro_batch = 8;
    c.model.vocab_size = 4096;
    c.memory.head = head;
    c.lora.rank = 2, c.lora.targets = "c_attn";
    Trainer t(c);
    first_loss[head] = t.step().loss.item<double>();
    t.step();
    const auto& s = t.tracker().last()[0];
    ASSERT_TRUE(s.at_peak.known);
    const int64_t C = c.model.n_embd, tokens = c.train.micro_batch * c.model.block_size;
    EXPECT_EQ(s.at_peak.head_saved, std::string(head) == "plain" ? 0 : tokens * C * 4);
    EXPECT_FALSE(t.model().named_parameters()["wte.weight"].grad().defined());
  }
  EXPECT_NEAR(first_loss["fused:32"], first_loss["plain"], 1e-5);
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
  // Pinned host memory (offloaded checkpoint inputs) comes from the CUDA host allocator, which the counting
  // CPU allocator never sees: the CPU sample reports it in its own field and not in its peak. In a step, a
  // 1 MiB ordinary tensor and (with CUDA) a 1 MiB pinned one: the activation peak holds the first only,
  // the pinned field the second only (0 without CUDA: nothing can be pinned there).
  const bool cuda = torch::cuda::is_available();
  test::TempDir dir;
  MemoryTracker tracker({.rank = 0, .devices = {c10::kCPU}, .jsonl_path = dir.path("m.jsonl")});
  if (cuda) at::getHostAllocator(c10::kCUDA)->empty_cache();
  const int64_t pinned_before = cuda ? pinned_host_bytes() : 0;
  tracker.begin_step(0);
  auto ordinary = torch::empty({1 << 18});  // 1 MiB of fp32
  torch::Tensor pinned;
  if (cuda) pinned = torch::empty({1 << 18}, torch::TensorOptions().pinned_memory(true));
  tracker.end_phase(Phase::kForward);
  const auto& s = tracker.end_step();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].activation_peak, 1 << 20) << "the ordinary MiB, and no pinned byte";
  EXPECT_EQ(s[0].pinned_host_bytes, pinned_before + (cuda ? 1 << 20 : 0));
  std::ifstream in(dir.path("m.jsonl"));
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  auto j = nlohmann::json::parse(line);
  ASSERT_TRUE(j.contains("pinned_host_bytes")) << line;
  EXPECT_EQ(j["pinned_host_bytes"].get<int64_t>(), pinned_before + (cuda ? 1 << 20 : 0));
  EXPECT_EQ(j["activation_peak"].get<int64_t>(), 1 << 20);
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
