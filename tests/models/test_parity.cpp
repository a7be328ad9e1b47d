// Parity with PyTorch: the same GPT, weights and batch in Python (scripts/reference/make_fixtures.py)
// and in memtrain give the same logits, loss, gradients and AdamW trajectory to float32 tolerance.
#include <gtest/gtest.h>

#include "helpers.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/models/gpt.h"
#include "memtrain/optim/optimizer.h"

namespace memtrain {
namespace {

class GptParity : public ::testing::Test {
 protected:
  void SetUp() override {
    ref = load_safetensors(test::fixture("gpt_parity.safetensors"));
    gpt = test::fixture_gpt();
  }
  std::map<std::string, torch::Tensor> ref;
  std::shared_ptr<GPT> gpt;
};

TEST_F(GptParity, LogitsLossAndEveryGradient) {
  auto logits = gpt->forward(ref.at("input"));
  auto loss = gpt->loss(logits, ref.at("target"));
  loss.backward();
  EXPECT_LT(test::relative_error(logits, ref.at("logits")), 1e-5);
  EXPECT_NEAR(loss.item<double>(), ref.at("loss").item<double>(), 1e-5);
  int n = 0;
  for (const auto& item : gpt->named_parameters()) {
    SCOPED_TRACE(item.key());
    ASSERT_TRUE(item.value().grad().defined());
    EXPECT_LT(test::relative_error(item.value().grad(), ref.at("grad." + item.key())), 1e-4);
    ++n;
  }
  EXPECT_EQ(n, 4 + 2 * 12);  // wte, wpe, ln_f (2) + 12 tensors per block
}

TEST_F(GptParity, AdamWTrajectory) {
  // Both AdamW implementations: the fused kernel (default) and LibTorch's per-parameter loop.
  using Kind = OptimizerOptions::Kind;
  for (auto kind : {Kind::kAdamW, Kind::kAdamWLoop}) {
    SCOPED_TRACE(kind == Kind::kAdamW ? "adamw" : "adamw_loop");
    SetUp();  // fresh weights
    auto opt = make_optimizer({.kind = kind, .lr = 1e-2, .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8},
                              gpt->named_parameters());
    auto expected = ref.at("adamw_losses");
    for (int64_t i = 0; i < expected.size(0); ++i) {
      opt->zero_grad(true);
      auto loss = gpt->loss(gpt->forward(ref.at("input")), ref.at("target"));
      loss.backward();
      opt->step();
      EXPECT_NEAR(loss.item<double>(), expected[i].item<double>(), 1e-4 * std::abs(expected[i].item<double>()))
          << "step " << i;
    }
  }
}

TEST_F(GptParity, MismatchedWeightsAreRejected) {
  auto weights = ref;
  weights.erase("input");
  auto msg = test::error_of([&] { load_module_state(*gpt, weights, "fixture"); });
  EXPECT_NE(msg.find("unexpected tensor"), std::string::npos) << msg;
  std::map<std::string, torch::Tensor> missing;
  msg = test::error_of([&] { load_module_state(*gpt, missing, "fixture"); });
  EXPECT_NE(msg.find("no tensor"), std::string::npos) << msg;
}

}  // namespace
}  // namespace memtrain
