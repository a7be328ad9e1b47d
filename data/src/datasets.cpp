#include "memtrain/data/datasets.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <torch/data/datasets/mnist.h>

#include <cerrno>
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

// Language modelling on a sequence of token ids: windows of block_size + 1 tokens. The ids are a 1-D
// integer tensor: the bytes of a text file (uint8), or a memory-mapped token file (uint16 held as int16,
// `unsigned_16` undoes the sign; uint32 as int32).
class WindowDataset : public Dataset {
 public:
  struct Source {
    torch::Tensor train, val;  // (N,) ids
    int64_t vocab = 256;
    bool unsigned_16 = false;
    int64_t resident = 0;      // bytes held (the text) or mapped (token files)
    std::string description;   // "text '...': ..." without the windows
  };
  WindowDataset(Source source, int64_t block_size, int64_t seed, int64_t accum, Shard shard)
      : src_(std::move(source)), block_(block_size), seed_(seed), accum_(accum), shard_(shard) {}
  void set_accum_steps(int64_t accum_steps) override { accum_ = accum_steps; }

  DataInfo info() const override {
    DataInfo d;
    d.vocab_size = src_.vocab;
    return d;
  }

  Batch train_batch(int64_t step, int64_t micro, int64_t batch_size) override {
    // One draw per optimizer step for the whole global batch, laid out [micro][rank][sample]: so
    // 4 x 8 micro-batches see exactly the samples of one 32-sample batch, and ranks are disjoint.
    auto gen = batch_generator(seed_, step, 0);
    const int64_t global = batch_size * shard_.world * accum_;
    const int64_t first = (micro * shard_.world + shard_.rank) * batch_size;
    // A window needs block_ + 1 tokens: starts in [0, n - block_ - 1], randint's high is exclusive.
    auto starts = torch::randint(0, src_.train.size(0) - block_, {global}, gen, torch::kLong)
                      .slice(0, first, first + batch_size);
    return windows(src_.train, starts);
  }

  std::vector<Batch> val_batches(int64_t batch_size, int64_t max_batches) override {
    // Non-overlapping windows from the start of the held-out tokens, dealt round-robin to ranks.
    const int64_t count = std::min((src_.val.size(0) - 1) / block_, batch_size * max_batches * shard_.world);
    // A rank past the last window (fewer windows than ranks) has none: arange would refuse start > end.
    auto starts = count > shard_.rank ? torch::arange(shard_.rank, count, shard_.world, torch::kLong) * block_
                                      : torch::empty({0}, torch::kLong);
    std::vector<Batch> out;
    for (int64_t b = 0; b < starts.size(0); b += batch_size) out.push_back(windows(src_.val, starts.slice(0, b, b + batch_size)));
    return out;
  }

  int64_t resident_bytes() const override { return src_.resident; }

  std::string describe() const override {
    std::ostringstream os;
    os << src_.description << ", windows of " << block_;
    return os.str();
  }

 private:
  Batch windows(const torch::Tensor& ids, const torch::Tensor& starts) const {
    auto idx = starts.unsqueeze(1) + torch::arange(block_ + 1, torch::kLong);  // (B, T+1)
    auto w = ids.index_select(0, idx.flatten()).view({starts.size(0), block_ + 1}).to(torch::kLong);
    if (src_.unsigned_16) w = w.bitwise_and(0xFFFF);
    return {w.slice(1, 0, block_).contiguous(), w.slice(1, 1, block_ + 1).contiguous()};
  }

  Source src_;
  int64_t block_, seed_, accum_;
  Shard shard_;
};

// The text's bytes: vocabulary 256, the tail held out.
WindowDataset::Source byte_source(const std::string& path, double val_fraction, int64_t block) {
  std::error_code ec;
  MEMTRAIN_CHECK(fs::is_regular_file(path, ec), DataError, "[data] text corpus '", path,
                 "' not found; run scripts/setup.sh to prepare it, or set data.path");
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto n = static_cast<int64_t>(bytes.size());
  const auto n_val = static_cast<int64_t>(static_cast<double>(n) * val_fraction);
  // The held-out part must hold at least one window per evaluation, the training part many.
  MEMTRAIN_CHECK(n - n_val > 2 * (block + 1) && (val_fraction == 0 || n_val > block + 1), DataError, "[data] '", path,
                 "' holds ", n, " bytes: too short for block_size ", block, " with val_fraction ", val_fraction);
  WindowDataset::Source s;
  auto all = torch::empty({n}, torch::kUInt8);
  std::memcpy(all.data_ptr(), bytes.data(), bytes.size());
  s.train = all.slice(0, 0, n - n_val);
  s.val = all.slice(0, n - n_val, n);
  s.resident = n;
  std::ostringstream os;
  os << "text '" << path << "': " << n << " bytes (" << n - n_val << " train, " << n_val << " validation), byte-level";
  s.description = os.str();
  return s;
}

// A token file mapped into memory (not copied): llm.c's format (a header of 256 int32: magic 20240520,
// version 1 = uint16 or 2 = uint32 tokens, token count; slot 3 the vocabulary in memtrain's files) or
// headerless uint16 (nanoGPT's .bin).
struct TokenFile {
  torch::Tensor ids;        // (count,) int16 (uint16 ids) or int32, a view of the mapping
  int64_t header_vocab = 0;  // 0: not in the file
  int64_t bytes = 0;
  std::string kind;
};

constexpr int32_t kLlmcMagic = 20240520;

TokenFile map_token_file(const std::string& path, const std::string& format) {
  std::error_code ec;
  MEMTRAIN_CHECK(fs::is_regular_file(path, ec), DataError, "[data] token file '", path,
                 "' not found; run scripts/setup.sh to prepare the BPE token files, or set data.tokens");
  const int fd = ::open(path.c_str(), O_RDONLY);
  MEMTRAIN_CHECK(fd >= 0, DataError, "[data] cannot open token file '", path, "': ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw DataError(detail::concat("[data] cannot read the size of token file '", path, "': ", std::strerror(err)));
  }
  const auto size = static_cast<size_t>(st.st_size);
  void* map = size > 0 ? ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0) : MAP_FAILED;
  ::close(fd);
  MEMTRAIN_CHECK(map != MAP_FAILED, DataError, "[data] cannot map token file '", path, "' (", size, " bytes)",
                 size == 0 ? ": it is empty" : "");
  auto mapping = std::shared_ptr<void>(map, [size](void* p) { ::munmap(p, size); });
  const auto* base = static_cast<const char*>(map);
  TokenFile f;
  f.bytes = static_cast<int64_t>(size);
  size_t offset = 0, element = 2;
  if (format == "llmc") {
    int32_t header[256];
    MEMTRAIN_CHECK(size >= sizeof header, DataError, "[data] ", path, ": ", size,
                   " bytes, shorter than llm.c's 1024-byte header");
    std::memcpy(header, base, sizeof header);
    MEMTRAIN_CHECK(header[0] == kLlmcMagic, DataError, "[data] ", path, ": magic ", header[0], ", not llm.c's ", kLlmcMagic,
                   ": not an llm.c token file (a headerless uint16 file, as nanoGPT writes, needs data.token_format = raw)");
    MEMTRAIN_CHECK(header[1] == 1 || header[1] == 2, DataError, "[data] ", path, ": llm.c version ", header[1],
                   "; expected 1 (uint16 tokens) or 2 (uint32 tokens)");
    element = header[1] == 1 ? 2 : 4;
    offset = sizeof header;
    MEMTRAIN_CHECK((size - offset) % element == 0 && header[2] >= 0 &&
                       static_cast<size_t>(header[2]) == (size - offset) / element,
                   DataError, "[data] ", path, ": the header says ", header[2], " tokens; the file holds ",
                   (size - offset) / element, (size - offset) % element ? " and a partial one" : "",
                   " (truncated, or not written whole)");
    f.header_vocab = header[3] > 0 ? header[3] : 0;
    f.kind = "llm.c v" + std::to_string(header[1]) + (element == 2 ? ", uint16" : ", uint32");
  } else {
    MEMTRAIN_CHECK(size % 2 == 0, DataError, "[data] ", path, ": ", size,
                   " bytes, an odd number: not a file of uint16 tokens");
    f.kind = "raw uint16";
  }
  const auto count = static_cast<int64_t>((size - offset) / element);
  f.ids = torch::from_blob(const_cast<char*>(base + offset), {count}, [mapping](void*) {},
                           torch::TensorOptions().dtype(element == 2 ? torch::kShort : torch::kInt));
  return f;
}

// Every id below `vocab`, checked in chunks (no copy of the whole file): the first one outside is named.
void check_ids(const TokenFile& f, const std::string& path, int64_t vocab, const char* vocab_from) {
  constexpr int64_t kChunk = 1 << 20;
  const auto n = f.ids.size(0);
  for (int64_t at = 0; at < n; at += kChunk) {
    auto ids = f.ids.slice(0, at, std::min(n, at + kChunk)).to(torch::kLong);
    if (f.ids.scalar_type() == torch::kShort) ids = ids.bitwise_and(0xFFFF);
    auto bad = (ids >= vocab).logical_or(ids < 0).nonzero();
    if (bad.size(0) == 0) continue;
    const auto i = bad[0][0].item<int64_t>();
    throw DataError(detail::concat("[data] ", path, ": token ", at + i, " is id ", ids[i].item<int64_t>(),
                                   ", outside the vocabulary of ", vocab, " (", vocab_from, ")"));
  }
}

WindowDataset::Source token_source(const TextDataOptions& o) {
  auto train = map_token_file(o.tokens, o.token_format);
  TokenFile val;
  const bool own_val = !o.val_tokens.empty();
  if (own_val) val = map_token_file(o.val_tokens, o.token_format);
  WindowDataset::Source s;
  const char* vocab_from = "model.vocab_size";
  s.vocab = o.vocab_size;
  if (s.vocab <= 0) s.vocab = train.header_vocab, vocab_from = "the file's header";
  MEMTRAIN_CHECK(s.vocab > 0, DataError, "[data] ", o.tokens, " (", train.kind,
                 ") does not say its vocabulary size: set model.vocab_size");
  check_ids(train, o.tokens, s.vocab, vocab_from);
  if (own_val) check_ids(val, o.val_tokens, s.vocab, vocab_from);
  const int64_t n = train.ids.size(0);
  const int64_t n_val = own_val ? 0 : static_cast<int64_t>(static_cast<double>(n) * o.val_fraction);
  s.train = train.ids.slice(0, 0, n - n_val);
  s.val = own_val ? val.ids : train.ids.slice(0, n - n_val, n);
  MEMTRAIN_CHECK(s.train.size(0) > 2 * (o.block_size + 1), DataError, "[data] ", o.tokens, " holds ", s.train.size(0),
                 " training tokens: too few for block_size ", o.block_size);
  MEMTRAIN_CHECK(s.val.size(0) == 0 || s.val.size(0) > o.block_size + 1, DataError, "[data] ",
                 own_val ? o.val_tokens : o.tokens, " holds ", s.val.size(0),
                 " validation tokens: too few for one window of block_size ", o.block_size);
  s.unsigned_16 = train.ids.scalar_type() == torch::kShort;
  MEMTRAIN_CHECK(!own_val || val.ids.scalar_type() == train.ids.scalar_type(), DataError, "[data] ", o.val_tokens,
                 " holds ", val.kind, " tokens, ", o.tokens, " ", train.kind);
  s.resident = train.bytes + val.bytes;
  std::ostringstream os;
  os << "tokens '" << o.tokens << "' (" << train.kind << ", memory-mapped): " << s.train.size(0) << " train, "
     << s.val.size(0) << " validation" << (own_val ? " from '" + o.val_tokens + "'" : std::string()) << ", vocabulary "
     << s.vocab;
  s.description = os.str();
  return s;
}

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
  void set_accum_steps(int64_t accum_steps) override { accum_ = accum_steps; }


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
  auto source = o.tokens.empty() ? byte_source(o.path, o.val_fraction, o.block_size) : token_source(o);
  return std::make_unique<WindowDataset>(std::move(source), o.block_size, o.seed, o.accum_steps, shard);
}

std::unique_ptr<Dataset> make_fashion_mnist(const FashionMnistOptions& o, const Shard& shard) {
  return std::make_unique<FashionMnistDataset>(o.root, o.val_fraction, o.seed, o.accum_steps, shard);
}

std::unique_ptr<Dataset> make_synthetic_dataset(const SyntheticDataOptions& o, const Shard& shard) {
  return std::make_unique<SyntheticDataset>(o, shard);
}

}  // namespace memtrain
