#include "memtrain/models/nf4.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <cstring>
#include <sstream>

#include "memtrain/core/error.h"
#include "memtrain/core/parallel.h"
#include "memtrain/models/model.h"
#include "memtrain/models/shapes.h"

namespace memtrain {

namespace {

// QLoRA's NF4 levels (the quantiles of N(0, 1) normalised to [-1, 1], exact zero included), to four decimals as
// torchao lists them; cast to the weight's dtype as torchao's torch.tensor(..., dtype=...) does (through float).
constexpr float kLevels[16] = {-1.0000f, -0.6962f, -0.5251f, -0.3949f, -0.2844f, -0.1848f, -0.0911f, 0.0000f,
                               0.0796f,  0.1609f,  0.2461f,  0.3379f,  0.4407f,  0.5626f,  0.7230f,  1.0000f};
// torchao quantizes 2^20 values at a time (its 16 distances per value are the transient).
constexpr int64_t kQuantizeChunk = int64_t{1} << 20;
// The ATen dequantization's values per chunk (its transient: 6 bytes each, 96 MiB).
constexpr int64_t kDequantizeChunk = int64_t{1} << 24;

int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// The per-block absolute maxima of a flat tensor (torchao's get_block_absmax).
torch::Tensor block_absmax(const torch::Tensor& flat, int64_t block) {
  return std::get<0>(flat.view({-1, block}).abs().max(1));
}

// bytes [offset, offset + count * element size) of a flat uint8 tensor, viewed as `dtype`.
torch::Tensor bytes_as(const torch::Tensor& packed, int64_t offset, int64_t count, c10::ScalarType dtype) {
  const int64_t size = c10::elementSize(dtype);
  return packed.narrow(0, offset, count * size).view(dtype);
}

// out (numel,) = level[code] * scale[block], in the dtype: each product of two values of the dtype is exact in float
// and rounded once, as ATen's own multiplication of the two dequantized tensors (torchao's get_original_weight).
template <class T>
void dequantize_loop(const uint8_t* codes, const T* scales, T* out, int64_t numel, int64_t block, const float* levels) {
  const int64_t blocks = numel / block;
  parallel_for(0, blocks, 256, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const float s = static_cast<float>(scales[b]);
      const uint8_t* c = codes + b * block / 2;
      T* o = out + b * block;
      for (int64_t i = 0; i < block / 2; ++i) {
        o[2 * i] = static_cast<T>(levels[c[i] >> 4] * s);
        o[2 * i + 1] = static_cast<T>(levels[c[i] & 15] * s);
      }
    }
  });
}

struct Nf4LinearFunction : public torch::autograd::Function<Nf4LinearFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& packed,
                               std::vector<int64_t> shape, int64_t dtype, int64_t block, int64_t scaler_block,
                               bool double_quant) {
    const Nf4Format f{.shape = shape, .dtype = static_cast<c10::ScalarType>(dtype), .block = block,
                      .scaler_block = scaler_block, .double_quant = double_quant};
    ctx->save_for_backward({packed});
    ctx->saved_data["shape"] = shape;
    ctx->saved_data["dtype"] = dtype;
    ctx->saved_data["block"] = block;
    ctx->saved_data["scaler_block"] = scaler_block;
    ctx->saved_data["double_quant"] = double_quant;
    auto w = nf4_dequantize(packed, f);
    // torchao: F.linear(x, W.to(x.dtype)). Under autocast the matmul casts both to its dtype anyway: W is handed over
    // as it is (its values are the same), without a copy in x's wider dtype.
    const auto dev = x.device().type();
    if (!at::autocast::is_autocast_enabled(dev)) w = w.to(x.scalar_type());
    return at::linear(x, w);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto packed = ctx->get_saved_variables()[0];
    const Nf4Format f{.shape = ctx->saved_data["shape"].toIntVector(),
                      .dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt()),
                      .block = ctx->saved_data["block"].toInt(),
                      .scaler_block = ctx->saved_data["scaler_block"].toInt(),
                      .double_quant = ctx->saved_data["double_quant"].toBool()};
    const auto& g = grad_out[0];
    // torchao: grad_output @ W.to(grad_output.dtype); the weight gets no gradient.
    auto grad_x = torch::matmul(g, nf4_dequantize(packed, f).to(g.scalar_type()));
    return {grad_x, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

std::vector<int64_t> Nf4Format::whole_shape() const { return is_slice() ? whole_sizes(split, shape) : shape; }

int64_t Nf4Format::numel() const {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

int64_t Nf4Format::factors_offset() const {
  return scales_offset() + blocks() * (double_quant ? 1 : static_cast<int64_t>(c10::elementSize(dtype)));
}

int64_t Nf4Format::mean_offset() const { return factors_offset() + groups() * static_cast<int64_t>(c10::elementSize(dtype)); }

int64_t Nf4Format::packed_bytes() const {
  return align16(mean_offset() + (double_quant ? static_cast<int64_t>(c10::elementSize(dtype)) : 0));
}

bool nf4_eligible(int64_t numel, const Nf4Options& o) {
  if (numel <= 0 || o.block <= 0 || o.block % 2 || numel % o.block) return false;
  return !o.double_quant || (o.scaler_block > 0 && (numel / o.block) % o.scaler_block == 0);
}

Nf4Format nf4_format(std::vector<int64_t> shape, c10::ScalarType dtype, const Nf4Options& o) {
  Nf4Format f{.shape = std::move(shape), .dtype = dtype, .block = o.block, .scaler_block = o.scaler_block,
              .double_quant = o.double_quant};
  MEMTRAIN_CHECK(nf4_eligible(f.numel(), o), Error, "[nf4] a weight of ", f.numel(), " values is not whole blocks of ",
                 o.block, o.double_quant ? detail::concat(" in groups of ", o.scaler_block, " blocks") : std::string());
  return f;
}

torch::Tensor nf4_levels(c10::ScalarType dtype, const c10::Device& device) {
  return torch::from_blob(const_cast<float*>(kLevels), {16}, torch::kFloat).to(device, dtype, false, /*copy=*/true);
}

Nf4Parts nf4_quantize(const torch::Tensor& w, const Nf4Options& o, int64_t code_begin, int64_t code_end) {
  MEMTRAIN_CHECK(nf4_eligible(w.numel(), o), Error, "[nf4] a weight of ", w.numel(), " values is not whole blocks of ",
                 o.block);
  torch::NoGradGuard no_grad;
  const auto flat = w.contiguous().view({-1});
  const int64_t numel = flat.numel(), blocks = numel / o.block;
  if (code_end < 0) code_end = numel / 2;
  MEMTRAIN_CHECK(0 <= code_begin && code_begin <= code_end && code_end <= numel / 2, Error, "[nf4] code bytes [",
                 code_begin, ", ", code_end, ") of a weight of ", numel, " values");
  Nf4Parts out;
  const auto absmax = block_absmax(flat, o.block);  // (blocks,) in w's dtype
  if (o.double_quant) {
    // torchao's double_quantize_scalers: the absmaxes less their mean, int8 per group of scaler_block.
    out.mean = absmax.mean();
    const auto centred = absmax - out.mean;
    const int64_t groups = blocks / o.scaler_block;
    const auto group_absmax = block_absmax(centred, o.scaler_block).unsqueeze(-1);  // (groups, 1)
    const auto factor = (group_absmax * 2).reciprocal() * 256;  // Python's 256 / t is t.reciprocal() * 256
    out.scales = (centred.view({groups, o.scaler_block}) * factor).round().clamp(-128, 127).view({-1}).to(torch::kChar);
    out.factors = factor.view({groups}).contiguous();
  } else {
    out.scales = absmax;
  }
  // torchao's convert_to_norm_float_weight: each value over its block's absmax, the nearest level's index (the first
  // of equal distances; a 0/0 of an all-zero block is NaN, whose index is 0, as in torchao).
  // Only the values of code bytes [code_begin, code_end): elements [2 code_begin, 2 code_end), in their blocks.
  const int64_t first = 2 * code_begin, last = 2 * code_end, count = last - first;
  const int64_t block_lo = first / o.block, block_hi = (last + o.block - 1) / o.block;
  const auto scaled = (flat.view({blocks, o.block}).slice(0, block_lo, block_hi) / absmax.slice(0, block_lo, block_hi).unsqueeze(-1))
                          .view({-1})
                          .slice(0, first - block_lo * o.block, last - block_lo * o.block);
  const auto levels = nf4_levels(w.scalar_type(), w.device());
  auto index = torch::empty({count}, flat.options().dtype(torch::kByte));
  for (int64_t s = 0; s < count; s += kQuantizeChunk) {
    const auto e = std::min(count, s + kQuantizeChunk);
    index.slice(0, s, e).copy_(std::get<1>((scaled.slice(0, s, e).unsqueeze(-1) - levels).abs().min(-1)));
  }
  out.codes = index.slice(0, 0, count, 2).bitwise_left_shift(4).bitwise_or_(index.slice(0, 1, count, 2));
  return out;
}

torch::Tensor nf4_pack(const torch::Tensor& w, const Nf4Format& f) { return nf4_pack_range(w, f, 0, f.packed_bytes()); }

// A slice's packed bytes [begin, end) from its whole weight's values `w`: the whole quantized as one process quantizes
// it, the slice's codes (two values a byte) and its blocks' dequantized absmaxes taken from their places in the whole.
torch::Tensor nf4_pack_slice(const torch::Tensor& w, const Nf4Format& f, int64_t begin, int64_t end) {
  const Nf4Format whole{.shape = f.whole_shape(), .dtype = f.dtype, .block = f.block, .scaler_block = f.scaler_block,
                        .double_quant = f.whole_double_quant};
  MEMTRAIN_CHECK(w.numel() == whole.numel() && w.scalar_type() == f.dtype, Error, "[nf4] packing a slice of shape ",
                 c10::IntArrayRef(f.shape), " from a ", w.scalar_type(), " tensor of ", w.numel(), " values; expected its whole ",
                 c10::IntArrayRef(whole.shape), " in ", f.dtype);
  const auto parts = nf4_quantize(w, {.block = f.block, .scaler_block = f.scaler_block, .double_quant = f.whole_double_quant});
  const auto scales = nf4_block_scales(parts, whole);
  auto packed = torch::zeros({f.packed_bytes()}, w.options().dtype(torch::kByte));
  const int64_t n = f.numel();
  packed.narrow(0, 0, n / 2).copy_(slice_of_whole(f.split, f.shape, f.tp_rank, f.tp_size, parts.codes, 0, n, 2));
  bytes_as(packed, f.scales_offset(), f.blocks(), f.dtype)
      .copy_(slice_of_whole(f.split, f.shape, f.tp_rank, f.tp_size, scales, 0, n, f.block));
  return begin == 0 && end == f.packed_bytes() ? packed : packed.slice(0, begin, end).clone();
}

torch::Tensor nf4_pack_range(const torch::Tensor& w, const Nf4Format& f, int64_t begin, int64_t end) {
  MEMTRAIN_CHECK(0 <= begin && begin <= end && end <= f.packed_bytes(), Error, "[nf4] bytes [", begin, ", ", end,
                 ") of a packed weight of ", f.packed_bytes());
  if (f.is_slice()) return nf4_pack_slice(w, f, begin, end);
  MEMTRAIN_CHECK(w.numel() == f.numel() && w.scalar_type() == f.dtype, Error, "[nf4] packing a ", w.scalar_type(),
                 " tensor of ", w.numel(), " values into a ", f.dtype, " format of ", f.numel());
  const int64_t codes = f.numel() / 2;
  const int64_t code_begin = std::min(begin, codes), code_end = std::min(end, codes);
  const auto parts = nf4_quantize(w, {.block = f.block, .scaler_block = f.scaler_block, .double_quant = f.double_quant},
                                  code_begin, code_end);
  auto out = torch::zeros({end - begin}, w.options().dtype(torch::kByte));
  out.slice(0, code_begin - begin, code_end - begin).copy_(parts.codes);
  if (end > codes) {  // the scales, factors and mean: laid out whole (a few percent of the bytes), the range kept
    auto tail = torch::zeros({f.packed_bytes() - codes}, w.options().dtype(torch::kByte));
    if (f.double_quant) {
      tail.narrow(0, 0, f.blocks()).copy_(parts.scales.view(torch::kByte));
      bytes_as(tail, f.factors_offset() - codes, f.groups(), f.dtype).copy_(parts.factors);
      bytes_as(tail, f.mean_offset() - codes, 1, f.dtype).copy_(parts.mean.reshape({1}));
    } else {
      bytes_as(tail, 0, f.blocks(), f.dtype).copy_(parts.scales);
    }
    const int64_t from = std::max(begin, codes);
    out.slice(0, from - begin, end - begin).copy_(tail.slice(0, from - codes, end - codes));
  }
  return out;
}

Nf4Parts nf4_unpack(const torch::Tensor& packed, const Nf4Format& f) {
  MEMTRAIN_CHECK(packed.scalar_type() == torch::kByte && packed.dim() == 1 && packed.numel() == f.packed_bytes(), Error,
                 "[nf4] a packed NF4 weight of shape ", c10::IntArrayRef(f.shape), " is ", f.packed_bytes(),
                 " uint8 values; got ", packed.scalar_type(), " ", packed.sizes());
  Nf4Parts p;
  p.codes = packed.narrow(0, 0, f.numel() / 2);
  if (f.double_quant) {
    p.scales = packed.narrow(0, f.scales_offset(), f.blocks()).view(torch::kChar);
    p.factors = bytes_as(packed, f.factors_offset(), f.groups(), f.dtype);
    p.mean = bytes_as(packed, f.mean_offset(), 1, f.dtype).squeeze(0);  // () (view({}) would pick view(dtype))
  } else {
    p.scales = bytes_as(packed, f.scales_offset(), f.blocks(), f.dtype);
  }
  return p;
}

torch::Tensor nf4_block_scales(const Nf4Parts& p, const Nf4Format& f) {
  if (!f.double_quant) return p.scales;
  // torchao's dequantize_scalers: (int8 / factor) in the dtype, plus the mean.
  return p.scales.view({f.groups(), f.scaler_block}).div(p.factors.unsqueeze(-1)).view({-1}).to(f.dtype).add(p.mean);
}

torch::Tensor nf4_dequantize(const torch::Tensor& packed, const Nf4Format& f) {
  if (!packed.is_cpu()) return nf4_dequantize_ops(packed, f);
  torch::NoGradGuard no_grad;
  const auto parts = nf4_unpack(packed, f);
  const auto scales = nf4_block_scales(parts, f).contiguous();
  auto out = torch::empty(f.shape, packed.options().dtype(f.dtype));
  float levels[16];  // the levels as the dtype rounds them, widened back to float
  const auto rounded = nf4_levels(f.dtype).to(torch::kFloat);
  std::memcpy(levels, rounded.data_ptr<float>(), sizeof(levels));
  const auto codes = parts.codes.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(torch::kBFloat16, torch::kHalf, f.dtype, "nf4_dequantize", [&] {
    dequantize_loop<scalar_t>(codes.data_ptr<uint8_t>(), scales.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), f.numel(),
                              f.block, levels);
  });
  return out;
}

torch::Tensor nf4_dequantize_ops(const torch::Tensor& packed, const Nf4Format& f) {
  torch::NoGradGuard no_grad;
  const auto parts = nf4_unpack(packed, f);
  const auto scales = nf4_block_scales(parts, f);
  // The same products with ATen operations, a chunk of blocks at a time (its int32 indices and gathered levels, 6 bytes
  // per value, bounded by the chunk), into the output.
  auto out = torch::empty({f.blocks(), f.block}, packed.options().dtype(f.dtype));
  const auto levels = nf4_levels(f.dtype, packed.device());
  const int64_t chunk_blocks = std::max<int64_t>(1, kDequantizeChunk / f.block);
  for (int64_t b = 0; b < f.blocks(); b += chunk_blocks) {
    const int64_t e = std::min(f.blocks(), b + chunk_blocks);
    const auto codes = parts.codes.slice(0, b * f.block / 2, e * f.block / 2);
    const auto index = torch::stack({codes.bitwise_right_shift(4), codes.bitwise_and(15)}, 1).view({-1}).to(torch::kInt);
    auto into = out.slice(0, b, e);
    torch::mul_out(into, levels.index_select(0, index).view({e - b, f.block}), scales.slice(0, b, e).unsqueeze(-1));
  }
  return out.view(f.shape);
}

torch::Tensor nf4_linear(const torch::Tensor& x, const torch::Tensor& packed, const Nf4Format& f, const torch::Tensor& bias) {
  auto y = Nf4LinearFunction::apply(x, packed, f.shape, static_cast<int64_t>(f.dtype), f.block, f.scaler_block,
                                    f.double_quant);
  return bias.defined() ? y + bias : y;
}

const Nf4Format* nf4_format_of(const torch::nn::Module& linear) {
  for (const auto& child : linear.named_children())
    if (child.key() == "nf4") return &static_cast<const Nf4Weight&>(*child.value()).format;
  return nullptr;
}

std::vector<std::pair<std::string, Nf4Format>> quantize_frozen_linears(Model& model, const Nf4Options& options,
                                                                       bool quantize_values,
                                                                       std::map<std::string, uint64_t>* digests) {
  std::vector<std::pair<std::string, Nf4Format>> out;
  torch::NoGradGuard no_grad;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto* linear = dynamic_cast<torch::nn::LinearImpl*>(item.value().get());
    if (!linear || nf4_format_of(*linear)) continue;
    const auto& path = item.key();
    if (path.substr(path.rfind('.') + 1) == "lm_head") continue;  // the output head stays (as bitsandbytes leaves it)
    auto& w = linear->weight;
    const auto name = path + ".weight";
    const auto* tp = model.tensor_parallel();
    const auto split = tp && tp->size() > 1 ? model.tensor_split(name) : TensorSplit{};
    const int64_t whole = c10::multiply_integers(whole_sizes(split, w.sizes()));
    if (w.requires_grad() || !nf4_eligible(whole, options)) continue;  // quantized where one process quantizes it
    auto module = std::make_shared<Nf4Weight>();
    if (split.split()) {
      MEMTRAIN_CHECK(!quantize_values, Error, "[nf4] ", name, " is a tensor-parallel slice: it is quantized by the fill, "
                     "from its whole weight's values");
      const int64_t runs = whole_run_granularity(split, w.sizes(), tp->size());
      MEMTRAIN_CHECK(runs % options.block == 0, ConfigError, "[config] lora.quantize_base = nf4 with dist.tensor_parallel = ",
                     tp->size(), ": ", name, " (", whole, " values) is quantized in blocks of ", options.block,
                     " values (lora.quantize_block), but its slices are cut in runs of ", runs, " values of the whole, so a "
                     "slice's blocks would not be the whole weight's; set lora.quantize_block to an even divisor of ", runs,
                     " or a smaller dist.tensor_parallel");
      module->format = nf4_format(w.sizes().vec(), torch::kBFloat16, nf4_slice_options(options));
      module->format.split = split, module->format.tp_rank = tp->rank(), module->format.tp_size = tp->size();
      module->format.whole_double_quant = options.double_quant;
    } else {
      module->format = nf4_format(w.sizes().vec(), torch::kBFloat16, options);
    }
    const auto& f = module->format;
    if (quantize_values) {
      const auto values = w.detach().to(torch::kBFloat16).contiguous();
      if (digests) (*digests)[path + ".weight"] = nf4_digest(values);
      w.set_data(nf4_pack(values, f));
    }
    else
      w.set_data(has_no_memory(w) ? shapes_only_tensor({f.packed_bytes()}, {.shapes_only = true, .dtype = torch::kByte, .device = w.device()})
                                  : torch::zeros({f.packed_bytes()}, w.options().dtype(torch::kByte)));
    linear->register_module("nf4", module);
    out.emplace_back(name, f);
  }
  return out;
}

std::map<std::string, Nf4Format> nf4_weights(Model& model) {
  std::map<std::string, Nf4Format> out;
  for (const auto& item : model.named_modules("", /*include_self=*/false))
    if (const auto* f = nf4_format_of(*item.value())) out.emplace(item.key() + ".weight", *f);
  return out;
}

uint64_t nf4_digest(const torch::Tensor& values) {
  const auto bytes = values.to(torch::kCPU).contiguous().view({-1}).view(torch::kByte);
  const auto* p = bytes.data_ptr<uint8_t>();
  const int64_t n = bytes.numel();
  uint64_t h = 1469598103934665603ULL;  // FNV-1a's offset basis, over 8-byte words (then the tail's bytes)
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t word;
    std::memcpy(&word, p + i, 8);
    h = (h ^ word) * 1099511628211ULL;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h >> 1;
}

std::string nf4_base_record(const std::map<std::string, uint64_t>& digests, int64_t block, bool double_quant,
                            const std::string& source) {
  uint64_t h = 1469598103934665603ULL;
  for (const auto& [name, d] : digests) h = (h ^ d) * 1099511628211ULL;
  std::ostringstream o;
  o << "nf4 block " << block << (double_quant ? " double_quant" : "") << ", " << digests.size() << " weights, digest "
    << std::hex << h << std::dec << " (from " << source << ")";
  return o.str();
}

bool nf4_same_base(const std::string& a, const std::string& b) { return a.substr(0, a.find(" (from")) == b.substr(0, b.find(" (from")); }

}  // namespace memtrain
