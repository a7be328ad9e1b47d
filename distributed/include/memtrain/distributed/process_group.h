// The process group of a multi-process run: rendezvous through c10d's TCPStore at MASTER_ADDR:MASTER_PORT,
// then LibTorch's own c10d backend (ProcessGroupGloo for CPU tensors, ProcessGroupNCCL for CUDA ones):
// the existing engine, not a home-made transport. Every collective waits with the group's timeout and
// turns a dead peer or a timeout into a memtrain::Error that names the operation and the rank.
//
//   auto world = memtrain::World::from_env();
//   auto group = memtrain::ProcessGroup::create(world, {.backend = "auto", .device = device});
//   group->all_reduce_sum(t);        // in place; Gloo has no AVG: divide by group->size() yourself
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "memtrain/distributed/world.h"

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace memtrain {

struct ProcessGroupOptions {
  std::string backend = "auto";          // auto (gloo on CPU, nccl on CUDA) | gloo | nccl
  std::chrono::seconds timeout{300};     // rendezvous and every collective
  c10::Device device = c10::kCPU;        // this rank's device: the tensors the collectives move
};

// Told of every collective once it has been waited for (on the waiting thread): what it was, its bytes,
// when it was issued and when it completed (Gloo: its completion callback; NCCL, whose future completes at
// enqueue: the end of the wait). The trace's collective spans.
using CollectiveObserver = std::function<void(const std::string& what, int64_t bytes,
                                              std::chrono::steady_clock::time_point issued,
                                              std::chrono::steady_clock::time_point completed)>;

// A collective started but not waited for (bucketed gradient reduction overlaps them with backward).
class PendingCollective {
 public:
  PendingCollective() = default;
  // With an observer: also its bytes and issue time, reported after the wait; completion is taken from the
  // work's future where that completes when the collective has run (Gloo), else from the end of the wait.
  PendingCollective(c10::intrusive_ptr<c10d::Work> work, std::string what, int rank, int64_t bytes = 0,
                    const CollectiveObserver* observer = nullptr, bool completion_from_future = false);
  ~PendingCollective();
  PendingCollective(PendingCollective&&) noexcept;
  PendingCollective& operator=(PendingCollective&&) noexcept;
  // Blocks until done; a failed or timed-out collective throws memtrain::Error naming it. On NCCL, wait()
  // only orders the current CUDA stream after the collective (the host goes on, and a dead peer shows as a hang
  // or the watchdog's abort); wait_for_host() also blocks the host, with the group's timeout, for results the
  // host reads (agreement, stop requests, sums of evaluation, the clip norm), so that a failure is the same
  // clear error as on Gloo. On Gloo both block the host.
  void wait();
  void wait_for_host();
  // NCCL: the current CUDA stream waits for the collective, the host does not, and the collective stays pending
  // (for a later wait_for_host()): a copy of its result queued next on that stream sees it. Gloo: nothing.
  void order_stream();
  bool pending() const;
  bool completed() const;  // pending and already done (wait() will not block); never blocks

 private:
  friend class ProcessGroup;
  c10::intrusive_ptr<c10d::Work> work_;
  std::chrono::milliseconds host_timeout_{0};  // NCCL: wait_for_host()'s limit (Gloo's waits carry their own)
  std::string what_;
  int rank_ = 0;
  int64_t bytes_ = 0;
  const CollectiveObserver* observer_ = nullptr;  // the group's; the group outlives its collectives
  std::chrono::steady_clock::time_point issued_;
  // Set by the backend's thread when the work completes (nanoseconds since the clock's epoch; 0: not yet).
  std::shared_ptr<std::atomic<int64_t>> completed_ns_;
  void report();  // to the observer, after a wait
};

class ProcessGroup {
 public:
  // Rendezvous of all world.world_size ranks. Rank 0 hosts the TCPStore. A rank that never arrives, a
  // wrong MASTER_ADDR or a busy port is an error within options.timeout, naming what was waited for.
  static std::shared_ptr<ProcessGroup> create(const World& world, const ProcessGroupOptions& options);
  ~ProcessGroup();

  // The group of `ranks` (of this group, in order; this rank among them) on the same store: a tensor-parallel or a
  // data-parallel group (dist.tensor_parallel). Every member calls it with the same ranks and `name`, and each rank
  // makes its groups in the same order.
  std::shared_ptr<ProcessGroup> subgroup(const std::vector<int>& ranks, const std::string& name) const;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& backend_name() const { return backend_name_; }

  // Element-wise sum over ranks, in place.
  PendingCollective all_reduce_sum_async(at::Tensor& tensor);
  void all_reduce_sum(at::Tensor& tensor) { all_reduce_sum_async(tensor).wait_for_host(); }
  // Element-wise max over ranks, in place (the fp16 scaler's found-inf flag).
  void all_reduce_max(at::Tensor& tensor) { all_reduce_max_async(tensor).wait_for_host(); }
  PendingCollective all_reduce_max_async(at::Tensor& tensor);
  // input (size * n elements) summed over ranks; this rank keeps elements [rank * n, (rank + 1) * n) in output (n).
  PendingCollective reduce_scatter_sum_async(at::Tensor& output, at::Tensor& input);
  // output (size * n) = the concatenation of every rank's input (n).
  PendingCollective all_gather_async(at::Tensor& output, at::Tensor& input);
  void broadcast(at::Tensor& tensor, int root);
  void barrier();
  // The end of a run: a host-synced barrier (every rank's last collective has run, so no send a slower peer
  // still needs is dropped), then the backend's shutdown (NCCL: its communicators destroyed in order, not
  // aborted by the destructor, which prints "has NOT been destroyed"). No collective may follow. Idempotent.
  void shutdown();

  // Bytes this rank has put into collectives so far: each collective counts its buffer's size (a ring
  // all-reduce moves about 2 (N-1)/N of it per rank, a reduce-scatter or all-gather (N-1)/N).
  int64_t bytes_communicated() const { return bytes_; }
  // Every collective of this group, once waited for, is reported to `observer` (empty: none).
  void set_observer(CollectiveObserver observer) { observer_ = std::move(observer); }

 private:
  bool shut_down_ = false;
  ProcessGroup() = default;
  PendingCollective start(c10::intrusive_ptr<c10d::Work> work, const std::string& what, int64_t bytes);

  int rank_ = 0, size_ = 1;
  std::string backend_name_;
  std::chrono::milliseconds timeout_{300000};
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  int64_t bytes_ = 0;
  CollectiveObserver observer_;
};

namespace detail {
// The NCCL backend, in its own translation unit (compiled everywhere, run only on a GPU).
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout);
}  // namespace detail

}  // namespace memtrain
