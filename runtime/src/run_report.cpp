#include "memtrain/runtime/run_report.h"

#include <torch/cuda.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "memtrain/core/files.h"
#include "memtrain/distributed/rank_agreement.h"
#include "memtrain/runtime/device.h"
#include "memtrain/runtime/trainer.h"
#include "stop_signals.h"

namespace memtrain {

namespace fs = std::filesystem;

struct RunReport::Summary {
  nlohmann::json json;
};

namespace {

// 42s, 3m10s, 1h02m.
std::string duration_text(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s < 60) std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(s));
  else if (s < 3600) std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  else std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(s / 3600), static_cast<long long>(s / 60 % 60));
  return buf;
}

// 1.2k, 3.4M, 5.6G.
std::string si(double v) {
  std::ostringstream os;
  const char* suffix = "";
  if (v >= 1e9) v /= 1e9, suffix = "G";
  else if (v >= 1e6) v /= 1e6, suffix = "M";
  else if (v >= 1e3) v /= 1e3, suffix = "k";
  os << std::fixed << std::setprecision(1) << v << suffix;
  return os.str();
}

// Every rank's memory summary, for rank 0's table: fixed-size rows of int64 (at most two devices per rank, the
// CPU and its GPU), gathered. Collective when there are ranks.
std::vector<MemoryTracker::Summary> gather_memory_summaries(Trainer& t) {
  auto mine = t.tracker().summaries();
  const auto ranks = t.agreement();
  if (ranks.world() == 1) return mine;
  constexpr int64_t kRows = 2, kFields = 12;
  auto local = torch::zeros({kRows, kFields}, torch::kLong);
  for (size_t i = 0; i < mine.size() && i < static_cast<size_t>(kRows); ++i) {
    const auto& m = mine[i];
    const auto dev = c10::Device(m.device);
    const int64_t row[kFields] = {1, dev.is_cuda(), dev.has_index() ? dev.index() : 0, m.steps, m.max_peak,
                                  m.max_reserved, m.first_activation, m.steady_activation, static_cast<int64_t>(m.max_phase),
                                  m.resident.params, m.resident.grads, m.resident.optimizer_state};
    for (int64_t f = 0; f < kFields; ++f) local[static_cast<int64_t>(i)][f] = row[f];
  }
  const auto host = ranks.gather_rows(local);  // (world, kRows, kFields)
  std::vector<MemoryTracker::Summary> rows;
  for (int64_t r = 0; r < ranks.world(); ++r) {
    for (int64_t i = 0; i < kRows; ++i) {
      auto v = host[r][i];
      if (v[0].item<int64_t>() == 0) continue;
      MemoryTracker::Summary m;
      m.rank = static_cast<int>(r);
      m.device = v[1].item<int64_t>() ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(v[2].item<int64_t>())).str()
                                      : std::string("cpu");
      m.steps = v[3].item<int64_t>(), m.max_peak = v[4].item<int64_t>(), m.max_reserved = v[5].item<int64_t>();
      m.first_activation = v[6].item<int64_t>(), m.steady_activation = v[7].item<int64_t>();
      m.max_phase = static_cast<Phase>(v[8].item<int64_t>());
      m.resident.params = v[9].item<int64_t>(), m.resident.grads = v[10].item<int64_t>();
      m.resident.optimizer_state = v[11].item<int64_t>();
      m.resident.data = m.device == "cpu" ? t.data().resident_bytes() : 0;  // every rank holds the same dataset
      rows.push_back(m);
    }
  }
  return rows;
}

}  // namespace

std::string RunReport::metrics_file(const std::string& run_dir) { return (fs::path(run_dir) / "metrics.jsonl").string(); }
std::string RunReport::summary_file(const std::string& run_dir) { return (fs::path(run_dir) / "summary.json").string(); }
std::string RunReport::run_dir(const std::string& log_dir, const std::string& log_name, const std::string& config_source) {
  const auto name = !log_name.empty() ? log_name : config_source.empty() ? std::string("run") : fs::path(config_source).stem().string();
  return (fs::path(log_dir) / name).string();
}
std::string RunReport::write_evaluation(Trainer& trainer, const EvalResult& e, const std::string& weights) {
  const auto& config = trainer.config();
  const auto dir = fs::path(trainer.run_dir() + "-eval");
  fs::create_directories(dir);
  std::ostringstream json;
  json << "{\n  \"mode\": \"eval\",\n  \"model\": \"" << trainer.model().describe() << "\",\n  \"init_from\": \""
       << config.model.init_from << "\",\n  \"weights\": \"" << weights << "\",\n  \"val_loss\": " << format_shortest(e.loss)
       << ",\n  \"val_samples\": " << e.samples << ",\n  \"val_tokens\": " << e.samples * trainer.model().tokens_per_sample()
       << "\n}\n";
  const auto path = summary_file(dir.string());
  write_file_atomically(path, json.str());
  return path;
}
std::string RunReport::config_file(const std::string& run_dir) { return (fs::path(run_dir) / "config.ini").string(); }
std::string RunReport::memory_file(const std::string& run_dir, int rank) {
  return (fs::path(run_dir) / ("memory.rank" + std::to_string(rank) + ".jsonl")).string();
}
namespace {
// A file every rank writes: `name` alone in one process, name.rank<N> with several.
std::string per_rank(const std::string& run_dir, const std::string& name, int rank, int world) {
  return (fs::path(run_dir) / (world == 1 ? name : name + ".rank" + std::to_string(rank))).string();
}
}  // namespace

std::string RunReport::trace_file(const std::string& run_dir, int rank, int world) {
  return per_rank(run_dir, "trace", rank, world) + ".json";
}
std::string RunReport::profile_stem(const std::string& run_dir, int rank, int world) {
  return per_rank(run_dir, "profile", rank, world);
}
std::string RunReport::snapshot_file(const std::string& run_dir, int rank) {
  return (fs::path(run_dir) / ("memory_snapshot.rank" + std::to_string(rank) + ".pickle")).string();
}

RunReport::RunReport(Trainer& trainer) : t_(trainer), summary_(std::make_unique<Summary>()) {
  const auto& c = t_.config();
  const auto& tr = c.train;
  const auto& world = t_.world();
  main_ = world.is_main();
  bar_ = c.log.progress == "bar" || (c.log.progress == "auto" && isatty(STDOUT_FILENO));
  peak_ = peak_flops(c.log.peak_tflops, t_.device(), t_.precision());
  measured_device_ = t_.memory_device().str();
  std::error_code ec;
  fs::create_directories(t_.run_dir(), ec);  // fit() probed it; an embedder's loop may not have
  if (main_) {
    std::cout << c.to_ini() << "\n";
    write_file_atomically(config_file(t_.run_dir()), c.to_ini());
    std::cout << "model:      " << t_.model().describe() << "\n"
              << "data:       " << t_.data().describe() << "\n"
              << "device:     " << t_.device().str() << ", precision " << precision_name(t_.precision()) << ", "
              << at::get_num_threads() << " threads\n"
              << "batch:      " << tr.micro_batch << " x " << tr.accum_steps << " micro-batches x " << t_.dims().dp
              << (t_.dims().tp > 1 ? " data-parallel" : "") << (t_.dims().dp == 1 ? " rank" : " ranks") << " = " << tr.micro_batch * tr.accum_steps * t_.dims().dp
              << " samples per step\n"
              << "recompute:  " << t_.recompute_policy().describe() << "; head " << c.memory.head << "\n"
              << "MFU peak:   "
              << (peak_.first > 0 ? si(peak_.first) + "FLOP/s (" + peak_.second + ")"
                                  : std::string("unknown: no MFU (set log.peak_tflops to report it)"))
              << "\n"
              << (t_.data_parallel() ? "parallel:   " + t_.data_parallel()->describe() + "\n" : std::string())
              << "run folder: " << t_.run_dir() << "\n";
    if (c.memory.track && c.memory.estimate)
      std::cout << "memory estimate per rank, " << measured_device_ << ":\n" << t_.memory_estimate().table();
    std::cout << std::flush;
  }
  // A resumed run appends to its logs; a fresh one starts them (the trace covers this life of the run).
  const bool resumed = !t_.resumed_from().empty();
  t_.tracker().record_trace(c.log.trace);
  trace_path_ = trace_file(t_.run_dir(), world.rank, world.world_size);
  if (c.memory.track) t_.tracker().write_jsonl(memory_file(t_.run_dir(), world.rank), /*append=*/resumed);
  if (main_) {
    metrics_.open(metrics_file(t_.run_dir()), resumed ? std::ios::app : std::ios::trunc);
    if (resumed)
      metrics_ << nlohmann::json({{"event", "resumed"}, {"step", t_.current_step()}, {"checkpoint", t_.resumed_from()}}).dump()
               << "\n";
  }
  // Tensor parallel: the T ranks of a group train on the same samples.
  samples_per_step_ = static_cast<double>(tr.micro_batch * tr.accum_steps * t_.dims().dp);
  tokens_per_step_ = samples_per_step_ * static_cast<double>(t_.model().tokens_per_sample());
  run_start_ = last_log_time_ = first_log_time_ = Clock::now();
  start_step_ = last_logged_step_ = t_.current_step();
}

RunReport::~RunReport() = default;

RunReport::Rates RunReport::rates(double steps, double seconds) const {
  Rates r;
  r.samples_per_s = samples_per_step_ * steps / seconds;
  r.tokens_per_s = tokens_per_step_ * steps / seconds;
  // Achieved FLOP/s (all ranks), and MFU as a fraction of their peak. 0: the model's FLOPs are unknown.
  // (Tensor parallel: the model's FLOPs are its slice's, about 1/T of the whole; each of the T ranks does them.)
  r.flops_per_s = samples_per_step_ * t_.model().train_flops_per_sample() * t_.dims().tp * steps / seconds;
  r.mfu = peak_.first > 0 ? r.flops_per_s / (peak_.first * t_.world().world_size) : 0;
  return r;
}

double RunReport::estimate_error(int64_t measured) const {
  return (static_cast<double>(t_.memory_estimate().peak_device()) - static_cast<double>(measured)) / static_cast<double>(measured);
}

std::string RunReport::against_estimate(int64_t measured) const {
  std::ostringstream o;
  o << format_bytes(measured) << " (estimate " << format_bytes(t_.memory_estimate().peak_device()) << ", " << std::showpos
    << std::fixed << std::setprecision(1) << 100 * estimate_error(measured) << std::noshowpos << "%)";
  return o.str();
}

std::string RunReport::timing() const {
  // Elapsed time in this loop and the time left at its mean pace so far (evaluations and saves included).
  const int64_t step = t_.current_step(), steps = t_.config().train.steps;
  const double elapsed = std::chrono::duration<double>(Clock::now() - run_start_).count();
  std::string eta = "?";
  if (step - start_step_ >= 2) eta = duration_text(elapsed / static_cast<double>(step - start_step_) * static_cast<double>(steps - step));
  return "elapsed " + duration_text(elapsed) + " | ETA " + eta;
}

void RunReport::step(const StepResult& r) {
  const auto& c = t_.config();
  const int64_t step = t_.current_step(), steps = c.train.steps;
  if (step1_peak_ < 0 && c.memory.track) {
    step1_peak_ = t_.last_peak();
    if (main_ && c.memory.estimate && step1_peak_ >= 0)
      std::cout << newline_after_bar() << "memory: step " << step << " peak " << measured_device_ << " "
                << against_estimate(step1_peak_) << "\n" << std::flush;
  }
  const std::string timing = this->timing();  // no host read of the device here
  if (step % c.log.every == 0 || step == steps || step == 1) {
    // Host reads happen here only, every log.every steps.
    if (t_.device().is_cuda()) torch::cuda::synchronize(t_.device().index());
    const auto now = Clock::now();
    const double ms = std::chrono::duration<double, std::milli>(now - last_log_time_).count() /
                      static_cast<double>(step - last_logged_step_);
    last_log_time_ = now, last_logged_step_ = step;
    if (first_logged_step_ < 0) first_logged_step_ = step, first_log_time_ = now;
    log_line(r, ms);
    if (main_ && !bar_)
      std::cout << "step " << std::setw(5) << step << "/" << steps << last_metrics_ << " | " << timing << "\n" << std::flush;
  }
  if (bar_ && main_) {  // every step on a terminal
    const int width = 20, filled = static_cast<int>(width * step / steps);
    std::cout << "\r[" << std::string(filled, '#') << std::string(width - filled, '.') << "] step " << step << "/" << steps
              << " | " << timing << last_metrics_ << "\033[K" << std::flush;
  }
}

void RunReport::log_line(const StepResult& r, double ms) {
  auto* dp = t_.data_parallel();
  const auto* scaler = t_.scaler();
  last_loss_ = t_.agreement().mean(r.loss.item<double>());  // each rank's loss is the mean over its own samples
  const double norm = r.grad_norm.item<double>();
  const auto& mem = t_.tracker().last();
  const auto rate = rates(1, ms / 1000);
  const bool tokens = t_.model().tokens_per_sample() > 1;
  nlohmann::json j = {{"step", t_.current_step()}, {"loss", last_loss_}, {"lr", r.lr}, {"grad_norm", norm},
                      {"ms_per_step", ms}, {"samples_per_s", rate.samples_per_s}};
  if (tokens) j["tokens_per_s"] = rate.tokens_per_s;
  if (rate.flops_per_s > 0) j["flops_per_s"] = rate.flops_per_s;
  if (rate.mfu > 0) j["mfu"] = rate.mfu;
  if (scaler) j["loss_scale"] = scaler->current_scale(), j["skipped"] = !r.applied;
  if (r.nonfinite) j["skipped_nonfinite"] = true;
  if (dp) j["comm_bytes"] = r.comm_bytes;  // this rank's, in the last step's collectives
  if (dp && t_.dims().gathers_parameters()) j["gathered_peak_bytes"] = r.gathered_peak_bytes;  // full parameters held at once
  for (const auto& m : mem) j["peak_" + m.device] = m.peak_allocated;
  if (!main_) return;
  metrics_ << j.dump() << "\n" << std::flush;
  std::ostringstream line;
  line << " | loss " << std::fixed << std::setprecision(4) << last_loss_ << " | lr " << std::scientific << std::setprecision(2)
       << r.lr << " | grad norm (pre-clip) " << std::fixed << std::setprecision(3) << norm << " | " << std::setprecision(1) << ms
       << " ms/step | " << si(tokens ? rate.tokens_per_s : rate.samples_per_s) << (tokens ? " tok/s" : " samples/s");
  if (rate.mfu > 0) line << " | MFU " << std::setprecision(1) << 100 * rate.mfu << "%";
  for (const auto& m : mem)
    line << " | peak " << m.device << " " << format_bytes(m.peak_allocated) << " (" << phase_name(m.peak_phase) << ")";
  if (scaler) line << " | scale " << scaler->current_scale() << (r.applied ? "" : " SKIPPED (inf/NaN)");
  last_metrics_ = line.str();
}

void RunReport::evaluation(const EvalResult& e) {
  if (!main_) return;
  nlohmann::json j = {{"step", t_.current_step()}, {"val_loss", e.loss}};
  if (e.peak_bytes >= 0) j["eval_peak_bytes"] = e.peak_bytes, j["eval_activation_peak"] = e.activation_peak;
  metrics_ << j.dump() << "\n" << std::flush;
  std::cout << newline_after_bar() << "eval step " << t_.current_step() << ": val loss " << std::fixed << std::setprecision(4)
            << e.loss << "\n" << std::flush;
}

void RunReport::checkpoint_saved(const std::string& folder, double seconds) {
  if (!main_) return;
  std::uintmax_t bytes = 0;  // every rank's files
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(folder, ec)) bytes += e.is_regular_file() ? e.file_size() : 0;
  std::cout << newline_after_bar() << "checkpoint: step " << t_.current_step() << " saved to " << folder << " ("
            << format_bytes(static_cast<int64_t>(bytes)) << " in " << std::fixed << std::setprecision(3) << seconds << " s)\n"
            << std::defaultfloat << std::flush;
}

void RunReport::stopped(const std::string& folder) {
  if (t_.config().log.trace) t_.tracker().write_trace(trace_path_);
  if (!main_) return;
  const int sig = detail::StopSignals::received();
  std::cout << newline_after_bar() << "memtrain: stopped by " << (sig ? strsignal(sig) : "a signal to another rank")
            << " after step " << t_.current_step() << " of " << t_.config().train.steps << "; checkpoint saved to " << folder
            << "; continue with --checkpoint.resume=auto\n" << std::flush;
}

void RunReport::end_of_steps() {
  if (bar_ && main_) std::cout << "\n";
}

void RunReport::finish(const EvalResult& val, const std::optional<EvalResult>& test) {
  const auto& c = t_.config();
  auto& summary = summary_->json;
  summary = {{"steps", t_.current_step()}, {"final_train_loss", last_loss_}, {"world_size", t_.world().world_size}};
  // The settings the run trained with: the config's own, or memory.budget_mib's plan applied to it (`planned`).
  summary["settings"] = {{"micro_batch", c.train.micro_batch},   {"accum_steps", c.train.accum_steps},
                         {"recompute", c.memory.recompute},      {"head", c.memory.head},
                         {"zero_stage", c.dist.zero_stage},      {"offload_optimizer", c.dist.offload_optimizer},
                         {"optimizer", c.train.optimizer},       {"planned", parse_budget_mib(c.memory.budget_mib) != 0}};
  const auto& dims = t_.dims();
  summary["parallel"] = {{"world", dims.world}, {"data_parallel", dims.dp}, {"tensor_parallel", dims.tp},
                         {"zero_stage", dims.zero_stage}, {"offload_optimizer", dims.offload}};
  if (first_logged_step_ >= 0 && last_logged_step_ > first_logged_step_) {  // after the first step, all ranks together
    const auto rate = rates(static_cast<double>(last_logged_step_ - first_logged_step_),
                            std::chrono::duration<double>(last_log_time_ - first_log_time_).count());
    summary["samples_per_s"] = rate.samples_per_s;
    if (t_.model().tokens_per_sample() > 1) summary["tokens_per_s"] = rate.tokens_per_s;
    if (rate.flops_per_s > 0) summary["flops_per_s"] = rate.flops_per_s;
    if (rate.mfu > 0) summary["mfu"] = rate.mfu;
  }
  if (c.log.trace) t_.tracker().write_trace(trace_path_);
  summary["val_loss"] = val.loss;
  if (val.peak_bytes >= 0) summary["eval_peak_bytes"] = val.peak_bytes, summary["eval_activation_peak"] = val.activation_peak;
  std::ostringstream out;
  out << "final: val loss " << std::fixed << std::setprecision(4) << val.loss;
  if (val.accuracy >= 0) out << ", val accuracy " << std::setprecision(2) << 100 * val.accuracy << "%";
  if (test) {
    summary["test_loss"] = test->loss, summary["test_accuracy"] = test->accuracy;
    out << ", test accuracy " << std::setprecision(2) << 100 * test->accuracy << "% on " << test->samples << " images";
  }
  const auto memory = c.memory.track ? gather_memory_summaries(t_) : std::vector<MemoryTracker::Summary>{};
  for (const auto& m : memory) {
    summary["peak_allocated_bytes"]["rank" + std::to_string(m.rank) + "/" + m.device] = m.max_peak;
    if (m.device == measured_device_) measured_peak_ = std::max(measured_peak_, m.max_peak);
  }
  const bool estimated = c.memory.track && c.memory.estimate && measured_peak_ > 0;
  if (estimated) {
    auto e = nlohmann::json::parse(t_.memory_estimate().to_json());
    e["measured_peak"] = measured_peak_;
    e["measured_first_step_peak"] = step1_peak_;
    e["error"] = estimate_error(measured_peak_);
    summary["memory_estimate"] = e;
  }
  if (!main_) return;
  std::cout << out.str() << "\n";
  if (c.memory.track) {
    std::cout << MemoryTracker::format_summary_table(memory);
    const auto allocator = t_.tracker().allocator_summaries();
    std::cout << MemoryTracker::format_allocator_summary(allocator, t_.world().rank);
    for (const auto& a : allocator) {
      auto& j = summary["memory_summary"][a.device];
      j = {{"allocated", a.allocated}, {"peak_allocated", a.peak_allocated}, {"reserved", a.reserved},
           {"peak_reserved", a.peak_reserved}, {"fragmentation", a.reserved - a.allocated}, {"allocations", a.allocations}};
      if (a.active >= 0) j["active"] = a.active, j["peak_active"] = a.peak_active, j["alloc_retries"] = a.alloc_retries, j["ooms"] = a.ooms;
    }
  }
  if (estimated) std::cout << "memory: peak " << measured_device_ << " over the run " << against_estimate(measured_peak_) << "\n";
}

void RunReport::close(const std::string& weights_path) {
  if (!main_) return;
  if (!weights_path.empty())
    std::cout << "saved weights to " << weights_path << " and the training state to "
              << checkpoint_folder(t_.checkpoint_dir(), t_.current_step()) << "\n";
  write_file_atomically(summary_file(t_.run_dir()), summary_->json.dump(2) + "\n");
}

}  // namespace memtrain
