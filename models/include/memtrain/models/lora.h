// LoRA (Hu et al. 2021), laid out as Hugging Face peft makes it: beside a targeted linear map W (out, in),
// a trainable A (rank, in) and B (out, rank), registered on W's module as `lora_A` and `lora_B`, add
// B A dropout(x) alpha / rank to its output. A starts Kaiming-uniform (a = sqrt 5: bound 1 / sqrt(in)), B
// zero, so the first forward is the base model's.
//
//   auto adapted = memtrain::add_lora(*model, {.rank = 8, .alpha = 16, .targets = {"q_proj", "v_proj"}});
//   memtrain::freeze_all_but_lora(*model);
#pragma once

#include <torch/nn/modules/linear.h>

#include <string>
#include <vector>

#include "memtrain/models/model.h"

namespace memtrain {

struct LoraOptions {
  int64_t rank = 8;
  double alpha = 16;
  double dropout = 0.0;
  std::vector<std::string> targets;  // module names (the last part of the path): q_proj, c_attn, ...
};

// Adds adapters to every torch::nn::Linear of `model` whose name's last part is a target (parameters
// model.layers.0.self_attn.q_proj.lora_A, ...). Returns the adapted modules' paths. A target that names no
// Linear is a ConfigError listing the model's Linear names.
std::vector<std::string> add_lora(Model& model, const LoraOptions& options);
// Whether a parameter is an adapter's (its path has a lora_A / lora_B part).
bool is_lora_parameter(const std::string& name);
// Every parameter but the adapters stops training (requires_grad false). Returns how many were frozen.
int64_t freeze_all_but_lora(Model& model);
// train.freeze: every parameter whose whole name matches the ECMAScript regular expression stops training.
// Returns how many did; one that matches none or all of them is a ConfigError.
int64_t freeze_matching(Model& model, const std::string& pattern);

namespace detail {
// x W^T + b, plus the module's adapter if it has one: B (A dropout(x)) alpha / rank. Under tensor parallelism a
// column-parallel map's A is whole and its gradient summed over the group (each rank's B slice gives a part of it).
torch::Tensor linear(const torch::Tensor& x, torch::nn::LinearImpl& m);
// A row-parallel map (y: this rank's input features, tp null or of size 1: linear()): the partial products summed over
// the group (reduce-scattered over the tokens with sequence parallelism), then the whole bias; its adapter's A y
// (tokens, rank) is summed the same way before the whole B.
torch::Tensor row_parallel_linear(const torch::Tensor& y, torch::nn::LinearImpl& m, const TensorParallel* tp);
}  // namespace detail

}  // namespace memtrain
