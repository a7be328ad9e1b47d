// ModuleModel: an ordinary LibTorch module trained by memtrain as it is, without rewriting it as a
// memtrain::Model subclass. Either a torch::nn::Sequential, each child a block (the unit that
// checkpointing recomputes and ZeRO-3 will gather), or a stem / blocks / head triple of any modules
// whose forward takes and returns one Tensor.
//
//   torch::nn::Sequential net(torch::nn::Linear(784, 256), torch::nn::ReLU(), torch::nn::Linear(256, 10));
//   auto model = std::make_shared<memtrain::ModuleModel>(net);         // 3 blocks, cross-entropy loss
//
//   auto model = std::make_shared<memtrain::ModuleModel>(
//       torch::nn::AnyModule(stem), std::vector<torch::nn::AnyModule>{...}, torch::nn::AnyModule(head),
//       memtrain::ModuleModelOptions{.loss = my_loss, .train_flops_per_sample = 6 * macs});
//
// The modules are shared, not copied: the caller's handles see the trained weights. Parameter names
// are stem.*, blocks.<i>.* and head.*.
#pragma once

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>

#include "memtrain/models/model.h"

namespace memtrain {

struct ModuleModelOptions {
  // loss(output, target); empty: mean cross-entropy over the last dimension (Model::loss).
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss;
  double train_flops_per_sample = 0;  // 0: unknown, and no FLOP/s or MFU is reported
  int64_t tokens_per_sample = 1;      // for tokens/s of sequence models
  std::string name = "module";        // in the start-up line
};

class ModuleModel : public Model {
 public:
  explicit ModuleModel(torch::nn::Sequential blocks, ModuleModelOptions options = {});
  // stem and head may be empty AnyModules (identity); blocks must not be empty.
  ModuleModel(torch::nn::AnyModule stem, std::vector<torch::nn::AnyModule> blocks, torch::nn::AnyModule head,
              ModuleModelOptions options = {});

  torch::Tensor embed(const torch::Tensor& input) override;
  int64_t num_blocks() const override { return static_cast<int64_t>(blocks_.size()); }
  torch::Tensor block_part(int64_t i, size_t part, const torch::Tensor& h) override;
  std::vector<torch::Tensor> block_parameters(int64_t i) const override;
  torch::Tensor head(const torch::Tensor& h) override;
  torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target) const override;
  double train_flops_per_sample() const override { return options_.train_flops_per_sample; }
  int64_t tokens_per_sample() const override { return options_.tokens_per_sample; }
  std::string describe() const override;

 private:
  ModuleModelOptions options_;
  torch::nn::AnyModule stem_, head_;            // empty: identity
  std::vector<torch::nn::AnyModule> blocks_;    // registered as blocks.<i>
};

}  // namespace memtrain
