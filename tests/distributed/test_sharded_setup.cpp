// Issue 36: a model built from shapes, each rank giving memory and values to what it holds. A Llama of 34 M
// parameters on 1, 2 and 4 Gloo processes through memtrain-run: the weights as set up (checkpoint.save_initial)
// are the same bytes at every world size, ZeRO stage and with offload, and equal to the fill routine computed
// here; under ZeRO-3 each rank's setup holds its share plus one bucket plus one tensor's values plus data, draws
// random values for its share only, and with model.init_from draws none and reads its share of the file.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>

#include "helpers.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/models/llama.h"
#include "memtrain/models/shapes.h"

namespace memtrain {
namespace {

namespace fs = std::filesystem;

// The model: 8 blocks of width 512 (8 heads, 4 key/value heads of 64), SwiGLU 1408 (8/3 x 512 rounded up to a
// multiple of 64), 8,192 tokens, untied head. Its elements by arithmetic (checked against the saved file below).
constexpr int64_t kLayers = 8, kC = 512, kKv = 256, kF = 1408, kVocab = 8192;
constexpr int64_t kBlock = 2 * kC * kC + 2 * kC * kKv + 3 * kC * kF + 2 * kC;  // q, o; k, v; gate, up, down; 2 norms
constexpr int64_t kParams = kLayers * kBlock + 2 * kVocab * kC + kC;           // embedding, head, final norm
constexpr int64_t kLargest = kVocab * kC;                                        // the embedding (and the head)
constexpr uint64_t kSeed = 1337;                                                 // llama_austen_bpe_cpu.ini's

struct SetupRun {
  int code = -1;
  std::string output;
  std::map<std::string, torch::Tensor> initial;  // initial.safetensors
  std::vector<double> losses;
  nlohmann::json summary;
};

std::string llama_args() {
  return " --config " + test::source("examples/configs/llama_austen_bpe_cpu.ini") +
         " --model.n_layer=8 --model.n_embd=512 --model.n_head=8 --model.n_kv_head=4 --model.block_size=32"
         " --train.steps=1 --train.warmup_steps=0 --train.eval_every=0 --train.eval_batches=1 --log.every=1"
         " --log.progress=lines --checkpoint.save_final=false";
}

SetupRun run_llama(int ranks, const std::string& extra) {
  static int counter = 0;
  const auto dir = fs::temp_directory_path() / ("memtrain-setup-" + std::to_string(::getpid()));
  const auto name = "run" + std::to_string(counter++);
  std::string command = test::binary("memtrain") + llama_args() + " --train.micro_batch=" + std::to_string(4 / ranks) +
                        " --log.dir=" + dir.string() + " --log.name=" + name + " " + extra;
  if (ranks > 1) command = test::binary("memtrain-run") + " --standalone --nproc-per-node " + std::to_string(ranks) + " -- " + command;
  SetupRun r;
  r.output = test::shell(command + " 2>&1", &r.code);
  const auto initial = dir / name / "checkpoints" / "initial.safetensors";
  if (fs::exists(initial)) r.initial = load_safetensors(initial.string());
  r.losses = test::metric_losses((dir / name / "metrics.jsonl").string());
  if (std::ifstream s(dir / name / "summary.json"); s.good()) r.summary = nlohmann::json::parse(s);
  fs::remove_all(dir / name);
  return r;
}

// Per rank, from its "setup:" line: the counted host peak, the resident growth, the random values drawn.
struct SetupLine {
  int64_t host_peak = -1, resident = -1, drawn = -1;
};
std::map<int, SetupLine> setup_lines(const std::string& output) {
  std::map<int, SetupLine> out;
  const std::regex line(R"(setup: +rank (\d+) in [^;]*; host peak [^(]*\((\d+) bytes\), resident high-water \+[^(]*\((-?\d+) bytes\); (\d+) random values drawn)");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), line); it != std::sregex_iterator(); ++it)
    out[std::stoi((*it)[1])] = {std::stoll((*it)[2]), std::stoll((*it)[3]), std::stoll((*it)[4])};
  return out;
}

// The fill routine, here in one process: the family's table drawn from the counter-based stream.
torch::Tensor expected_values(const std::string& name, c10::IntArrayRef sizes) {
  auto out = torch::empty(sizes);
  fill_initial(out, llama_init(ModelConfig{}, name), kSeed, name, 0);
  return out;
}

TEST(ShardedSetup, InitialWeightsAreTheSameBytesAtEveryWorldSizeStageAndOffload) {
  struct Case {
    int ranks;
    std::string extra;
  };
  const std::vector<Case> cases = {{1, "--dist.zero_stage=0"},
                                   {2, "--dist.zero_stage=0"},
                                   {2, "--dist.zero_stage=1"},
                                   {4, "--dist.zero_stage=3"},
                                   {2, "--dist.zero_stage=3 --dist.offload_optimizer=cpu"},
                                   {1, "--dist.zero_stage=1 --dist.offload_optimizer=cpu"}};
  std::vector<SetupRun> runs;
  for (const auto& c : cases) {
    runs.push_back(run_llama(c.ranks, c.extra + " --checkpoint.save_initial=true"));
    ASSERT_EQ(runs.back().code, 0) << c.ranks << " ranks, " << c.extra << ":\n" << runs.back().output;
  }
  const auto& first = runs.front().initial;
  int64_t elements = 0;
  for (const auto& [name, t] : first) elements += t.numel();
  ASSERT_EQ(elements, kParams) << "initial.safetensors holds " << first.size() << " tensors";
  for (size_t k = 1; k < runs.size(); ++k) {
    ASSERT_EQ(runs[k].initial.size(), first.size()) << cases[k].extra;
    for (const auto& [name, t] : first)
      EXPECT_TRUE(torch::equal(runs[k].initial.at(name), t)) << name << ": " << cases[k].ranks << " ranks, " << cases[k].extra;
  }
  // Equal to the fill routine computed here, and the routine follows the published table (transformers'
  // _init_weights: N(0, 0.02), norms one): the sample standard deviation of each matrix within 2% of 0.02.
  for (const auto& [name, t] : first) {
    const auto want = expected_values(name, t.sizes());
    EXPECT_TRUE(torch::equal(t, want)) << name;
    if (name.find("norm") != std::string::npos) {
      EXPECT_TRUE(torch::all(t == 1).item<bool>()) << name;
    } else {
      EXPECT_NEAR(t.std().item<double>(), 0.02, 0.02 * 0.02) << name;
      EXPECT_LT(std::abs(t.mean().item<double>()), 0.02 * 5 / std::sqrt(static_cast<double>(t.numel()))) << name;
    }
  }
  // Two names never share a stream: the q and k projections of block 0 start differently.
  EXPECT_FALSE(torch::equal(first.at("model.layers.0.self_attn.q_proj.weight").slice(0, 0, kKv),
                            first.at("model.layers.0.self_attn.k_proj.weight")));
}

TEST(ShardedSetup, UnderZeroThreeEachRankHoldsItsShareAndDrawsOnlyIt) {
  const int64_t whole = kParams * 4;  // fp32
  for (int ranks : {2, 4}) {
    const auto r = run_llama(ranks, "--dist.zero_stage=3 --dist.bucket_mib=4");
    ASSERT_EQ(r.code, 0) << r.output;
    const auto lines = setup_lines(r.output);
    ASSERT_EQ(lines.size(), static_cast<size_t>(ranks)) << r.output;
    ASSERT_TRUE(r.summary.contains("memory_estimate")) << r.output;
    const auto data = r.summary["memory_estimate"]["device"]["data"].get<int64_t>();
    const auto setup_estimate = r.summary["memory_estimate"]["setup"]["device"].get<int64_t>();
    // Its share (every bucket padded to a multiple of the ranks: at most ranks - 1 elements per bucket, 2 buckets
    // a block at most and 3 for the root here), one bucket (4 MiB, or the embedding above it), one tensor's fp32
    // values, the data; 1 MiB for everything else (names, views, the process group).
    const int64_t share = (kParams + ranks - 1) / ranks * 4 + (2 * kLayers + 3) * ranks * 4;
    const int64_t bound = share + std::max<int64_t>(4 << 20, kLargest * 4) + kLargest * 4 + data + (1 << 20);
    int64_t drawn = 0;
    for (const auto& [rank, l] : lines) {
      EXPECT_LE(l.host_peak, bound) << "rank " << rank << " of " << ranks;
      EXPECT_LE(l.host_peak, setup_estimate) << "rank " << rank << ": above the estimate's setup peak";
      EXPECT_LT(l.resident, whole) << "rank " << rank << ": resident memory grew by the whole model or more";
      EXPECT_LE(l.drawn, (kParams + ranks - 1) / ranks) << "rank " << rank << " drew more than its share";
      drawn += l.drawn;
    }
    // Together the ranks drew every random value once: all but the norms' ones.
    EXPECT_EQ(drawn, kParams - (2 * kLayers + 1) * kC) << ranks << " ranks";
    EXPECT_LT(setup_estimate, whole) << "the estimate's setup peak should be a share";
  }
}

TEST(ShardedSetup, InitFromReadsEachRanksShareDrawsNothingAndStartsAtTheSameLoss) {
  // A Hugging Face folder of this model: one process trains a step, then exports it.
  const auto dir = fs::temp_directory_path() / ("memtrain-setup-hf-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  int code = -1;
  auto out = test::shell(test::binary("memtrain") + llama_args() + " --train.micro_batch=4 --checkpoint.save_final=true"
                             " --log.dir=" + dir.string() + " --log.name=src 2>&1", &code);
  ASSERT_EQ(code, 0) << out;
  out = test::shell(test::binary("memtrain") + " export --checkpoint " + (dir / "src" / "checkpoints").string() +
                        " --out " + (dir / "hf").string() + " 2>&1", &code);
  ASSERT_EQ(code, 0) << out;
  const auto init = " --model.init_from=" + (dir / "hf").string();
  const auto one = run_llama(1, init);
  ASSERT_EQ(one.code, 0) << one.output;
  ASSERT_EQ(one.losses.size(), 1u) << one.output;
  for (int ranks : {2, 4}) {
    const auto r = run_llama(ranks, init + " --dist.zero_stage=3");
    ASSERT_EQ(r.code, 0) << r.output;
    const auto lines = setup_lines(r.output);
    ASSERT_EQ(lines.size(), static_cast<size_t>(ranks)) << r.output;
    for (const auto& [rank, l] : lines) EXPECT_EQ(l.drawn, 0) << "rank " << rank << " drew random values for loaded weights";
    // Each rank read its share of the file's bytes: the reads add up to the file's, none above a share plus the
    // padding of its buckets.
    const std::regex read(R"(rank (\d+) read [^(]*\(its shard\), host \+[^(]*\(-?\d+ bytes; read (\d+) of (\d+)\))");
    int64_t total = 0, count = 0;
    for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), read); it != std::sregex_iterator(); ++it) {
      const auto bytes = std::stoll((*it)[2]), all = std::stoll((*it)[3]);
      EXPECT_LE(bytes, (all + ranks - 1) / ranks + (2 * kLayers + 3) * ranks * 4) << "rank " << (*it)[1];
      total += bytes, ++count;
      EXPECT_EQ(all, kParams * 4) << "the export is fp32";
    }
    EXPECT_EQ(count, ranks) << r.output;
    EXPECT_EQ(total, kParams * 4);
    // The first step's loss is taken before any update: the loaded weights, the same data.
    ASSERT_EQ(r.losses.size(), 1u) << r.output;
    EXPECT_NEAR(r.losses[0], one.losses[0], 1e-5 * one.losses[0]) << ranks << " ranks";
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace memtrain
