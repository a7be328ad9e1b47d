#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include <filesystem>
#include <fstream>

#include "helpers.h"
#include "memtrain/core/error.h"
#include "memtrain/data/datasets.h"
#include "memtrain/models/module_model.h"
#include "memtrain/runtime/recompute.h"
#include "memtrain/runtime/trainer.h"

namespace memtrain {
namespace {

torch::nn::Sequential small_net() {
  return torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(784, 32), torch::nn::ReLU(),
                               torch::nn::Linear(32, 10));
}

TEST(ModuleModel, SequentialChildrenAreBlocksSharingTheCallersModules) {
  torch::manual_seed(0);
  auto net = small_net();
  ModuleModel model(net);
  EXPECT_EQ(model.num_blocks(), 4);
  auto names = model.named_parameters().keys();
  EXPECT_EQ(names, (std::vector<std::string>{"blocks.1.weight", "blocks.1.bias", "blocks.3.weight", "blocks.3.bias"}));
  EXPECT_TRUE(model.block_parameters(1)[0].is_same(net[1]->as<torch::nn::Linear>()->weight));
  EXPECT_TRUE(model.block_parameters(0).empty());
  auto x = torch::randn({5, 1, 28, 28});
  EXPECT_TRUE(torch::equal(model.forward(x), net->forward(x)));  // the same modules, in the same order
  EXPECT_EQ(model.train_flops_per_sample(), 0);                   // unknown unless given
}

TEST(ModuleModel, CheckpointedBlocksGiveTheSameGradients) {
  torch::manual_seed(0);
  ModuleModel model(small_net());
  auto x = torch::randn({6, 1, 28, 28});
  auto y = torch::randint(0, 10, {6}, torch::kLong);
  auto grads = [&](const std::string& policy) {
    model.zero_grad(true);
    model.loss(forward_with_checkpointing(model, x, RecomputePolicy::parse(policy)), y).backward();
    std::vector<torch::Tensor> g;
    for (const auto& p : model.parameters()) g.push_back(p.grad().clone());
    return g;
  };
  const auto plain = grads("none");
  const auto before = checkpoint_recompute_count();
  const auto ckpt = grads("all");
  EXPECT_EQ(checkpoint_recompute_count() - before, 3);  // Flatten has no parameters and takes no grad input
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_LT(test::relative_error(ckpt[i], plain[i]), 1e-6) << i;
}

TEST(ModuleModel, StemBlocksHeadWithOwnLossAndFlops) {
  torch::manual_seed(0);
  torch::nn::Linear stem(3, 8), head(8, 1);
  std::vector<torch::nn::AnyModule> blocks{torch::nn::AnyModule(torch::nn::Linear(8, 8)),
                                           torch::nn::AnyModule(torch::nn::Tanh())};
  auto mse = [](const torch::Tensor& out, const torch::Tensor& target) { return (out.squeeze(1) - target).pow(2).mean(); };
  ModuleModel model(torch::nn::AnyModule(stem), blocks, torch::nn::AnyModule(head),
                    {.loss = mse, .train_flops_per_sample = 1234, .name = "regressor"});
  auto x = torch::randn({4, 3}), y = torch::randn({4});
  auto expected = head->forward(torch::tanh(blocks[0].forward(stem->forward(x))));
  EXPECT_TRUE(torch::allclose(model.forward(x), expected));
  EXPECT_NEAR(model.loss(model.forward(x), y).item<double>(), (expected.squeeze(1) - y).pow(2).mean().item<double>(),
              1e-6);
  EXPECT_EQ(model.train_flops_per_sample(), 1234);
  EXPECT_NE(model.describe().find("regressor: stem, 2 blocks, head"), std::string::npos) << model.describe();
  EXPECT_THROW(ModuleModel(torch::nn::AnyModule(stem), {}, torch::nn::AnyModule(head)), Error);
}

TEST(ModuleModel, TrainerTrainsAWrappedSequentialAndReportsNoFlopsWhenUnknown) {
  auto c = test::tiny_gpt_config();
  c.model.name = "mlp";  // unused: the model is the application's
  c.memory.recompute = "all";
  c.train.accum_steps = 2;
  c.train.steps = 3;
  c.log.name = "module-model";
  c.checkpoint.save_final = false;
  std::shared_ptr<Dataset> data = make_synthetic_dataset({.text = false}, {});
  auto net = small_net();
  auto before = net[1]->as<torch::nn::Linear>()->weight.clone();
  Trainer t(c, std::make_shared<ModuleModel>(net), data);
  t.fit();
  EXPECT_FALSE(torch::equal(before, net[1]->as<torch::nn::Linear>()->weight));  // the caller's module trained
  std::ifstream metrics((std::filesystem::path(t.run_dir()) / "metrics.jsonl").string());
  std::string all((std::istreambuf_iterator<char>(metrics)), std::istreambuf_iterator<char>());
  EXPECT_NE(all.find("\"loss\""), std::string::npos);
  EXPECT_EQ(all.find("flops"), std::string::npos) << all;
}

}  // namespace
}  // namespace memtrain
