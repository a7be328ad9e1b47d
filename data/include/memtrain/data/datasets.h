// Datasets: real text (byte-level), Fashion-MNIST, or synthetic batches. Every training batch is a
// pure function of (seed, step, micro-batch, rank): runs repeat exactly, ranks see disjoint samples,
// and a resumed run sees the same data it would have seen.
//
//   auto data = memtrain::make_text_dataset({.path = "austen.txt", .block_size = 128}, {.rank = 0, .world = 1});
//   memtrain::Batch b = data->train_batch(step, micro, cfg.train.micro_batch);
#pragma once

#include <torch/types.h>

#include <memory>
#include <string>
#include <vector>

#include "memtrain/core/data_info.h"

namespace memtrain {

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
  // Bytes of data this dataset holds in memory (the MemoryTracker's "data" column); 0 if it streams.
  virtual int64_t resident_bytes() const { return 0; }
  // The micro-batches per step changed and the global batch did not (the memory planner): a dataset that
  // draws the global batch once per step lays it out for the new count, so the samples stay the same.
  virtual void set_accum_steps(int64_t accum_steps) {}
};

// The prepared-data folder: $MEMTRAIN_DATA if set, else the one the build was configured with.
std::string default_data_dir();

// Language modelling, windows of block_size + 1 tokens: byte-level on a text file (vocabulary 256), or
// on a token file, memory-mapped (llm.c's .bin: a 256 x int32 header with magic 20240520, version 1 =
// uint16 / 2 = uint32 tokens, the count; or headerless uint16, nanoGPT's). Bad token files are
// DataErrors: wrong magic or version, a count that does not match the size, an id >= the vocabulary.
struct TextDataOptions {
  std::string path;             // the corpus (byte-level); see default_data_dir() for the prepared one
  std::string tokens;           // a token file instead of path's bytes ("" = byte-level)
  std::string val_tokens;       // its validation tokens ("" = the tail val_fraction of `tokens`)
  std::string token_format = "llmc";  // llmc | raw
  int64_t vocab_size = 0;       // token files: 0 = from the llm.c header's slot 3 (memtrain's files)
  int64_t block_size = 128;     // tokens per sample
  double val_fraction = 0.1;    // the tail held out for validation
  int64_t seed = 1337;
  int64_t accum_steps = 1;      // micro-batches per step: the global batch is drawn once per step
};
std::unique_ptr<Dataset> make_text_dataset(const TextDataOptions& options, const Shard& shard);

// Fashion-MNIST from its four gunzipped IDX files (train 60,000 and t10k 10,000 images, 28 x 28).
struct FashionMnistOptions {
  std::string root;             // folder with the four files
  double val_fraction = 0.1;
  int64_t seed = 1337;
  int64_t accum_steps = 1;
};
std::unique_ptr<Dataset> make_fashion_mnist(const FashionMnistOptions& options, const Shard& shard);

// Random tokens (text = true) or images of a given shape: for benchmarks and tests, where loading
// must not count.
struct SyntheticDataOptions {
  bool text = true;
  int64_t block_size = 128;     // text: tokens per sample
  DataInfo info{.vocab_size = 256};  // text: vocab_size; images: channels, image_size, num_classes
  int64_t seed = 1337;
};
std::unique_ptr<Dataset> make_synthetic_dataset(const SyntheticDataOptions& options, const Shard& shard);

}  // namespace memtrain
