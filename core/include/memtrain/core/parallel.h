// A parallel loop over [begin, end) on as many threads as ATen's intra-op setting (at::get_num_threads()), each thread
// one contiguous range of at least `grain` iterations; the calling thread takes the first. at::parallel_for cannot
// serve here: with the wheel's OpenMP backend its loop is a header template (ATen/ParallelOpenMP.h, #pragma omp
// parallel), which runs serially in code built without -fopenmp, and a second OpenMP runtime beside the wheel's
// bundled libgomp is no option. For loops of a few milliseconds or more (threads are started per call).
//
//   memtrain::parallel_for(0, n, 65536, [&](int64_t lo, int64_t hi) { for (auto i = lo; i < hi; ++i) out[i] = f(i); });
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace memtrain {

template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1));
  if (threads <= 1) return f(begin, end);
  const int64_t per = (n + threads - 1) / threads;
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t)
    pool.emplace_back([&f, lo = std::min(end, begin + t * per), hi = std::min(end, begin + (t + 1) * per)] { f(lo, hi); });
  f(begin, std::min(end, begin + per));
  for (auto& th : pool) th.join();
}

}  // namespace memtrain
