// Token files: llm.c's format written by a small Python script here (header and tokens built by hand),
// headerless uint16, one error per kind of bad file, set-up's BPE files decoding back to the corpus, and a
// BPE GPT that learns, with its loss curve against the same model trained by PyTorch on the same files.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "helpers.h"
#include "memtrain/data/datasets.h"
#include "memtrain/runtime/factories.h"
#include "memtrain/runtime/trainer.h"

namespace memtrain {
namespace {

namespace fs = std::filesystem;

std::string python() { return MEMTRAIN_PYTHON; }

// Runs a Python program (numpy available) with `dir` as its working folder; fails the test on error.
void run_python(const test::TempDir& dir, const std::string& program) {
  const auto script = dir.file("make.py", program);
  int code = -1;
  const auto out = test::shell("cd " + dir.path() + " && " + python() + " " + script + " 2>&1", &code);
  ASSERT_EQ(code, 0) << out;
}

// An llm.c file: 256 int32 header (magic, version, count, then `vocab` in slot 3), ids (i * 7919) % 50000
// as uint16: many above 32767, where a signed read would go wrong.
const char* kWriteLlmc = R"(
import numpy as np
def write(name, ids, magic=20240520, version=1, count=None, vocab=0, dtype="<u2"):
    h = np.zeros(256, dtype="<i4")
    h[0], h[1], h[2], h[3] = magic, version, len(ids) if count is None else count, vocab
    with open(name, "wb") as f:
        f.write(h.tobytes()); f.write(np.asarray(ids, dtype=dtype).tobytes())
ids = [(i * 7919) % 50000 for i in range(1000)]
write("good.bin", ids, vocab=50000)
write("no_vocab.bin", ids)
write("v2.bin", ids, version=2, vocab=50000, dtype="<u4")
write("magic.bin", ids, magic=20240521)
write("version.bin", ids, version=3)
write("count.bin", ids, count=1001)
write("too_big.bin", ids[:500] + [60000] + ids[501:], vocab=50000)
np.asarray(ids, dtype="<u2").tofile("raw.bin")
open("odd.bin", "wb").write(np.asarray(ids, dtype="<u2").tobytes() + b"x")
)";

std::unique_ptr<Dataset> tokens(const std::string& path, int64_t vocab = 0, const std::string& format = "llmc") {
  TextDataOptions o;
  o.tokens = path, o.vocab_size = vocab, o.token_format = format, o.block_size = 8, o.val_fraction = 0.1;
  return make_text_dataset(o, {});
}

// The ids the script wrote, positions [from, from + n).
torch::Tensor expected_ids(int64_t from, int64_t n) {
  return (torch::arange(from, from + n, torch::kLong) * 7919).remainder(50000);
}

TEST(TokenFiles, AnLlmcFileWrittenByHandIsReadWithItsCountAndIds) {
  test::TempDir dir;
  run_python(dir, kWriteLlmc);
  for (const char* file : {"good.bin", "v2.bin"}) {
    SCOPED_TRACE(file);
    auto d = tokens(dir.path(file));
    EXPECT_EQ(d->info().vocab_size, 50000);  // from the header's slot 3
    EXPECT_NE(d->describe().find("900 train, 100 validation"), std::string::npos) << d->describe();
    auto val = d->val_batches(4, 1);
    ASSERT_FALSE(val.empty());
    // The first validation window starts at token 900: input ids 900..907, targets 901..908.
    EXPECT_TRUE(torch::equal(val[0].input[0], expected_ids(900, 8))) << val[0].input[0];
    EXPECT_TRUE(torch::equal(val[0].target[0], expected_ids(901, 8)));
    // Training windows are runs of consecutive ids of the file.
    auto b = d->train_batch(0, 0, 4);
    for (int64_t i = 0; i < 4; ++i) {
      const auto first = b.input[i][0].item<int64_t>();
      int64_t pos = 0;
      while (pos < 900 && (pos * 7919) % 50000 != first) ++pos;
      EXPECT_TRUE(torch::equal(b.input[i], expected_ids(pos, 8))) << "window " << i;
    }
  }
  // The memory is the file's, mapped: nothing of the size of the tokens is allocated.
  EXPECT_NE(tokens(dir.path("good.bin"))->describe().find("memory-mapped"), std::string::npos);
}

TEST(TokenFiles, HeaderlessUint16FilesNeedTheFormatAndTheVocabulary) {
  test::TempDir dir;
  run_python(dir, kWriteLlmc);
  auto d = tokens(dir.path("raw.bin"), 50000, "raw");
  EXPECT_TRUE(torch::equal(d->val_batches(1, 1)[0].input[0], expected_ids(900, 8)));
  auto e = test::error_of([&] { tokens(dir.path("raw.bin"), 0, "raw"); });
  EXPECT_NE(e.find("does not say its vocabulary size: set model.vocab_size"), std::string::npos) << e;
  e = test::error_of([&] { tokens(dir.path("no_vocab.bin")); });
  EXPECT_NE(e.find("does not say its vocabulary size"), std::string::npos) << e;
  EXPECT_EQ(tokens(dir.path("no_vocab.bin"), 50000)->info().vocab_size, 50000);
}

TEST(TokenFiles, EachKindOfBadFileHasItsOwnError) {
  test::TempDir dir;
  run_python(dir, kWriteLlmc);
  auto e = test::error_of([&] { tokens(dir.path("magic.bin")); });
  EXPECT_NE(e.find("magic.bin: magic 20240521, not llm.c's 20240520"), std::string::npos) << e;
  EXPECT_NE(e.find("data.token_format = raw"), std::string::npos) << e;
  e = test::error_of([&] { tokens(dir.path("version.bin"), 50000); });
  EXPECT_NE(e.find("version.bin: llm.c version 3; expected 1 (uint16 tokens) or 2 (uint32 tokens)"), std::string::npos) << e;
  e = test::error_of([&] { tokens(dir.path("count.bin"), 50000); });
  EXPECT_NE(e.find("count.bin: the header says 1001 tokens; the file holds 1000"), std::string::npos) << e;
  e = test::error_of([&] { tokens(dir.path("too_big.bin")); });
  EXPECT_NE(e.find("too_big.bin: token 500 is id 60000, outside the vocabulary of 50000 (the file's header)"),
            std::string::npos) << e;
  e = test::error_of([&] { tokens(dir.path("good.bin"), 40000); });
  EXPECT_NE(e.find("outside the vocabulary of 40000 (model.vocab_size)"), std::string::npos) << e;
  e = test::error_of([&] { tokens(dir.path("odd.bin"), 50000, "raw"); });
  EXPECT_NE(e.find("odd.bin: 2001 bytes, an odd number"), std::string::npos) << e;
  e = test::error_of([&] { tokens(dir.path("missing.bin")); });
  EXPECT_NE(e.find("token file '" + dir.path("missing.bin") + "' not found"), std::string::npos) << e;
  std::ofstream(dir.path("short.bin")) << "tiny";
  e = test::error_of([&] { tokens(dir.path("short.bin")); });
  EXPECT_NE(e.find("shorter than llm.c's 1024-byte header"), std::string::npos) << e;
}

TEST(TokenFiles, SetUpsBpeFilesDecodeBackToTheCorpus) {
  // Set-up's byte-level BPE token files as memtrain reads them (its llm.c reader, the vocabulary from the
  // header), decoded with their tokenizer.json by Hugging Face tokenizers: training then validation, byte
  // for byte the prepared corpus. Windows of one token (block_size 1) at stride 1: the inputs of the
  // validation windows are every id of the file but the last, which is the last window's target.
  test::TempDir dir;
  const auto data = default_data_dir();
  for (const auto& [set, vocab] : {std::pair<std::string, int64_t>{"austen-bpe8192", 8192}, {"austen-bpe50257", 50257}}) {
    SCOPED_TRACE(set);
    const auto folder = data + "/tokens/" + set;
    std::vector<torch::Tensor> ids;
    for (const char* part : {"train.bin", "val.bin"}) {
      TextDataOptions o;
      o.tokens = folder + "/val.bin", o.val_tokens = folder + "/" + part, o.block_size = 1;  // `part` as validation
      auto d = make_text_dataset(o, {});
      EXPECT_EQ(d->info().vocab_size, vocab) << "from the header's slot 3";
      auto windows = d->val_batches(1 << 20, 1 << 10);
      ASSERT_FALSE(windows.empty());
      for (const auto& w : windows) ids.push_back(w.input.flatten());
      ids.push_back(windows.back().target.flatten().slice(0, -1));
    }
    auto all = torch::cat(ids).to(torch::kInt).contiguous();
    EXPECT_LT(all.max().item<int64_t>(), vocab);
    std::ofstream(dir.path("ids.i32"), std::ios::binary)
        .write(static_cast<const char*>(all.data_ptr()), static_cast<std::streamsize>(all.numel() * 4));
    run_python(dir, std::string(R"(
import numpy as np
from tokenizers import Tokenizer
tok = Tokenizer.from_file(")") + folder + R"(/tokenizer.json")
ids = np.fromfile("ids.i32", dtype="<i4")
text = tok.decode(ids.tolist())
want = open(")" + data + R"(/text/austen.txt", encoding="utf-8").read()
assert text == want, "memtrain read %d tokens; they decode to %d chars, the corpus has %d" % (len(ids), len(text), len(want))
print("round trip", len(ids), "tokens")
)");
  }
}

// A 2-layer GPT on austen-bpe8192 for `steps` steps: the step losses.
Config bpe_config(int steps) {
  auto c = test::tiny_gpt_config();
  c.data.dataset = "text";
  c.data.tokens = "austen-bpe8192";
  c.model.n_layer = 2, c.model.n_head = 2, c.model.n_embd = 64, c.model.block_size = 64;
  c.train.micro_batch = 16, c.train.steps = steps, c.train.warmup_steps = 10;
  c.train.lr = 3e-3, c.train.min_lr = 3e-4;
  c.memory.head = "fused";
  return c;
}

TEST(TokenFiles, ABpeGptLearnsAndItsCurveMatchesPyTorchsOnTheSameFiles) {
  const int steps = 150;
  auto c = bpe_config(steps);
  Trainer t(c);
  const double start = t.evaluate(t.data().val_batches(16, 4)).loss;
  std::vector<double> ours;
  for (int i = 0; i < steps; ++i) ours.push_back(t.step().loss.item<double>());
  const double end = t.evaluate(t.data().val_batches(16, 4)).loss;
  EXPECT_NEAR(start, std::log(8192.0), 0.3);  // a fresh model is about uniform over the vocabulary
  EXPECT_LT(end, start - 2.0) << "validation loss " << start << " -> " << end;

  // PyTorch: the reference GPT (scripts/reference/gpt_ref.py), its own initialisation and sampling
  // from the same token files, the same optimizer, schedule and clipping.
  test::TempDir dir;
  int code = -1;
  const auto out = test::shell(python() + " " + test::source("scripts/reference/bpe_curve.py") + " --tokens " +
                                   default_data_dir() + "/tokens/austen-bpe8192/train.bin --steps " + std::to_string(steps) +
                                   " --out " + dir.path("curve.txt") + " 2>&1",
                               &code);
  ASSERT_EQ(code, 0) << out;
  std::ifstream in(dir.path("curve.txt"));
  std::vector<double> theirs;
  for (double v; in >> v;) theirs.push_back(v);
  ASSERT_EQ(theirs.size(), ours.size());
  // Different initial weights and batches: the curves agree within run-to-run noise, compared as means
  // over windows of 25 steps (each within 4% once past the first window).
  for (int w = 25; w < steps; w += 25) {
    double a = 0, b = 0;
    for (int i = w; i < w + 25; ++i) a += ours[i] / 25, b += theirs[i] / 25;
    EXPECT_NEAR(a, b, 0.04 * b) << "steps " << w + 1 << "-" << w + 25 << ": memtrain " << a << ", PyTorch " << b;
    std::cout << "[          ] steps " << w + 1 << "-" << w + 25 << ": mean loss memtrain " << a << ", PyTorch " << b << "\n";
  }
  std::cout << "[          ] validation loss " << start << " -> " << end << "\n";
}

}  // namespace
}  // namespace memtrain
