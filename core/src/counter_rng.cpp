#include "memtrain/core/counter_rng.h"

#include <cmath>
#include <limits>
#include <numbers>

#include "memtrain/core/error.h"
#include "memtrain/core/parallel.h"

namespace memtrain {
namespace {

constexpr int64_t kBlock = 65536;  // elements per task of parallel_for (core/parallel.h)
constexpr double kTwoToMinus53 = 1.0 / 9007199254740992.0;

uint32_t lo32(uint64_t v) { return static_cast<uint32_t>(v); }
uint32_t hi32(uint64_t v) { return static_cast<uint32_t>(v >> 32); }

// Block j of the stream as two 53-bit integers (a, b): elements 2j and 2j + 1 (the header says how).
std::array<uint64_t, 2> block_bits(uint64_t seed, uint64_t key, int64_t j) {
  const uint64_t c = static_cast<uint64_t>(j);
  const auto x = philox4x32_10({lo32(c), hi32(c), lo32(seed), hi32(seed)}, {lo32(key), hi32(key)});
  return {((uint64_t{x[1]} << 32) | x[0]) >> 11, ((uint64_t{x[3]} << 32) | x[2]) >> 11};
}

void check_out(const torch::Tensor& out, int64_t begin, const char* what) {
  MEMTRAIN_CHECK(out.device().is_cpu(), Error, "[rng] ", what, ": expected a CPU tensor, got one on ",
                 out.device().str(), " (fill on the CPU and copy)");
  MEMTRAIN_CHECK(out.scalar_type() == torch::kFloat, Error, "[rng] ", what, ": expected a float32 tensor, got ",
                 c10::toString(out.scalar_type()), " (fill a float32 tensor and convert)");
  MEMTRAIN_CHECK(out.is_contiguous(), Error, "[rng] ", what, ": expected a contiguous tensor, got strides ",
                 out.strides(), " for sizes ", out.sizes());
  MEMTRAIN_CHECK(begin >= 0, Error, "[rng] ", what, ": expected begin >= 0, got ", begin);
}

// Writes elements [begin, begin + n) into `out`; pair(j) gives elements 2j and 2j + 1. The threads split the pairs
// that cover the range, each computed once (the first and the last may be cut in half by it), so no value depends on
// where a slice starts or on the split.
template <class Pair>
void fill_pairs(const torch::Tensor& out, int64_t begin, Pair pair) {
  float* data = out.data_ptr<float>();
  const int64_t n = out.numel();
  if (n == 0) return;
  const int64_t first = begin / 2, last = (begin + n - 1) / 2 + 1;
  auto run = [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      const auto v = pair(j);
      const int64_t i = 2 * j - begin;
      if (i >= 0) data[i] = v[0];
      if (i + 1 < n) data[i + 1] = v[1];
    }
  };
  parallel_for(first, last, kBlock / 2, run);
}

float inside(double v, double low, double high) {
  float f = static_cast<float>(v);
  if (f < low) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  if (f >= high) f = std::nextafter(f, -std::numeric_limits<float>::infinity());
  return f;
}

}  // namespace

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {  // the key schedule: a Weyl sequence, bumped before every round but the first
      k[0] += 0x9E3779B9u;
      k[1] += 0xBB67AE85u;
    }
    const uint64_t p0 = uint64_t{0xD2511F53u} * c[0], p1 = uint64_t{0xCD9E8D57u} * c[2];
    c = {hi32(p1) ^ c[1] ^ k[0], lo32(p1), hi32(p0) ^ c[3] ^ k[1], lo32(p0)};
  }
  return c;
}

uint64_t name_key(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64-bit offset basis and prime
  for (unsigned char byte : name) h = (h ^ byte) * 0x100000001b3ull;
  return h;
}

void fill_normal(const torch::Tensor& out, uint64_t seed, const std::string& name, int64_t begin, double mean,
                 double stddev) {
  check_out(out, begin, "fill_normal");
  MEMTRAIN_CHECK(stddev >= 0, Error, "[rng] fill_normal: expected stddev >= 0, got ", stddev);
  const uint64_t key = name_key(name);
  fill_pairs(out, begin, [&](int64_t j) {
    const auto [a, b] = block_bits(seed, key, j);
    const double r = std::sqrt(-2.0 * std::log(static_cast<double>(a + 1) * kTwoToMinus53));
    const double theta = 2.0 * std::numbers::pi * (static_cast<double>(b) * kTwoToMinus53);
    return std::array<float, 2>{static_cast<float>(mean + stddev * (r * std::cos(theta))),
                                static_cast<float>(mean + stddev * (r * std::sin(theta)))};
  });
}

void fill_uniform(const torch::Tensor& out, uint64_t seed, const std::string& name, int64_t begin, double low,
                  double high) {
  check_out(out, begin, "fill_uniform");
  MEMTRAIN_CHECK(low < high, Error, "[rng] fill_uniform: expected low < high, got [", low, ", ", high, ")");
  const uint64_t key = name_key(name);
  fill_pairs(out, begin, [&](int64_t j) {
    const auto [a, b] = block_bits(seed, key, j);
    return std::array<float, 2>{inside(low + (high - low) * (static_cast<double>(a) * kTwoToMinus53), low, high),
                                inside(low + (high - low) * (static_cast<double>(b) * kTwoToMinus53), low, high)};
  });
}

}  // namespace memtrain
