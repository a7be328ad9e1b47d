// The baseline for memtrain's overhead: a hand-written LibTorch training loop on the same model, data
// and optimizer as a memtrain config, with none of the trainer (no tracker, no phases, no policy).
//
//   memtrain_bare_loop --config X.ini [--section.key=value ...]
// Prints one JSON line per step: {"step", "ms", "loss"} (loss read only at the end).
#include <torch/cuda.h>

#include <chrono>
#include <iostream>

#include "memtrain/core/config.h"
#include "memtrain/core/cpu_memory.h"
#include "memtrain/core/error.h"
#include "memtrain/runtime/factories.h"
#include "memtrain/runtime/precision.h"

int main(int argc, char** argv) {
  // The same host-allocator settings as the memtrain binary, so that the comparison is of the loops.
  memtrain::cpu_memory::keep_freed_memory();
  std::string path;
  std::vector<std::string> overrides;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--config" && i + 1 < argc) path = argv[++i];
    else overrides.push_back(a);
  }
  try {
    auto c = memtrain::Config::load(path, overrides);
    if (c.train.threads > 0) at::set_num_threads(static_cast<int>(c.train.threads));
    auto data = memtrain::make_dataset(c, {});
    torch::manual_seed(static_cast<uint64_t>(c.train.seed));
    auto model = memtrain::make_model(c.model, data->info());
    const c10::Device device = c.train.device == "cuda" ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
    model->to(device);
    auto opt = memtrain::make_optimizer(memtrain::optimizer_options(c.train), model->named_parameters());
    const auto dtype = memtrain::autocast_dtype(memtrain::parse_precision(c.train.precision));
    std::vector<torch::Tensor> params = model->parameters();
    torch::Tensor loss;
    for (int64_t step = 0; step < c.train.steps; ++step) {
      auto t0 = std::chrono::steady_clock::now();
      opt->zero_grad(true);
      for (int64_t micro = 0; micro < c.train.accum_steps; ++micro) {
        auto b = data->train_batch(step, micro, c.train.micro_batch);
        auto x = b.input.to(device, true), y = b.target.to(device, true);
        {
          memtrain::AutocastGuard autocast(device.type(), dtype);
          loss = model->loss(model->forward(x), y) / static_cast<double>(c.train.accum_steps);
        }
        loss.backward();
      }
      if (c.train.grad_clip > 0) torch::nn::utils::clip_grad_norm_(params, c.train.grad_clip);
      opt->step();
      if (device.is_cuda()) torch::cuda::synchronize();
      auto ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      std::cout << "{\"step\": " << step + 1 << ", \"ms\": " << ms << "}\n";
    }
    std::cout << "{\"final_loss\": " << loss.item<double>() * static_cast<double>(c.train.accum_steps) << "}\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "memtrain_bare_loop: " << e.what() << "\n";
    return 1;
  }
}
