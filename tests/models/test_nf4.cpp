// Issue 37: QLoRA's NF4 base. Expected values come from torchao 0.18's NF4Tensor and linear_nf4
// (scripts/reference/nf4_ref.py: its codes, int8 scales, factors, mean and dequantized weights for random, zero, tiny,
// mixed-magnitude and wide-block tensors; a QLoRA Llama and GPT-2 forward and backward on a batch) and from
// arithmetic on the packed layout.
#include <gtest/gtest.h>

#include "helpers.h"
#include "memtrain/core/config.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/models/hugging_face.h"
#include "memtrain/models/lora.h"
#include "memtrain/models/nf4.h"
#include "memtrain/runtime/factories.h"

namespace memtrain {
namespace {

// Bit for bit: the same dtype, shape and bytes (NaN-safe, unlike torch::equal).
void expect_same_bits(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  auto a = got.contiguous().view({-1}), b = want.contiguous().view({-1});
  if (a.element_size() == 2) a = a.view(torch::kShort), b = b.view(torch::kShort);
  if (a.element_size() == 4) a = a.view(torch::kInt), b = b.view(torch::kInt);
  const auto differ = a.ne(b).sum().item<int64_t>();
  EXPECT_EQ(differ, 0) << what << ": " << differ << " of " << a.numel() << " values differ";
}

TEST(Nf4, LevelsAreTorchaosInBf16) {
  const auto ref = load_safetensors(test::fixture("nf4.safetensors"));
  expect_same_bits(nf4_levels(torch::kBFloat16), ref.at("levels"), "levels");
}

class Nf4Torchao : public ::testing::TestWithParam<const char*> {};

TEST_P(Nf4Torchao, CodesScalesAndDequantizedValuesAreTorchaosBitForBit) {
  const std::string name = GetParam();
  const auto ref = load_safetensors(test::fixture("nf4.safetensors"));
  const auto& x = ref.at(name + "/x");
  const bool wide = name == "wide";  // torchao's to_nf4(x, 128, 64)
  const Nf4Options o{.block = wide ? 128 : 64, .scaler_block = wide ? 64 : 256, .double_quant = true};
  const auto parts = nf4_quantize(x, o);
  expect_same_bits(parts.codes, ref.at(name + "/codes"), "codes");
  expect_same_bits(parts.scales, ref.at(name + "/scales"), "int8 scales");
  expect_same_bits(parts.factors, ref.at(name + "/factors"), "factors");
  expect_same_bits(parts.mean, ref.at(name + "/mean"), "mean");
  const auto f = nf4_format(x.sizes().vec(), torch::kBFloat16, o);
  const auto packed = nf4_pack(x, f);
  expect_same_bits(nf4_dequantize(packed, f), ref.at(name + "/dequantized"), "dequantized");
  expect_same_bits(nf4_dequantize_ops(packed, f), ref.at(name + "/dequantized"), "dequantized by ATen operations (CUDA's path)");
  // Any byte range (a ZeRO-3 rank's part) quantized alone is the same bytes.
  const int64_t n = f.packed_bytes();
  for (auto [b, e] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {7, n / 2 - 3}, {n / 2 - 5, n / 2 + 9}, {n / 3, n}, {n - 1, n}})
    expect_same_bits(nf4_pack_range(x, f, b, e), packed.slice(0, b, e), "bytes " + std::to_string(b) + ".." + std::to_string(e));
  // The packed tensor holds the parts at their offsets.
  expect_same_bits(nf4_unpack(packed, f).codes, ref.at(name + "/codes"), "packed codes");
  expect_same_bits(nf4_unpack(packed, f).mean, ref.at(name + "/mean"), "packed mean");
}

INSTANTIATE_TEST_SUITE_P(Tensors, Nf4Torchao, ::testing::Values("random", "zero", "tiny", "mixed", "wide"),
                         [](const auto& info) { return std::string(info.param); });

TEST(Nf4, PackedBytesAreHalfAByteAWeightPlusItsScales) {
  // Llama-3.1-8B's up_proj, 14336 x 4096: 2^19 x 112 values.
  const int64_t n = 14336LL * 4096;
  const auto f = nf4_format({14336, 4096}, torch::kBFloat16, {});
  const int64_t blocks = n / 64, groups = blocks / 256;
  EXPECT_EQ(f.packed_bytes(), n / 2 + blocks + 2 * groups + 16);  // codes, int8 scales, bf16 factors, bf16 mean + 14 pad
  EXPECT_NEAR(static_cast<double>(f.packed_bytes()) / static_cast<double>(n), 0.5 + 1.0 / 64 + 2.0 / (64 * 256), 1e-6);
  const auto plain = nf4_format({14336, 4096}, torch::kBFloat16, {.double_quant = false});
  EXPECT_EQ(plain.packed_bytes(), n / 2 + 2 * blocks);  // one bf16 absmax per block
  EXPECT_FALSE(nf4_eligible(64 * 128, {}));                 // 128 blocks: not a whole group of 256
  EXPECT_TRUE(nf4_eligible(64 * 128, {.double_quant = false}));
  EXPECT_FALSE(nf4_eligible(100, {.double_quant = false}));  // not whole blocks
}

TEST(Nf4, WithoutDoubleQuantizationEachValueIsItsLevelTimesItsBlocksAbsmax) {
  const auto x = torch::randn({32, 64}, torch::TensorOptions().dtype(torch::kBFloat16));
  const auto f = nf4_format({32, 64}, torch::kBFloat16, {.double_quant = false});
  const auto packed = nf4_pack(x, f);
  const auto parts = nf4_unpack(packed, f);
  const auto absmax = std::get<0>(x.view({-1, 64}).abs().max(1));
  expect_same_bits(parts.scales, absmax, "absmaxes");
  // By the published algorithm (in bf16, as torchao computes it): the nearest of the 16 levels to x / absmax, times
  // the absmax, one rounding.
  const auto levels = nf4_levels(torch::kBFloat16);
  const auto scaled = (x.view({-1, 64}) / absmax.unsqueeze(1)).view({-1, 1});
  const auto nearest = levels.index_select(0, std::get<1>((scaled - levels).abs().min(1))).to(torch::kFloat);
  const auto want = (nearest.view({-1, 64}) * absmax.to(torch::kFloat).unsqueeze(1)).to(torch::kBFloat16).view({32, 64});
  // Each value within half the widest gap between levels (0.3038 / 2 of its absmax) of x, plus bf16's rounding.
  const auto err = (nf4_dequantize(packed, f).to(torch::kFloat) - x.to(torch::kFloat)).view({-1, 64}).abs();
  EXPECT_TRUE((err <= absmax.to(torch::kFloat).unsqueeze(1) * (0.3038 / 2 + 0.01)).all().item<bool>());
  EXPECT_EQ(nf4_dequantize(packed, f).to(torch::kFloat).sub(want.to(torch::kFloat)).abs().max().item<float>(), 0.0f);
}

// A tensor-parallel slice of an NF4 weight (lora.quantize_base = nf4 with dist.tensor_parallel): the whole weight is
// quantized as one process quantizes it (double quantization over all its absmaxes), and the slice keeps its codes and its
// blocks' absmaxes as that quantization dequantizes them. Its values are then the whole's at the slice's places, to the bit,
// on every rank, for a row-parallel split (columns) and GPT's fused q, k, v split by rows; any byte range of it (a ZeRO-3
// part) is those bytes of it. The same slice quantized on its own is not (its absmaxes' mean and groups differ).
TEST(Nf4, ATensorParallelSliceHoldsTheWholeWeightsValuesAtItsPlaces) {
  torch::manual_seed(5);
  struct Case {
    const char* name;
    std::vector<int64_t> whole;
    TensorSplit split;
    int T;
  };
  const std::vector<Case> cases = {{"row-parallel, T = 2", {128, 256}, {.dim = 1, .chunks = 1, .whole = 256}, 2},
                                   {"row-parallel, T = 4", {128, 256}, {.dim = 1, .chunks = 1, .whole = 256}, 4},
                                   {"fused q, k, v, T = 2", {192, 256}, {.dim = 0, .chunks = 3, .whole = 192}, 2}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    // Values of several magnitudes, so that the blocks' absmaxes (and their int8 double quantization) differ.
    const auto w = (torch::randn(c.whole) * torch::rand({c.whole[0], 1}) * 3).to(torch::kBFloat16);
    const Nf4Options whole_options{.block = 64};
    const auto whole_format = nf4_format(c.whole, torch::kBFloat16, whole_options);
    ASSERT_TRUE(whole_format.double_quant);
    const auto whole_values = nf4_dequantize(nf4_pack(w, whole_format), whole_format);
    for (int r = 0; r < c.T; ++r) {
      auto local = c.whole;
      local[static_cast<size_t>(c.split.dim)] = split_size(c.split, r, c.T);
      auto f = nf4_format(local, torch::kBFloat16, {.block = 64, .double_quant = false});
      f.split = c.split, f.tp_rank = r, f.tp_size = c.T, f.whole_double_quant = true;
      EXPECT_EQ(f.whole_shape(), c.whole);
      const auto packed = nf4_pack(w, f);
      const int64_t n = f.numel();
      EXPECT_EQ(packed.numel(), (n / 2 + 2 * (n / 64) + 15) / 16 * 16);  // half a byte a value, a bf16 absmax per 64
      const auto expected = slice_of_whole(c.split, local, r, c.T, whole_values, 0, n).view(local);
      EXPECT_TRUE(torch::equal(nf4_dequantize(packed, f), expected)) << "rank " << r;
      EXPECT_TRUE(torch::equal(nf4_dequantize_ops(packed, f), expected)) << "rank " << r << ", ATen path";
      const int64_t a = n / 2 - 40, b = packed.numel() - 24;  // codes into scales
      EXPECT_TRUE(torch::equal(nf4_pack_range(w, f, a, b), packed.slice(0, a, b))) << "rank " << r;
      // Quantized on its own, the slice's values are another's.
      const auto alone = nf4_format(local, torch::kBFloat16, {.block = 64, .scaler_block = 64});
      const auto mine = slice_of_whole(c.split, local, r, c.T, w, 0, n).view(local);
      EXPECT_FALSE(torch::equal(nf4_dequantize(nf4_pack(mine, alone), alone), expected)) << "rank " << r;
    }
  }
}

TEST(Nf4, TheLinearsGradientIsTheDequantizedWeightsAndTheWeightGetsNone) {
  torch::manual_seed(3);
  const auto w = torch::randn({128, 256}).to(torch::kBFloat16);
  const auto f = nf4_format({128, 256}, torch::kBFloat16, {});
  const auto packed = nf4_pack(w, f);
  const auto deq = nf4_dequantize(packed, f).to(torch::kFloat);
  auto x = torch::randn({4, 5, 256}).requires_grad_();
  auto x2 = x.detach().clone().requires_grad_();
  auto y = nf4_linear(x, packed, f);
  auto y2 = at::linear(x2, deq);
  EXPECT_TRUE(torch::equal(y, y2));
  const auto g = torch::randn(y.sizes());
  y.backward(g);
  y2.backward(g);
  EXPECT_TRUE(torch::equal(x.grad(), x2.grad()));
  EXPECT_FALSE(packed.grad().defined());
}

// QLoRA on a transformers model: every eligible frozen block linear in NF4, the adapters as peft adds them. The loss,
// logits and every adapter gradient equal torchao's QLoRA (linear_nf4 on to_nf4 of the bf16 weight) to 1e-5, and the
// packed bytes are torchao's parts.
class QloraParity : public ::testing::TestWithParam<const char*> {};

TEST_P(QloraParity, LossLogitsAndAdapterGradientsMatchTorchaosQlora) {
  const std::string name = GetParam();
  const auto base = test::fixture("hf/nf4_" + name), adapter = test::fixture("hf/nf4_" + name + "_lora");
  const auto ref = load_safetensors(test::fixture("hf/nf4_" + name + "_qlora.safetensors"));
  const auto c = Config::load("", {"--model.init_from=" + base, "--lora.init_from=" + adapter, "--data.dataset=synthetic",
                                   "--lora.quantize_base=nf4"});
  auto model = make_model(c.model, DataInfo{.vocab_size = 128});
  load_hugging_face_weights(*model, base);
  add_lora(*model, lora_options(c.lora));
  load_lora_adapter(*model, c.model, adapter);
  freeze_all_but_lora(*model);
  const auto quantized = quantize_frozen_linears(*model, nf4_options(c.lora), /*quantize_values=*/true);
  // llama: q, o, gate, up, down per layer (k and v, 64 x 128, are 128 blocks: not a whole group); gpt2: all four.
  EXPECT_EQ(quantized.size(), name == std::string("llama") ? 2u * 5 : 2u * 4);
  const auto params = model->named_parameters();
  size_t packed_checked = 0;
  for (const auto& [param, f] : quantized) {
    const auto hf = hugging_face_name(c.model, param).name;
    SCOPED_TRACE(param + " as " + hf);
    ASSERT_TRUE(ref.count("packed/" + hf + "/codes"));
    const auto parts = nf4_unpack(params[param], f);
    expect_same_bits(parts.codes, ref.at("packed/" + hf + "/codes"), "codes");
    expect_same_bits(parts.scales, ref.at("packed/" + hf + "/scales"), "scales");
    expect_same_bits(parts.factors, ref.at("packed/" + hf + "/factors"), "factors");
    ++packed_checked;
  }
  EXPECT_EQ(packed_checked, quantized.size());
  auto logits = model->forward(ref.at("input"));
  auto loss = model->loss(logits, ref.at("target"));
  loss.backward();
  EXPECT_LT(test::relative_error(logits, ref.at("logits")), 1e-5);
  EXPECT_NEAR(loss.item<double>(), ref.at("loss").item<double>(), 1e-5);
  size_t compared = 0, expected = 0;
  for (const auto& [key, t] : ref) expected += key.starts_with("grad/");
  for (const auto& item : params) {
    if (!item.value().requires_grad()) {
      EXPECT_FALSE(item.value().grad().defined()) << item.key();
      continue;
    }
    const auto peft = peft_name(c.model, item.key());
    SCOPED_TRACE(item.key());
    ASSERT_TRUE(ref.count("grad/" + peft));
    EXPECT_LT(test::relative_error(item.value().grad(), ref.at("grad/" + peft)), 1e-5);
    ++compared;
  }
  EXPECT_EQ(compared, expected);
  EXPECT_GT(compared, 0u);
}

INSTANTIATE_TEST_SUITE_P(Models, QloraParity, ::testing::Values("llama", "gpt2"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace memtrain
