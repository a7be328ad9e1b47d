#include "memtrain/runtime/planner.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <sstream>

#include "memtrain/core/config.h"
#include "memtrain/core/error.h"
#include "memtrain/core/memory_tracker.h"

namespace memtrain {

std::string PlanCandidate::describe() const {
  std::ostringstream o;
  o << "micro-batch " << micro_batch << " x " << accum_steps << ", recompute " << recompute << ", head " << head
    << ", stage " << stage;
  if (offload) o << " + offload";
  if (tensor_parallel > 1) o << ", tensor parallel " << tensor_parallel;
  if (!optimizer.empty()) o << ", train.optimizer " << optimizer;
  if (!quantize_base.empty()) o << ", lora.quantize_base " << quantize_base;
  return o.str();
}

void PlanCandidate::apply_to(Config& config) const {
  config.train.micro_batch = micro_batch, config.train.accum_steps = accum_steps;
  config.memory.recompute = recompute, config.memory.head = head;
  config.dist.zero_stage = stage, config.dist.offload_optimizer = offload ? "cpu" : "none";
  if (!optimizer.empty()) config.train.optimizer = optimizer;
  if (!quantize_base.empty()) config.lora.quantize_base = quantize_base;
  config.dist.tensor_parallel = tensor_parallel;
}

double recompute_fraction(const std::string& policy) {
  if (policy == "none") return 0;
  if (policy == "all") return 1;
  if (policy == "attn") return 1.0 / 3;
  if (policy == "mlp") return 2.0 / 3;
  if (policy.rfind("every:", 0) == 0) return 1.0 / std::max(1.0, std::stod(policy.substr(6)));
  return 1;  // budget:MiB: at most all
}

double plan_step_cost(int64_t micro_batch, int64_t accum_steps, double recompute_fraction, int stage, double comm_share,
                      bool offload) {
  // Forward 1, backward 2: recomputing a fraction r of the forward adds r / 3 of the compute.
  const double compute = static_cast<double>(accum_steps) * static_cast<double>(micro_batch + 1) * (1 + recompute_fraction / 3);
  const double samples = static_cast<double>(accum_steps * micro_batch);
  const double comm = comm_share * (samples + 1) * (stage == 3 ? 1.5 : 1.0);
  return (compute + comm) * (offload ? 2.0 : 1.0);
}

double offload_step_ms(int64_t stepped_elements, int64_t grad_bytes_per_element, int64_t param_bytes_per_element,
                       double cpu_update_ns_per_element, double link_bytes_per_s) {
  const double n = static_cast<double>(stepped_elements);
  const double copies = n * static_cast<double>(grad_bytes_per_element + param_bytes_per_element) / link_bytes_per_s;
  return n * cpu_update_ns_per_element * 1e-6 + copies * 1e3;
}

double time_cpu_update() {
  torch::NoGradGuard no_grad;
  constexpr int64_t n = 1 << 20;
  auto f = torch::TensorOptions().dtype(torch::kFloat);
  std::vector<torch::Tensor> p{torch::zeros({n}, f)}, g{torch::full({n}, 1e-3, f)}, m{torch::zeros({n}, f)},
      v{torch::zeros({n}, f)}, step{torch::zeros({}, f)};
  double best = 1e30;
  for (int i = 0; i < 4; ++i) {  // the first warms the kernel and the pages
    const auto t0 = std::chrono::steady_clock::now();
    torch::_foreach_add_(step, 1);
    at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, step, 1e-3, 0.9, 0.999, 0.0, 1e-8, false, false);
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0) best = std::min(best, ns);
  }
  return best / static_cast<double>(n);
}

namespace {
// The largest part of an estimate, by name: what dominates its peak.
std::string dominant(const MemoryParts& p) {
  const std::pair<const char*, int64_t> parts[] = {{"parameters", p.params},
                                                   {"gradients", p.grads},
                                                   {"optimizer state", p.optimizer_state},
                                                   {"data", p.data},
                                                   {"activations", p.activations},
                                                   {"gathered parameters", p.gathered},
                                                   {"gradient buckets in flight", p.buckets_in_flight}};
  const auto* best = &parts[0];
  for (const auto& x : parts)
    if (x.second > best->second) best = &x;
  std::ostringstream o;
  o << best->first << " (" << format_bytes(best->second) << " of " << format_bytes(p.peak()) << ")";
  return o.str();
}
}  // namespace

Plan choose_plan(std::vector<PlanCandidate> candidates, int64_t budget_bytes, double headroom) {
  MEMTRAIN_CHECK(!candidates.empty(), Error, "[planner] no candidate settings to choose from");
  MEMTRAIN_CHECK(headroom >= 0 && headroom < 1, Error, "[planner] headroom ", headroom, " is outside [0, 1)");
  Plan plan;
  plan.budget_bytes = budget_bytes;
  plan.headroom = headroom;
  const auto usable = plan.usable_bytes();
  plan.considered = static_cast<int64_t>(candidates.size());
  std::stable_sort(candidates.begin(), candidates.end(), [](const PlanCandidate& a, const PlanCandidate& b) {
    if (a.lowbit_rank != b.lowbit_rank) return a.lowbit_rank < b.lowbit_rank;
    if (a.step_ms != b.step_ms) return a.step_ms < b.step_ms;
    return a.estimate.peak_device() < b.estimate.peak_device();
  });
  std::vector<PlanCandidate> fit;
  // A setting fits when its training peak and its setup's peak both do (memory_estimate.h, SetupPeak).
  for (const auto& c : candidates)
    if (std::max(c.estimate.peak_device(), c.estimate.setup.device) <= usable) fit.push_back(c);
  if (fit.empty()) {
    auto needs = [](const PlanCandidate& c) { return std::max(c.estimate.peak_device(), c.estimate.setup.device); };
    const auto smallest = *std::min_element(candidates.begin(), candidates.end(), [&](const auto& a, const auto& b) {
      return needs(a) < needs(b);
    });
    const double mib = static_cast<double>(needs(smallest)) / (1024.0 * 1024.0);
    std::ostringstream need;
    need << std::fixed << std::setprecision(1) << mib;
    const auto feasible = static_cast<int64_t>(std::ceil(mib / (1 - headroom)));
    throw ConfigError("[planner] memory.budget_mib = " + std::to_string(budget_bytes / (1024 * 1024)) +
                      " cannot be met: the smallest estimated peak of " + std::to_string(plan.considered) +
                      " settings is " + need.str() + " MiB (" + smallest.describe() + "), dominated by " +
                      (smallest.estimate.setup.device > smallest.estimate.peak_device()
                           ? "its setup (" + smallest.estimate.setup.terms + ")"
                           : dominant(smallest.estimate.device)) + "; the smallest feasible budget is memory.budget_mib = " +
                      std::to_string(feasible) + (headroom > 0 ? " (with memory.budget_headroom = " + format_shortest(headroom) + ")" : std::string()) +
                      " (or shard more: more ranks with dist.zero_stage = 3, dist.offload_optimizer = cpu on a GPU)");
  }
  plan.fitting = static_cast<int64_t>(fit.size());
  plan.chosen = fit.front();
  for (size_t i = 1; i < fit.size() && plan.runners_up.size() < 3; ++i) plan.runners_up.push_back(fit[i]);
  return plan;
}

std::string Plan::explain() const {
  std::ostringstream o;
  auto line = [&](const char* tag, const PlanCandidate& c) {
    o << "  " << tag << c.describe() << ": estimated peak " << format_bytes(c.estimate.peak_device()) << " (setup "
      << format_bytes(c.estimate.setup.device) << "), ";
    if (timing == "relative")
      o << "relative cost " << std::fixed << std::setprecision(1) << c.step_ms << " (no closed form to time)\n";
    else if (timing == "probe")
      o << "step " << std::fixed << std::setprecision(1) << c.step_ms << " ms (from the probe's timings)\n";
    else
      o << "step " << std::fixed << std::setprecision(1) << c.step_ms << " ms, " << std::setprecision(0)
        << c.tokens_per_s << " tokens/s (the time model)\n";
  };
  o << "plan for a budget of " << format_bytes(budget_bytes) << " per rank (memory.budget_mib";
  if (headroom > 0)
    o << "; estimates up to " << format_bytes(usable_bytes())
      << ", memory.budget_headroom = " << format_shortest(headroom) << " kept for the estimate's error";
  o << "; " << fitting << " of " << considered << " settings fit; the fastest is chosen):\n";
  line("chosen:    ", chosen);
  for (const auto& r : runners_up) line("runner-up: ", r);
  if (timing == "model") o << "  time model: " << speed_source << " (docs/ESTIMATE.md, \"Step time\")\n";
  if (!chosen.optimizer.empty())
    o << "  train.optimizer = " << chosen.optimizer << " (memory.allow_lowbit_optimizer = true): no setting with "
      << (chosen.lowbit_rank == 1 ? "fp32" : "fp32 or (where its blocks fit) 8-bit") << " moments fits; the moments are stored blockwise-"
      << "quantized, which changes the numerics\n";
  return o.str();
}

}  // namespace memtrain
