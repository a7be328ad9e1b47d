// A rank of the parity test against PyTorch's own data parallelism, started by memtrain-run on 2 ranks:
//
//   memtrain-run --standalone --nproc-per-node 2 -- ddp_parity_rank STAGE FIXTURES_DIR [adamw|sgd|sgd_clip]
//
// Trains the fixture GPT (gpt_parity.safetensors' weights) for 4 steps with memtrain::Trainer at ZeRO stage
// STAGE on the global batches of ddp_zero.safetensors, which scripts/reference/ddp_ref.py wrote by running
// the same training under torch DistributedDataParallel with torch.optim.AdamW (a), with
// ZeroRedundancyOptimizer (b), under FSDP2's fully_shard per block + root (c), and under DDP with plain SGD
// without (d) and with (e) clipping. adamw (the default) checks stage 0 against (a), stages 1-2 against (b)
// and stage 3 against (c); sgd and sgd_clip check every stage against (d) and (e). AdamW's update does not
// change when every gradient is scaled by one factor: only the gradient norms and the SGD runs can see a
// reduction that sums where it should average. Rank 0 prints one PASS or FAIL line per check (the losses
// averaged over the ranks, the pre-clip gradient norm of every step, every final parameter) and exits 1 if
// any failed.
//
// Not a gtest: each rank is a separate process, and helpers.h (which pulls gtest in) is not needed for the
// few lines of fixture loading below.
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

#include "memtrain/core/config.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/data/datasets.h"
#include "memtrain/models/gpt.h"
#include "memtrain/runtime/trainer.h"

namespace {

using Tensors = std::map<std::string, torch::Tensor>;

constexpr double kLr = 1e-2;      // AdamW's, as ddp_ref.py / make_fixtures.adamw
constexpr double kSgdLr = 0.5;    // ddp_ref.SGD_LR
constexpr double kSgdClip = 0.25; // ddp_ref.SGD_CLIP

// The fixture's batches: step s serves rows [rank * B, (rank + 1) * B) of inputs[s] (B = the per-rank batch).
class FixtureBatches : public memtrain::Dataset {
 public:
  FixtureBatches(torch::Tensor inputs, torch::Tensor targets, int rank)
      : inputs_(std::move(inputs)), targets_(std::move(targets)), rank_(rank) {}
  memtrain::DataInfo info() const override { return {.vocab_size = 64}; }
  memtrain::Batch train_batch(int64_t step, int64_t micro, int64_t batch_size) override {
    TORCH_CHECK(step < inputs_.size(0) && micro == 0, "the fixture has ", inputs_.size(0),
                " steps of one micro-batch; asked for step ", step, " micro-batch ", micro);
    const int64_t begin = rank_ * batch_size;
    TORCH_CHECK(begin + batch_size <= inputs_.size(1), "the fixture's global batch is ", inputs_.size(1), " rows");
    return {inputs_[step].slice(0, begin, begin + batch_size), targets_[step].slice(0, begin, begin + batch_size)};
  }
  std::vector<memtrain::Batch> val_batches(int64_t, int64_t) override { return {}; }
  std::string describe() const override { return "ddp_zero.safetensors batches"; }

 private:
  torch::Tensor inputs_, targets_;  // (steps, global batch, T) int64
  int rank_;
};

// max |a - b| / max |b|: the distance relative to the tensor's scale.
double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  auto fa = a.to(torch::kDouble), fb = b.to(torch::kDouble);
  return (fa - fb).abs().max().item<double>() / (fb.abs().max().item<double>() + 1e-12);
}

std::string sci(double v) {
  std::ostringstream os;
  os << std::scientific << std::setprecision(2) << v;
  return os.str();
}

// Rank 0 prints every check; the other ranks only the failed ones (theirs are the learning rates).
struct Checks {
  bool verbose = true;
  int passed = 0, failed = 0;
  void check(bool ok, const std::string& what) {
    if (verbose || !ok) std::cout << (ok ? "PASS " : "FAIL ") << what << "\n";
    ok ? ++passed : ++failed;
  }
};

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc == 4 ? argv[3] : "adamw";
    if ((argc != 3 && argc != 4) || (mode != "adamw" && mode != "sgd" && mode != "sgd_clip")) {
      std::cerr << "usage: ddp_parity_rank STAGE FIXTURES_DIR [adamw|sgd|sgd_clip] (started by memtrain-run on 2 ranks)\n";
      return 2;
    }
    const int stage = std::atoi(argv[1]);
    const std::string dir = argv[2];
    const bool sgd = mode != "adamw";
    const auto parity = memtrain::load_safetensors(dir + "/gpt_parity.safetensors");
    const auto ref = memtrain::load_safetensors(dir + "/ddp_zero.safetensors");
    // The reference run this stage and mode are checked against, and its name in the output.
    const std::string run = sgd ? mode : stage == 0 ? "ddp" : stage == 3 ? "fsdp" : "zero";
    const std::string run_name = sgd ? "DDP + SGD" + std::string(mode == "sgd_clip" ? " (clipped)" : "")
                                 : stage == 0 ? "DDP" : stage == 3 ? "FSDP2 fully_shard" : "ZeroRedundancyOptimizer";
    const auto& ddp_losses = ref.at("ddp_losses");
    const auto& run_losses = ref.at(run + "_losses");
    const auto& run_norms = ref.at(run + "_grad_norms");
    const int64_t steps = run_losses.size(0);
    const double lr = sgd ? kSgdLr : kLr;

    memtrain::GPTOptions o;
    o.vocab_size = 64, o.block_size = 16, o.n_layer = 2, o.n_head = 2, o.n_embd = 32, o.dropout = 0.0;
    auto gpt = std::make_shared<memtrain::GPT>(o);
    Tensors initial;
    for (const auto& item : gpt->named_parameters()) initial[item.key()] = parity.at(item.key());
    memtrain::load_module_state(*gpt, initial, "gpt_parity.safetensors");

    const auto world = memtrain::World::from_env();
    TORCH_CHECK(world.world_size == 2, "run on 2 ranks (the fixture's), not ", world.world_size);
    memtrain::Config c;
    c.train.optimizer = sgd ? "sgd" : "adamw";
    c.train.lr = lr;
    c.train.min_lr = lr;         // with warmup 0, CosineSchedule::at(s) = min + 0.5 (peak - min)(...) = lr exactly
    c.train.warmup_steps = 0;
    c.train.steps = steps;
    c.train.beta1 = 0.9, c.train.beta2 = 0.95, c.train.eps = 1e-8, c.train.weight_decay = sgd ? 0.0 : 0.1;
    c.train.momentum = 0.0;      // SGD: the update is lr x gradient
    c.train.grad_clip = mode == "sgd_clip" ? kSgdClip : 0;  // the other references do not clip
    c.train.micro_batch = ref.at("inputs").size(1) / world.world_size;
    c.train.threads = 1;         // two ranks on two cores; the reference ran one thread per rank too
    c.memory.track = false;      // no cpu_memory::install(): nothing to measure here
    c.dist.zero_stage = stage;
    c.log.dir = "/tmp";          // nothing is written: step() only
    auto data = std::make_shared<FixtureBatches>(ref.at("inputs"), ref.at("targets"), world.rank);
    memtrain::Trainer trainer(c, gpt, data);

    const bool main = world.is_main();
    Checks checks{.verbose = main};
    for (int64_t s = 0; s < steps; ++s) {
      auto r = trainer.step();
      checks.check(r.lr == lr, "step " + std::to_string(s) + " lr " + sci(r.lr));
      const double norm = r.grad_norm.item<double>();  // global over the ranks, before clipping
      auto mean = r.loss.to(torch::kDouble);
      trainer.data_parallel()->group_all_reduce_sum(mean);  // each rank's loss is the mean over its rows
      const double loss = mean.item<double>() / world.world_size;
      if (!main) continue;
      const double ddp = ddp_losses[s].item<double>(), want = run_losses[s].item<double>();
      const double want_norm = run_norms[s].item<double>();
      std::cout << "step " << s << " loss memtrain " << std::setprecision(9) << loss << " " << run_name << " " << want
                << " | grad norm memtrain " << norm << " " << run_name << " " << want_norm << "\n";
      if (!sgd) checks.check(std::abs(loss - ddp) <= 1e-5 * std::abs(ddp), "step " + std::to_string(s) + " loss vs DDP");
      checks.check(std::abs(loss - want) <= 1e-5 * std::abs(want), "step " + std::to_string(s) + " loss vs " + run_name);
      // The same averaged gradient has the same norm: summed over the ranks it would be 2x (stage 0-1's
      // all-reduce, stage 2-3's reduce-scatter and their sharded norm alike).
      checks.check(std::abs(norm - want_norm) <= 1e-5 * want_norm,
                   "step " + std::to_string(s) + " pre-clip grad norm " + sci(norm) + " vs " + run_name + " " + sci(want_norm));
    }

    // Stage 3 holds parts only: every rank joins in gathering the full parameters, rank 0 keeps them (by name).
    const auto full = trainer.data_parallel()->full_parameters(main);
    if (main) {
      // Every parameter after the last step (the losses only show the updates before it), against the
      // reference run chosen above. One exception (AdamW only), as in
      // tests/models/test_parity.cpp: the key third of each c_attn.bias has a gradient that is zero but for
      // rounding (softmax ignores a shift shared by every key), which Adam, dividing by sqrt(v), turns into
      // steps of up to lr whose signs no two implementations share. It must only stay within those steps.
      const std::string prefix = run + "_final.";
      const int64_t C = o.n_embd;
      int compared = 0;
      for (const auto& item : gpt->named_parameters()) {
        const auto& name = item.key();
        const auto& expected = ref.at(prefix + name);
        const auto p = full.count(name) ? full.at(name) : item.value().detach();
        ++compared;
        if (!sgd && name.ends_with("attn.c_attn.bias")) {
          auto query_value = [&](const torch::Tensor& b) { return torch::cat({b.slice(0, 0, C), b.slice(0, 2 * C)}); };
          const double err = relative_error(query_value(p), query_value(expected));
          checks.check(err < 1e-4, name + " (query, value) relative error " + sci(err));
          const double moved = (p.slice(0, C, 2 * C) - initial.at(name).slice(0, C, 2 * C)).abs().max().item<double>();
          checks.check(moved <= static_cast<double>(steps) * kLr * 1.01,
                       name + " (key) moved " + sci(moved) + " <= steps * lr");
          continue;
        }
        const double err = relative_error(p, expected);
        checks.check(err < 1e-4, name + " relative error " + sci(err));
      }
      checks.check(compared == 4 + 2 * 12, "compared " + std::to_string(compared) + " parameters (28 expected)");
      std::cout << "stage " << stage << " (" << mode << "): " << checks.passed << " passed, " << checks.failed << " failed" << std::endl;
    }
    return checks.failed == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "ddp_parity_rank: FAIL " << e.what() << std::endl;
    return 1;
  }
}
