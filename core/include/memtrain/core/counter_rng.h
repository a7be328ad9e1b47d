// A counter-based random stream for initial weights: element i of a parameter's flattened values is a pure
// function of (seed, parameter name, i), so any slice of any parameter is filled without generating the rest.
// Each ZeRO-3 rank fills only its own shard, and the weights are bitwise the same at every world size, bucket
// layout and thread count; other devices get them by copying from the CPU.
//
//   auto shard = torch::empty({hi - lo});                                 // (hi - lo,) fp32
//   fill_normal(shard, seed, "h.0.attn.c_attn.weight", lo, 0.0, 0.02);  // elements [lo, hi) of that weight
//
// The stream, exactly (a change to any line changes every model's initial weights):
//   K        = name_key(name)
//   x        = philox4x32_10({lo32(j), hi32(j), lo32(seed), hi32(seed)}, {lo32(K), hi32(K)})  for j = i / 2
//   a, b     = (x[1] << 32 | x[0]) >> 11,  (x[3] << 32 | x[2]) >> 11             two 53-bit integers
//   normal   : u1 = (a + 1) / 2^53 in (0, 1], u2 = b / 2^53 in [0, 1), r = sqrt(-2 ln u1) (Box-Muller, double);
//              z = r cos(2 pi u2) for even i, r sin(2 pi u2) for odd i;  value = float(mean + stddev * z)
//   uniform  : u = a / 2^53 for even i, b / 2^53 for odd i (53-bit uniforms in [0, 1));
//              value = float(low + (high - low) * u), moved one float inwards if rounding left [low, high)
// The name is the key and the seed the upper half of the counter, rather than one key of seed ^ K: with the
// XOR, seed s ^ K1 ^ K2 of one parameter would replay seed s of another. Here two parameters never share a
// key (short of an FNV-1a collision) and two seeds of one parameter never share a block, as Philox is a
// bijection of the counter for a fixed key. Normal and uniform fills of one (seed, name) read the same blocks;
// a parameter is initialised by one of them. Normals go through the C library's log, cos and sin in double
// before the one rounding to float, so only a machine with another libm could differ (in a float's last bit,
// and rarely); the build turns off fused multiply-add for this file so that no compiler flag can.
#pragma once

#include <torch/types.h>

#include <array>
#include <cstdint>
#include <string>

namespace memtrain {

// Philox4x32 with 10 rounds (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3",
// SC'11), the generator Random123 and cuRAND call philox4x32_10.
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// FNV-1a, 64-bit, of the name's bytes: the Philox key of a parameter.
uint64_t name_key(const std::string& name);

// `out` (a contiguous fp32 CPU tensor of n elements, any shape) receives elements [begin, begin + n) of the
// stream of (seed, name), drawn from N(mean, stddev^2). Multi-threaded (core/parallel.h, blocks of at least 65536);
// no value depends on the split, on `begin` or on the thread count.
void fill_normal(const torch::Tensor& out, uint64_t seed, const std::string& name, int64_t begin, double mean,
                 double stddev);
// The same, uniform in [low, high) (needs low < high).
void fill_uniform(const torch::Tensor& out, uint64_t seed, const std::string& name, int64_t begin, double low,
                  double high);

}  // namespace memtrain
