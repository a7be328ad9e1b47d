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
  torch::Tensor target;  // text: (B, T) int64 next tokens (-100: no loss); images: (B,) int64 labels
  // Packed records (data.dataset = chat): each token's position within its record and its record's index in the row
  // (-1: padding); undefined for one stream per row.
  torch::Tensor positions;  // (B, T) int64
  torch::Tensor documents;  // (B, T) int64
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
  // Whether some targets carry no loss (-100): the step's loss is then the sum over trained tokens divided by their
  // count over the whole step (every micro-batch and rank), not a mean per micro-batch.
  virtual bool masks_targets() const { return false; }
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

// Chat and instruction records (issue 38), prepared by scripts/prepare_chat.py into a folder holding train.safetensors
// and val.safetensors, each with
//   tokens   (N,) int32   every record's token ids, one record after another (its chat template applied)
//   trained  (N,) uint8   1 where the token is one the loss trains on (the assistant's), else 0
//   offsets  (R + 1,) int64  record r is tokens [offsets[r], offsets[r + 1])
// Records are packed into rows of block_size (input, target) pairs, whole, in order (the training split shuffled by
// the seed once), a row closed when the next record does not fit; each token keeps its position within its record
// and its record's index in the row, so attention stays inside a record (models/packed.h). A target whose token is
// not trained, and padding, is -100. Bad files are DataErrors naming the file and what is wrong.
struct ChatDataOptions {
  std::string dir;              // the prepared folder
  int64_t vocab_size = 0;       // 0 = the files' metadata
  int64_t block_size = 128;     // pairs per row
  int64_t seed = 1337;
  int64_t accum_steps = 1;
  bool pack = true;             // false: one record per row, padded
};
std::unique_ptr<Dataset> make_chat_dataset(const ChatDataOptions& options, const Shard& shard);

}  // namespace memtrain
