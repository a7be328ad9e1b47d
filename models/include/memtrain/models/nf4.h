// 4-bit NormalFloat (NF4) weights, as QLoRA defines them (Dettmers et al. 2023) and torchao's NF4Tensor computes
// them (torchao 0.18, quantization/quantize_/workflows/nf4): each block of `block` (64) consecutive values of the
// flattened weight is scaled by its absolute maximum into [-1, 1] and each value replaced by the index of the nearest
// of the 16 NF4 levels (two indices per byte, the first value in the high nibble). With double quantization the
// blocks' absmaxes are quantized too: their mean is subtracted, and each group of `scaler_block` (256) of them is
// scaled by 256 / (2 max|.|) and rounded to int8. Everything is computed in the weight's own dtype (bf16), with the
// same ATen operations in the same order as torchao, so the codes, scales and dequantized values are its bytes.
//
// A quantized frozen Linear keeps its `weight` parameter, but as the bytes of one flat uint8 tensor (codes, int8
// scales, per-group factors, the mean; Nf4Format::packed_bytes), so that every path that moves parameters (ZeRO-3's
// frozen buckets, gathers, the tracker) moves 0.5 byte per weight plus the scales; its format rides on the module
// as a child named "nf4". detail::linear (lora.h) dequantizes it block by block in the compute dtype inside the
// forward and again in the backward (for the input's gradient; the weight gets none).
//
//   auto fmt = nf4_format({4096, 4096}, torch::kBFloat16, {});
//   auto packed = nf4_pack(w.to(torch::kBFloat16), fmt);        // (fmt.packed_bytes(),) uint8
//   auto back = nf4_dequantize(packed, fmt);                     // (4096, 4096) bf16
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "memtrain/models/tensor_parallel.h"

namespace memtrain {

class Model;

struct Nf4Options {
  int64_t block = 64;          // values per absmax (lora.quantize_block)
  int64_t scaler_block = 256;  // absmaxes per int8 group (double quantization)
  bool double_quant = true;    // lora.double_quant: absmaxes in int8 + a factor per group + the mean
};

// How a tensor-parallel slice of a weight quantized whole with `whole` is stored (Nf4Format::split): the whole's blocks,
// each block's absmax kept dequantized (no double quantization of its own).
inline Nf4Options nf4_slice_options(const Nf4Options& whole) {
  return {.block = whole.block, .scaler_block = whole.scaler_block, .double_quant = false};
}

// How one weight is stored: its logical shape and dtype (the dequantized values'), and the byte layout of its
// packed tensor: [codes: numel / 2][scales: blocks x (1 byte, or the dtype's size without double quantization)]
// [factors: groups x dtype][mean: dtype], padded to a multiple of 16 bytes.
struct Nf4Format {
  std::vector<int64_t> shape;
  c10::ScalarType dtype = torch::kBFloat16;
  int64_t block = 64;
  int64_t scaler_block = 256;
  bool double_quant = true;
  // A tensor-parallel slice (split.split()): `shape` is rank tp_rank's slice (of tp_size) of a weight quantized whole,
  // with double quantization where whole_double_quant. The slice keeps its values' codes, and each of its blocks' absmax
  // as the whole's quantization dequantizes it, in the dtype (double_quant is false: the slice's blocks are not whole
  // groups of the whole's absmaxes, and its values are the whole's to the bit). nf4_pack(_range) take the whole values.
  TensorSplit split;
  int tp_rank = 0, tp_size = 1;
  bool whole_double_quant = false;

  bool is_slice() const { return split.split(); }
  std::vector<int64_t> whole_shape() const;  // the weight's values whole (a slice's whole weight; else shape)
  int64_t numel() const;
  int64_t blocks() const { return numel() / block; }
  int64_t groups() const { return double_quant ? blocks() / scaler_block : 0; }
  int64_t scales_offset() const { return numel() / 2; }
  int64_t factors_offset() const;
  int64_t mean_offset() const;
  int64_t packed_bytes() const;
};

// Whether a weight of `numel` values can be stored in NF4 with these options: whole blocks (and, with double
// quantization, whole groups of absmaxes), as torchao requires; smaller or odd tensors stay as they are.
bool nf4_eligible(int64_t numel, const Nf4Options& options);
Nf4Format nf4_format(std::vector<int64_t> shape, c10::ScalarType dtype, const Nf4Options& options);

// The 16 levels (QLoRA's Appendix E values as torchao lists them), in `dtype`.
torch::Tensor nf4_levels(c10::ScalarType dtype, const c10::Device& device = torch::kCPU);

// The parts of a quantized weight, each a tensor (views into a packed tensor after nf4_unpack).
struct Nf4Parts {
  torch::Tensor codes;    // (numel / 2,) uint8: two 4-bit level indices per byte
  torch::Tensor scales;   // (blocks,) int8 with double quantization; else the absmaxes in the dtype
  torch::Tensor factors;  // (groups,) dtype: 256 / (2 max|absmax - mean|) per group; undefined without
  torch::Tensor mean;     // () dtype: the absmaxes' mean; undefined without
};

// `w` (contiguous, in its dtype, numel eligible) quantized as torchao's to_nf4(w, block, scaler_block). The codes of
// bytes [code_begin, code_end) only (end -1: all): every absmax needs the whole weight, each code its own values only.
Nf4Parts nf4_quantize(const torch::Tensor& w, const Nf4Options& options, int64_t code_begin = 0, int64_t code_end = -1);
// One flat uint8 tensor holding the parts in the format's layout (on w's device). A slice's format: w is the whole
// weight's values (whole_shape()), quantized whole; the slice's codes and block absmaxes are kept.
torch::Tensor nf4_pack(const torch::Tensor& w, const Nf4Format& format);
// Bytes [begin, end) of nf4_pack(w, format), quantizing only the codes among them (a ZeRO-3 rank's part).
torch::Tensor nf4_pack_range(const torch::Tensor& w, const Nf4Format& format, int64_t begin, int64_t end);
// Views of `packed`'s parts (no copy).
Nf4Parts nf4_unpack(const torch::Tensor& packed, const Nf4Format& format);
// The per-block absmaxes as dequantization sees them: int8 / factor + mean in the dtype (torchao's
// dequantize_scalers), or the stored absmaxes.
torch::Tensor nf4_block_scales(const Nf4Parts& parts, const Nf4Format& format);
// The weight back, (shape) in the format's dtype: on a CPU one threaded pass; elsewhere nf4_dequantize_ops.
torch::Tensor nf4_dequantize(const torch::Tensor& packed, const Nf4Format& format);
// The same values from ATen operations on any device (the CUDA path), 2^24 values at a time.
torch::Tensor nf4_dequantize_ops(const torch::Tensor& packed, const Nf4Format& format);

// x W^T (+ bias) with W stored in NF4 (`packed`): W is dequantized in forward and again in backward; the input
// gets its gradient, `packed` none (the bias its own if it trains). As torchao's linear_nf4: W in the input's dtype.
torch::Tensor nf4_linear(const torch::Tensor& x, const torch::Tensor& packed, const Nf4Format& format,
                         const torch::Tensor& bias = {});

// The module a quantized Linear carries as its child "nf4".
struct Nf4Weight : torch::nn::Module {
  Nf4Format format;
};
// The format of a Linear's weight if it is stored in NF4.
const Nf4Format* nf4_format_of(const torch::nn::Module& linear);

// Every frozen torch::nn::Linear weight of `model` inside its blocks (not the output head; embeddings and norms are
// not Linear) whose size is eligible becomes NF4 (a split model: whose whole size is, as a slice format; a ConfigError
// when a slice's runs in the whole are not whole blocks): its `weight` turns into a packed uint8 tensor. With
// `quantize_values`, from its current values (a model built whole); otherwise the packed tensor is given the same
// kind of storage the weight had (none, for a model built from shapes: the trainer fills it, nf4_pack per weight).
// Returns each quantized weight's name and format, in the model's order.
// `digests` (with quantize_values): each quantized weight's nf4_digest of its bf16 values.
std::vector<std::pair<std::string, Nf4Format>> quantize_frozen_linears(Model& model, const Nf4Options& options,
                                                                       bool quantize_values,
                                                                       std::map<std::string, uint64_t>* digests = nullptr);
// name -> format of every NF4 weight of `model` (empty when none).
std::map<std::string, Nf4Format> nf4_weights(Model& model);

// A 63-bit digest of a tensor's bytes (FNV-1a over 8-byte words, the top bit cleared: ranks agree on them by a signed
// maximum): of an NF4 weight's bf16 values, which decide its packed bytes.
uint64_t nf4_digest(const torch::Tensor& values);
// The checkpoint's record of an NF4 base: its settings, where its values came from, and one digest over every
// weight's (by name). Two runs on the same base in the same format have the same record.
std::string nf4_base_record(const std::map<std::string, uint64_t>& digests, int64_t block, bool double_quant,
                            const std::string& source);
// Whether two records describe the same base (settings and digest; the source named may have moved).
bool nf4_same_base(const std::string& a, const std::string& b);

}  // namespace memtrain
