// Low-bit AdamW (optim/lowbit_adamw.h) against torchao's AdamW8bit / AdamW4bit (scripts/reference/lowbit_ref.py
// wrote lowbit.safetensors at build time) and against the papers' formula by arithmetic here; its state bytes in
// a run, its checkpoints refused by a run of another block size, and the planner's rule for it.
#include <gtest/gtest.h>

#include <torch/cuda.h>

#include <cmath>

#include "helpers.h"
#include "memtrain/core/error.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/optim/lowbit_adamw.h"
#include "memtrain/optim/optimizer.h"
#include "memtrain/runtime/planner.h"
#include "memtrain/runtime/trainer.h"

namespace memtrain {
namespace {

const std::map<std::string, torch::Tensor>& reference() {
  static const auto ref = load_safetensors(test::fixture("lowbit.safetensors"));
  return ref;
}

TEST(LowBit, MapsAreTorchaosAndTheLinearOneIsKOverSixteen) {
  const auto& ref = reference();
  for (int bits : {8, 4}) {
    SCOPED_TRACE(bits);
    EXPECT_TRUE(torch::equal(moment_map(bits, false), ref.at("map" + std::to_string(bits) + "_m")));
    EXPECT_TRUE(torch::equal(moment_map(bits, true), ref.at("map" + std::to_string(bits) + "_v")));
    for (bool second : {false, true}) {
      const auto map = moment_map(bits, second);
      ASSERT_EQ(map.numel(), 1 << bits);
      EXPECT_TRUE(torch::equal(map, std::get<0>(map.sort()))) << "sorted";
      EXPECT_EQ(map[-1].item<float>(), 1.0f);
    }
  }
  // Li et al.'s second-moment map at 4 bits: k / 16, k = 1..16 (no zero).
  const auto linear = moment_map(4, true);
  for (int k = 1; k <= 16; ++k) EXPECT_EQ(linear[k - 1].item<float>(), static_cast<float>(k) / 16.0f);
  // The 8-bit signed map holds 0 and spans (-1, 1]; the unsigned one starts at 0.
  const auto s8 = moment_map(8, false), u8 = moment_map(8, true);
  EXPECT_EQ((s8 == 0).sum().item<int64_t>(), 1);
  EXPECT_GT(s8[0].item<float>(), -1.0f);
  EXPECT_EQ(u8[0].item<float>(), 0.0f);
}

TEST(LowBit, BlocksQuantizeToTheNearestCodeOfTheirAbsmax) {
  const auto& ref = reference();
  const auto x = ref.at("x");
  for (int bits : {8, 4}) {
    const int64_t block = bits == 8 ? 256 : 128;
    for (bool second : {false, true}) {
      SCOPED_TRACE(std::to_string(bits) + (second ? " bits, exp_avg_sq" : " bits, exp_avg"));
      const auto map = moment_map(bits, second);
      const auto input = second ? x.abs() : x;
      const auto [codes, absmax] = quantize_blockwise(input, map, block, bits);
      const std::string key = "q" + std::to_string(bits) + (second ? "_v" : "_m");
      EXPECT_TRUE(torch::equal(codes, ref.at(key + "_codes"))) << "codes differ from torchao's";
      EXPECT_TRUE(torch::equal(absmax, ref.at(key + "_absmax"))) << "absmaxes differ from torchao's";
      // The formula (Dettmers et al. 2022, section 2.1), by arithmetic here: N_b = max |x| over the block
      // (at least 1e-12), and each code is an index j minimising |Q_j - x / N_b|.
      const auto values = map.accessor<float, 1>();
      const auto xs = input.contiguous();
      const auto* xp = xs.data_ptr<float>();
      auto flat = codes;
      if (bits == 4) flat = torch::stack({codes.div(16, "floor"), codes.remainder(16)}, -1).reshape({-1});  // high nibble first
      const auto cs = flat.to(torch::kLong);
      const auto* cp = cs.data_ptr<int64_t>();
      int64_t not_nearest = 0;
      for (int64_t b = 0; b < x.numel() / block; ++b) {
        double top = 0;
        for (int64_t i = 0; i < block; ++i) top = std::max(top, std::abs(static_cast<double>(xp[b * block + i])));
        top = std::max(top, 1e-12);
        EXPECT_NEAR(absmax[b].item<double>(), top, top * 1e-7) << "block " << b;
        for (int64_t i = 0; i < block; ++i) {
          const double y = xp[b * block + i] / top;
          const double mine = std::abs(values[cp[b * block + i]] - y);
          for (int64_t j = 0; j < map.numel(); ++j) not_nearest += std::abs(values[j] - y) < mine - 1e-6;
        }
      }
      EXPECT_EQ(not_nearest, 0);
      // Dequantized: Q_code x N_b.
      const auto back = dequantize_blockwise(codes, absmax, map, block, bits);
      const auto expected = map.index({cs}) * absmax.repeat_interleave(block);
      EXPECT_TRUE(torch::equal(back, expected));
    }
  }
}

// The reference trajectory: parameters from the fixture, the gradient of step t = bank[t % 8] + 0.5 p.
struct Trajectory {
  std::vector<std::string> names = {"w1", "w2", "bias", "odd"};
  std::vector<torch::Tensor> params;
  std::unique_ptr<LowBitAdamW> opt;

  Trajectory(int bits, bool fused_cpu) {
    const auto& ref = reference();
    for (const auto& n : names) params.push_back(ref.at("init/" + n).clone().requires_grad_());
    // torchao's hyperparameters (lowbit_ref.py): weight decay on every tensor.
    auto o = torch::optim::AdamWOptions(1e-3).betas({0.9, 0.95}).weight_decay(0.1).eps(1e-8);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(params, std::make_unique<torch::optim::AdamWOptions>(o));
    opt = std::make_unique<LowBitAdamW>(std::move(groups), o,
                                        LowBitOptions{.bits = bits, .block = bits == 8 ? 256 : 128, .fused_cpu = fused_cpu});
  }
  void step(int t) {
    const auto& ref = reference();
    for (size_t i = 0; i < params.size(); ++i)
      params[i].mutable_grad() = ref.at("bank/" + std::to_string(t % 8) + "/" + names[i]) + params[i].detach() * 0.5;
    opt->step();
  }
};

TEST(LowBit, OneAndTwoHundredStepsFollowTorchaosAdamW) {
  const auto& ref = reference();
  for (int bits : {8, 4}) {
    for (bool fused : {true, false}) {
      SCOPED_TRACE(std::to_string(bits) + (fused ? " bits, the CPU loop" : " bits, ATen ops"));
      const std::string tag = "b" + std::to_string(bits);
      Trajectory run(bits, fused);
      for (int t = 0; t < 200; ++t) {
        run.step(t);
        if (t != 0 && t != 199) continue;
        const auto at = tag + "/step" + std::to_string(t + 1) + "/";
        for (size_t i = 0; i < run.params.size(); ++i) {
          const auto& name = run.names[i];
          const auto want = ref.at(at + name);
          const auto got = run.params[i].detach();
          // After one step, through ATen ops: the same bits as torchao's eager step. The CPU loop: within an ulp
          // or two of the largest, as its sqrt is the C library's, correctly rounded, where ATen's vectorized one may be an ulp
          // off (checked in Python: torch.sqrt differs from numpy's on 100,000 random floats). After 200 steps
          // (each gradient depends on the parameters, so differences compound): within 1e-6 of their scale.
          if (t == 0 && !fused) {
            EXPECT_TRUE(torch::equal(got, want)) << name << ": max diff " << (got - want).abs().max().item<double>();
          } else if (t == 0) {
            EXPECT_LT(test::relative_error(got, want), 1e-7) << name;
          } else {
            EXPECT_LT(test::relative_error(got, want), 1e-6) << name;
          }
          const auto state = get_param_state(*run.opt, run.params[i]);
          if (ref.count(at + name + ".m_codes")) {
            ASSERT_TRUE(state.count("exp_avg_codes")) << name << " should be quantized";
            const auto mc = state.at("exp_avg_codes"), vc = state.at("exp_avg_sq_codes");
            const auto want_mc = ref.at(at + name + ".m_codes"), want_vc = ref.at(at + name + ".v_codes");
            const double differ = (mc.ne(want_mc).sum().item<double>() + vc.ne(want_vc).sum().item<double>()) /
                                  static_cast<double>(2 * mc.numel());
            if (t == 0) {
              EXPECT_EQ(differ, 0) << name;
              EXPECT_TRUE(torch::equal(state.at("exp_avg_absmax"), ref.at(at + name + ".m_absmax"))) << name;
              EXPECT_TRUE(torch::equal(state.at("exp_avg_sq_absmax"), ref.at(at + name + ".v_absmax"))) << name;
            } else {
              EXPECT_LT(differ, 1e-3) << name << ": codes that differ from torchao's after 200 steps";
              EXPECT_LT(test::relative_error(state.at("exp_avg_absmax"), ref.at(at + name + ".m_absmax")), 1e-4) << name;
            }
          } else {
            ASSERT_TRUE(state.count("exp_avg")) << name << " keeps fp32 moments";
            EXPECT_LT(test::relative_error(state.at("exp_avg").reshape({-1}), ref.at(at + name + ".m")), t == 0 ? 1e-7 : 1e-5) << name;
          }
          EXPECT_EQ(state.at("step").item<int64_t>(), t + 1);
        }
      }
    }
  }
}

TEST(LowBit, CudaStepsAsTorchaosSkipWithoutGpu) {
  // The ATen path on the GPU: codes and absmaxes after one step as torchao's, parameters within 1e-6.
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto& ref = reference();
  for (int bits : {8, 4}) {
    SCOPED_TRACE(bits);
    Trajectory run(bits, false);
    for (auto& p : run.params) p = p.detach().to(torch::kCUDA).requires_grad_();
    std::vector<torch::optim::OptimizerParamGroup> groups;
    auto o = torch::optim::AdamWOptions(1e-3).betas({0.9, 0.95}).weight_decay(0.1).eps(1e-8);
    groups.emplace_back(run.params, std::make_unique<torch::optim::AdamWOptions>(o));
    run.opt = std::make_unique<LowBitAdamW>(std::move(groups), o, LowBitOptions{.bits = bits, .block = bits == 8 ? 256 : 128});
    for (size_t i = 0; i < run.params.size(); ++i)
      run.params[i].mutable_grad() = (ref.at("bank/0/" + run.names[i]).to(torch::kCUDA) + run.params[i].detach() * 0.5);
    run.opt->step();
    const auto at = "b" + std::to_string(bits) + "/step1/";
    for (size_t i = 0; i < run.params.size(); ++i) {
      EXPECT_LT(test::relative_error(run.params[i].detach().cpu(), ref.at(at + run.names[i])), 1e-6) << run.names[i];
      const auto state = get_param_state(*run.opt, run.params[i]);
      if (ref.count(at + run.names[i] + ".m_codes")) {
        EXPECT_LT(state.at("exp_avg_codes").cpu().ne(ref.at(at + run.names[i] + ".m_codes")).sum().item<int64_t>(), 3) << run.names[i];
      }
    }
  }
}

TEST(LowBit, OnlyWholeBlocksOfLargeEnoughParametersAreQuantized) {
  // torchao's rule (and bitsandbytes'): at least 4096 elements and a multiple of the block.
  Trajectory run(8, true);
  run.step(0);
  std::map<std::string, bool> quantized;
  for (size_t i = 0; i < run.params.size(); ++i) quantized[run.names[i]] = get_param_state(*run.opt, run.params[i]).count("exp_avg_codes") > 0;
  EXPECT_TRUE(quantized["w1"]);     // 8192
  EXPECT_TRUE(quantized["w2"]);     // 12288
  EXPECT_FALSE(quantized["bias"]);  // 10
  EXPECT_FALSE(quantized["odd"]);   // 4900: not whole blocks of 256
}

// What a tensor's moments take in bytes, by arithmetic: quantized, a code per element per moment (8 bits) or half
// a byte (4 bits) and an fp32 absmax per block per moment; else two fp32 moments.
int64_t state_bytes(int64_t numel, int bits, int64_t block) {
  if (numel >= 4096 && numel % block == 0) return 2 * (bits == 8 ? numel : numel / 2) + 2 * 4 * (numel / block);
  return 8 * numel;
}

TEST(LowBit, TheRunsOptimizerStateBytesAreTheArithmeticAndTheEstimateCountsThem) {
  for (const auto& [optimizer, bits] : std::vector<std::pair<std::string, int>>{{"adamw8bit", 8}, {"adamw4bit", 4}}) {
    SCOPED_TRACE(optimizer);
    auto c = test::tiny_gpt_config();
    c.train.optimizer = optimizer;
    Trainer t(c);
    int64_t expected = 0, fp32 = 0, quantized = 0;
    for (const auto& p : t.parameters()) {
      expected += state_bytes(p.numel(), bits, bits == 8 ? 256 : 128);
      fp32 += 8 * p.numel();
      quantized += p.numel() >= 4096;
    }
    ASSERT_GE(quantized, 2) << "the model should have quantized parameters";
    for (int s = 0; s < 2; ++s) t.step();
    EXPECT_EQ(t.tracker().last().at(0).resident.optimizer_state, expected);
    EXPECT_EQ(t.memory_estimate().device.optimizer_state, expected);
    EXPECT_LT(expected, fp32 / 2);
  }
}

TEST(LowBit, ACheckpointOfAnotherOptimizerOrBlockSizeIsRefusedNamingIt) {
  test::TempDir dir;
  auto c = test::tiny_gpt_config();
  c.train.optimizer = "adamw8bit";
  c.checkpoint.dir = dir.path("checkpoints");
  std::string path;
  {
    Trainer t(c);
    t.step();
    path = t.save_checkpoint();
  }
  auto other = c;
  other.train.optimizer_block = 128;
  Trainer b(other);
  const auto before = b.parameters()[0].clone();
  try {
    b.load_checkpoint(path);
    FAIL() << "a checkpoint with blocks of 256 loaded into a run with blocks of 128";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("train.optimizer_block"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(torch::equal(b.parameters()[0], before));
  auto fp32 = c;
  fp32.train.optimizer = "adamw";
  Trainer f(fp32);
  try {
    f.load_checkpoint(path);
    FAIL() << "an 8-bit checkpoint loaded into an fp32 AdamW run";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("adamw8bit"), std::string::npos) << e.what();
  }
}

TEST(Planner, LowBitStateIsChosenOnlyWhereNothingWithFp32MomentsFits) {
  auto candidate = [](int64_t peak, double ms, int rank) {
    PlanCandidate c;
    c.estimate.device.params = peak;
    c.step_ms = ms;
    c.lowbit_rank = rank;
    c.optimizer = rank == 0 ? "" : rank == 1 ? "adamw8bit" : "adamw4bit";
    return c;
  };
  // A slower fp32 setting that fits beats a faster 8-bit one.
  auto plan = choose_plan({candidate(900, 50, 0), candidate(100, 10, 1), candidate(50, 5, 2)}, 1000);
  EXPECT_EQ(plan.chosen.lowbit_rank, 0);
  EXPECT_EQ(plan.explain().find("adamw8bit (memory"), std::string::npos);
  // Nothing fp32 fits: 8 bits before 4, and the plan says it changes the numerics.
  plan = choose_plan({candidate(2000, 50, 0), candidate(900, 10, 1), candidate(50, 5, 2)}, 1000);
  EXPECT_EQ(plan.chosen.optimizer, "adamw8bit");
  EXPECT_NE(plan.explain().find("changes the numerics"), std::string::npos) << plan.explain();
  plan = choose_plan({candidate(2000, 50, 0), candidate(1100, 10, 1), candidate(500, 5, 2)}, 1000);
  EXPECT_EQ(plan.chosen.optimizer, "adamw4bit");
}

TEST(Planner, LowBitStateIsPlannedOnlyWhenAllowedAndThenTheRunFits) {
  // Model states by arithmetic: the tied embedding is 20,000 x 64 = 1.28M elements: 5.12 MB of fp32 parameters
  // and AdamW's two moments 10.24 MB; 8-bit moments are 2 x (1.28M + 4 x 1.28M / 256) = 2.6 MB, 7.6 MB (7.3 MiB)
  // less. The step's own peak adds about 15 MiB whatever the planner recomputes (the embedding's gradient is born
  // in backward, 5.12 MB, with its scatter's temporaries): fp32 moments need about 29 MiB, over 26 MiB less the
  // 5% headroom (24.7 MiB); 8-bit ones about 22 MiB.
  auto c = test::tiny_gpt_config();
  c.model.n_embd = 64;
  c.model.vocab_size = 20000;
  c.train.micro_batch = 2;
  c.memory.budget_mib = "26";
  const auto e = test::error_of([&] { Trainer t(c); });
  EXPECT_NE(e.find("memory.budget_mib = 26 cannot be met"), std::string::npos) << e;
  c.memory.allow_lowbit_optimizer = true;
  Trainer t(c);
  EXPECT_EQ(t.config().train.optimizer, "adamw8bit");
  for (int s = 0; s < 2; ++s) t.step();
  EXPECT_LE(t.tracker().last().at(0).peak_allocated, 26 * (int64_t{1} << 20));
  EXPECT_LT(t.tracker().last().at(0).resident.optimizer_state, 3'000'000);
}

}  // namespace
}  // namespace memtrain
