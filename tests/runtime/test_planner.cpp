#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "helpers.h"
#include "memtrain/runtime/planner.h"
#include "memtrain/runtime/step_time.h"
#include "memtrain/runtime/trainer.h"

namespace memtrain {
namespace {

PlanCandidate candidate(int64_t micro, const char* policy, int64_t activation_mib, double ms) {
  PlanCandidate c;
  c.micro_batch = micro, c.accum_steps = 16 / micro, c.recompute = policy, c.step_ms = ms;
  c.estimate.device.params = 10 << 20;
  c.estimate.device.activations = activation_mib << 20;
  return c;
}

TEST(Planner, ChoosesTheFastestThatFits) {
  // Peaks: 10 MiB of parameters + the activations.
  const std::vector<PlanCandidate> c = {candidate(16, "none", 90, 100), candidate(16, "all", 40, 130),
                                        candidate(4, "none", 30, 120), candidate(1, "all", 5, 200)};
  EXPECT_EQ(choose_plan(c, 100 << 20).chosen.recompute, "none");  // everything fits: the fastest
  EXPECT_EQ(choose_plan(c, 100 << 20).chosen.micro_batch, 16);
  const auto p = choose_plan(c, 50 << 20);  // 100 MiB no longer fits: 4 x none (120 ms) before 16 x all (130 ms)
  EXPECT_EQ(p.chosen.micro_batch, 4);
  ASSERT_EQ(p.runners_up.size(), 2u);
  EXPECT_EQ(p.runners_up[0].recompute, "all");
  EXPECT_EQ(p.runners_up[0].micro_batch, 16);
  EXPECT_EQ(p.fitting, 3);
  EXPECT_EQ(choose_plan(c, 20 << 20).chosen.micro_batch, 1);
  EXPECT_NE(p.explain().find("chosen:    micro-batch 4 x 4, recompute none"), std::string::npos) << p.explain();
}

// memory.budget_headroom: a plan's estimate must leave that share of the budget free (the estimate's error).
TEST(Planner, TheHeadroomKeepsAShareOfTheBudgetForTheEstimatesError) {
  const std::vector<PlanCandidate> c = {candidate(16, "none", 90, 100), candidate(4, "none", 30, 120)};
  EXPECT_EQ(choose_plan(c, 100 << 20, 0).chosen.micro_batch, 16);  // 100 MiB fits 100 MiB exactly
  const auto p = choose_plan(c, 100 << 20, 0.05);                  // estimates up to 95 MiB: only 40 MiB fits
  EXPECT_EQ(p.chosen.micro_batch, 4);
  EXPECT_EQ(p.fitting, 1);
  EXPECT_NE(p.explain().find("estimates up to 95.0 MiB, memory.budget_headroom = 0.05"), std::string::npos) << p.explain();
  // 40 MiB with a quarter held back needs 40 / 0.75 = 53.3 MiB: 54 is the smallest whole budget.
  const auto e = test::error_of([&] { choose_plan(c, 53 << 20, 0.25); });
  EXPECT_NE(e.find("memory.budget_mib = 54 (with memory.budget_headroom = 0.25)"), std::string::npos) << e;
  EXPECT_EQ(choose_plan(c, 54 << 20, 0.25).chosen.micro_batch, 4);
}

TEST(Planner, AnImpossibleBudgetNamesTheSmallestFeasibleOneAndWhatDominatesIt) {
  const std::vector<PlanCandidate> c = {candidate(16, "none", 90, 100), candidate(1, "all", 5, 200)};
  const auto e = test::error_of([&] { choose_plan(c, 12 << 20); });
  EXPECT_NE(e.find("smallest estimated peak of 2 settings is 15.0 MiB"), std::string::npos) << e;
  EXPECT_NE(e.find("memory.budget_mib = 15 "), std::string::npos) << e;  // 15.0 MiB fits 15 MiB exactly
  EXPECT_NE(e.find("dominated by parameters (10.0 MiB of 15.0 MiB)"), std::string::npos) << e;
}

TEST(Planner, TheStepCostModelOrdersTheKnobs) {
  // Recomputing everything adds a third of the compute; smaller micro-batches add their fixed cost.
  EXPECT_NEAR(plan_step_cost(16, 1, 1.0, 0, 0) / plan_step_cost(16, 1, 0.0, 0, 0), 4.0 / 3, 1e-12);
  EXPECT_GT(plan_step_cost(4, 4, 0, 0), plan_step_cost(16, 1, 0, 0));
  EXPECT_GT(plan_step_cost(16, 1, 0, 3), plan_step_cost(16, 1, 0, 2));
  EXPECT_DOUBLE_EQ(recompute_fraction("every:4"), 0.25);
  EXPECT_DOUBLE_EQ(recompute_fraction("attn") + recompute_fraction("mlp"), 1.0);
}

// Offload's price: the CPU update of this rank's part plus its gradient down and parameters up, by arithmetic.
TEST(Planner, OffloadIsPricedByItsCpuUpdateAndCopiesAndChosenOnlyWhereItIsNeeded) {
  // 1e8 elements: 2 ns each on the CPU is 200 ms; 8 bytes each over 25 GB/s is 32 ms.
  EXPECT_NEAR(offload_step_ms(100'000'000, 4, 4, 2.0, 25e9), 200.0 + 32.0, 1e-9);
  EXPECT_NEAR(offload_step_ms(100'000'000, 4, 2, 2.0, 25e9), 200.0 + 24.0, 1e-9);  // bf16 parameters go up
  const double ns = time_cpu_update();  // ATen's fused AdamW here: a real, finite cost per element
  EXPECT_GT(ns, 0.0);
  EXPECT_LT(ns, 1000.0);
  // Untimed (several ranks): offload costs more than the same setting without it, so it is chosen only when
  // nothing else fits.
  EXPECT_GT(plan_step_cost(16, 1, 0, 2, 0.1, true), plan_step_cost(4, 4, 1.0, 3, 0.1, false));
  auto candidate = [](int stage, bool offload, int64_t peak_mib, double ms) {
    PlanCandidate c;
    c.stage = stage, c.offload = offload, c.step_ms = ms;
    c.estimate.device.params = peak_mib << 20;
    return c;
  };
  const std::vector<PlanCandidate> c = {candidate(3, false, 60, 100), candidate(3, true, 30, 180)};
  EXPECT_FALSE(choose_plan(c, 80ll << 20).chosen.offload);
  const auto tight = choose_plan(c, 40ll << 20);
  EXPECT_TRUE(tight.chosen.offload);
  EXPECT_NE(tight.explain().find("stage 3 + offload"), std::string::npos) << tight.explain();
}

Config planner_config() {
  auto c = test::tiny_gpt_config(4);
  // The Austen text: its global batch is drawn once per step, so any micro-batch split sees the same samples.
  c.data.dataset = "text";
  c.model.n_embd = 64, c.model.block_size = 64, c.model.n_head = 4;
  c.train.micro_batch = 16, c.train.steps = 4, c.train.threads = 1;
  return c;
}

std::pair<std::vector<double>, int64_t> train(Trainer& t, int steps) {
  std::vector<double> losses;
  for (int i = 0; i < steps; ++i) losses.push_back(t.step().loss.item<double>());
  return {losses, t.tracker().summaries().at(0).max_peak};
}

TEST(Planner, EachPlannedRunFitsItsBudgetAndTrainsAsTheUnplannedRun) {
  // The counting allocator is process-wide: the unplanned trainer is gone before the planned ones start.
  const auto [plain_losses, plain_peak] = [] {
    Trainer plain(planner_config());
    return train(plain, 4);
  }();
  // Budgets from 80% of the unplanned peak down to 40%: each needs less activation memory than the last.
  for (double share : {0.8, 0.6, 0.4}) {
    SCOPED_TRACE("budget " + std::to_string(share) + " of the unplanned peak");
    auto c = planner_config();
    const int64_t budget = static_cast<int64_t>(share * static_cast<double>(plain_peak));
    c.memory.budget_mib = std::to_string(static_cast<double>(budget) / (1024.0 * 1024.0));
    Trainer t(c);
    const auto& chosen = t.config();
    EXPECT_EQ(chosen.train.micro_batch * chosen.train.accum_steps, 16) << "the global batch is kept";
    const auto [losses, peak] = train(t, 4);
    EXPECT_LE(peak, budget) << chosen.train.micro_batch << " x " << chosen.train.accum_steps << ", "
                            << chosen.memory.recompute << ", " << chosen.memory.head;
    ASSERT_EQ(losses.size(), plain_losses.size());
    // The same samples: another micro-batch split sums them in another order (fp32 rounding apart).
    for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(losses[i], plain_losses[i], 1e-4 * plain_losses[i]) << i;
  }
}

// The plan is a value: applied once, written into the run's config.ini and recorded in summary.json.
TEST(Planner, APlannedRunRecordsItsSettingsInTheSummary) {
  test::TempDir dir;
  int code = -1;
  const auto out = test::shell(test::binary("memtrain") + " --config " + test::source("examples/configs/gpt_austen_cpu.ini") +
                                   " --memory.budget_mib=40 --train.steps=2 --train.eval_batches=1 "
                                   "--checkpoint.save_final=false --log.dir=" + dir.path() + " --log.name=p 2>&1",
                               &code);
  ASSERT_EQ(code, 0) << out;
  std::ifstream summary_file(dir.path("p/summary.json"));
  const auto summary = nlohmann::json::parse(summary_file);
  const auto settings = summary["settings"];
  const auto ini = Config::load(dir.path("p/config.ini"), {});
  // One process without offload: nothing sharded, whatever the config's stage (ParallelDims).
  EXPECT_EQ(summary["parallel"], nlohmann::json({{"world", 1}, {"data_parallel", 1}, {"tensor_parallel", 1},
                                                 {"zero_stage", 0}, {"offload_optimizer", false}}));
  EXPECT_TRUE(settings["planned"].get<bool>());
  EXPECT_EQ(settings["micro_batch"].get<int64_t>() * settings["accum_steps"].get<int64_t>(), 16);
  EXPECT_LT(settings["micro_batch"].get<int64_t>(), 16) << "40 MiB does not hold 16 x 1 without recompute";
  EXPECT_EQ(settings["micro_batch"].get<int64_t>(), ini.train.micro_batch);
  EXPECT_EQ(settings["recompute"].get<std::string>(), ini.memory.recompute);
  EXPECT_EQ(settings["head"].get<std::string>(), ini.memory.head);
  EXPECT_NE(out.find("chosen:"), std::string::npos) << out;  // printed once, at the start
}

TEST(Planner, AnImpossibleBudgetIsAnErrorBeforeTraining) {
  auto c = planner_config();
  c.memory.budget_mib = "1";
  const auto e = test::error_of([&] { Trainer t(c); });
  EXPECT_NE(e.find("memory.budget_mib = 1 cannot be met"), std::string::npos) << e;
  EXPECT_NE(e.find("the smallest feasible budget is memory.budget_mib = "), std::string::npos) << e;
}

TEST(Planner, BudgetKeyErrorsNameTheValue) {
  EXPECT_NE(test::error_of([] { Config::load("", {"--memory.budget_mib=lots"}); }).find("memory.budget_mib = 'lots'"),
            std::string::npos);
  EXPECT_NE(test::error_of([] { Config::load("", {"--memory.budget_mib=100", "--memory.recompute=budget:50"}); })
                .find("set one of them"),
            std::string::npos);
  EXPECT_NO_THROW(Config::load("", {"--memory.budget_mib=auto"}));
  EXPECT_NE(test::error_of([] { Config::load("", {"--memory.budget_headroom=0.5"}); })
                .find("memory.budget_headroom = 0.5 is out of range: expected in [0, 0.5)"),
            std::string::npos);
}

// The time model (step_time.h, docs/ESTIMATE.md "Step time") by its stated arithmetic: on a GPU target each matmul
// takes its FLOPs at 30.5% of the data sheet's dense peak; causal attention half the 4 T^2 d FLOPs per sequence and
// head forward, 2.5x that backward; everything trains, so each linear's backward is two products of its forward's.
TEST(StepTime, AGpuStepIsItsFlopsAtTheStatedShareOfThePeak) {
  const int64_t L = 2, C = 64, H = 2, T = 32, V = 256, B = 4, A = 3;
  auto c = Config::load("", {"--model.n_layer=2", "--model.n_head=2", "--model.n_embd=64", "--model.block_size=32",
                             "--model.vocab_size=256", "--train.micro_batch=4", "--train.accum_steps=3",
                             "--train.precision=bf16"});
  const auto s = step_settings(c, 1, 1);
  const auto speed = target_speed(parse_target("h100-80gb"), s.half_matmuls);
  const auto t = predict_step(s, speed);
  const double rate = 989e12 * 0.305;
  const double tokens = B * T;
  const double linears = 2 * tokens * 12 * C * C;           // qkv, proj, fc, proj: 12 C^2 per token
  const double attention = 2.0 * B * H * T * T * (C / H);   // causal forward
  const double head = 2 * tokens * C * V;
  const double micro = L * (3 * linears + 3.5 * attention) + 3 * head;
  EXPECT_NEAR(t.compute_s, A * micro / rate, 1e-6 * t.compute_s);
  EXPECT_EQ(t.recompute_s, 0);
  EXPECT_EQ(t.communication_s, 0);  // one rank
  EXPECT_NEAR(t.overhead_s, A * L * 60 * 4e-6, 1e-12);
  // Recomputing every block adds one block forward per micro-batch and layer.
  c.memory.recompute = "all";
  const auto r = predict_step(step_settings(c, 1, 1), speed);
  EXPECT_NEAR(r.recompute_s, A * L * (linears + attention) / rate, 1e-6 * r.recompute_s);
  EXPECT_GT(r.total_s, t.total_s);
  // fp32 matmuls run at the fp32 peak (no TF32): 989 / 67 times slower.
  c.train.precision = "fp32";
  c.memory.recompute = "none";
  const auto f = predict_step(step_settings(c, 1, 1), target_speed(parse_target("h100-80gb"), false));
  EXPECT_NEAR(f.compute_s / t.compute_s, 989.0 / 67, 1e-9);
  EXPECT_NEAR(t.tokens_per_s, A * tokens / t.total_s, 1e-6 * t.tokens_per_s);
}

TEST(StepTime, CollectivesMoveTheirBytesAtTheBusBandwidthAndOverlapTheBackward) {
  // GPT with biases: a block 12 C^2 + 13 C elements, the rest V C + T C + 2 C (tied head); fp32 gradients.
  const int64_t L = 2, C = 64, T = 32, V = 256;
  const double P = L * (12.0 * C * C + 13 * C) + V * C + T * C + 2 * C;
  auto c = Config::load("", {"--model.n_layer=2", "--model.n_head=2", "--model.n_embd=64", "--model.block_size=32",
                             "--model.vocab_size=256", "--dist.zero_stage=2"});
  const auto speed = target_speed(parse_target("h100-80gb"), false);
  // Stage 2 on 8 GPUs of one node: a reduce-scatter of the gradients, an all-gather of the parameters after the step.
  auto s = step_settings(c, 8, 8);
  EXPECT_EQ(s.trained_elements, static_cast<int64_t>(P));
  const double nvlink = 0.8 * 450e9, share = 7.0 / 8;
  auto t = predict_step(s, speed);
  EXPECT_NEAR(t.communication_s, 2 * share * 4 * P / nvlink, 1e-9 * t.communication_s);
  EXPECT_GE(t.exposed_s, share * 4 * P / nvlink * (1 - 1e-9));  // the gather after the step never overlaps
  // Two nodes of 4: the network's 50 GB/s at 80% is the ring's slowest link.
  t = predict_step(step_settings(c, 8, 4), speed);
  EXPECT_NEAR(t.communication_s, 2 * share * 4 * P / (0.8 * 50e9), 1e-9 * t.communication_s);
  // Stage 3 gathers every parameter twice per micro-batch besides the reduce-scatter.
  c.dist.zero_stage = 3;
  t = predict_step(step_settings(c, 8, 8), speed);
  EXPECT_NEAR(t.communication_s, 3 * share * 4 * P / nvlink, 1e-9 * t.communication_s);
  // The optimizer steps 1/8 of the elements, 32 bytes each over HBM (3.35 TB/s).
  EXPECT_NEAR(t.optimizer_s, P / 8 * 32 / 3.35e12, 1e-9 * t.optimizer_s);
}

// dist.tensor_parallel = 2 on 8 GPUs of a node: ZeRO-2 runs over the 4 data-parallel ranks (a rank's slice: the block
// linears' weights and the vocabulary's rows halved, biases and norms counted whole), and each micro-batch's tensor-
// parallel collectives are 8 per block and 4 more all-gathers' worth of its tokens x C bf16 activations, all exposed.
TEST(StepTime, TensorParallelCollectivesAreExposedAndZeroRunsOverTheDataRanks) {
  const int64_t L = 2, C = 64, Tc = 32, V = 256, B = 4, A = 3, T = 2;
  auto c = Config::load("", {"--model.n_layer=2", "--model.n_head=2", "--model.n_embd=64", "--model.block_size=32",
                             "--model.vocab_size=256", "--train.micro_batch=4", "--train.accum_steps=3",
                             "--train.precision=bf16", "--dist.zero_stage=2", "--dist.tensor_parallel=2"});
  const auto s = step_settings(c, 8, 8);
  const double P = L * (12.0 * C * C / T + 13 * C) + (V / T) * C + Tc * C + 2 * C;
  EXPECT_EQ(s.trained_elements, static_cast<int64_t>(P));
  const auto speed = target_speed(parse_target("h100-80gb"), s.half_matmuls);
  const auto t = predict_step(s, speed);
  const double nvlink = 0.8 * 450e9;
  const double unit = (T - 1.0) / T * (B * Tc * C * 2) / nvlink;  // one all-gather of a micro-batch's activations
  EXPECT_NEAR(t.tensor_parallel_s, A * (8 * L + 4) * unit, 1e-9 * t.tensor_parallel_s);
  const double data_share = 3.0 / 4;  // ZeRO's ring over 4 data-parallel ranks, fp32 gradients of the slice
  EXPECT_NEAR(t.communication_s - t.tensor_parallel_s, 2 * data_share * 4 * P / nvlink, 1e-9 * t.communication_s);
  EXPECT_GE(t.exposed_s, t.tensor_parallel_s);
  EXPECT_NEAR(t.tokens_per_s, A * B * Tc * 4 / t.total_s, 1e-6 * t.tokens_per_s);  // 4 data-parallel ranks' samples
  // Recomputing every block runs its forward collectives again: 4 more units per block and micro-batch.
  c.memory.recompute = "all";
  EXPECT_NEAR(predict_step(step_settings(c, 8, 8), speed).tensor_parallel_s, A * (12 * L + 4) * unit, 1e-9 * t.tensor_parallel_s);
}

TEST(StepTime, ACpuTargetTimesItsMatmulsHere) {
  auto c = Config::load("", {"--model.vocab_size=256"});
  const auto speed = target_speed(parse_target("cpu:8GiB"), false);
  EXPECT_TRUE(speed.timed);
  const auto t = predict_step(step_settings(c, 1, 1), speed);
  EXPECT_GT(t.compute_s, 0);
  EXPECT_GT(t.optimizer_s, 0);
  EXPECT_FALSE(speed.matmul_s.empty());  // what it timed, memoized
  c.memory.recompute = "all";
  EXPECT_GT(predict_step(step_settings(c, 1, 1), speed).total_s, t.total_s);
}

}  // namespace
}  // namespace memtrain
