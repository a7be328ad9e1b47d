// Training-state checkpoints in one process: bit-exact resume with every technique, name-keyed optimizer
// state, checkpoints of another model refused before anything changes, each kind of corruption named,
// a full disk during a save, out-of-memory retries and non-finite steps.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <set>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include "helpers.h"
#include "memtrain/core/cpu_memory.h"
#include "memtrain/core/error.h"
#include "memtrain/core/state_checkpoint.h"
#include "memtrain/models/module_model.h"
#include "memtrain/data/datasets.h"
#include "memtrain/optim/optimizer.h"
#include "memtrain/runtime/trainer.h"

namespace memtrain {
namespace {

namespace fs = std::filesystem;

std::vector<float> run_steps(Trainer& t, int n) {
  std::vector<float> out;
  for (int i = 0; i < n; ++i) out.push_back(t.step().loss.item<float>());
  return out;
}

void expect_same_state(Trainer& a, Trainer& b) {
  ASSERT_EQ(a.parameters().size(), b.parameters().size());
  for (size_t i = 0; i < a.parameters().size(); ++i) {
    EXPECT_TRUE(torch::equal(a.parameters()[i], b.parameters()[i])) << "parameter " << i;
    const auto& sa = a.master_weights().empty() ? a.parameters()[i] : a.master_weights()[i];
    const auto& sb = b.master_weights().empty() ? b.parameters()[i] : b.master_weights()[i];
    EXPECT_TRUE(torch::equal(sa, sb)) << "master " << i;
    const auto state_a = get_param_state(a.optimizer(), sa), state_b = get_param_state(b.optimizer(), sb);
    ASSERT_EQ(state_a.size(), state_b.size()) << "parameter " << i;
    for (const auto& [field, t] : state_a) EXPECT_TRUE(torch::equal(t, state_b.at(field))) << field << " of " << i;
  }
}

// N steps straight against N/2, save, a new Trainer, load, N/2: losses and state bitwise equal.
void expect_bit_exact_resume(Config c, int steps) {
  test::TempDir dir;
  c.checkpoint.dir = dir.path("checkpoints");
  c.train.steps = steps;
  Trainer straight(c);
  const auto expected = run_steps(straight, steps);
  std::string path;
  {
    Trainer first(c);
    run_steps(first, steps / 2);
    path = first.save_checkpoint();
  }
  EXPECT_EQ(path, checkpoint_folder(c.checkpoint.dir, steps / 2));
  Trainer resumed(c);
  resumed.load_checkpoint(path);
  EXPECT_EQ(resumed.current_step(), steps / 2);
  const auto got = run_steps(resumed, steps - steps / 2);
  for (int i = 0; i < steps - steps / 2; ++i) EXPECT_EQ(got[i], expected[steps / 2 + i]) << "step " << steps / 2 + i + 1;
  expect_same_state(straight, resumed);
}

TEST(Resume, BitExactWithBf16MastersRecomputeAccumulationAndDropout) {
  auto c = test::tiny_gpt_config();
  c.train.precision = "bf16";
  c.train.param_dtype = "bf16";  // fp32 masters in the optimizer, bf16 in the model
  c.memory.recompute = "all";
  c.train.accum_steps = 2;
  c.model.dropout = 0.1;
  expect_bit_exact_resume(c, 6);
}

TEST(Resume, BitExactWithEachOptimizerAndTheFusedHead) {
  for (const char* optimizer : {"adamw", "adamw_loop", "sgd", "adamw8bit", "adamw4bit"}) {
    SCOPED_TRACE(optimizer);
    auto c = test::tiny_gpt_config();
    c.train.optimizer = optimizer;
    c.memory.recompute = "every:2";
    c.memory.head = "fused:64";
    expect_bit_exact_resume(c, 6);
  }
}

TEST(Resume, BitExactWithLowBitStateBf16MastersAndOffload) {
  // 8-bit moments of fp32 masters, in host memory (offload: the update bucket by bucket, step_only).
  auto c = test::tiny_gpt_config();
  c.train.optimizer = "adamw8bit";
  c.train.precision = "bf16";
  c.train.param_dtype = "bf16";
  c.dist.zero_stage = 1;
  c.dist.offload_optimizer = "cpu";
  expect_bit_exact_resume(c, 6);
}

TEST(Resume, TheBudgetPlanIsSavedAndRestored) {
  auto c = test::tiny_gpt_config(4);
  c.memory.recompute = "budget:0.8";  // some blocks recomputed (0.56 MiB with all of them), not all
  test::TempDir dir;
  c.checkpoint.dir = dir.path("checkpoints");
  Trainer first(c);
  run_steps(first, 2);
  const auto plan = first.recompute_policy().blocks;
  ASSERT_EQ(plan.size(), 4u);
  const auto path = first.save_checkpoint();
  Trainer resumed(c);
  ASSERT_TRUE(resumed.recompute_policy().budget_unresolved());
  resumed.load_checkpoint(path);
  // The plan comes from the checkpoint, before any step could measure one.
  EXPECT_FALSE(resumed.recompute_policy().budget_unresolved());
  EXPECT_EQ(resumed.recompute_policy().blocks, plan);
  EXPECT_NE(std::count(plan.begin(), plan.end(), true), 4);
}

TEST(OptimizerState, NameKeyedStateMovesBetweenOptimizers) {
  // Two steps on one optimizer, its state copied through get/set into a fresh one: the next step of
  // each gives the same parameters, for every kind.
  for (auto kind : {OptimizerOptions::Kind::kAdamW, OptimizerOptions::Kind::kAdamWLoop, OptimizerOptions::Kind::kSgd}) {
    torch::manual_seed(3);
    auto w = torch::randn({4, 3}, torch::requires_grad()), v = w.detach().clone().requires_grad_();
    auto a = make_optimizer({.kind = kind, .lr = 0.1}, {w}, {});
    auto b = make_optimizer({.kind = kind, .lr = 0.1}, {v}, {});
    auto grad = [](int s) { return torch::full({4, 3}, 0.5 * (s + 1)); };
    for (int s = 0; s < 2; ++s) {
      w.mutable_grad() = grad(s);
      a->step();
    }
    torch::NoGradGuard no_grad;
    v.copy_(w);
    set_param_state(*b, v, get_param_state(*a, w));
    w.mutable_grad() = grad(2), v.mutable_grad() = grad(2);
    a->step();
    b->step();
    EXPECT_TRUE(torch::equal(w, v)) << static_cast<int>(kind);
    EXPECT_EQ(get_param_state(*b, v).size(), param_state_fields(*b).size());
  }
}

TEST(Resume, AnotherModelsCheckpointIsRefusedBeforeAnythingChanges) {
  test::TempDir dir;
  auto c = test::tiny_gpt_config();
  c.checkpoint.dir = dir.path("checkpoints");
  Trainer saved(c);
  run_steps(saved, 1);
  const auto path = saved.save_checkpoint();

  auto wider = c;
  wider.model.n_embd = 48;
  Trainer other(wider);
  const auto before = other.parameters()[0].clone();
  const auto e = test::error_of([&] { other.load_checkpoint(path); });
  EXPECT_NE(e.find("has shape"), std::string::npos) << e;
  EXPECT_NE(e.find(path), std::string::npos) << e;
  EXPECT_TRUE(torch::equal(other.parameters()[0], before));
  EXPECT_EQ(other.current_step(), 0);

  auto deeper = c;
  deeper.model.n_layer = 3;
  Trainer more(deeper);
  const auto e2 = test::error_of([&] { more.load_checkpoint(path); });
  EXPECT_NE(e2.find("no tensor 'model/h.2."), std::string::npos) << e2;

  auto sgd = c;
  sgd.train.optimizer = "sgd";
  Trainer other_optimizer(sgd);
  const auto e3 = test::error_of([&] { other_optimizer.load_checkpoint(path); });
  EXPECT_NE(e3.find("train.optimizer = adamw"), std::string::npos) << e3;
}

// --- the files: each kind of corruption gets its own error -------------------------------------------

// A two-rank checkpoint of two tensors written through the format's own functions.
std::string two_rank_checkpoint(const std::string& dir, int64_t step = 5) {
  auto a = torch::arange(10, torch::kFloat), b = torch::arange(6, torch::kFloat).reshape({2, 3});
  const auto staging = staging_folder(dir, step);
  fs::create_directories(staging);
  std::vector<SavedFile> files;
  files.push_back(write_rank_file(
      staging, 0, {{"model/a", {10}, 0, 4, a.slice(0, 0, 4)}, {"model/b", {2, 3}, 0, 6, b.reshape({-1})}}));
  files.push_back(write_rank_file(staging, 1, {{"model/a", {10}, 4, 10, a.slice(0, 4, 10)}}));
  return commit_checkpoint(dir, {.step = step, .world_size = 2, .zero_stage = 1, .fields = {{"config", ""}}}, files, 3);
}

void flip_byte(const std::string& file, int64_t from_end) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-from_end, std::ios::end);
  char ch = 0;
  f.read(&ch, 1);
  f.seekp(-from_end, std::ios::end);
  ch = static_cast<char>(ch ^ 0x10);
  f.write(&ch, 1);
}

std::string manifest_text(const std::string& path) {
  std::ifstream in(fs::path(path) / "manifest.json");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void set_manifest(const std::string& path, const std::string& text) {
  std::ofstream(fs::path(path) / "manifest.json") << text;
}

TEST(CheckpointFiles, ShardsAssembleIntoTheFullTensors) {
  test::TempDir dir;
  const auto path = two_rank_checkpoint(dir.path());
  const auto ck = load_checkpoint(path);
  EXPECT_EQ(ck.meta.step, 5);
  EXPECT_EQ(ck.meta.world_size, 2);
  EXPECT_TRUE(torch::equal(ck.tensors.at("model/a"), torch::arange(10, torch::kFloat)));
  EXPECT_TRUE(torch::equal(ck.tensors.at("model/b"), torch::arange(6, torch::kFloat).reshape({2, 3})));
}

TEST(CheckpointFiles, AFlippedByteIsNamed) {
  test::TempDir dir;
  const auto path = two_rank_checkpoint(dir.path());
  flip_byte(path + "/rank-00001.safetensors", 3);  // inside the data
  const auto e = test::error_of([&] { load_checkpoint(path); });
  EXPECT_NE(e.find("rank-00001.safetensors: checksum mismatch"), std::string::npos) << e;
}

TEST(CheckpointFiles, ATruncatedFileIsNamed) {
  test::TempDir dir;
  const auto path = two_rank_checkpoint(dir.path());
  const auto file = path + "/rank-00000.safetensors";
  fs::resize_file(file, fs::file_size(file) - 8);
  const auto e = test::error_of([&] { load_checkpoint(path); });
  EXPECT_NE(e.find("rank-00000.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("(truncated or replaced)"), std::string::npos) << e;
}

TEST(CheckpointFiles, AMissingShardIsNamed) {
  test::TempDir dir;
  const auto path = two_rank_checkpoint(dir.path());
  fs::remove(path + "/rank-00001.safetensors");
  const auto e = test::error_of([&] { load_checkpoint(path); });
  EXPECT_NE(e.find("rank-00001.safetensors: missing"), std::string::npos) << e;
}

TEST(CheckpointFiles, AManifestThatDoesNotMatchTheFilesIsNamed) {
  test::TempDir dir;
  const auto path = two_rank_checkpoint(dir.path());
  const auto good = manifest_text(path);
  // A piece's range that is not the file's tensor.
  auto text = good;
  text.replace(text.find("\"end\": 10"), 9, "\"end\": 9");
  set_manifest(path, text);
  auto e = test::error_of([&] { load_checkpoint(path); });
  EXPECT_NE(e.find("tensor 'model/a' holds 6 elements; the manifest says [4, 9)"), std::string::npos) << e;
  // A tensor the manifest does not list.
  auto j = good;
  const auto b = j.find("\"model/b\"");
  const auto end = j.find("\n  }", b);
  j.erase(j.rfind(',', b), end + 4 - j.rfind(',', b));
  set_manifest(path, j);
  e = test::error_of([&] { load_checkpoint(path); });
  EXPECT_NE(e.find("tensor 'model/b' is not in the manifest"), std::string::npos) << e;
  // Another shape: the pieces no longer cover it.
  text = good;
  text.replace(text.find("10\n"), 2, "12");
  set_manifest(path, text);
  e = test::error_of([&] { load_checkpoint(path); });
  EXPECT_NE(e.find("tensor 'model/a' is covered up to element 10 of 12"), std::string::npos) << e;
  // Not JSON at all.
  set_manifest(path, good.substr(0, good.size() / 2));
  e = test::error_of([&] { load_checkpoint(path); });
  EXPECT_NE(e.find("manifest.json: malformed manifest"), std::string::npos) << e;
}

TEST(CheckpointFiles, OnlyCompleteCheckpointsCountAndKeepPrunesTheOldest) {
  test::TempDir dir;
  for (int64_t step : {1, 2, 3, 4}) two_rank_checkpoint(dir.path(), step);
  auto all = list_checkpoints(dir.path());
  ASSERT_EQ(all.size(), 3u);  // keep = 3
  EXPECT_EQ(fs::path(all.front()).filename(), "step-000002");
  // A save killed part way: its staging folder is never a checkpoint.
  fs::create_directories(staging_folder(dir.path(), 5));
  std::ofstream(staging_folder(dir.path(), 5) + "/rank-00000.safetensors") << "half";
  EXPECT_EQ(find_latest_checkpoint(dir.path()), checkpoint_folder(dir.path(), 4));
  // Killed between the rename and `latest`: the newest complete folder wins over `latest`.
  std::ofstream(dir.path("latest")) << "step-000003\n";
  EXPECT_EQ(find_latest_checkpoint(dir.path()), checkpoint_folder(dir.path(), 4));
  // The next save removes the stale staging folder.
  two_rank_checkpoint(dir.path(), 6);
  EXPECT_FALSE(fs::exists(staging_folder(dir.path(), 5)));
}

TEST(Resume, AFullDiskDuringASaveIsAnErrorAndThePreviousCheckpointIsIntact) {
  test::TempDir dir;
  auto c = test::tiny_gpt_config();
  c.checkpoint.dir = dir.path("checkpoints");
  Trainer t(c);
  run_steps(t, 1);
  const auto first = t.save_checkpoint();
  run_steps(t, 1);
  // Files may not grow past 16 KiB (a rank file here is ~400 KiB): as a full disk, write() fails.
  struct rlimit old {};
  getrlimit(RLIMIT_FSIZE, &old);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 16 * 1024;
  setrlimit(RLIMIT_FSIZE, &small);
  const auto e = test::error_of([&] { t.save_checkpoint(); });
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_NE(e.find("[checkpoint] saving step 2"), std::string::npos) << e;
  EXPECT_NE(e.find("File too large"), std::string::npos) << e;
  EXPECT_NE(e.find("the previous checkpoint " + first + " is intact"), std::string::npos) << e;
  EXPECT_EQ(list_checkpoints(c.checkpoint.dir), std::vector<std::string>{first});
  EXPECT_FALSE(fs::exists(staging_folder(c.checkpoint.dir, 2)));
  EXPECT_EQ(load_checkpoint(first).meta.step, 1);
}

// --- out of memory and non-finite steps ------------------------------------------------------------

TEST(OutOfMemory, AStepOverTheLimitIsRetriedWithHalfTheMicroBatchAndTheSameSamples) {
  auto c = test::tiny_gpt_config();
  c.train.micro_batch = 64;
  c.train.steps = 4;
  std::vector<float> expected;
  int64_t peak = 0, activations = 0;
  {
    Trainer free_run(c);
    expected = run_steps(free_run, 4);
    for (const auto& s : free_run.tracker().last())
      if (s.device == "cpu") peak = s.peak_allocated, activations = s.activation_peak;
  }
  ASSERT_GT(activations, 8 << 20) << "the test needs activations of several MiB";
  // A limit that the full micro-batch exceeds and half of it fits under, in whole MiB.
  c.memory.limit_mib = (peak - activations * 3 / 10) >> 20;
  Trainer limited(c);
  const auto got = run_steps(limited, 4);
  EXPECT_EQ(limited.micro_batch_split(), 2);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], expected[i], 1e-5 * expected[i]) << "step " << i + 1;
  for (const auto& s : limited.tracker().last())
    if (s.device == "cpu") {
      EXPECT_LE(s.peak_allocated, c.memory.limit_mib << 20);
    }

  c.train.oom = "fail";
  // Without a retry, its own estimate (over the limit at micro-batch 64) stops it before the model is built.
  const auto before = test::error_of([&] { Trainer t(c); });
  EXPECT_NE(before.find("[memory] this run cannot fit: before building the model"), std::string::npos) << before;
  EXPECT_NE(before.find("memory.limit_mib = " + std::to_string(c.memory.limit_mib)), std::string::npos) << before;
  // Without the estimate, the step itself runs out and says so.
  c.memory.estimate = false;
  Trainer failing(c);
  const auto e = test::error_of([&] { failing.step(); });
  cpu_memory::set_limit(0);
  EXPECT_NE(e.find("[memory] out of memory in step 1"), std::string::npos) << e;
  EXPECT_NE(e.find("memory.limit_mib = " + std::to_string(c.memory.limit_mib)), std::string::npos) << e;
  EXPECT_NE(e.find("train.oom = fail"), std::string::npos) << e;
  EXPECT_EQ(failing.current_step(), 0);
}

// A small classifier whose loss is NaN in chosen steps (counted by the loss function: one call per step).
struct NanModel {
  std::shared_ptr<ModuleModel> model;
  std::shared_ptr<int> calls = std::make_shared<int>(0);
  explicit NanModel(std::set<int> nan_calls) {
    torch::nn::Sequential net(torch::nn::Flatten(), torch::nn::Linear(784, 16), torch::nn::Tanh(), torch::nn::Linear(16, 10));
    auto counter = calls;
    model = std::make_shared<ModuleModel>(
        net, ModuleModelOptions{.loss = [counter, nan_calls](const torch::Tensor& out, const torch::Tensor& y) {
          auto l = torch::nn::functional::cross_entropy(out, y);
          return nan_calls.count((*counter)++) ? l * std::numeric_limits<float>::quiet_NaN() : l;
        }});
  }
};

Config regression_config() {
  auto c = test::tiny_gpt_config();
  c.model.name = "mlp";  // unused: the model is the test's
  c.memory.estimate = false;  // NanModel counts its forward calls: the estimate's probe would run some
  return c;
}

std::shared_ptr<Dataset> regression_data() { return make_synthetic_dataset({.text = false}, {}); }

TEST(NonFinite, ANanStepIsSkippedAndNamedAndTrainingGoesOn) {
  NanModel m({2});  // the third step's loss
  auto c = regression_config();
  Trainer t(c, m.model, regression_data());
  t.step(), t.step();
  const auto before = t.parameters()[0].clone();
  auto r = t.step();
  EXPECT_TRUE(r.nonfinite);
  EXPECT_FALSE(r.applied);
  EXPECT_TRUE(torch::equal(t.parameters()[0], before));  // no update from a NaN
  r = t.step();
  EXPECT_FALSE(r.nonfinite);
  EXPECT_FALSE(torch::equal(t.parameters()[0], before));
}

TEST(NonFinite, StopNowOrAfterKConsecutive) {
  {
    NanModel m({1});
    auto c = regression_config();
    c.train.on_nonfinite = "stop";
    Trainer t(c, m.model, regression_data());
    t.step();
    const auto e = test::error_of([&] { t.step(); });
    EXPECT_NE(e.find("[train] step 2: non-finite loss"), std::string::npos) << e;
    EXPECT_NE(e.find("train.on_nonfinite = stop"), std::string::npos) << e;
  }
  NanModel m({0, 1, 2, 3, 4, 5});
  auto c = regression_config();
  c.train.max_nonfinite = 3;
  Trainer t(c, m.model, regression_data());
  t.step(), t.step();
  const auto e = test::error_of([&] { t.step(); });
  EXPECT_NE(e.find("3 consecutive such steps, train.max_nonfinite = 3"), std::string::npos) << e;
}

// train.host_reads = deferred through fit(): the fused AdamW skips a non-finite update on the device and the host
// reads the step's flags during the next step (at once on log and last steps). What trains, what is skipped and
// where a run stops must be what each_step gives; only the stop comes one step's forward and backward later.
struct FitResult {
  std::vector<torch::Tensor> parameters;
  std::string error;
};

FitResult fit_with(const std::string& host_reads, std::set<int> nan_calls, int64_t max_nonfinite = 5,
                   const std::string& on_nonfinite = "skip") {
  torch::manual_seed(7);  // the same initial weights in each run
  NanModel m(std::move(nan_calls));
  auto c = regression_config();
  c.train.steps = 6;
  c.log.every = 10;  // read at once: steps 1 and 6 only (the last); 2 to 5 are read during the next step
  c.log.name = "deferred_" + host_reads;
  c.checkpoint.save_final = false;
  c.train.max_nonfinite = max_nonfinite;
  c.train.on_nonfinite = on_nonfinite;
  c.train.host_reads = host_reads;
  FitResult out;
  Trainer t(c, m.model, regression_data());
  out.error = test::error_of([&] { t.fit(); });
  for (const auto& p : t.parameters()) out.parameters.push_back(p.detach().clone());
  return out;
}

void expect_same_parameters(const FitResult& a, const FitResult& b) {
  ASSERT_EQ(a.parameters.size(), b.parameters.size());
  for (size_t i = 0; i < a.parameters.size(); ++i) EXPECT_TRUE(torch::equal(a.parameters[i], b.parameters[i])) << i;
}

TEST(NonFinite, DeferredReadsSkipOnTheDeviceAndStopWhereEachStepDoes) {
  // Steps 2 and 4 are NaN and skipped; the others train: the same parameters bit for bit.
  const auto each = fit_with("each_step", {1, 3}), deferred = fit_with("deferred", {1, 3});
  EXPECT_EQ(each.error, "<no exception>");
  EXPECT_EQ(deferred.error, "<no exception>");
  expect_same_parameters(each, deferred);
  // The skip happened (a run that applied the NaN step would hold NaN parameters).
  for (const auto& p : deferred.parameters) EXPECT_TRUE(torch::isfinite(p).all().item<bool>());

  // Steps 2 to 6 NaN, max_nonfinite = 3: each_step stops in step 4; deferred reads step 4's flags during step 5
  // and stops there, before step 5's update. The parameters are those after step 1 in both.
  const auto each_stop = fit_with("each_step", {1, 2, 3, 4, 5}, 3), deferred_stop = fit_with("deferred", {1, 2, 3, 4, 5}, 3);
  EXPECT_NE(each_stop.error.find("[train] step 4: non-finite"), std::string::npos) << each_stop.error;
  EXPECT_NE(deferred_stop.error.find("[train] step 4: non-finite"), std::string::npos) << deferred_stop.error;
  EXPECT_NE(deferred_stop.error.find("3 consecutive such steps, train.max_nonfinite = 3"), std::string::npos) << deferred_stop.error;
  EXPECT_NE(deferred_stop.error.find("step 5 was stopped before its update"), std::string::npos) << deferred_stop.error;
  expect_same_parameters(each_stop, deferred_stop);

  // train.on_nonfinite = stop: step 2 named in both, nothing after step 1 applied.
  const auto each_now = fit_with("each_step", {1}, 5, "stop"), deferred_now = fit_with("deferred", {1}, 5, "stop");
  EXPECT_NE(deferred_now.error.find("[train] step 2: non-finite loss"), std::string::npos) << deferred_now.error;
  EXPECT_NE(deferred_now.error.find("train.on_nonfinite = stop"), std::string::npos) << deferred_now.error;
  expect_same_parameters(each_now, deferred_now);
}

TEST(NonFinite, DeferredReadsNeedAnUpdateTheDeviceCanSkip) {
  auto c = regression_config();
  c.train.host_reads = "deferred";
  c.train.optimizer = "sgd";
  const auto e = test::error_of([&] { Trainer t(c); });
  EXPECT_NE(e.find("train.host_reads = deferred needs an update the device can skip by itself"), std::string::npos) << e;
  EXPECT_NE(e.find("train.optimizer = sgd decides on the host"), std::string::npos) << e;
}

}  // namespace
}  // namespace memtrain
