#include "memtrain/runtime/step_profile.h"

#include <kineto/ActivityType.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <map>
#include <sstream>

#include "memtrain/core/error.h"

namespace memtrain {

namespace {

bool has(const std::string& lower, std::initializer_list<const char*> words) {
  return std::any_of(words.begin(), words.end(), [&](const char* w) { return lower.find(w) != std::string::npos; });
}

std::string ms(int64_t ns) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", static_cast<double>(ns) / 1e6);
  return buf;
}

std::string percent(int64_t part, int64_t whole) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", whole > 0 ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0);
  return buf;
}

std::vector<ProfileRow> largest_first(std::map<std::string, ProfileRow>&& by_name) {
  std::vector<ProfileRow> rows;
  rows.reserve(by_name.size());
  for (auto& [name, row] : by_name) rows.push_back(std::move(row));
  std::stable_sort(rows.begin(), rows.end(), [](const ProfileRow& a, const ProfileRow& b) { return a.self_ns > b.self_ns; });
  return rows;
}

}  // namespace

std::string profile_kind(const std::string& name) {
  std::string n(name);
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  // The order matters: attention kernels may name their GEMMs, norm kernels their reductions.
  if (has(n, {"nccl", "gloo", "c10d::", "all_reduce", "allreduce", "reduce_scatter", "all_gather", "allgather"}))
    return "communication";
  if (has(n, {"flash", "fmha", "sdpa", "attention", "attn", "scaled_dot_product"})) return "attention";
  if (has(n, {"softmax", "nll", "cross_entropy", "logsumexp"})) return "loss (softmax, cross-entropy)";
  if (has(n, {"layer_norm", "layernorm", "rms_norm", "rmsnorm"})) return "normalization";
  if (has(n, {"gemm", "cutlass", "nvjet", "xmma", "cublas", "aten::mm", "aten::bmm", "aten::addmm", "aten::matmul",
              "aten::baddbmm", "aten::linear"}))
    return "GEMM";
  if (has(n, {"adam", "sgd", "foreach", "multi_tensor", "_amp_"})) return "optimizer";
  if (has(n, {"memcpy", "memset", "copy", "fill", "cat", "clone", "zero", "index", "embedding", "gather", "scatter"}))
    return "copy, cast, fill";
  if (has(n, {"reduce", "aten::sum", "aten::mean", "aten::norm", "aten::max", "aten::min", "aten::amax"})) return "reduction";
  if (has(n, {"elementwise", "vectorized", "unrolled", "gelu", "silu", "tanh", "aten::add", "aten::mul", "aten::sub",
              "aten::div", "aten::pow", "aten::rsqrt", "aten::exp", "aten::where", "aten::neg", "aten::masked"}))
    return "elementwise";
  return "other";
}

StepProfileTable summarize_profile(const std::vector<ProfiledEvent>& events, bool device, int64_t wall_ns) {
  StepProfileTable t;
  t.device = device;
  t.wall_ns = wall_ns;
  std::vector<int64_t> self(events.size());
  for (size_t i = 0; i < events.size(); ++i) self[i] = std::max<int64_t>(0, events[i].end_ns - events[i].begin_ns);
  if (!device) {
    // Per thread, in order of start (the longer first where two start together): an open stack of spans; each event
    // is subtracted from the innermost span that still holds it.
    std::vector<size_t> order(events.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const auto &x = events[a], &y = events[b];
      if (x.thread != y.thread) return x.thread < y.thread;
      if (x.begin_ns != y.begin_ns) return x.begin_ns < y.begin_ns;
      return x.end_ns > y.end_ns;
    });
    std::vector<size_t> open;
    uint64_t thread = 0;
    for (size_t i : order) {
      const auto& e = events[i];
      if (open.empty() || e.thread != thread) open.clear(), thread = e.thread;
      while (!open.empty() && events[open.back()].end_ns <= e.begin_ns) open.pop_back();
      if (!open.empty() && e.end_ns <= events[open.back()].end_ns) self[open.back()] -= e.end_ns - e.begin_ns;
      open.push_back(i);
    }
  }
  std::map<std::string, ProfileRow> by_name, by_kind;
  for (size_t i = 0; i < events.size(); ++i) {
    auto& row = by_name[events[i].name];
    if (row.calls == 0) row.name = events[i].name, row.kind = profile_kind(row.name);
    row.calls += 1;
    row.self_ns += std::max<int64_t>(0, self[i]);
  }
  for (const auto& [name, row] : by_name) {
    auto& k = by_kind[row.kind];
    k.name = k.kind = row.kind;
    k.calls += row.calls;
    k.self_ns += row.self_ns;
    t.busy_ns += row.self_ns;
  }
  t.rows = largest_first(std::move(by_name));
  t.kinds = largest_first(std::move(by_kind));
  return t;
}

std::string StepProfileTable::markdown(size_t top) const {
  std::ostringstream o;
  const char* what = device ? "kernel, copy or set" : "ATen op";
  o << "# Step " << step << ": where the time went\n\n"
    << "The step took " << ms(wall_ns) << " ms from its start to its synchronised end (profiler on). "
    << (device ? "The GPU was busy " : "Host ops' self time summed ") << ms(busy_ns) << " ms ("
    << percent(busy_ns, wall_ns) << " of it)"
    << (device ? "." : "; with several threads the sum can pass the step's time.") << "\n\n"
    << "| kind | calls | ms | share |\n|---|---:|---:|---:|\n";
  for (const auto& k : kinds) o << "| " << k.kind << " | " << k.calls << " | " << ms(k.self_ns) << " | " << percent(k.self_ns, busy_ns) << " |\n";
  o << "\n| " << what << " | kind | calls | ms | mean us | share |\n|---|---|---:|---:|---:|---:|\n";
  for (size_t i = 0; i < rows.size() && i < top; ++i) {
    const auto& r = rows[i];
    std::string name = r.name;
    std::replace(name.begin(), name.end(), '|', '/');
    if (name.size() > 120) name = name.substr(0, 117) + "...";
    char mean[32];
    std::snprintf(mean, sizeof mean, "%.1f", static_cast<double>(r.self_ns) / 1e3 / static_cast<double>(std::max<int64_t>(1, r.calls)));
    o << "| `" << name << "` | " << r.kind << " | " << r.calls << " | " << ms(r.self_ns) << " | " << mean << " | "
      << percent(r.self_ns, busy_ns) << " |\n";
  }
  if (rows.size() > top) o << "\n(" << rows.size() - top << " more names, " << "in the trace)\n";
  return o.str();
}

std::string StepProfileTable::one_line() const {
  std::ostringstream o;
  o << (device ? "GPU busy " : "host ops ") << ms(busy_ns) << " of " << ms(wall_ns) << " ms";
  for (size_t i = 0; i < kinds.size() && i < 5; ++i) o << (i == 0 ? ": " : ", ") << kinds[i].kind << " " << percent(kinds[i].self_ns, busy_ns);
  return o.str();
}

namespace {
namespace prof = torch::profiler::impl;
std::set<prof::ActivityType> activities(bool cuda) {
  std::set<prof::ActivityType> a{prof::ActivityType::CPU};
  if (cuda) a.insert(prof::ActivityType::CUDA);
  return a;
}
}  // namespace

StepProfiler::StepProfiler(bool cuda) : cuda_(cuda) {
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
  torch::autograd::profiler::prepareProfiler(config, activities(cuda_));
  torch::autograd::profiler::enableProfiler(config, activities(cuda_));
}

StepProfiler::~StepProfiler() {
  if (!running_) return;
  try {  // left by an exception in the step: nothing to report, and a destructor must not throw
    torch::autograd::profiler::disableProfiler();
  } catch (...) {
  }
}

StepProfileTable StepProfiler::stop(const std::string& trace_path, int64_t wall_ns) {
  running_ = false;
  auto result = torch::autograd::profiler::disableProfiler();
  MEMTRAIN_CHECK(result != nullptr, Error, "[profile] the profiler returned no result");
  std::vector<ProfiledEvent> events;
  for (const auto& e : result->events()) {
    const auto type = static_cast<libkineto::ActivityType>(e.activityType());
    const bool on_device = type == libkineto::ActivityType::CONCURRENT_KERNEL || type == libkineto::ActivityType::GPU_MEMCPY ||
                           type == libkineto::ActivityType::GPU_MEMSET;
    if (cuda_ ? !on_device : type != libkineto::ActivityType::CPU_OP) continue;
    events.push_back({e.name(), e.startThreadId(), static_cast<int64_t>(e.startNs()), static_cast<int64_t>(e.endNs())});
  }
  result->save(trace_path);
  return summarize_profile(events, cuda_, wall_ns);
}

}  // namespace memtrain
