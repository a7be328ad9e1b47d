// Shared test helpers: configs for small runs, fixture access, tensor comparison.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "memtrain/config.h"
#include "memtrain/data/safetensors.h"
#include "test_paths.h"

namespace memtrain::test {

inline std::string fixture(const std::string& name) { return std::string(MEMTRAIN_FIXTURES) + "/" + name; }
inline std::string source(const std::string& rel) { return std::string(MEMTRAIN_SOURCE_DIR) + "/" + rel; }

// A small byte-level GPT on synthetic tokens: fast, no data files.
inline Config tiny_gpt_config(int64_t layers = 2) {
  Config c;
  c.model.name = "gpt";
  c.model.n_layer = layers;
  c.model.n_head = 2;
  c.model.n_embd = 32;
  c.model.block_size = 32;
  c.data.dataset = "synthetic";
  c.train.steps = 10;
  c.train.micro_batch = 4;
  c.train.warmup_steps = 2;
  c.train.eval_every = 0;
  c.log.dir = (std::filesystem::temp_directory_path() / "memtrain-tests").string();
  return c;
}

// A file under a fresh temporary folder, removed with the object.
class TempDir {
 public:
  TempDir() {
    path_ = std::filesystem::temp_directory_path() /
            ("memtrain-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string file(const std::string& name, const std::string& contents) const {
    auto p = (path_ / name).string();
    std::ofstream(p) << contents;
    return p;
  }
  std::string path(const std::string& name = "") const { return (path_ / name).string(); }

 private:
  static int& counter() {
    static int n = 0;
    return n;
  }
  std::filesystem::path path_;
};

// max |a - b| / (max |b| + tiny): a scale-free distance for comparing gradients.
inline double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  auto fa = a.to(torch::kDouble), fb = b.to(torch::kDouble);
  return (fa - fb).abs().max().item<double>() / (fb.abs().max().item<double>() + 1e-12);
}

template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no exception>";
}

}  // namespace memtrain::test
