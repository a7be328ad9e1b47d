#include <gtest/gtest.h>

#include "helpers.h"
#include "memtrain/core/files.h"
#include <nlohmann/json.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <torch/cuda.h>
#include <type_traits>

#include "memtrain/data/datasets.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/runtime/factories.h"
#include "memtrain/runtime/trainer.h"

namespace memtrain {
namespace {

std::vector<double> losses(Trainer& t, int steps) {
  std::vector<double> out;
  for (int i = 0; i < steps; ++i) out.push_back(t.step().loss.item<double>());
  return out;
}

double mean_tail(const std::vector<double>& v, size_t n) {
  double s = 0;
  for (size_t i = v.size() - n; i < v.size(); ++i) s += v[i];
  return s / static_cast<double>(n);
}

TEST(Training, DefaultGptLearnsAusten) {
  // The README's default job, shortened: byte-level GPT on Jane Austen.
  auto c = Config::load(test::source("examples/configs/gpt_austen_cpu.ini"),
                        {"--train.steps=150", "--train.warmup_steps=10"});
  Trainer t(c);
  auto l = losses(t, 150);
  // Uniform over 256 bytes is ln 256 = 5.545; the first loss sits near it.
  EXPECT_NEAR(l.front(), std::log(256.0), 0.3);
  const double end = mean_tail(l, 10);
  EXPECT_LT(end, 0.6 * l.front()) << "training loss did not fall well below its start";
  auto val = t.evaluate(t.data().val_batches(16, 8));
  EXPECT_LT(val.loss, 0.6 * l.front()) << "held-out loss did not fall";
}

TEST(Training, FitWritesTheRunFolderAndLoadableWeights) {
  test::TempDir dir;
  auto c = test::tiny_gpt_config();
  c.train.steps = 4, c.train.eval_every = 2, c.log.every = 2, c.log.dir = dir.path(), c.log.name = "fit";
  c.log.progress = "lines";
  Trainer t(c);
  t.fit();
  namespace fs = std::filesystem;
  const auto run = fs::path(dir.path()) / "fit";
  for (const char* f : {"config.ini", "metrics.jsonl", "memory.rank0.jsonl", "summary.json"})
    EXPECT_TRUE(fs::is_regular_file(run / f)) << f;
  // The saved config reads back to the same resolved values (the comment line naming the source aside).
  auto body = [](const std::string& ini) { return ini.substr(ini.find('[')); };
  EXPECT_EQ(body(Config::load((run / "config.ini").string()).to_ini()), body(c.to_ini()));
  std::ifstream mem((run / "memory.rank0.jsonl").string());
  int lines = 0;
  for (std::string l; std::getline(mem, l);) ++lines;
  EXPECT_EQ(lines, 4);  // one per step on the one tracked device
  // The saved weights load into a fresh model of the same config and equal the trained ones.
  auto saved = load_safetensors((run / "checkpoints" / "model.safetensors").string());
  auto fresh = make_model(c.model, t.data().info());
  load_module_state(*fresh, saved, "model.safetensors");
  auto a = t.model().named_parameters(), b = fresh->named_parameters();
  for (const auto& item : a) EXPECT_TRUE(torch::equal(item.value(), b[item.key()])) << item.key();
}

TEST(Training, TrainerIsNeitherCopyableNorMovable) {
  // The tracker's resident-bytes callback captures `this`: a moved Trainer would leave it pointing at
  // the moved-from object.
  static_assert(!std::is_copy_constructible_v<Trainer>);
  static_assert(!std::is_copy_assignable_v<Trainer>);
  static_assert(!std::is_move_constructible_v<Trainer>);
  static_assert(!std::is_move_assignable_v<Trainer>);
  SUCCEED();
}

TEST(Training, SameSeedSameLosses) {
  auto c = test::tiny_gpt_config();
  c.model.dropout = 0.1;
  Trainer a(c), b(c);
  auto la = losses(a, 5), lb = losses(b, 5);
  EXPECT_EQ(la, lb);  // bitwise
  c.train.seed = 7;
  Trainer d(c);
  EXPECT_NE(losses(d, 5), la);
}

TEST(Training, FashionMnistMlpBeatsChance) {
  auto c = Config::load(test::source("examples/configs/mlp_fashion_cpu.ini"),
                        {"--train.steps=200", "--train.warmup_steps=10"});
  Trainer t(c);
  auto l = losses(t, 200);
  EXPECT_LT(mean_tail(l, 20), 0.5 * l.front());
  auto batches = t.data().test_batches(500);
  auto test = t.evaluate(batches);
  EXPECT_EQ(test.samples, 10000);
  EXPECT_GT(test.accuracy, 0.75) << "chance is 0.10";
}

TEST(Training, FashionMnistResNetLearns) {
  auto c = Config::load(test::source("examples/configs/resnet_fashion_cpu.ini"),
                        {"--train.steps=60", "--train.warmup_steps=5", "--model.width=8", "--train.micro_batch=32"});
  Trainer t(c);
  auto l = losses(t, 60);
  EXPECT_LT(mean_tail(l, 10), 0.6 * l.front());
  auto batches = t.data().test_batches(250);
  batches.resize(8);  // 2000 test images: enough to tell learning from chance
  auto test = t.evaluate(batches);
  EXPECT_GT(test.accuracy, 0.5) << "chance is 0.10";
}

TEST(Accumulation, FourTimesEightEqualsOneTimesThirtyTwo) {
  // Plain SGD: parameters move in proportion to the gradients, so a mis-normalised accumulation
  // (a sum instead of a mean) shows; Adam would hide it by its scale invariance.
  auto c = Config::load("", {"--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
                             "--train.steps=3", "--train.warmup_steps=0", "--train.eval_every=0", "--train.grad_clip=0",
                             "--train.optimizer=sgd", "--train.momentum=0", "--train.lr=0.5", "--train.min_lr=0.5"});
  auto small = c, big = c;
  small.train.micro_batch = 8, small.train.accum_steps = 4;
  big.train.micro_batch = 32, big.train.accum_steps = 1;
  Trainer a(small), b(big);
  for (int i = 0; i < 3; ++i) {
    auto ra = a.step(), rb = b.step();
    EXPECT_NEAR(ra.loss.item<double>(), rb.loss.item<double>(), 1e-5);
    EXPECT_NEAR(ra.grad_norm.item<double>(), rb.grad_norm.item<double>(), 1e-5 * rb.grad_norm.item<double>());
  }
  for (size_t i = 0; i < a.parameters().size(); ++i)
    EXPECT_LT(test::relative_error(a.parameters()[i], b.parameters()[i]), 1e-5) << "parameter " << i;
}

TEST(Accumulation, ActivationPeakScalesWithMicroBatch) {
  auto c = test::tiny_gpt_config(4);
  c.model.block_size = 64;
  auto small = c, big = c;
  small.train.micro_batch = 8, small.train.accum_steps = 4;
  big.train.micro_batch = 32, big.train.accum_steps = 1;
  Trainer a(small), b(big);
  a.step(), b.step();
  a.step(), b.step();  // step 1: gradients and optimizer state already exist in both
  const auto act_small = a.tracker().last()[0].activation_peak;
  const auto act_big = b.tracker().last()[0].activation_peak;
  EXPECT_LT(act_small, act_big / 2) << act_small << " vs " << act_big;
}

// Every example config runs as documented: a few steps each (CUDA configs on a GPU only).
// A config that starts from another example's export (model.init_from = runs/llama_austen_hf, the LoRA
// example): that base is made here as the README makes it, 2 steps of llama_austen_bpe_cpu.ini exported.
std::string example_base(const std::string& init_from) {
  const auto dir = std::filesystem::path(test::run_root()) / "example-base";
  const auto out = (dir / std::filesystem::path(init_from).filename()).string();
  if (std::filesystem::exists(out)) return out;
  int code = -1;
  const auto log = test::shell(test::binary("memtrain") + " --config " + test::source("examples/configs/llama_austen_bpe_cpu.ini") +
                                   " --train.steps=2 --train.warmup_steps=1 --train.eval_every=0 --log.progress=lines --log.dir=" +
                                   dir.string() + " --log.name=base 2>&1 && " + test::binary("memtrain") +
                                   " export --checkpoint " + (dir / "base" / "checkpoints").string() + " --out " + out + " 2>&1",
                               &code);
  EXPECT_EQ(code, 0) << log;
  return out;
}

void run_examples(bool cuda) {
  int ran = 0;
  for (const auto& f : std::filesystem::directory_iterator(test::source("examples/configs"))) {
    if (f.path().extension() != ".ini") continue;
    std::vector<std::string> overrides = {"--train.steps=2", "--train.warmup_steps=1", "--train.eval_every=0",
                                          "--log.dir=" + test::tiny_gpt_config().log.dir};
    auto ini = Config::ini_values(read_file_bytes(f.path().string()));
    // The device first: a config of the other kind is not run, so its init_from base is not made (on the GPU
    // machine, the CPU LoRA example's missing base made Config::load throw before the device was looked at).
    if ((ini["train.device"] == "cuda") != cuda) continue;
    SCOPED_TRACE(f.path().filename().string());
    // An 8B model's configs only load here: the one for several GPUs (llama3_8b_8xh100.ini: about 128 GB of model
    // states before activations, for 8 ranks of ZeRO-3) is for `memtrain estimate/plan --target` (TargetEstimate.*);
    // the one for a single GPU (llama3_8b_1xh100.ini, 70.7 GiB of an H100's 80 estimated) needs the whole device to
    // itself, not beside the CUDA tests running in parallel: GPU_CHECK_MODE=speed trains it alone.
    if (f.path().stem().string().starts_with("llama3_8b_")) {
      EXPECT_NO_THROW(Config::load(f.path().string(), overrides));
      continue;
    }
    const auto init_from = ini["model.init_from"];
    if (!init_from.empty()) overrides.push_back("--model.init_from=" + example_base(init_from));
    auto c = Config::load(f.path().string(), overrides);
    Trainer t(c);
    // A finite loss no higher than a uniform guess over the classes (ln V; a fresh model sits near it,
    // within 0.5 for the ResNet's BatchNorm start), for the first steps of every example.
    const auto info = t.data().info();
    const double classes = c.model.name == "gpt" || c.model.name == "llama" ? static_cast<double>(info.vocab_size) : static_cast<double>(info.num_classes);
    for (int i = 0; i < 2; ++i) {
      const double loss = t.step().loss.item<double>();
      EXPECT_TRUE(std::isfinite(loss)) << "step " << i + 1;
      EXPECT_LT(loss, std::log(classes) + 0.5) << "step " << i + 1;
    }
    ++ran;
  }
  EXPECT_GE(ran, 1);
}

TEST(Examples, EveryCpuConfigTrains) { run_examples(/*cuda=*/false); }

TEST(Examples, EveryCudaConfigTrainsSkipWithoutGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: the CUDA example configs are not run";
  run_examples(/*cuda=*/true);
}

}  // namespace
}  // namespace memtrain

namespace memtrain {
namespace {

std::string read_all(const std::filesystem::path& p) {
  std::ifstream in(p);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The run folder and the log of a short MLP run on Fashion-MNIST.
struct OutputRun {
  std::string log;
  std::filesystem::path dir;
  std::vector<MemoryTracker::Summary> memory;
};

OutputRun output_run(const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {"--train.steps=4", "--log.every=1", "--log.progress=lines", "--train.eval_every=0",
                                   "--log.dir=" + test::tiny_gpt_config().log.dir, "--log.name=output", "--log.overwrite=true"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto c = Config::load(test::source("examples/configs/mlp_fashion_cpu.ini"), args);
  Trainer t(c);
  testing::internal::CaptureStdout();
  t.fit();
  OutputRun r{testing::internal::GetCapturedStdout(), t.run_dir(), t.tracker().summaries()};
  return r;
}

TEST(Output, DatasetBytesHaveTheirOwnColumnAndActivationsAreSteady) {
  auto r = output_run();
  ASSERT_EQ(r.memory.size(), 1u);
  const auto& m = r.memory[0];
  // Fashion-MNIST in memory: 70,000 float images of 28 x 28, 70,000 int64 labels, and the epoch's
  // permutation of the 54,000 training images (val_fraction 0.1), int64.
  const int64_t expected = 70000LL * 784 * 4 + 70000LL * 8 + 54000LL * 8;
  EXPECT_EQ(m.resident.data, expected);
  EXPECT_NE(r.log.find(format_bytes(expected)), std::string::npos) << r.log;
  // steady = the largest activation peak of steps 2..4, as the JSONL says.
  std::ifstream mem(r.dir / "memory.rank0.jsonl");
  int64_t steady = 0;
  int line_no = 0;
  for (std::string line; std::getline(mem, line);) {
    ++line_no;
    if (line_no == 1) {
      // The first step creates the AdamW moments (2 x params): resident at its end, not at its start.
      auto field = [&](const char* name) { return std::stoll(line.substr(line.find(name) + std::strlen(name) + 1)); };
      EXPECT_GE(field("\"end_allocated\"") - field("\"start_allocated\""), 2 * m.resident.params) << line;
    }
    // Steps are numbered from 1 here as in metrics.jsonl.
    EXPECT_NE(line.find("\"step\":" + std::to_string(line_no)), std::string::npos) << line;
    if (line_no > 1) {
      auto at = line.find("\"activation_peak\":") + 18;
      steady = std::max<int64_t>(steady, std::stoll(line.substr(at)));
    }
  }
  EXPECT_EQ(line_no, 4);
  EXPECT_EQ(m.steady_activation, steady);
  auto metrics = read_all(r.dir / "metrics.jsonl");
  auto first = metrics.substr(0, metrics.find('\n'));
  EXPECT_TRUE(first.find("\"step\":1,") != std::string::npos || first.find("\"step\":1}") != std::string::npos) << first;
  // CPU: no reserved figure beside the peak.
  EXPECT_NE(r.log.find("cpu: reserved is not shown"), std::string::npos) << r.log;
}

TEST(Output, AchievedFlopsAndMfuAreNamedForWhatTheyAre) {
  auto plain = output_run();
  auto metrics = read_all(plain.dir / "metrics.jsonl");
  EXPECT_EQ(metrics.find("mfu"), std::string::npos) << "no peak known on CPU: no MFU";
  EXPECT_NE(metrics.find("\"flops_per_s\":"), std::string::npos);
  EXPECT_NE(plain.log.find("MFU peak:   unknown"), std::string::npos) << plain.log;
  // With a peak given, MFU = achieved FLOP/s / peak, in the log line and summary.json.
  auto r = output_run({"--log.peak_tflops=0.5"});
  auto summary = read_all(r.dir / "summary.json");
  auto number = [&](const std::string& key) {
    auto at = summary.find("\"" + key + "\": ");
    return at == std::string::npos ? std::nan("") : std::stod(summary.substr(at + key.size() + 4));
  };
  EXPECT_NEAR(number("mfu"), number("flops_per_s") / 0.5e12, 1e-12);
  EXPECT_GT(number("samples_per_s"), 0);
  EXPECT_GT(number("rank0/cpu"), 200e6) << summary;  // peak_allocated_bytes: the images alone are 219 MB
  EXPECT_NE(r.log.find("| MFU "), std::string::npos) << r.log;
}

TEST(Output, AchievedFlopsAreTheGptFormulaTimesTokensOverTheMeasuredTime) {
  // The published count of training FLOPs per token (Kaplan et al. 2020, PaLM's appendix B, nanoGPT's
  // estimate_mfu): 6 N + 12 L C T, N the parameters but the position embeddings. N by arithmetic here: per
  // block 12 C^2 + 13 C (qkv 3C^2 + 3C, projection C^2 + C, MLP 8C^2 + 5C, two LayerNorms 4C), the tied token
  // embedding V C, the final LayerNorm 2C.
  test::TempDir dir;
  auto c = test::tiny_gpt_config();
  c.train.steps = 4, c.log.every = 1, c.log.progress = "lines", c.log.dir = dir.path(), c.log.name = "flops";
  const double L = 2, C = 32, T = 32, V = 256, B = 4;
  ASSERT_EQ(c.model.n_layer, L);
  ASSERT_EQ(c.model.n_embd, C);
  ASSERT_EQ(c.model.block_size, T);
  ASSERT_EQ(c.train.micro_batch, B);
  const double n = L * (12 * C * C + 13 * C) + V * C + 2 * C;
  const double per_token = 6 * n + 12 * L * C * T;
  Trainer t(c);
  ASSERT_EQ(t.data().info().vocab_size, V);
  testing::internal::CaptureStdout();
  t.fit();
  testing::internal::GetCapturedStdout();
  std::ifstream metrics(std::filesystem::path(dir.path()) / "flops" / "metrics.jsonl");
  int lines = 0;
  for (std::string line; std::getline(metrics, line);) {
    auto j = nlohmann::json::parse(line);
    if (!j.contains("ms_per_step")) continue;
    ++lines;
    const double seconds = j["ms_per_step"].get<double>() / 1000;
    EXPECT_NEAR(j["tokens_per_s"].get<double>(), B * T / seconds, 1e-9 * B * T / seconds) << line;
    EXPECT_NEAR(j["flops_per_s"].get<double>(), per_token * B * T / seconds, 1e-9 * per_token * B * T / seconds) << line;
  }
  EXPECT_EQ(lines, 4);
}

TEST(Output, LogLineSaysPreClipAndOneRank) {
  auto r = output_run();
  EXPECT_NE(r.log.find("grad norm (pre-clip) "), std::string::npos) << r.log;
  EXPECT_NE(r.log.find("x 1 rank = "), std::string::npos) << r.log;
  EXPECT_EQ(r.log.find("1 ranks"), std::string::npos) << r.log;
}

}  // namespace
}  // namespace memtrain

namespace memtrain {
namespace {

TEST(Training, AnUnwritableCheckpointFolderIsAnErrorBeforeTheFirstStep) {
  test::TempDir dir;
  auto c = test::tiny_gpt_config();
  c.log.name = "unwritable";
  c.checkpoint.dir = dir.file("a-file", "not a folder") + "/checkpoints";  // under a regular file
  Trainer t(c);
  auto msg = test::error_of([&] { t.fit(); });
  EXPECT_NE(msg.find("[io] checkpoint.dir '" + c.checkpoint.dir + "' is not writable"), std::string::npos) << msg;
  EXPECT_EQ(t.current_step(), 0) << "training started before the output folders were checked";
}

}  // namespace
}  // namespace memtrain
