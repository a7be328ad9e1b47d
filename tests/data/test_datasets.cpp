#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "helpers.h"
#include "memtrain/data/datasets.h"
#include "memtrain/core/error.h"

namespace memtrain {
namespace {

TextDataOptions text_options(const std::string& path) {
  TextDataOptions o;
  o.path = path, o.block_size = 8;
  return o;
}

std::string alphabet_text(test::TempDir& dir) {
  std::string s;
  for (int i = 0; i < 4000; ++i) s += static_cast<char>('a' + i % 26);
  return dir.file("abc.txt", s);
}

TEST(TextData, TargetsAreInputsShiftedByOne) {
  test::TempDir dir;
  auto data = make_text_dataset(text_options(alphabet_text(dir)), {});
  EXPECT_EQ(data->info().vocab_size, 256);
  auto b = data->train_batch(0, 0, 4);
  ASSERT_EQ(b.input.sizes(), (std::vector<int64_t>{4, 8}));
  ASSERT_EQ(b.target.sizes(), (std::vector<int64_t>{4, 8}));
  EXPECT_TRUE(torch::equal(b.input.slice(1, 1, 8), b.target.slice(1, 0, 7)));
  // The text is a repeating alphabet: each next byte is the previous one plus one, mod 26.
  EXPECT_TRUE(torch::equal((b.input - 'a' + 1).remainder(26) + 'a', b.target));
}

TEST(TextData, DeterministicPerStepAndDisjointAcrossRanks) {
  test::TempDir dir;
  auto path = alphabet_text(dir);
  auto c = text_options(path);
  c.accum_steps = 2;
  auto one = make_text_dataset(c, {0, 1});
  EXPECT_TRUE(torch::equal(one->train_batch(3, 1, 4).input, make_text_dataset(c, {0, 1})->train_batch(3, 1, 4).input));
  EXPECT_FALSE(torch::equal(one->train_batch(3, 0, 4).input, one->train_batch(4, 0, 4).input));
  // Two ranks with micro-batches of 2 see exactly the single rank's batch of 4, split in two.
  auto r0 = make_text_dataset(c, {0, 2}), r1 = make_text_dataset(c, {1, 2});
  auto whole = one->train_batch(5, 1, 4).input;
  auto parts = torch::cat({r0->train_batch(5, 1, 2).input, r1->train_batch(5, 1, 2).input});
  EXPECT_TRUE(torch::equal(whole, parts));
}

TEST(TextData, ValidationIsHeldOutAndStable) {
  // 4000 bytes, val_fraction 0.1: the last 400 are held out. They are upper case and the 3600 before them
  // lower case, so a window's letters say which part of the file it came from.
  test::TempDir dir;
  std::string s;
  for (int i = 0; i < 4000; ++i) s += static_cast<char>((i < 3600 ? 'a' : 'A') + i % 26);
  auto data = make_text_dataset(text_options(dir.file("two_cases.txt", s)), {});
  auto upper = [](const torch::Tensor& t) { return t.ge('A').logical_and(t.le('Z')).all().item<bool>(); };
  auto lower = [](const torch::Tensor& t) { return t.ge('a').logical_and(t.le('z')).all().item<bool>(); };
  auto v1 = data->val_batches(4, 3), v2 = data->val_batches(4, 3);
  ASSERT_EQ(v1.size(), 3u);
  for (size_t i = 0; i < v1.size(); ++i) {
    EXPECT_TRUE(torch::equal(v1[i].input, v2[i].input));
    EXPECT_TRUE(upper(v1[i].input) && upper(v1[i].target)) << "validation batch " << i << " reaches into training:\n"
                                                           << v1[i].input;
  }
  // Every held-out window, and never a training window in it: 400 bytes hold (400 - 1) / 8 = 49 windows of 8 + 1.
  int64_t windows = 0;
  for (const auto& b : data->val_batches(16, 100)) {
    EXPECT_TRUE(upper(b.input) && upper(b.target)) << b.input;
    windows += b.input.size(0);
  }
  EXPECT_EQ(windows, (400 - 1) / 8);
  // Training windows never read a held-out byte.
  for (int64_t step = 0; step < 50; ++step) {
    auto b = data->train_batch(step, 0, 16);
    EXPECT_TRUE(lower(b.input) && lower(b.target)) << "step " << step << " trains on held-out bytes:\n" << b.input;
  }
}

TEST(TextData, RanksPastTheLastValidationWindowGetNone) {
  // 4000 bytes, a tail of 400 held out: (400 - 1) / 8 = 49 windows of 8 + 1, dealt round-robin to 64 ranks:
  // ranks 0-48 one each, ranks 49-63 none (and no error).
  test::TempDir dir;
  const auto path = alphabet_text(dir);
  int64_t windows = 0;
  for (int rank = 0; rank < 64; ++rank) {
    auto v = make_text_dataset(text_options(path), {rank, 64})->val_batches(4, 10);
    const int64_t mine = v.empty() ? 0 : v[0].input.size(0);
    EXPECT_EQ(mine, rank < 49 ? 1 : 0) << "rank " << rank;
    windows += mine;
  }
  EXPECT_EQ(windows, 49);
}

TEST(TextData, MissingAndShortFilesAreNamed) {
  auto msg = test::error_of([] { make_text_dataset(text_options("/no/such/corpus.txt"), {}); });
  EXPECT_NE(msg.find("'/no/such/corpus.txt' not found"), std::string::npos) << msg;
  test::TempDir dir;
  auto tiny = dir.file("tiny.txt", "too short");
  msg = test::error_of([&] { make_text_dataset(text_options(tiny), {}); });
  EXPECT_NE(msg.find("holds 9 bytes: too short for block_size 8"), std::string::npos) << msg;
}

TEST(TextData, RealCorpusIsPrepared) {
  auto data = make_text_dataset(text_options((std::filesystem::path(default_data_dir()) / "text" / "austen.txt").string()), {});
  EXPECT_NE(data->describe().find("austen.txt"), std::string::npos);
  EXPECT_GT(data->val_batches(8, 1).size(), 0u);
}

TEST(FashionMnist, ShapesLabelsAndSplits) {
  auto data = make_fashion_mnist({.root = (std::filesystem::path(default_data_dir()) / "fashion-mnist").string(),
                                  .val_fraction = 0.1},
                                 {});
  auto b = data->train_batch(0, 0, 16);
  EXPECT_EQ(b.input.sizes(), (std::vector<int64_t>{16, 1, 28, 28}));
  EXPECT_EQ(b.target.sizes(), (std::vector<int64_t>{16}));
  EXPECT_GE(b.target.min().item<int64_t>(), 0);
  EXPECT_LE(b.target.max().item<int64_t>(), 9);
  // Normalised with the training set's mean and standard deviation: over all 60,000 training images (one
  // epoch of 54,000 in 9 batches of 6,000, and the 6,000 held out) mean 0 and std 1. Raw pixels in [0, 1]
  // have mean 0.286 and std 0.353, so a missing or wrong normalisation is far outside 0.01.
  double sum = 0, squares = 0, count = 0;
  auto add = [&](const torch::Tensor& x) {
    auto d = x.to(torch::kDouble);
    sum += d.sum().item<double>(), squares += d.square().sum().item<double>(), count += static_cast<double>(d.numel());
  };
  for (int64_t step = 0; step < 9; ++step) add(data->train_batch(step, 0, 6000).input);
  int64_t val = 0, test = 0;
  for (const auto& v : data->val_batches(1000, 100)) add(v.input);
  ASSERT_EQ(count, 60000.0 * 784);
  const double mean = sum / count, std = std::sqrt(squares / count - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.01);
  EXPECT_NEAR(std, 1.0, 0.01);
  for (const auto& v : data->val_batches(1000, 100)) val += v.target.size(0);
  for (const auto& t : data->test_batches(1000)) test += t.target.size(0);
  EXPECT_EQ(val, 6000);
  EXPECT_EQ(test, 10000);
}

TEST(FashionMnist, CorruptFileIsNamed) {
  test::TempDir dir;
  namespace fs = std::filesystem;
  const auto src = fs::path(default_data_dir()) / "fashion-mnist";
  for (const auto& f : fs::directory_iterator(src)) fs::copy_file(f.path(), fs::path(dir.path()) / f.path().filename());
  fs::resize_file(dir.path("train-labels-idx1-ubyte"), 1000);  // truncated
  auto msg = test::error_of([&] { make_fashion_mnist({.root = dir.path()}, {}); });
  EXPECT_NE(msg.find("train-labels-idx1-ubyte' has 1000 bytes, expected 60008"), std::string::npos) << msg;
}

}  // namespace
}  // namespace memtrain

namespace memtrain {
namespace {

TEST(FashionMnist, LabelOutOfRangeIsNamedWithItsRecord) {
  test::TempDir dir;
  namespace fs = std::filesystem;
  const auto src = fs::path(default_data_dir()) / "fashion-mnist";
  for (const auto& f : fs::directory_iterator(src)) fs::copy_file(f.path(), fs::path(dir.path()) / f.path().filename());
  {  // record 17's label (the IDX header is 8 bytes) becomes 200
    std::fstream f(dir.path("train-labels-idx1-ubyte"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8 + 17);
    f.put(static_cast<char>(200));
  }
  auto msg = test::error_of([&] { make_fashion_mnist({.root = dir.path()}, {}); });
  EXPECT_NE(msg.find("train-labels-idx1-ubyte': label 200 at record 17 is outside the 10 classes 0..9"),
            std::string::npos)
      << msg;
}

}  // namespace
}  // namespace memtrain
