#include "memtrain/core/activation_model.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace memtrain {

int64_t fused_head_chunk_rows(int64_t vocab, bool cuda) {
  if (vocab <= 0) return 1;
  const int64_t rows = (cuda ? int64_t{1} << 27 : int64_t{1} << 24) / vocab;
  return cuda ? std::max<int64_t>(64, rows / 64 * 64) : std::max<int64_t>(1, rows);
}

double korthikanti_layer_bytes(int64_t s, int64_t b, int64_t h, int64_t a, bool selective, int64_t T, bool sequence_parallel) {
  const double sbh = static_cast<double>(s) * static_cast<double>(b) * static_cast<double>(h), t = static_cast<double>(T);
  const double scores = selective ? 0 : 5 * static_cast<double>(a) * static_cast<double>(s) / static_cast<double>(h);
  if (sequence_parallel) return sbh * (34 + scores) / t;
  return sbh * (10 + 24 / t + scores / t);
}

namespace {

struct Linear {
  const char* name;
  int64_t in, out;
  bool mlp;  // in the block's MLP part (else its attention part)
};

// A block's linear maps, by the names LoRA's targets use.
std::vector<Linear> block_linears(const TransformerShape& m) {
  const int64_t h = m.hidden, k = m.kv_heads * m.head_dim(), F = m.ffn;
  if (m.family == TransformerShape::Family::kGpt)
    return {{"c_attn", h, 3 * h, false}, {"c_proj", h, h, false}, {"c_fc", h, F, true}, {"c_proj", F, h, true}};
  return {{"q_proj", h, h, false},    {"k_proj", h, k, false},  {"v_proj", h, k, false},   {"o_proj", h, h, false},
          {"gate_proj", h, F, true}, {"up_proj", h, F, true}, {"down_proj", F, h, true}};
}

}  // namespace

TransformerShape split_transformer(TransformerShape shape, int64_t T, bool sequence) {
  if (T <= 1) return shape;
  shape.heads /= T, shape.kv_heads /= T, shape.ffn /= T;
  shape.vocab = (shape.vocab + T - 1) / T;
  shape.split = T;
  shape.sequence_split = sequence;
  return shape;
}

bool LoraShape::adapts(const std::string& name) const {
  return rank > 0 && std::find(targets.begin(), targets.end(), name) != targets.end();
}

std::vector<int64_t> LoraShape::block_tensors(const TransformerShape& shape) const {
  std::vector<int64_t> out;
  for (const auto& l : block_linears(shape))
    if (adapts(l.name)) out.insert(out.end(), {rank * l.in, l.out * rank});
  return out;
}

int64_t LoraShape::block_elements(const TransformerShape& shape) const {
  const auto tensors = block_tensors(shape);
  return std::accumulate(tensors.begin(), tensors.end(), int64_t{0});
}

namespace {

// Bytes per token that one block part keeps for its backward, and the weight copies autocast caches for it
// (independent of the batch), split as the recompute policies split a block.
struct Part {
  int64_t per_token = 0;
  int64_t weights = 0;   // autocast's cached 16-bit copies of the part's weights, kept until its backward
  int64_t tensors = 0;   // how many tensors (for CUDA's per-allocation rounding)
};

struct BlockModel {
  Part attn, mlp;
  int64_t input = 0;       // a checkpointed part keeps only its input (the residual stream), per token
  int64_t grad_mlp = 0;    // the backward's working set at the MLP's output projection, per token
  int64_t grad_attn = 0;   // ... at the attention's
};

BlockModel block_model(const TransformerShape& m, const ActivationSettings& s) {
  const int64_t h = m.hidden, a = m.heads, k = m.kv_heads * m.head_dim(), F = m.ffn, ctx = m.context;
  // Tensor parallel: q and the attention output are this rank's heads (qh wide); what lies between the split regions
  // is per token of this rank's share (1 / sp of them with sequence parallelism).
  const int64_t qh = a * m.head_dim(), sp = m.sequence_split ? m.split : 1;
  const int64_t r = s.half_params ? 2 : 4;                      // the residual stream's bytes
  const int64_t e = s.half_params || s.autocast ? 2 : 4;        // the matmuls' activations
  const int64_t w = s.autocast && !s.half_params ? 2 : 0;       // autocast's weight copies
  const int64_t cast = e == 2 && r == 4 ? 2 * h / sp : 0;       // a 16-bit copy of the residual branch's gradient
  // SDPA: the flash / memory-efficient kernels keep q, k, v, the output and a fp32 logsumexp per head. With
  // dropout on a CPU, PyTorch takes the math path instead: softmax, its noise and the dropped scores (s per head
  // each), and no logsumexp.
  const bool math_attention = m.dropout > 0 && !s.cuda;
  const int64_t scores = math_attention ? 3 * a * ctx * e : 4 * a;
  // Dropout (p > 0): the kept noise on a CPU (a tensor of the input's dtype), a 1-byte mask on CUDA.
  const int64_t drop = m.dropout > 0 ? (s.cuda ? h : e * h) / sp : 0;
  BlockModel b;
  b.input = r * h / sp;
  // LoRA: a frozen linear keeps no input (codegen saves a matmul's input only for its weight's gradient), a frozen
  // RMSNorm weight no normalised value; each adapter keeps A x (rank values, saved by B) and, with dropout, the
  // noise and the dropped input; under autocast it keeps its own 16-bit cast of the input, and its weights' casts.
  const auto& lora = s.lora;
  const bool frozen = lora.rank > 0;
  auto kept_input = [&](std::initializer_list<const char*> names) {
    if (!frozen) return true;
    for (const char* n : names)
      if (lora.adapts(n)) return true;
    return false;
  };
  const int64_t xb = s.half_params ? 2 : 4;  // a norm output's dtype before autocast's cast
  int64_t adapters[2] = {0, 0}, adapter_weights[2] = {0, 0};
  for (const auto& l : block_linears(m)) {
    if (!lora.adapts(l.name)) continue;
    const bool after_norm = l.in == h && std::string(l.name) != "c_proj" && std::string(l.name) != "o_proj";
    int64_t bytes = lora.rank * e;
    if (lora.dropout > 0) bytes += (s.cuda ? 1 : (after_norm ? xb : e)) * l.in + (after_norm ? xb : e) * l.in;
    adapters[l.mlp] += bytes;
    adapter_weights[l.mlp] += w * lora.rank * (l.in + l.out);
  }
  if (m.family == TransformerShape::Family::kGpt) {
    const int64_t stats = s.half_params ? 4 : 8;                // LayerNorm's mean and rstd
    // attn: x (LayerNorm's input), its stats, its output (c_attn's input, or autocast's cast of it), q k v,
    // the attention output (c_proj's input), the logsumexp; mlp: h1, stats, c_fc's input, c_fc's output (GELU's
    // input), GELU's output (c_proj's input).
    const int64_t ln1_out = kept_input({"c_attn"}) ? e * h : 0, ln2_out = kept_input({"c_fc"}) ? e * h : 0;
    const int64_t gelu_out = kept_input({"c_proj"}) ? e * F : 0;
    const int64_t norm = (r * h + stats) / sp;
    b.attn = {norm + ln1_out + 3 * e * qh + e * qh + scores + drop + adapters[0], w * 4 * h * qh + adapter_weights[0], 7};
    b.mlp = {norm + ln2_out + e * F + gelu_out + drop + adapters[1], w * 2 * h * F + adapter_weights[1], 6};
    // The output projection's input gradient, and GELU's beside it; when that input was kept (saved for the
    // weight's gradient) it is freed as GELU's gradient is made, else both are new.
    b.grad_mlp = e * F + cast + (gelu_out == 0 ? e * F : 0);
    b.grad_attn = 3 * e * qh + cast;
  } else {
    // RMSNorm in fp32: its fp32 input (the residual itself when it is fp32, else an upcast copy; on CUDA ATen's fused
    // rms_norm keeps the residual as it is), rsqrt, the normalised value (saved by the weight's product, in the
    // parameters' dtype); then the projections' input (autocast casts it once per projection).
    const int64_t norm = ((s.cuda ? r : 4) * h + 4 + (frozen ? 0 : r * h)) / sp;
    // The projections' input: autocast casts it once per projection that keeps it, else one tensor kept by any.
    auto projections_in = [&](std::initializer_list<const char*> names) {
      int64_t keeping = 0;
      for (const char* n : names) keeping += !frozen || lora.adapts(n) ? 1 : 0;
      return w > 0 ? keeping * 2 * h : (keeping > 0 ? e * h : 0);
    };
    const int64_t attn_in = projections_in({"q_proj", "k_proj", "v_proj"}), mlp_in = projections_in({"gate_proj", "up_proj"});
    const int64_t product = kept_input({"down_proj"}) ? e * F : 0;
    // q and k after rotary, v (SDPA's), the attention output (o_proj's input), the logsumexp; gate (SiLU's
    // input), SiLU's output, up, their product (down's input).
    b.attn = {norm + attn_in + e * qh + 2 * e * k + e * qh + scores + adapters[0],
              w * (2 * h * qh + 2 * h * k) + adapter_weights[0], w > 0 ? 10 : 8};
    b.mlp = {norm + mlp_in + 3 * e * F + product + adapters[1], w * 3 * h * F + adapter_weights[1], w > 0 ? 9 : 8};
    b.grad_mlp = 2 * e * F + cast + (product == 0 ? e * F : 0);  // as GPT's: the product's gradient beside its operands'
    b.grad_attn = e * qh + 2 * e * k + cast;
  }
  return b;
}

}  // namespace

ActivationEstimate transformer_activations(const TransformerShape& m, const ActivationSettings& s) {
  ActivationEstimate out;
  const int64_t t = s.micro_batch * m.context, h = m.hidden, V = m.vocab, L = m.layers;
  const int64_t r = s.half_params ? 2 : 4, e = s.half_params || s.autocast ? 2 : 4;
  const int64_t pb = s.half_params ? 2 : 4;                 // a gradient's bytes (the parameters' dtype)
  // A kept gradient's bytes: bf16 parameters move each gradient into its fp32 master's as it completes, unless the
  // masters step bucket by bucket from the bf16 gradients.
  const int64_t gb = s.half_params && !s.masters_by_bucket ? 4 : pb;
  const int64_t w = s.autocast && !s.half_params ? 2 : 0;
  const auto b = block_model(m, s);
  out.block_saved = (b.attn.per_token + b.mlp.per_token) * t;

  // Before the first block: the batch (input and target, int64), GPT's positions, Llama's rotary tables (fp32
  // cos and sin, and their 16-bit copies).
  int64_t base = 16 * t;
  // Packed records (data.dataset = chat): their positions and documents (int64), the boolean attention mask
  // (B, 1, T, T), and with Llama each block's rotary rows gathered by position (cos and sin, B x T x hd, at most fp32),
  // which the rotation's product keeps for backward (counted for every block: an upper bound under recompute).
  if (s.packed) base += 16 * t + s.micro_batch * m.context * m.context +
                        (m.family == TransformerShape::Family::kGpt ? 0 : L * 2 * 4 * t * m.head_dim());
  if (m.family == TransformerShape::Family::kGpt) {
    base += 8 * m.context;
    if (m.dropout > 0) base += (s.cuda ? 1 : r) * h * t;     // the embedding's dropout
  } else {
    base += 2 * m.context * m.head_dim() * (4 + (e == 2 ? 2 : 0));
  }

  // What each block keeps through the forward, by policy.
  const bool part = s.policy.mode == RecomputePolicy::Mode::kPart;
  const bool attn_ck = part && s.policy.part == "attn", mlp_ck = part && s.policy.part == "mlp";
  const int64_t offloaded_input = s.policy.offload && s.cuda ? 0 : b.input * t;  // memory.offload: in host memory
  std::vector<int64_t> kept(static_cast<size_t>(L)), kept_tensors(static_cast<size_t>(L));
  for (int64_t i = 0; i < L; ++i) {
    const bool whole = !part && s.policy.checkpoints_block(i);
    int64_t bytes = 0, tensors = 0;
    if (whole) {
      bytes = offloaded_input, tensors = 1;
    } else {
      bytes += attn_ck ? offloaded_input : b.attn.per_token * t + b.attn.weights;
      bytes += mlp_ck ? offloaded_input : b.mlp.per_token * t + b.mlp.weights;
      tensors = (attn_ck ? 1 : b.attn.tensors) + (mlp_ck ? 1 : b.mlp.tensors);
    }
    kept[static_cast<size_t>(i)] = bytes, kept_tensors[static_cast<size_t>(i)] = tensors;
  }
  const int64_t all_kept = std::accumulate(kept.begin(), kept.end(), int64_t{0});
  const int64_t all_tensors = std::accumulate(kept_tensors.begin(), kept_tensors.end(), int64_t{0});

  // The head's features: the final norm's saved tensors and the head's input.
  // With LoRA the head is frozen: its matmul keeps no input, the final RMSNorm no normalised value.
  const bool frozen = s.lora.rank > 0;
  const int64_t head_in = frozen ? 0 : e * h;
  int64_t features = 0;
  const int64_t sp = m.sequence_split ? m.split : 1;  // the final norm runs on this rank's tokens; the head's input is whole
  if (m.family == TransformerShape::Family::kGpt) features = (r * h + (s.half_params ? 4 : 8)) / sp + head_in;
  else features = (4 * h + 4 + (frozen ? 0 : r * h)) / sp + head_in;
  features *= t;
  // ... without the head's input, which the fused head does not keep.
  const int64_t features_fused = features - head_in * t + (s.half_params ? 2 : 4) * h * t;  // the norm's output, alive in its forward
  const int64_t features_saved = features - head_in * t;
  const int64_t x_bytes = s.half_params ? 2 : 4;  // the fused head's input dtype (the final norm's output)

  int64_t best = -1;
  auto candidate = [&](const std::string& at, std::vector<ActivationTerm> terms, int64_t tensors) {
    int64_t sum = 0;
    for (const auto& term : terms) sum += term.bytes;
    if (sum <= best) return;
    best = sum;
    out.peak = sum, out.at = at, out.saved_tensors = tensors;
    terms.erase(std::remove_if(terms.begin(), terms.end(), [](const ActivationTerm& x) { return x.bytes == 0; }), terms.end());
    out.terms = std::move(terms);
  };
  const ActivationTerm batch{"batch and positions", base};
  const ActivationTerm blocks{"blocks' saved tensors", all_kept};

  if (s.head_rows < 0 && m.split > 1) {
    // The vocabulary-parallel cross-entropy's forward (this rank's V / T columns): the logits, their fp32 copy (16-bit
    // logits) and the exponentials, which become the softmax kept for backward, where the gradient is formed in place.
    candidate("the vocabulary-parallel cross-entropy's forward",
              {batch, blocks, {"head input and final norm", features},
               {"logits slice: its fp32 exponentials (and fp32 copy)", (e == 2 ? 10 : 8) * V * t},
               {"autocast's head weight copy", w * V * h}},
              all_tensors + 6);
  } else if (s.head_rows < 0) {
    // The backward's start: log-softmax's fp32 result, the loss gradient's dense fp32 (tokens x vocab) and the
    // log-softmax backward's output; autocast's copy of the head weight.
    candidate("the backward's start (the loss over the logits)",
              {batch, blocks, {"head input and final norm", features}, {"logits: log-softmax, its gradients (fp32)", 12 * V * t},
               {"autocast's head weight copy", w * V * h}},
              all_tensors + 6);
  } else {
    const int64_t n = std::min(t, s.head_rows > 0 ? s.head_rows : fused_head_chunk_rows(V, s.cuda));
    // logits in fp32 and the log-softmax's output of the same size (a 16-bit matmul output is freed at the cast, before)
    const int64_t chunk = 8 * n * V;
    const int64_t head_weight_grad = frozen ? 0 : 1;  // a frozen head's weight gets no gradient (no accumulator)
    candidate("the fused head's forward (one chunk of logits)",
              {batch, blocks, {"final norm and its output", features_fused},
               {"fused head: gradient accumulators (fp32)", 4 * h * t + head_weight_grad * 4 * V * h},
               {"fused head: weight in the compute dtype", w * V * h}, {"fused head: a chunk's logits (fp32)", chunk}},
              all_tensors + 8);
    candidate("the fused head's backward",
              {batch, blocks, {"final norm", features_saved},
               {"fused head: saved gradients and their products", 2 * (x_bytes * h * t + head_weight_grad * pb * V * h)}},
              all_tensors + 6);
  }

  // Each block's backward, from the last: the blocks below keep their saved tensors, this one's are whole
  // (recomputed when checkpointed), the gradients born so far (one process) are there, and the residual's
  // gradient, the recomputed output and the backward's working set.
  const int64_t head_grads = s.keep_grads && !frozen
                                 ? gb * (m.root_parameters - (m.family == TransformerShape::Family::kGpt
                                                                  ? m.positions * h : (m.tied ? 0 : V * h)))
                                 : 0;  // the embeddings' gradients are born last; LoRA trains no root parameter
  const int64_t block_trained = frozen ? s.lora.block_elements(m) : m.block_parameters;
  int64_t below = all_kept, below_tensors = all_tensors;
  for (int64_t i = L - 1; i >= 0; --i) {
    below -= kept[static_cast<size_t>(i)], below_tensors -= kept_tensors[static_cast<size_t>(i)];
    const bool whole = !part && s.policy.checkpoints_block(i);
    const int64_t grads = s.keep_grads ? head_grads + gb * (L - i) * block_trained : 0;
    // ZeRO 2-3: the reduced parts of the blocks above, whose buckets were reduced (this block's is in flight).
    const auto reduced = static_cast<int64_t>(std::llround(s.reduced_bytes_per_element * static_cast<double>((L - 1 - i) * block_trained)));
    const int64_t attn_held = attn_ck ? b.input * t : b.attn.per_token * t + b.attn.weights;
    const std::string name = "block " + std::to_string(i) + "'s backward" + (whole || part ? " (recomputed)" : "");
    candidate(name + ", at its MLP",
              {batch, {"blocks below: saved tensors", below},
               {"this block: saved tensors", attn_held + b.mlp.per_token * t + b.mlp.weights},
               {"gradients born so far", grads}, {"reduced gradient parts (ZeRO 2-3)", reduced},
               {"residual gradient, recomputed output, MLP backward", 2 * r * h * t + b.grad_mlp * t},
               {"an NF4 weight dequantized for its product", s.nf4_dequantized_bytes}},
              below_tensors + b.attn.tensors + b.mlp.tensors + 4);
    candidate(name + ", at its attention",
              {batch, {"blocks below: saved tensors", below},
               {"this block: attention's saved tensors", b.attn.per_token * t + b.attn.weights},
               {"gradients born so far", grads}, {"reduced gradient parts (ZeRO 2-3)", reduced},
               {"residual gradient, recomputed output, attention backward", 2 * r * h * t + b.grad_attn * t},
               {"an NF4 weight dequantized for its product", s.nf4_dequantized_bytes}},
              below_tensors + b.attn.tensors + 4);
  }

  if (!s.keep_grads && !frozen) {
    // Several ranks (the gradients leave for their buckets as each completes): the backward's end is the embedding's.
    // Every block's reduced part is there (ZeRO 2-3), the embedding's dense gradient is born, and a tied head's
    // gradient waits for it to be summed out of place (a third V x h tensor): measured on qwen2.5-0.5b (151,936 x 896,
    // fp32) at ZeRO-3 on 2 ranks, 1,029 MiB over the estimate that left this moment out, two such tensors. An untied
    // head's gradient went to its bucket when it completed.
    const auto reduced = static_cast<int64_t>(std::llround(s.reduced_bytes_per_element * static_cast<double>(L * block_trained)));
    candidate("the backward's end (the embedding's gradient)",
              {batch, {"reduced gradient parts (ZeRO 2-3)", reduced}, {"embedding's dense gradient", pb * V * h},
               {"a tied head's gradient and the two's sum", m.tied ? 2 * pb * V * h : 0},
               {"embedding output's gradient", r * h * t}},
              6);
  }

  if (s.keep_grads) {
    // The backward's end: every gradient (fp32 with masters, each moved as it completed; bf16 when the masters step
    // by bucket), the embedding's dense gradient, the embedding output's gradient. A tied head's gradient and the
    // embedding's are summed out of place (the sum is a third V x h tensor while both exist: measured on a GPT with a
    // vocabulary of 20,000 at micro-batch 1, where this moment is the step's peak). With accumulation the sum is added
    // into the held gradient, so the head's own gradient is a fourth (the same GPT at micro-batch 1 x 2: 27.9 MiB
    // measured, one V x h over the single micro-batch's 23.0).
    const int64_t P = L * block_trained + (frozen ? 0 : m.root_parameters);
    const bool tied_sum = !frozen && m.tied;
    candidate("the backward's end (every gradient born)",
              {batch, {"gradients", gb * P}, {"embedding's dense gradient", frozen ? 0 : pb * V * h},
               {"the tied weight's two gradients' sum", tied_sum ? pb * V * h : 0},
               {"a later micro-batch: the tied head's own gradient beside the held one",
                tied_sum && s.accumulates ? pb * V * h : 0},
               {"embedding output's gradient", frozen ? 0 : r * h * t}},
              2 * 12 * L);
    // The step by bucket: the bf16 gradients not yet stepped and one bucket's fp32 gradients (or one tensor's).
    const int64_t largest = frozen ? s.lora.rank * std::max(m.hidden, m.ffn) : m.largest_parameter;
    if (s.half_params && s.masters_by_bucket)
      candidate("the masters' step, bucket by bucket",
                {batch, {"bf16 gradients", pb * P}, {"one bucket's fp32 gradients", 4 * (std::min(P, s.bucket_elements) + largest)}},
                12 * L);
  }
  return out;
}

}  // namespace memtrain
