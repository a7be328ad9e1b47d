#include "memtrain/runtime/device.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/memory_snapshot.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <fstream>
#include <iostream>

#include "memtrain/core/cpu_memory.h"
#include "memtrain/core/error.h"

namespace memtrain {

namespace {
// Dense peak TFLOP/s (no sparsity) from NVIDIA's data sheets, by device name: half precision (bf16/fp16
// on tensor cores) and fp32 (no TF32). Longer names first: "A100" before "A10", "L40S" before "L4".
struct KnownPeak {
  const char* name;
  double half_tflops, fp32_tflops;
};
constexpr KnownPeak kKnownPeaks[] = {
    {"H100 PCIe", 756, 51}, {"H100", 989, 67},    {"H200", 989, 67},     {"A100", 312, 19.5}, {"A10", 125, 31.2},
    {"L40S", 362, 91.6},    {"L4", 121, 30.3},    {"RTX 4090", 165, 82.6}, {"V100", 125, 15.7},
};
}  // namespace

c10::Device resolve_device(const std::string& name, int local_rank) {
  if (name == "cpu") return c10::kCPU;
  const bool cuda = torch::cuda::is_available();
  if (name == "auto" && !cuda) return c10::Device(c10::kCPU);
  MEMTRAIN_CHECK(name == "cuda" || name == "auto", ConfigError, "[config] train.device = '", name, "': expected cpu | cuda | auto");
  MEMTRAIN_CHECK(cuda, ConfigError, "[config] train.device = cuda, but no CUDA device is available here; use cpu or auto");
  // LOCAL_RANK modulo the visible devices: where each task sees one GPU (Slurm's --gpus-per-task=1,
  // CUDA_VISIBLE_DEVICES set per rank) every rank takes cuda:0; where a node's ranks share its GPUs, each its own.
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank % static_cast<int>(torch::cuda::device_count())));
}

void configure_cuda_allocator(const MemoryConfig& m, const c10::Device& device, bool main) {
  const bool asked = m.snapshot || m.expandable_segments || m.gc_threshold > 0 || m.cuda_allocator != "native";
  if (!asked) return;
  MEMTRAIN_CHECK(device.is_cuda(), ConfigError, "[config] memory.snapshot, memory.expandable_segments, memory.gc_threshold "
                 "and memory.cuda_allocator set CUDA's caching allocator; this run is on ", device.str());
  // PYTORCH_CUDA_ALLOC_CONF's grammar, with only the keys the user set: sending a default would turn off what
  // the user exported (an expandable_segments:True of theirs, when memory.snapshot alone was asked).
  std::string settings;
  if (m.expandable_segments) settings = "expandable_segments:True";
  if (m.gc_threshold > 0)
    settings += std::string(settings.empty() ? "" : ",") + "garbage_collection_threshold:" + std::to_string(m.gc_threshold);
  if (m.cuda_allocator != "native") {
    // The backend is chosen once, when libc10_cuda initializes (before main() on the 2.11 wheel): setting
    // PYTORCH_CUDA_ALLOC_CONF now is too late and would be silently ignored. What was chosen is checked instead.
    const std::string chosen = c10::cuda::CUDACachingAllocator::name();
    MEMTRAIN_CHECK(chosen == m.cuda_allocator, ConfigError, "[config] memory.cuda_allocator = ", m.cuda_allocator,
                   ": this process's CUDA allocator is ", chosen, ", chosen when it started; start memtrain with "
                   "PYTORCH_CUDA_ALLOC_CONF=backend:", m.cuda_allocator, " exported");
    MEMTRAIN_CHECK(!m.snapshot, ConfigError, "[config] memory.snapshot needs the native allocator's history; "
                   "memory.cuda_allocator = ", m.cuda_allocator, " keeps none");
  }
  if (!settings.empty()) c10::CachingAllocator::setAllocatorSettings(settings);
  // The history memory_viz draws: every allocation and free with its stack, up to 100,000 entries. Each
  // stack's frames are symbolized when the snapshot is written; addr2line-style symbolization of every frame
  // takes minutes, dladdr (exported symbols) seconds: the user's own TORCH_SYMBOLIZE_MODE is kept.
  if (m.snapshot) {
    ::setenv("TORCH_SYMBOLIZE_MODE", "dladdr", /*overwrite=*/0);
    torch::cuda::_record_memory_history(std::string("all"), std::string("all"), "all", 100000);
  }
}

void apply_memory_limit(int64_t limit_mib, double gc_threshold, const c10::Device& device) {
  const int64_t limit = limit_mib * 1024 * 1024;
  if (device.is_cuda()) {
    if (limit > 0) {
      const double total = static_cast<double>(at::cuda::getDeviceProperties(device.index())->totalGlobalMem);
      c10::cuda::CUDACachingAllocator::setMemoryFraction(std::min(1.0, static_cast<double>(limit) / total), device.index());
    } else if (gc_threshold > 0) {
      // The caching allocator collects garbage only against a memory fraction: with none set, the whole device.
      c10::cuda::CUDACachingAllocator::setMemoryFraction(1.0, device.index());
    }
    return;
  }
  MEMTRAIN_CHECK(limit == 0 || cpu_memory::installed(), Error,
                 "[memory] memory.limit_mib on CPU needs memtrain::cpu_memory::install() at the start of main()");
  cpu_memory::set_limit(limit);
}

std::pair<double, std::string> peak_flops(double configured_tflops, const c10::Device& device, Precision p) {
  if (configured_tflops > 0) return {configured_tflops * 1e12, "log.peak_tflops"};
  if (!device.is_cuda()) return {0, ""};
  const std::string name = at::cuda::getDeviceProperties(device.index())->name;
  for (const auto& k : kKnownPeaks)
    if (name.find(k.name) != std::string::npos)
      return {(p == Precision::kFp32 ? k.fp32_tflops : k.half_tflops) * 1e12, name};
  return {0, ""};
}

std::string target_name_of(const c10::Device& device) {
  if (!device.is_cuda()) return "cpu:";
  const auto* props = at::cuda::getDeviceProperties(device.index());
  const std::string name = props->name;
  if (name.find("H200") != std::string::npos) return "h200-141gb";
  if (name.find("H100") != std::string::npos && name.find("PCIe") == std::string::npos) return "h100-80gb";
  if (name.find("A100") != std::string::npos) return props->totalGlobalMem > (60LL << 30) ? "a100-80gb" : "a100-40gb";
  return "";
}

int64_t free_device_bytes(const c10::Device& device) {
  if (device.is_cuda()) {
    size_t free = 0, total = 0;
    return cudaMemGetInfo(&free, &total) == cudaSuccess ? static_cast<int64_t>(free) : -1;
  }
  std::ifstream meminfo("/proc/meminfo");
  for (std::string key; meminfo >> key;) {
    int64_t kib = 0;
    meminfo >> kib;
    if (key == "MemAvailable:") return kib * 1024;
    meminfo.ignore(256, '\n');
  }
  return -1;
}

bool cpu_has_native_bf16() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("flags", 0) == 0) return line.find(" avx512_bf16") != std::string::npos || line.find(" amx_bf16") != std::string::npos;
  return true;  // unknown: say nothing
}

int64_t cublas_workspace_bytes(const c10::Device& device) {
  if (!device.is_cuda()) return 0;
  c10::cuda::CUDAGuard guard(device.index());
  return 2 * static_cast<int64_t>(at::cuda::getChosenWorkspaceSize());
}

}  // namespace memtrain
