// RunReport: every output of a run, written from one place. It names each file once and writes the
// banner, the step line (or progress bar), metrics.jsonl, the evaluation, checkpoint and stop lines,
// memory.rank<N>.jsonl (through the tracker), trace.json, summary.json and the final memory tables.
// Trainer::fit() uses it; an embedder's own loop gets the same files:
//
//   memtrain::Trainer trainer(cfg, model, data);
//   memtrain::RunReport report(trainer);                 // config.ini, the banner, opens metrics.jsonl
//   while (trainer.current_step() < cfg.train.steps) report.step(trainer.step());
//   report.finish(trainer.evaluate(trainer.data().val_batches(16, 8)));   // tables, summary.json
//
// Every rank constructs it and calls step() and finish(): on log steps the loss is averaged over the ranks
// and finish() gathers every rank's memory summary (collectives). Rank 0 writes the files shared by the run.
#pragma once

#include <chrono>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "memtrain/runtime/trainer.h"

namespace memtrain {

class RunReport {
 public:
  // The output files of a run folder, named here once.
  static std::string metrics_file(const std::string& run_dir);                    // metrics.jsonl (rank 0)
  static std::string summary_file(const std::string& run_dir);                    // summary.json (rank 0)
  static std::string config_file(const std::string& run_dir);                     // config.ini (rank 0)
  static std::string memory_file(const std::string& run_dir, int rank);           // memory.rank<N>.jsonl
  static std::string trace_file(const std::string& run_dir, int rank, int world); // trace.json / trace.rank<N>.json
  static std::string snapshot_file(const std::string& run_dir, int rank);         // memory_snapshot.rank<N>.pickle
  static std::string profile_stem(const std::string& run_dir, int rank, int world); // profile / profile.rank<N> (.json, .md)
  // The run folder: log.dir / (log.name, else the config file's stem, else "run").
  static std::string run_dir(const std::string& log_dir, const std::string& log_name, const std::string& config_source);
  // `memtrain eval`'s result beside the run folder (<run folder>-eval/summary.json; rank 0): its path.
  static std::string write_evaluation(Trainer& trainer, const EvalResult& e, const std::string& weights);

  // Opens the outputs (appending after a resume) and prints the banner; the run folder is created.
  explicit RunReport(Trainer& trainer);
  ~RunReport();
  RunReport(const RunReport&) = delete;
  RunReport& operator=(const RunReport&) = delete;

  // After each step: the first step's peak against the estimate; on log steps (log.every, the first and the
  // last) the step line or bar and a metrics.jsonl line, the loss averaged over the ranks (collective).
  void step(const StepResult& r);
  // An evaluation during training: its metrics.jsonl line and "eval step N: val loss".
  void evaluation(const EvalResult& e);
  // A training-state save of `seconds`: "checkpoint: step N saved to ... (size in s)".
  void checkpoint_saved(const std::string& folder, double seconds);
  // After the last step: ends the progress bar's line.
  void end_of_steps();
  // The run stopped by a signal after the current step, its state in `folder`: the trace and the stop line.
  void stopped(const std::string& folder);
  // The end of the run: the final validation (and test) results, every rank's memory summary (collective),
  // the tables, the estimate against the measured peak, the trace; then, once the weights are saved
  // (`weights_path`, empty when not), the last line and summary.json.
  void finish(const EvalResult& val, const std::optional<EvalResult>& test = std::nullopt);
  void close(const std::string& weights_path = "");

 private:
  using Clock = std::chrono::steady_clock;
  // Samples, tokens and FLOPs per second of `steps` steps in `seconds` (all ranks), and MFU (0: unknown).
  struct Rates {
    double samples_per_s = 0, tokens_per_s = 0, flops_per_s = 0, mfu = 0;
  };
  Rates rates(double steps, double seconds) const;
  // "12.3 MiB (estimate 12.0 MiB, -2.4%)", and the estimate's relative error against a measured peak.
  std::string against_estimate(int64_t measured) const;
  double estimate_error(int64_t measured) const;
  std::string timing() const;   // "elapsed 12s | ETA 1m03s"
  void log_line(const StepResult& r, double ms);
  const char* newline_after_bar() const { return bar_ ? "\n" : ""; }

  Trainer& t_;
  bool main_ = false;
  bool bar_ = false;            // a progress bar redrawn every step (a terminal), else one line per log step
  std::pair<double, std::string> peak_;  // FLOP/s MFU divides by, and where the figure came from
  std::string measured_device_;  // the training device's name in the tracker's samples ("cpu", "cuda:0")
  std::string trace_path_;
  std::ofstream metrics_;        // rank 0 only
  double samples_per_step_ = 0, tokens_per_step_ = 0;
  int64_t start_step_ = 0, last_logged_step_ = 0, first_logged_step_ = -1, step1_peak_ = -1;
  Clock::time_point run_start_, last_log_time_, first_log_time_;
  double last_loss_ = std::numeric_limits<double>::quiet_NaN();
  std::string last_metrics_;     // the bar shows the last logged values beside the live step count
  struct Summary;                      // summary.json's contents (run_report.cpp)
  std::unique_ptr<Summary> summary_;   // built by finish(), written by close()
  int64_t measured_peak_ = -1;         // the training device's, over steps and ranks (finish())
};

}  // namespace memtrain
