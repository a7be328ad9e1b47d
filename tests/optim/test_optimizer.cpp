#include <gtest/gtest.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <limits>
#include <numbers>

#include "helpers.h"
#include "memtrain/optim/optimizer.h"

namespace memtrain {
namespace {

TEST(CosineSchedule, WarmupPeakMidpointAndFloor) {
  CosineSchedule s({.peak = 1.0, .min = 0.1, .warmup_steps = 10, .total_steps = 110});
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);     // (0 + 1) / 10
  EXPECT_DOUBLE_EQ(s.at(4), 0.5);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);    // cosine starts at the peak
  EXPECT_DOUBLE_EQ(s.at(60), 0.55);   // halfway: (peak + min) / 2
  EXPECT_NEAR(s.at(35), 0.1 + 0.45 * (1 + std::cos(std::numbers::pi / 4)), 1e-12);
  EXPECT_DOUBLE_EQ(s.at(110), 0.1);
  EXPECT_DOUBLE_EQ(s.at(500), 0.1);
}

TEST(ClipGradNorm, AgreesWithLibTorchClipGradNorm) {
  torch::manual_seed(0);
  std::vector<torch::Tensor> a, b;
  for (auto shape : {std::vector<int64_t>{3, 4}, {5}, {2, 2, 2}}) {
    auto g = torch::randn(shape) * 3;
    auto pa = torch::zeros(shape).requires_grad_(), pb = torch::zeros(shape).requires_grad_();
    pa.mutable_grad() = g.clone();
    pb.mutable_grad() = g.clone();
    a.push_back(pa), b.push_back(pb);
  }
  auto norm = clip_grad_norm(a, 1.0).item<double>();
  auto expected = torch::nn::utils::clip_grad_norm_(b, 1.0);
  EXPECT_NEAR(norm, expected, 1e-5);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::allclose(a[i].grad(), b[i].grad(), 1e-5, 1e-6));
  // clip 0: the norm is reported and nothing is scaled.
  auto before = a[0].grad().clone();
  EXPECT_NEAR(clip_grad_norm(a, 0).item<double>(), 1.0, 1e-4);
  EXPECT_TRUE(torch::equal(a[0].grad(), before));
}

TEST(MakeOptimizer, DecayOnMatricesOnly) {
  torch::nn::Linear lin(4, 3);
  auto opt = make_optimizer({.weight_decay = 0.25}, lin->named_parameters());
  ASSERT_EQ(opt->param_groups().size(), 2u);
  auto& g0 = opt->param_groups()[0];
  auto& g1 = opt->param_groups()[1];
  ASSERT_EQ(g0.params().size(), 1u);
  EXPECT_TRUE(g0.params()[0].is_same(lin->weight));
  EXPECT_DOUBLE_EQ(static_cast<torch::optim::AdamWOptions&>(g0.options()).weight_decay(), 0.25);
  EXPECT_TRUE(g1.params()[0].is_same(lin->bias));
  EXPECT_DOUBLE_EQ(static_cast<torch::optim::AdamWOptions&>(g1.options()).weight_decay(), 0.0);
  set_learning_rate(*opt, 0.123);
  EXPECT_DOUBLE_EQ(g0.options().get_lr(), 0.123);
  EXPECT_DOUBLE_EQ(g1.options().get_lr(), 0.123);
}

TEST(MakeOptimizer, StateTensorsAreAdamMoments) {
  torch::nn::Linear lin(4, 3);
  auto opt = make_optimizer({}, lin->named_parameters());
  lin->forward(torch::randn({2, 4})).sum().backward();
  opt->step();
  auto state = optimizer_state_tensors(*opt);
  ASSERT_EQ(state.size(), 4u);  // exp_avg and exp_avg_sq for weight and bias
  int64_t elems = 0;
  for (const auto& s : state) elems += s.numel();
  EXPECT_EQ(elems, 2 * (12 + 3));
}

// Offload updates bucket by bucket: stepping the parameters in parts must give the bits of one step().
TEST(FusedAdamW, SteppingInPartsEqualsOneStepBitwise) {
  torch::manual_seed(3);
  auto make = [] {
    std::vector<torch::Tensor> p = {torch::randn({7, 5}), torch::randn({5}), torch::randn({300})};
    for (auto& t : p) t.requires_grad_();
    return p;
  };
  auto whole = make(), parts = make();
  for (size_t i = 0; i < whole.size(); ++i) parts[i].data().copy_(whole[i].data());
  auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  FusedAdamW a({torch::optim::OptimizerParamGroup(whole)}, options), b({torch::optim::OptimizerParamGroup(parts)}, options);
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < whole.size(); ++i) {
      auto g = torch::randn(whole[i].sizes());
      whole[i].mutable_grad() = g.clone();
      parts[i].mutable_grad() = g.clone();
    }
    a.step();
    b.step_only({parts[2]});
    b.step_only({parts[0], parts[1]});
    for (size_t i = 0; i < whole.size(); ++i) EXPECT_TRUE(torch::equal(whole[i], parts[i])) << "step " << step << ", tensor " << i;
  }
  EXPECT_TRUE(torch::equal(a.step_count(whole[0]), b.step_count(parts[0])));
}

// train.host_reads = deferred: a step whose found_inf is 1 leaves parameters, moments and the saved step count
// as they were, so a run that skipped step 2 on the device equals one that never called step() for it.
TEST(FusedAdamW, AStepSkippedOnTheDeviceIsAsIfNotTaken) {
  torch::manual_seed(5);
  std::vector<torch::Tensor> skipping = {torch::randn({6, 4}), torch::randn({4})}, plain = {torch::randn({6, 4}), torch::randn({4})};
  for (size_t i = 0; i < plain.size(); ++i) plain[i].data().copy_(skipping[i].data()), plain[i].requires_grad_(), skipping[i].requires_grad_();
  auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  FusedAdamW a({torch::optim::OptimizerParamGroup(skipping)}, options), b({torch::optim::OptimizerParamGroup(plain)}, options);
  for (int step = 0; step < 4; ++step) {
    const bool bad = step == 1;
    for (size_t i = 0; i < plain.size(); ++i) {
      auto g = torch::randn(plain[i].sizes());
      skipping[i].mutable_grad() = bad ? torch::full_like(g, std::numeric_limits<float>::quiet_NaN()) : g.clone();
      plain[i].mutable_grad() = g.clone();
    }
    a.skip_when(torch::full({}, bad ? 1.0f : 0.0f));
    a.step();
    if (!bad) b.step();
    for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(skipping[i], plain[i])) << "step " << step << ", tensor " << i;
  }
  for (size_t i = 0; i < plain.size(); ++i) {
    const auto sa = get_param_state(a, skipping[i]), sb = get_param_state(b, plain[i]);
    EXPECT_TRUE(torch::equal(sa.at("exp_avg"), sb.at("exp_avg")));
    EXPECT_TRUE(torch::equal(sa.at("exp_avg_sq"), sb.at("exp_avg_sq")));
    EXPECT_EQ(sa.at("step").item<int64_t>(), 3);  // four calls, one skipped
    EXPECT_EQ(sb.at("step").item<int64_t>(), 3);
  }
}

}  // namespace
}  // namespace memtrain
