#include "memtrain/models/module_model.h"

#include <sstream>

#include "memtrain/core/error.h"

namespace memtrain {

namespace {
std::vector<torch::nn::AnyModule> children_of(const torch::nn::Sequential& seq) {
  MEMTRAIN_CHECK(!seq.is_empty(), Error, "[model] ModuleModel: the Sequential is a null handle");
  return std::vector<torch::nn::AnyModule>(seq->begin(), seq->end());
}
}  // namespace

ModuleModel::ModuleModel(torch::nn::Sequential blocks, ModuleModelOptions options)
    : ModuleModel(torch::nn::AnyModule(), children_of(blocks), torch::nn::AnyModule(), std::move(options)) {}

ModuleModel::ModuleModel(torch::nn::AnyModule stem, std::vector<torch::nn::AnyModule> blocks, torch::nn::AnyModule head,
                         ModuleModelOptions options)
    : options_(std::move(options)), stem_(std::move(stem)), head_(std::move(head)), blocks_(std::move(blocks)) {
  MEMTRAIN_CHECK(!blocks_.empty(), Error, "[model] ModuleModel needs at least one block");
  MEMTRAIN_CHECK(options_.train_flops_per_sample >= 0, Error,
                 "[model] ModuleModel: train_flops_per_sample must be >= 0 (0 = unknown), got ",
                 options_.train_flops_per_sample);
  MEMTRAIN_CHECK(options_.tokens_per_sample >= 1, Error, "[model] ModuleModel: tokens_per_sample must be >= 1, got ",
                 options_.tokens_per_sample);
  if (!stem_.is_empty()) register_module("stem", stem_.ptr());
  auto list = register_module("blocks", torch::nn::ModuleList());
  for (size_t i = 0; i < blocks_.size(); ++i) {
    MEMTRAIN_CHECK(!blocks_[i].is_empty(), Error, "[model] ModuleModel: block ", i, " is empty");
    list->push_back(blocks_[i].ptr());
  }
  if (!head_.is_empty()) register_module("head", head_.ptr());
}

torch::Tensor ModuleModel::embed(const torch::Tensor& input) {
  return stem_.is_empty() ? input : stem_.forward(input);
}

torch::Tensor ModuleModel::block_part(int64_t i, size_t, const torch::Tensor& h) { return blocks_[i].forward(h); }

std::vector<torch::Tensor> ModuleModel::block_parameters(int64_t i) const { return blocks_[i].ptr()->parameters(); }

torch::Tensor ModuleModel::head(const torch::Tensor& h) { return head_.is_empty() ? h : head_.forward(h); }

torch::Tensor ModuleModel::loss(const torch::Tensor& output, const torch::Tensor& target) const {
  return options_.loss ? options_.loss(output, target) : Model::loss(output, target);
}

std::string ModuleModel::describe() const {
  std::ostringstream os;
  os << options_.name << ": " << (stem_.is_empty() ? "" : "stem, ") << blocks_.size() << " blocks"
     << (head_.is_empty() ? "" : ", head") << ", " << num_parameters() << " parameters";
  return os.str();
}

}  // namespace memtrain
