// Hugging Face checkpoints in and out. Every expected value comes from transformers: the folders and
// their logits, loss and gradients are written by scripts/reference/hf_models.py (build/fixtures/hf), and the
// exports are read back by transformers' from_pretrained (scripts/reference/hf_check.py).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <cstring>
#include <regex>

#include "helpers.h"
#include "memtrain/core/config.h"
#include "memtrain/core/cpu_memory.h"
#include "memtrain/core/files.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/core/state_checkpoint.h"
#include "memtrain/models/hugging_face.h"
#include "memtrain/models/llama.h"
#include "memtrain/runtime/export.h"
#include "memtrain/runtime/factories.h"

namespace memtrain {
namespace {

namespace fs = std::filesystem;

std::string hf(const std::string& name) { return test::fixture("hf/" + name); }

// The model config.json describes, built as the trainer builds it (vocabulary 97: the fixtures').
std::shared_ptr<Model> model_of(const std::string& folder, std::vector<std::string> overrides = {}) {
  overrides.push_back("--model.init_from=" + folder);
  overrides.push_back("--data.dataset=synthetic");
  const auto c = Config::load("", overrides);
  return make_model(c.model, DataInfo{.vocab_size = 97});
}

class HuggingFaceParity : public ::testing::TestWithParam<const char*> {};

TEST_P(HuggingFaceParity, LogitsLossAndEveryGradientMatchTransformers) {
  const std::string name = GetParam();
  const auto ref = load_safetensors(hf(name + ".safetensors"));
  auto model = model_of(hf(name));
  const auto loaded = load_hugging_face_weights(*model, hf(name));
  EXPECT_GT(loaded.files, name == "qwen2" || name == "llama3_rope" || name == "phi3" ? 0 : 1);  // the sharded cases read shards
  auto logits = model->forward(ref.at("input"));
  auto loss = model->loss(logits, ref.at("target"));
  loss.backward();
  EXPECT_LT(test::relative_error(logits, ref.at("logits")), 1e-5);
  EXPECT_NEAR(loss.item<double>(), ref.at("loss").item<double>(), 1e-5);
  // Every parameter transformers has (a tied head once) has memtrain's gradient, in the checkpoint's layout (a
  // fused tensor's gradient is its projections' rows).
  const auto config = Config::load("", {"--model.init_from=" + hf(name), "--data.dataset=synthetic"}).model;
  std::set<std::string> compared;
  std::set<const void*> seen;
  for (const auto& item : model->named_parameters()) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    const auto h = hugging_face_name(config, item.key());
    SCOPED_TRACE(item.key() + " as " + h.name);
    ASSERT_TRUE(ref.count("grad/" + h.name));
    auto g = item.value().grad();
    ASSERT_TRUE(g.defined());
    auto expected = ref.at("grad/" + h.name);
    if (h.rows > 0) expected = expected.narrow(0, h.row_begin, h.rows);
    EXPECT_LT(test::relative_error(h.transposed ? g.t() : g, expected), 1e-5);
    compared.insert(h.name);
  }
  size_t grads = 0;
  for (const auto& [key, t] : ref) grads += key.starts_with("grad/");
  EXPECT_EQ(compared.size(), grads);
}

INSTANTIATE_TEST_SUITE_P(Models, HuggingFaceParity,
                         ::testing::Values("gpt2", "llama_gqa", "qwen2", "llama3_rope", "llama_bf16", "phi3"),
                         [](const auto& info) { return std::string(info.param); });

TEST(HuggingFace, ConfigJsonSetsTheModelAndAGivenKeyMustAgree) {
  auto c = Config::load("", {"--model.init_from=" + hf("llama_gqa")});
  EXPECT_EQ(c.model.name, "llama");
  EXPECT_EQ(c.model.n_kv_head, 2);
  EXPECT_EQ(c.model.ffn_hidden, 72);
  EXPECT_EQ(c.model.max_positions, 64);
  EXPECT_EQ(c.model.block_size, 64);  // the default 128 is more than the model was made for: its 64
  EXPECT_EQ(Config::load("", {"--model.init_from=" + hf("qwen2")}).model.attn_bias, "qkv");
  EXPECT_EQ(Config::load("", {"--model.init_from=" + hf("llama3_rope")}).model.rope_scaling, "llama3:8:1:4:16");
  const auto gpt2 = Config::load("", {"--model.init_from=" + hf("gpt2")});
  EXPECT_EQ(gpt2.model.name, "gpt");
  EXPECT_EQ(gpt2.model.block_size, 16);
  // The same value given again is fine; another is an error naming the key, the folder and its value.
  EXPECT_NO_THROW(Config::load("", {"--model.init_from=" + hf("llama_gqa"), "--model.n_layer=2"}));
  const auto e = test::error_of([&] { Config::load("", {"--model.init_from=" + hf("llama_gqa"), "--model.n_layer=3"}); });
  EXPECT_NE(e.find("model.n_layer = 3"), std::string::npos) << e;
  EXPECT_NE(e.find("makes it 2"), std::string::npos) << e;
  const auto b = test::error_of([&] { Config::load("", {"--model.init_from=" + hf("llama_gqa"), "--model.block_size=65"}); });
  EXPECT_NE(b.find("model.max_positions"), std::string::npos) << b;
}

TEST(HuggingFace, BadFoldersEachGetTheirOwnError) {
  auto bad = [](const std::string& name) { return hf("bad/" + name); };
  struct Case {
    const char* folder;
    std::vector<const char*> says;
  };
  // Config-level: refused while the config is read, before a model exists.
  for (const auto& [folder, says] : std::vector<Case>{
           {"no_config", {"no config.json"}},
           {"unknown_type", {"model_type = falcon", "gpt2 | llama | mistral | qwen2"}},
           {"yarn_rope", {"rope_scaling.rope_type = yarn", "llama3"}},
           {"phi3_longrope", {"rope_scaling.rope_type = longrope", "llama3"}},
           {"phi3_partial_rotary", {"partial_rotary_factor = 0.5", "1.0"}}}) {
    const auto e = test::error_of([&] { Config::load("", {"--model.init_from=" + bad(folder)}); });
    for (auto s : says) EXPECT_NE(e.find(s), std::string::npos) << folder << ": " << e;
  }
  EXPECT_NE(test::error_of([&] { Config::load("", {"--model.init_from=" + bad("nowhere")}); }).find("no such folder"),
            std::string::npos);
  // Weight-level: refused before anything is copied, the model left as it was.
  for (const auto& [folder, says] : std::vector<Case>{
           {"missing_shard", {"missing shard model-00002-of-00012.safetensors"}},
           {"wrong_shape", {"mlp.", "has shape", "expects"}},
           {"truncated", {"model-00012-of-00012.safetensors", "truncated"}},
           {"unexpected_tensor", {"unexpected tensor 'model.layers.0.self_attn.extra.weight'", "model-00001-of-00012"}},
           {"phi3_extra_rows", {"'model.layers.0.self_attn.qkv_proj.weight' has 68 rows", "take 64"}}}) {
    auto model = model_of(bad(folder));
    std::vector<torch::Tensor> before;
    for (const auto& p : model->parameters()) before.push_back(p.detach().clone());
    const auto e = test::error_of([&] { load_hugging_face_weights(*model, bad(folder)); });
    for (auto s : says) EXPECT_NE(e.find(s), std::string::npos) << folder << ": " << e;
    const auto after = model->parameters();
    for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], after[i])) << folder << ": half-loaded";
  }
}

TEST(HuggingFace, ALoadHoldsTheModelPlusOneTensor) {
  // The counting allocator's peak while the weights load: the model exists already, so what the load adds
  // is at most the largest tensor read (and its dtype conversion), never a copy of the file.
  auto model = model_of(hf("llama_bf16"));
  int64_t largest = 0;
  for (const auto& p : model->parameters()) largest = std::max<int64_t>(largest, p.numel() * 4);
  ASSERT_TRUE(cpu_memory::installed());
  const auto resident = cpu_memory::current();
  cpu_memory::reset_peak();
  load_hugging_face_weights(*model, hf("llama_bf16"));
  const auto added = cpu_memory::peak() - resident;
  EXPECT_LE(added, largest + largest / 2) << "bf16 tensor read (half) + nothing else";
  EXPECT_GT(added, 0);
}

// A tiny Llama run on a token file of random ids, from the llama_gqa folder (or the fixture folder `from` names).
struct LlamaRun {
  test::TempDir dir;
  std::string tokens = dir.path("val.bin");
  std::string from = hf("llama_gqa");
  LlamaRun() {
    torch::manual_seed(7);
    auto ids = torch::randint(0, 97, {4000}, torch::kLong).to(torch::kShort);  // ids < 97 fit int16 and uint16 alike
    std::ofstream(tokens, std::ios::binary).write(static_cast<const char*>(ids.data_ptr()), ids.numel() * 2);
  }
  std::string memtrain(const std::string& args, int* code, const std::string& subcommand = "") const {
    return test::shell(test::binary("memtrain") + " " + subcommand + " --model.init_from=" + from + " --data.tokens=" + tokens +
                           " --data.val_tokens=" + tokens + " --data.token_format=raw --model.block_size=16"
                           " --train.micro_batch=4 --train.eval_batches=2 --log.progress=lines --log.dir=" + dir.path() +
                           " " + args + " 2>&1",
                       code);
  }
  std::string python(const std::string& args) const {
    return test::shell(std::string(MEMTRAIN_PYTHON) + " " + test::source("scripts/reference/hf_check.py") + " " + args + " 2>&1");
  }
};

double number_after(const std::string& text, const std::string& label) {
  std::smatch m;
  if (!std::regex_search(text, m, std::regex(label + " ?([-0-9.eE+]+)"))) return NAN;
  return std::stod(m[1]);
}

TEST(HuggingFace, EvalPrintsTheValidationLossTransformersComputes) {
  LlamaRun r;
  int code = -1;
  const auto out = r.memtrain("--log.name=e", &code, "eval");
  ASSERT_EQ(code, 0) << out;
  const double ours = number_after(out, "val loss");
  const double theirs = number_after(r.python("val_loss " + hf("llama_gqa") + " " + r.tokens + " 16 8"), "val_loss");
  EXPECT_NEAR(ours, theirs, 1e-5) << out;
  std::ifstream summary(r.dir.path("e-eval/summary.json"));
  std::string text((std::istreambuf_iterator<char>(summary)), {});
  EXPECT_NEAR(number_after(text, "\"val_loss\":"), theirs, 1e-5) << text;
}

TEST(HuggingFace, TrainedWeightsExportAndTransformersGivesTheSameLogits) {
  LlamaRun r;
  int code = -1;
  auto out = r.memtrain("--train.steps=3 --train.warmup_steps=1 --train.eval_every=0 --log.name=t", &code);
  ASSERT_EQ(code, 0) << out;
  const auto ckpt = r.dir.path("t/checkpoints");
  out = test::shell(test::binary("memtrain") + " export --checkpoint " + ckpt + " --out " + r.dir.path("hf") +
                        " --max-shard-mb 1 2>&1", &code);
  ASSERT_EQ(code, 0) << out;
  // memtrain's logits from the trained weights (its own file), transformers' from the export.
  auto model = model_of(hf("llama_gqa"), {"--model.block_size=16"});
  load_module_state(*model, load_safetensors(ckpt + "/model.safetensors"), "model.safetensors");
  torch::NoGradGuard no_grad;
  auto input = torch::randint(0, 97, {2, 16}, torch::kLong);
  save_safetensors(r.dir.path("logits.safetensors"), {{"input", input}, {"logits", model->forward(input)}});
  const auto check = r.python("logits " + r.dir.path("hf") + " " + r.dir.path("logits.safetensors"));
  EXPECT_LT(number_after(check, "max_abs_diff"), 1e-5 * number_after(check, "max_abs_ref")) << check;
  EXPECT_GT(number_after(check, "max_abs_ref"), 0) << check;
  // An export never replaces a folder.
  out = test::shell(test::binary("memtrain") + " export --checkpoint " + ckpt + " --out " + r.dir.path("hf") + " 2>&1", &code);
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("already exists"), std::string::npos) << out;
}

// The other families and the bf16 export, read back by transformers as llama_gqa's fp32 export is above: GPT-2
// (Conv1D weights stored transposed, tied head), Qwen2 (q, k and v biases, tied head), Llama 3.1's rope scaling
// (rope_scaling in config.json), and a bf16 export (--dtype bfloat16) of the bf16-stored Llama. Each trains 3 steps
// from its fixture folder, is exported, and transformers' logits from the export must be memtrain's from the
// trained weights. For the bf16 export memtrain's weights are first rounded to bf16 here (torch's round to nearest
// even, as any bf16 file holds them): both sides then run the same values in fp32, so the tolerance stays 1e-5.
struct ExportCase {
  const char* name;
  const char* dtype;  // --dtype: float32 | bfloat16
};
// GoogleTest prints a parameter with this (else its raw bytes, in every test's name).
void PrintTo(const ExportCase& c, std::ostream* os) { *os << c.name << " as " << c.dtype; }

class HuggingFaceExport : public ::testing::TestWithParam<ExportCase> {};

TEST_P(HuggingFaceExport, TrainedWeightsReadBackByTransformersGiveTheSameLogits) {
  const auto& k = GetParam();
  LlamaRun r;
  r.from = hf(k.name);
  int code = -1;
  auto out = r.memtrain("--train.steps=3 --train.warmup_steps=1 --train.eval_every=0 --log.name=t", &code);
  ASSERT_EQ(code, 0) << out;
  const auto ckpt = r.dir.path("t/checkpoints");
  out = test::shell(test::binary("memtrain") + " export --checkpoint " + ckpt + " --out " + r.dir.path("hf") +
                        " --max-shard-mb 1 --dtype " + k.dtype + " 2>&1", &code);
  ASSERT_EQ(code, 0) << out;
  auto model = model_of(hf(k.name), {"--model.block_size=16"});
  const auto trained = load_safetensors(ckpt + "/model.safetensors");
  load_module_state(*model, trained, "model.safetensors");
  torch::NoGradGuard no_grad;
  // Training moved the weights off the fixture's: the export is of what trained, not of what was loaded.
  auto fresh = model_of(hf(k.name), {"--model.block_size=16"});
  load_hugging_face_weights(*fresh, hf(k.name));
  double moved = 0;
  const auto before = fresh->parameters(), after = model->parameters();
  ASSERT_EQ(before.size(), after.size());
  ASSERT_FALSE(after.empty());
  for (size_t i = 0; i < after.size(); ++i) moved = std::max(moved, (after[i] - before[i]).abs().max().item<double>());
  EXPECT_GT(moved, 0) << "3 steps left every weight as loaded";
  const bool bf16 = std::string(k.dtype) == "bfloat16";
  if (bf16)
    for (auto& p : model->parameters()) p.copy_(p.to(torch::kBFloat16).to(torch::kFloat));
  torch::manual_seed(11);
  auto input = torch::randint(0, 97, {2, 16}, torch::kLong);
  save_safetensors(r.dir.path("logits.safetensors"), {{"input", input}, {"logits", model->forward(input)}});
  const auto check = r.python("logits " + r.dir.path("hf") + " " + r.dir.path("logits.safetensors"));
  EXPECT_LT(number_after(check, "max_abs_diff"), 1e-5 * number_after(check, "max_abs_ref")) << check;
  EXPECT_GT(number_after(check, "max_abs_ref"), 0) << check;
  // The files hold the dtype asked for (hf_check.py reads the safetensors headers).
  EXPECT_NE(check.find(bf16 ? "stored BF16\n" : "stored F32\n"), std::string::npos) << check;
}

INSTANTIATE_TEST_SUITE_P(Models, HuggingFaceExport,
                         ::testing::Values(ExportCase{"gpt2", "float32"}, ExportCase{"qwen2", "float32"},
                                           ExportCase{"llama3_rope", "float32"}, ExportCase{"llama_bf16", "bfloat16"},
                                           ExportCase{"phi3", "float32"}),
                         [](const auto& info) { return std::string(info.param.name) + "_" + info.param.dtype; });

TEST(HuggingFace, AFourRankStageThreeCheckpointExportsTheSameBytesAsOneRank) {
  // Saved at step 2 by 4 ranks in stage 3 (each rank holds a quarter of every parameter), then taken up by one
  // process with nothing left to train, which saves the same state whole: both export to the same files.
  LlamaRun r;
  int code = -1;
  const std::string common = " --train.micro_batch=1 --train.warmup_steps=1 --train.eval_every=0 --checkpoint.every=2 --log.every=1 ";
  auto out = test::shell(test::binary("memtrain-run") + " --standalone --nproc-per-node 4 -- " + test::binary("memtrain") +
                             " --model.init_from=" + hf("llama_gqa") + " --data.tokens=" + r.tokens + " --data.val_tokens=" + r.tokens +
                             " --data.token_format=raw"
                             " --model.block_size=16 --log.progress=lines --dist.zero_stage=3 --train.steps=2 --log.dir=" +
                             r.dir.path() + " --log.name=four" + common + " 2>&1", &code);
  ASSERT_EQ(code, 0) << out;
  const auto four = checkpoint_folder(r.dir.path("four/checkpoints"), 2);
  ASSERT_EQ(read_manifest(four).world_size, 4);
  // Each rank read only its shard: the four reads add up to the model's bytes, each about a quarter, and what a
  // rank's host memory grew by during its read is at most one tensor (the parts themselves exist already).
  std::smatch m;
  int64_t total = 0, sum = 0, ranks = 0;
  const int64_t largest = 97 * 32 * 4;  // the untied head and the embedding, fp32: the largest tensors
  for (auto it = out.cbegin(); std::regex_search(it, out.cend(), m, std::regex("host \\+\\S+ \\S+ at most during the load \\(([0-9]+) bytes; read ([0-9]+) of ([0-9]+)\\)")); it = m.suffix().first) {
    const int64_t added = std::stoll(m[1]), read = std::stoll(m[2]);
    total = std::stoll(m[3]);
    EXPECT_LE(added, largest) << m[0];
    EXPECT_LE(read, total / 4 + largest) << m[0];
    sum += read, ++ranks;
  }
  EXPECT_EQ(ranks, 4) << out;
  EXPECT_EQ(sum, total) << out;
  // The weights each rank assembled from its reads are the file's: the first step's loss is one process's,
  // which read them whole (the same global batch of 4).
  out = r.memtrain("--train.steps=1 --log.name=whole" + common + " --train.micro_batch=4", &code);
  ASSERT_EQ(code, 0) << out;
  auto first_loss = [&](const std::string& run) { return test::metric_losses(r.dir.path(run + "/metrics.jsonl")).at(0); };
  EXPECT_NEAR(first_loss("four"), first_loss("whole"), 1e-5 * first_loss("whole"));
  out = r.memtrain("--train.steps=2 --log.name=one --checkpoint.resume=" + four + common, &code);
  ASSERT_EQ(code, 0) << out;
  out = test::shell(test::binary("memtrain") + " export --checkpoint " + four + " --out " + r.dir.path("x4") + " && " +
                        test::binary("memtrain") + " export --checkpoint " + r.dir.path("one/checkpoints") + " --out " +
                        r.dir.path("x1") + " 2>&1", &code);
  ASSERT_EQ(code, 0) << out;
  ASSERT_EQ(read_manifest(find_latest_checkpoint(r.dir.path("one/checkpoints"))).world_size, 1);
  for (const char* f : {"model.safetensors", "config.json"}) {
    EXPECT_EQ(read_file_bytes(r.dir.path(std::string("x4/") + f)), read_file_bytes(r.dir.path(std::string("x1/") + f))) << f;
  }
}

TEST(HuggingFace, TheExampleExportsAModelTransformersGeneratesWith) {
  // The README's path: the Llama example on the Austen BPE tokens (3 steps here), exported with the tokens'
  // tokenizer, then transformers' text-generation pipeline reads the folder alone.
  test::TempDir dir;
  int code = -1;
  auto out = test::shell(test::binary("memtrain") + " --config " + test::source("examples/configs/llama_austen_bpe_cpu.ini") +
                             " --train.steps=3 --train.warmup_steps=1 --train.eval_every=0 --log.progress=lines --log.dir=" +
                             dir.path() + " --log.name=ex 2>&1 && " + test::binary("memtrain") + " export --checkpoint " +
                             dir.path("ex/checkpoints") + " --out " + dir.path("hf") + " --dtype bfloat16 2>&1",
                         &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_TRUE(std::filesystem::exists(dir.path("hf/tokenizer.json"))) << out;
  const auto text = test::shell(std::string(MEMTRAIN_PYTHON) + " " + test::source("scripts/reference/hf_check.py") +
                                " pipeline " + dir.path("hf") + " 'It is a truth' 8 2>&1");
  EXPECT_NE(text.find("text: It is a truth"), std::string::npos) << text;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(text, m, std::regex("text: It is a truth(.+)"))) << text;
  EXPECT_GE(m[1].length(), 4) << "no continuation: " << text;
}

TEST(HuggingFace, PrepareTokensWithAFolderTokenizerWritesWideIdsAsUint32) {
  // A word-level tokenizer of 70,000 entries (w0 .. w69999): ids past 65,535 need llm.c's version 2 (uint32).
  test::TempDir dir;
  const std::string make = "from tokenizers import Tokenizer, models, pre_tokenizers\n"
                           "t = Tokenizer(models.WordLevel({'w%d' % i: i for i in range(70000)}, unk_token='w0'))\n"
                           "t.pre_tokenizer = pre_tokenizers.Whitespace()\n"
                           "t.save('" + dir.path("tokenizer.json") + "')\n";
  std::ofstream(dir.path("make.py")) << make;
  std::ofstream(dir.path("corpus.txt")) << "w69999 w1 w65536 w7 w65535 w2 w3 w4 w5 w6";
  int code = -1;
  const auto out = test::shell(std::string(MEMTRAIN_PYTHON) + " " + dir.path("make.py") + " && " + MEMTRAIN_PYTHON + " " +
                                   test::source("scripts/prepare_tokens.py") + " --tokenizer " + dir.path() + " --input " +
                                   dir.path("corpus.txt") + " --out " + dir.path("tok") + " --val-fraction 0.2 2>&1",
                               &code);
  ASSERT_EQ(code, 0) << out;
  const auto bytes = read_file_bytes(dir.path("tok/train.bin"));
  ASSERT_EQ(bytes.size(), 1024u + 8 * 4) << out;  // 8 training tokens of 10, uint32
  int32_t header[4];
  std::memcpy(header, bytes.data(), sizeof header);
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 2);  // uint32 tokens
  EXPECT_EQ(header[2], 8);
  EXPECT_EQ(header[3], 70000);
  std::vector<uint32_t> ids(8);
  std::memcpy(ids.data(), bytes.data() + 1024, 32);
  EXPECT_EQ(ids, (std::vector<uint32_t>{69999, 1, 65536, 7, 65535, 2, 3, 4}));
  EXPECT_TRUE(std::filesystem::exists(dir.path("tok/tokenizer.json")));
}

}  // namespace
}  // namespace memtrain
