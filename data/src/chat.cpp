#include <filesystem>
#include <map>
#include <numeric>

#include "memtrain/core/error.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/data/datasets.h"

namespace memtrain {

namespace {

namespace fs = std::filesystem;

struct Records {
  torch::Tensor tokens;   // (N,) int64
  torch::Tensor trained;  // (N,) bool
  std::vector<int64_t> offsets;
  int64_t vocab_size = 0;  // the tokenizer's, where prepare_chat.py recorded it
};

Records read_records(const std::string& path) {
  MEMTRAIN_CHECK(fs::is_regular_file(path), DataError, "[data] data.dataset = chat: no ", path,
                 " (scripts/prepare_chat.py writes train.safetensors and val.safetensors)");
  const auto t = load_safetensors(path);
  for (const char* key : {"tokens", "trained", "offsets"})
    MEMTRAIN_CHECK(t.count(key), DataError, "[data] ", path, ": no tensor '", key, "' (tokens, trained, offsets)");
  Records r;
  r.tokens = t.at("tokens").to(torch::kLong).reshape({-1});
  r.trained = t.at("trained").reshape({-1}).ne(0);
  const auto offsets = t.at("offsets").to(torch::kLong).reshape({-1}).contiguous();
  r.offsets.assign(offsets.data_ptr<int64_t>(), offsets.data_ptr<int64_t>() + offsets.numel());
  const int64_t n = r.tokens.numel();
  MEMTRAIN_CHECK(r.trained.numel() == n, DataError, "[data] ", path, ": 'trained' has ", r.trained.numel(),
                 " entries for ", n, " tokens");
  MEMTRAIN_CHECK(r.offsets.size() >= 2 && r.offsets.front() == 0 && r.offsets.back() == n, DataError, "[data] ", path,
                 ": 'offsets' must run from 0 to the token count ", n, " with at least one record");
  for (size_t i = 1; i < r.offsets.size(); ++i)
    MEMTRAIN_CHECK(r.offsets[i] - r.offsets[i - 1] >= 2, DataError, "[data] ", path, ": record ", i - 1, " has ",
                   r.offsets[i] - r.offsets[i - 1], " tokens (at least 2: an input and a target)");
  if (t.count("vocab_size")) r.vocab_size = t.at("vocab_size").reshape({-1})[0].item<int64_t>();
  return r;
}

void check_vocabulary(const Records& r, const std::string& path, int64_t vocab) {
  const auto lo = r.tokens.min().item<int64_t>(), hi = r.tokens.max().item<int64_t>();
  MEMTRAIN_CHECK(lo >= 0 && hi < vocab, DataError, "[data] ", path, ": token ids span [", lo, ", ", hi,
                 "], outside the vocabulary of ", vocab);
}

// Rows of T (input, target) pairs, records whole and in `order`.
struct Packed {
  torch::Tensor input, target, positions, documents;  // (rows, T) int64
  int64_t rows() const { return input.size(0); }
};

Packed pack(const Records& r, const std::vector<int64_t>& order, int64_t T, bool several) {
  std::vector<int64_t> in, tg, pos, doc;
  const auto* tokens = r.tokens.data_ptr<int64_t>();
  const auto trained = r.trained.contiguous();
  const auto* mask = trained.data_ptr<bool>();
  int64_t used = 0, index = 0;
  auto close = [&] {  // the open row padded to T (token 0, no loss, its own document -1)
    if (used == 0) return;
    for (; used < T; ++used) in.push_back(0), tg.push_back(-100), pos.push_back(0), doc.push_back(-1);
    used = 0, index = 0;
  };
  for (auto rec : order) {
    const int64_t b = r.offsets[rec], pairs = std::min(T, r.offsets[rec + 1] - b - 1);  // longer: its first T pairs
    if (used + pairs > T || !several) close();
    for (int64_t j = 0; j < pairs; ++j) {
      in.push_back(tokens[b + j]);
      tg.push_back(mask[b + j + 1] ? tokens[b + j + 1] : -100);
      pos.push_back(j), doc.push_back(index);
    }
    used += pairs, ++index;
  }
  close();
  const int64_t rows = static_cast<int64_t>(in.size()) / T;
  auto make = [&](const std::vector<int64_t>& v) { return torch::tensor(v, torch::kLong).view({rows, T}); };
  return {make(in), make(tg), make(pos), make(doc)};
}

class ChatDataset : public Dataset {
 public:
  ChatDataset(const ChatDataOptions& o, const Shard& shard) : o_(o), shard_(shard) {
    const auto train_path = (fs::path(o.dir) / "train.safetensors").string();
    const auto val_path = (fs::path(o.dir) / "val.safetensors").string();
    const auto train = read_records(train_path);
    const auto val = read_records(val_path);
    vocab_ = o.vocab_size > 0 ? o.vocab_size : train.vocab_size;  // the model's, else the tokenizer's
    MEMTRAIN_CHECK(vocab_ > 0, DataError, "[data] ", train_path, ": no tensor 'vocab_size'; set model.vocab_size");
    check_vocabulary(train, train_path, vocab_);
    check_vocabulary(val, val_path, vocab_);
    auto g = torch::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(o.seed));
    const auto perm = torch::randperm(static_cast<int64_t>(train.offsets.size() - 1), g, torch::kLong);
    const std::vector<int64_t> order(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + perm.numel());
    train_ = pack(train, order, o.block_size, o.pack);
    std::vector<int64_t> val_order(val.offsets.size() - 1);
    std::iota(val_order.begin(), val_order.end(), 0);
    val_ = pack(val, val_order, o.block_size, o.pack);
    records_ = static_cast<int64_t>(order.size());
    trained_tokens_ = train.trained.sum().item<int64_t>();
  }
  DataInfo info() const override { return {.vocab_size = vocab_}; }
  bool masks_targets() const override { return true; }
  void set_accum_steps(int64_t accum_steps) override { o_.accum_steps = accum_steps; }

  Batch train_batch(int64_t step, int64_t micro, int64_t batch_size) override {
    // Row k of the stream: epoch k / rows, in that epoch's order (drawn from seed + epoch); this rank's part of the
    // step's global batch.
    const int64_t first = ((step * o_.accum_steps + micro) * shard_.world + shard_.rank) * batch_size;
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < batch_size; ++i) {
      const int64_t k = first + i, epoch = k / train_.rows();
      if (epoch != epoch_ || !perm_.defined()) {
        auto g = torch::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(o_.seed + 1 + epoch));
        perm_ = torch::randperm(train_.rows(), g, torch::kLong), epoch_ = epoch;
      }
      rows.push_back(perm_[k % train_.rows()].item<int64_t>());
    }
    return take(train_, torch::tensor(rows, torch::kLong));
  }

  std::vector<Batch> val_batches(int64_t batch_size, int64_t max_batches) override {
    std::vector<Batch> out;
    for (int64_t b = 0; b * batch_size < val_.rows() && (max_batches <= 0 || b < max_batches); ++b) {
      const int64_t lo = b * batch_size, hi = std::min(val_.rows(), lo + batch_size);
      out.push_back(take(val_, torch::arange(lo, hi, torch::kLong)));
    }
    return out;
  }

  std::string describe() const override {
    return detail::concat("chat records from ", o_.dir, ": ", records_, " training records packed into ", train_.rows(),
                          " rows of ", o_.block_size, " (", trained_tokens_, " trained tokens), ", val_.rows(),
                          " validation rows");
  }
  int64_t resident_bytes() const override { return 4 * 8 * (train_.input.numel() + val_.input.numel()); }

 private:
  static Batch take(const Packed& p, const torch::Tensor& rows) {
    return {p.input.index_select(0, rows), p.target.index_select(0, rows), p.positions.index_select(0, rows),
            p.documents.index_select(0, rows)};
  }
  ChatDataOptions o_;
  Shard shard_;
  int64_t vocab_ = 0, records_ = 0, trained_tokens_ = 0;
  Packed train_, val_;
  torch::Tensor perm_;
  int64_t epoch_ = -1;
};

}  // namespace

std::unique_ptr<Dataset> make_chat_dataset(const ChatDataOptions& options, const Shard& shard) {
  return std::make_unique<ChatDataset>(options, shard);
}

}  // namespace memtrain
