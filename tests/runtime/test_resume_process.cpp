// Resuming the memtrain binary: SIGTERM saves and exits 0, SIGKILL at random moments (most of them
// inside a save) never costs the last complete checkpoint, and a run folder that holds another run is
// refused unless resumed or overwritten. The finished runs equal the uninterrupted one bit for bit.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <regex>

#include "helpers.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/core/state_checkpoint.h"

namespace memtrain {
namespace {

namespace fs = std::filesystem;

// A folder for this test's runs, removed at the end.
struct Runs {
  test::TempDir dir;
  // The memtrain command for run `name` of `steps` steps (a small byte-level GPT on the Austen text).
  std::string command(const std::string& name, int steps, const std::string& extra = "") const {
    return test::binary("memtrain") + " --config " + test::source("examples/configs/gpt_austen_cpu.ini") +
           " --model.n_layer=2 --model.n_embd=32 --model.n_head=2 --model.block_size=32 --train.micro_batch=8"
           " --train.eval_every=0 --log.progress=lines --log.every=50 --log.dir=" + dir.path() +
           " --log.name=" + name + " --train.steps=" + std::to_string(steps) + " " + extra;
  }
  std::string run(const std::string& name, int steps, const std::string& extra, int* code) const {
    return test::shell(command(name, steps, extra) + " 2>&1", code);
  }
  std::string checkpoints(const std::string& name) const { return dir.path(name + "/checkpoints"); }
  std::map<std::string, torch::Tensor> weights(const std::string& name) const {
    return load_safetensors(checkpoints(name) + "/model.safetensors");
  }
};

void expect_bitwise_equal(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) EXPECT_TRUE(torch::equal(t, b.at(name))) << name;
}

TEST(ResumeProcess, SigtermSavesExitsZeroAndTheResumedRunIsBitExact) {
  Runs runs;
  int code = -1;
  const int steps = 800;
  runs.run("straight", steps, "", &code);
  ASSERT_EQ(code, 0);
  // SIGTERM once step 50 is logged (the handler was installed before the header's last line), to the process
  // itself: whatever the machine's speed, the signal comes inside training, 750 steps before its end.
  const auto log = runs.dir.path("stopped.log");
  const auto out = test::shell(runs.command("stopped", steps) + " > " + log + " 2>&1 & p=$!; " +
                               test::wait_for_line(log, "^step  *50/800", 120) + "; kill -TERM $p; " +
                               test::wait_at_most("$p", 120) + "; echo \"exit=$?\"; cat " + log);
  EXPECT_NE(out.find("exit=0"), std::string::npos) << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("stopped by Terminated after step ([0-9]+) of 800; checkpoint saved to (\\S+);")))
      << out;
  const int stopped_at = std::stoi(m[1]);
  EXPECT_GE(stopped_at, 50);
  EXPECT_LT(stopped_at, steps) << "the signal came after the end: nothing was tested";
  EXPECT_EQ(m[2].str(), checkpoint_folder(runs.checkpoints("stopped"), stopped_at));
  EXPECT_EQ(load_checkpoint(m[2]).meta.step, stopped_at);

  const auto resumed = runs.run("stopped", steps, "--checkpoint.resume=auto", &code);
  ASSERT_EQ(code, 0) << resumed;
  EXPECT_NE(resumed.find("resumed:    step " + std::to_string(stopped_at)), std::string::npos) << resumed;
  expect_bitwise_equal(runs.weights("stopped"), runs.weights("straight"));
  // The resumed run appended to metrics.jsonl: the steps before the stop are still there.
  std::ifstream metrics(runs.dir.path("stopped/metrics.jsonl"));
  const std::string all(std::istreambuf_iterator<char>(metrics), {});
  EXPECT_NE(all.find("\"step\":1,"), std::string::npos) << "step 1's line was lost";
  EXPECT_NE(all.find("\"event\":\"resumed\""), std::string::npos);
}

TEST(ResumeProcess, TwentyKillNinesAtRandomMomentsNeverLoseTheLastCheckpoint) {
  Runs runs;
  int code = -1;
  const int steps = 1200;
  runs.run("straight", steps, "", &code);
  ASSERT_EQ(code, 0);
  // Each life: start (resuming when there is a checkpoint), wait until it trains (its header, whose last line
  // is "run folder:", comes after the resume), then SIGKILL it 0-0.3 s later. The log is removed first: the
  // background process truncates it only once it starts, and a wait that read the last life's header would
  // kill this one before it trained (seen in CI; here 39 of 300 such waits read the old file). With a save
  // after every step, more than half of the training time is inside a save.
  std::mt19937 rng(20261201);
  std::uniform_real_distribution<double> delay(0.0, 0.3);
  int kills = 0, inside_a_save = 0, lives = 0;
  int64_t last_step = -1;
  const auto dir = runs.checkpoints("killed");
  const auto log = runs.dir.path("life.log");
  while (kills < 20 && lives < 40) {
    ++lives;
    const auto out = test::shell("rm -f " + log + "; " + runs.command("killed", steps, "--checkpoint.every=1 --checkpoint.resume=auto") +
                                 " > " + log + " 2>&1 & p=$!; " + test::wait_for_line(log, "^run folder:", 30) + "; sleep " +
                                 std::to_string(delay(rng)) +
                                 "; kill -9 $p 2>/dev/null && echo killed; wait $p 2>/dev/null; echo \"exit=$?\"; cat " + log);
    ASSERT_EQ(out.find("memtrain: ["), std::string::npos) << "life " << lives << " failed:\n" << out;
    ASSERT_NE(out.find("model:      "), std::string::npos) << "life " << lives << " never started training:\n" << out;
    if (last_step > 0) {
      EXPECT_NE(out.find("resumed:    step " + std::to_string(last_step)), std::string::npos) << out;
    }
    if (out.find("killed\nexit=137") == std::string::npos) break;  // it finished first
    ++kills;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().filename().string().ends_with(".staging")) ++inside_a_save;
    // What the next life will resume from: complete, and never older than before.
    const auto latest = find_latest_checkpoint(dir);
    if (latest.empty()) continue;
    const auto ck = load_checkpoint(latest);
    EXPECT_GE(ck.meta.step, last_step);
    last_step = ck.meta.step;
  }
  EXPECT_GE(kills, 20) << "the run finished after " << kills << " kills: make it longer";
  std::cout << "[          ] " << kills << " kills, " << inside_a_save << " of them inside a save (a staging folder "
            << "left behind); last checkpoint before the final life: step " << last_step << "\n";
  // The last life runs to the end (saving only there: the bit-exactness does not depend on it).
  const auto last = runs.run("killed", steps, "--checkpoint.resume=auto", &code);
  ASSERT_EQ(code, 0) << last;
  EXPECT_NE(last.find("resumed:    step " + std::to_string(last_step)), std::string::npos) << last;
  expect_bitwise_equal(runs.weights("killed"), runs.weights("straight"));
}

TEST(ResumeProcess, AFolderWithAnotherRunIsRefusedUnlessResumedOrOverwritten) {
  Runs runs;
  int code = -1;
  runs.run("r", 2, "", &code);
  ASSERT_EQ(code, 0);
  const auto metrics_before = fs::file_size(runs.dir.path("r/metrics.jsonl"));
  auto out = runs.run("r", 2, "", &code);
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("already holds a run (1 checkpoint(s) in " + runs.checkpoints("r") + ")"), std::string::npos) << out;
  EXPECT_NE(out.find("--checkpoint.resume=auto"), std::string::npos) << out;
  EXPECT_EQ(fs::file_size(runs.dir.path("r/metrics.jsonl")), metrics_before);  // nothing touched
  EXPECT_EQ(list_checkpoints(runs.checkpoints("r")).size(), 1u);

  out = runs.run("r", 4, "--log.overwrite=true", &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("overwrite:  started over"), std::string::npos) << out;
  const auto left = list_checkpoints(runs.checkpoints("r"));
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(fs::path(left[0]).filename(), "step-000004");  // the old run's step-2 is gone

  out = runs.run("fresh", 2, "--checkpoint.resume=auto", &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("resume:     no checkpoint in " + runs.checkpoints("fresh") + ": starting fresh"), std::string::npos) << out;

  out = runs.run("r", 4, "--checkpoint.resume=" + runs.dir.path("nowhere"), &code);
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("checkpoint.resume = " + runs.dir.path("nowhere") + ": no such checkpoint folder"), std::string::npos) << out;
}

TEST(ResumeProcess, ACorruptLatestCheckpointStopsTheRunNamingTheFile) {
  Runs runs;
  int code = -1;
  runs.run("r", 3, "--checkpoint.every=1", &code);
  ASSERT_EQ(code, 0);
  const auto file = checkpoint_folder(runs.checkpoints("r"), 3) + "/rank-00000.safetensors";
  fs::resize_file(file, fs::file_size(file) / 2);
  const auto out = runs.run("r", 6, "--checkpoint.resume=auto", &code);
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find(file + ": "), std::string::npos) << out;
  EXPECT_EQ(out.find("step     4/6"), std::string::npos) << "it trained from a corrupt checkpoint:\n" << out;
}

TEST(ResumeProcess, ResumingFromAnOlderCheckpointMovesTheNewerOnesAside) {
  Runs runs;
  int code = -1;
  runs.run("r", 4, "--checkpoint.every=1 --checkpoint.keep=4", &code);
  ASSERT_EQ(code, 0);
  const auto dir = runs.checkpoints("r");
  ASSERT_EQ(list_checkpoints(dir).size(), 4u);
  // Back to step 2 and on to step 3 with other settings: steps 3 and 4 of the first timeline go aside.
  auto out = runs.run("r", 3, "--checkpoint.every=1 --checkpoint.keep=4 --checkpoint.resume=" + checkpoint_folder(dir, 2), &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("resumed:    step 2"), std::string::npos) << out;
  EXPECT_TRUE(fs::exists(dir + "/abandoned/step-000003/manifest.json")) << out;
  EXPECT_TRUE(fs::exists(dir + "/abandoned/step-000004/manifest.json")) << out;
  std::vector<std::string> names;
  for (const auto& c : list_checkpoints(dir)) names.push_back(fs::path(c).filename().string());
  EXPECT_EQ(names, (std::vector<std::string>{"step-000001", "step-000002", "step-000003"}));
  EXPECT_EQ(fs::path(find_latest_checkpoint(dir)).filename(), "step-000003");  // the new step 3, not the old step 4
}

}  // namespace
}  // namespace memtrain
