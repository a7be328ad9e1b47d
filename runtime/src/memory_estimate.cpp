#include "memtrain/runtime/memory_estimate.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <functional>
#include <numeric>
#include <sstream>

#include "memtrain/core/error.h"
#include "memtrain/core/memory_tracker.h"
#include "memtrain/distributed/data_parallel.h"

namespace memtrain {

int64_t ActivationProbe::at(int64_t m) const {
  const auto m0 = micro_batch[0], m1 = micro_batch[1];
  if (m0 <= 0) return 0;
  if (m1 == m0) return bytes[0] * m / m0;  // one point: proportional
  // The line through both points; from the first point on, never below the smaller of the two (a line
  // falling with the batch is noise), and never below zero.
  const double slope = static_cast<double>(bytes[1] - bytes[0]) / static_cast<double>(m1 - m0);
  const double v = static_cast<double>(bytes[0]) + slope * static_cast<double>(m - m0);
  return std::max<int64_t>(static_cast<int64_t>(v), std::min(bytes[0], bytes[1]) * (m >= m0 ? 1 : 0));
}

double ActivationProbe::ms_at(int64_t m) const {
  const auto m0 = micro_batch[0], m1 = micro_batch[1];
  if (m0 <= 0) return 0;
  if (m1 == m0) return ms[0] * static_cast<double>(m) / static_cast<double>(m0);
  const double slope = (ms[1] - ms[0]) / static_cast<double>(m1 - m0);
  return std::max(0.0, ms[0] + slope * static_cast<double>(m - m0));
}

namespace {
// Optimizer moments of `stepped` elements: the quantized share at its bytes per element, the rest at state_bytes.
// `p`: the trainable elements.
int64_t moment_bytes(const EstimateInputs& in, int64_t p, int64_t stepped) {
  // (in doubles: quantized_elements x stepped overflows int64 past ~3e9 parameters)
  const int64_t q = p == 0 ? 0
                           : std::clamp<int64_t>(std::llround(static_cast<double>(in.quantized_elements) /
                                                              static_cast<double>(p) * static_cast<double>(stepped)),
                                                 0, stepped);
  return in.state_bytes * (stepped - q) + static_cast<int64_t>(std::llround(in.quantized_state_bytes * static_cast<double>(q)));
}

// Offload from a GPU: what the CUDA host allocator adds to the optimizer state on top of the bytes asked for.
// Pinned host blocks are rounded up to a power of two by the CUDA host allocator (CachingHostAllocator::
// allocate): each bucket's stepped part and reduced part is a block of its own. Buckets close near
// dist.bucket_mib (stage 3: within a unit), so each unit is taken as that many equal buckets.
int64_t pinned_rounding_bytes(const EstimateInputs& in, int64_t p, int64_t n, int64_t bucket, int64_t reduced,
                              int64_t reduced_bytes) {
  const int64_t pb = in.param_bytes;
  auto pow2_ceil = [](int64_t x) {
    int64_t v = 1;
    while (v < x) v <<= 1;
    return x > 0 ? v : 0;
  };
  std::vector<int64_t> units = {p};
  if (in.stage == 3) units = in.block_elements, units.push_back(in.root_elements);
  const int64_t stepped_bytes = in.master_weights ? 4 : pb;
  int64_t rounding = 0;
  for (const auto u : units) {
    if (u <= 0) continue;
    const int64_t k = std::max<int64_t>(1, (u * pb + bucket - 1) / bucket);  // buckets in the unit
    const int64_t shard = (u + k * n - 1) / (k * n);                      // elements of one bucket's part
    rounding += k * (pow2_ceil(shard * stepped_bytes) - shard * stepped_bytes);
    if (reduced > 0) rounding += k * (pow2_ceil(shard * reduced_bytes) - shard * reduced_bytes);
  }
  return rounding;
}

// Stage 3: the root for the whole step, and the 1 + prefetch largest blocks at once.
// What does not train is gathered with its unit.
int64_t gathered_bytes(const EstimateInputs& in) {
  const int64_t pb = in.param_bytes;
  auto sizes = in.block_elements;
  for (size_t b = 0; b < in.frozen_block_elements.size() && b < sizes.size(); ++b) sizes[b] += in.frozen_block_elements[b];
  std::sort(sizes.begin(), sizes.end(), std::greater<>());
  const auto held = std::min<int64_t>(1 + in.prefetch, static_cast<int64_t>(sizes.size()));
  return (in.root_elements + in.frozen_root_elements +
          std::accumulate(sizes.begin(), sizes.begin() + held, int64_t{0})) * pb;
}

// Several ranks (or offload): parameters, gradients and optimizer state of `p` trainable elements, of which this
// rank holds `part` and steps `stepped`. `state_home`: where the optimizer state lives (`dev`, or the host).
void estimate_sharded_states(const EstimateInputs& in, int64_t p, int64_t part, int64_t stepped, MemoryParts& dev,
                             MemoryParts& state_home) {
  const int64_t n = std::max(1, in.world);
  const int64_t pb = in.param_bytes;
  const int64_t reduced_bytes = in.master_weights ? 4 : pb;  // the reduced gradient is the stepped tensor's dtype
  dev.params = (in.stage == 3 ? part + (in.frozen_elements + n - 1) / n : p + in.frozen_elements) * pb;
  // Full-size gradient buckets stay allocated in stages 0 and 1 (views the backward accumulates into);
  // stage 1 also holds this rank's reduced part (offload: beside the optimizer state). In stages 2-3 it
  // exists only from the bucket's first reduction to the optimizer step: not at the activation peak (the
  // backward's start), where only the buckets in flight are.
  if (in.stage <= 1) dev.grads = p * pb;
  // ... unless it is reduced after every micro-batch of several: then it is made in the first and held
  // through the later ones' forwards.
  const bool held_across = in.accum_steps > 1 && reduces_each_micro_batch(in.stage, in.reduce_every_micro_batch);
  const int64_t reduced = in.stage == 0                  ? (in.master_weights ? 4 * p : 0)
                          : in.stage >= 2 && !held_across ? 0
                                                          : part * reduced_bytes;
  int64_t state = moment_bytes(in, p, stepped);
  if (in.master_weights) state += 4 * stepped;
  if (in.offload) {
    // The stepped copy of the parameters' part (without masters) and the reduced gradient move to the host.
    if (!in.master_weights) state += pb * stepped;
    state += reduced;
  } else {
    dev.grads += reduced;
  }
  const int64_t bucket = static_cast<int64_t>(in.bucket_mib * 1024 * 1024);
  if (in.offload && in.cuda) state += pinned_rounding_bytes(in, p, n, bucket, reduced, reduced_bytes);
  state_home.optimizer_state = state;
  if (in.stage >= 2) {
    // The largest bucket: at most bucket_mib, and in stage 3 at most one unit.
    int64_t largest = p * pb;
    if (in.stage == 3) {
      largest = in.root_elements * pb;
      for (auto b : in.block_elements) largest = std::max(largest, b * pb);
    }
    dev.buckets_in_flight = std::min(bucket, largest);
  }
  if (in.stage == 3) dev.gathered = gathered_bytes(in);
}

// The step's activations (and the cuBLAS workspaces) on the device; returns how they were found.
// `sharded`: several ranks or offload; `p`: the trainable elements.
std::string estimate_activations(const EstimateInputs& in, bool sharded, int64_t p, MemoryParts& dev) {
  const int64_t pb = in.param_bytes;
  if (in.budget_bytes >= 0) {
    dev.activations = in.budget_bytes;
    dev.workspace = in.workspace_bytes;
    return "memory.recompute = budget: activations held to the budget (" + format_bytes(in.budget_bytes) + ")";
  }
  if (!in.probe.measured())
    return "model states only (activations not measured: memory.track = false or no counting allocator)";
  dev.activations = in.probe.at(in.micro_batch);
  if (!sharded && in.accum_steps > 1 && in.probe_dropped.measured()) {
    // Micro-batches after the first: the gradients (the fp32 masters' with master weights; bf16 ones are
    // freed after each micro-batch) are already there, and the backward adds into them.
    const int64_t resident_grads = in.master_weights ? 4 * p : pb * p;
    dev.activations = std::max(dev.activations, in.probe_dropped.at(in.micro_batch) + resident_grads);
  }
  std::ostringstream m;
  if (!in.probe.closed_form.empty()) {
    m << "activations in closed form at micro-batch " << in.micro_batch << ", peak at " << in.probe.closed_form
      << " (docs/ESTIMATE.md); model states from element counts";
  } else {
    m << "activations measured at micro-batch " << in.probe.micro_batch[0];
    if (in.probe.micro_batch[1] != in.probe.micro_batch[0]) m << " and " << in.probe.micro_batch[1];
    m << ", extrapolated linearly to " << in.micro_batch << "; model states from element counts";
  }
  // The workspaces come with the first GEMM of each thread: inside a probe's measurement (if it is the
  // process's first), never inside the closed form.
  if (!in.probe.closed_form.empty()) dev.workspace = in.workspace_bytes;
  return m.str();
}
}  // namespace

namespace {
SetupPeak setup_peak(const EstimateInputs& in, bool sharded, int64_t stepped, const MemoryParts& dev, const MemoryParts& host) {
  // What the rank holds once set up: its parameters (the parts under ZeRO-3, else whole) and the fp32 masters it
  // steps (where they live); the moments come with the first step, the gradients with the first backward.
  const int64_t masters = in.master_weights ? 4 * stepped : in.offload ? in.param_bytes * stepped : 0;
  const int64_t masters_on_device = in.offload && in.cuda ? 0 : masters;
  // Transients: DataParallel lays out one bucket at a time (at most bucket_mib, or one tensor above it); the fill
  // holds one tensor's fp32 values on the host and, with init_from, its read (at most as many bytes again).
  // A bucket closes once it reaches bucket_mib (so it may pass it by one tensor) and never holds more than its
  // unit: the whole model, or at stage 3 one block or the root.
  const int64_t largest = in.largest_elements;
  const int64_t blocks = std::accumulate(in.block_elements.begin(), in.block_elements.end(), int64_t{0});
  const int64_t unit = in.stage == 3 ? std::max(in.root_elements, in.block_elements.empty() ? int64_t{0}
                                                    : *std::max_element(in.block_elements.begin(), in.block_elements.end()))
                                     : blocks + in.root_elements;
  const int64_t cap = static_cast<int64_t>(in.bucket_mib * 1024 * 1024) / std::max<int64_t>(1, in.param_bytes) + largest;
  const int64_t bucket = sharded ? std::max(std::min(unit, cap), largest) * in.param_bytes : 0;
  const int64_t values = 8 * largest;
  SetupPeak s;
  s.device = dev.params + masters_on_device + bucket + (in.cuda ? 4 * largest : 0);
  s.host = in.cuda ? host.data + (masters - masters_on_device) + values : 0;
  if (!in.cuda) s.device += dev.data + values;
  s.terms = detail::concat("parameters ", format_bytes(dev.params), ", fp32 masters ", format_bytes(masters),
                           ", one bucket ", format_bytes(bucket), ", one tensor's values ", format_bytes(values),
                           ", data ", format_bytes(in.cuda ? host.data : dev.data));
  return s;
}
}  // namespace

MemoryEstimate estimate_memory(const EstimateInputs& in) {
  MemoryEstimate e;
  e.cuda = in.cuda;
  const int64_t n = std::max(1, in.world);
  const int64_t pb = in.param_bytes;
  const int64_t blocks = std::accumulate(in.block_elements.begin(), in.block_elements.end(), int64_t{0});
  const int64_t p = blocks + in.root_elements;
  const bool sharded = in.world > 1 || in.offload || in.tensor_parallel;
  // Rank r steps elements [r S, (r + 1) S) of every bucket (padded to a multiple of N): about P / N.
  const int64_t part = (p + n - 1) / n;
  const int64_t stepped = !sharded || in.stage == 0 ? p : part;

  MemoryParts dev, host;
  MemoryParts& state_home = in.offload && in.cuda ? host : dev;  // offload: the stepped part lives in host memory
  if (!sharded) {
    // One process: gradients are set to none at each step's start and born during backward (the probe
    // measured them with the activations); the masters' gradients too.
    dev.params = (p + in.frozen_elements) * pb;
    dev.optimizer_state = moment_bytes(in, p, p) + (in.master_weights ? 4 * p : 0);
  } else {
    estimate_sharded_states(in, p, part, stepped, dev, state_home);
  }
  (in.cuda ? host : dev).data = in.data_bytes;
  e.method = estimate_activations(in, sharded, p, dev);
  e.device = dev;
  e.host = host;
  e.setup = setup_peak(in, sharded, stepped, dev, host);
  return e;
}

std::string MemoryEstimate::table() const {
  std::ostringstream out;
  auto line = [&](const char* what, int64_t d, int64_t h) {
    if (d == 0 && h == 0) return;
    out << "  " << what << std::string(20 - std::string(what).size(), ' ') << format_bytes(d);
    if (cuda) out << "  (host " << format_bytes(h) << ")";
    out << "\n";
  };
  line("parameters", device.params, host.params);
  line("gradients", device.grads, host.grads);
  line("optimizer state", device.optimizer_state, host.optimizer_state);
  line("data", device.data, host.data);
  line("activations", device.activations, host.activations);
  line("gathered (ZeRO-3)", device.gathered, host.gathered);
  line("bucket in flight", device.buckets_in_flight, host.buckets_in_flight);
  line("cuBLAS workspaces", device.workspace, host.workspace);
  out << "  peak                " << format_bytes(device.peak()) << (cuda ? " on the device, host " + format_bytes(host.peak()) : "")
      << "\n  setup peak          " << format_bytes(setup.device) << (cuda ? " on the device, host " + format_bytes(setup.host) : "")
      << " (before step 1: " << setup.terms << ")\n  (" << method << ")\n";
  return out.str();
}

std::string MemoryEstimate::to_json() const {
  auto parts = [](const MemoryParts& p) {
    return nlohmann::json{{"params", p.params},           {"grads", p.grads},
                          {"optimizer_state", p.optimizer_state}, {"data", p.data},
                          {"activations", p.activations}, {"gathered", p.gathered},
                          {"buckets_in_flight", p.buckets_in_flight}, {"workspace", p.workspace},
                          {"peak", p.peak()}};
  };
  nlohmann::json j = {{"device", parts(device)}, {"method", method}, {"setup", {{"device", setup.device}, {"host", setup.host}}}};
  if (cuda) j["host"] = parts(host);
  return j.dump();
}

Target parse_target(const std::string& spec) {
  // memory.total in MiB as nvidia-smi prints it for each product (SXM parts; PCIe a100-40gb reports 40,960 too).
  static const std::vector<std::pair<std::string, int64_t>> gpus = {
      {"a100-40gb", 40960}, {"a100-80gb", 81920}, {"h100-80gb", 81559}, {"h200-141gb", 143771}};
  for (const auto& [name, mib] : gpus)
    if (spec == name) return {name, true, mib * (int64_t{1} << 20)};
  auto number = [&](const std::string& text, int64_t unit) -> int64_t {
    size_t used = 0;
    double v = -1;
    try {
      v = std::stod(text, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    MEMTRAIN_CHECK(used == text.size() && v > 0, ConfigError, "[estimate] --target '", spec, "': '", text,
                   "' is not a positive number");
    return static_cast<int64_t>(v * static_cast<double>(unit));
  };
  if (spec.rfind("cpu:", 0) == 0) {
    const auto size = spec.substr(4);
    for (const auto& [suffix, unit] : std::vector<std::pair<std::string, int64_t>>{
             {"GiB", int64_t{1} << 30}, {"GB", 1000000000}, {"MiB", int64_t{1} << 20}})
      if (size.size() > suffix.size() && size.compare(size.size() - suffix.size(), suffix.size(), suffix) == 0)
        return {spec, false, number(size.substr(0, size.size() - suffix.size()), unit)};
    throw ConfigError("[estimate] --target '" + spec + "': a host's memory is cpu:<N>GiB, cpu:<N>GB or cpu:<N>MiB");
  }
  if (!spec.empty() && std::isdigit(static_cast<unsigned char>(spec[0]))) return {spec, true, number(spec, 1)};
  std::string names;
  for (const auto& [name, mib] : gpus) names += (names.empty() ? "" : " | ") + name;
  throw ConfigError("[estimate] unknown --target '" + spec + "'; expected " + names + " | cpu:<N>GiB | a byte count");
}

}  // namespace memtrain
