// Tensor parallelism (dist.tensor_parallel, models/tensor_parallel.h) on Gloo processes started through memtrain-run:
// a GPT and a GQA Llama split over 2 and 4 ranks, with and without sequence parallelism, recomputation and
// accumulation, and 2 x 2 grids with ZeRO-2 and ZeRO-3, train as one process does (losses, pre-clip gradient norms and
// final weights); checkpoints saved on one grid resume on another; the slices sit where the arithmetic says.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <tuple>

#include "helpers.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/models/tensor_parallel.h"
#include "memtrain/runtime/factories.h"

namespace memtrain {
namespace {

namespace fs = std::filesystem;

// ---- Where a slice sits in the whole: for_each_whole_run against narrow() on an arange ----------------------------

// Rank r's slice of `whole` by the split's definition, written with narrow and cat: `chunks` equal blocks along dim,
// each split in T pieces (one block: pieces of ceil(n / T), the last ones shorter).
torch::Tensor expected_slice(const torch::Tensor& whole, const TensorSplit& s, int r, int T) {
  const int64_t n = whole.size(s.dim);
  if (s.chunks == 1) {
    const int64_t piece = (n + T - 1) / T;
    const int64_t begin = std::min(n, piece * r);
    return whole.narrow(s.dim, begin, std::min(piece, n - begin));
  }
  const int64_t block = n / s.chunks, piece = block / T;
  std::vector<torch::Tensor> parts;
  for (int64_t c = 0; c < s.chunks; ++c) parts.push_back(whole.narrow(s.dim, c * block + r * piece, piece));
  return torch::cat(parts, s.dim);
}

TEST(TensorSplit, RunsPutEachSliceAtItsPlaceInTheWhole) {
  struct Case {
    std::vector<int64_t> whole;
    TensorSplit split;
    int ranks;
  };
  const std::vector<Case> cases = {
      {{12, 5}, {.dim = 0, .chunks = 3, .whole = 12}, 2},  // a fused q, k, v weight (column-parallel by head)
      {{12}, {.dim = 0, .chunks = 3, .whole = 12}, 2},     // and its bias
      {{6, 8}, {.dim = 1, .chunks = 1, .whole = 8}, 4},    // a row-parallel weight
      {{7, 3}, {.dim = 0, .chunks = 1, .whole = 7}, 2},    // a vocabulary T does not divide: 4 + 3 rows
      {{5, 2}, {.dim = 0, .chunks = 1, .whole = 5}, 4},    // 2 + 2 + 1 + 0 rows
  };
  for (const auto& c : cases) {
    const auto whole = torch::arange(c10::multiply_integers(c.whole), torch::kFloat).view(c.whole);
    const auto flat = whole.view({-1});
    int64_t total = 0;
    for (int r = 0; r < c.ranks; ++r) {
      const auto want = expected_slice(whole, c.split, r, c.ranks).contiguous();
      auto sizes = c.whole;
      sizes[static_cast<size_t>(c.split.dim)] = split_size(c.split, r, c.ranks);
      ASSERT_EQ(sizes, want.sizes().vec()) << "rank " << r;
      EXPECT_EQ(whole_sizes(c.split, sizes), c.whole);
      total += want.numel();
      // Every element, then a range that starts and ends inside runs (a ZeRO part of the slice).
      for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, want.numel()}, {std::min<int64_t>(3, want.numel()), std::max<int64_t>(want.numel() - 2, 0)}}) {
        if (begin >= end) continue;
        auto got = torch::full({end - begin}, -1.0f);
        for_each_whole_run(c.split, sizes, r, c.ranks, begin, end, [&](int64_t l, int64_t w, int64_t n) {
          ASSERT_GE(l, begin);
          ASSERT_LE(l + n, end);
          got.slice(0, l - begin, l - begin + n).copy_(flat.slice(0, w, w + n));
        });
        EXPECT_TRUE(torch::equal(got, want.view({-1}).slice(0, begin, end)))
            << "split dim " << c.split.dim << " chunks " << c.split.chunks << ", rank " << r << " of " << c.ranks
            << ", elements [" << begin << ", " << end << ")";
      }
    }
    EXPECT_EQ(total, whole.numel()) << "the slices cover the whole once";
  }
}

// whole_run_granularity: the gcd of every run's start in the slice and in the whole and of its length, over all ranks
// (by hand from the definitions above).
TEST(TensorSplit, RunGranularityIsWhereEverySlicesRunsStartAndEnd) {
  // A row-parallel (6, 8) weight on 4 ranks: rank r's runs are 2 columns at whole offsets 8 i + 2 r, local 2 i.
  EXPECT_EQ(whole_run_granularity({.dim = 1, .chunks = 1, .whole = 8}, std::vector<int64_t>{6, 2}, 4), 2);
  // On 2 ranks: runs of 4.
  EXPECT_EQ(whole_run_granularity({.dim = 1, .chunks = 1, .whole = 8}, std::vector<int64_t>{6, 4}, 2), 4);
  // A fused q, k, v weight (96, 32) on 2 ranks: pieces of 16 rows x 32 at whole rows 32 c + 16 r: gcd 512.
  EXPECT_EQ(whole_run_granularity({.dim = 0, .chunks = 3, .whole = 96}, std::vector<int64_t>{48, 32}, 2), 512);
  // A vocabulary of 259 rows of 32 on 2 ranks: 130 x 32 at 0, 129 x 32 at 4160: gcd(4160, 4128) = 32.
  EXPECT_EQ(whole_run_granularity({.dim = 0, .chunks = 1, .whole = 259}, std::vector<int64_t>{130, 32}, 2), 32);
}

// ---- Training on grids ----------------------------------------------------------------------------------------------

struct GridRun {
  int code = -1;
  std::string output;
  std::vector<double> losses, grad_norms;
  std::map<std::string, torch::Tensor> weights;  // checkpoints/model.safetensors
  fs::path dir;                                  // the run folder (removed by the test's TempDir)
};

// The number `key` of each line of a run's metrics.jsonl that has it; null (a skipped fp16 step's gradient norm): NaN.
std::vector<double> metric_numbers(const fs::path& metrics, const std::string& key) {
  std::vector<double> out;
  std::ifstream in(metrics);
  std::smatch m;
  const std::regex number("\"" + key + "\":([^,}]+)");
  for (std::string line; std::getline(in, line);)
    if (std::regex_search(line, m, number)) out.push_back(m[1] == "null" ? std::nan("") : std::stod(m[1]));
  return out;
}

// memtrain on the Austen bytes (examples/configs/gpt_austen_cpu.ini, then `args`) as one process (ranks = 1) or `ranks`
// through memtrain-run, logging into dir/name: its output, and its exit status in *code.
std::string run_on_austen(const test::TempDir& dir, const std::string& name, int ranks, const std::string& args, int* code) {
  std::string command = test::binary("memtrain") + " --config " + test::source("examples/configs/gpt_austen_cpu.ini") +
                        " " + args + " --log.dir=" + dir.path() + " --log.name=" + name;
  if (ranks > 1)
    command = "timeout 300 " + test::binary("memtrain-run") + " --standalone --nproc-per-node " + std::to_string(ranks) +
              " -- " + command;
  return test::shell(command + " 2>&1", code);
}

// A run's measured peak over the run (MiB) and its estimate's error (%), from the output's memory line.
std::optional<std::pair<double, double>> peak_against_estimate(const std::string& out) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex(R"(memory: peak cpu over the run ([0-9.]+) (KiB|MiB|GiB) \(estimate [^,]*, ([-+][0-9.]+)%\))")))
    return std::nullopt;
  const double unit = m[2] == "KiB" ? 1.0 / 1024 : m[2] == "GiB" ? 1024.0 : 1.0;
  return std::make_pair(std::stod(m[1]) * unit, std::stod(m[3]));
}

// 4 steps of a small model on the Austen bytes: one process (ranks = 1) or `ranks` through memtrain-run, with
// `micro` samples per micro-batch on each data-parallel rank and 2 micro-batches per step.
GridRun train(const test::TempDir& dir, const std::string& name, int ranks, int micro, const std::string& extra) {
  GridRun r;
  r.output = run_on_austen(dir, name, ranks,
                           "--model.block_size=32 --train.steps=4 --train.warmup_steps=1 --train.eval_every=0"
                           " --train.accum_steps=2 --log.every=1 --log.progress=lines --train.micro_batch=" +
                               std::to_string(micro) + " " + extra,
                           &r.code);
  r.dir = fs::path(dir.path()) / name;
  r.losses = metric_numbers(r.dir / "metrics.jsonl", "loss");
  r.grad_norms = metric_numbers(r.dir / "metrics.jsonl", "grad_norm");
  if (fs::exists(r.dir / "checkpoints" / "model.safetensors"))
    r.weights = load_safetensors((r.dir / "checkpoints" / "model.safetensors").string());
  return r;
}

// The last `field` of a rank's memory.rank<r>.jsonl ("params": the resident parameter bytes the tracker counted;
// "optimizer_state": its state's).
int64_t resident(const fs::path& run, int rank, const char* field = "params") {
  std::ifstream in(run / ("memory.rank" + std::to_string(rank) + ".jsonl"));
  int64_t bytes = -1;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains(field)) bytes = j[field].get<int64_t>();
  }
  return bytes;
}

// Losses and pre-clip gradient norms of every step within `tol` (relative), and every final weight within `weight_tol`
// (max |a - b| / max |b|) of one process's. The weights' 1e-4 is the data-parallel tests' (test_data_parallel.cpp):
// AdamW divides by sqrt(v), so a gradient element near zero, summed in another order, moves its weight by up to lr;
// measured here 1.9e-5 on one Llama q_proj element, the rest below 1e-5.
// `code_flips` (low-bit state): that many weight elements over all tensors may differ by more, each by at most the 4 steps'
// lr: a moment within rounding of the midpoint of two codes takes either one, and Adam's normalised step moves that
// element by up to lr each step.
void expect_same_training(const GridRun& one, const GridRun& grid, const std::string& what, double tol = 1e-5,
                          double weight_tol = 1e-4, int64_t code_flips = 0) {
  ASSERT_EQ(one.code, 0) << one.output;
  ASSERT_EQ(grid.code, 0) << what << "\n" << grid.output;
  ASSERT_EQ(one.losses.size(), 4u) << one.output;
  ASSERT_EQ(grid.losses.size(), one.losses.size()) << what << "\n" << grid.output;
  ASSERT_EQ(grid.grad_norms.size(), one.grad_norms.size()) << what;
  for (size_t s = 0; s < one.losses.size(); ++s) {
    EXPECT_NEAR(grid.losses[s], one.losses[s], tol * std::abs(one.losses[s])) << what << ", step " << s + 1;
    if (std::isnan(one.grad_norms[s]))  // an fp16 step that overflowed: the grid's too
      EXPECT_TRUE(std::isnan(grid.grad_norms[s])) << what << ", grad norm, step " << s + 1 << ": " << grid.grad_norms[s];
    else
      EXPECT_NEAR(grid.grad_norms[s], one.grad_norms[s], tol * std::abs(one.grad_norms[s])) << what << ", grad norm, step " << s + 1;
  }
  ASSERT_FALSE(one.weights.empty());
  ASSERT_EQ(grid.weights.size(), one.weights.size()) << what << ": model.safetensors holds other tensors";
  int64_t flipped = 0;
  for (const auto& [name, w] : one.weights) {
    ASSERT_TRUE(grid.weights.count(name)) << what << ": no " << name;
    const auto& g = grid.weights.at(name);
    ASSERT_EQ(g.sizes(), w.sizes()) << what << ": " << name << " is not whole";
    if (name.ends_with("attn.c_attn.bias")) {
      // As in tests/models/test_parity.cpp: the key third of GPT's q, k, v bias has a gradient that is zero but for
      // rounding (softmax ignores a shift every key shares), which AdamW, dividing by sqrt(v), turns into steps of up
      // to lr whose signs no two summation orders share. The query and value thirds are compared; the key third
      // only stays within those steps (4 steps of lr 2e-3 from the same start, on either side).
      const int64_t C = w.size(0) / 3;
      auto query_value = [&](const torch::Tensor& b) { return torch::cat({b.slice(0, 0, C), b.slice(0, 2 * C)}); };
      EXPECT_LT(test::relative_error(query_value(g), query_value(w)), weight_tol) << what << ": " << name;
      EXPECT_LE((g.slice(0, C, 2 * C) - w.slice(0, C, 2 * C)).abs().max().item<double>(), 2 * 4 * 2e-3 * 1.01)
          << what << ": " << name << " (key)";
      continue;
    }
    if (code_flips == 0) {
      EXPECT_LT(test::relative_error(g, w), weight_tol) << what << ": " << name;
      continue;
    }
    const auto diff = (g - w).abs();
    const auto beyond = diff > weight_tol * w.abs().max();
    flipped += beyond.sum().item<int64_t>();
    if (beyond.any().item<bool>())
      EXPECT_LE(diff.max().item<double>(), 4 * 2e-3 * 1.01) << what << ": " << name << " moved beyond 4 steps of lr";
  }
  EXPECT_LE(flipped, code_flips) << what << ": weight elements beyond " << weight_tol << " of one process's";
}

// GPT, bytes (vocabulary 259: split 130 + 129 over 2 ranks, 65 x 3 + 64 over 4), 4 heads.
const std::string kGpt = "--model.n_layer=2 --model.n_head=4 --model.n_embd=32 --model.vocab_size=259";

TEST(TensorParallel, GptOnTwoAndFourRanksTrainsAsOneProcess) {
  test::TempDir dir;
  const auto one = train(dir, "one", 1, 8, kGpt);
  expect_same_training(one, train(dir, "t2", 2, 8, kGpt + " --dist.tensor_parallel=2"), "T = 2, sequence parallel");
  expect_same_training(one, train(dir, "t2_plain", 2, 8, kGpt + " --dist.tensor_parallel=2 --dist.sequence_parallel=off"),
                       "T = 2 without sequence parallelism");
  const auto four = train(dir, "t4", 4, 8, kGpt + " --dist.tensor_parallel=4 --memory.recompute=all");
  expect_same_training(one, four, "T = 4, sequence parallel, every block recomputed");
  EXPECT_NE(four.output.find("4 ranks: 1 data-parallel x 4 tensor-parallel"), std::string::npos) << four.output;
}

// Llama with grouped key/value heads (4 query heads, 2 kv heads: 2 and 1 per rank at T = 2), SwiGLU, RMSNorm,
// rotary positions, an untied head.
const std::string kLlama = "--model.name=llama --model.n_layer=2 --model.n_head=4 --model.n_kv_head=2 --model.n_embd=32"
                           " --model.tie_embeddings=false --model.vocab_size=256";

TEST(TensorParallel, GqaLlamaOnTwoRanksTrainsAsOneProcess) {
  test::TempDir dir;
  const auto one = train(dir, "one", 1, 8, kLlama);
  expect_same_training(one, train(dir, "t2", 2, 8, kLlama + " --dist.tensor_parallel=2 --memory.recompute=attn"),
                       "T = 2, sequence parallel, attention recomputed");
  expect_same_training(one, train(dir, "t2_plain", 2, 8, kLlama + " --dist.tensor_parallel=2 --dist.sequence_parallel=off"),
                       "T = 2 without sequence parallelism");
}

// LoRA's adapters split with their maps (a column-parallel map's B by rows, GPT's fused c_attn by q, k, v block, and
// its A whole with the gradient summed over the group; a row-parallel map's A by columns, its B whole) and train.freeze
// on a split model (the vocabulary-split embedding, column-split k_proj weights and the replicated norms frozen): as
// one process, with and without sequence parallelism, and on a 2 x 2 grid with ZeRO-3 (frozen buckets sharded too).
TEST(TensorParallel, LoraAndFrozenParametersTrainAsOneProcess) {
  test::TempDir dir;
  const std::string gpt_lora = kGpt + " --lora.rank=4 --lora.alpha=8 --lora.targets=c_attn,c_proj,c_fc --train.lr=1e-2";
  const auto gpt = train(dir, "gpt_lora", 1, 8, gpt_lora);
  expect_same_training(gpt, train(dir, "gpt_lora_t2", 2, 8, gpt_lora + " --dist.tensor_parallel=2"),
                       "GPT, LoRA on every map, T = 2, sequence parallel");
  const std::string llama_lora =
      kLlama + " --lora.rank=4 --lora.targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --train.lr=1e-2";
  const auto llama = train(dir, "llama_lora", 1, 8, llama_lora);
  expect_same_training(llama,
                       train(dir, "llama_lora_t2", 2, 8, llama_lora + " --dist.tensor_parallel=2 --dist.sequence_parallel=off"),
                       "Llama, LoRA on every map, T = 2 without sequence parallelism");
  expect_same_training(llama,
                       train(dir, "llama_lora_2x2", 4, 4, llama_lora + " --dist.tensor_parallel=2 --dist.zero_stage=3"),
                       "Llama, LoRA on every map, 2 x 2, ZeRO-3");
  const std::string frozen = kLlama + " --train.freeze='model\\.embed_tokens\\.weight|.*k_proj\\.weight|.*layernorm\\.weight'";
  const auto one = train(dir, "frozen", 1, 8, frozen);
  const auto two = train(dir, "frozen_t2", 2, 8, frozen + " --dist.tensor_parallel=2");
  expect_same_training(one, two, "Llama, train.freeze, T = 2, sequence parallel");
  EXPECT_NE(two.output.find("parameters match"), std::string::npos) << two.output;
  // The frozen, vocabulary-split embedding comes back whole and bitwise one process's.
  ASSERT_TRUE(two.weights.count("model.embed_tokens.weight"));
  EXPECT_TRUE(torch::equal(two.weights.at("model.embed_tokens.weight"), one.weights.at("model.embed_tokens.weight")));
}

// bf16: autocast (fp32 parameters) on 2 tensor-parallel ranks, and bf16 parameters with fp32 masters on a 2 x 2 grid
// with ZeRO-1, against one process at bf16's precision (as the data-parallel tests: SGD, whose error stays
// proportional; bf16 products over other shapes round differently; the split adds its partial sums in bf16).
TEST(TensorParallel, Bf16TrainsAsOneProcessToBf16sPrecision) {
  test::TempDir dir;
  const std::string autocast = kGpt + " --train.precision=bf16 --train.optimizer=sgd --train.lr=0.05";
  expect_same_training(train(dir, "autocast", 1, 8, autocast),
                       train(dir, "autocast_t2", 2, 8, autocast + " --dist.tensor_parallel=2"), "bf16 autocast, T = 2",
                       2e-3, 2e-2);
  const std::string params = kLlama + " --train.param_dtype=bf16 --train.precision=bf16 --train.optimizer=sgd --train.lr=0.05";
  expect_same_training(train(dir, "params", 1, 8, params),
                       train(dir, "params_2x2", 4, 4, params + " --dist.tensor_parallel=2 --dist.zero_stage=1"),
                       "bf16 parameters, fp32 masters, 2 x 2, ZeRO-1", 5e-3, 5e-2);
}

// fp16 with dynamic loss scaling (on the CPU, as torch.amp runs it there): a scale so large that the first steps' fp16
// gradients overflow. Every rank of the grid skips the same steps (found-inf is a maximum over the data-parallel and the
// tensor-parallel group) and so the scale goes as one process's; losses and weights to fp16's precision (the split adds
// its partial products in fp16).
TEST(TensorParallel, Fp16SkipsAndScalesAsOneProcess) {
  test::TempDir dir;
  const std::string fp16 = kGpt + " --train.precision=fp16 --train.optimizer=sgd --train.lr=0.05"
                                  " --train.loss_scale_init=16777216 --train.loss_scale_backoff=0.125 --train.loss_scale_interval=2";
  auto skipped = [](const GridRun& r) {
    std::vector<bool> out;
    std::ifstream in(r.dir / "metrics.jsonl");
    for (std::string line; std::getline(in, line);)
      if (line.find("\"loss_scale\"") != std::string::npos) out.push_back(line.find("\"skipped\":true") != std::string::npos);
    return out;
  };
  const auto one = train(dir, "one", 1, 8, fp16);
  const auto scales = metric_numbers(one.dir / "metrics.jsonl", "loss_scale");
  const auto skips = skipped(one);
  ASSERT_EQ(scales.size(), 4u) << one.output;
  // The one-process run skips and then steps, or this test would check less than it says.
  ASSERT_TRUE(skips.front() && !skips.back()) << one.output;
  for (const auto& [name, ranks, micro, extra] :
       {std::tuple{"t2", 2, 8, " --dist.tensor_parallel=2"},
        std::tuple{"2x2", 4, 4, " --dist.tensor_parallel=2 --dist.zero_stage=2 --dist.sequence_parallel=off"}}) {
    const auto grid = train(dir, name, ranks, micro, fp16 + extra);
    expect_same_training(one, grid, std::string("fp16, ") + name, 2e-3, 2e-2);
    EXPECT_EQ(metric_numbers(grid.dir / "metrics.jsonl", "loss_scale"), scales) << name;
    EXPECT_EQ(skipped(grid), skips) << name;
  }
}

// 2 x 2: tensor parallel within pairs of ranks, ZeRO across them (each data-parallel rank half the samples).
TEST(TensorParallel, TwoByTwoGridsWithZeroTrainAsOneProcess) {
  test::TempDir dir;
  const auto gpt = train(dir, "gpt", 1, 8, kGpt);
  expect_same_training(gpt, train(dir, "gpt_2x2", 4, 4, kGpt + " --dist.tensor_parallel=2 --dist.zero_stage=2"),
                       "GPT 2 x 2, ZeRO-2");
  const auto llama = train(dir, "llama", 1, 8, kLlama);
  expect_same_training(llama,
                       train(dir, "llama_2x2", 4, 4, kLlama + " --dist.tensor_parallel=2 --dist.zero_stage=3 --memory.recompute=all"),
                       "Llama 2 x 2, ZeRO-3, every block recomputed");
}

// A checkpoint holds whole tensors whatever the grid: saved at step 2 by T = 2 (and by a 2 x 2 grid at ZeRO-1), it
// resumes in one process (and on 4 tensor-parallel ranks), whose steps 3 and 4 are those of the run that saved it (1e-6).
// `memtrain export` of the grid's checkpoint writes the whole model the grid's final weights are.
TEST(TensorParallel, CheckpointsResumeOnAnotherGridAndExportWhole) {
  test::TempDir dir;
  const std::string every = " --checkpoint.every=2 --checkpoint.keep=5";
  auto resume = [&](const GridRun& saved, const std::string& name, int ranks, int micro, const std::string& extra) {
    const auto step2 = saved.dir / "checkpoints" / "step-000002";
    EXPECT_TRUE(fs::exists(step2)) << saved.output;
    return train(dir, name, ranks, micro, extra + " --checkpoint.resume=" + step2.string());
  };
  auto expect_continues = [](const GridRun& saved, const GridRun& resumed, const std::string& what) {
    ASSERT_EQ(resumed.code, 0) << what << "\n" << resumed.output;
    ASSERT_EQ(saved.losses.size(), 4u) << saved.output;
    ASSERT_EQ(resumed.losses.size(), 2u) << what << "\n" << resumed.output;  // steps 3 and 4
    for (size_t s = 0; s < 2; ++s)
      EXPECT_NEAR(resumed.losses[s], saved.losses[s + 2], 1e-6 * saved.losses[s + 2]) << what << ", step " << s + 3;
  };
  const auto t2 = train(dir, "t2", 2, 8, kGpt + " --dist.tensor_parallel=2" + every);
  ASSERT_EQ(t2.code, 0) << t2.output;
  expect_continues(t2, resume(t2, "t2_to_one", 1, 8, kGpt), "T = 2 -> one process");
  const auto grid = train(dir, "grid", 4, 4, kGpt + " --dist.tensor_parallel=2 --dist.zero_stage=1" + every);
  ASSERT_EQ(grid.code, 0) << grid.output;
  expect_continues(grid, resume(grid, "grid_to_t4", 4, 8, kGpt + " --dist.tensor_parallel=4"), "2 x 2 -> 4 x 1");

  const auto out = dir.path("exported");
  const auto final_step = t2.dir / "checkpoints" / "step-000004";
  int code = -1;
  const auto printed = test::shell(test::binary("memtrain") + " export --checkpoint " + final_step.string() + " --out " + out + " 2>&1", &code);
  ASSERT_EQ(code, 0) << printed;
  const auto exported = load_safetensors(out + "/model.safetensors");
  const auto& wte = t2.weights.at("wte.weight");
  ASSERT_TRUE(exported.count("transformer.wte.weight")) << printed;
  EXPECT_TRUE(torch::equal(exported.at("transformer.wte.weight"), wte)) << "the exported embedding is the gathered one";
  // GPT-2's Conv1D layout: the fused q, k, v weight transposed, whole (3 x 32 outputs).
  const auto& qkv = exported.at("transformer.h.0.attn.c_attn.weight");
  ASSERT_EQ(qkv.sizes(), (std::vector<int64_t>{32, 96}));
  EXPECT_TRUE(torch::equal(qkv, t2.weights.at("h.0.attn.c_attn.weight").t()));
}

// Low-bit AdamW state on split parameters: each slice's blocks are blocks of the whole parameter (the vocabulary split
// 130 + 129 rows of 32, q, k and v by 16-row pieces, the row-parallel maps by 16- and 64-column runs), so T = 2 quantizes
// what one process quantizes and trains as it does; a checkpoint keeps the codes and absmaxes whole and resumes in one
// process. A block that would straddle two slices' runs is refused, naming the parameter and the blocks that work.
TEST(TensorParallel, LowBitStateTrainsAsOneProcessAndResumesOnAnotherGrid) {
  test::TempDir dir;
  const std::string eight = kGpt + " --train.optimizer=adamw8bit --train.optimizer_block=16 --train.optimizer_min_quantized=1024";
  const std::string every = " --checkpoint.every=2 --checkpoint.keep=5";
  const auto one = train(dir, "one", 1, 8, eight);
  const auto t2 = train(dir, "t2", 2, 8, eight + " --dist.tensor_parallel=2" + every);
  // 4 steps of 40,000 elements: 3 came within rounding of a midpoint when this test was written, 10 are allowed.
  // Blocks cut elsewhere than one process's would quantize every moment differently (a different absmax per block).
  expect_same_training(one, t2, "adamw8bit, T = 2, sequence parallel", 1e-5, 1e-4, 10);
  // Rank 0's state by arithmetic: a slice whose whole parameter has 1,024 elements or more (even when the slice has
  // fewer: the attention's c_proj, 512) keeps a code byte per element and an fp32 absmax per 16 for each moment
  // (2.5 bytes per element); the rest two fp32 moments (8 bytes). Slices quantized by their own size would keep 8 bytes
  // for the attention's c_proj.
  const auto quantized = [](int64_t n) { return n * 5 / 2; };
  const auto fp32 = [](int64_t n) { return n * 8; };
  const int64_t block = quantized(48 * 32) + fp32(48) + quantized(32 * 16) + fp32(32) + fp32(4 * 32) +  // attention, norms
                        quantized(64 * 32) + fp32(64) + quantized(32 * 64) + fp32(32);                   // MLP
  const int64_t state = quantized(130 * 32) + quantized(32 * 32) + 2 * block + fp32(2 * 32);  // wte rows, wpe, ln_f
  EXPECT_EQ(resident(t2.dir, 0, "optimizer_state"), state);
  const std::string four = kGpt + " --train.optimizer=adamw4bit --train.optimizer_block=16 --train.optimizer_min_quantized=1024";
  const auto grid4 = train(dir, "grid4", 4, 4, four + " --dist.tensor_parallel=2 --dist.zero_stage=2" + every);
  expect_same_training(train(dir, "one4", 1, 8, four), grid4, "adamw4bit, 2 x 2, ZeRO-2", 1e-5, 1e-4, 10);
  // The 2 x 2 grid's ZeRO parts cut the slices mid-run; its checkpoint resumes on 2 tensor-parallel ranks, each reading
  // its slice's codes and absmaxes back from their whole places.
  const auto from_grid = train(dir, "grid4_to_t2", 2, 8,
                               four + " --dist.tensor_parallel=2 --checkpoint.resume=" +
                                   (grid4.dir / "checkpoints" / "step-000002").string());
  ASSERT_EQ(from_grid.code, 0) << from_grid.output;
  ASSERT_EQ(from_grid.losses.size(), 2u) << from_grid.output;
  for (size_t s = 0; s < 2; ++s)
    EXPECT_NEAR(from_grid.losses[s], grid4.losses[s + 2], 1e-6 * grid4.losses[s + 2]) << "2 x 2 -> T = 2, step " << s + 3;
  // The state is saved whole: the checkpoint's codes are one process's shape, and one process continues the run.
  const auto step2 = t2.dir / "checkpoints" / "step-000002";
  const auto resumed = train(dir, "t2_to_one", 1, 8, eight + " --checkpoint.resume=" + step2.string());
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  ASSERT_EQ(resumed.losses.size(), 2u) << resumed.output;
  for (size_t s = 0; s < 2; ++s)
    EXPECT_NEAR(resumed.losses[s], t2.losses[s + 2], 1e-6 * t2.losses[s + 2]) << "T = 2 -> one process, step " << s + 3;
  const auto refused = train(dir, "t4", 4, 8, eight + " --dist.tensor_parallel=4");
  EXPECT_NE(refused.code, 0);
  EXPECT_NE(refused.output.find("h.0.attn.c_proj.weight (1024 elements) has quantized moments in blocks of 16"), std::string::npos)
      << refused.output;
  EXPECT_NE(refused.output.find("an even divisor of 8 (8)"), std::string::npos) << refused.output;
}

// The largest "peak_allocated" of a rank's memory.rank<r>.jsonl (every step's).
int64_t largest_peak(const fs::path& run, int rank) {
  std::ifstream in(run / ("memory.rank" + std::to_string(rank) + ".jsonl"));
  int64_t peak = -1;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains("peak_allocated")) peak = std::max(peak, j["peak_allocated"].get<int64_t>());
  }
  return peak;
}

// memory.budget_mib on a split model: rank 0 plans over this rank's slices (the split shapes' closed form, ZeRO over the
// data-parallel ranks, the plain vocabulary-parallel head only) and every rank takes its choice. Budgets of 70% and 45%
// of the unplanned run's activations above its model states and data: every rank's measured peak stays within the
// budget, the global batch is kept, and the run trains as the unplanned one (another micro-batch split: 1e-5).
TEST(TensorParallel, BudgetPlansTheSplitModelAndEveryRankFits) {
  test::TempDir dir;
  const std::string wide = kGpt + " --model.block_size=128 --model.n_layer=4 --model.n_embd=64 --dist.tensor_parallel=2";
  const auto plain = train(dir, "plain", 2, 8, wide);
  ASSERT_EQ(plain.code, 0) << plain.output;
  const int64_t plain_peak = std::max(largest_peak(plain.dir, 0), largest_peak(plain.dir, 1));
  const int64_t at_start = [&] {  // the model states and the data, before any activation
    std::ifstream in(plain.dir / "memory.rank0.jsonl");
    std::string line;
    std::getline(in, line);
    return nlohmann::json::parse(line)["start_allocated"].get<int64_t>();
  }();
  for (const double share : {0.7, 0.45}) {
    SCOPED_TRACE("budget: " + std::to_string(share) + " of the activations");
    const int64_t budget = at_start + static_cast<int64_t>(share * static_cast<double>(plain_peak - at_start));
    const auto name = "planned" + std::to_string(static_cast<int>(share * 100));
    const auto planned = train(dir, name, 2, 8, wide + " --memory.budget_mib=" + std::to_string(budget / 1048576.0));
    ASSERT_EQ(planned.code, 0) << planned.output;
    EXPECT_NE(planned.output.find("plan for a budget"), std::string::npos) << planned.output;
    for (int r = 0; r < 2; ++r) EXPECT_LE(largest_peak(planned.dir, r), budget) << "rank " << r << "\n" << planned.output;
    ASSERT_EQ(planned.losses.size(), plain.losses.size()) << planned.output;
    for (size_t i = 0; i < plain.losses.size(); ++i)
      EXPECT_NEAR(planned.losses[i], plain.losses[i], 1e-5 * plain.losses[i]) << "step " << i + 1;
  }
}

// What cannot be split is refused before anything runs, naming the keys.
TEST(TensorParallel, RefusesWhatItCannotSplit) {
  test::TempDir dir;
  auto refused = [&](const std::string& name, int ranks, const std::string& extra) {
    const auto r = train(dir, name, ranks, 8, extra);
    EXPECT_NE(r.code, 0) << r.output;
    return r.output;
  };
  EXPECT_NE(refused("heads", 2, "--model.n_head=3 --model.n_embd=48 --model.n_layer=1 --dist.tensor_parallel=2")
                .find("dist.tensor_parallel = 2 must divide model.n_head = 3"),
            std::string::npos);
  EXPECT_NE(refused("kv", 2, kLlama + " --model.n_kv_head=1 --dist.tensor_parallel=2").find("model.n_kv_head = 1"),
            std::string::npos);
  EXPECT_NE(refused("world", 2, kGpt + " --dist.tensor_parallel=4").find("dist.tensor_parallel = 4 must divide the 2 ranks"),
            std::string::npos);
}

}  // namespace
}  // namespace memtrain

namespace memtrain {
namespace {

// A GPT of 4 blocks, 256 wide and 256 tokens, on 1, 2 and 4 ranks: each rank holds 1/T of the split matrices and the
// whole of the rest (by arithmetic, to the byte), and the run's own estimate of its peak is within 10% of the peak it
// measures, with and without sequence parallelism.
TEST(TensorParallel, EachRankHoldsItsSliceAndTheEstimateFollowsT) {
  test::TempDir dir;
  const int64_t C = 256, L = 4, V = 256, ctx = 256;
  const std::string model = "--model.n_layer=4 --model.n_embd=256 --model.n_head=8 --model.block_size=256";
  for (int T : {1, 2, 4}) {
    for (const char* sp : {"on", "off"}) {
      if (T == 1 && std::string(sp) == "off") continue;
      const auto name = "t" + std::to_string(T) + sp;
      int code = -1;
      const auto out = run_on_austen(dir, name, T,
                                     model + " --train.micro_batch=8 --train.steps=2 --train.eval_every=0 --log.every=1"
                                             " --log.progress=lines --checkpoint.save_final=false --dist.tensor_parallel=" +
                                         std::to_string(T) + " --dist.sequence_parallel=" + sp,
                                     &code);
      ASSERT_EQ(code, 0) << out;
      // Split per block: q, k, v (3 C^2 + 3 C), the attention's projection (C^2), the MLP's (4 C^2 + 4 C, 4 C^2);
      // whole: two LayerNorms (4 C) and the two row-parallel biases (2 C). Outside the blocks: the vocabulary's
      // rows (V / T), the position embedding and the final LayerNorm, whole. fp32.
      const int64_t per_rank = 4 * (L * ((12 * C * C + 7 * C) / T + 6 * C) + V / T * C + ctx * C + 2 * C);
      for (int r = 0; r < T; ++r) EXPECT_EQ(resident(fs::path(dir.path()) / name, r), per_rank) << name << " rank " << r;
      // The run's peak (the second step's: the first has no optimizer state before its update) against the estimate.
      const auto peak = peak_against_estimate(out);
      ASSERT_TRUE(peak) << out;
      // Measured: T = 1 +2.2%; T = 2 -0.1% (sequence parallel), +0.7% (not); T = 4 -2.2%, -0.8%.
      EXPECT_LT(std::abs(peak->second), 10.0) << name << ": the estimate is " << peak->second << "% off the measured peak\n" << out;
    }
  }
}

}  // namespace
}  // namespace memtrain

namespace memtrain {
namespace {

// Hugging Face weights in (model.init_from: each rank reads its slices from the whole tensors; GPT-2's transposed
// Conv1D, Qwen2's q, k, v biases, a vocabulary of 97 split 49 + 48) and chat records out (packed rows with the
// block-diagonal mask, the loss a sum over trained tokens): 2 tensor-parallel ranks train as one process (1e-5).
// 3 steps of Hugging Face weights `fixture` on chat_ref.py's packed records, on T tensor-parallel ranks: the losses and
// pre-clip gradient norms.
std::pair<std::vector<double>, std::vector<double>> hf_run(const test::TempDir& dir, const std::string& fixture, int T,
                                                           const std::string& name, const std::string& extra = "") {
  const std::string command =
      (T > 1 ? "timeout 300 " + test::binary("memtrain-run") + " --standalone --nproc-per-node 2 -- " : std::string()) +
      test::binary("memtrain") + " --model.init_from=" + test::fixture("hf/" + fixture) + " --data.dataset=chat --data.path=" +
      test::fixture("chat/gpt2") + " --model.block_size=16 --train.steps=3"
      " --train.warmup_steps=0 --train.lr=1e-2 --train.eval_every=0 --log.every=1 --log.progress=lines"
      " --train.micro_batch=4 --train.accum_steps=2 --dist.tensor_parallel=" + std::to_string(T) +
      " --log.dir=" + dir.path() + " --log.name=" + name + " " + extra + " 2>&1";
  int code = -1;
  const auto out = test::shell(command, &code);
  EXPECT_EQ(code, 0) << out;
  const auto metrics = dir.path(name + "/metrics.jsonl");
  return std::make_pair(test::metric_losses(metrics), test::metric_grad_norms(metrics));
}

void expect_same_hf_run(const std::pair<std::vector<double>, std::vector<double>>& one,
                        const std::pair<std::vector<double>, std::vector<double>>& two, const std::string& what) {
  ASSERT_EQ(one.first.size(), 3u) << what;
  ASSERT_EQ(two.first.size(), 3u) << what;
  for (size_t s = 0; s < 3; ++s) {
    EXPECT_NEAR(two.first[s], one.first[s], 1e-5 * one.first[s]) << what << ", step " << s + 1;
    EXPECT_NEAR(two.second[s], one.second[s], 1e-5 * one.second[s]) << what << ", grad norm, step " << s + 1;
  }
}

TEST(TensorParallel, HuggingFaceWeightsAndPackedRecordsOnTwoRanksAsOneProcess) {
  test::TempDir dir;
  for (const char* fixture : {"gpt2", "llama_gqa", "qwen2"})
    expect_same_hf_run(hf_run(dir, fixture, 1, std::string(fixture) + "1"), hf_run(dir, fixture, 2, std::string(fixture) + "2"),
                       fixture);
}

// peft adapters (lora.init_from: hf/<model>_lora, trained so that B is not zero) on a split base: each rank reads its
// slice of each adapter from the whole one in the file (GPT's c_attn B by q, k, v block, c_proj and down_proj A by
// columns), and T = 2 trains as one process. The adapters are read: the first gradient norm is not the fresh adapters'
// by 1e-2, a thousand times the parity tolerance (gpt2: 0.431 against 0.260; llama_gqa: 4%; gpt2's first loss moves by
// 3e-5 only, the adapters being small beside the base).
TEST(TensorParallel, PeftAdaptersOnASplitBaseTrainAsOneProcess) {
  test::TempDir dir;
  const std::map<std::string, std::string> targets = {{"gpt2", "c_attn,c_proj,c_fc"}, {"llama_gqa", "q_proj,v_proj,down_proj"}};
  for (const auto& [fixture, maps] : targets) {
    const auto lora = " --lora.rank=4 --lora.alpha=8 --lora.targets=" + maps;
    const auto adapters = lora + " --lora.init_from=" + test::fixture("hf/" + fixture + "_lora");
    const auto one = hf_run(dir, fixture, 1, fixture + "_lora1", adapters);
    expect_same_hf_run(one, hf_run(dir, fixture, 2, fixture + "_lora2", adapters), fixture + " with its peft adapter");
    const auto fresh = hf_run(dir, fixture, 2, fixture + "_fresh2", lora);
    ASSERT_FALSE(fresh.second.empty());
    ASSERT_FALSE(one.second.empty());
    EXPECT_GT(std::abs(fresh.second[0] - one.second[0]), 1e-2 * one.second[0]) << fixture << ": the adapter changed nothing";
  }
}

// The rows chat_ref.py's six records (4, 8, 3, 10, 5 and 6 input-target pairs) pack into at model.block_size = 16 in
// train.seed's order (the test checks that the dataset says so).
constexpr int kChatRows = 3;

// PyTorch's own tensor parallelism as the oracle (scripts/reference/tp_ref.py): hf_models.py's GQA Llama split by
// parallelize_module over two Gloo processes (q, k, v, gate, up ColwiseParallel; o, down RowwiseParallel; embedding
// RowwiseParallel, 49 + 48 rows; head ColwiseParallel), 3 steps of SGD (lr 0.5, clipped at 1.0) on chat_ref.py's six
// records, every record in every step. memtrain on 2 tensor-parallel ranks, with and without sequence parallelism,
// one micro-batch holding every packed row: the same losses and pre-clip gradient norms (1e-5); its export loads in
// transformers with memtrain's logits.
TEST(TensorParallel, LossesAndGradientNormsEqualPyTorchsParallelizeModule) {
  const auto ref = load_safetensors(test::fixture("tp/llama_gqa_ref.safetensors"));
  const auto want_losses = ref.at("losses"), want_norms = ref.at("grad_norms");
  ASSERT_EQ(want_losses.numel(), 3);
  test::TempDir dir;
  for (const char* sp : {"on", "off"}) {
    const auto name = std::string("sp_") + sp;
    const std::string command =
        "timeout 300 " + test::binary("memtrain-run") + " --standalone --nproc-per-node 2 -- " + test::binary("memtrain") +
        " --model.init_from=" + test::fixture("hf/llama_gqa") + " --data.dataset=chat --data.path=" +
        test::fixture("chat/llama_gqa") + " --model.block_size=16 --train.micro_batch=" + std::to_string(kChatRows) +
        " --train.steps=3 --train.optimizer=sgd --train.momentum=0 --train.weight_decay=0 --train.lr=0.5"
        " --train.min_lr=0.5 --train.warmup_steps=0 --train.grad_clip=1 --train.eval_every=0 --log.every=1"
        " --log.progress=lines --dist.tensor_parallel=2 --dist.sequence_parallel=" + sp + " --log.dir=" + dir.path() +
        " --log.name=" + name + " 2>&1";
    int code = -1;
    const auto out = test::shell(command, &code);
    ASSERT_EQ(code, 0) << out;
    // Every step trains on all six records once: the micro-batch is exactly the packed rows.
    ASSERT_NE(out.find("6 training records packed into " + std::to_string(kChatRows) + " rows"), std::string::npos) << out;
    const auto metrics = dir.path(name + "/metrics.jsonl");
    const auto losses = test::metric_losses(metrics), norms = test::metric_grad_norms(metrics);
    ASSERT_EQ(losses.size(), 3u) << out;
    ASSERT_EQ(norms.size(), 3u) << out;
    for (int64_t s = 0; s < 3; ++s) {
      const double l = want_losses[s].item<double>(), n = want_norms[s].item<double>();
      EXPECT_NEAR(losses[static_cast<size_t>(s)], l, 1e-5 * l) << "sequence parallel " << sp << ", step " << s + 1;
      EXPECT_NEAR(norms[static_cast<size_t>(s)], n, 1e-5 * n) << "sequence parallel " << sp << ", grad norm, step " << s + 1;
    }
  }
  // The split run's final checkpoint exported as a Hugging Face folder loads in transformers, whose logits are those of
  // memtrain's model on the gathered weights the run wrote (1e-5).
  const auto ckpt = dir.path("sp_on/checkpoints");
  int code = -1;
  auto out = test::shell(test::binary("memtrain") + " export --checkpoint " + ckpt + " --out " + dir.path("hf") + " 2>&1", &code);
  ASSERT_EQ(code, 0) << out;
  const auto c = Config::load("", {"--model.init_from=" + test::fixture("hf/llama_gqa"), "--model.block_size=16"});
  auto model = make_model(c.model, DataInfo{.vocab_size = 97});
  load_module_state(*model, load_safetensors(ckpt + "/model.safetensors"), "model.safetensors");
  model->eval();
  torch::NoGradGuard no_grad;
  const auto input = torch::randint(0, 97, {2, 16}, torch::kLong);
  save_safetensors(dir.path("logits.safetensors"), {{"input", input}, {"logits", model->forward(input)}});
  out = test::shell(std::string(MEMTRAIN_PYTHON) + " " + test::source("scripts/reference/hf_check.py") + " logits " +
                    dir.path("hf") + " " + dir.path("logits.safetensors") + " 2>&1");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(max_abs_diff ([-0-9.eE+]+) max_abs_ref ([-0-9.eE+]+))"))) << out;
  EXPECT_LT(std::stod(m[1]), 1e-5 * std::stod(m[2])) << out;
  EXPECT_GT(std::stod(m[2]), 0) << out;
}

// memory.head = fused on a split model: each chunk's logits are this rank's vocabulary rows, their log-sum-exp and
// target logits reduced over the group chunk by chunk, the features' gradient summed by the split region's entry. As one
// process's fused head (1e-5): GPT at T = 2 with sequence parallelism and a 2 x 2 grid with ZeRO-2 without it, in
// chunks of 24 rows (tokens: 8 x 32 per micro-batch, so the last chunk is short); chat records (targets of -100, the
// loss a sum) on Hugging Face GPT-2 at T = 2. Then the memory: at T = 2 with a vocabulary of 8192, the fused head's
// measured peak is below the plain head's, and the run's estimate of it within 10%.
TEST(TensorParallel, FusedHeadTrainsAsOneProcessAndKeepsNoLogits) {
  test::TempDir dir;
  const std::string fused = kGpt + " --memory.head=fused:24";
  const auto one = train(dir, "one", 1, 8, fused);
  expect_same_training(one, train(dir, "t2", 2, 8, fused + " --dist.tensor_parallel=2"), "fused head, T = 2, sequence parallel");
  expect_same_training(one,
                       train(dir, "2x2", 4, 4, fused + " --dist.tensor_parallel=2 --dist.zero_stage=2 --dist.sequence_parallel=off"),
                       "fused head, 2 x 2, ZeRO-2, without sequence parallelism");
  expect_same_hf_run(hf_run(dir, "gpt2", 1, "chat_one", "--memory.head=fused:8"),
                     hf_run(dir, "gpt2", 2, "chat_t2", "--memory.head=fused:8"), "chat records, fused head, T = 2");
  std::map<std::string, double> peak;
  for (const char* head : {"plain", "fused:128"}) {
    const std::string name = head == std::string("plain") ? "plain" : "fused";
    int code = -1;
    const auto out = run_on_austen(dir, name, 2,
                                   "--model.n_layer=2 --model.n_embd=64 --model.n_head=4 --model.block_size=128"
                                   " --model.vocab_size=8192 --train.micro_batch=8 --train.steps=2 --train.eval_every=0"
                                   " --log.every=1 --log.progress=lines --checkpoint.save_final=false"
                                   " --dist.tensor_parallel=2 --memory.head=" + std::string(head),
                                   &code);
    ASSERT_EQ(code, 0) << out;
    const auto measured = peak_against_estimate(out);
    ASSERT_TRUE(measured) << out;
    peak[name] = measured->first;  // MiB
    EXPECT_LT(std::abs(measured->second), 10.0) << name << ": the estimate is " << measured->second << "% off the measured peak\n" << out;
  }
  // The plain head's logits at T = 2: 1024 tokens x 4096 rows in fp32 (16 MiB), several times over.
  EXPECT_LT(peak.at("fused"), peak.at("plain") - 16.0) << "fused " << peak.at("fused") << " MiB, plain " << peak.at("plain");
}

// memory.head = fused with automatic chunks on an uneven vocabulary: 8193 rows split 4097 + 4096, where each rank's own
// rows would give chunks of 2^24 / 4097 = 4095 and 4096 tokens, and a micro-batch of 8 x 512 = 4096 tokens two chunks
// on rank 0 and one on rank 1 (collectives of other sizes: a hang or an error). Every rank sizes them by the largest
// slice: one step of 2 ranks gives one process's loss (1e-5) and gradient norm (1e-4: 4096 tokens' softmax over 8193
// classes summed in two halves and added over the group, in another order; measured 1.0e-5).
TEST(TensorParallel, FusedHeadCutsTheSameChunksOnEveryRankOfAnUnevenVocabulary) {
  test::TempDir dir;
  auto run = [&](int T, const std::string& name) {
    int code = -1;
    const auto out = run_on_austen(dir, name, T,
                                   "--model.n_layer=1 --model.n_embd=32 --model.n_head=2 --model.block_size=512"
                                   " --model.vocab_size=8193 --train.micro_batch=8 --train.steps=1 --train.eval_every=0"
                                   " --log.every=1 --log.progress=lines --checkpoint.save_final=false --memory.head=fused"
                                   " --dist.tensor_parallel=" + std::to_string(T),
                                   &code);
    EXPECT_EQ(code, 0) << out;
    const auto metrics = dir.path(name + "/metrics.jsonl");
    return std::make_pair(test::metric_losses(metrics), test::metric_grad_norms(metrics));
  };
  const auto one = run(1, "one"), two = run(2, "t2");
  ASSERT_EQ(one.first.size(), 1u);
  ASSERT_EQ(two.first.size(), 1u);
  EXPECT_NEAR(two.first[0], one.first[0], 1e-5 * one.first[0]);
  EXPECT_NEAR(two.second[0], one.second[0], 1e-4 * one.second[0]);
}

}  // namespace
}  // namespace memtrain
