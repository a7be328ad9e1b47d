// train.host_reads = deferred: what the host must learn of a step (whether its gradients were non-finite,
// whether a rank was asked to stop, and for the message the norm and the loss) travels in one small tensor,
// copied to pinned host memory (MAX over ranks first) without waiting; the trainer reads it once the next
// step's forward and backward are queued, so the GPU never idles for the host. Internal to the runtime.
#pragma once

#include <c10/core/Event.h>

#include <optional>

#include "memtrain/distributed/process_group.h"

namespace memtrain::detail {

class StepFlags {
 public:
  struct Values {
    int64_t step = 0;  // the step they belong to, numbered from 1
    bool found_inf = false, stop = false;
    double grad_norm = 0, loss = 0;
  };
  // `flags`: (4,) fp32 on the training device: found_inf (0/1), stop (0/1), gradient norm, loss. With a group,
  // every rank records at the same step (the MAX over ranks is a collective).
  void record(int64_t step, torch::Tensor flags, ProcessGroup* group);
  bool pending() const { return step_ > 0; }
  // The recorded values, waiting for them if needed (a failed collective is memtrain's clear error, within
  // dist.timeout_s); nullopt when nothing is pending.
  std::optional<Values> take();

 private:
  int64_t step_ = 0;
  torch::Tensor device_, host_;
  PendingCollective reduce_;
  std::optional<c10::Event> copied_;
};

}  // namespace memtrain::detail
