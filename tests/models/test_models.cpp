#include <gtest/gtest.h>

#include "helpers.h"
#include "memtrain/core/error.h"
#include "memtrain/models/gpt.h"
#include "memtrain/models/mlp.h"
#include "memtrain/models/resnet.h"

namespace memtrain {
namespace {

// GPT-2 parameter count with tied embeddings: V C + T C + L (12 C^2 + 13 C) + 2 C
// (per block: qkv 3C^2+3C, proj C^2+C, fc 4C^2+4C, fc-proj 4C^2+C, two LayerNorms 4C; final LayerNorm 2C).
int64_t gpt_formula(int64_t V, int64_t T, int64_t L, int64_t C) { return V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C; }

TEST(GPT, Gpt2SmallHasThePublishedParameterCount) {
  GPT gpt(GPTOptions::preset("gpt2"));
  EXPECT_EQ(gpt.num_parameters(), 124439808);  // published: 124,439,808 (tied embeddings)
  EXPECT_EQ(gpt_formula(50257, 1024, 12, 768), 124439808);
}

TEST(GPT, LargerPresetsHaveThePublishedShapes) {
  // GPT-2 medium / large / XL: 24x16x1024, 36x20x1280, 48x25x1600 (Radford et al. 2019, table 2).
  auto m = GPTOptions::preset("gpt2-medium"), l = GPTOptions::preset("gpt2-large"), xl = GPTOptions::preset("gpt2-xl");
  EXPECT_EQ(std::make_tuple(m.n_layer, m.n_head, m.n_embd), std::make_tuple(24L, 16L, 1024L));
  EXPECT_EQ(std::make_tuple(l.n_layer, l.n_head, l.n_embd), std::make_tuple(36L, 20L, 1280L));
  EXPECT_EQ(std::make_tuple(xl.n_layer, xl.n_head, xl.n_embd), std::make_tuple(48L, 25L, 1600L));
}

TEST(GPT, ShapesBlocksAndFlops) {
  GPTOptions o;
  o.vocab_size = 100, o.block_size = 24, o.n_layer = 3, o.n_head = 4, o.n_embd = 48;
  GPT gpt(o);
  EXPECT_EQ(gpt.num_parameters(), gpt_formula(100, 24, 3, 48));
  auto idx = torch::randint(0, 100, {5, 24}, torch::kLong);
  EXPECT_EQ(gpt.forward(idx).sizes(), (std::vector<int64_t>{5, 24, 100}));
  EXPECT_EQ(gpt.forward(idx.slice(1, 0, 10)).sizes(), (std::vector<int64_t>{5, 10, 100}));
  EXPECT_EQ(gpt.num_blocks(), 3);
  EXPECT_EQ(gpt.part_names(), (std::vector<std::string>{"attn", "mlp"}));
  // forward == head(blocks(embed)) with blocks run part by part
  auto h = gpt.embed(idx);
  for (int64_t i = 0; i < 3; ++i) h = gpt.block_part(i, 1, gpt.block_part(i, 0, h));
  EXPECT_TRUE(torch::allclose(gpt.head(h), gpt.forward(idx)));
  // 6 N + 12 L C T per token, N without the position embedding (PaLM appendix B).
  const double n = static_cast<double>(gpt_formula(100, 24, 3, 48) - 24 * 48);
  EXPECT_DOUBLE_EQ(gpt.train_flops_per_token(), 6 * n + 12.0 * 3 * 48 * 24);
  EXPECT_DOUBLE_EQ(gpt.train_flops_per_sample(), gpt.train_flops_per_token() * 24);
  EXPECT_THROW(gpt.forward(torch::zeros({1, 25}, torch::kLong)), Error);
}

TEST(GPT, Gpt2FlopsPerToken) {
  // nanoGPT's estimate_mfu: 6 N + 12 L C T per token, N without the position embedding.
  GPTOptions o = GPTOptions::preset("gpt2");
  o.n_layer = 1;  // cheap to build: a 1-layer GPT-2-width model
  GPT one(o);
  const double n1 = static_cast<double>(gpt_formula(50257, 1024, 1, 768) - 1024 * 768);
  EXPECT_DOUBLE_EQ(one.train_flops_per_token(), 6 * n1 + 12.0 * 1 * 768 * 1024);
}

TEST(ResNet, PublishedParameterCounts) {
  // torchvision: resnet18 11,689,512; resnet50 25,557,032 (ImageNet: 3 x 224 x 224, 1000 classes).
  ResNet r18({.depth = 18, .width = 64, .in_channels = 3, .num_classes = 1000, .image_size = 224, .stem = "imagenet"});
  ResNet r50({.depth = 50, .width = 64, .in_channels = 3, .num_classes = 1000, .image_size = 224, .stem = "imagenet"});
  EXPECT_EQ(r18.num_parameters(), 11689512);
  EXPECT_EQ(r50.num_parameters(), 25557032);
  EXPECT_EQ(r18.num_blocks(), 8);
  EXPECT_EQ(r50.num_blocks(), 16);
  // torchvision's documented forward cost: 1.81 and 4.09 GMACs ("GFLOPS").
  EXPECT_NEAR(r18.forward_macs() / 1e9, 1.81, 0.02);
  EXPECT_NEAR(r50.forward_macs() / 1e9, 4.09, 0.03);
  EXPECT_DOUBLE_EQ(r18.train_flops_per_sample(), 6 * r18.forward_macs());
}

TEST(ResNet, SmallStemShapes) {
  ResNet net({.depth = 18, .width = 8, .in_channels = 1, .num_classes = 10, .image_size = 28, .stem = "small"});
  auto x = torch::randn({3, 1, 28, 28});
  EXPECT_EQ(net.forward(x).sizes(), (std::vector<int64_t>{3, 10}));
  EXPECT_EQ(net.embed(x).sizes(), (std::vector<int64_t>{3, 8, 28, 28}));
  ResNet deep({.depth = 50, .width = 4, .in_channels = 1, .num_classes = 10, .image_size = 28, .stem = "small"});
  EXPECT_EQ(deep.forward(x).sizes(), (std::vector<int64_t>{3, 10}));
}

TEST(MLP, ParametersShapesAndFlops) {
  MLP mlp({.in_features = 784, .hidden = {256, 128}, .num_classes = 10});
  EXPECT_EQ(mlp.num_parameters(), 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10);
  EXPECT_EQ(mlp.forward(torch::randn({2, 1, 28, 28})).sizes(), (std::vector<int64_t>{2, 10}));
  EXPECT_EQ(mlp.num_blocks(), 2);
  EXPECT_DOUBLE_EQ(mlp.train_flops_per_sample(), 6.0 * (784 * 256 + 256 * 128 + 128 * 10));
}

}  // namespace
}  // namespace memtrain
