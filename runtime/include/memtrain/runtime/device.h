// The device a run trains on and what memtrain knows of it: which device a rank takes, the caching
// allocator's settings (CUDA), the memory limit, the peak FLOP/s that MFU divides by, and whether a CPU
// runs bf16 natively. One room for what depends on the hardware.
//
//   auto device = memtrain::resolve_device(cfg.train.device, world.local_rank);
//   memtrain::configure_cuda_allocator(cfg.memory, device, world.is_main());   // before the first CUDA tensor
#pragma once

#include <c10/core/Device.h>

#include <string>
#include <utility>

#include "memtrain/core/config.h"
#include "memtrain/runtime/precision.h"

namespace memtrain {

// The device a config asks for: cpu, cuda (this rank's GPU: LOCAL_RANK modulo the visible devices, so a task
// that sees one GPU takes it), or auto (cuda when available).
c10::Device resolve_device(const std::string& name, int local_rank);

// memory.snapshot / expandable_segments / gc_threshold / cuda_allocator: CUDA's caching allocator set up
// (ConfigError on another device when any is asked). `main`: this rank says what it overrides.
void configure_cuda_allocator(const MemoryConfig& memory, const c10::Device& device, bool main);

// memory.limit_mib (0 = none): on CPU the counting allocator refuses allocations past it (process-wide);
// on CUDA the caching allocator gets the matching fraction of the device (the whole device when only
// memory.gc_threshold is set: its garbage collection works against a fraction).
void apply_memory_limit(int64_t limit_mib, double gc_threshold, const c10::Device& device);

// FLOP/s that MFU is a fraction of, and where the figure came from: log.peak_tflops, else NVIDIA's data
// sheet for a known GPU at this precision; {0, ""} when unknown (a CPU).
std::pair<double, std::string> peak_flops(double configured_tflops, const c10::Device& device, Precision precision);

// Bytes free for this run on the device: cudaMemGetInfo's free bytes on CUDA, MemAvailable of /proc/meminfo
// on the CPU; -1 when it cannot be read.
int64_t free_device_bytes(const c10::Device& device);

// The `--target` name of the device this run trains on, for the time model (step_time.h): a100-40gb | a100-80gb |
// h100-80gb | h200-141gb by the CUDA device's name and memory; "cpu:" for the CPU; "" for a GPU the table does not
// know (the time model then takes an H100's speeds and says so).
std::string target_name_of(const c10::Device& device);

// CUDA: the cuBLAS workspaces a training step leaves in the caching allocator. PyTorch keeps one per (cuBLAS
// handle, stream), of at::cuda::getChosenWorkspaceSize() bytes (CUBLAS_WORKSPACE_CONFIG; 32 MiB on Hopper, 8 MiB +
// 128 KiB before), and cuBLASLt uses the same one (unified by default); handles are per thread, and a step's GEMMs
// run on two threads: the forward on the caller's, the backward on autograd's device thread. 0 on other devices.
int64_t cublas_workspace_bytes(const c10::Device& device);

// A CPU without native bf16 (AVX512-BF16 or AMX) runs bf16 autocast in emulation, ~10-20x slower than fp32.
bool cpu_has_native_bf16();

}  // namespace memtrain
