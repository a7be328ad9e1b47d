#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>

#include "helpers.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/core/error.h"
#include "memtrain/models/gpt.h"
#include "memtrain/runtime/precision.h"
#include "memtrain/data/datasets.h"
#include "memtrain/runtime/trainer.h"

namespace memtrain {
namespace {

TEST(Autocast, GuardEnablesNestsAndRestores) {
  ASSERT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  auto lin = torch::nn::Linear(8, 8);
  auto x = torch::randn({2, 8});
  {
    AutocastGuard outer(c10::kCPU, c10::kBFloat16);
    EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::kCPU));
    EXPECT_EQ(lin->forward(x).scalar_type(), c10::kBFloat16);
    {
      AutocastGuard inner(c10::kCPU, std::nullopt);  // an fp32 island
      EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
      EXPECT_EQ(lin->forward(x).scalar_type(), c10::kFloat);
    }
    EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::kCPU));
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  EXPECT_EQ(lin->forward(x).scalar_type(), c10::kFloat);
}

TEST(Autocast, NestedGuardInheritsTheCacheSetting) {
  // As torch.autocast(cache_enabled=None): an inner guard keeps the enclosing guard's cache setting
  // unless it names one.
  ASSERT_TRUE(at::autocast::is_autocast_cache_enabled());
  {
    AutocastGuard outer(c10::kCPU, c10::kBFloat16, /*cache_enabled=*/false);
    EXPECT_FALSE(at::autocast::is_autocast_cache_enabled());
    {
      AutocastGuard inner(c10::kCPU, c10::kBFloat16);
      EXPECT_FALSE(at::autocast::is_autocast_cache_enabled());
      AutocastGuard fp32(c10::kCPU, std::nullopt);
      EXPECT_FALSE(at::autocast::is_autocast_cache_enabled());
    }
    {
      AutocastGuard inner(c10::kCPU, c10::kBFloat16, /*cache_enabled=*/true);
      EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
    }
    EXPECT_FALSE(at::autocast::is_autocast_cache_enabled());
  }
  EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
}

TEST(Autocast, Bf16OnAMissingCudaDeviceIsAConfigError) {
  // The capability check reads the requested device; one that does not exist is named, not queried.
  const int n = static_cast<int>(torch::cuda::device_count());
  const c10::Device missing(c10::kCUDA, static_cast<c10::DeviceIndex>(n));
  auto msg = test::error_of([&] { check_precision_supported(Precision::kBf16, missing); });
  EXPECT_NE(msg.find("[precision]"), std::string::npos) << msg;
  EXPECT_NE(msg.find(missing.str() + ": that device is not available"), std::string::npos) << msg;
  EXPECT_THROW(check_precision_supported(Precision::kBf16, missing), ConfigError);
}

TEST(Autocast, RejectsNonHalfDtypes) {
  EXPECT_THROW(AutocastGuard(c10::kCPU, c10::kDouble), Error);
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
}

TEST(Autocast, Bf16MatchesPyTorchCpuAutocast) {
  auto ref = load_safetensors(test::fixture("gpt_bf16.safetensors"));
  auto parity = load_safetensors(test::fixture("gpt_parity.safetensors"));
  auto gpt_ptr = test::fixture_gpt();
  auto& gpt = *gpt_ptr;
  // One thread, as the fixture was made: bf16 GEMMs blocked differently round differently, and those
  // last-bit differences are what a loose tolerance would have to absorb.
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  torch::Tensor loss;
  {
    AutocastGuard autocast(c10::kCPU, c10::kBFloat16);
    loss = gpt.loss(gpt.forward(parity.at("input")), parity.at("target"));
  }
  loss.backward();
  at::set_num_threads(threads);
  // The same bf16 operations as PyTorch's run: equal far below bf16's own rounding (2^-8 = 4e-3), so a
  // layer left in fp32 (or cast to bf16 where PyTorch keeps fp32) shows.
  EXPECT_NEAR(loss.item<double>(), ref.at("loss").item<double>(), 1e-4);
  for (const auto& item : gpt.named_parameters()) {
    SCOPED_TRACE(item.key());
    EXPECT_LT(test::relative_error(item.value().grad(), ref.at("grad." + item.key())), 1e-3);
  }
  // ... and differ from the fp32 gradients by more than fp32 rounding: autocast really ran in bf16.
  double max_diff = 0;
  for (const auto& item : gpt.named_parameters())
    max_diff = std::max(max_diff, test::relative_error(item.value().grad(), parity.at("grad." + item.key())));
  EXPECT_GT(max_diff, 1e-4);
}

TEST(Autocast, Bf16LowersActivationPeak) {
  auto c = test::tiny_gpt_config(4);
  c.model.n_embd = 64, c.model.block_size = 64, c.train.micro_batch = 8;
  auto bf = c;
  bf.train.precision = "bf16";
  Trainer a(c), b(bf);
  a.step(), b.step();
  a.step(), b.step();
  const auto fp32 = a.tracker().last()[0].activation_peak, bf16 = b.tracker().last()[0].activation_peak;
  EXPECT_LT(bf16, 0.9 * fp32) << bf16 << " vs " << fp32;
}

// The fixture's batch on every step, and the fixture's vocabulary.
class FixtureBatch : public Dataset {
 public:
  explicit FixtureBatch(std::map<std::string, torch::Tensor> ref) : ref_(std::move(ref)) {}
  DataInfo info() const override { return {.vocab_size = 64}; }
  Batch train_batch(int64_t, int64_t, int64_t) override { return {ref_.at("input"), ref_.at("target")}; }
  std::vector<Batch> val_batches(int64_t, int64_t) override { return {{ref_.at("input"), ref_.at("target")}}; }
  std::string describe() const override { return "fixture batch"; }

 private:
  std::map<std::string, torch::Tensor> ref_;
};

TEST(MasterWeights, MatchPyTorchBf16ModelWithFp32Masters) {
  // scripts/reference/make_fixtures.py gpt_master(): the GPT in bf16, AdamW on fp32 copies, 3 steps.
  auto parity = load_safetensors(test::fixture("gpt_parity.safetensors"));
  auto ref = load_safetensors(test::fixture("gpt_master.safetensors"));
  auto gpt = test::fixture_gpt();
  auto c = Config::load("", {"--train.param_dtype=bf16", "--train.lr=0.01", "--train.min_lr=0.01",
                             "--train.warmup_steps=0", "--train.grad_clip=0", "--train.weight_decay=0.1",
                             "--train.beta2=0.95", "--train.micro_batch=4", "--train.steps=3", "--train.threads=1"});
  // One thread, as the fixture was made: bf16 GEMMs round differently with other blockings, and Adam's
  // first step (+-lr per element) turns such last-bit differences into whole-lr ones.
  const int threads = at::get_num_threads();
  Trainer t(c, gpt, std::make_shared<FixtureBatch>(parity));
  auto expected = ref.at("losses");
  for (int64_t i = 0; i < 3; ++i)
    EXPECT_NEAR(t.step().loss.item<double>(), expected[i].item<double>(), 1e-5) << "step " << i;
  size_t i = 0;
  for (const auto& item : gpt->named_parameters()) {
    SCOPED_TRACE(item.key());
    EXPECT_LT(test::relative_error(t.master_weights()[i], ref.at("master." + item.key())), 5e-3);
    ++i;
  }
  at::set_num_threads(threads);
}

TEST(Fp16, TrainsAsTorchAmpOnTheCpu) {
  // scripts/reference/make_fixtures.py gpt_fp16(): torch.autocast("cpu", torch.float16) and torch.amp.GradScaler("cpu")
  // from a scale of 2^27 (backoff 0.25, growth after 2 finite steps), AdamW, 10 steps on the fixture batch.
  auto parity = load_safetensors(test::fixture("gpt_parity.safetensors"));
  auto ref = load_safetensors(test::fixture("gpt_fp16.safetensors"));
  const auto losses = ref.at("losses"), scales = ref.at("scales"), stepped = ref.at("stepped");
  // The fixture skips steps and steps after them, or this test would check less than it says.
  ASSERT_GT(stepped.sum().item<int64_t>(), 0);
  ASSERT_LT(stepped.sum().item<int64_t>(), stepped.numel());
  auto gpt = test::fixture_gpt();
  auto c = Config::load("", {"--train.precision=fp16", "--train.loss_scale_init=134217728", "--train.loss_scale_backoff=0.25",
                             "--train.loss_scale_interval=2", "--train.lr=0.01", "--train.min_lr=0.01",
                             "--train.warmup_steps=0", "--train.grad_clip=0", "--train.weight_decay=0.1",
                             "--train.beta2=0.95", "--train.micro_batch=4", "--train.steps=10", "--train.threads=1"});
  const int threads = at::get_num_threads();
  Trainer t(c, gpt, std::make_shared<FixtureBatch>(parity));
  ASSERT_NE(t.scaler(), nullptr);
  for (int64_t i = 0; i < losses.numel(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    const auto r = t.step();
    // The same fp16 operations as PyTorch's on one thread: far below fp16's own rounding (2^-11 = 5e-4).
    EXPECT_NEAR(r.loss.item<double>(), losses[i].item<double>(), 1e-5 * losses[i].item<double>());
    EXPECT_EQ(r.applied, stepped[i].item<int64_t>() == 1);
    EXPECT_DOUBLE_EQ(t.scaler()->current_scale(), scales[i].item<double>());
  }
  const int64_t applied = stepped.sum().item<int64_t>();
  for (const auto& item : gpt->named_parameters()) {
    SCOPED_TRACE(item.key());
    const auto mine = item.value().detach(), theirs = ref.at("final." + item.key());
    if (item.key().ends_with("attn.c_attn.bias")) {
      // As in tests/models/test_parity.cpp: the key third of the q, k, v bias has a gradient that is zero but for
      // rounding (softmax ignores a shift every key shares), which AdamW turns into steps of up to lr in either
      // direction. The query and value thirds are compared; the key third stays within those steps.
      const int64_t C = mine.size(0) / 3;
      auto query_value = [&](const torch::Tensor& b) { return torch::cat({b.slice(0, 0, C), b.slice(0, 2 * C)}); };
      EXPECT_LT(test::relative_error(query_value(mine), query_value(theirs)), 1e-4);
      EXPECT_LE((mine - theirs).slice(0, C, 2 * C).abs().max().item<double>(), 2 * applied * 0.01 * 1.01);
      continue;
    }
    EXPECT_LT(test::relative_error(mine, theirs), 1e-4);
  }
  at::set_num_threads(threads);
}

TEST(MasterWeights, Bf16ParametersWithFp32Masters) {
  auto c = test::tiny_gpt_config();
  c.train.param_dtype = "bf16";
  Trainer bf(c);
  for (int i = 0; i < 3; ++i) bf.step();
  ASSERT_EQ(bf.master_weights().size(), bf.parameters().size());
  const int64_t n = bf.model().num_parameters();
  for (size_t i = 0; i < bf.parameters().size(); ++i) {
    EXPECT_EQ(bf.parameters()[i].scalar_type(), torch::kBFloat16);
    EXPECT_EQ(bf.master_weights()[i].scalar_type(), torch::kFloat);
    // The model holds the masters rounded to bf16, exactly.
    EXPECT_TRUE(torch::equal(bf.parameters()[i], bf.master_weights()[i].to(torch::kBFloat16)));
  }
  // Bytes at the step's end: bf16 parameters 2N; the optimizer holds masters 4N and AdamW 8N. One micro-batch per
  // step: each bucket's fp32 gradients are freed once stepped, and the bf16 ones once cast.
  const auto& s = bf.tracker().last()[0];
  EXPECT_EQ(s.resident.params, 2 * n);
  EXPECT_EQ(s.resident.grads, 0);
  EXPECT_EQ(s.resident.optimizer_state, 12 * n);
}

TEST(MasterWeights, TheStepNeverHoldsTheGradientsInBothDtypes) {
  // bf16 parameters, fp32 masters, one process. The step used to cast every bf16 gradient to fp32 before freeing
  // any: 2N + 4N gradient bytes at once. Now, with one micro-batch per step (an element-wise AdamW), the gradients
  // stay bf16 and the masters step a bucket at a time: at most 2N + one bucket's fp32 (dist.bucket_mib, or one
  // tensor above it). With accumulation each gradient goes into its master's fp32 as autograd completes it: at most
  // 4N + the bf16 gradients in flight (a block's, and the tied embedding's, held from the head to the embedding).
  auto c = test::tiny_gpt_config(/*layers=*/4);
  c.model.n_embd = 64;
  c.model.block_size = 8;
  c.train.micro_batch = 1;
  c.train.param_dtype = "bf16";
  c.train.grad_clip = 1.0;
  c.dist.bucket_mib = 0.05;  // about 13k fp32 elements: a fraction of a block
  for (int64_t accum : {1, 2}) {
    SCOPED_TRACE("accum_steps " + std::to_string(accum));
    c.train.accum_steps = accum;
    Trainer t(c);
    for (int i = 0; i < 3; ++i) t.step();
    const int64_t n = t.model().num_parameters();
    int64_t largest = 0, root = 0, block = 0;
    for (const auto& p : t.parameters()) largest = std::max(largest, p.numel());
    for (const auto& p : t.model().block_parameters(0)) block += p.numel();
    root = n - c.model.n_layer * block;
    const auto& s = t.tracker().last()[0];
    ASSERT_TRUE(s.at_peak.known);
    const int64_t bucket = static_cast<int64_t>(c.dist.bucket_mib * 1024 * 1024) / 4;
    const int64_t bound = accum == 1 ? 2 * n + 4 * (bucket + largest) : 4 * n + 2 * (root + block);
    std::cout << "accum_steps " << accum << ": gradient bytes at the step's peak " << s.at_peak.grads << ", bound " << bound
              << ", both dtypes whole 6N = " << 6 * n << "\n";
    EXPECT_LE(s.at_peak.grads, bound) << "N = " << n << ": the whole model's gradients in bf16 and fp32 are " << 6 * n;
    EXPECT_LT(bound, 6 * n);  // the bound can tell the two apart
  }
}

TEST(MasterWeights, StepsByBucketGiveTheBitsOfOneStep) {
  // The masters stepped bucket by bucket from bf16 gradients, clipped by the global norm of their fp32 values: the
  // same bits with buckets of a fraction of a tensor's size as with one bucket holding the whole model.
  auto c = test::tiny_gpt_config(/*layers=*/2);
  c.train.param_dtype = "bf16";
  c.train.grad_clip = 0.05;  // clips every step
  auto run = [&](double bucket_mib) {
    c.dist.bucket_mib = bucket_mib;
    Trainer t(c);
    std::vector<double> norms;
    for (int i = 0; i < 3; ++i) norms.push_back(t.step().grad_norm.item<double>());
    std::vector<torch::Tensor> out;
    for (const auto& m : t.master_weights()) out.push_back(m.detach().clone());
    for (const auto& p : t.parameters()) out.push_back(p.detach().clone());
    return std::make_pair(norms, out);
  };
  const auto [norms_whole, whole] = run(1000);
  const auto [norms_small, small] = run(0.001);
  EXPECT_EQ(norms_whole, norms_small);
  EXPECT_GT(norms_whole.front(), c.train.grad_clip);
  ASSERT_EQ(whole.size(), small.size());
  for (size_t i = 0; i < whole.size(); ++i) EXPECT_TRUE(torch::equal(whole[i], small[i])) << "tensor " << i;
}

TEST(MasterWeights, BatchNormStaysFp32WithBf16Parameters) {
  // As PyTorch FSDP's MixedPrecision (keep_low_precision_grads off, _module_classes_to_ignore =
  // BatchNorm): BatchNorm's affine parameters and running statistics stay fp32; every other parameter
  // is bf16; every parameter has an fp32 master. Forward with and without bf16 autocast.
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    auto c = Config::load("", {"--model.name=resnet", "--data.dataset=synthetic", "--model.width=4",
                               "--train.micro_batch=4", "--train.param_dtype=bf16", "--train.warmup_steps=0",
                               std::string("--train.precision=") + precision, "--train.eval_every=0"});
    Trainer t(c);
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(std::isfinite(t.step().loss.item<double>())) << "step " << i;
    EXPECT_TRUE(std::isfinite(t.evaluate(t.data().val_batches(4, 1)).loss));
    int64_t bn = 0, other = 0;
    for (const auto& m : t.model().modules()) {
      if (dynamic_cast<torch::nn::BatchNorm2dImpl*>(m.get()) == nullptr) continue;
      for (const auto& p : m->parameters(/*recurse=*/false)) {
        EXPECT_EQ(p.scalar_type(), torch::kFloat);
        ++bn;
      }
      for (const auto& b : m->buffers(/*recurse=*/false)) {
        if (!b.is_floating_point()) continue;
        EXPECT_EQ(b.scalar_type(), torch::kFloat);
        ++bn;
      }
    }
    EXPECT_GT(bn, 0);
    for (const auto& m : t.model().modules()) {
      if (dynamic_cast<torch::nn::Conv2dImpl*>(m.get()) == nullptr) continue;
      for (const auto& p : m->parameters(/*recurse=*/false)) {
        EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
        ++other;
      }
    }
    EXPECT_GT(other, 0);
    ASSERT_EQ(t.master_weights().size(), t.parameters().size());
    for (size_t i = 0; i < t.parameters().size(); ++i) {
      EXPECT_EQ(t.master_weights()[i].scalar_type(), torch::kFloat);
      EXPECT_TRUE(torch::equal(t.parameters()[i], t.master_weights()[i].to(t.parameters()[i].scalar_type())));
    }
  }
}

TEST(MasterWeights, RefusesFp16WithBf16Parameters) {
  auto msg = test::error_of([] { Config::load("", {"--train.param_dtype=bf16", "--train.precision=fp16"}); });
  EXPECT_NE(msg.find("mixes two half types"), std::string::npos) << msg;
}

TEST(GradScaler, SameScalesAsTorchAmp) {
  auto ref = load_safetensors(test::fixture("grad_scaler.safetensors"));
  auto scales = ref.at("scales"), stepped = ref.at("stepped"), params = ref.at("params");
  auto p = torch::ones({4}).requires_grad_();
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.1));
  GradScaler scaler({.growth_interval = 3});
  const std::map<int, double> bad = {{3, INFINITY}, {4, INFINITY}, {9, NAN}};
  for (int step = 0; step < scales.size(0); ++step) {
    SCOPED_TRACE(step);
    opt.zero_grad();
    auto loss = (p * torch::arange(1.0, 5.0)).sum();
    scaler.scale(loss).backward();
    if (bad.count(step)) {
      torch::NoGradGuard g;
      p.grad()[1] = bad.at(step);
    }
    bool did = scaler.step(opt, {p});
    scaler.update();
    EXPECT_EQ(did, stepped[step].item<int64_t>() == 1);
    EXPECT_DOUBLE_EQ(scaler.current_scale(), scales[step].item<double>());
    EXPECT_TRUE(torch::allclose(p.detach(), params[step], 1e-6, 1e-7));
  }
}

TEST(GradScaler, UnscalesOncePerStepAcrossMicroBatches) {
  auto p = torch::ones({2}).requires_grad_();
  GradScaler scaler({.init_scale = 8.0});
  for (int micro = 0; micro < 3; ++micro) scaler.scale((p * 2).sum()).backward();  // grad 3 * 2 * 8 = 48
  scaler.unscale({p});
  scaler.unscale({p});  // a second call in the same step does nothing
  EXPECT_TRUE(torch::allclose(p.grad(), torch::full({2}, 6.0)));
}

TEST(GradScaler, AnAbandonedStepIsDiscardedNotWedged) {
  // A step abandoned between unscale/step and update (an out-of-memory retry): without discard_step()
  // the retry's gradients would stay scaled (unscale thinks it ran) and step() would refuse to run.
  auto p = torch::ones({2}).requires_grad_();
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.5));
  GradScaler scaler({.init_scale = 8.0});
  scaler.scale((p * 2).sum()).backward();  // grad 16
  EXPECT_TRUE(scaler.step(opt, {p}));      // unscaled to 2 and applied: p = 0
  // ... the exception comes here, before update(). The retry:
  scaler.discard_step();
  p.mutable_grad().reset();
  scaler.scale((p * 2).sum()).backward();  // grad 16 again
  EXPECT_TRUE(scaler.step(opt, {p}));      // unscaled again, stepped: p = 0 - 0.5 * 2
  EXPECT_TRUE(torch::allclose(p.detach(), torch::full({2}, -1.0))) << p;
  scaler.update();
}

TEST(GradScaler, CudaFp16SkipsWithoutGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto c = test::tiny_gpt_config();
  c.train.device = "cuda";
  c.train.precision = "fp16";
  Trainer t(c);
  auto r = t.step();
  EXPECT_TRUE(std::isfinite(r.loss.item<double>()));
  EXPECT_DOUBLE_EQ(t.scaler()->current_scale(), 65536.0);
  {
    AutocastGuard guard(c10::kCUDA, c10::kHalf);
    torch::nn::Linear lin(4, 4);
    lin->to(torch::kCUDA);
    auto y = lin->forward(torch::randn({2, 4}, torch::kCUDA));
    EXPECT_EQ(y.scalar_type(), c10::kHalf);
  }
}

}  // namespace
}  // namespace memtrain
