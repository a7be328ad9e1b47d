// ResNet-18/50 in torchvision's layout (v1.5: stride on the 3x3 conv; no conv biases), with two stems:
// "imagenet" (7x7/2 conv + 3x3/2 max-pool, for 224x224 inputs: the published nets) and "small"
// (one 3x3/1 conv, no pool: for 28x28 Fashion-MNIST images). `width` scales every stage (64 published).
//
//   memtrain::ResNet net({.depth = 18, .width = 16, .in_channels = 1, .num_classes = 10});
//   auto logits = net.forward(images);   // (B, 1, 28, 28) -> (B, 10)
#pragma once

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "memtrain/models/model.h"

namespace memtrain {
namespace detail {
class ResidualUnit;
}

struct ResNetOptions {
  int64_t depth = 18;  // 18 (basic blocks 2-2-2-2) | 50 (bottlenecks 3-4-6-3)
  int64_t width = 64;
  int64_t in_channels = 1;
  int64_t num_classes = 10;
  int64_t image_size = 28;
  std::string stem = "small";  // small | imagenet
};

class ResNet : public Model {
 public:
  explicit ResNet(const ResNetOptions& options);

  torch::Tensor embed(const torch::Tensor& images) override;
  int64_t num_blocks() const override { return static_cast<int64_t>(blocks_.size()); }
  torch::Tensor block_part(int64_t i, size_t part, const torch::Tensor& h) override;
  std::vector<torch::Tensor> block_parameters(int64_t i) const override;
  torch::Tensor head(const torch::Tensor& h) override;
  double train_flops_per_sample() const override { return 6.0 * forward_macs_; }  // 3 x (2 x MACs)
  std::string describe() const override;
  // Multiply-accumulates of one forward pass (convolutions and the classifier), counted while the
  // network is built from the spatial size at each layer.
  double forward_macs() const { return forward_macs_; }

 private:
  ResNetOptions options_;
  torch::nn::Sequential stem_{nullptr};
  std::vector<std::shared_ptr<detail::ResidualUnit>> blocks_;  // registered as layer{1-4}.{j}
  torch::nn::Linear fc_{nullptr};
  double forward_macs_ = 0;
};

}  // namespace memtrain
