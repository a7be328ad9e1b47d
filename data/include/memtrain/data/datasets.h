// Datasets: real text (byte-level), Fashion-MNIST, or synthetic batches. Every training batch is a
// pure function of (seed, step, micro-batch, rank): runs repeat exactly, ranks see disjoint samples,
// and a resumed run sees the same data it would have seen.
//
//   auto data = memtrain::make_dataset(cfg, {.rank = 0, .world = 1});
//   memtrain::Batch b = data->train_batch(step, micro, cfg.train.micro_batch);
#pragma once

#include <torch/types.h>

#include <memory>
#include <string>
#include <vector>

#include "memtrain/models/model.h"

namespace memtrain {

struct Config;

struct Batch {
  torch::Tensor input;   // text: (B, T) int64 tokens; images: (B, C, H, W) float
  torch::Tensor target;  // text: (B, T) int64 next tokens; images: (B,) int64 labels
};

struct Shard {
  int rank = 0;
  int world = 1;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual DataInfo info() const = 0;
  // Micro-batch `micro` of optimizer step `step`, this rank's part of the global batch.
  virtual Batch train_batch(int64_t step, int64_t micro, int64_t batch_size) = 0;
  // Held-out validation batches; the same on every call.
  virtual std::vector<Batch> val_batches(int64_t batch_size, int64_t max_batches) = 0;
  // A separate test split where the data has one (Fashion-MNIST's t10k); else empty.
  virtual std::vector<Batch> test_batches(int64_t batch_size) { return {}; }
  virtual std::string describe() const = 0;
};

// The prepared-data folder: $MEMTRAIN_DATA if set, else the one the build was configured with.
std::string default_data_dir();

std::unique_ptr<Dataset> make_dataset(const Config& config, const Shard& shard);

}  // namespace memtrain
