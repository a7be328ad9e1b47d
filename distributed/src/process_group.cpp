// Compiled with USE_C10D_GLOO (this file only): ProcessGroupGloo.hpp needs the gloo headers, which the
// torch wheel does not ship; Debian's libgloo-dev supplies them. ProcessGroupGloo holds gloo types only
// through shared_ptrs, so constructing it from these headers matches the wheel's own layout; nothing
// here touches a gloo object or an inline member that would (docs/libtorch-notes.md).
#include "memtrain/distributed/process_group.h"

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <iostream>
#include <thread>

#include "memtrain/core/error.h"

namespace memtrain {

namespace {
std::string what_of(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}
}  // namespace

PendingCollective::PendingCollective(c10::intrusive_ptr<c10d::Work> work, std::string what, int rank, int64_t bytes,
                                     const CollectiveObserver* observer, bool completion_from_future)
    : work_(std::move(work)), what_(std::move(what)), rank_(rank), bytes_(bytes), observer_(observer) {
  if (!observer_) return;  // nothing to time
  issued_ = std::chrono::steady_clock::now();
  completed_ns_ = std::make_shared<std::atomic<int64_t>>(0);
  // Gloo's works complete their future on Gloo's thread when the collective has run. NCCL's future
  // completes when the kernel is queued, not run: NCCL collectives (observer_ set with completion_from_future
  // false) are timed to the end of the wait instead, as is a backend without a future (the base Work throws).
  if (!completion_from_future) return;
  try {
    work_->getFuture()->addCallback([done = completed_ns_](c10::ivalue::Future&) {
      done->store(std::chrono::steady_clock::now().time_since_epoch().count());
    });
  } catch (const std::exception&) {
  }
}
PendingCollective::~PendingCollective() = default;
PendingCollective::PendingCollective(PendingCollective&&) noexcept = default;
PendingCollective& PendingCollective::operator=(PendingCollective&&) noexcept = default;
bool PendingCollective::pending() const { return static_cast<bool>(work_); }
bool PendingCollective::completed() const { return work_ && work_->isCompleted(); }

void PendingCollective::wait() {
  if (!work_) return;
  auto work = std::move(work_);
  try {
    work->wait();
  } catch (const std::exception& e) {
    throw Error(detail::concat("[dist] rank ", rank_, ": ", what_, " failed (a peer died or timed out): ", what_of(e)));
  }
  report();
}

void PendingCollective::wait_for_host() {
  if (!work_) return;
  if (host_timeout_.count() == 0) return wait();  // Gloo: wait() blocks the host with the collective's timeout
  auto work = std::move(work_);
  try {
    // WorkNCCL::wait with a timeout blocks the host until the kernel has run, or throws after the timeout.
    work->wait(host_timeout_);
  } catch (const std::exception& e) {
    throw Error(detail::concat("[dist] rank ", rank_, ": ", what_, " failed (a peer died or timed out within ",
                               host_timeout_.count() / 1000, " s, dist.timeout_s): ", what_of(e)));
  }
  report();
}

void PendingCollective::order_stream() {
  // WorkNCCL::synchronize() makes the current stream wait on the collective's end event; it returns at once
  // (without TORCH_NCCL_BLOCKING_WAIT). Gloo's would block, and Gloo needs no stream order.
  if (work_ && host_timeout_.count() != 0) work_->synchronize();
}

void PendingCollective::report() {
  if (observer_ && *observer_) {
    const auto now = std::chrono::steady_clock::now();
    const auto ns = completed_ns_->load();
    const auto completed = ns > 0 ? std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(ns)) : now;
    (*observer_)(what_, bytes_, issued_, std::min(completed, now));
  }
}

std::shared_ptr<ProcessGroup> ProcessGroup::create(const World& world, const ProcessGroupOptions& options) {
  std::shared_ptr<ProcessGroup> g(new ProcessGroup());
  g->rank_ = world.rank;
  g->size_ = world.world_size;
  g->timeout_ = std::chrono::duration_cast<std::chrono::milliseconds>(options.timeout);
  auto backend = options.backend;
  if (backend == "auto") backend = options.device.is_cuda() ? "nccl" : "gloo";
  MEMTRAIN_CHECK(backend == "gloo" || backend == "nccl", ConfigError, "[config] dist.backend = '", backend,
                 "': expected auto | gloo | nccl");
  MEMTRAIN_CHECK(backend != "nccl" || options.device.is_cuda(), ConfigError,
                 "[config] dist.backend = nccl needs train.device = cuda (NCCL moves CUDA tensors); use gloo on CPU");
  g->backend_name_ = backend;

  // 1. Rendezvous: rank 0 serves the store, the others connect; every rank counts itself in and waits until all
  //    have, saying so now and then (a lone rank of a job whose others never started must not look hung).
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(world.master_port);
  so.isServer = world.rank == 0;
  so.numWorkers = static_cast<size_t>(world.world_size);
  so.waitWorkers = false;  // counted below instead, with progress lines
  so.timeout = g->timeout_;
  auto failed = [&](const std::string& why) {
    return Error(detail::concat("[dist] rank ", world.rank, ": rendezvous at ", world.master_addr, ":", world.master_port,
                                " failed: ", world.rank == 0 ? "serving the store for " : "joining the store of ",
                                world.world_size, " ranks within ", options.timeout.count(), " s (dist.timeout_s): ", why,
                                ". Check MASTER_ADDR / MASTER_PORT, that every rank was started, and that the port is free"));
  };
  try {
    // A group of one (the sharded optimizer's offload in a single process) needs no rendezvous.
    if (world.world_size == 1) g->store_ = c10::make_intrusive<c10d::HashStore>();
    else g->store_ = c10::make_intrusive<c10d::TCPStore>(world.master_addr, so);
  } catch (const std::exception& e) {
    throw failed(what_of(e));
  }
  if (world.world_size > 1) {
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    auto say_at = start + std::chrono::seconds(5);
    int64_t joined = 0;
    try {
      joined = g->store_->add("memtrain/joined", 1);
      while (joined < world.world_size) {
        if (Clock::now() - start > options.timeout)
          throw failed(detail::concat(joined, " of ", world.world_size, " ranks joined"));
        if (Clock::now() >= say_at) {
          std::cerr << "[dist] rank " << world.rank << ": waiting at " << world.master_addr << ":" << world.master_port
                    << " for the ranks to join: " << joined << " of " << world.world_size << " so far ("
                    << std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - start).count() << " s of "
                    << options.timeout.count() << " s, dist.timeout_s)\n" << std::flush;
          say_at += std::chrono::seconds(30);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        joined = g->store_->add("memtrain/joined", 0);
      }
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw failed(what_of(e));
    }
  }
  auto store = c10::make_intrusive<c10d::PrefixStore>("memtrain/" + backend, g->store_);

  // 2. The backend on top of the store (its own rendezvous of transport addresses).
  try {
    if (backend == "gloo") {
      auto o = c10d::ProcessGroupGloo::Options::create_default(g->timeout_);
      g->backend_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, world.rank, world.world_size, o);
    } else {
      g->backend_ = detail::make_nccl_backend(store, world.rank, world.world_size, g->timeout_);
    }
  } catch (const std::exception& e) {
    throw Error(detail::concat("[dist] rank ", world.rank, ": creating the ", backend, " process group of ",
                               world.world_size, " ranks failed: ", what_of(e)));
  }
  return g;
}

std::shared_ptr<ProcessGroup> ProcessGroup::subgroup(const std::vector<int>& ranks, const std::string& name) const {
  const auto at = std::find(ranks.begin(), ranks.end(), rank_);
  MEMTRAIN_CHECK(at != ranks.end(), Error, "[dist] rank ", rank_, " is not in the ", name, " group it makes");
  std::shared_ptr<ProcessGroup> g(new ProcessGroup());
  g->rank_ = static_cast<int>(at - ranks.begin());
  g->size_ = static_cast<int>(ranks.size());
  g->timeout_ = timeout_;
  g->backend_name_ = backend_name_;
  g->store_ = store_;
  auto store = c10::make_intrusive<c10d::PrefixStore>("memtrain/" + backend_name_ + "/" + name, store_);
  try {
    if (backend_name_ == "gloo") {
      auto o = c10d::ProcessGroupGloo::Options::create_default(timeout_);
      g->backend_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, g->rank_, g->size_, o);
    } else {
      g->backend_ = detail::make_nccl_backend(store, g->rank_, g->size_, timeout_);
    }
  } catch (const std::exception& e) {
    throw Error(detail::concat("[dist] rank ", rank_, ": creating the ", backend_name_, " ", name, " group of ",
                               ranks.size(), " ranks failed: ", what_of(e)));
  }
  return g;
}

ProcessGroup::~ProcessGroup() = default;

PendingCollective ProcessGroup::start(c10::intrusive_ptr<c10d::Work> work, const std::string& what, int64_t bytes) {
  bytes_ += bytes;
  PendingCollective p(std::move(work), what, rank_, bytes, observer_ ? &observer_ : nullptr, backend_name_ == "gloo");
  if (backend_name_ == "nccl") p.host_timeout_ = timeout_;
  return p;
}

PendingCollective ProcessGroup::all_reduce_sum_async(at::Tensor& tensor) {
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::SUM;
  o.timeout = timeout_;
  return start(backend_->allreduce(ts, o), "all-reduce", tensor.numel() * tensor.element_size());
}

PendingCollective ProcessGroup::all_reduce_max_async(at::Tensor& tensor) {
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  o.timeout = timeout_;
  return start(backend_->allreduce(ts, o), "all-reduce (max)", tensor.numel() * tensor.element_size());
}

PendingCollective ProcessGroup::reduce_scatter_sum_async(at::Tensor& output, at::Tensor& input) {
  MEMTRAIN_CHECK(input.numel() == output.numel() * size_, Error, "[dist] reduce-scatter: input has ", input.numel(),
                 " elements, expected ", size_, " x ", output.numel());
  c10d::ReduceScatterOptions o;
  o.reduceOp = c10d::ReduceOp::SUM;
  o.timeout = timeout_;
  return start(backend_->_reduce_scatter_base(output, input, o), "reduce-scatter",
               input.numel() * input.element_size());
}

PendingCollective ProcessGroup::all_gather_async(at::Tensor& output, at::Tensor& input) {
  MEMTRAIN_CHECK(output.numel() == input.numel() * size_, Error, "[dist] all-gather: output has ", output.numel(),
                 " elements, expected ", size_, " x ", input.numel());
  c10d::AllgatherOptions o;
  o.timeout = timeout_;
  return start(backend_->_allgather_base(output, input, o), "all-gather", output.numel() * output.element_size());
}

void ProcessGroup::broadcast(at::Tensor& tensor, int root) {
  std::vector<at::Tensor> ts{tensor};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  o.timeout = timeout_;
  start(backend_->broadcast(ts, o), "broadcast", tensor.numel() * tensor.element_size()).wait_for_host();
}

void ProcessGroup::shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  if (size_ > 1) barrier();
  backend_->shutdown();
}

void ProcessGroup::barrier() {
  c10d::BarrierOptions o;
  o.timeout = timeout_;
  start(backend_->barrier(o), "barrier", 0).wait_for_host();
}


}  // namespace memtrain
