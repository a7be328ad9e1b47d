// Issue 38: chat and instruction records, packed. Expected values come from arithmetic on the records' lengths and
// from each record run alone (no packing, no mask, positions from 0): a packed row must give every record exactly
// what it gets alone, and the loss of a step is its trained tokens' summed cross-entropy over their count.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <sstream>

#include "helpers.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/data/datasets.h"
#include "memtrain/models/hugging_face.h"
#include "memtrain/models/model.h"
#include "memtrain/runtime/factories.h"
#include "memtrain/runtime/trainer.h"

namespace memtrain {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kVocab = 64;

// Records of the given lengths: random ids, the second half of each record trained (a prompt, then its answer).
struct Written {
  std::vector<torch::Tensor> tokens, trained;
};
Written write_records(const std::string& path, const std::vector<int64_t>& lengths, uint64_t seed) {
  auto g = torch::make_generator<at::CPUGeneratorImpl>(seed);
  Written w;
  std::vector<int64_t> offsets = {0};
  for (auto n : lengths) {
    w.tokens.push_back(torch::randint(1, kVocab, {n}, g, torch::kLong));
    auto mask = torch::zeros({n}, torch::kUInt8);
    mask.slice(0, n / 2, n).fill_(1);
    w.trained.push_back(mask);
    offsets.push_back(offsets.back() + n);
  }
  save_safetensors(path, {{"tokens", torch::cat(w.tokens).to(torch::kInt)},
                          {"trained", torch::cat(w.trained)},
                          {"offsets", torch::tensor(offsets, torch::kLong)},
                          {"vocab_size", torch::tensor({kVocab}, torch::kLong)}});
  return w;
}

Config chat_config(const std::string& dir, const std::string& model, int64_t block) {
  auto c = test::tiny_gpt_config(2);
  c.model.name = model;
  c.model.block_size = block;
  c.model.vocab_size = kVocab;
  c.data.dataset = "chat";
  c.data.path = dir;
  if (model == "llama") c.model.n_kv_head = 1;
  return c;
}

TEST(Chat, RecordsArePackedWholeWithTheirPositionsAndOnlyTrainedTargets) {
  test::TempDir dir;
  // Pairs per record: length - 1 = 4, 6, 3, 7, 2; rows of 10: [4 + 6], [3 + 7], [2 + padding 8].
  const auto w = write_records(dir.path("val.safetensors"), {5, 7, 4, 8, 3}, 1);
  write_records(dir.path("train.safetensors"), {5, 7, 4, 8, 3}, 1);
  auto data = make_chat_dataset({.dir = dir.path(), .block_size = 10}, {});
  EXPECT_EQ(data->info().vocab_size, kVocab);
  EXPECT_TRUE(data->masks_targets());
  const auto rows = data->val_batches(8, 0);
  ASSERT_EQ(rows.size(), 1u);
  const auto& b = rows[0];
  ASSERT_EQ(b.input.sizes(), (std::vector<int64_t>{3, 10}));
  const std::vector<std::vector<int64_t>> docs = {{0, 0, 0, 0, 1, 1, 1, 1, 1, 1}, {0, 0, 0, 1, 1, 1, 1, 1, 1, 1},
                                                  {0, 0, -1, -1, -1, -1, -1, -1, -1, -1}};
  const std::vector<std::vector<int64_t>> pos = {{0, 1, 2, 3, 0, 1, 2, 3, 4, 5}, {0, 1, 2, 0, 1, 2, 3, 4, 5, 6},
                                                 {0, 1, 0, 0, 0, 0, 0, 0, 0, 0}};
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(torch::equal(b.documents[r], torch::tensor(docs[r], torch::kLong))) << "row " << r;
    EXPECT_TRUE(torch::equal(b.positions[r], torch::tensor(pos[r], torch::kLong))) << "row " << r;
  }
  // Record 1 (7 tokens) at row 0, columns 4..9: input its tokens 0..5, target 1..6 where trained (from token 3 on).
  const auto& t1 = w.tokens[1];
  EXPECT_TRUE(torch::equal(b.input[0].slice(0, 4, 10), t1.slice(0, 0, 6)));
  for (int j = 0; j < 6; ++j)
    EXPECT_EQ(b.target[0][4 + j].item<int64_t>(), j + 1 >= 3 ? t1[j + 1].item<int64_t>() : -100) << j;
  EXPECT_EQ(b.target[2].slice(0, 2, 10).ne(-100).sum().item<int64_t>(), 0);  // padding trains nothing
}

TEST(Chat, BadFilesAreNamed) {
  test::TempDir dir;
  EXPECT_NE(test::error_of([&] { make_chat_dataset({.dir = dir.path(), .block_size = 8}, {}); }).find("train.safetensors"),
            std::string::npos);
  save_safetensors(dir.path("train.safetensors"), {{"tokens", torch::tensor({1, 2, 3}, torch::kInt)},
                                                   {"trained", torch::tensor({0, 1, 1}, torch::kUInt8)},
                                                   {"offsets", torch::tensor({0, 2}, torch::kLong)},
                                                   {"vocab_size", torch::tensor({kVocab}, torch::kLong)}});
  write_records(dir.path("val.safetensors"), {4}, 2);
  const auto e = test::error_of([&] { make_chat_dataset({.dir = dir.path(), .block_size = 8}, {}); });
  EXPECT_NE(e.find("'offsets' must run from 0 to the token count 3"), std::string::npos) << e;
}

class ChatModels : public ::testing::TestWithParam<const char*> {};

// Each record of a packed row gets exactly what it gets alone: changing one record's tokens leaves the others' logits
// bitwise unchanged (a mask that leaks fails), and the packed loss (summed cross-entropy over trained tokens / their
// count) and every parameter gradient equal running each record alone with labels -100 on its prompt, to 1e-5.
TEST_P(ChatModels, APackedRowGivesEachRecordWhatItGetsAlone) {
  const std::string name = GetParam();
  test::TempDir dir;
  const std::vector<int64_t> lengths = {6, 9, 5, 12, 4};
  const auto w = write_records(dir.path("val.safetensors"), lengths, 3);
  write_records(dir.path("train.safetensors"), lengths, 3);
  auto c = chat_config(dir.path(), name, 16);
  auto data = make_chat_dataset({.dir = dir.path(), .block_size = 16}, {});
  const auto batch = data->val_batches(8, 0).at(0);
  torch::manual_seed(5);
  auto model = make_model(c.model, data->info());
  model->eval();
  torch::Tensor logits;
  {
    PackedScope packed(batch.positions, batch.documents);
    logits = model->forward(batch.input);
    auto changed = batch.input.clone();
    // Row 0 holds records 0 and 1 (5 + 8 pairs): change record 0's tokens.
    changed[0].slice(0, 0, 5).random_(1, kVocab);
    const auto again = model->forward(changed);
    EXPECT_TRUE(torch::equal(again[0].slice(0, 5, 13), logits[0].slice(0, 5, 13))) << "record 1 saw record 0";
    EXPECT_FALSE(torch::equal(again[0].slice(0, 0, 5), logits[0].slice(0, 0, 5)));
  }
  // Loss and gradients: packed against each record alone.
  model->train();
  model->zero_grad();
  torch::Tensor packed_loss;
  {
    PackedScope packed(batch.positions, batch.documents);
    const auto out = model->forward(batch.input);
    const auto target = batch.target.reshape({-1});
    packed_loss = torch::nn::functional::cross_entropy(
                      out.reshape({-1, out.size(-1)}), target,
                      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
                  static_cast<double>(target.ne(-100).sum().item<int64_t>());
    packed_loss.backward();
  }
  std::map<std::string, torch::Tensor> packed_grads;
  for (const auto& item : model->named_parameters())
    if (item.value().grad().defined()) packed_grads[item.key()] = item.value().grad().clone();
  model->zero_grad();
  int64_t count = 0;
  for (size_t r = 0; r < lengths.size(); ++r)
    count += w.trained[r].slice(0, 1).sum().item<int64_t>();
  auto alone_loss = torch::zeros({});
  for (size_t r = 0; r < lengths.size(); ++r) {
    const auto& t = w.tokens[r];
    const auto n = t.size(0);
    auto target = t.slice(0, 1, n).clone();
    target.masked_fill_(w.trained[r].slice(0, 1, n).eq(0), -100);
    const auto out = model->forward(t.slice(0, 0, n - 1).unsqueeze(0));
    const auto loss = torch::nn::functional::cross_entropy(
                          out.reshape({-1, out.size(-1)}), target,
                          torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
                      static_cast<double>(count);
    loss.backward();
    alone_loss += loss.detach();
  }
  EXPECT_NEAR(packed_loss.item<double>(), alone_loss.item<double>(), 1e-5);
  size_t compared = 0;
  for (const auto& item : model->named_parameters()) {
    if (!packed_grads.count(item.key())) continue;
    EXPECT_LT(test::relative_error(packed_grads.at(item.key()), item.value().grad()), 1e-5) << item.key();
    ++compared;
  }
  EXPECT_GT(compared, 4u);
}

INSTANTIATE_TEST_SUITE_P(Models, ChatModels, ::testing::Values("gpt", "llama"),
                         [](const auto& info) { return std::string(info.param); });

// The step's loss is over its trained tokens whatever the micro-batching: 4 rows at once, 2 x 2 accumulated (the
// micro-batches hold different numbers of trained tokens), and the fused head, give the same loss and gradient norm.
TEST(Chat, AccumulationAndTheFusedHeadGiveOneBigBatchsStep) {
  test::TempDir dir;
  std::vector<int64_t> lengths;
  for (int i = 0; i < 40; ++i) lengths.push_back(3 + (i * 7) % 13);
  write_records(dir.path("train.safetensors"), lengths, 4);
  write_records(dir.path("val.safetensors"), {5, 6, 7}, 5);
  auto run = [&](int64_t micro, int64_t accum, const std::string& head) {
    auto c = chat_config(dir.path(), "llama", 16);
    c.train.micro_batch = micro, c.train.accum_steps = accum, c.memory.head = head;
    c.train.warmup_steps = 0, c.train.lr = 1e-2;
    Trainer t(c);
    std::vector<std::pair<double, double>> out;
    for (int s = 0; s < 3; ++s) {
      const auto r = t.step();
      out.emplace_back(r.loss.item<double>(), r.grad_norm.item<double>());
    }
    return out;
  };
  const auto one = run(4, 1, "plain");
  for (const auto& [micro, accum, head] : std::vector<std::tuple<int64_t, int64_t, std::string>>{{2, 2, "plain"}, {1, 4, "fused"}}) {
    const auto got = run(micro, accum, head);
    for (size_t s = 0; s < one.size(); ++s) {
      EXPECT_NEAR(got[s].first, one[s].first, 1e-5 * one[s].first) << micro << " x " << accum << " " << head << ", step " << s + 1;
      EXPECT_NEAR(got[s].second, one[s].second, 1e-5 * one[s].second) << micro << " x " << accum << " " << head;
    }
  }
}

// scripts/prepare_chat.py on a JSONL with good and bad records and the Austen BPE tokenizer (no chat template: the
// script's plain one): each bad record named by its line, and a kept record's ids are transformers' own
// apply_chat_template(messages, tokenize=True), its trained tokens the assistant's turn.
TEST(Chat, PrepareChatGivesTheTemplatesIdsAndNamesBadLines) {
  test::TempDir dir;
  const auto jsonl = dir.file("records.jsonl",
                              "{\"messages\": [{\"role\": \"user\", \"content\": \"Who wrote Emma?\"}, {\"role\": \"assistant\", \"content\": \"Jane Austen wrote Emma.\"}]}\n"
                              "{\"prompt\": \"Name a sister.\", \"response\": \"Elizabeth Bennet.\"}\n"
                              "{\"messages\": [{\"role\": \"user\", \"content\": \"No answer here\"}]}\n"
                              "not json\n"
                              "{\"prompt\": \"Empty?\", \"response\": \"  \"}\n"
                              "{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}, {\"role\": \"assistant\", \"content\": \"y\"}]}\n"
                              "{\"prompt\": \"Q\", \"response\": \"A\"}\n");
  const auto tokenizer = (fs::path(default_data_dir()) / "tokens" / "austen-bpe8192").string();
  int code = -1;
  const auto out = test::shell(std::string(MEMTRAIN_PYTHON) + " " + test::source("scripts/prepare_chat.py") +
                                   " --tokenizer " + tokenizer + " --train " + jsonl + " --val-fraction 0.2 --out " +
                                   dir.path("chat") + " 2>&1",
                               &code);
  ASSERT_EQ(code, 0) << out;
  for (const char* line : {"train line 3: dropped: no assistant message", "train line 4: dropped: not JSON",
                           "train line 5: dropped: an empty assistant answer", "train line 6: dropped: message 0 has role 'robot'"})
    EXPECT_NE(out.find(line), std::string::npos) << line << "\n" << out;
  EXPECT_FALSE(fs::exists(dir.path("chat.partial")));
  const auto t = load_safetensors(dir.path("chat/train.safetensors"));
  const auto offsets = t.at("offsets");
  ASSERT_EQ(offsets.numel(), 3);  // lines 1 and 2 kept
  // transformers' ids for line 1 with the same template.
  const auto ids = test::shell(std::string(MEMTRAIN_PYTHON) + " -c \"import sys; sys.path.insert(0, '" + test::source("scripts") +
                               "'); import prepare_chat as p; t = p.load_tokenizer('" + tokenizer +
                               "', None); print(' '.join(map(str, t.apply_chat_template([{'role': 'user', 'content': "
                               "'Who wrote Emma?'}, {'role': 'assistant', 'content': 'Jane Austen wrote Emma.'}], "
                               "tokenize=True))))\" 2>/dev/null | tail -1");
  std::vector<int64_t> want;
  std::istringstream in(ids);
  for (int64_t v; in >> v;) want.push_back(v);
  const auto first = t.at("tokens").slice(0, 0, offsets[1].item<int64_t>()).to(torch::kLong);
  ASSERT_EQ(first.numel(), static_cast<int64_t>(want.size())) << ids;
  EXPECT_TRUE(torch::equal(first, torch::tensor(want, torch::kLong)));
  // The trained tokens are a suffix of record 1: the answer and its end of turn, nothing of the prompt.
  const auto trained = t.at("trained").slice(0, 0, offsets[1].item<int64_t>()).to(torch::kLong);
  const auto n = trained.sum().item<int64_t>();
  EXPECT_GT(n, 0);
  EXPECT_EQ(trained.slice(0, trained.numel() - n).sum().item<int64_t>(), n);
  // It trains.
  auto c = chat_config(dir.path("chat"), "llama", 32);
  c.model.vocab_size = 0;
  c.train.micro_batch = 2;
  Trainer tr(c);
  EXPECT_TRUE(std::isfinite(tr.step().loss.item<double>()));
}

// memtrain on the chat records in `dir`, 3 steps of 4 rows of 16 (one process, or 2 ranks of 2 rows through
// memtrain-run), with `args` for the model; the run's metrics.jsonl (its output in *out).
std::string run_chat(const test::TempDir& dir, int ranks, const std::string& name, const std::string& args,
                     std::string* out = nullptr) {
  const std::string cmd =
      (ranks > 1 ? test::binary("memtrain-run") + " --standalone --nproc-per-node 2 -- " : std::string()) +
      test::binary("memtrain") + " " + args + " --model.block_size=16 --data.dataset=chat --data.path=" + dir.path() +
      " --train.steps=3 --train.warmup_steps=0 --train.lr=1e-2 --train.eval_every=0 --log.every=1 --log.progress=lines"
      " --train.micro_batch=" + std::to_string(4 / ranks) + " --log.dir=" + dir.path() + " --log.name=" + name + " 2>&1";
  int code = -1;
  const auto output = test::shell(cmd, &code);
  EXPECT_EQ(code, 0) << output;
  if (out) *out = output;
  return dir.path(name + "/metrics.jsonl");
}

// Two ranks take their parts of the same rows and normalise by the step's trained tokens over both: their losses and
// gradient norms are one process's (1e-5), at ZeRO 0 and at ZeRO 3 with every block recomputed.
TEST(Chat, TwoRanksGiveOneProcesssSteps) {
  test::TempDir dir;
  std::vector<int64_t> lengths;
  for (int i = 0; i < 40; ++i) lengths.push_back(3 + (i * 5) % 11);
  write_records(dir.path("train.safetensors"), lengths, 6);
  write_records(dir.path("val.safetensors"), {5, 6, 7}, 7);
  const std::string llama = "--model.name=llama --model.n_layer=2 --model.n_embd=32 --model.n_head=2 --model.n_kv_head=1"
                            " --model.vocab_size=64";
  auto run = [&](int ranks, const std::string& name, const std::string& extra) {
    const auto metrics = run_chat(dir, ranks, name, llama + " " + extra);
    return std::make_pair(test::metric_losses(metrics), test::metric_grad_norms(metrics));
  };
  const auto one = run(1, "one", "");
  ASSERT_EQ(one.first.size(), 3u);
  for (int stage : {0, 3}) {
    // Stage 3 recomputes every block: its backward runs the forward again under the same packed layout.
    const auto two = run(2, "two" + std::to_string(stage),
                         "--dist.zero_stage=" + std::to_string(stage) + (stage == 3 ? " --memory.recompute=all" : ""));
    ASSERT_EQ(two.first.size(), 3u);
    for (size_t s = 0; s < 3; ++s) {
      EXPECT_NEAR(two.first[s], one.first[s], 1e-5 * one.first[s]) << "stage " << stage << ", step " << s + 1;
      EXPECT_NEAR(two.second[s], one.second[s], 1e-5 * one.second[s]) << "stage " << stage << ", grad norm, step " << s + 1;
    }
  }
}

// QLoRA on records: the NF4 Llama of scripts/reference/nf4_ref.py with its adapters, the fused head, trained on
// packed records in one process and on 2 ranks at ZeRO 3: the same losses (1e-5).
TEST(Chat, QloraTrainsOnRecordsAlikeOnOneAndTwoRanks) {
  test::TempDir dir;
  std::vector<int64_t> lengths;
  for (int i = 0; i < 30; ++i) lengths.push_back(4 + (i * 3) % 10);
  write_records(dir.path("train.safetensors"), lengths, 8);
  write_records(dir.path("val.safetensors"), {5, 6}, 9);
  const std::string qlora = "--model.init_from=" + test::fixture("hf/nf4_llama") + " --lora.init_from=" +
                            test::fixture("hf/nf4_llama_lora") + " --lora.quantize_base=nf4 --memory.head=fused";
  auto run = [&](int ranks, const std::string& name, const std::string& extra) {
    std::string out;
    const auto metrics = run_chat(dir, ranks, name, qlora + " " + extra, &out);
    EXPECT_NE(out.find("nf4:"), std::string::npos) << out;
    return test::metric_losses(metrics);
  };
  const auto one = run(1, "one", "");
  const auto two = run(2, "two", "--dist.zero_stage=3");
  ASSERT_EQ(one.size(), 3u);
  ASSERT_EQ(two.size(), 3u);
  for (size_t s = 0; s < 3; ++s) EXPECT_NEAR(two[s], one[s], 1e-5 * one[s]) << "step " << s + 1;
}

// transformers as the oracle (scripts/reference/chat_ref.py): six records of hf_models.py's Llama (GQA) and GPT-2, each
// run alone in transformers with labels -100 on its prompt; memtrain packs them into rows of 16 and runs them at once.
// The loss (summed over trained tokens / their count) and every parameter's gradient agree to 1e-5.
class ChatTransformers : public ::testing::TestWithParam<const char*> {};

TEST_P(ChatTransformers, PackedLossAndGradientsEqualEachRecordAloneInTransformers) {
  const std::string name = GetParam();
  const auto base = test::fixture("hf/" + name);
  const auto ref = load_safetensors(test::fixture("chat/" + name + "_ref.safetensors"));
  const auto c = Config::load("", {"--model.init_from=" + base, "--data.dataset=chat", "--model.block_size=16",
                                   "--data.path=" + test::fixture("chat/" + name)});
  auto model = make_model(c.model, DataInfo{.vocab_size = 97});
  load_hugging_face_weights(*model, base);
  auto data = make_chat_dataset({.dir = test::fixture("chat/" + name), .block_size = 16}, {});
  const auto rows = data->val_batches(8, 0);
  ASSERT_EQ(rows.size(), 1u);
  const auto& batch = rows[0];
  EXPECT_LT(batch.input.size(0), 6) << "the records were not packed";
  model->train();
  PackedScope packed(batch.positions, batch.documents);
  const auto out = model->forward(batch.input);
  const auto target = batch.target.reshape({-1});
  const auto loss = torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), target,
                                                         torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
                    static_cast<double>(target.ne(-100).sum().item<int64_t>());
  loss.backward();
  EXPECT_NEAR(loss.item<double>(), ref.at("loss").item<double>(), 1e-5);
  size_t compared = 0;
  for (const auto& item : model->named_parameters()) {
    const auto hf = hugging_face_name(c.model, item.key());
    SCOPED_TRACE(item.key() + " as " + hf.name);
    ASSERT_TRUE(ref.count("grad/" + hf.name));
    const auto& want = ref.at("grad/" + hf.name);
    EXPECT_LT(test::relative_error(hf.transposed ? item.value().grad().t() : item.value().grad(), want), 1e-5);
    ++compared;
  }
  EXPECT_GT(compared, 10u);
}

// Evaluation weighs each batch by its trained tokens: the trainer's validation loss over the same records is
// transformers' loss above.
TEST_P(ChatTransformers, EvaluationIsTheTrainedTokensMeanTransformersGives) {
  const std::string name = GetParam();
  const auto ref = load_safetensors(test::fixture("chat/" + name + "_ref.safetensors"));
  auto c = Config::load("", {"--model.init_from=" + test::fixture("hf/" + name), "--data.dataset=chat",
                             "--model.block_size=16", "--data.path=" + test::fixture("chat/" + name),
                             "--train.micro_batch=1", "--train.eval_batches=8", "--log.dir=" + test::run_root()});
  Trainer t(c);
  EXPECT_NEAR(t.validate().loss, ref.at("loss").item<double>(), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Models, ChatTransformers, ::testing::Values("llama_gqa", "gpt2"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace memtrain
