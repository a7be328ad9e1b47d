// AdamW whose two moments are stored blockwise-quantized in 8 or 4 bits (Dettmers et al. 2022, "8-bit
// Optimizers via Block-wise Quantization"; Li et al. 2023, "Memory Efficient Optimizers with 4-bit
// States"), with the arithmetic of torchao's AdamW8bit / AdamW4bit:
//
//   * a tensor's elements are cut into blocks of `block` values; each block keeps one fp32 absmax (clipped
//     at 1e-12) and one code per value, the index of the nearest entry of a quantization map of the value
//     divided by the absmax (ties round up). 8-bit: a byte per value; 4-bit: two values per byte, the first
//     in the high nibble;
//   * maps: exp_avg the signed dynamic map, exp_avg_sq the unsigned dynamic map (8-bit) or the linear map
//     without zero, 1/16 .. 1 (4-bit);
//   * a tensor is quantized when its whole parameter has at least `min_quantized` elements and a multiple
//     of `block`; the others keep fp32 moments;
//   * one step, per block in one pass: dequantize both moments, p -= lr wd p, m = lerp(m, g, 1 - beta1),
//     v = lerp(v, g^2, 1 - beta2), p -= lr (m / bc1) / (sqrt(v) / sqrt(bc2) + eps) with the fp32 moments,
//     then requantize them. Bias corrections and lr in fp32, as torchao computes them.
//
// CPU fp32 tensors take a fused loop (core/parallel.h over blocks); other devices and dtypes take the same
// arithmetic as ATen ops.
//
//   auto opt = make_optimizer({.kind = OptimizerOptions::Kind::kAdamW8bit, .lr = 3e-4}, model->named_parameters());
#pragma once

#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include "memtrain/optim/optimizer.h"

#include <array>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace memtrain {

namespace detail {
struct LowBitEncoders;  // the CPU loop's code tables (lowbit_adamw.cpp)
}

struct LowBitOptions {
  int bits = 8;                  // 8 | 4
  int64_t block = 256;           // values per absmax (8-bit: 256, 4-bit: 128 by default); even
  int64_t min_quantized = 4096;  // smaller parameters keep fp32 moments
  bool fused_cpu = true;         // false: ATen ops on the CPU too (tests compare the two)
};

// Whether a parameter of `numel` elements gets quantized moments, and the bytes per element they take (two
// moments' codes and absmaxes: 2 (bits / 8 + 4 / block)).
bool quantizes(const LowBitOptions& options, int64_t numel);
double quantized_bytes_per_element(const LowBitOptions& options);

// The dynamic quantization map of bitsandbytes / torchao (`create_dynamic_map`): 2^total_bits sorted fp32
// values in [-1, 1] (signed) or [0, 1], spaced by decades of max_exponent_bits exponents.
torch::Tensor dynamic_quantization_map(bool is_signed, int max_exponent_bits, int total_bits);
// The map of one moment at `bits`: exp_avg (second = false) or exp_avg_sq (second = true).
torch::Tensor moment_map(int bits, bool second);

// x (fp32, numel a multiple of block) -> codes (uint8: numel values, or numel / 2 bytes at 4 bits) and one
// absmax per block ((numel / block,) fp32). Any device, ATen ops.
std::pair<torch::Tensor, torch::Tensor> quantize_blockwise(const torch::Tensor& x, const torch::Tensor& map, int64_t block,
                                                           int bits);
// The fp32 values (flat) the codes and absmaxes stand for.
torch::Tensor dequantize_blockwise(const torch::Tensor& codes, const torch::Tensor& absmax, const torch::Tensor& map,
                                   int64_t block, int bits);

// One stepped tensor's state. Quantized: the four code/absmax tensors; otherwise the fp32 moments.
struct LowBitAdamWParamState : torch::optim::OptimizerCloneableParamState<LowBitAdamWParamState> {
  int64_t step = 0;
  torch::Tensor exp_avg, exp_avg_sq;
  torch::Tensor exp_avg_codes, exp_avg_absmax, exp_avg_sq_codes, exp_avg_sq_absmax;
  bool quantized() const { return exp_avg_codes.defined(); }
};

// Missing state is allocated for every parameter before any is updated.
class LowBitAdamW : public PartialStepOptimizer {
 public:
  LowBitAdamW(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::AdamWOptions defaults,
              LowBitOptions lowbit);

  // A stepped tensor that is part of a larger parameter (a ZeRO segment) is quantized as that parameter
  // would be; its part must then hold whole blocks. By default a tensor is its own parameter.
  void set_whole_numel(const torch::Tensor& stepped, int64_t numel);
  bool quantizes(int64_t whole_numel) const { return memtrain::quantizes(lowbit_, whole_numel); }
  const LowBitOptions& lowbit() const { return lowbit_; }

 private:
  void update(const std::set<const void*>* only) override;
  LowBitOptions lowbit_;
  std::array<torch::Tensor, 2> maps_;                          // exp_avg's, exp_avg_sq's (CPU fp32)
  std::map<std::string, std::array<torch::Tensor, 2>> device_maps_;  // the same on other devices, moved once
  std::map<const void*, int64_t> whole_numel_;
  std::shared_ptr<const detail::LowBitEncoders> encoders_;  // made at the first CPU step
};

}  // namespace memtrain
