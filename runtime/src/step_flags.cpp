#include "step_flags.h"

#include <c10/core/impl/VirtualGuardImpl.h>

namespace memtrain::detail {

void StepFlags::record(int64_t step, torch::Tensor flags, ProcessGroup* group) {
  step_ = step;
  device_ = std::move(flags);  // kept alive until take(): an asynchronous collective writes it
  copied_.reset();
  if (group) {
    reduce_ = group->all_reduce_max_async(device_);
    // NCCL: the copy below is ordered after the all-reduce on the stream; the host does not wait. Gloo on CUDA
    // tensors stages through its own streams, so its result is waited for here (a test configuration); Gloo on
    // CPU tensors runs on its own thread until take().
    if (device_.is_cuda()) group->backend_name() == "nccl" ? reduce_.order_stream() : reduce_.wait();
  }
  if (!device_.is_cuda()) {
    host_ = device_;
    return;
  }
  // Pinned memory, so the copy is asynchronous; the event says when it has landed.
  host_ = torch::empty(device_.sizes(), device_.options().device(c10::kCPU).pinned_memory(true));
  host_.copy_(device_, /*non_blocking=*/true);
  const c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
  copied_.emplace(c10::DeviceType::CUDA);
  copied_->record(guard.getStream(device_.device()));
}

std::optional<StepFlags::Values> StepFlags::take() {
  if (!pending()) return std::nullopt;
  reduce_.wait_for_host();  // NCCL: blocks the host until the all-reduce ran, or throws after dist.timeout_s
  if (copied_) copied_->synchronize();
  const auto* v = host_.data_ptr<float>();
  Values out{step_, v[0] != 0, v[1] != 0, v[2], v[3]};
  step_ = 0;
  device_ = host_ = torch::Tensor();
  copied_.reset();
  return out;
}

}  // namespace memtrain::detail
