#include "memtrain/models/resnet.h"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/pooling.h>

#include <sstream>

#include "memtrain/models/family.h"
#include "memtrain/core/error.h"

namespace memtrain {
namespace detail {

// Spatial size and MAC count, carried through construction.
struct ShapeTrace {
  int64_t size;
  double macs = 0;
  torch::nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride, int64_t pad) {
    size = (size + 2 * pad - k) / stride + 1;
    macs += static_cast<double>(in) * out * k * k * size * size;
    return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, k).stride(stride).padding(pad).bias(false));
  }
};

class ResidualUnit : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;

 protected:
  // The projection shortcut (1x1 conv + bn) when the shape changes, counted at the block's input size.
  void add_downsample(int64_t in, int64_t out, int64_t stride, int64_t in_size, ShapeTrace& trace) {
    if (stride == 1 && in == out) return;
    ShapeTrace side{in_size};
    downsample = register_module("downsample", torch::nn::Sequential(side.conv(in, out, 1, stride, 0),
                                                                     torch::nn::BatchNorm2d(out)));
    trace.macs += side.macs;
  }
  torch::Tensor shortcut(const torch::Tensor& x) { return downsample ? downsample->forward(x) : x; }
  torch::nn::Sequential downsample{nullptr};
};

// conv3x3 - bn - relu - conv3x3 - bn, plus the shortcut; relu.
class BasicBlock : public ResidualUnit {
 public:
  BasicBlock(int64_t in, int64_t out, int64_t stride, ShapeTrace& trace) {
    const auto in_size = trace.size;
    conv1 = register_module("conv1", trace.conv(in, out, 3, stride, 1));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(out));
    conv2 = register_module("conv2", trace.conv(out, out, 3, 1, 1));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(out));
    add_downsample(in, out, stride, in_size, trace);
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto y = torch::relu(bn1->forward(conv1->forward(x)));
    y = bn2->forward(conv2->forward(y));
    return torch::relu(y + shortcut(x));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
};

// conv1x1 - bn - relu - conv3x3(stride) - bn - relu - conv1x1 (x4) - bn, plus the shortcut; relu.
class Bottleneck : public ResidualUnit {
 public:
  static constexpr int64_t kExpansion = 4;
  Bottleneck(int64_t in, int64_t mid, int64_t stride, ShapeTrace& trace) {
    const auto in_size = trace.size;
    const auto out = mid * kExpansion;
    conv1 = register_module("conv1", trace.conv(in, mid, 1, 1, 0));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(mid));
    conv2 = register_module("conv2", trace.conv(mid, mid, 3, stride, 1));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(mid));
    conv3 = register_module("conv3", trace.conv(mid, out, 1, 1, 0));
    bn3 = register_module("bn3", torch::nn::BatchNorm2d(out));
    add_downsample(in, out, stride, in_size, trace);
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto y = torch::relu(bn1->forward(conv1->forward(x)));
    y = torch::relu(bn2->forward(conv2->forward(y)));
    y = bn3->forward(conv3->forward(y));
    return torch::relu(y + shortcut(x));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
};

}  // namespace detail

ResNet::ResNet(const ResNetOptions& options) : options_(options) {
  const auto& o = options_;
  MEMTRAIN_CHECK(o.depth == 18 || o.depth == 50, Error, "[model] ResNet depth must be 18 or 50, got ", o.depth);
  MEMTRAIN_CHECK(o.stem == "small" || o.stem == "imagenet", Error, "[model] ResNet stem must be small or imagenet, got '",
                 o.stem, "'");
  detail::ShapeTrace trace{o.image_size};
  stem_ = torch::nn::Sequential();
  if (o.stem == "imagenet") {
    stem_->push_back(trace.conv(o.in_channels, o.width, 7, 2, 3));
    stem_->push_back(torch::nn::BatchNorm2d(o.width));
    stem_->push_back(torch::nn::ReLU());
    stem_->push_back(torch::nn::MaxPool2d(torch::nn::MaxPool2dOptions(3).stride(2).padding(1)));
    trace.size = (trace.size + 2 - 3) / 2 + 1;
  } else {
    stem_->push_back(trace.conv(o.in_channels, o.width, 3, 1, 1));
    stem_->push_back(torch::nn::BatchNorm2d(o.width));
    stem_->push_back(torch::nn::ReLU());
  }
  register_module("stem", stem_);

  const bool bottleneck = o.depth == 50;
  const std::vector<int64_t> counts = bottleneck ? std::vector<int64_t>{3, 4, 6, 3} : std::vector<int64_t>{2, 2, 2, 2};
  int64_t in = o.width;
  for (size_t stage = 0; stage < counts.size(); ++stage) {
    const int64_t planes = o.width << stage;
    auto layer = register_module("layer" + std::to_string(stage + 1), torch::nn::ModuleList());
    for (int64_t j = 0; j < counts[stage]; ++j) {
      const int64_t stride = (stage > 0 && j == 0) ? 2 : 1;
      std::shared_ptr<detail::ResidualUnit> unit;
      if (bottleneck) {
        unit = std::make_shared<detail::Bottleneck>(in, planes, stride, trace);
        in = planes * detail::Bottleneck::kExpansion;
      } else {
        unit = std::make_shared<detail::BasicBlock>(in, planes, stride, trace);
        in = planes;
      }
      layer->push_back(unit);
      blocks_.push_back(unit);
    }
  }
  fc_ = register_module("fc", torch::nn::Linear(in, o.num_classes));
  forward_macs_ = trace.macs + static_cast<double>(in) * o.num_classes;
}

torch::Tensor ResNet::embed(const torch::Tensor& images) { return stem_->forward(images); }

torch::Tensor ResNet::block_part(int64_t i, size_t, const torch::Tensor& h) { return blocks_[i]->forward(h); }

std::vector<torch::Tensor> ResNet::block_parameters(int64_t i) const { return blocks_[i]->parameters(); }

torch::Tensor ResNet::head(const torch::Tensor& h) { return detail::linear(h.mean({2, 3}), fc_->weight, fc_->bias); }

std::string ResNet::describe() const {
  std::ostringstream os;
  os << "ResNet-" << options_.depth << " (width " << options_.width << ", " << options_.stem << " stem, "
     << options_.image_size << "x" << options_.image_size << "x" << options_.in_channels << " -> "
     << options_.num_classes << "), " << num_parameters() << " parameters";
  return os.str();
}


const ModelFamily& resnet_family() {
  static const ModelFamily family{
      .config = {.name = "resnet", .keys = "resnet"},
      .build = [](const ModelConfig& c, const DataInfo& data, const ParameterBuild&) -> std::shared_ptr<Model> {
        ResNetOptions o;
        o.depth = c.depth, o.width = c.width, o.stem = c.stem;
        o.in_channels = data.channels, o.num_classes = data.num_classes, o.image_size = data.image_size;
        return std::make_shared<ResNet>(o);
      },
  };
  return family;
}

}  // namespace memtrain
