// The NCCL backend in its own translation unit, compiled with USE_C10D_NCCL and nccl.h from the CUDA
// toolkit: it builds and links on machines without a GPU, and runs only on one.
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "memtrain/distributed/process_group.h"

namespace memtrain::detail {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

}  // namespace memtrain::detail
