// A rank of a multi-process test (started by memtrain-run or torchrun): checks every collective of
// memtrain::ProcessGroup against arithmetic, then prints "collectives ok". Environment knobs for the
// failure tests: PROBE_DIE_RANK=r makes rank r exit at once with code 3 after the rendezvous (before it, with
// PROBE_DIE_BEFORE_RENDEZVOUS=1: the others then wait at the store, where nothing tells them of the death, until
// their timeout or until a launcher stops them); PROBE_TIMEOUT_S sets the group's timeout; PROBE_PRINT_PID prints
// this process's pid first.
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>

#include "memtrain/core/error.h"
#include "memtrain/distributed/process_group.h"

int main() {
  try {
    if (std::getenv("PROBE_PRINT_PID")) std::cout << "pid " << getpid() << std::endl;
    auto world = memtrain::World::from_env();
    const char* die = std::getenv("PROBE_DIE_RANK");
    const bool dies = die && std::atoi(die) == world.rank;
    if (dies && std::getenv("PROBE_DIE_BEFORE_RENDEZVOUS")) {
      std::cout << "dying on purpose" << std::endl;
      _exit(3);
    }
    memtrain::ProcessGroupOptions o;
    if (const char* t = std::getenv("PROBE_TIMEOUT_S")) o.timeout = std::chrono::seconds(std::atoi(t));
    auto g = memtrain::ProcessGroup::create(world, o);
    const int r = g->rank(), n = g->size();
    if (dies) {
      std::cout << "dying on purpose" << std::endl;
      _exit(3);  // at once, as a crash would: no destructors closing the group politely
    }
    // all-reduce: sum over ranks of (rank + 1) * [1, 2, 3] = n (n + 1) / 2 * [1, 2, 3]
    auto t = torch::tensor({1.f, 2.f, 3.f}) * static_cast<float>(r + 1);
    g->all_reduce_sum(t);
    TORCH_CHECK(torch::equal(t, torch::tensor({1.f, 2.f, 3.f}) * static_cast<float>(n * (n + 1) / 2)), "all-reduce ", t);
    // reduce-scatter: every rank gives arange(2n) * (rank + 1); rank r keeps [2r, 2r + 2) of the sum
    auto in = torch::arange(2 * n, torch::kFloat) * static_cast<float>(r + 1);
    auto out = torch::empty({2});
    g->reduce_scatter_sum_async(out, in).wait();
    auto expect = torch::arange(2 * r, 2 * r + 2, torch::kFloat) * static_cast<float>(n * (n + 1) / 2);
    TORCH_CHECK(torch::equal(out, expect), "reduce-scatter ", out, " expected ", expect);
    // all-gather: rank r gives [r, r]; everyone gets [0, 0, 1, 1, ...]
    auto mine = torch::full({2}, static_cast<float>(r));
    auto all = torch::empty({2 * n});
    g->all_gather_async(all, mine).wait();
    TORCH_CHECK(torch::equal(all, torch::arange(n, torch::kFloat).repeat_interleave(2)), "all-gather ", all);
    // max and broadcast
    auto m = torch::tensor({static_cast<float>(r)});
    g->all_reduce_max(m);
    TORCH_CHECK(m.item<float>() == static_cast<float>(n - 1), "max ", m);
    auto b = torch::tensor({static_cast<float>(r == n - 1 ? 42 : 0)});
    g->broadcast(b, n - 1);
    TORCH_CHECK(b.item<float>() == 42.f, "broadcast ", b);
    g->barrier();
    std::cout << "collectives ok: rank " << r << " of " << n << " (" << g->backend_name() << ")" << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "probe: " << e.what() << std::endl;
    return 1;
  }
}
