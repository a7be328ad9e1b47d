#include <gtest/gtest.h>

#include "helpers.h"
#include "memtrain/core/error.h"
#include "memtrain/runtime/factories.h"

namespace memtrain {
namespace {

// One table of allowed values: every value the validator accepts, the factory builds.
TEST(Factories, EveryModelNameIsBuilt) {
  for (auto name : choices::model_name) {
    SCOPED_TRACE(std::string(name));
    ModelConfig m;
    m.name = std::string(name);
    m.n_layer = 1, m.n_embd = 16, m.n_head = 2, m.block_size = 8, m.width = 4, m.hidden = "8";
    EXPECT_NO_THROW(make_model(m, DataInfo{.vocab_size = 256}));
  }
}

TEST(Factories, EveryDatasetIsBuiltForAModelItFits) {
  for (auto name : choices::dataset) {
    SCOPED_TRACE(std::string(name));
    Config c;
    c.data.dataset = std::string(name);
    c.model.name = name == "fashion_mnist" ? "mlp" : "gpt";
    EXPECT_NO_THROW(make_dataset(c, {}));
  }
}

TEST(Factories, EveryOptimizerIsBuilt) {
  torch::nn::Linear lin(2, 2);
  for (auto name : choices::optimizer) {
    SCOPED_TRACE(std::string(name));
    TrainOptions t;
    t.optimizer = std::string(name);
    EXPECT_NO_THROW(make_optimizer(optimizer_options(t), lin->named_parameters()));
  }
  TrainOptions bad;
  bad.optimizer = "lamb";  // not in the table: the validator refuses it, and so does the factory
  EXPECT_THROW(optimizer_options(bad), Error);
}

}  // namespace
}  // namespace memtrain
