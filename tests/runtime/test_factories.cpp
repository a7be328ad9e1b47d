#include <gtest/gtest.h>

#include "helpers.h"
#include "memtrain/core/error.h"
#include "memtrain/models/family.h"
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
                                                     {"llama", 4 * 16 * 16 + 3 * 16 * 64 + 2 * 16 + 2 * 256 * 16 + 16},
                                                     // Phi-3: Llama's blocks (its fused projections are storage).
                                                     {"phi3", 4 * 16 * 16 + 3 * 16 * 64 + 2 * 16 + 2 * 256 * 16 + 16}};
  for (const auto* family : model_families()) {
    const auto& name = family->config.name;
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
    if (family->reads_tokens) {
      EXPECT_EQ(model->forward(torch::zeros({2, 8}, torch::kLong)).sizes(), (std::vector<int64_t>{2, 8, 256}));
    } else {
      EXPECT_EQ(model->forward(torch::zeros({2, 1, 28, 28})).sizes(), (std::vector<int64_t>{2, 10}));
    }
  }
}

// The families registered (models/family.h) are the names the config accepts, each once; a family that gives no
// shape is never estimated in closed form (a name the registry reads as a language model is not costed as another).
TEST(Factories, EveryModelNameIsOneRegisteredFamily) {
  std::vector<std::string> registered;
  for (const auto* f : model_families()) registered.push_back(f->config.name);
  std::vector<std::string> accepted;
  for (const auto* f : family_configs()) accepted.push_back(f->name);
  EXPECT_EQ(registered, accepted);
  EXPECT_EQ(registered, (std::vector<std::string>{"gpt", "llama", "resnet", "mlp", "phi3"}));
  EXPECT_THROW(model_family("gemma"), ConfigError);
  EXPECT_NE(test::error_of([] { model_family("gemma"); }).find("expected gpt | llama | resnet | mlp | phi3"), std::string::npos);
  EXPECT_NE(test::error_of([] { Config::load("", {"--model.name=gemma"}); })
                .find("model.name = 'gemma' is not allowed; expected one of: gpt | llama | resnet | mlp | phi3"),
            std::string::npos);
  for (const auto* f : model_families()) {
    SCOPED_TRACE(f->config.name);
    EXPECT_TRUE(f->build);
    // The closed form's shape and its tensor list come together, and only for models that read tokens.
    EXPECT_EQ(static_cast<bool>(f->shape), static_cast<bool>(f->tensors));
    if (f->shape) {
      EXPECT_TRUE(f->reads_tokens);
    }
  }
  // An image model asked for a closed form: an error naming the families that have one.
  Config c;
  c.model.name = "resnet";
  EXPECT_NE(test::error_of([&] { config_transformer_shape(c); }).find("has no closed form (gpt, llama and phi3 do)"), std::string::npos);
  EXPECT_NE(test::error_of([&] { model_state_inputs(c, 1); }).find("--target estimates gpt, llama and phi3 without building them"),
            std::string::npos);
  // Each family's tensors by shape are its built model's parameters (a Llama with GQA and biases, a GPT without).
  for (const auto& [name, extra] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"gpt", {"--model.bias=false"}}, {"llama", {"--model.n_kv_head=2", "--model.attn_bias=qkv"}}, {"phi3", {"--model.n_kv_head=2"}}}) {
    SCOPED_TRACE(name);
    auto args = extra;
    args.insert(args.end(), {"--model.name=" + name, "--model.n_layer=2", "--model.n_head=4", "--model.n_embd=32",
                             "--model.block_size=16", "--model.vocab_size=300"});
    const auto config = Config::load("", args);
    const auto t = model_family(name).tensors(config.model, 300);
    int64_t total = 0;
    for (auto n : t.block) total += n * t.layers;
    for (auto n : t.root) total += n;
    EXPECT_EQ(total, make_model(config.model, DataInfo{.vocab_size = 300})->num_parameters());
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
    } else if (name == "chat") {  // set-up's Austen records, in its 8,192-entry BPE vocabulary, packed
      EXPECT_EQ(data->info().vocab_size, 8192);
      EXPECT_EQ(b.input.sizes(), (std::vector<int64_t>{2, c.model.block_size}));
      EXPECT_LT(b.input.max().item<int64_t>(), 8192);
      EXPECT_EQ(b.positions.sizes(), b.input.sizes());
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
