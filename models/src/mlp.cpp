#include "memtrain/models/mlp.h"

#include <sstream>

#include "memtrain/models/family.h"
#include "memtrain/core/error.h"

namespace memtrain {

MLP::MLP(const MLPOptions& options) : options_(options) {
  MEMTRAIN_CHECK(!options_.hidden.empty(), Error, "[model] MLP needs at least one hidden layer");
  int64_t in = options_.in_features;
  for (size_t i = 0; i < options_.hidden.size(); ++i) {
    layers_.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(in, options_.hidden[i])));
    in = options_.hidden[i];
  }
  out_ = register_module("out", torch::nn::Linear(in, options_.num_classes));
}

double MLP::train_flops_per_sample() const {
  double macs = 0;
  int64_t in = options_.in_features;
  for (auto h : options_.hidden) macs += static_cast<double>(in) * h, in = h;
  macs += static_cast<double>(in) * options_.num_classes;
  return 6.0 * macs;
}

std::string MLP::describe() const {
  std::ostringstream os;
  os << "MLP " << options_.in_features;
  for (auto h : options_.hidden) os << "-" << h;
  os << "-" << options_.num_classes << ", " << num_parameters() << " parameters";
  return os.str();
}


const ModelFamily& mlp_family() {
  static const ModelFamily family{
      .config = {.name = "mlp", .keys = "mlp"},
      .build = [](const ModelConfig& c, const DataInfo& data, const ParameterBuild&) -> std::shared_ptr<Model> {
        MLPOptions o;
        o.in_features = data.channels * data.image_size * data.image_size;
        o.num_classes = data.num_classes;
        o.hidden.clear();
        std::stringstream ss(c.hidden);
        for (std::string item; std::getline(ss, item, ',');) o.hidden.push_back(std::stoll(item));
        return std::make_shared<MLP>(o);
      },
  };
  return family;
}

}  // namespace memtrain
