#include "memtrain/runtime/step_time.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <numeric>

#include "memtrain/core/config.h"
#include "memtrain/core/error.h"
#include "memtrain/runtime/factories.h"
#include "memtrain/runtime/planner.h"

namespace memtrain {

namespace {

// Seconds of the fastest of `repeats` calls of f, after one to warm the kernels, the caches and the pages.
template <class F>
double fastest_seconds(F&& f, int repeats) {
  f();
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// A GPU target's published figures (SXM parts, NVIDIA's data sheets; the same peaks as device.cpp's MFU table).
struct GpuFigures {
  const char* prefix;
  double half_tflops, fp32_tflops;  // dense, tensor cores for 16 bits, no TF32 for fp32 (PyTorch's default)
  double memory_tb_s;               // HBM
  double nvlink_gb_s;               // NVLink per direction
  double network_gb_s;              // one NIC per GPU (InfiniBand NDR 400 Gb/s on H100/H200 nodes, HDR 200 on A100)
};
constexpr GpuFigures kGpus[] = {
    {"a100-40gb", 312, 19.5, 1.555, 300, 25},
    {"a100-80gb", 312, 19.5, 2.039, 300, 25},
    {"h100-80gb", 989, 67, 3.35, 450, 50},
    {"h200-141gb", 989, 67, 4.8, 450, 50},
};

// Collectives reach about this share of a link's bandwidth as bus bandwidth (nccl-tests' busbw against the
// link's rate on large messages): an assumption, stated in docs/ESTIMATE.md.
constexpr double kBusShare = 0.8;
// memtrain's own MFU on an H200, GPT-2 124M in bf16 (docs/gpu_check/2026-12-04): the share of the peak a step's
// matmuls reach, taken for every GPU target until more is measured.
constexpr double kAchievedGpu = 0.305;
// Kernels launched per block per micro-batch (forward about 20, backward about twice that) at ~4 us each: the
// per-micro-batch cost that makes small micro-batches slower on a GPU. An assumption.
constexpr double kKernelsPerBlock = 60, kKernelSeconds = 4e-6;
// The optimizer's update reads parameter, gradient and two moments and writes three of them: 28 bytes per fp32
// element, about 32 with the masters' copy back (GPU targets, HBM bound).
constexpr double kOptimizerBytesPerElement = 32;
// cpu: matmuls over this many FLOPs are timed on a slice of their rows.
constexpr double kTimedFlops = 2e9;
// A GPU target's host, offloaded: its fused AdamW per element (a server's cores; this machine's would understate it).
constexpr double kHostUpdateNs = 1.0;

// The matmuls of one block, per token: (in, out) of each linear map.
std::vector<std::pair<int64_t, int64_t>> block_linears(const TransformerShape& m) {
  const int64_t C = m.hidden;
  if (m.family == TransformerShape::Family::kGpt) return {{C, 3 * C}, {C, C}, {C, m.ffn}, {m.ffn, C}};
  const int64_t q = m.heads * m.head_dim(), kv = m.kv_heads * m.head_dim();
  return {{C, q}, {C, kv}, {C, kv}, {q, C}, {C, m.ffn}, {C, m.ffn}, {m.ffn, C}};
}

}  // namespace

double TargetSpeed::matmul_seconds(int64_t m, int64_t k, int64_t n) const {
  if (!timed) return 2.0 * static_cast<double>(m) * static_cast<double>(k) * static_cast<double>(n) / (matmul_flops * achieved);
  const auto key = std::make_tuple(m, k, n);
  if (auto it = matmul_s.find(key); it != matmul_s.end()) return it->second;
  torch::NoGradGuard no_grad;
  // A large product is timed on a slice of its rows and scaled: its rate no longer changes with them, and a
  // plan for a model the size of GPT-2's head is timed in a second, not minutes.
  const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(k) * static_cast<double>(n);
  const int64_t rows = flops > kTimedFlops ? std::max<int64_t>(64, static_cast<int64_t>(m * kTimedFlops / flops)) : m;
  const auto o = torch::TensorOptions().dtype(half ? torch::kBFloat16 : torch::kFloat);
  const auto a = torch::randn({rows, k}, o), b = torch::randn({k, n}, o);
  auto c = torch::empty({rows, n}, o);
  const double s = fastest_seconds([&] { at::mm_out(c, a, b); }, 3) * static_cast<double>(m) / static_cast<double>(rows);
  matmul_s[key] = s;
  return s;
}

std::pair<double, double> TargetSpeed::attention_seconds(int64_t batch, int64_t heads, int64_t tokens, int64_t head_dim) const {
  if (!timed) {
    // Causal: half of the 4 T^2 d multiply-adds' FLOPs of scores and output; a flash backward does 2.5x.
    const double fwd = 2.0 * static_cast<double>(batch * heads) * static_cast<double>(tokens) * static_cast<double>(tokens) *
                       static_cast<double>(head_dim) / (matmul_flops * achieved);
    return {fwd, 2.5 * fwd};
  }
  const auto key = std::make_tuple(batch, heads, tokens, head_dim);
  if (auto it = attention_s.find(key); it != attention_s.end()) return it->second;
  // One sequence's heads, scaled by the batch: sequences are independent, and the rate no longer changes with them.
  const auto o = torch::TensorOptions().dtype(half ? torch::kBFloat16 : torch::kFloat);
  auto q = torch::randn({1, heads, tokens, head_dim}, o).requires_grad_();
  auto k = torch::randn({1, heads, tokens, head_dim}, o).requires_grad_();
  auto v = torch::randn({1, heads, tokens, head_dim}, o).requires_grad_();
  torch::Tensor y;
  const double fwd = fastest_seconds(
      [&] {
        torch::NoGradGuard no_grad;
        y = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
      },
      3);
  const double both = fastest_seconds(
      [&] {
        y = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
        y.backward(torch::ones_like(y));
      },
      3);
  const double b = static_cast<double>(batch);
  attention_s[key] = {b * fwd, b * std::max(0.0, both - fwd)};
  return attention_s[key];
}

StepSettings step_settings(const Config& config, int world, int nproc_per_node) {
  StepSettings s;
  s.shape = config_transformer_shape(config);
  s.micro_batch = config.train.micro_batch, s.accum_steps = config.train.accum_steps;
  s.recompute_fraction = recompute_fraction(config.memory.recompute);
  s.stage = static_cast<int>(config.dist.zero_stage);
  s.offload = config.dist.offload_optimizer == "cpu";
  const bool bf16_params = config.train.param_dtype == "bf16";
  s.half_matmuls = bf16_params || config.train.precision != "fp32";
  s.lora = config.lora.rank > 0;
  s.world = world, s.nproc_per_node = std::min(nproc_per_node, world);
  s.tensor_parallel = static_cast<int>(config.dist.tensor_parallel);
  s.activation_bytes = s.half_matmuls ? 2 : 4;
  const auto in = model_state_inputs(config, world);
  s.trained_elements = std::accumulate(in.block_elements.begin(), in.block_elements.end(), in.root_elements);
  s.parameter_elements = s.trained_elements + in.frozen_elements;
  s.param_bytes = in.param_bytes;
  s.grad_bytes = in.master_weights ? 4 : in.param_bytes;  // bf16 parameters reduce into fp32 masters' gradients
  s.reduce_every_micro_batch = reduces_each_micro_batch(s.stage, in.reduce_every_micro_batch);
  return s;
}

TargetSpeed target_speed(const Target& target, bool half_matmuls) {
  TargetSpeed t;
  t.half = half_matmuls;
  if (!target.cuda) {
    // A cpu: target is this machine's kind: its own cores, timed at the step's shapes.
    t.timed = true;
    t.optimizer_ns_per_element = time_cpu_update();
    t.intra_node_bytes_per_s = t.inter_node_bytes_per_s = 5e9;  // Gloo over loopback: an assumption
    t.source = "cpu: matmuls, attention and the optimizer timed on this machine at the step's shapes";
    return t;
  }
  const GpuFigures* g = nullptr;
  for (const auto& x : kGpus)
    if (target.name == x.prefix) g = &x;
  // A byte count names no GPU: taken as an H100's speeds.
  if (g == nullptr) g = &kGpus[2];
  t.matmul_flops = (half_matmuls ? g->half_tflops : g->fp32_tflops) * 1e12;
  t.achieved = kAchievedGpu;
  t.memory_bytes_per_s = g->memory_tb_s * 1e12;
  t.intra_node_bytes_per_s = kBusShare * g->nvlink_gb_s * 1e9;
  t.inter_node_bytes_per_s = kBusShare * g->network_gb_s * 1e9;
  t.kernel_overhead_s = kKernelSeconds;
  t.source = std::string(g->prefix) + ": " + std::to_string(static_cast<int>(half_matmuls ? g->half_tflops : g->fp32_tflops)) +
             " TFLOP/s dense at 30.5% (memtrain's MFU measured on an H200), NVLink and the network at 80% as bus "
             "bandwidth, kernels at 4 us";
  return t;
}

StepTime predict_step(const StepSettings& s, const TargetSpeed& speed) {
  StepTime t;
  const auto& m = s.shape;
  const int64_t tokens = s.micro_batch * m.context;
  const double layers = static_cast<double>(m.layers);
  // 1. One micro-batch's block: its matmuls (forward; backward: the input's gradient, and the weight's unless frozen)
  //    and its attention.
  double block_fwd = 0, block_bwd = 0;
  for (const auto& [in, out] : block_linears(m)) {
    block_fwd += speed.matmul_seconds(tokens, in, out);
    block_bwd += speed.matmul_seconds(tokens, out, in);              // dX = dY W
    if (!s.lora) block_bwd += speed.matmul_seconds(out, tokens, in);  // dW = dY^T X
  }
  const auto [attn_fwd, attn_bwd] = speed.attention_seconds(s.micro_batch, m.heads, m.context, m.head_dim());
  block_fwd += attn_fwd, block_bwd += attn_bwd;
  // 2. The head (logits, their input's gradient, and the embedding's gradient unless frozen).
  double head = speed.matmul_seconds(tokens, m.hidden, m.vocab) + speed.matmul_seconds(tokens, m.vocab, m.hidden);
  if (!s.lora) head += speed.matmul_seconds(m.vocab, tokens, m.hidden);
  const double micro = layers * (block_fwd + block_bwd) + head;
  const double accum = static_cast<double>(s.accum_steps);
  t.recompute_s = accum * layers * block_fwd * s.recompute_fraction;
  t.compute_s = accum * micro + t.recompute_s;
  t.overhead_s = accum * layers * kKernelsPerBlock * speed.kernel_overhead_s;
  // 3. Communication: ring collectives move (N - 1) / N of the bytes per rank, at the slowest link's bus bandwidth.
  //    ZeRO's over the data-parallel ranks (every T-th), which span nodes when the world does.
  const int data = s.world / std::max(1, s.tensor_parallel);
  if (data > 1) {
    const double share = static_cast<double>(data - 1) / data;
    const double link = s.world > s.nproc_per_node ? speed.inter_node_bytes_per_s : speed.intra_node_bytes_per_s;
    const double grads = static_cast<double>(s.trained_elements * s.grad_bytes);
    const double params = static_cast<double>(s.parameter_elements * s.param_bytes);
    const double reductions = s.reduce_every_micro_batch ? accum : 1;
    double overlapped = 0, after = 0;  // with the backward (and stage 3's forward), and after the step
    if (s.stage <= 1) overlapped = reductions * 2 * share * grads / link;  // all-reduce = reduce-scatter + all-gather
    else overlapped = reductions * share * grads / link;                    // reduce-scatter
    if (s.stage == 1 || s.stage == 2) after = share * params / link;        // the stepped parameters gathered back
    double window = accum * layers * block_bwd;
    if (s.stage == 3) {
      overlapped += accum * 2 * share * params / link;  // each unit gathered for forward and again for backward
      window += accum * layers * block_fwd;
    }
    t.communication_s = overlapped + after;
    t.exposed_s = std::max(0.0, overlapped - window) + after;
  }
  //    Tensor parallel, within a node, in units of one all-gather (or reduce-scatter) of the micro-batch's tokens x
  //    hidden: an all-reduce is two. A block's forward runs 2 all-reduces (sequence parallel: 2 all-gathers and 2
  //    reduce-scatters), 4 units; its backward 4; a recomputed forward 4 again; the embedding and the head 4 in all.
  if (const int T = s.tensor_parallel; T > 1) {
    const double bytes = static_cast<double>(tokens * m.hidden * s.activation_bytes);
    const double unit = static_cast<double>(T - 1) / T * bytes / speed.intra_node_bytes_per_s;
    t.tensor_parallel_s = accum * (layers * (8 + 4 * s.recompute_fraction) + 4) * unit;
    t.communication_s += t.tensor_parallel_s;
    t.exposed_s += t.tensor_parallel_s;
  }
  // 4. The optimizer on this rank's part (or the host's, offloaded).
  const double part = static_cast<double>(s.trained_elements) / (s.stage >= 1 ? data : 1);
  if (s.offload) {
    t.offload_s = offload_step_ms(static_cast<int64_t>(part), s.grad_bytes, s.param_bytes,
                                  speed.timed ? speed.optimizer_ns_per_element : kHostUpdateNs) / 1e3;
  } else {
    t.optimizer_s = speed.timed ? part * speed.optimizer_ns_per_element * 1e-9
                                : part * kOptimizerBytesPerElement / speed.memory_bytes_per_s;
  }
  t.total_s = t.compute_s + t.overhead_s + t.exposed_s + t.optimizer_s + t.offload_s;
  t.tokens_per_s = static_cast<double>(s.tokens_per_step()) / t.total_s;
  return t;
}

}  // namespace memtrain
