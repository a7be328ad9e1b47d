// The Llama-family decoder: shapes against the published parameter counts, and its blocks under the memory
// techniques (recompute, the fused head, accumulation, ZeRO-3 on several processes) giving the same training.
// Its numbers against transformers are in test_hugging_face.cpp.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include "helpers.h"
#include "memtrain/models/family.h"
#include "memtrain/models/hugging_face.h"
#include "memtrain/models/llama.h"
#include "memtrain/runtime/factories.h"
#include "memtrain/runtime/trainer.h"

namespace memtrain {
namespace {

TEST(Llama, PresetsHaveThePublishedParameterCounts) {
  // The model cards' counts (meta-llama/Llama-3.2-1B: 1.24B, -3.2-3B: 3.21B, -3.1-8B: 8.03B, -3.1-70B: 70.6B; Qwen/Qwen2.5-0.5B:
  // 0.49B, -7B: 7.61B; mistralai/Mistral-7B-v0.1: 7.24B), to the parameter, as transformers counts them.
  const std::map<std::string, int64_t> published = {
      {"llama-3.2-1b", 1235814400}, {"llama-3.2-3b", 3212749824}, {"llama-3.1-8b", 8030261248},
      {"llama-3.1-70b", 70553706496},
      {"qwen2.5-0.5b", 494032768},  {"qwen2.5-7b", 7615616512},   {"mistral-7b", 7241732096}};
  for (const auto& name : llama_family().config.presets) {
    if (name == "custom") continue;
    SCOPED_TRACE(std::string(name));
    ASSERT_TRUE(published.count(std::string(name)));
    EXPECT_EQ(LlamaOptions::preset(std::string(name)).parameter_count(), published.at(std::string(name)));
  }
}

TEST(Llama, TheCountFormulaIsTheBuiltModels) {
  // Every option that changes the count, built small.
  for (int variant = 0; variant < 4; ++variant) {
    LlamaOptions o;
    o.vocab_size = 50, o.n_layer = 2, o.n_head = 4, o.n_embd = 32, o.ffn_hidden = 40;
    o.n_kv_head = variant == 1 ? 1 : 2;
    o.tie_embeddings = variant % 2 == 0;
    o.qkv_bias = variant >= 2, o.out_bias = variant == 3, o.mlp_bias = variant == 3;
    SCOPED_TRACE(variant);
    Llama llama(o);
    EXPECT_EQ(llama.num_parameters(), o.parameter_count());
  }
}

TEST(Llama, AFlopCountByThePaLMFormula) {
  // 6 N + 12 L C T per token, N without the input embedding when the head is untied: by hand for a tiny model.
  LlamaOptions o;
  o.vocab_size = 10, o.n_layer = 1, o.n_head = 2, o.n_kv_head = 1, o.n_embd = 4, o.ffn_hidden = 6, o.block_size = 8;
  Llama llama(o);
  const double n = 4 * 4 + 2 * 4 * 2 + 4 * 4 + 3 * 4 * 6 + 2 * 4 + 4 + 10 * 4;  // q, k v, o, mlp, norms, final, head
  EXPECT_DOUBLE_EQ(llama.train_flops_per_token(), 6 * n + 12 * 1 * 4 * 8);
}

Config tiny_llama() {
  auto c = test::tiny_gpt_config();
  c.model.name = "llama";
  c.model.n_head = 4;
  c.model.n_kv_head = 2;
  c.model.rope_scaling = "llama3:8:1:4:16";
  c.data.dataset = "text";  // the Austen bytes: their batches split into micro-batches sample by sample
  c.train.steps = 3;
  c.train.micro_batch = 4;
  c.checkpoint.save_final = false;
  return c;
}

std::vector<double> losses(Config c) {
  Trainer t(c, World{});
  std::vector<double> out;
  for (int s = 0; s < 3; ++s) out.push_back(t.step().loss.item<double>());
  return out;
}

TEST(Llama, EveryMemoryTechniqueTrainsTheSame) {
  const auto plain = losses(tiny_llama());
  ASSERT_TRUE(plain[2] < plain[0]);
  for (const auto& [what, set] : std::vector<std::pair<std::string, std::function<void(Config&)>>>{
           {"recompute all", [](Config& c) { c.memory.recompute = "all"; }},
           {"recompute attn", [](Config& c) { c.memory.recompute = "attn"; }},
           {"fused head", [](Config& c) { c.memory.head = "fused:16"; }},
           {"2 x 2 accumulation", [](Config& c) { c.train.micro_batch = 2, c.train.accum_steps = 2; }}}) {
    SCOPED_TRACE(what);
    auto c = tiny_llama();
    set(c);
    const auto got = losses(c);
    for (size_t s = 0; s < got.size(); ++s) EXPECT_NEAR(got[s], plain[s], 2e-5 * plain[s]) << "step " << s + 1;
  }
}

TEST(Llama, CudaRmsNormIsTransformersFormulaForwardAndBackward) {
  // On CUDA the norm is ATen's fused rms_norm; transformers' LlamaRMSNorm (normalised in fp32, cast to the input's
  // dtype, then scaled) computed here op by op on the CPU is the reference, in fp32 and bf16 (the residual stream's
  // dtype with autocast and with bf16 parameters).
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  torch::manual_seed(0);
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    RMSNorm norm(512, 1e-5);
    norm->to(torch::kCUDA, dtype);
    torch::NoGradGuard no_grad;
    norm->weight.uniform_(0.5, 1.5);
    auto x = torch::randn({4, 64, 512}).to(dtype).mul_(3);
    const auto g = torch::randn({4, 64, 512}).to(dtype);
    torch::Tensor y, dx, dw;
    {
      at::AutoGradMode grad(true);
      auto xc = x.cuda().requires_grad_();
      y = norm(xc);
      y.backward(g.cuda());
      dx = xc.grad().cpu(), dw = norm->weight.grad().cpu(), y = y.detach().cpu();
    }
    at::AutoGradMode grad(true);
    auto xr = x.clone().requires_grad_();
    auto w = norm->weight.detach().cpu().requires_grad_();
    const auto x32 = xr.to(torch::kFloat);
    const auto ref = w * (x32 * torch::rsqrt(x32.pow(2).mean(-1, true) + 1e-5)).to(dtype);
    ref.backward(g);
    const double tol = dtype == torch::kFloat ? 1e-5 : 2e-2;  // bf16: one rounding apart at most
    EXPECT_TRUE(torch::allclose(y.to(torch::kFloat), ref.detach().to(torch::kFloat), tol, tol));
    EXPECT_TRUE(torch::allclose(dx.to(torch::kFloat), xr.grad().to(torch::kFloat), tol, tol));
    EXPECT_TRUE(torch::allclose(dw.to(torch::kFloat), w.grad().to(torch::kFloat), tol, 64 * tol));  // summed over 256 rows
  }
}

TEST(Llama, ZeroThreeOnTwoProcessesTrainsAsOne) {
  // Llama's blocks are ZeRO-3's units as the GPT's: 2 ranks in stage 3 (global batch 8) against one process. The
  // losses and each step's pre-clip gradient norm: AdamW (default) and clipping are blind to a common scale of the
  // gradients, so a reduce-scatter that sums where it should average leaves the losses as they were and doubles
  // the norm (docs/TESTING.md).
  test::TempDir dir;
  auto run = [&](int ranks, const std::string& name) {
    const std::string cmd = (ranks > 1 ? test::binary("memtrain-run") + " --standalone --nproc-per-node 2 -- " : std::string()) +
                            test::binary("memtrain") + " --model.name=llama --model.n_layer=2 --model.n_head=4"
                            " --model.n_kv_head=2 --model.n_embd=32 --model.block_size=32 --train.steps=4 --train.warmup_steps=1"
                            " --train.eval_every=0 --log.every=1 --log.progress=lines --checkpoint.save_final=false"
                            " --memory.recompute=all --train.micro_batch=" + std::to_string(8 / ranks) +
                            (ranks > 1 ? " --dist.zero_stage=3" : "") + " --log.dir=" + dir.path() + " --log.name=" + name;
    int code = -1;
    const auto out = test::shell(cmd + " 2>&1", &code);
    EXPECT_EQ(code, 0) << out;
    const auto metrics = dir.path(name + "/metrics.jsonl");
    return std::make_pair(test::metric_losses(metrics), test::metric_grad_norms(metrics));
  };
  const auto [one, one_norms] = run(1, "one");
  const auto [two, two_norms] = run(2, "two");
  ASSERT_EQ(one.size(), 4u);
  ASSERT_EQ(two.size(), 4u);
  ASSERT_EQ(one_norms.size(), 4u);
  ASSERT_EQ(two_norms.size(), 4u);
  for (size_t s = 0; s < 4; ++s) {
    EXPECT_NEAR(two[s], one[s], 1e-5 * one[s]) << "step " << s + 1;
    // The same samples reduced in another order: within the losses' tolerance (a sum for a mean is a factor 2).
    ASSERT_GT(one_norms[s], 0) << "step " << s + 1;
    EXPECT_NEAR(two_norms[s], one_norms[s], 1e-5 * one_norms[s]) << "pre-clip gradient norm, step " << s + 1;
  }
}

}  // namespace
}  // namespace memtrain

namespace memtrain {
namespace {

// Phi-3 (models/src/phi3.cpp), a family added in one file: its presets count what the model cards say (Phi-3-mini
// 3.8B, Phi-3-medium 14B), to the parameter as transformers' Phi3ForCausalLM counts them on the published
// config.json (built on the meta device: 3,821,079,552 and 13,960,238,080), from the shapes alone.
TEST(Phi3, PresetsCountTheModelCardsParameters) {
  const std::map<std::string, int64_t> published = {{"phi-3-mini-4k", 3821079552}, {"phi-3-medium-4k", 13960238080}};
  const auto& family = model_family("phi3");
  ASSERT_EQ(family.config.presets, (std::vector<std::string>{"custom", "phi-3-mini-4k", "phi-3-medium-4k"}));
  for (const auto& [name, count] : published) {
    SCOPED_TRACE(name);
    const auto c = Config::load("", {"--model.preset=" + name, "--data.dataset=synthetic"});
    EXPECT_EQ(c.model.name, "phi3");  // the preset names its family
    const auto t = family.tensors(c.model, 1);
    int64_t block = 0, root = 0;
    for (auto n : t.block) block += n;
    for (auto n : t.root) root += n;
    EXPECT_EQ(t.layers * block + root, count);
  }
  // The 4k models' sliding window (2047) caps the context memtrain trains exactly; a shape key beside a preset is
  // refused as for any family.
  EXPECT_NE(test::error_of([] { Config::load("", {"--model.preset=phi-3-mini-4k", "--model.block_size=4096"}); })
                .find("model.block_size = 4096 is out of range: the model is made for at most 2047 positions"),
            std::string::npos);
  EXPECT_NE(test::error_of([] { Config::load("", {"--model.preset=phi-3-mini-4k", "--model.n_layer=2"}); })
                .find("fixes the model's shape"),
            std::string::npos);
  // A peft adapter targets the fused module; memtrain's per-projection adapters cannot be written as one.
  ModelConfig m;
  m.name = "phi3", m.n_layer = 1, m.n_head = 4, m.n_embd = 32, m.vocab_size = 97;
  EXPECT_NE(test::error_of([&] { peft_name(m, "model.layers.0.self_attn.q_proj.lora_A"); }).find("inside model.layers.0.self_attn.qkv_proj.weight"),
            std::string::npos);
  EXPECT_EQ(peft_name(m, "model.layers.0.self_attn.o_proj.lora_A"), "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight");
}

}  // namespace
}  // namespace memtrain
