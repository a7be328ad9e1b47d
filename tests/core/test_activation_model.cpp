// The closed-form activation model (core/activation_model.h) against arithmetic: Korthikanti et al.'s per-layer
// count adjusted term by term for what memtrain's GPT keeps, the Llama block's saved tensors one by one, and how
// the recompute policies and the fused head change the peak. Its agreement with measured peaks is
// tests/runtime/test_memory_estimate.cpp's and docs/benchmarks/estimate_cpu.md's.
#include <gtest/gtest.h>

#include <string>

#include "memtrain/core/activation_model.h"

namespace memtrain {
namespace {

// micro-batch, autocast (bf16/fp16 activations, fp32 parameters), bf16 parameters, a CUDA device.
ActivationSettings settings(int64_t micro_batch, bool autocast, bool half_params, bool cuda) {
  ActivationSettings s;
  s.micro_batch = micro_batch, s.autocast = autocast, s.half_params = half_params, s.cuda = cuda;
  return s;
}

// The bytes of the peak's term named `name`; -1 when the peak has no such term.
int64_t term_bytes(const ActivationEstimate& a, const std::string& name) {
  for (const auto& term : a.terms)
    if (term.name == name) return term.bytes;
  return -1;
}

TransformerShape gpt2_shape() {
  // GPT-2 124M: 12 x 768, 12 heads, context 1024, vocabulary 50257.
  const int64_t h = 768;
  return {.family = TransformerShape::Family::kGpt, .layers = 12, .hidden = h, .heads = 12, .kv_heads = 12,
          .ffn = 4 * h, .vocab = 50257, .context = 1024, .positions = 1024, .bias = true, .tied = true,
          .dropout = 0, .block_parameters = 12 * h * h + 13 * h, .root_parameters = 50257 * h + 1024 * h + 2 * h,
          .largest_parameter = 50257 * h};
}

TEST(ActivationModel, GptBlockIsKorthikantisCountWithoutDropoutMasksAndWithFp32LayerNormInputs) {
  // Korthikanti et al. 2022, section 4.1, 16-bit activations: s b h (34 + 5 a s / h) per layer, of which 5 a s^2 b
  // is the attention's scores, softmax and dropout (flash attention keeps none: "selective" 34 s b h), and 2 s b h
  // the two dropout masks (1 byte each). memtrain's block under bf16 autocast with fp32 parameters differs by:
  //   - no masks at dropout 0 (-2 s b h);
  //   - both LayerNorms' inputs are the fp32 residual stream (+2 s b h each: +4);
  //   - what the paper leaves out: LayerNorm's mean and rstd (2 fp32 per token each: 16 s b) and the attention
  //     kernel's logsumexp (one fp32 per head and token: 4 a s b).
  const auto g = gpt2_shape();
  const int64_t s = 1024, b = 8, h = 768, a = 12;
  auto bf16 = settings(b, true, false, true);
  const double korthikanti = korthikanti_layer_bytes(s, b, h, a, /*selective=*/true);
  EXPECT_DOUBLE_EQ(korthikanti, 34.0 * s * b * h);
  EXPECT_DOUBLE_EQ(korthikanti_layer_bytes(s, b, h, a, false), s * b * h * (34.0 + 5.0 * a * s / h));
  EXPECT_EQ(static_cast<double>(transformer_activations(g, bf16).block_saved),
            korthikanti - 2.0 * s * b * h + 4.0 * s * b * h + 16.0 * s * b + 4.0 * a * s * b);
  // Dropout on a GPU: the fused kernels keep a 1-byte mask for each of the two dropouts (the paper's 2 s b h) and
  // flash attention's dropout keeps only its seed (no 5 a s^2 b).
  auto dropped = g;
  dropped.dropout = 0.1;
  EXPECT_EQ(static_cast<double>(transformer_activations(dropped, bf16).block_saved),
            korthikanti + 4.0 * s * b * h + 16.0 * s * b + 4.0 * a * s * b);
  // Dropout on a CPU: PyTorch's math attention keeps the softmax, its noise and the dropped scores (3 a s^2 b
  // elements, 2 bytes each here: the paper's 5 a s^2 b is 2 + 1 + 2 bytes), and each dropout keeps its noise in the
  // activation dtype (2 bytes for the paper's 1-byte mask).
  auto cpu = bf16;
  cpu.cuda = false;
  EXPECT_EQ(static_cast<double>(transformer_activations(dropped, cpu).block_saved),
            korthikanti + 2.0 * s * b * h + 4.0 * s * b * h + 16.0 * s * b + 3.0 * a * s * s * b * 2);
  // bf16 parameters: the residual stream is 16-bit too (the paper's count less its masks), LayerNorm's statistics
  // are bf16 (8 s b).
  auto half = settings(b, false, true, true);
  EXPECT_EQ(static_cast<double>(transformer_activations(g, half).block_saved),
            korthikanti - 2.0 * s * b * h + 8.0 * s * b + 4.0 * a * s * b);
  // fp32: every activation twice the paper's 16-bit bytes; statistics and logsumexp as they were.
  auto fp32 = settings(b, false, false, true);
  EXPECT_EQ(static_cast<double>(transformer_activations(g, fp32).block_saved),
            2 * (korthikanti - 2.0 * s * b * h) + 16.0 * s * b + 4.0 * a * s * b);
}

// Tensor parallelism: Korthikanti et al. 2022, section 4.2, per layer split over T ranks, 16-bit activations, flash
// attention (selective: no 5 a s^2 b): s b h (10 + 24 / T) without sequence parallelism, s b h 34 / T with it. Of the
// 34: 24 lie in the split regions (q, k 4; v 2; the attention output 2; GELU's input and output 16), 10 outside (both
// LayerNorms' inputs 4, the inputs of c_attn and c_fc 4, the two dropout masks 2). memtrain's split GPT block under
// bf16 autocast with fp32 parameters differs by:
//   - no masks at dropout 0 (-2 outside the split regions);
//   - the LayerNorms' inputs are the fp32 residual stream (+4 outside);
//   - with sequence parallelism, c_attn's and c_fc's inputs are the all-gathered tokens, kept whole (4, not 4 / T: the
//     paper keeps the 1 / T shard and gathers it again in backward);
//   - LayerNorm's statistics (16 s b, 1 / T of the tokens with sequence parallelism) and the logsumexp of this rank's
//     heads (4 a s b / T).
TEST(ActivationModel, SplitGptBlockIsKorthikantisTensorParallelCountAdjusted) {
  const auto g = gpt2_shape();
  const int64_t s = 1024, b = 8, h = 768, a = 12;
  const double sbh = static_cast<double>(s) * b * h, sb = static_cast<double>(s) * b;
  const auto bf16 = settings(b, true, false, true);
  for (const int64_t T : {2, 4}) {
    SCOPED_TRACE("T = " + std::to_string(T));
    const double t = static_cast<double>(T);
    const double plain = korthikanti_layer_bytes(s, b, h, a, /*selective=*/true, T, false);
    const double sequence = korthikanti_layer_bytes(s, b, h, a, true, T, true);
    EXPECT_DOUBLE_EQ(plain, sbh * (10 + 24 / t));
    EXPECT_DOUBLE_EQ(sequence, sbh * 34 / t);
    EXPECT_DOUBLE_EQ(korthikanti_layer_bytes(s, b, h, a, false, T, false), sbh * (10 + 24 / t + 5.0 * a * s / (h * t)));
    EXPECT_EQ(static_cast<double>(transformer_activations(split_transformer(g, T, false), bf16).block_saved),
              plain - 2 * sbh + 4 * sbh + 16 * sb + 4 * a * sb / t);
    EXPECT_EQ(static_cast<double>(transformer_activations(split_transformer(g, T, true), bf16).block_saved),
              sequence - 2 * sbh / t + 4 * sbh / t + (4 * sbh - 4 * sbh / t) + 16 * sb / t + 4 * a * sb / t);
  }
}

TEST(ActivationModel, LlamaBlockCountsEachSavedTensor) {
  // A GQA Llama block (h 4096, 32 heads, 8 key/value heads: k = 1024, SwiGLU F = 14336), per token, counted from
  // the forward's saved tensors: RMSNorm keeps its fp32 input, rsqrt and the normalised value; the projections
  // their input (autocast: a cast per projection); SDPA q, k, v, the output and a logsumexp per head; the MLP gate,
  // SiLU(gate), up and their product.
  const int64_t h = 4096, k = 1024, F = 14336, a = 32, s = 2048, b = 1;
  TransformerShape m{.family = TransformerShape::Family::kLlama, .layers = 2, .hidden = h, .heads = a, .kv_heads = 8,
                     .ffn = F, .vocab = 128256, .context = s, .tied = false};
  const int64_t t = s * b;
  auto fp32 = settings(b, false, false, false);
  const int64_t norm32 = 4 * h + 4 + 4 * h;  // input (the fp32 residual itself), rsqrt, normalised
  EXPECT_EQ(transformer_activations(m, fp32).block_saved,
            t * (norm32 + 4 * h + (4 * h + 8 * k) + 4 * h + 4 * a + norm32 + 4 * h + 16 * F));
  auto autocast = settings(b, true, false, false);
  EXPECT_EQ(transformer_activations(m, autocast).block_saved,
            t * (norm32 + 3 * 2 * h + (2 * h + 4 * k) + 2 * h + 4 * a + norm32 + 2 * 2 * h + 8 * F));
  auto half = settings(b, false, true, false);
  const int64_t norm16 = 4 * h + 4 + 2 * h;  // the fp32 upcast, rsqrt, the bf16 normalised value
  EXPECT_EQ(transformer_activations(m, half).block_saved,
            t * (norm16 + 2 * h + (2 * h + 4 * k) + 2 * h + 4 * a + norm16 + 2 * h + 8 * F));
}

TEST(ActivationModel, RecomputePoliciesOrderThePeakAndAllKeepsOneInputPerBlock) {
  auto g = gpt2_shape();
  auto s = settings(4, true, false, true);
  auto peak = [&](const std::string& policy) {
    auto v = s;
    v.policy = RecomputePolicy::parse(policy);
    return transformer_activations(g, v);
  };
  const auto none = peak("none"), every2 = peak("every:2"), attn = peak("attn"), mlp = peak("mlp"), all = peak("all");
  EXPECT_GT(none.peak, every2.peak);
  EXPECT_GT(every2.peak, all.peak);
  EXPECT_GT(none.peak, attn.peak);
  EXPECT_GT(attn.peak, mlp.peak);  // recomputing the MLP frees 22 h of the block's 36 h per token, attention 14 h
  EXPECT_GT(mlp.peak, all.peak);
  // With all blocks recomputed, the backward's start (GPT-2's logits dwarf a block) holds one fp32 input per block.
  EXPECT_EQ(all.at, "the backward's start (the loss over the logits)");
  const int64_t t = 4 * 1024;
  EXPECT_EQ(term_bytes(all, "blocks' saved tensors"), 12 * 4 * 768 * t);
  // The plain head's peak: the log-softmax's fp32 result, the loss gradient and the log-softmax gradient (3 x 4 V).
  EXPECT_EQ(term_bytes(none, "logits: log-softmax, its gradients (fp32)"), 12 * 50257 * t);
}

TEST(ActivationModel, TheFusedHeadHoldsOneChunkOfLogits) {
  EXPECT_EQ(fused_head_chunk_rows(50257, false), (int64_t{1} << 24) / 50257);
  EXPECT_EQ(fused_head_chunk_rows(50257, true) % 64, 0);
  EXPECT_EQ(fused_head_chunk_rows(50257, true), (int64_t{1} << 27) / 50257 / 64 * 64);
  auto g = gpt2_shape();
  auto plain = settings(8, true, false, true);
  auto fused = plain;
  fused.head_rows = 0;
  const auto p = transformer_activations(g, plain), f = transformer_activations(g, fused);
  EXPECT_LT(f.peak, p.peak);
  // Its chunk: the fp32 logits and logsumexp's temporary of the same size, for 2^27 / V rows (a multiple of 64).
  EXPECT_EQ(term_bytes(f, "fused head: a chunk's logits (fp32)"), 8 * fused_head_chunk_rows(50257, true) * 50257);
}

TEST(ActivationModel, LoraKeepsOnlyWhatItsAdaptersAndTheFrozenBasesInputsNeed) {
  // A Llama block with adapters on q_proj and v_proj (rank 8), fp32: the base is frozen, so neither RMSNorm keeps its
  // normalised value (its weight takes no gradient), gate/up and down keep no input (nothing adapted there); q_proj
  // and v_proj keep their input (A's), and each adapter keeps A x (8 values). SDPA, SiLU and the product's operands
  // keep theirs for the input's gradient as before.
  const int64_t h = 512, k = 128, F = 1408, a = 8, s = 256, b = 2, r = 8;
  TransformerShape m{.family = TransformerShape::Family::kLlama, .layers = 4, .hidden = h, .heads = a, .kv_heads = 2,
                     .ffn = F, .vocab = 32000, .context = s, .tied = false};
  auto fp32 = settings(b, false, false, false);
  const auto full = transformer_activations(m, fp32);
  auto lora = fp32;
  lora.lora.rank = r, lora.lora.targets = {"q_proj", "v_proj"};
  const int64_t t = s * b;
  const int64_t norm_frozen = 4 * h + 4;
  EXPECT_EQ(transformer_activations(m, lora).block_saved,
            t * (norm_frozen + 4 * h + (4 * h + 8 * k) + 4 * h + 4 * a + 2 * 4 * r + norm_frozen + 3 * 4 * F));
  EXPECT_LT(transformer_activations(m, lora).peak, full.peak);
  // The adapters' elements: A (r x in) and B (out x r) for q (h -> h) and v (h -> k).
  EXPECT_EQ(lora.lora.block_elements(m), r * (h + h) + r * (h + k));
  // GPT with c_attn only: LayerNorm 2's output and GELU's output are no one's input to keep.
  auto g = gpt2_shape();
  auto bf16 = settings(4, true, false, true);
  auto adapted = bf16;
  adapted.lora.rank = r, adapted.lora.targets = {"c_attn"};
  const int64_t hg = 768, tg = 4 * 1024;
  EXPECT_EQ(transformer_activations(g, bf16).block_saved - transformer_activations(g, adapted).block_saved,
            tg * (2 * hg + 2 * 4 * hg - 2 * r));
}

}  // namespace
}  // namespace memtrain
