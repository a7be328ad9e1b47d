#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "helpers.h"
#include "memtrain/core/config.h"
#include "memtrain/core/error.h"

namespace memtrain {
namespace {

using test::error_of;
using test::TempDir;

// `key = value` lines of an INI text by section ("train.lr" -> "2e-3"), comments and blank lines skipped.
std::map<std::string, std::string> ini_values(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream in(text);
  std::string section;
  auto trim = [](std::string s) {
    s.erase(0, s.find_first_not_of(" \t"));
    s.erase(s.find_last_not_of(" \t\r") + 1);
    return s;
  };
  for (std::string line; std::getline(in, line);) {
    line = trim(line.substr(0, line.find('#')));
    if (line.empty()) continue;
    if (line.front() == '[') section = line.substr(1, line.find(']') - 1);
    else if (auto eq = line.find('='); eq != std::string::npos) out[section + "." + trim(line.substr(0, eq))] = trim(line.substr(eq + 1));
  }
  return out;
}

TEST(Config, ExampleConfigsParse) {
  // Every value an example file sets is the value the loaded config holds (read back from its resolved
  // INI): no key of an example is misspelled into being ignored, none is overridden by another.
  int n = 0;
  for (const auto& f : std::filesystem::directory_iterator(test::source("examples/configs"))) {
    if (f.path().extension() != ".ini") continue;
    SCOPED_TRACE(f.path().string());
    Config c;
    std::ifstream in(f.path());
    const auto given = ini_values(std::string(std::istreambuf_iterator<char>(in), {}));
    // An example that starts from another's export (the LoRA example's runs/llama_austen_hf) reads a Hugging
    // Face folder here: transformers' tiny Llama of the fixtures stands in for it.
    std::vector<std::string> overrides;
    if (given.count("model.init_from")) overrides.push_back("--model.init_from=" + test::fixture("hf/llama_gqa"));
    ASSERT_NO_THROW(c = Config::load(f.path().string(), overrides));
    const auto resolved = ini_values(c.to_ini());
    EXPECT_GE(given.size(), 5u);
    for (const auto& [key, value] : given) {
      if (key == "model.init_from") continue;  // replaced above
      ASSERT_TRUE(resolved.count(key)) << key << " is not a key of the resolved config";
      char* end = nullptr;
      const double number = std::strtod(value.c_str(), &end);
      if (end != value.c_str() && *end == '\0')
        EXPECT_DOUBLE_EQ(std::stod(resolved.at(key)), number) << key;
      else
        EXPECT_EQ(resolved.at(key), value) << key;
    }
    ++n;
  }
  EXPECT_GE(n, 4);
}

TEST(Config, FileValuesAndOverrides) {
  TempDir dir;
  auto path = dir.file("a.ini", "[train]\nlr = 0.005\nsteps = 7\n[model]\nname = mlp\n");
  auto c = Config::load(path, {"--train.steps=9", "--memory.recompute", "every:2"});
  EXPECT_DOUBLE_EQ(c.train.lr, 0.005);
  EXPECT_EQ(c.train.steps, 9);  // the command line wins over the file
  EXPECT_EQ(c.model.name, "mlp");
  EXPECT_EQ(c.memory.recompute, "every:2");
  EXPECT_EQ(c.train.micro_batch, TrainOptions{}.micro_batch);  // untouched keys keep their defaults
}

TEST(Config, ResolvedConfigRoundTrips) {
  TempDir dir;
  auto c = Config::load("", {"--train.lr=0.0125", "--model.name=mlp", "--data.dataset=synthetic", "--model.hidden=64,32",
                             "--log.name=x", "--train.precision=bf16"});
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

TEST(Config, ZeroStageThreePrefetchAndOffloadAreChecked) {
  EXPECT_NO_THROW(Config::load("", {"--dist.zero_stage=3", "--dist.prefetch=2", "--dist.offload_optimizer=cpu"}));
  auto msg = error_of([] { Config::load("", {"--dist.zero_stage=4"}); });
  EXPECT_NE(msg.find("dist.zero_stage = 4 is out of range: expected 0, 1, 2 or 3"), std::string::npos) << msg;
  msg = error_of([] { Config::load("", {"--dist.prefetch=-1"}); });
  EXPECT_NE(msg.find("dist.prefetch = -1 is out of range: expected >= 0"), std::string::npos) << msg;
  msg = error_of([] { Config::load("", {"--dist.offload_optimizer=nvme"}); });
  EXPECT_NE(msg.find("dist.offload_optimizer = 'nvme' is not allowed; expected one of: none | cpu"), std::string::npos) << msg;
  msg = error_of([] { Config::load("", {"--dist.offload_optimizer=cpu"}); });  // stage 0 shards nothing to offload
  EXPECT_NE(msg.find("dist.offload_optimizer = cpu needs dist.zero_stage = 1, 2 or 3"), std::string::npos) << msg;
  msg = error_of([] { Config::load("", {"--dist.offload_optimizer=cpu", "--dist.zero_stage=2", "--train.precision=fp16"}); });
  EXPECT_NE(msg.find("with train.precision = fp16 is not supported"), std::string::npos) << msg;
}

TEST(Config, BadCheckpointPolicies) {
  for (const char* bad : {"every:0", "every:1.5", "budget:abc", "budget:-3", "sometimes"}) {
    auto msg = error_of([&] { Config::load("", {std::string("--memory.recompute=") + bad}); });
    EXPECT_NE(msg.find("memory.recompute = '" + std::string(bad) + "'"), std::string::npos) << msg;
  }
  for (const char* good : {"none", "all", "every:3", "attn", "mlp", "budget:12.5"})
    EXPECT_NO_THROW(Config::load("", {std::string("--memory.recompute=") + good})) << good;
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

TEST(Config, ReferencePageIsCurrent) {
  // docs/config-reference.md is what `memtrain --print-config-reference` prints; regenerate it with
  //   build/memtrain --print-config-reference > docs/config-reference.md
  std::ifstream in(test::source("docs/config-reference.md"));
  ASSERT_TRUE(in.good()) << "docs/config-reference.md is missing";
  std::string page((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(page, Config::reference_markdown()) << "docs/config-reference.md is stale: regenerate it";
}

TEST(Config, NumbersPrintInTheirShortestExactForm) {
  auto c = Config::load("", {"--train.lr=0.1", "--model.dropout=0.3"});
  auto ini = c.to_ini();
  EXPECT_NE(ini.find("\nlr = 0.1\n"), std::string::npos) << ini;
  EXPECT_NE(ini.find("\ndropout = 0.3\n"), std::string::npos) << ini;
  EXPECT_NE(ini.find("\nmin_lr = 1e-04\n"), std::string::npos) << ini;  // to_chars: the shorter of the two forms
  EXPECT_NE(Config::help().find("--train.lr=0.001\n"), std::string::npos);
  EXPECT_EQ(Config::help().find("0000000"), std::string::npos) << "a number printed with all 17 digits";
}

TEST(Config, PrintedConfigListsOnlyTheChosenModelsKeys) {
  auto gpt = Config::load("").to_ini();
  EXPECT_NE(gpt.find("n_layer = "), std::string::npos);
  for (const char* other : {"depth = ", "stem = ", "hidden = "}) EXPECT_EQ(gpt.find(other), std::string::npos) << other;
  auto mlp = Config::load("", {"--model.name=mlp", "--data.dataset=synthetic"}).to_ini();
  EXPECT_NE(mlp.find("hidden = "), std::string::npos);
  for (const char* other : {"n_layer = ", "preset = ", "depth = "}) EXPECT_EQ(mlp.find(other), std::string::npos) << other;
  // --help groups the model keys by model.
  EXPECT_NE(Config::help().find("[model] model.name = resnet:\n  --model.depth=18"), std::string::npos) << Config::help();
}

TEST(Config, PresetBesideAShapeKeyIsAnErrorNamingBoth) {
  auto msg = error_of([] { Config::load("", {"--model.preset=gpt2", "--model.n_layer=6"}); });
  EXPECT_NE(msg.find("model.preset = gpt2 (set on the command line) fixes the model's shape, but model.n_layer = 6"),
            std::string::npos)
      << msg;
  TempDir dir;
  auto path = dir.file("p.ini", "[model]\npreset = gpt2\nblock_size = 256\n");
  msg = error_of([&] { Config::load(path); });
  EXPECT_NE(msg.find("model.block_size = 256 is also given (set at " + path + ":3)"), std::string::npos) << msg;
  EXPECT_NO_THROW(Config::load("", {"--model.preset=gpt2", "--model.dropout=0.1"}));  // not a shape key
}

TEST(Config, APresetNamesItsFamily) {
  EXPECT_EQ(Config::load("", {"--model.preset=llama-3.1-8b"}).model.name, "llama");
  EXPECT_EQ(Config::load("", {"--model.preset=qwen2.5-0.5b", "--model.block_size=64"}).model.name, "llama");
  EXPECT_EQ(Config::load("", {"--model.preset=gpt2"}).model.name, "gpt");
  EXPECT_EQ(Config::load("", {"--model.preset=custom"}).model.name, "gpt");  // custom names no family: the default
  // A name given beside the preset must agree with it.
  auto msg = error_of([] { Config::load("", {"--model.name=gpt", "--model.preset=llama-3.1-8b"}); });
  EXPECT_NE(msg.find("model.preset = 'llama-3.1-8b' is not a gpt preset"), std::string::npos) << msg;
}

TEST(Config, SettingsThatDoNothingWarnOnce) {
  auto has = [](const Config& c, const std::string& text) {
    return std::any_of(c.warnings.begin(), c.warnings.end(),
                       [&](const std::string& w) { return w.find(text) != std::string::npos; });
  };
  EXPECT_TRUE(Config::load("").warnings.empty());
  auto c = Config::load("", {"--memory.offload=true"});
  EXPECT_TRUE(has(c, "memory.offload = true (set on the command line) does nothing without activation recomputation"));
  EXPECT_FALSE(has(Config::load("", {"--memory.offload=true", "--memory.recompute=all"}), "memory.offload"));
  c = Config::load("", {"--dist.backend=nccl"});
  EXPECT_TRUE(has(c, "dist.backend = nccl (set on the command line) does nothing with train.device = cpu"));
  c = Config::load("", {"--model.name=mlp", "--data.dataset=synthetic", "--model.n_layer=8"});
  EXPECT_TRUE(has(c, "model.n_layer (set on the command line) is a gpt | llama | phi3 key; model.name = mlp ignores it"));
  EXPECT_EQ(c.warnings.size(), 1u);
}

TEST(Config, OldRecomputeKeyNamesTheNewOne) {
  auto msg = error_of([] { Config::load("", {"--memory.checkpoint=all"}); });
  EXPECT_NE(msg.find("'memory.checkpoint' was renamed: use memory.recompute"), std::string::npos) << msg;
  TempDir dir;
  auto path = dir.file("old.ini", "[memory]\ncheckpoint = all\n");
  msg = error_of([&] { Config::load(path); });
  EXPECT_NE(msg.find(path + ":2: 'memory.checkpoint' was renamed: use memory.recompute"), std::string::npos) << msg;
}

TEST(Config, TheLastValueOfARepeatedKeyWins) {
  EXPECT_EQ(Config::load("", {"--train.steps=3", "--train.steps=5"}).train.steps, 5);
  auto c = Config::load("", {"--train.steps", "3", "--train.lr=0.5", "--train.steps=7", "--train.lr", "0.25"});
  EXPECT_EQ(c.train.steps, 7);
  EXPECT_EQ(c.train.lr, 0.25);
}

}  // namespace
}  // namespace memtrain
