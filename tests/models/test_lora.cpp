// Frozen parameters and LoRA. Expected values come from Hugging Face peft (scripts/reference/peft_models.py:
// adapters on transformers' tiny GPT-2 and Llama, their logits, loss, adapter gradients and merged weights;
// hf_check.py: peft loading memtrain's exported adapter) and from arithmetic on element counts.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <regex>
#include <tuple>

#include "helpers.h"
#include "memtrain/core/config.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/core/state_checkpoint.h"
#include "memtrain/models/hugging_face.h"
#include "memtrain/models/llama.h"
#include "memtrain/models/lora.h"
#include "memtrain/models/nf4.h"
#include "memtrain/runtime/factories.h"
#include "memtrain/runtime/trainer.h"

namespace memtrain {
namespace {

namespace fs = std::filesystem;

std::string hf(const std::string& name) { return test::fixture("hf/" + name); }

// The base from its folder, with the adapters of `adapter` (their rank, alpha and targets from its config).
std::shared_ptr<Model> adapted(const std::string& base, const std::string& adapter, Config* out = nullptr) {
  const auto c = Config::load("", {"--model.init_from=" + base, "--lora.init_from=" + adapter, "--data.dataset=synthetic"});
  auto model = make_model(c.model, DataInfo{.vocab_size = 97});
  load_hugging_face_weights(*model, base);
  add_lora(*model, lora_options(c.lora));
  load_lora_adapter(*model, c.model, adapter);
  freeze_all_but_lora(*model);
  if (out) *out = c;
  return model;
}

class PeftParity : public ::testing::TestWithParam<const char*> {};

TEST_P(PeftParity, LossAndEveryAdapterGradientMatchPeft) {
  const std::string name = GetParam();
  const auto ref = load_safetensors(hf(name + "_lora.safetensors"));
  Config c;
  auto model = adapted(hf(name), hf(name + "_lora"), &c);
  EXPECT_EQ(c.lora.rank, 4);
  EXPECT_EQ(c.lora.alpha, 8);
  auto logits = model->forward(ref.at("input"));
  auto loss = model->loss(logits, ref.at("target"));
  loss.backward();
  EXPECT_LT(test::relative_error(logits, ref.at("logits")), 1e-5);
  EXPECT_NEAR(loss.item<double>(), ref.at("loss").item<double>(), 1e-5);
  size_t compared = 0, expected = 0;
  for (const auto& [key, t] : ref) expected += key.starts_with("grad/");
  for (const auto& item : model->named_parameters()) {
    if (!item.value().requires_grad()) {
      EXPECT_FALSE(item.value().grad().defined()) << item.key() << ": frozen, yet it has a gradient";
      continue;
    }
    const auto peft = peft_name(c.model, item.key());
    SCOPED_TRACE(item.key() + " as " + peft);
    ASSERT_TRUE(ref.count("grad/" + peft));
    EXPECT_LT(test::relative_error(item.value().grad(), ref.at("grad/" + peft)), 1e-5);
    ++compared;
  }
  EXPECT_EQ(compared, expected);
  EXPECT_EQ(compared, name == std::string("gpt2") ? 2u * 2 * 4 : 2u * 2 * 3);  // layers x (A, B) x targets
}

TEST_P(PeftParity, MergedWeightsArePeftsMergeAndUnload) {
  const std::string name = GetParam();
  const auto ref = load_safetensors(hf(name + "_lora.safetensors"));
  Config c;
  auto model = adapted(hf(name), hf(name + "_lora"), &c);
  std::map<std::string, torch::Tensor> params;
  for (const auto& item : model->named_parameters()) params[item.key()] = item.value().detach();
  const auto merged = merge_lora(params, c.lora.alpha / static_cast<double>(c.lora.rank));
  int checked = 0;
  for (const auto& [key, want] : ref) {
    if (!key.starts_with("merged/")) continue;
    // peft's name -> memtrain's: GPT-2's transformer. prefix, and its Conv1D weights stored (in, out).
    auto ours = key.substr(7);
    const bool gpt = c.model.name == "gpt";
    if (gpt) ours = ours.substr(std::string("transformer.").size());
    if (!ours.ends_with(".weight")) continue;
    ASSERT_TRUE(merged.count(ours)) << ours;
    const auto& got = merged.at(ours);
    EXPECT_LT((gpt ? got.t() : got).sub(want).abs().max().item<double>(), 1e-6) << ours;
    ++checked;
  }
  EXPECT_EQ(checked, name == std::string("gpt2") ? 2 * 4 : 2 * 3);
}

INSTANTIATE_TEST_SUITE_P(Models, PeftParity, ::testing::Values("gpt2", "llama_gqa"),
                         [](const auto& info) { return std::string(info.param); });

TEST(Lora, FreshAdaptersLeaveTheBaseModelsOutputAndStartAsPeftDoes) {
  auto c = Config::load("", {"--model.init_from=" + hf("llama_gqa"), "--data.dataset=synthetic"});
  auto model = make_model(c.model, DataInfo{.vocab_size = 97});
  load_hugging_face_weights(*model, hf("llama_gqa"));
  torch::NoGradGuard no_grad;
  auto input = torch::randint(0, 97, {2, 12}, torch::kLong);
  const auto before = model->forward(input);
  add_lora(*model, {.rank = 8, .alpha = 16, .targets = {"q_proj", "up_proj"}});
  EXPECT_TRUE(torch::equal(model->forward(input), before));  // B = 0: the base's output exactly
  for (const auto& item : model->named_parameters()) {
    if (item.key().ends_with("lora_B")) {
      EXPECT_EQ(item.value().abs().max().item<double>(), 0.0) << item.key();
    }
    if (item.key().ends_with("lora_A")) {
      // Kaiming-uniform with a = sqrt 5: U(-1/sqrt(in), 1/sqrt(in)), in = 32.
      EXPECT_LE(item.value().abs().max().item<double>(), 1 / std::sqrt(32.0)) << item.key();
      EXPECT_GT(item.value().abs().max().item<double>(), 0.5 / std::sqrt(32.0)) << item.key();
    }
  }
  const auto e = test::error_of([&] { add_lora(*model, {.rank = 2, .targets = {"qproj"}}); });
  EXPECT_NE(e.find("'qproj' names no linear map"), std::string::npos) << e;
  EXPECT_NE(e.find("q_proj"), std::string::npos) << e;
}

Config tiny_llama(std::vector<std::string> overrides) {
  overrides.insert(overrides.begin(), {"--model.name=llama", "--model.n_layer=2", "--model.n_head=4", "--model.n_kv_head=2",
                                       "--model.n_embd=32", "--model.block_size=16", "--data.dataset=synthetic",
                                       "--train.steps=3", "--train.micro_batch=2", "--train.eval_every=0",
                                       "--checkpoint.save_final=false", "--log.dir=" + test::run_root(),
                                       "--log.overwrite=true", "--train.weight_decay=0.5"});
  return Config::load("", overrides);
}

TEST(Lora, GradientsAndOptimizerStateAreTheAdaptersAlone) {
  // By arithmetic: the adapters' elements (rank r on q_proj (32 -> 32) and v_proj (32 -> 16), 2 layers) in
  // fp32: gradients 4 bytes each, AdamW's two moments 8; parameters every element, 4 bytes.
  Trainer t(tiny_llama({"--lora.rank=4", "--lora.targets=q_proj,v_proj"}), World{});
  const int64_t adapters = 2 * ((4 * 32 + 32 * 4) + (4 * 32 + 16 * 4));
  int64_t all = 0;
  for (const auto& p : t.model().parameters()) all += p.numel();
  for (int s = 0; s < 2; ++s) t.step();
  const auto& m = t.tracker().last().at(0);
  EXPECT_EQ(m.grads_at_optimizer, 4 * adapters);
  EXPECT_EQ(m.resident.optimizer_state, 8 * adapters);
  EXPECT_EQ(m.resident.params, 4 * all);
  // The estimate counts the same: parameters whole, state for the adapters only.
  EXPECT_EQ(t.memory_estimate().device.optimizer_state, 8 * adapters);
  EXPECT_EQ(t.memory_estimate().device.params, 4 * all);
}

TEST(Freeze, StateForWhatTrainsAloneAndFrozenWeightsNeverMove) {
  const std::string pattern = "model\\.embed_tokens\\.weight|model\\.layers\\.0\\..*";
  auto c = tiny_llama({"--train.freeze=" + pattern});
  Trainer t(c, World{});
  std::map<std::string, torch::Tensor> before;
  int64_t trains = 0;
  for (const auto& item : t.model().named_parameters()) {
    before[item.key()] = item.value().detach().clone();
    if (!std::regex_match(item.key(), std::regex(pattern))) trains += item.value().numel();
  }
  for (int s = 0; s < 3; ++s) t.step();
  const auto& m = t.tracker().last().at(0);
  EXPECT_EQ(m.grads_at_optimizer, 4 * trains);
  EXPECT_EQ(m.resident.optimizer_state, 8 * trains);
  int frozen = 0, moved = 0;
  for (const auto& item : t.model().named_parameters()) {
    const bool is_frozen = std::regex_match(item.key(), std::regex(pattern));
    const bool same = torch::equal(item.value(), before.at(item.key()));
    if (is_frozen) {
      EXPECT_TRUE(same) << item.key() << " is frozen, yet it moved (weight decay 0.5)";
      ++frozen;
    } else {
      moved += !same;
    }
  }
  EXPECT_EQ(frozen, 1 + 9);  // the embedding and layer 0's nine tensors
  EXPECT_GT(moved, 0);
  for (const auto& bad : {std::string("nothing\\.here"), std::string(".*")}) {
    const auto e = test::error_of([&] { Trainer(tiny_llama({"--train.freeze=" + bad}), World{}); });
    EXPECT_NE(e.find(bad == ".*" ? "nothing would train" : "matches none"), std::string::npos) << e;
  }
  EXPECT_NE(test::error_of([] { tiny_llama({"--train.freeze=(unclosed"}); }).find("is not a regular expression"),
            std::string::npos);
}

// A tiny Llama LoRA run through the binaries, from the llama_gqa folder, on a token file of random ids (the
// same global batch however many ranks share it).
std::string run(const test::TempDir& dir, int ranks, const std::string& name, const std::string& extra, int* code) {
  const auto tokens = dir.path("tokens.bin");
  if (!fs::exists(tokens)) {
    torch::manual_seed(11);
    auto ids = torch::randint(0, 97, {6000}, torch::kLong).to(torch::kShort);
    std::ofstream(tokens, std::ios::binary).write(static_cast<const char*>(ids.data_ptr()), ids.numel() * 2);
  }
  const std::string cmd =
      (ranks > 1 ? test::binary("memtrain-run") + " --standalone --nproc-per-node " + std::to_string(ranks) + " -- " : std::string()) +
      test::binary("memtrain") + " --model.init_from=" + hf("llama_gqa") + " --data.tokens=" + tokens + " --data.token_format=raw --model.block_size=16"
      " --train.steps=4 --train.warmup_steps=1 --train.eval_every=0 --log.every=1 --log.progress=lines"
      " --train.weight_decay=0.5 --train.lr=1e-2 --train.micro_batch=" + std::to_string(4 / ranks) + " --log.dir=" + dir.path() +
      " --log.name=" + name + " " + extra + " 2>&1";
  return test::shell(cmd, code);
}

std::vector<double> losses(const test::TempDir& dir, const std::string& name) {
  return test::metric_losses(dir.path(name + "/metrics.jsonl"));
}

// Each logged step's pre-clip gradient norm (the adapters' gradients, the base being frozen).
std::vector<double> grad_norms(const test::TempDir& dir, const std::string& name) {
  return test::metric_grad_norms(dir.path(name + "/metrics.jsonl"));
}

TEST(Lora, EveryStageTrainsTheAdaptersAsOneProcessAndTheBaseNeverMoves) {
  // Losses and each step's pre-clip gradient norm against one process: AdamW and clipping are blind to a common
  // scale of the gradients, so an adapter reduction that sums where it should average shows in the norms alone.
  test::TempDir dir;
  const std::string lora = "--lora.rank=4 --lora.targets=q_proj,v_proj,down_proj --memory.recompute=all";
  int code = -1;
  auto out = run(dir, 1, "one", lora, &code);
  ASSERT_EQ(code, 0) << out;
  const auto one = losses(dir, "one");
  const auto one_norms = grad_norms(dir, "one");
  ASSERT_EQ(one.size(), 4u);
  ASSERT_EQ(one_norms.size(), 4u);
  for (size_t s = 0; s < 4; ++s) ASSERT_GT(one_norms[s], 0) << "step " << s + 1 << ": the adapters got no gradient";
  // The adapters trained: every B, zero at the start, has moved.
  const auto trained = load_checkpoint(find_latest_checkpoint(dir.path("one/checkpoints")));
  int b = 0;
  for (const auto& [name, t] : trained.tensors)
    if (name.ends_with(".lora_B")) {
      EXPECT_GT(t.abs().max().item<double>(), 0) << name;
      ++b;
    }
  EXPECT_EQ(b, 2 * 3);
  for (int stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const auto name = "s" + std::to_string(stage);
    out = run(dir, 2, name, lora + " --checkpoint.every=2 --dist.zero_stage=" + std::to_string(stage), &code);
    ASSERT_EQ(code, 0) << out;
    const auto got = losses(dir, name);
    const auto got_norms = grad_norms(dir, name);
    ASSERT_EQ(got.size(), 4u);
    ASSERT_EQ(got_norms.size(), 4u);
    for (size_t s = 0; s < 4; ++s) {
      EXPECT_NEAR(got[s], one[s], 1e-5 * one[s]) << "step " << s + 1;
      // The same samples reduced in another order: within the losses' tolerance (a sum for a mean is a factor 2).
      EXPECT_NEAR(got_norms[s], one_norms[s], 1e-5 * one_norms[s]) << "pre-clip gradient norm, step " << s + 1;
    }
    // Parameter bytes a rank holds between steps (its tracker): every element in stages 0-2; in stage 3 half of
    // them, the frozen base included (each bucket padded to a multiple of 2 ranks: at most 4 bytes per bucket).
    std::ifstream memory(dir.path(name + "/memory.rank0.jsonl"));
    std::string last;
    for (std::string line; std::getline(memory, line);) last = line;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(last, m, std::regex("\"params\":([0-9]+)"))) << last;
    const int64_t held = std::stoll(m[1]);
    // The base: 26,336 fp32 elements (its safetensors' 105,344 tensor bytes); the adapters, rank 4 on q_proj
    // (32 -> 32), v_proj (32 -> 16) and down_proj (72 -> 32) in 2 layers: 2 x 864.
    const int64_t all = 4 * (26336 + 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4 + 4 * 72 + 32 * 4));
    if (stage < 3) EXPECT_EQ(held, all) << last;
    else EXPECT_LE(held, all / 2 + 4 * 64) << last;
    // The frozen base, saved whole as frozen/<name>: bitwise the folder's weights after 4 steps of weight decay.
    const auto ck = load_checkpoint(find_latest_checkpoint(dir.path(name + "/checkpoints")));
    auto model = make_model(Config::load("", {"--model.init_from=" + hf("llama_gqa")}).model, DataInfo{.vocab_size = 97});
    load_hugging_face_weights(*model, hf("llama_gqa"));
    int frozen = 0;
    for (const auto& item : model->named_parameters()) {
      auto it = ck.tensors.find("frozen/" + item.key());
      ASSERT_NE(it, ck.tensors.end()) << item.key();
      EXPECT_TRUE(torch::equal(it->second, item.value())) << item.key() << " moved";
      ++frozen;
    }
    EXPECT_EQ(frozen, 21);
    // The adapters' state resumes resharded: step 2 of the 2-rank run taken up by one process.
    out = run(dir, 1, name + "-to-1", lora + " --checkpoint.resume=" + checkpoint_folder(dir.path(name + "/checkpoints"), 2), &code);
    ASSERT_EQ(code, 0) << out;
    const auto resumed = losses(dir, name + "-to-1");
    const auto resumed_norms = grad_norms(dir, name + "-to-1");
    ASSERT_EQ(resumed.size(), 2u) << out;
    ASSERT_EQ(resumed_norms.size(), 2u) << out;
    for (size_t s = 0; s < 2; ++s) {
      EXPECT_NEAR(resumed[s], one[2 + s], 1e-5 * one[2 + s]) << "resumed step " << s + 3;
      EXPECT_NEAR(resumed_norms[s], one_norms[2 + s], 1e-5 * one_norms[2 + s]) << "pre-clip gradient norm, resumed step " << s + 3;
    }
  }
}

TEST(Lora, AccumulationTheFusedHeadAndBf16TrainTheAdaptersAsPlain) {
  // No warm-up and a learning rate of 1e-2, so that the adapters move at once: with the default 20 warm-up steps
  // the first updates were 1e-3 / 20 = 5e-5, B (zero at the start) stayed near zero, the losses hardly depended on
  // the adapters, and nothing checked that they trained: adapters that got no gradient at all would have passed.
  const double lr = 1e-2;
  struct Run {
    std::vector<double> losses, norms;      // per step; the norm is the adapters' gradient's, before clipping
    std::map<std::string, double> b_moved;  // max |B| of each adapter after the first step
    double val_before = 0, val_after = 0;   // held-out loss before the first step and after the last
  };
  auto train = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), {"--lora.rank=4", "--lora.targets=q_proj,up_proj", "--train.warmup_steps=0", "--train.lr=" + std::to_string(lr),
                               "--data.dataset=text"});  // the Austen bytes: a batch splits into micro-batches sample by sample
    Trainer t(tiny_llama(extra), World{});
    const auto val = t.data().val_batches(4, 2);
    Run r;
    r.val_before = t.evaluate(val).loss;
    for (int s = 0; s < 3; ++s) {
      const auto step = t.step();
      r.losses.push_back(step.loss.item<double>());
      r.norms.push_back(step.grad_norm.item<double>());
      if (s > 0) continue;
      for (const auto& item : t.model().named_parameters())
        if (item.key().ends_with("lora_B")) r.b_moved[item.key()] = item.value().abs().max().item<double>();
    }
    r.val_after = t.evaluate(val).loss;
    return r;
  };
  const auto plain = train({"--train.micro_batch=4"});
  const auto combined = train({"--train.micro_batch=2", "--train.accum_steps=2", "--memory.head=fused:16"});
  const auto bf16 = train({"--train.micro_batch=4", "--train.precision=bf16"});
  for (const auto& [what, r] : std::vector<std::pair<std::string, const Run*>>{
           {"plain", &plain}, {"accumulation + fused head", &combined}, {"bf16", &bf16}}) {
    SCOPED_TRACE(what);
    // Every adapter received a gradient. B starts at zero and takes one AdamW step: with no history, Adam's
    // bias-corrected step is lr g / (|g| + eps) per element (Kingma & Ba 2015, section 2.1: the first step's size is
    // the step size), so max |B| = lr to eps / |g|; decoupled weight decay of a zero B adds nothing. No gradient
    // leaves B at zero; clipping and a scale of the gradients do not change it.
    ASSERT_EQ(r->b_moved.size(), 2u * 2) << "layers x targets";
    for (const auto& [name, moved] : r->b_moved) EXPECT_NEAR(moved, lr, 1e-3 * lr) << name;
    ASSERT_EQ(r->norms.size(), 3u);
    for (size_t s = 0; s < 3; ++s) EXPECT_GT(r->norms[s], 0) << "step " << s + 1;
    // The loss moved: the held-out loss of the adapted model fell by more than 10 times the tolerance the
    // accumulated run is compared with below (2e-5), so adapters that stopped training would show there.
    EXPECT_LT(r->val_after, r->val_before * (1 - 10 * 2e-5)) << "before " << r->val_before << ", after " << r->val_after;
  }
  for (size_t s = 0; s < 3; ++s) {
    EXPECT_NEAR(combined.losses[s], plain.losses[s], 2e-5 * plain.losses[s]) << "step " << s + 1;
    // The same gradient, summed over two micro-batches and the fused head's chunks in another order: fp32 rounding
    // (about 1e-6) apart, against a factor 2 for a sum where a mean belongs, which AdamW's losses would not show.
    EXPECT_NEAR(combined.norms[s], plain.norms[s], 1e-4 * plain.norms[s]) << "pre-clip gradient norm, step " << s + 1;
    // bf16 autocast: 8 mantissa bits, about 0.4% per rounding; the loss of a 2-layer model stays within 2%, the
    // norm (a sum of squares of gradients through a few more roundings) within 5%.
    EXPECT_NEAR(bf16.losses[s], plain.losses[s], 2e-2 * plain.losses[s]) << "step " << s + 1;
    EXPECT_NEAR(bf16.norms[s], plain.norms[s], 5e-2 * plain.norms[s]) << "pre-clip gradient norm, step " << s + 1;
  }
}

TEST(Freeze, ABudgetThatFitsOnlyWithTheFreezeIsPlannedAsFitting) {
  // Model states by arithmetic: the embedding and the untied head are 2 x 20,000 x 64 = 2.56M elements (10.2 MB
  // fp32), the two layers 0.11M. Training everything holds parameters, gradients and AdamW's two moments: about
  // 4 x 10.7 MB = 43 MB, over a 25 MiB budget whatever the planner recomputes; frozen embedding and head leave
  // 10.7 MB of parameters and 3 x 0.43 MB for what trains.
  const std::vector<std::string> shape = {"--model.n_embd=64", "--model.vocab_size=20000", "--memory.budget_mib=25",
                                          "--train.micro_batch=2"};
  auto e = test::error_of([&] { Trainer(tiny_llama(shape), World{}); });
  EXPECT_NE(e.find("memory.budget_mib"), std::string::npos) << e;
  auto with = shape;
  with.push_back("--train.freeze=model\\.embed_tokens\\.weight|lm_head\\.weight");
  Trainer t(tiny_llama(with), World{});
  EXPECT_LE(t.memory_estimate().device.peak(), 25 * (int64_t{1} << 20));
  for (int s = 0; s < 2; ++s) t.step();
  EXPECT_LE(t.tracker().last().at(0).peak_allocated, 25 * (int64_t{1} << 20));
}

TEST(Lora, ExportedAdapterAndMergedModelLoadInPeftAndTransformersWithMemtrainsLogits) {
  test::TempDir dir;
  int code = -1;
  auto out = run(dir, 1, "l", "--lora.rank=4 --lora.targets=q_proj,v_proj,down_proj", &code);
  ASSERT_EQ(code, 0) << out;
  const auto ckpt = dir.path("l/checkpoints");
  out = test::shell(test::binary("memtrain") + " export --checkpoint " + ckpt + " --out " + dir.path("adapter") + " && " +
                        test::binary("memtrain") + " export --merged --checkpoint " + ckpt + " --out " + dir.path("merged") +
                        " 2>&1", &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_TRUE(fs::exists(dir.path("adapter/adapter_config.json")));
  // memtrain's logits from the trained weights (its own model.safetensors).
  auto c = Config::load("", {"--model.init_from=" + hf("llama_gqa"), "--model.block_size=16"});
  auto model = make_model(c.model, DataInfo{.vocab_size = 97});
  add_lora(*model, {.rank = 4, .alpha = 16, .targets = {"q_proj", "v_proj", "down_proj"}});
  load_module_state(*model, load_safetensors(ckpt + "/model.safetensors"), "model.safetensors");
  torch::NoGradGuard no_grad;
  model->eval();
  auto input = torch::randint(0, 97, {2, 16}, torch::kLong);
  save_safetensors(dir.path("logits.safetensors"), {{"input", input}, {"logits", model->forward(input)}});
  auto number = [](const std::string& text, const std::string& label) {
    std::smatch m;
    return std::regex_search(text, m, std::regex(label + " ([-0-9.eE+]+)")) ? std::stod(m[1]) : NAN;
  };
  const auto check = [&](const std::string& args) {
    return test::shell(std::string(MEMTRAIN_PYTHON) + " " + test::source("scripts/reference/hf_check.py") + " " + args + " 2>&1");
  };
  const auto peft = check("peft_logits " + hf("llama_gqa") + " " + dir.path("adapter") + " " + dir.path("logits.safetensors"));
  EXPECT_LT(number(peft, "max_abs_diff"), 1e-5 * number(peft, "max_abs_ref")) << peft;
  const auto merged = check("logits " + dir.path("merged") + " " + dir.path("logits.safetensors"));
  EXPECT_LT(number(merged, "max_abs_diff"), 1e-5 * number(merged, "max_abs_ref")) << merged;
  // The trained adapter continues a run: lora.init_from takes its rank, alpha and targets.
  out = run(dir, 1, "again", "--train.steps=1 --lora.init_from=" + dir.path("adapter"), &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("adapters from"), std::string::npos) << out;
}

// QLoRA through the binaries: the nf4_llama folder of scripts/reference/nf4_ref.py (width 128, 2 layers, vocabulary
// 128) with its adapters, the frozen block linears in NF4, on random token ids.
// `micro`: samples per micro-batch on each rank (0: the 4 of a step over the ranks).
std::string run_qlora(const test::TempDir& dir, int ranks, const std::string& name, const std::string& extra, int* code,
                      int micro = 0) {
  const auto tokens = dir.path("tokens128.bin");
  if (!fs::exists(tokens)) {
    torch::manual_seed(12);
    auto ids = torch::randint(0, 128, {6000}, torch::kLong).to(torch::kShort);
    std::ofstream(tokens, std::ios::binary).write(static_cast<const char*>(ids.data_ptr()), ids.numel() * 2);
  }
  const std::string cmd =
      (ranks > 1 ? test::binary("memtrain-run") + " --standalone --nproc-per-node " + std::to_string(ranks) + " -- " : std::string()) +
      test::binary("memtrain") + " --model.init_from=" + test::fixture("hf/nf4_llama") +
      " --lora.init_from=" + test::fixture("hf/nf4_llama_lora") + " --lora.quantize_base=nf4 --data.tokens=" + tokens +
      " --data.token_format=raw --model.block_size=16 --train.steps=4 --train.warmup_steps=1 --train.eval_every=0"
      " --log.every=1 --log.progress=lines --train.lr=1e-2 --train.micro_batch=" + std::to_string(micro ? micro : 4 / ranks) +
      " --memory.recompute=all --memory.head=fused --log.dir=" + dir.path() + " --log.name=" + name + " " + extra + " 2>&1";
  return test::shell(cmd, code);
}

// The bytes a rank holds between steps (its tracker's last line).
int64_t held_parameter_bytes(const test::TempDir& dir, const std::string& name) {
  std::ifstream memory(dir.path(name + "/memory.rank0.jsonl"));
  std::string last;
  for (std::string line; std::getline(memory, line);) last = line;
  std::smatch m;
  return std::regex_search(last, m, std::regex("\"params\":([0-9]+)")) ? std::stoll(m[1]) : -1;
}

// The parameter bytes of the run's estimate (summary.json, rank 0's).
int64_t estimated_parameter_bytes(const test::TempDir& dir, const std::string& name) {
  std::ifstream in(dir.path(name + "/summary.json"));
  const auto j = nlohmann::json::parse(in);
  return j.at("memory_estimate").at("device").at("params").get<int64_t>();
}

TEST(Qlora, ZeroStagesHoldHalfAByteAWeightMatchOneProcessAndResumeOnTheSameBaseOnly) {
  test::TempDir dir;
  int code = -1;
  auto out = run_qlora(dir, 1, "one", "--checkpoint.every=2", &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("nf4:        10 frozen linear weights"), std::string::npos) << out;
  const auto one = losses(dir, "one");
  ASSERT_EQ(one.size(), 4u);
  {  // the adapters trained: every B moved from the folder's
    const auto start = load_safetensors(test::fixture("hf/nf4_llama_lora/adapter_model.safetensors"));
    const auto ck = load_checkpoint(find_latest_checkpoint(dir.path("one/checkpoints")));
    int moved = 0;
    for (const auto& [name, t] : ck.tensors)
      if (name.ends_with(".lora_B")) {
        const auto layer = name.substr(std::string("model/").size());
        const auto peft = "base_model.model." + layer.substr(0, layer.size() - 7) + ".lora_B.weight";
        ASSERT_TRUE(start.count(peft)) << peft;
        moved += !torch::equal(start.at(peft), t);
      }
    EXPECT_EQ(moved, 2 * 3);
  }
  // By arithmetic (QLoRA's layout: half a byte per value, an int8 scale per 64, a bf16 factor per 16,384 and the
  // mean, padded to 16 bytes): q and o 128 x 128, gate, up and down 256 x 128 in NF4; k and v (64 x 128, 128 blocks:
  // not a whole group of 256) and the norms in fp32; the embedding, head and final norm fp32; the adapters fp32.
  auto packed = [](int64_t n) { return (n / 2 + n / 64 + 2 * (n / 16384) + 2 + 15) / 16 * 16; };
  const int64_t layer = 2 * packed(128 * 128) + 3 * packed(256 * 128) + 4 * (2 * 64 * 128 + 2 * 128);
  const int64_t root = 4 * (2 * 128 * 128 + 128);
  const int64_t adapters = 4 * (4 * 128 + 128 * 4 + 4 * 128 + 64 * 4 + 4 * 256 + 128 * 4);
  const int64_t all = 2 * (layer + adapters) + root;
  EXPECT_EQ(held_parameter_bytes(dir, "one"), all);
  EXPECT_EQ(estimated_parameter_bytes(dir, "one"), all);  // the run's own estimate counts the same bytes
  // Bit-exact resume: from step 2, the base made again from init_from.
  out = run_qlora(dir, 1, "resumed", "--checkpoint.resume=" + checkpoint_folder(dir.path("one/checkpoints"), 2), &code);
  ASSERT_EQ(code, 0) << out;
  const auto resumed = losses(dir, "resumed");
  ASSERT_EQ(resumed.size(), 2u) << out;
  EXPECT_EQ(resumed[0], one[2]);
  EXPECT_EQ(resumed[1], one[3]);
  // Export: the adapter folder, or merged into the dequantized NF4 base (remade from init_from): q_proj's weight is
  // the bf16 values of its NF4 codes plus B A alpha / rank.
  out = test::shell(test::binary("memtrain") + " export --checkpoint " + dir.path("one/checkpoints") + " --out " +
                    dir.path("merged") + " --merged 2>&1", &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("dequantized NF4 base"), std::string::npos) << out;
  {
    const auto merged = load_safetensors(dir.path("merged/model.safetensors"));
    const auto last = load_checkpoint(find_latest_checkpoint(dir.path("one/checkpoints")));
    const auto w = load_safetensors(test::fixture("hf/nf4_llama/model.safetensors")).at("model.layers.0.self_attn.q_proj.weight");
    const auto f = nf4_format({128, 128}, torch::kBFloat16, {});
    const auto base = nf4_dequantize(nf4_pack(w.to(torch::kBFloat16), f), f).to(torch::kFloat);
    const auto& a = last.tensors.at("model/model.layers.0.self_attn.q_proj.lora_A");
    const auto& b = last.tensors.at("model/model.layers.0.self_attn.q_proj.lora_B");
    const auto want = base + torch::matmul(b, a) * (8.0 / 4);
    EXPECT_LT((merged.at("model.layers.0.self_attn.q_proj.weight") - want).abs().max().item<double>(), 1e-6);
  }
  out = test::shell(test::binary("memtrain") + " export --checkpoint " + dir.path("one/checkpoints") + " --out " +
                    dir.path("adapter") + " 2>&1", &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_TRUE(fs::exists(dir.path("adapter/adapter_model.safetensors")));
  // The base is not in the checkpoint; its record is.
  const auto ck = load_checkpoint(checkpoint_folder(dir.path("one/checkpoints"), 2));
  EXPECT_FALSE(ck.tensors.count("frozen/model.layers.0.self_attn.q_proj.weight"));
  EXPECT_TRUE(ck.tensors.count("frozen/model.layers.0.self_attn.k_proj.weight"));
  ASSERT_TRUE(ck.meta.fields.count("quantized_base"));
  EXPECT_NE(ck.meta.fields.at("quantized_base").find("nf4 block 64 double_quant, 10 weights"), std::string::npos);
  // 2 ranks: stage 2 with accumulation (1 x 2 per rank: the same global batch), stage 3 with the optimizer offloaded;
  // 4 ranks at stage 3.
  for (const auto& [ranks, stage] : std::vector<std::pair<int, int>>{{2, 2}, {2, 3}, {4, 3}}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks, stage " + std::to_string(stage));
    const auto name = "s" + std::to_string(stage) + (ranks == 4 ? "x4" : "");
    const std::string how = stage == 2 ? " --train.micro_batch=1 --train.accum_steps=2"
                                       : ranks == 2 ? " --dist.offload_optimizer=cpu" : "";
    out = run_qlora(dir, ranks, name, "--checkpoint.every=2 --dist.zero_stage=" + std::to_string(stage) + how, &code);
    ASSERT_EQ(code, 0) << out;
    const auto got = losses(dir, name);
    ASSERT_EQ(got.size(), 4u);
    for (size_t s = 0; s < 4; ++s) EXPECT_NEAR(got[s], one[s], 1e-5 * one[s]) << "step " << s + 1;
    // Stage 3 shards the NF4 bytes with the rest (a bucket per run of one dtype, each padded to the world size).
    const auto held = held_parameter_bytes(dir, name);
    if (stage < 3) EXPECT_EQ(held, all);
    else EXPECT_LE(held, all / ranks + 4 * 64);
    if (stage == 3) {
      EXPECT_GE(held, all / ranks);
    }
    EXPECT_LE(std::abs(estimated_parameter_bytes(dir, name) - held), 4 * 64) << "the estimate's parameters";
  }
  // A checkpoint of stage 3 on 2 ranks continues in one process.
  out = run_qlora(dir, 1, "s3-to-1", "--checkpoint.resume=" + checkpoint_folder(dir.path("s3/checkpoints"), 2), &code);
  ASSERT_EQ(code, 0) << out;
  const auto s3_to_1 = losses(dir, "s3-to-1");
  ASSERT_EQ(s3_to_1.size(), 2u) << out;
  EXPECT_NEAR(s3_to_1[1], one[3], 1e-5 * one[3]);
  // A changed base is refused, named: one weight of the folder perturbed.
  const auto changed = dir.path("changed");
  fs::copy(test::fixture("hf/nf4_llama"), changed, fs::copy_options::recursive);
  auto weights = load_safetensors(changed + "/model.safetensors");
  weights.at("model.layers.1.mlp.up_proj.weight").mul_(1.5);
  save_safetensors(changed + "/model.safetensors", weights, {{"format", "pt"}});
  out = run_qlora(dir, 1, "on-changed", "--model.init_from=" + changed + " --checkpoint.resume=" +
                                            checkpoint_folder(dir.path("one/checkpoints"), 2), &code);
  EXPECT_NE(code, 0) << out;
  EXPECT_NE(out.find("changed since"), std::string::npos) << out;
  // And a run without NF4 does not take up the QLoRA adapters' state silently.
  out = run_qlora(dir, 1, "unquantized", "--lora.quantize_base=none --checkpoint.resume=" +
                                             checkpoint_folder(dir.path("one/checkpoints"), 2), &code);
  EXPECT_NE(code, 0) << out;
  EXPECT_NE(out.find("not quantized"), std::string::npos) << out;
}

// QLoRA on a split model (dist.tensor_parallel = 2): each rank holds its slices of the NF4 weights (the whole weight
// quantized as one process quantizes it, the slice's blocks' absmaxes kept dequantized in bf16), q, gate and up by rows,
// o and down by columns; the fused head over the vocabulary's slices, every block recomputed. As one process to 1e-5 at
// T = 2 (sequence parallel) and on a 2 x 2 grid with ZeRO-3 (the packed slices sharded too). Rank 0 holds the bytes of
// the arithmetic, and the run's estimate counts them; the T = 2 checkpoint resumes in one process and the 2 x 2 one at
// T = 2 (the base's record is the whole weights' digest on any grid) within 1e-6; export --merged is one process's.
TEST(Qlora, TensorParallelSlicesTrainAsOneProcessAndResumeOnAnotherGrid) {
  test::TempDir dir;
  int code = -1;
  auto out = run_qlora(dir, 1, "one", "", &code);
  ASSERT_EQ(code, 0) << out;
  const auto one = losses(dir, "one");
  const auto one_norms = test::metric_grad_norms(dir.path("one/metrics.jsonl"));
  ASSERT_EQ(one.size(), 4u);
  for (const auto& [ranks, name, extra] : {std::tuple{2, "t2", " --checkpoint.every=2"},
                                           std::tuple{4, "2x2", " --dist.zero_stage=3 --dist.sequence_parallel=off --checkpoint.every=2"}}) {
    SCOPED_TRACE(name);
    out = run_qlora(dir, ranks, name, std::string("--dist.tensor_parallel=2") + extra, &code, 4 * 2 / ranks);
    ASSERT_EQ(code, 0) << out;
    EXPECT_NE(out.find("nf4:        10 frozen linear weights"), std::string::npos) << out;
    const auto got = losses(dir, name);
    const auto norms = test::metric_grad_norms(dir.path(std::string(name) + "/metrics.jsonl"));
    ASSERT_EQ(got.size(), 4u) << out;
    ASSERT_EQ(norms.size(), 4u) << out;
    for (size_t s = 0; s < 4; ++s) {
      EXPECT_NEAR(got[s], one[s], 1e-5 * one[s]) << "step " << s + 1;
      EXPECT_NEAR(norms[s], one_norms[s], 1e-5 * one_norms[s]) << "grad norm, step " << s + 1;
    }
  }
  // Rank 0 at T = 2, by arithmetic: NF4 slices of half a byte a value and a bf16 absmax per 64 (padded to 16 bytes):
  // q and o 64 x 128 and 128 x 64, gate, up and down 128 x 128; k and v (whole 64 x 128: not a whole group of 256
  // blocks, fp32 as in one process) 32 x 128; the norms whole. The vocabulary's half of the embedding and head, the
  // final norm. The adapters: q's and v's A whole, their B by rows (64 x 4, 32 x 4); down's A by columns (4 x 128), B
  // whole.
  auto slice = [](int64_t n) { return (n / 2 + 2 * (n / 64) + 15) / 16 * 16; };
  const int64_t layer = 2 * slice(64 * 128) + 3 * slice(128 * 128) + 4 * (2 * 32 * 128 + 2 * 128);
  const int64_t root = 4 * (2 * 64 * 128 + 128);
  const int64_t adapters = 4 * (4 * 128 + 64 * 4 + 4 * 128 + 32 * 4 + 4 * 128 + 128 * 4);
  const int64_t all = 2 * (layer + adapters) + root;
  EXPECT_EQ(held_parameter_bytes(dir, "t2"), all);
  EXPECT_EQ(estimated_parameter_bytes(dir, "t2"), all);
  // The checkpoints of step 2 continue on another grid: T = 2's (its frozen slices, the head's vocabulary halves and
  // k's and v's rows, at their places in the whole) in one process, and 2 x 2 ZeRO-3's (those slices' parts) at T = 2
  // (each rank reads its slices from the whole).
  for (const auto& [grid, ranks] : {std::pair{"t2", 1}, std::pair{"2x2", 2}}) {
    SCOPED_TRACE(grid);
    const auto name = std::string(grid) + "-on-" + std::to_string(ranks);
    out = run_qlora(dir, ranks, name, std::string(ranks > 1 ? "--dist.tensor_parallel=2 " : "") + "--checkpoint.resume=" +
                                          checkpoint_folder(dir.path(std::string(grid) + "/checkpoints"), 2), &code, 4);
    ASSERT_EQ(code, 0) << out;
    const auto resumed = losses(dir, name);
    ASSERT_EQ(resumed.size(), 2u) << out;
    EXPECT_NEAR(resumed[0], one[2], 1e-6 * one[2]);
    EXPECT_NEAR(resumed[1], one[3], 1e-6 * one[3]);
  }
  // memtrain export --merged from the T = 2 run's final checkpoint: the base remade whole from init_from (its record
  // checked), the whole adapters merged into it, as from one process's. 2e-4 of each tensor's largest value: AdamW
  // divides by sqrt(v), so an adapter element whose gradient is zero but for rounding, summed in another order, moves
  // by up to lr a step (measured: one of layer 1's q_proj lora_A elements by 4.5e-5, its merged weight 1.1e-4 off; every
  // other tensor within 1e-6); a value on another NF4 code is off by a step between levels times its block's absmax.
  std::map<std::string, std::map<std::string, torch::Tensor>> merged;
  for (const char* run : {"one", "t2"}) {
    out = test::shell(test::binary("memtrain") + " export --checkpoint " + dir.path(std::string(run) + "/checkpoints") +
                      " --out " + dir.path(std::string(run) + "-merged") + " --merged 2>&1", &code);
    ASSERT_EQ(code, 0) << out;
    merged[run] = load_safetensors(dir.path(std::string(run) + "-merged/model.safetensors"));
  }
  ASSERT_EQ(merged["t2"].size(), merged["one"].size());
  for (const auto& [name, w] : merged["one"]) {
    ASSERT_TRUE(merged["t2"].count(name)) << name;
    EXPECT_LT(test::relative_error(merged["t2"].at(name), w), 2e-4) << name;
  }
  // A quantization block the slices' runs do not hold whole is refused, named: blocks of 128 without double
  // quantization make o_proj (128 x 128) eligible, and its columns at T = 2 run 64 values.
  out = run_qlora(dir, 2, "block128", "--dist.tensor_parallel=2 --lora.double_quant=false --lora.quantize_block=128", &code, 4);
  EXPECT_NE(code, 0) << out;
  EXPECT_NE(out.find("o_proj.weight (16384 values) is quantized in blocks of 128 values (lora.quantize_block), but its "
                     "slices are cut in runs of 64 values"), std::string::npos) << out;
}

TEST(Qlora, NeedsAFrozenBase) {
  const auto e = test::error_of([] { Config::load("", {"--lora.quantize_base=nf4"}); });
  EXPECT_NE(e.find("needs a frozen base"), std::string::npos) << e;
}

}  // namespace
}  // namespace memtrain
