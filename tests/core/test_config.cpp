#include <gtest/gtest.h>

#include <filesystem>

#include "helpers.h"
#include "memtrain/core/config.h"
#include "memtrain/core/error.h"

namespace memtrain {
namespace {

using test::error_of;
using test::TempDir;

TEST(Config, ExampleConfigsParse) {
  int n = 0;
  for (const auto& f : std::filesystem::directory_iterator(test::source("examples/configs"))) {
    if (f.path().extension() != ".ini") continue;
    SCOPED_TRACE(f.path().string());
    EXPECT_NO_THROW(Config::load(f.path().string()));
    ++n;
  }
  EXPECT_GE(n, 4);
}

TEST(Config, FileValuesAndOverrides) {
  TempDir dir;
  auto path = dir.file("a.ini", "[train]\nlr = 0.005\nsteps = 7\n[model]\nname = mlp\n");
  auto c = Config::load(path, {"--train.steps=9", "--memory.checkpoint", "every:2"});
  EXPECT_DOUBLE_EQ(c.train.lr, 0.005);
  EXPECT_EQ(c.train.steps, 9);  // the command line wins over the file
  EXPECT_EQ(c.model.name, "mlp");
  EXPECT_EQ(c.memory.checkpoint, "every:2");
  EXPECT_EQ(c.train.micro_batch, TrainOptions{}.micro_batch);  // untouched keys keep their defaults
}

TEST(Config, ResolvedConfigRoundTrips) {
  TempDir dir;
  auto c = Config::load("", {"--train.lr=0.0125", "--model.hidden=64,32", "--log.name=x", "--train.precision=bf16"});
  auto path = dir.file("resolved.ini", c.to_ini());
  auto back = Config::load(path);
  EXPECT_DOUBLE_EQ(back.train.lr, 0.0125);
  EXPECT_EQ(back.model.hidden, "64,32");
  EXPECT_EQ(back.train.precision, "bf16");
  EXPECT_EQ(back.checkpoint.dir, "");
  EXPECT_EQ(back.to_ini().substr(back.to_ini().find('[')), c.to_ini().substr(c.to_ini().find('[')));
}

TEST(Config, DoublesRoundTripToTheLastBit) {
  test::TempDir dir;
  auto c = Config::load("", {"--train.lr=0.00012345678901234567", "--train.eps=1e-11"});
  auto back = Config::load(dir.file("r.ini", c.to_ini()));
  EXPECT_EQ(back.train.lr, c.train.lr);  // exact, not approximately
  EXPECT_EQ(back.train.eps, 1e-11);
}

TEST(Config, InvalidValueSaysWhereItWasSet) {
  test::TempDir dir;
  auto path = dir.file("v.ini", "[train]\n\nprecision = fp8\n");
  auto msg = error_of([&] { Config::load(path); });
  EXPECT_NE(msg.find("(set at " + path + ":3)"), std::string::npos) << msg;
  msg = error_of([&] { Config::load("", {"--train.steps=0"}); });
  EXPECT_NE(msg.find("(set on the command line)"), std::string::npos) << msg;
  msg = error_of([&] { Config::load(dir.file("s.ini", "steps = 3\n")); });
  EXPECT_NE(msg.find("outside any section"), std::string::npos) << msg;
}

TEST(Config, UnknownKeyNamesFileLineKeyAndSuggestion) {
  TempDir dir;
  auto path = dir.file("bad.ini", "[model]\nname = gpt\n\n[train]\nlrr = 0.1\n");
  auto msg = error_of([&] { Config::load(path); });
  EXPECT_NE(msg.find(path + ":5"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unknown key 'lrr' in section [train]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'train.lr'"), std::string::npos) << msg;
}

TEST(Config, UnknownSectionListsSections) {
  TempDir dir;
  auto path = dir.file("bad.ini", "[optimizer]\nlr = 0.1\n");
  auto msg = error_of([&] { Config::load(path); });
  EXPECT_NE(msg.find("unknown key 'lr' in section [optimizer]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Known sections"), std::string::npos) << msg;
}

TEST(Config, BadValueTypeNamesValueKeyAndLine) {
  TempDir dir;
  auto path = dir.file("bad.ini", "[train]\nsteps = many\n");
  auto msg = error_of([&] { Config::load(path); });
  EXPECT_NE(msg.find(path + ":2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("invalid value 'many' for train.steps"), std::string::npos) << msg;
}

TEST(Config, BadEnumListsAllowedValues) {
  auto msg = error_of([] { Config::load("", {"--train.precision=fp8"}); });
  EXPECT_NE(msg.find("train.precision = 'fp8' is not allowed; expected one of: fp32 | bf16 | fp16"), std::string::npos)
      << msg;
}

TEST(Config, OutOfRangeNamesRange) {
  auto msg = error_of([] { Config::load("", {"--train.micro_batch=0"}); });
  EXPECT_NE(msg.find("train.micro_batch = 0 is out of range: expected >= 1"), std::string::npos) << msg;
  msg = error_of([] { Config::load("", {"--model.n_embd=30", "--model.n_head=4"}); });
  EXPECT_NE(msg.find("model.n_embd = 30"), std::string::npos) << msg;
}

TEST(Config, BadCheckpointPolicies) {
  for (const char* bad : {"every:0", "every:1.5", "budget:abc", "budget:-3", "sometimes"}) {
    auto msg = error_of([&] { Config::load("", {std::string("--memory.checkpoint=") + bad}); });
    EXPECT_NE(msg.find("memory.checkpoint = '" + std::string(bad) + "'"), std::string::npos) << msg;
  }
  for (const char* good : {"none", "all", "every:3", "attn", "mlp", "budget:12.5"})
    EXPECT_NO_THROW(Config::load("", {std::string("--memory.checkpoint=") + good})) << good;
}

TEST(Config, MissingFileIsNamed) {
  auto msg = error_of([] { Config::load("/nonexistent/dir/run.ini"); });
  EXPECT_NE(msg.find("cannot open config file '/nonexistent/dir/run.ini': no such file"), std::string::npos) << msg;
}

TEST(Config, UnknownCommandLineOption) {
  auto msg = error_of([] { Config::load("", {"--train.stepz=3"}); });
  EXPECT_NE(msg.find("command line: unknown option '--train.stepz'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'train.steps'"), std::string::npos) << msg;
}

TEST(Config, ErrorsAreConfigErrors) {
  EXPECT_THROW(Config::load("", {"--train.lr=-1"}), ConfigError);
  EXPECT_THROW(Config::load("/nope.ini"), ConfigError);
}

}  // namespace
}  // namespace memtrain
