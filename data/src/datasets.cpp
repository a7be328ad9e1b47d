#include "memtrain/data/datasets.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/data/datasets/mnist.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "memtrain/core/error.h"

namespace memtrain {
namespace {

namespace fs = std::filesystem;

// splitmix64: decorrelates (seed, step, micro) into a generator seed.
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

at::Generator batch_generator(int64_t seed, int64_t step, int64_t micro) {
  auto s = mix(mix(mix(static_cast<uint64_t>(seed)) ^ static_cast<uint64_t>(step)) ^ static_cast<uint64_t>(micro));
  return at::make_generator<at::CPUGeneratorImpl>(s);
}

// Byte-level language modelling on a text file: vocabulary of 256, windows of block_size + 1 bytes.
class TextDataset : public Dataset {
 public:
  TextDataset(const std::string& path, int64_t block_size, double val_fraction, int64_t seed, int64_t accum, Shard shard)
      : path_(path), block_(block_size), seed_(seed), accum_(accum), shard_(shard) {
    std::error_code ec;
    MEMTRAIN_CHECK(fs::is_regular_file(path, ec), DataError, "[data] text corpus '", path,
                   "' not found; run scripts/setup.sh to prepare it, or set data.path");
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto n = static_cast<int64_t>(bytes.size());
    const auto n_val = static_cast<int64_t>(static_cast<double>(n) * val_fraction);
    // The held-out part must hold at least one window per evaluation, the training part many.
    MEMTRAIN_CHECK(n - n_val > 2 * (block_ + 1) && (val_fraction == 0 || n_val > block_ + 1), DataError, "[data] '",
                   path, "' holds ", n, " bytes: too short for block_size ", block_, " with val_fraction ",
                   val_fraction);
    tokens_ = torch::empty({n}, torch::kUInt8);
    std::memcpy(tokens_.data_ptr(), bytes.data(), bytes.size());
    train_ = tokens_.slice(0, 0, n - n_val);
    val_ = tokens_.slice(0, n - n_val, n);
  }

  DataInfo info() const override {
    DataInfo d;
    d.vocab_size = 256;
    return d;
  }

  Batch train_batch(int64_t step, int64_t micro, int64_t batch_size) override {
    // One draw per optimizer step for the whole global batch, laid out [micro][rank][sample]: so
    // 4 x 8 micro-batches see exactly the samples of one 32-sample batch, and ranks are disjoint.
    auto gen = batch_generator(seed_, step, 0);
    const int64_t global = batch_size * shard_.world * accum_;
    const int64_t first = (micro * shard_.world + shard_.rank) * batch_size;
    // A window needs block_ + 1 bytes: starts in [0, n - block_ - 1], randint's high is exclusive.
    auto starts = torch::randint(0, train_.size(0) - block_, {global}, gen, torch::kLong)
                      .slice(0, first, first + batch_size);
    return windows(train_, starts);
  }

  std::vector<Batch> val_batches(int64_t batch_size, int64_t max_batches) override {
    // Non-overlapping windows from the start of the held-out text, dealt round-robin to ranks.
    const int64_t count = std::min((val_.size(0) - 1) / block_, batch_size * max_batches * shard_.world);
    auto starts = torch::arange(shard_.rank, count, shard_.world, torch::kLong) * block_;
    std::vector<Batch> out;
    for (int64_t b = 0; b < starts.size(0); b += batch_size) out.push_back(windows(val_, starts.slice(0, b, b + batch_size)));
    return out;
  }

  int64_t resident_bytes() const override { return static_cast<int64_t>(tokens_.nbytes()); }

  std::string describe() const override {
    std::ostringstream os;
    os << "text '" << path_ << "': " << tokens_.size(0) << " bytes (" << train_.size(0) << " train, " << val_.size(0)
       << " validation), byte-level, windows of " << block_;
    return os.str();
  }

 private:
  Batch windows(const torch::Tensor& text, const torch::Tensor& starts) const {
    auto idx = starts.unsqueeze(1) + torch::arange(block_ + 1, torch::kLong);  // (B, T+1)
    auto w = text.index_select(0, idx.flatten()).view({starts.size(0), block_ + 1}).to(torch::kLong);
    return {w.slice(1, 0, block_).contiguous(), w.slice(1, 1, block_ + 1).contiguous()};
  }

  std::string path_;
  int64_t block_, seed_, accum_;
  Shard shard_;
  torch::Tensor tokens_;  // (N,) uint8, the whole corpus
  torch::Tensor train_, val_;
};

// Fashion-MNIST from the four gunzipped IDX files, read by LibTorch's MNIST dataset.
class FashionMnistDataset : public Dataset {
 public:
  FashionMnistDataset(const std::string& root, double val_fraction, int64_t seed, int64_t accum, Shard shard)
      : root_(root), seed_(seed), accum_(accum), shard_(shard) {
    check_idx("train-images-idx3-ubyte", 2051, 16 + 60000 * 784);
    check_idx("train-labels-idx1-ubyte", 2049, 8 + 60000);
    check_idx("t10k-images-idx3-ubyte", 2051, 16 + 10000 * 784);
    check_idx("t10k-labels-idx1-ubyte", 2049, 8 + 10000);
    torch::data::datasets::MNIST train(root, torch::data::datasets::MNIST::Mode::kTrain);
    torch::data::datasets::MNIST test(root, torch::data::datasets::MNIST::Mode::kTest);
    // A label outside the 10 classes would pass the size and magic checks and surface mid-training as
    // LibTorch's "Target 200 is out of bounds": name the file and the record now.
    check_labels("train-labels-idx1-ubyte", train.targets());
    check_labels("t10k-labels-idx1-ubyte", test.targets());
    auto images = normalize(train.images());
    const int64_t n = images.size(0);
    const auto n_val = static_cast<int64_t>(static_cast<double>(n) * val_fraction);
    train_x_ = images.slice(0, 0, n - n_val);
    train_y_ = train.targets().slice(0, 0, n - n_val);
    val_x_ = images.slice(0, n - n_val, n);
    val_y_ = train.targets().slice(0, n - n_val, n);
    test_x_ = normalize(test.images());
    test_y_ = test.targets();
  }

  DataInfo info() const override { return {}; }  // 1 x 28 x 28, 10 classes: DataInfo's defaults

  Batch train_batch(int64_t step, int64_t micro, int64_t batch_size) override {
    // Sample positions in an endless sequence of epochs, each a fresh permutation from the seed.
    const int64_t n = train_x_.size(0);
    const int64_t global = batch_size * shard_.world;
    const int64_t first = (step * accum_ + micro) * global + shard_.rank * batch_size;
    auto idx = torch::empty({batch_size}, torch::kLong);
    auto* out = idx.data_ptr<int64_t>();
    for (int64_t j = 0; j < batch_size; ++j) {
      const int64_t pos = first + j;
      out[j] = permutation(pos / n).data_ptr<int64_t>()[pos % n];
    }
    return {train_x_.index_select(0, idx), train_y_.index_select(0, idx)};
  }

  std::vector<Batch> val_batches(int64_t batch_size, int64_t max_batches) override {
    return split(val_x_, val_y_, batch_size, max_batches);
  }
  std::vector<Batch> test_batches(int64_t batch_size) override {
    return split(test_x_, test_y_, batch_size, std::numeric_limits<int64_t>::max());
  }

  int64_t resident_bytes() const override {
    // train_x_ / val_x_ (and the labels) are slices of one storage each: count every storage once.
    std::set<const void*> seen;
    int64_t n = 0;
    for (const auto* t : {&train_x_, &train_y_, &val_x_, &val_y_, &test_x_, &test_y_, &perm_})
      if (t->defined() && seen.insert(t->storage().data()).second) n += static_cast<int64_t>(t->storage().nbytes());
    return n;
  }

  std::string describe() const override {
    std::ostringstream os;
    os << "Fashion-MNIST '" << root_ << "': " << train_x_.size(0) << " train, " << val_x_.size(0) << " validation, "
       << test_x_.size(0) << " test images";
    return os.str();
  }

 private:
  void check_idx(const std::string& name, uint32_t magic, uint64_t size) const {
    const auto path = (fs::path(root_) / name).string();
    std::error_code ec;
    MEMTRAIN_CHECK(fs::is_regular_file(path, ec), DataError, "[data] Fashion-MNIST file '", path,
                   "' not found; run scripts/setup.sh to prepare it, or set data.path");
    MEMTRAIN_CHECK(fs::file_size(path) == size, DataError, "[data] '", path, "' has ", fs::file_size(path),
                   " bytes, expected ", size, ": truncated or corrupt");
    std::ifstream in(path, std::ios::binary);
    unsigned char b[4] = {};
    in.read(reinterpret_cast<char*>(b), 4);
    const uint32_t got = (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | b[3];
    MEMTRAIN_CHECK(got == magic, DataError, "[data] '", path, "' starts with magic ", got, ", expected ", magic,
                   ": not an IDX file of this kind");
  }

  void check_labels(const std::string& name, const torch::Tensor& labels) const {
    auto bad = ((labels < 0) | (labels > 9)).nonzero();
    if (bad.numel() == 0) return;
    const auto record = bad[0][0].item<int64_t>();
    throw DataError(detail::concat("[data] '", (fs::path(root_) / name).string(), "': label ",
                                   labels[record].item<int64_t>(), " at record ", record,
                                   " is outside the 10 classes 0..9 (", bad.size(0), " such records): corrupt file"));
  }

  static torch::Tensor normalize(const torch::Tensor& x) {
    return (x - 0.2860) / 0.3530;  // Fashion-MNIST's pixel mean and std (x already in [0, 1])
  }

  const torch::Tensor& permutation(int64_t epoch) {
    if (epoch != perm_epoch_) {
      auto gen = batch_generator(seed_, -1 - epoch, 0);
      perm_ = torch::randperm(train_x_.size(0), gen, torch::kLong);
      perm_epoch_ = epoch;
    }
    return perm_;
  }

  std::vector<Batch> split(const torch::Tensor& x, const torch::Tensor& y, int64_t batch_size, int64_t max_batches) const {
    // Rank r takes every world-th batch, so ranks evaluate disjoint parts.
    std::vector<Batch> out;
    const int64_t n = x.size(0);
    for (int64_t b = shard_.rank; b * batch_size < n && static_cast<int64_t>(out.size()) < max_batches; b += shard_.world)
      out.push_back({x.slice(0, b * batch_size, (b + 1) * batch_size), y.slice(0, b * batch_size, (b + 1) * batch_size)});
    return out;
  }

  std::string root_;
  int64_t seed_, accum_;
  Shard shard_;
  torch::Tensor train_x_, train_y_, val_x_, val_y_, test_x_, test_y_;  // (N, 1, 28, 28) float, (N,) int64
  torch::Tensor perm_;
  int64_t perm_epoch_ = -1;
};

// Random tokens or images of the model's shape: for benchmarks, where data loading must not count.
class SyntheticDataset : public Dataset {
 public:
  SyntheticDataset(const SyntheticDataOptions& o, Shard shard)
      : seed_(o.seed), block_(o.block_size), shard_(shard), text_(o.text), info_(o.info) {}
  DataInfo info() const override { return info_; }
  Batch train_batch(int64_t step, int64_t micro, int64_t batch_size) override {
    // Each (step, micro, rank) slot has its own generator: cheap, and independent of accum_steps.
    auto gen = batch_generator(seed_, step, (micro * shard_.world + shard_.rank) * 7919 + batch_size);
    if (text_) {
      auto x = torch::randint(0, info_.vocab_size, {batch_size, block_ + 1}, gen, torch::kLong);
      return {x.slice(1, 0, block_).contiguous(), x.slice(1, 1, block_ + 1).contiguous()};
    }
    return {torch::randn({batch_size, info_.channels, info_.image_size, info_.image_size}, gen),
            torch::randint(0, info_.num_classes, {batch_size}, gen, torch::kLong)};
  }
  std::vector<Batch> val_batches(int64_t batch_size, int64_t max_batches) override {
    std::vector<Batch> out;
    for (int64_t b = 0; b < max_batches; ++b) out.push_back(train_batch(-1000 - b, 0, batch_size));
    return out;
  }
  std::string describe() const override { return text_ ? "synthetic tokens" : "synthetic images"; }

 private:
  int64_t seed_, block_;
  Shard shard_;
  bool text_;
  DataInfo info_;
};

}  // namespace

std::string default_data_dir() {
  if (const char* env = std::getenv("MEMTRAIN_DATA"); env != nullptr && *env != '\0') return env;
  return MEMTRAIN_DEFAULT_DATA_DIR;
}

std::unique_ptr<Dataset> make_text_dataset(const TextDataOptions& o, const Shard& shard) {
  return std::make_unique<TextDataset>(o.path, o.block_size, o.val_fraction, o.seed, o.accum_steps, shard);
}

std::unique_ptr<Dataset> make_fashion_mnist(const FashionMnistOptions& o, const Shard& shard) {
  return std::make_unique<FashionMnistDataset>(o.root, o.val_fraction, o.seed, o.accum_steps, shard);
}

std::unique_ptr<Dataset> make_synthetic_dataset(const SyntheticDataOptions& o, const Shard& shard) {
  return std::make_unique<SyntheticDataset>(o, shard);
}

}  // namespace memtrain
