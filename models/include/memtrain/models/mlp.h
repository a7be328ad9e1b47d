// MLP: flatten, then Linear + ReLU blocks, then a Linear classifier.
//
//   memtrain::MLP mlp({.in_features = 784, .hidden = {256, 128}, .num_classes = 10});
#pragma once

#include <torch/nn/modules/linear.h>

#include "memtrain/models/model.h"

namespace memtrain {

struct MLPOptions {
  int64_t in_features = 784;
  std::vector<int64_t> hidden = {256, 128};
  int64_t num_classes = 10;
};

class MLP : public Model {
 public:
  explicit MLP(const MLPOptions& options);
  torch::Tensor embed(const torch::Tensor& x) override { return x.flatten(1); }
  int64_t num_blocks() const override { return static_cast<int64_t>(layers_.size()); }
  torch::Tensor block_part(int64_t i, size_t, const torch::Tensor& h) override {
    return torch::relu(detail::linear(h, layers_[i]->weight, layers_[i]->bias));
  }
  std::vector<torch::Tensor> block_parameters(int64_t i) const override { return layers_[i]->parameters(); }
  torch::Tensor head(const torch::Tensor& h) override { return detail::linear(h, out_->weight, out_->bias); }
  double train_flops_per_sample() const override;
  std::string describe() const override;

 private:
  MLPOptions options_;
  std::vector<torch::nn::Linear> layers_;  // (in, hidden[i]), registered as fc{i}
  torch::nn::Linear out_{nullptr};         // (hidden.back(), classes)
};

}  // namespace memtrain
