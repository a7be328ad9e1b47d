#include <gtest/gtest.h>

#include "helpers.h"
#include "memtrain/core/error.h"
#include "memtrain/runtime/factories.h"

#include <map>

namespace memtrain {
namespace {

// One table of allowed values: every value the validator accepts, the factory builds, and builds right.
TEST(Factories, EveryModelNameIsBuilt) {
  // Parameters by arithmetic for the shapes below: the GPT (L = 1, C = 16, T = 8, V = 256) has a block of
  // 12 C^2 + 13 C, the tied token embedding V C, positions T C and the final LayerNorm 2 C; the MLP
  // (784 -> 8 -> 10) 784 x 8 + 8 and 8 x 10 + 10. ResNet's count has no short formula: its output shape is checked.
  const std::map<std::string, int64_t> parameters = {{"gpt", 12 * 16 * 16 + 13 * 16 + 256 * 16 + 8 * 16 + 2 * 16},
                                                     {"mlp", 784 * 8 + 8 + 8 * 10 + 10},
                                                     // Llama (L = 1, C = 16, kv heads = heads, MLP 8/3 C rounded up to
                                                     // 64): q k v o 4 C^2, SwiGLU 3 C 64, two norms 2 C, untied
                                                     // embedding and head 2 V C, final norm C.
                                                     {"llama", 4 * 16 * 16 + 3 * 16 * 64 + 2 * 16 + 2 * 256 * 16 + 16}};
  for (auto name : choices::model_name) {
    SCOPED_TRACE(std::string(name));
    ModelConfig m;
    m.name = std::string(name);
    m.n_layer = 1, m.n_embd = 16, m.n_head = 2, m.block_size = 8, m.width = 4;
    m.hidden.assign(1, '8');  // not `= "8"`: GCC 12 warns of a memcpy bound there (-Wstringop-overflow, a false positive)
    std::shared_ptr<Model> model;
    ASSERT_NO_THROW(model = make_model(m, DataInfo{.vocab_size = 256}));
    if (parameters.count(m.name)) {
      EXPECT_EQ(model->num_parameters(), parameters.at(m.name));
    }
    // Logits over the vocabulary per token, or over the 10 classes per image.
    torch::NoGradGuard no_grad;
    if (name == "gpt" || name == "llama") {
      EXPECT_EQ(model->forward(torch::zeros({2, 8}, torch::kLong)).sizes(), (std::vector<int64_t>{2, 8, 256}));
    } else {
      EXPECT_EQ(model->forward(torch::zeros({2, 1, 28, 28})).sizes(), (std::vector<int64_t>{2, 10}));
    }
  }
}

TEST(Factories, EveryDatasetIsBuiltForAModelItFits) {
  for (auto name : choices::dataset) {
    SCOPED_TRACE(std::string(name));
    Config c;
    c.data.dataset = std::string(name);
    c.model.name = name == "fashion_mnist" ? "mlp" : "gpt";
    std::unique_ptr<Dataset> data;
    ASSERT_NO_THROW(data = make_dataset(c, {}));
    auto b = data->train_batch(0, 0, 2);
    if (name == "fashion_mnist") {  // 10 classes of 1 x 28 x 28 images
      EXPECT_EQ(data->info().num_classes, 10);
      EXPECT_EQ(b.input.sizes(), (std::vector<int64_t>{2, 1, 28, 28}));
    } else {  // the byte-level text and the synthetic tokens: a vocabulary of the 256 byte values
      EXPECT_EQ(data->info().vocab_size, 256);
      EXPECT_EQ(b.input.sizes(), (std::vector<int64_t>{2, c.model.block_size}));
      EXPECT_LT(b.input.max().item<int64_t>(), 256);
    }
  }
}

TEST(Factories, EveryOptimizerIsBuilt) {
  // One step on a gradient of ones moves every weight down (lr > 0; weight decay only adds to that on
  // positive weights).
  for (auto name : choices::optimizer) {
    SCOPED_TRACE(std::string(name));
    torch::nn::Linear lin(2, 2);
    torch::NoGradGuard no_grad;
    for (auto& p : lin->parameters()) p.fill_(0.5);
    TrainOptions t;
    t.optimizer = std::string(name);
    std::unique_ptr<torch::optim::Optimizer> opt;
    ASSERT_NO_THROW(opt = make_optimizer(optimizer_options(t), lin->named_parameters()));
    for (auto& p : lin->parameters()) p.mutable_grad() = torch::ones_like(p);
    opt->step();
    for (auto& p : lin->parameters()) EXPECT_TRUE((p < 0.5).all().item<bool>()) << p;
  }
  TrainOptions bad;
  bad.optimizer = "lamb";  // not in the table: the validator refuses it, and so does the factory
  EXPECT_THROW(optimizer_options(bad), Error);
}

}  // namespace
}  // namespace memtrain
