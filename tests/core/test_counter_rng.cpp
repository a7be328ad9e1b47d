#include <gtest/gtest.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#include "helpers.h"
#include "memtrain/core/counter_rng.h"

namespace memtrain {
namespace {

using Words = std::array<uint32_t, 4>;

bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() &&
         std::memcmp(a.data_ptr<float>(), b.data_ptr<float>(), a.numel() * sizeof(float)) == 0;
}

torch::Tensor normals(int64_t n, uint64_t seed, const std::string& name, int64_t begin = 0) {
  auto out = torch::empty({n});
  fill_normal(out, seed, name, begin, 0.0, 0.02);
  return out;
}

TEST(CounterRng, PhiloxMatchesRandom123KnownAnswers) {
  // Random123's examples/kat_vectors, the "philox4x32 10" lines (counter, key -> output); an independent Python
  // Philox4x32-10 reproduces all three.
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}), (Words{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32_10({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
            (Words{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (Words{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(CounterRng, NameKeyIsFnv1a) {
  // The FNV reference test vectors for FNV-1a 64.
  EXPECT_EQ(name_key(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(name_key("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(name_key("foobar"), 0x85944171f73967e8ull);
}

TEST(CounterRng, StreamFollowsItsDefinition) {
  // Written by this Python, the header's definition on top of the Philox and FNV-1a above (M = 2**32 - 1, f32
  // rounds to float32 with struct.pack('f')):
  //   def bits(seed, name, j):
  //       k = fnv1a(name); x = philox4x32_10([j & M, j >> 32, seed & M, seed >> 32], [k & M, k >> 32])
  //       return (x[1] << 32 | x[0]) >> 11, (x[3] << 32 | x[2]) >> 11
  //   def normal(seed, name, i, mean, std):
  //       a, b = bits(seed, name, i // 2); u1 = (a + 1) * 2.0**-53; u2 = b * 2.0**-53
  //       r = math.sqrt(-2 * math.log(u1)); t = 2 * math.pi * u2
  //       return f32(mean + std * (r * math.cos(t) if i % 2 == 0 else r * math.sin(t)))
  //   def uniform(seed, name, i, low, high):
  //       a, b = bits(seed, name, i // 2)
  //       return f32(low + (high - low) * ((a if i % 2 == 0 else b) * 2.0**-53))
  // Any change to the stream changes every model's initial weights: this test is what notices. FLOAT_EQ
  // (4 ulps) leaves room for another libm's last bit of log, cos and sin.
  const std::string name = "h.0.attn.c_attn.weight";
  auto n = torch::empty({4}), u = torch::empty({4});
  fill_normal(n, 1234, name, 0, 0.0, 0.02);
  fill_uniform(u, 1234, name, 0, -0.5, 0.5);
  const float want_n[] = {-0.0129219964f, 0.00463877013f, -0.0195821561f, 0.00611636601f};
  const float want_u[] = {0.290080667f, -0.0548534691f, 0.0909118056f, -0.0481829792f};
  for (int i = 0; i < 4; ++i) {
    EXPECT_FLOAT_EQ(n[i].item<float>(), want_n[i]) << "normal element " << i;
    EXPECT_FLOAT_EQ(u[i].item<float>(), want_u[i]) << "uniform element " << i;
  }
  // Far into the stream: the block index needs the counter's second word.
  auto far = torch::empty({1});
  fill_normal(far, 1234, name, 1000000000001, 0.0, 0.02);
  EXPECT_FLOAT_EQ(far[0].item<float>(), -0.0374703966f);
  fill_uniform(far, 1234, name, 1000000000001, -0.5, 0.5);
  EXPECT_FLOAT_EQ(far[0].item<float>(), 0.303479403f);
}

TEST(CounterRng, ASliceEqualsTheWhole) {
  const auto whole = normals(10007, 7, "w");
  const std::pair<int64_t, int64_t> slices[] = {{3, 5000}, {5000, 10007}, {0, 1}, {10006, 10007}};
  for (auto [lo, hi] : slices) {
    EXPECT_TRUE(bitwise_equal(normals(hi - lo, 7, "w", lo), whole.slice(0, lo, hi).contiguous()))
        << "[" << lo << ", " << hi << ")";
  }
  // Slices across the 65536-element blocks of parallel_for, starting at odd elements.
  const auto big = normals(200003, 7, "w");
  EXPECT_TRUE(bitwise_equal(normals(200003 - 65537, 7, "w", 65537), big.slice(0, 65537).contiguous()));
  EXPECT_TRUE(bitwise_equal(normals(10007, 7, "w"), big.slice(0, 0, 10007).contiguous()));
  auto u = torch::empty({131071}), part = torch::empty({131071 - 99});
  fill_uniform(u, 7, "w", 0, -1.0, 1.0);
  fill_uniform(part, 7, "w", 99, -1.0, 1.0);
  EXPECT_TRUE(bitwise_equal(part, u.slice(0, 99).contiguous()));
}

TEST(CounterRng, SeedAndNameSelectTheStream) {
  const auto a = normals(1000, 1, "a");
  EXPECT_TRUE(bitwise_equal(a, normals(1000, 1, "a")));
  EXPECT_FALSE(torch::equal(a, normals(1000, 1, "b")));
  EXPECT_FALSE(torch::equal(a, normals(1000, 2, "a")));
}

TEST(CounterRng, NormalStatistics) {
  const int64_t n = 1000000;
  const double stddev = 0.02;
  auto x = torch::empty({n});
  fill_normal(x, 42, "statistics", 0, 0.0, stddev);
  const auto d = x.to(torch::kDouble);
  EXPECT_LT(std::abs(d.mean().item<double>()), 5 * stddev / std::sqrt(static_cast<double>(n)));  // 5 standard errors
  EXPECT_NEAR(d.std().item<double>(), stddev, 0.01 * stddev);
  EXPECT_TRUE(torch::isfinite(x).all().item<bool>());
  // A shifted mean is the same draw moved: mean + stddev * z.
  auto shifted = torch::empty({n});
  fill_normal(shifted, 42, "statistics", 0, 1.0, stddev);
  EXPECT_NEAR(shifted.to(torch::kDouble).mean().item<double>() - d.mean().item<double>(), 1.0, 1e-6);
}

TEST(CounterRng, UniformStatistics) {
  const int64_t n = 1000000;
  const double a = 0.1;  // not a float: the bounds hold after rounding to float too
  auto x = torch::empty({n});
  fill_uniform(x, 42, "statistics", 0, -a, a);
  const auto d = x.to(torch::kDouble);
  EXPECT_GE(d.min().item<double>(), -a);
  EXPECT_LT(d.max().item<double>(), a);
  const double sigma = a / std::sqrt(3.0);  // the standard deviation of U[-a, a)
  EXPECT_LT(std::abs(d.mean().item<double>()), 5 * sigma / std::sqrt(static_cast<double>(n)));
  EXPECT_NEAR(d.var().item<double>(), a * a / 3, 0.01 * a * a / 3);
}

TEST(CounterRng, ThreadCountDoesNotChangeTheValues) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const auto one = normals(300001, 3, "w", 12345);
  auto uniform_one = torch::empty({300001});
  fill_uniform(uniform_one, 3, "w", 12345, -1.0, 1.0);
  at::set_num_threads(2);
  const auto two = normals(300001, 3, "w", 12345);
  auto uniform_two = torch::empty({300001});
  fill_uniform(uniform_two, 3, "w", 12345, -1.0, 1.0);
  at::set_num_threads(threads);
  EXPECT_TRUE(bitwise_equal(one, two));
  EXPECT_TRUE(bitwise_equal(uniform_one, uniform_two));
}

TEST(CounterRng, RejectsOutputsItCannotFill) {
  auto msg = test::error_of([] { fill_normal(torch::empty({4}, torch::kDouble), 0, "w", 0, 0.0, 1.0); });
  EXPECT_NE(msg.find("[rng] fill_normal: expected a float32 tensor, got Double"), std::string::npos) << msg;
  msg = test::error_of([] { fill_uniform(torch::empty({4, 3}).t(), 0, "w", 0, -1.0, 1.0); });
  EXPECT_NE(msg.find("expected a contiguous tensor"), std::string::npos) << msg;
  msg = test::error_of([] { fill_normal(torch::empty({4}), 0, "w", -1, 0.0, 1.0); });
  EXPECT_NE(msg.find("expected begin >= 0, got -1"), std::string::npos) << msg;
  msg = test::error_of([] { fill_normal(torch::empty({4}), 0, "w", 0, 0.0, -1.0); });
  EXPECT_NE(msg.find("expected stddev >= 0"), std::string::npos) << msg;
  msg = test::error_of([] { fill_uniform(torch::empty({4}), 0, "w", 0, 1.0, 1.0); });
  EXPECT_NE(msg.find("expected low < high"), std::string::npos) << msg;
  auto empty = torch::empty({0});
  fill_normal(empty, 0, "w", 5, 0.0, 1.0);  // nothing to fill is not an error
}

}  // namespace
}  // namespace memtrain
