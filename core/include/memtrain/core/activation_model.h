// Activation memory of one forward + backward of memtrain's GPT or Llama, by closed form: no model built,
// nothing allocated, any shape and micro-batch (an 8B or 70B model is answered in microseconds). Per block it
// counts what autograd keeps for backward in memtrain's own forward code (docs/ESTIMATE.md derives each term:
// LayerNorm/RMSNorm inputs and statistics, the linears' inputs, SDPA's q, k, v, output and logsumexp, the
// MLP's activations, autocast's cast copies of activations and cached weight copies), then takes the peak
// over the moments where memory is highest: the backward's start (logits and log-softmax), the fused head's
// chunks, and each block's (re)computed backward with the gradients born by then.
//
//   TransformerShape g{.family = TransformerShape::Family::kGpt, .layers = 12, .hidden = 768, .heads = 12,
//                      .kv_heads = 12, .ffn = 3072, .vocab = 50257, .context = 1024, .positions = 1024};
//   ActivationSettings s{.micro_batch = 8, .autocast = true, .policy = RecomputePolicy::parse("all")};
//   ActivationEstimate a = transformer_activations(g, s);   // a.peak bytes, a.at names the moment, a.terms its parts
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "memtrain/core/recompute_policy.h"

namespace memtrain {

struct TransformerShape {
  // The block's kind, not a model family: GPT-2's (LayerNorm, MHA, GELU MLP) or Llama's (RMSNorm, GQA with rotary
  // embeddings, SwiGLU). A family's ModelFamily::shape picks one (Phi-3's blocks are Llama's); a family whose
  // blocks are neither gives no shape and is estimated by a probe.
  enum class Family { kGpt, kLlama };
  Family family = Family::kGpt;
  int64_t layers = 0, hidden = 0, heads = 0, kv_heads = 0, ffn = 0, vocab = 0;
  int64_t context = 0;         // tokens per sample (model.block_size)
  int64_t positions = 0;       // GPT: rows of the position embedding; Llama: 0
  bool bias = false;           // GPT's linear biases (their autocast copies are freed at once: no bytes kept)
  bool tied = true;            // the head is the token embedding (GPT always)
  double dropout = 0;          // GPT's dropout
  int64_t block_parameters = 0;  // elements of one block and of the rest (embeddings, final norm, head)
  int64_t root_parameters = 0;
  int64_t largest_parameter = 0;  // elements of the largest single tensor
  // Tensor parallelism (dist.tensor_parallel): the shape of one rank's slice, heads, kv_heads, ffn and vocab already
  // divided by `split`; with sequence_split, what lies between the split regions (norms, residuals) holds 1/split of
  // the tokens. The column-parallel maps' input is the gathered (whole) hidden state, which their products keep.
  int64_t split = 1;
  bool sequence_split = false;
  int64_t head_dim() const { return hidden / (heads * split); }
};

// The shape of one rank's slice under tensor parallelism of degree T (dist.tensor_parallel): heads, kv heads, MLP width
// and vocabulary (rounded up) divided by T; `sequence`: sequence parallelism between the split regions. T = 1: `shape`.
TransformerShape split_transformer(TransformerShape shape, int64_t T, bool sequence);

// LoRA's adapters on a frozen base (models/lora.h): rank, dropout, and the linear maps adapted by name (GPT: c_attn,
// c_proj (both the attention's and the MLP's), c_fc; Llama: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
// down_proj).
struct LoraShape {
  int64_t rank = 0;  // 0: no adapters, everything trains
  double dropout = 0;
  std::vector<std::string> targets{};
  bool adapts(const std::string& name) const;
  // Elements of one block's adapters (A: rank x in, B: out x rank for each adapted linear).
  int64_t block_elements(const TransformerShape& shape) const;
  std::vector<int64_t> block_tensors(const TransformerShape& shape) const;  // each A's and B's elements
};

struct ActivationSettings {
  int64_t micro_batch = 1;
  bool autocast = false;       // train.precision = bf16 | fp16: linears and attention in 16 bits, parameters fp32
  bool half_params = false;    // train.param_dtype = bf16: everything in 16 bits, fp32 masters
  // With half_params in one process: the gradients stay bf16 and the masters step bucket by bucket (one micro-batch
  // per step, an element-wise optimizer); otherwise each gradient goes into its fp32 master's as it completes.
  bool masters_by_bucket = false;
  int64_t bucket_elements = 0;  // dist.bucket_mib in fp32 elements (masters_by_bucket's transient)
  RecomputePolicy policy{};    // memory.recompute (a budget resolved to its blocks)
  int64_t head_rows = -1;      // memory.head: -1 plain, 0 fused with automatic chunks, > 0 fused with these rows
  bool keep_grads = true;      // one process: each gradient stays from its birth in backward (several ranks
                               // reduce them into buckets, counted apart)
  // With keep_grads: train.accum_steps > 1, so a later micro-batch's backward adds into gradients already held (a tied
  // head's own gradient and the embedding's are summed beside the held one: a fourth V x h tensor at the backward's end).
  bool accumulates = false;
  bool cuda = false;           // CUDA's attention and dropout kernels, and the fused head's GPU chunks
  LoraShape lora{};            // adapters on a frozen base: frozen linears keep no input, frozen norms less
  // ZeRO 2-3: the bytes a rank keeps per trained element once that element's bucket is reduced (its part of the
  // reduced gradient: 4 / N with fp32 masters, else the parameter bytes / N), born block by block during backward;
  // 0 where the estimate counts the reduced part among the model states.
  double reduced_bytes_per_element = 0;
  // lora.quantize_base = nf4: the largest NF4 weight's dequantized copy, alive while its product runs (bf16, and its
  // fp32 copy where the input is fp32 without autocast); counted in each block's backward.
  int64_t nf4_dequantized_bytes = 0;
  bool packed = false;  // data.dataset = chat: packed records with their attention mask
};

struct ActivationTerm {
  std::string name;
  int64_t bytes = 0;
};

struct ActivationEstimate {
  int64_t peak = 0;                  // bytes over what is resident before the step (model states, data)
  std::string at;                    // the moment of the peak
  std::vector<ActivationTerm> terms; // what is alive then, summing to peak
  int64_t block_saved = 0;           // one block's saved bytes without recompute (the Korthikanti quantity)
  int64_t saved_tensors = 0;         // tensors alive at the peak (CUDA's allocator rounds each)
};

ActivationEstimate transformer_activations(const TransformerShape& shape, const ActivationSettings& settings);

// The fused head's rows per chunk when memory.head = fused leaves them automatic (fused_linear_cross_entropy):
// about 2^24 logits on a CPU, 2^27 in multiples of 64 rows on a GPU.
int64_t fused_head_chunk_rows(int64_t vocab, bool cuda);

// Korthikanti et al. 2022, section 4.1: a transformer layer's stored activations with 16-bit tensors,
// s b h (34 + 5 a s / h) bytes without recompute (10 s b h of them dropout's, masks and outputs), and
// s b h 34 with selective recompute (the attention's s x s tensors recomputed). Split over T tensor-parallel ranks
// (section 4.2.2, eq. 2): s b h (10 + 24 / T + 5 a s / (h T)), the 10 being what lies outside the split regions (the
// layer norms' inputs, the linears' replicated inputs, the dropout masks); with sequence parallelism (section 4.2.3,
// eq. 3) that too is split: s b h / T (34 + 5 a s / h).
double korthikanti_layer_bytes(int64_t s, int64_t b, int64_t h, int64_t a, bool selective, int64_t T = 1,
                               bool sequence_parallel = false);

}  // namespace memtrain
