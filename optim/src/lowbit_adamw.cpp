#include "memtrain/optim/lowbit_adamw.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#include "memtrain/core/error.h"
#include "memtrain/core/parallel.h"

namespace memtrain {

bool quantizes(const LowBitOptions& o, int64_t numel) { return numel >= o.min_quantized && numel % o.block == 0; }

double quantized_bytes_per_element(const LowBitOptions& o) {
  return 2.0 * (o.bits / 8.0 + 4.0 / static_cast<double>(o.block));
}

torch::Tensor dynamic_quantization_map(bool is_signed, int max_exponent_bits, int total_bits) {
  // bitsandbytes' create_dynamic_map as torchao keeps it (no zero padding): for each exponent i, the means of
  // neighbouring points of linspace(0.1, 1, k) in fp32, times 10^(i - (E - 1)) (and negated when signed);
  // then 0 and 1. The fp32 ATen ops give the reference's bits.
  const int non_sign_bits = total_bits - 1;  // torchao's: signed or not
  std::vector<torch::Tensor> parts;
  auto means = [](int64_t k) {
    auto b = torch::linspace(0.1, 1, k);
    return (b.slice(0, 0, -1) + b.slice(0, 1)) / 2.0;
  };
  for (int i = 0; i < max_exponent_bits; ++i) {
    const int64_t k = is_signed ? (int64_t{1} << (i + non_sign_bits - max_exponent_bits)) + 1
                                : (int64_t{1} << (i + non_sign_bits - max_exponent_bits + 1)) + 1;
    const double decade = std::pow(10.0, -(max_exponent_bits - 1) + i);
    parts.push_back(means(k) * decade);
    if (is_signed) parts.push_back(means(k) * -decade);
  }
  const int64_t extra = (int64_t{1} << (non_sign_bits - max_exponent_bits)) - 1;
  if (extra > 0) {
    const double decade = std::pow(10.0, -(max_exponent_bits - 1) + max_exponent_bits - 1);
    parts.push_back(means(extra + 1) * decade);
    if (is_signed) parts.push_back(means(extra + 1) * -decade);
  }
  parts.push_back(torch::tensor({0.0f, 1.0f}));
  auto map = std::get<0>(torch::cat(parts).sort());
  MEMTRAIN_CHECK(map.numel() == (int64_t{1} << total_bits), Error, "[optim] a dynamic map of ", total_bits, " bits with ",
                 max_exponent_bits, " exponent bits has ", map.numel(), " values");
  return map;
}

torch::Tensor moment_map(int bits, bool second) {
  MEMTRAIN_CHECK(bits == 8 || bits == 4, Error, "[optim] low-bit state has 8 or 4 bits, not ", bits);
  if (bits == 8) return dynamic_quantization_map(/*is_signed=*/!second, 7, 8);
  if (!second) return dynamic_quantization_map(true, 3, 4);
  return torch::linspace(0, 1, 17).slice(0, 1);  // linear, without zero (Li et al. 2023)
}

std::pair<torch::Tensor, torch::Tensor> quantize_blockwise(const torch::Tensor& x, const torch::Tensor& map, int64_t block,
                                                           int bits) {
  MEMTRAIN_CHECK(x.numel() % block == 0, Error, "[optim] ", x.numel(), " values do not make whole blocks of ", block);
  auto rows = x.reshape({-1, block}).to(torch::kFloat);
  auto absmax = rows.abs().amax(-1).clamp_min(1e-12);
  auto y = (rows / absmax.unsqueeze(1)).reshape({-1});
  // The largest code whose value is <= y (0 if none), by a branchless binary search, then one up when y is
  // at least half-way to the next value.
  const int64_t n = map.numel();
  auto codes = torch::zeros(y.sizes(), y.options().dtype(torch::kInt));
  for (int64_t step = n / 2; step > 0; step /= 2) codes.add_((y >= map.index_select(0, codes + step)).to(torch::kInt), step);
  auto up = (codes + 1).clamp_max(n - 1);
  auto lo = map.index_select(0, codes), hi = map.index_select(0, up);
  codes = torch::where((y - lo) >= (hi - lo) * 0.5, up, codes).to(torch::kUInt8);
  if (bits == 4) codes = torch::bitwise_or(torch::bitwise_left_shift(codes.slice(0, 0, c10::nullopt, 2), 4), codes.slice(0, 1, c10::nullopt, 2));
  return {codes, absmax};
}

torch::Tensor dequantize_blockwise(const torch::Tensor& codes, const torch::Tensor& absmax, const torch::Tensor& map,
                                   int64_t block, int bits) {
  auto flat = codes.reshape({-1});
  if (bits == 4) flat = torch::stack({torch::bitwise_right_shift(flat, 4), torch::bitwise_and(flat, 15)}, -1).reshape({-1});
  return (map.take(flat.to(torch::kLong)).view({-1, block}) * absmax.unsqueeze(1)).reshape({-1});
}

namespace detail {

// The largest index whose value is <= y (0 if none, or y is NaN): quantize_blockwise's branchless search.
inline int search(float y, const float* map, int n) {
  int c = 0;
  for (int step = n >> 1; step > 0; step >>= 1) c += y >= map[c + step] ? step : 0;
  return c;
}

inline uint32_t prefix(float y) {
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof bits);
  return bits >> 16;  // sign, exponent and 7 mantissa bits
}

// The code of y (the search and the rounding quantize_blockwise does with tensors), through a table over the
// 16-bit prefix of y's float: every y with that prefix has its search result in [first, last], so a step or
// two from `first` finds it, where the binary search takes 8 dependent loads.
class Encoder {
 public:
  Encoder(const torch::Tensor& map) : n_(static_cast<int>(map.numel())), values_(map.data_ptr<float>(), map.data_ptr<float>() + map.numel()) {
    range_.resize(65536);
    for (uint32_t p = 0; p < 65536; ++p) {
      float lo, hi;
      const uint32_t a = p << 16, b = (p << 16) | 0xffffu;
      std::memcpy(&lo, &a, sizeof lo);
      std::memcpy(&hi, &b, sizeof hi);
      // search is monotone in y; the prefixes of infinity and NaN hold +-inf (search: the ends) and NaNs (0, set below).
      const bool special = ((p >> 7) & 0xff) == 0xff;
      const int x = search(lo, values_.data(), n_), y = special ? x : search(hi, values_.data(), n_);
      range_[p] = static_cast<uint16_t>(std::min(x, y) | std::max(x, y) << 8);
      width_ = std::max(width_, std::abs(y - x));
    }
  }
  uint8_t operator()(float y) const {
    const uint32_t p = prefix(y);
    const float* map = values_.data();
    const uint16_t range = range_[p];
    int c = range & 0xff;
    const int end = range >> 8;
    for (int step = 0; step < width_; ++step) c += (c < end) & (map[std::min(c + 1, n_ - 1)] <= y);  // no data-dependent branch
    c = y == y ? c : 0;  // NaN: the search's 0
    const int up = c + 1 < n_ ? c + 1 : n_ - 1;
    const float lo = map[c];
    return static_cast<uint8_t>(y - lo >= (map[up] - lo) * 0.5f ? up : c);
  }

 private:
  int n_;
  std::vector<float> values_;
  std::vector<uint16_t> range_;  // per prefix: the first candidate | the last << 8
  int width_ = 0;                // the most candidates past the first of any prefix (1 for the maps used here)
};

struct LowBitEncoders {
  Encoder m, v;  // exp_avg's, exp_avg_sq's
};

}  // namespace detail

namespace {

// The per-step numbers, as torchao makes them: fp32 0-dim tensors (lr, the step count), so every product and
// power rounds as theirs.
struct Scalars {
  float lr = 0, lr_wd = 0, w1 = 0, w2 = 0, bc1 = 1, bc2_sqrt = 1, eps = 0;
};

Scalars scalars(const torch::optim::AdamWOptions& o, int64_t step) {
  const auto lr = torch::tensor(static_cast<float>(o.lr()));
  const auto count = torch::tensor(static_cast<float>(step));
  const auto& [beta1, beta2] = o.betas();
  Scalars s;
  s.lr = lr.item<float>();
  s.lr_wd = (lr * o.weight_decay()).item<float>();
  s.w1 = static_cast<float>(1 - beta1);
  s.w2 = static_cast<float>(1 - beta2);
  s.bc1 = (1 - torch::pow(beta1, count)).item<float>();
  s.bc2_sqrt = (1 - torch::pow(beta2, count)).sqrt().item<float>();
  s.eps = static_cast<float>(o.eps());
  return s;
}

// ATen's CPU lerp: start + w (end - start) for |w| < 0.5, else end - (1 - w)(end - start), one fused multiply-add.
[[gnu::always_inline]] inline float lerp(float start, float end, float w) {
  return std::abs(w) < 0.5f ? std::fma(w, end - start, start) : std::fma(w - 1.0f, end - start, end);
}

// One element's update: p, m, v in place.
[[gnu::always_inline]] inline void adamw(float& p, float g, float& m, float& v, const Scalars& k) {
  p = p - k.lr_wd * p;
  m = lerp(m, g, k.w1);
  v = lerp(v, g * g, k.w2);
  const float denom = std::sqrt(v) / k.bc2_sqrt + k.eps;
  p = p - k.lr * (m / k.bc1) / denom;
}

// The update of n elements in place (p, m, v): a loop the compiler vectorizes. Two builds of it, one for CPUs
// with AVX2 and FMA (8 lanes; ATen's lerp is itself a fused multiply-add, so FMA is needed for its bits), one for
// any x86-64; this file is compiled with -ffp-contract=off, so no other product and sum are fused.
[[gnu::always_inline]] inline void update_span(float* __restrict p, const float* __restrict g, float* __restrict m,
                                               float* __restrict v, int64_t n, const Scalars& k) {
  for (int64_t i = 0; i < n; ++i) adamw(p[i], g[i], m[i], v[i], k);
}
#if defined(__x86_64__)
[[gnu::target("avx2,fma")]] void update_span_avx2(float* p, const float* g, float* m, float* v, int64_t n, const Scalars& k) {
  update_span(p, g, m, v, n, k);
}
#endif
void update_span_any(float* p, const float* g, float* m, float* v, int64_t n, const Scalars& k) { update_span(p, g, m, v, n, k); }

void update(float* p, const float* g, float* m, float* v, int64_t n, const Scalars& k) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) return update_span_avx2(p, g, m, v, n, k);
#endif
  update_span_any(p, g, m, v, n, k);
}

// CPU, fp32 parameter and gradient: one pass per block (decode, update, re-encode).
void step_cpu(const torch::Tensor& param, const torch::Tensor& grad, LowBitAdamWParamState& s, const Scalars& k,
              const std::array<torch::Tensor, 2>& maps, const detail::LowBitEncoders& encoders, const LowBitOptions& o) {
  float* p = param.data_ptr<float>();
  const auto g_contig = grad.contiguous();
  const float* g = g_contig.data_ptr<float>();
  const int64_t n = param.numel();
  if (!s.quantized()) {
    float* m = s.exp_avg.data_ptr<float>();
    float* v = s.exp_avg_sq.data_ptr<float>();
    parallel_for(0, n, 16384, [&](int64_t lo, int64_t hi) { update(p + lo, g + lo, m + lo, v + lo, hi - lo, k); });
    return;
  }
  const int64_t B = o.block;
  const int bits = o.bits;
  const auto& encode_m = encoders.m;
  const auto& encode_v = encoders.v;
  const float* map_m = maps[0].data_ptr<float>();
  const float* map_v = maps[1].data_ptr<float>();
  uint8_t* mc = s.exp_avg_codes.data_ptr<uint8_t>();
  uint8_t* vc = s.exp_avg_sq_codes.data_ptr<uint8_t>();
  float* ma = s.exp_avg_absmax.data_ptr<float>();
  float* va = s.exp_avg_sq_absmax.data_ptr<float>();
  parallel_for(0, n / B, std::max<int64_t>(1, 16384 / B), [&](int64_t first, int64_t last) {
    std::vector<float> m(static_cast<size_t>(B)), v(static_cast<size_t>(B));
    for (int64_t b = first; b < last; ++b) {
      const int64_t base = b * B;
      const float am = ma[b], av = va[b];
      if (bits == 8) {
        for (int64_t i = 0; i < B; ++i) m[i] = map_m[mc[base + i]] * am, v[i] = map_v[vc[base + i]] * av;
      } else {
        for (int64_t i = 0; i < B; i += 2) {
          const uint8_t cm = mc[(base + i) / 2], cv = vc[(base + i) / 2];
          m[i] = map_m[cm >> 4] * am, m[i + 1] = map_m[cm & 15] * am;
          v[i] = map_v[cv >> 4] * av, v[i + 1] = map_v[cv & 15] * av;
        }
      }
      update(p + base, g + base, m.data(), v.data(), B, k);
      float top_m = 0, top_v = 0;
      for (int64_t i = 0; i < B; ++i) {
        top_m = std::max(top_m, std::abs(m[i]));  // NaN never wins: a non-finite step is skipped before this
        top_v = std::max(top_v, std::abs(v[i]));
      }
      top_m = std::max(top_m, 1e-12f), top_v = std::max(top_v, 1e-12f);
      ma[b] = top_m, va[b] = top_v;
      if (bits == 8) {
        for (int64_t i = 0; i < B; ++i) mc[base + i] = encode_m(m[i] / top_m), vc[base + i] = encode_v(v[i] / top_v);
      } else {
        for (int64_t i = 0; i < B; i += 2) {
          mc[(base + i) / 2] = static_cast<uint8_t>(encode_m(m[i] / top_m) << 4 | encode_m(m[i + 1] / top_m));
          vc[(base + i) / 2] = static_cast<uint8_t>(encode_v(v[i] / top_v) << 4 | encode_v(v[i + 1] / top_v));
        }
      }
    }
  });
}

// Any device and dtype: the same arithmetic as ATen ops, on one chunk of whole blocks.
void step_aten_chunk(const torch::Tensor& param, const torch::Tensor& grad, LowBitAdamWParamState& s, const Scalars& k,
               const std::array<torch::Tensor, 2>& maps, const LowBitOptions& o, double beta1, double beta2) {
  auto p = param.reshape({-1}).to(torch::kFloat);
  const auto g = grad.reshape({-1}).to(torch::kFloat);
  p = p - static_cast<double>(k.lr_wd) * p;
  const auto m_old = s.quantized() ? dequantize_blockwise(s.exp_avg_codes, s.exp_avg_absmax, maps[0], o.block, o.bits) : s.exp_avg;
  const auto v_old = s.quantized() ? dequantize_blockwise(s.exp_avg_sq_codes, s.exp_avg_sq_absmax, maps[1], o.block, o.bits)
                                   : s.exp_avg_sq;
  const auto m = m_old.lerp(g, 1 - beta1), v = v_old.lerp(g.square(), 1 - beta2);
  if (s.quantized()) {
    auto [mc, ma] = quantize_blockwise(m, maps[0], o.block, o.bits);
    auto [vc, va] = quantize_blockwise(v, maps[1], o.block, o.bits);
    s.exp_avg_codes.copy_(mc.view_as(s.exp_avg_codes)), s.exp_avg_absmax.copy_(ma);
    s.exp_avg_sq_codes.copy_(vc.view_as(s.exp_avg_sq_codes)), s.exp_avg_sq_absmax.copy_(va);
  } else {
    s.exp_avg.copy_(m), s.exp_avg_sq.copy_(v);
  }
  const auto denom = v.sqrt() / static_cast<double>(k.bc2_sqrt) + static_cast<double>(k.eps);
  p = p - static_cast<double>(k.lr) * (m / static_cast<double>(k.bc1)) / denom;
  param.copy_(p);
}

// The same over the tensor in chunks of whole blocks (about 1M elements): the ATen ops' temporaries (~60 bytes an
// element) stay a few dozen MB whatever the tensor's size.
void step_aten(const torch::Tensor& param, const torch::Tensor& grad, LowBitAdamWParamState& s, const Scalars& k,
               const std::array<torch::Tensor, 2>& maps, const LowBitOptions& o, double beta1, double beta2) {
  const int64_t n = param.numel();
  const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 20) / o.block) * o.block;
  const auto work = param.is_contiguous() ? param : param.contiguous();
  auto flat_param = work.view({-1});
  const auto flat_grad = grad.reshape({-1});
  const int64_t per_code = o.bits == 8 ? 1 : 2;
  for (int64_t begin = 0; begin < n; begin += chunk) {
    const int64_t end = std::min(n, begin + chunk);
    LowBitAdamWParamState part;  // views of this chunk's state
    if (s.quantized()) {
      part.exp_avg_codes = s.exp_avg_codes.narrow(0, begin / per_code, (end - begin) / per_code);
      part.exp_avg_sq_codes = s.exp_avg_sq_codes.narrow(0, begin / per_code, (end - begin) / per_code);
      part.exp_avg_absmax = s.exp_avg_absmax.narrow(0, begin / o.block, (end - begin) / o.block);
      part.exp_avg_sq_absmax = s.exp_avg_sq_absmax.narrow(0, begin / o.block, (end - begin) / o.block);
    } else {
      part.exp_avg = s.exp_avg.narrow(0, begin, end - begin);
      part.exp_avg_sq = s.exp_avg_sq.narrow(0, begin, end - begin);
    }
    auto slice = flat_param.narrow(0, begin, end - begin);
    step_aten_chunk(slice, flat_grad.narrow(0, begin, end - begin), part, k, maps, o, beta1, beta2);
  }
  if (!work.is_same(param)) param.copy_(work);
}

}  // namespace

LowBitAdamW::LowBitAdamW(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::AdamWOptions defaults,
                         LowBitOptions lowbit)
    : PartialStepOptimizer(std::move(groups), std::make_unique<torch::optim::AdamWOptions>(defaults)), lowbit_(lowbit) {
  MEMTRAIN_CHECK(!defaults.amsgrad(), Error, "[optim] low-bit AdamW does not implement amsgrad");
  MEMTRAIN_CHECK(lowbit_.bits == 8 || lowbit_.bits == 4, Error, "[optim] low-bit state has 8 or 4 bits, not ", lowbit_.bits);
  MEMTRAIN_CHECK(lowbit_.block >= 2 && lowbit_.block % 2 == 0, Error, "[optim] the quantization block must be an even number of values >= 2, not ",
                 lowbit_.block);
  maps_ = {moment_map(lowbit_.bits, false), moment_map(lowbit_.bits, true)};
}


void LowBitAdamW::set_whole_numel(const torch::Tensor& stepped, int64_t numel) { whole_numel_[stepped.unsafeGetTensorImpl()] = numel; }

void LowBitAdamW::update(const std::set<const void*>* only) {
  struct Item {
    torch::Tensor param;
    LowBitAdamWParamState* state;
    const torch::optim::AdamWOptions* options;
  };
  std::vector<Item> items;
  // 1. Missing state first: an allocation that fails leaves nothing updated.
  for (auto& group : param_groups_) {
    const auto* options = &static_cast<const torch::optim::AdamWOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined() || (only && !only->count(p.unsafeGetTensorImpl()))) continue;
      auto key = p.unsafeGetTensorImpl();
      auto it = state_.find(key);
      if (it == state_.end()) {
        auto s = std::make_unique<LowBitAdamWParamState>();
        auto whole = whole_numel_.find(key);
        if (quantizes(whole == whole_numel_.end() ? p.numel() : whole->second)) {
          MEMTRAIN_CHECK(p.numel() % lowbit_.block == 0, Error, "[optim] a part of ", p.numel(),
                         " elements of a quantized parameter does not hold whole blocks of ", lowbit_.block);
          const auto bytes = torch::TensorOptions().dtype(torch::kUInt8).device(p.device());
          const auto fp32 = torch::TensorOptions().dtype(torch::kFloat).device(p.device());
          const int64_t codes = lowbit_.bits == 8 ? p.numel() : p.numel() / 2;
          s->exp_avg_codes = torch::zeros({codes}, bytes);
          s->exp_avg_sq_codes = torch::zeros({codes}, bytes);
          s->exp_avg_absmax = torch::zeros({p.numel() / lowbit_.block}, fp32);
          s->exp_avg_sq_absmax = torch::zeros({p.numel() / lowbit_.block}, fp32);
        } else {
          s->exp_avg = torch::zeros({p.numel()}, p.options().dtype(torch::kFloat));
          s->exp_avg_sq = torch::zeros({p.numel()}, p.options().dtype(torch::kFloat));
        }
        it = state_.emplace(key, std::move(s)).first;
      }
      items.push_back({p, static_cast<LowBitAdamWParamState*>(it->second.get()), options});
    }
  }
  // 2. The update, tensor by tensor (bias corrections once per options and step count).
  std::map<std::pair<const void*, int64_t>, Scalars> made;
  for (auto& item : items) {
    auto& s = *item.state;
    s.step += 1;
    auto [slot, added] = made.try_emplace({item.options, s.step});
    if (added) slot->second = scalars(*item.options, s.step);
    const auto& p = item.param;
    const auto& grad = p.grad();
    if (lowbit_.fused_cpu && p.device().is_cpu() && p.scalar_type() == torch::kFloat && grad.scalar_type() == torch::kFloat && p.is_contiguous()) {
      if (!encoders_) encoders_ = std::make_shared<const detail::LowBitEncoders>(detail::LowBitEncoders{detail::Encoder(maps_[0]), detail::Encoder(maps_[1])});
      step_cpu(p, grad, s, slot->second, maps_, *encoders_, lowbit_);
    } else {
      auto [maps, fresh] = device_maps_.try_emplace(p.device().str());
      if (fresh) maps->second = {maps_[0].to(p.device()), maps_[1].to(p.device())};
      const auto& [beta1, beta2] = item.options->betas();
      step_aten(p, grad, s, slot->second, maps->second, lowbit_, beta1, beta2);
    }
  }
}

}  // namespace memtrain
