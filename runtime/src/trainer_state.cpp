// The Trainer's training-state checkpoints: what each rank saves, loading at any world size and ZeRO
// stage, resuming at the start of fit(), and agreeing across ranks on failures and stop signals.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <iomanip>
#include <filesystem>
#include <iostream>
#include <set>
#include <sstream>

#include "memtrain/core/error.h"
#include "memtrain/optim/lowbit_adamw.h"
#include "memtrain/runtime/run_report.h"
#include "memtrain/runtime/trainer.h"
#include "stop_signals.h"

namespace memtrain {

namespace fs = std::filesystem;

namespace {

std::string plan_text(const std::vector<bool>& blocks) {
  std::string s;
  for (bool b : blocks) s += b ? '1' : '0';
  return s;
}

// Values per absmax of low-bit AdamW's state; 0 for other optimizers.
int64_t state_block(const torch::optim::Optimizer& optimizer) {
  auto* low = dynamic_cast<const LowBitAdamW*>(&optimizer);
  return low ? low->lowbit().block : 0;
}

}  // namespace

std::vector<ShardPiece> Trainer::state_pieces() const {
  std::vector<ShardPiece> out;
  auto add = [&](const std::string& name, const torch::Tensor& t, std::vector<int64_t> shape, int64_t begin, int64_t end) {
    out.push_back({name, std::move(shape), begin, end, t.detach().reshape({-1})});
  };
  // Elements [begin, end) of parameter `param`'s slice on this rank (`shape` the slice's), saved at their place in the
  // whole parameter: a checkpoint holds whole tensors whatever the grid, and resumes on any other. What is whole on
  // every rank of a tensor-parallel group is saved by its first rank. A field of k elements per value (4-bit codes,
  // absmaxes: `t` holds (end - begin) / k) is saved as a (whole numel / k,) tensor; its runs are whole blocks
  // (Trainer::lowbit_slices_refusal).
  const int tp_place = tp_rank(), T = tp_ ? tp_->size() : 1;
  auto add_slice = [&](const std::string& key, const std::string& param, const torch::Tensor& t, const std::vector<int64_t>& shape,
                       int64_t begin, int64_t end, int64_t k = 1) {
    const auto split = model_->tensor_split(param);
    const auto whole = whole_sizes(split, shape);
    const auto saved_shape = k == 1 ? whole : std::vector<int64_t>{c10::multiply_integers(whole) / k};
    if (!tp_ || !split.split()) {
      if (tp_place == 0) add(key, t, saved_shape, begin / k, end / k);
      return;
    }
    const auto flat = t.detach().reshape({-1});
    for_each_whole_run(split, shape, tp_place, T, begin, end, [&](int64_t l, int64_t w, int64_t n) {
      add(key, flat.slice(0, (l - begin) / k, (l - begin + n) / k), saved_shape, w / k, (w + n) / k);
    });
  };
  // Optimizer state of one stepped tensor: elements [begin, end) of the parameter; the step count once,
  // by whoever holds the parameter's first element.
  // A field of k elements per value (4-bit codes, absmaxes) saves values [begin / k, end / k) of a (numel / k,) tensor.
  auto add_state = [&](const std::string& name, const torch::Tensor& stepped, const std::vector<int64_t>& shape,
                       int64_t begin, int64_t end) {
    const auto numel = whole_numel(name, shape);  // quantized as the whole
    std::map<std::string, int64_t> per_value;
    for (const auto& f : param_state_fields(*optimizer_, numel)) per_value[f.name] = f.per_value;
    for (const auto& [field, value] : get_param_state(*optimizer_, stepped)) {
      const auto it = per_value.find(field);
      MEMTRAIN_CHECK(it != per_value.end(), Error, "[checkpoint] the optimizer's state of '", name, "' has a field '", field,
                     "' its kind does not list");
      if (const int64_t k = it->second; k == 0) {
        if (begin == 0 && tp_place == 0) add("optim/" + name + "/" + field, value, {}, 0, 1);
      } else {
        add_slice("optim/" + name + "/" + field, name, value, shape, begin, end, k);
      }
    }
  };
  if (dp_) {
    // Stage 0: every rank holds everything; rank 0 saves it. Stages 1-2: each rank its own part.
    if (dims_.zero_stage > 0 || dp_rank() == 0) {  // (tensor parallel: each rank of the first data-parallel group)
      std::map<std::string, std::vector<int64_t>> shapes;
      for (const auto& slot : dp_->index()) shapes[slot.name] = slot.shape;
      for (const auto& seg : dp_->segments()) {
        add_slice("model/" + seg.name, seg.name, seg.stepped, shapes.at(seg.name), seg.begin, seg.end);
        add_state(seg.name, seg.stepped, shapes.at(seg.name), seg.begin, seg.end);
      }
    }
  } else {
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& value = master_.empty() ? params_[i] : master_[i];
      add("model/" + param_names_[i], value, value.sizes().vec(), 0, value.numel());
      add_state(param_names_[i], value, value.sizes().vec(), 0, value.numel());
    }
  }
  if (frozen_sharded()) {  // ZeRO-3: each rank its part of what does not train
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const auto& slot : dp_->frozen_index()) shapes[slot.name] = slot.shape;
    for (const auto& seg : dp_->frozen_segments())
      if (!nf4_.count(seg.name)) add_slice("frozen/" + seg.name, seg.name, seg.stepped, shapes.at(seg.name), seg.begin, seg.end);
  }
  // An NF4 base is not saved: it is made again from its source (model.init_from, or the seed), and the manifest's
  // quantized_base records which, with a digest of its bytes.
  // What does not train, whole, once: by the first data-parallel group's ranks (tensor parallel: each its slices).
  if (!frozen_sharded() && (tp_ ? dp_rank() == 0 : world_.is_main()))
    for (size_t i = 0; i < frozen_.size(); ++i)
      if (!nf4_.count(frozen_names_[i]))
        add_slice("frozen/" + frozen_names_[i], frozen_names_[i], frozen_[i], frozen_[i].sizes().vec(), 0, frozen_[i].numel());
  if (world_.is_main()) {
    for (const auto& item : model_->named_buffers())
      add("buffer/" + item.key(), item.value(), item.value().sizes().vec(), 0, item.value().numel());
    if (scaler_) {
      add("scaler/scale", scaler_->scale_tensor(), {}, 0, 1);
      add("scaler/growth_tracker", scaler_->growth_tracker(), {}, 0, 1);
    }
  }
  return out;
}

std::string Trainer::save_checkpoint() {
  sync_buffers();  // every rank: a collective; rank 0's statistics are the ones saved
  const bool main = world_.is_main();
  const auto staging = staging_folder(ckpt_dir_, step_);
  const auto previous = find_latest_checkpoint(ckpt_dir_);
  std::string error;
  auto attempt = [&](auto&& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      error = e.what();
    }
  };
  auto fail_unless_all = [&](const char* stage) {
    if (agree(error.empty())) return;
    if (main) {
      std::error_code ec;
      fs::remove_all(staging, ec);
    }
    throw Error(detail::concat("[checkpoint] saving step ", step_, " to ", ckpt_dir_, " failed while ", stage, ": ",
                               error.empty() ? std::string("another rank failed (its own message names the cause)") : error,
                               previous.empty() ? std::string("; no earlier checkpoint exists")
                                                : "; the previous checkpoint " + previous + " is intact"));
  };
  if (main) attempt([&] {
      fs::remove_all(staging);
      fs::create_directories(staging);
    });
  fail_unless_all("creating its folder");
  SavedFile mine;
  attempt([&] { mine = write_rank_file(staging, world_.rank, state_pieces()); });
  fail_unless_all("writing the ranks' files");
  // Rank 0 writes every file's size and checksum into the manifest: two int64 per rank, all-gathered.
  std::vector<SavedFile> files(static_cast<size_t>(world_.world_size));
  const auto rows = agreement().gather_rows(torch::tensor({static_cast<int64_t>(mine.bytes), static_cast<int64_t>(mine.crc32)}));
  for (int r = 0; r < world_.world_size; ++r)
    files[r] = {static_cast<uint64_t>(rows[r][0].item<int64_t>()), static_cast<uint32_t>(rows[r][1].item<int64_t>())};
  std::string folder = checkpoint_folder(ckpt_dir_, step_);
  if (main) attempt([&] {
      CheckpointMeta meta;
      meta.step = step_;
      meta.world_size = world_.world_size;
      meta.zero_stage = dims_.zero_stage;
      meta.fields = {{"config", config_.to_ini()},
                     {"optimizer", config_.train.optimizer},
                     {"optimizer_block", std::to_string(state_block(*optimizer_))},
                     {"optimizer_min_quantized", std::to_string(config_.train.optimizer_min_quantized)},
                     {"param_dtype", config_.train.param_dtype},
                     {"precision", config_.train.precision},
                     {"micro_batch_split", std::to_string(split_)},
                     {"nonfinite_run", std::to_string(nonfinite_run_)}};
      if (!nf4_.empty()) meta.fields["quantized_base"] = nf4_record();
      if (policy_.mode == RecomputePolicy::Mode::kBudget && !policy_.blocks.empty())
        meta.fields["recompute_plan"] = plan_text(policy_.blocks);
      folder = commit_checkpoint(ckpt_dir_, meta, files, config_.checkpoint.keep);
    });
  fail_unless_all("writing the manifest");
  last_saved_step_ = step_;
  return folder;
}

std::set<std::string> Trainer::check_checkpoint(const std::string& path, const LoadedCheckpoint& ck) const {
  const auto& T = ck.tensors;
  auto field = [&](const std::string& key) {
    auto it = ck.meta.fields.find(key);
    return it == ck.meta.fields.end() ? std::string() : it->second;
  };
  const auto saved_optimizer = field("optimizer");
  const std::set<std::string> fp32_adamw = {"adamw", "adamw_loop"};  // the same state, in two implementations
  MEMTRAIN_CHECK(saved_optimizer.empty() || saved_optimizer == config_.train.optimizer ||
                     (fp32_adamw.count(saved_optimizer) && fp32_adamw.count(config_.train.optimizer)),
                 DataError, "[checkpoint] ", path, " was saved with train.optimizer = ", saved_optimizer,
                 "; this run uses ", config_.train.optimizer, ": their states differ");
  const auto saved_block = field("optimizer_block"), block = std::to_string(state_block(*optimizer_));
  MEMTRAIN_CHECK(saved_block.empty() || saved_block == block || fp32_adamw.count(saved_optimizer) || saved_optimizer == "sgd",
                 DataError, "[checkpoint] ", path, " was saved with ", saved_optimizer, " state in blocks of ", saved_block,
                 " values (train.optimizer_block); this run uses ", block, ": their codes and absmaxes differ");
  const auto saved_min = field("optimizer_min_quantized"), min = std::to_string(config_.train.optimizer_min_quantized);
  MEMTRAIN_CHECK(saved_min.empty() || saved_min == min || state_block(*optimizer_) == 0, DataError, "[checkpoint] ", path,
                 " was saved with train.optimizer_min_quantized = ", saved_min, "; this run uses ", min,
                 ": other parameters have quantized moments");
  std::map<std::string, torch::Tensor> params;
  for (size_t i = 0; i < params_.size(); ++i) params[param_names_[i]] = params_[i];
  std::map<std::string, torch::Tensor> buffers;
  for (const auto& item : model_->named_buffers()) buffers[item.key()] = item.value();
  // A tensor-parallel slice is checked against its whole parameter (a checkpoint holds whole tensors).
  auto whole_of = [&](const std::string& name, const torch::Tensor& p) { return whole_sizes(model_->tensor_split(name), p.sizes()); };
  auto expect_sizes = [&](const std::string& name, c10::IntArrayRef sizes, const char* what) {
    auto it = T.find(name);
    MEMTRAIN_CHECK(it != T.end(), DataError, "[checkpoint] ", path, ": no tensor '", name, "' for the model's ", what,
                   " of shape ", sizes, ": a checkpoint of another model?");
    MEMTRAIN_CHECK(it->second.sizes() == sizes, DataError, "[checkpoint] ", path, ": tensor '", name,
                   "' has shape ", it->second.sizes(), "; the model's ", what, " has ", sizes);
    return it->second;
  };
  auto expect = [&](const std::string& name, const torch::Tensor& target, const char* what) {
    return expect_sizes(name, target.sizes(), what);
  };
  for (const auto& [name, p] : params) expect_sizes("model/" + name, whole_of(name, p), "parameter");
  // An NF4 base is made again, not loaded: the checkpoint's record of it must be this run's.
  const auto saved_base = field("quantized_base"), base = nf4_record();
  MEMTRAIN_CHECK(saved_base.empty() == base.empty() && (base.empty() || nf4_same_base(saved_base, base)), DataError, "[checkpoint] ", path, " was trained on ",
                 saved_base.empty() ? std::string("a base that was not quantized") : "the quantized base '" + saved_base + "'",
                 "; this run's base is ", base.empty() ? std::string("not quantized (lora.quantize_base = none)") : "'" + base + "'",
                 base.empty() || saved_base.empty() ? std::string(": the adapters were fitted to other weights")
                                                    : ": model.init_from's weights (or the NF4 settings) changed since");
  std::map<std::string, torch::Tensor> frozen;
  for (size_t i = 0; i < frozen_.size(); ++i)
    if (!nf4_.count(frozen_names_[i])) frozen[frozen_names_[i]] = frozen_[i];
  for (const auto& [name, p] : frozen) expect_sizes("frozen/" + name, whole_of(name, p), "frozen parameter");
  for (const auto& [name, b] : buffers) expect("buffer/" + name, b, "buffer");
  std::set<std::string> stepped_names;  // parameters that have optimizer state in the checkpoint
  for (const auto& [name, p] : params) {
    const auto numel = whole_numel(name, p.sizes());
    const auto state_fields = param_state_fields(*optimizer_, numel);
    size_t present = 0;
    for (const auto& f : state_fields) present += T.count("optim/" + name + "/" + f.name);
    if (!present) continue;
    for (const auto& f : state_fields) {
      const auto key = "optim/" + name + "/" + f.name;
      auto it = T.find(key);
      MEMTRAIN_CHECK(it != T.end(), DataError, "[checkpoint] ", path, ": no optimizer state '", key,
                     "' beside the rest of that parameter's state (saved by another optimizer or block size?)");
      const int64_t values = f.per_value == 0 ? 1 : numel / f.per_value;
      MEMTRAIN_CHECK(it->second.numel() == values, DataError, "[checkpoint] ", path, ": optimizer state '", key, "' has ",
                     it->second.numel(), " values; a parameter of ", numel, " elements has ", values);
    }
    stepped_names.insert(name);
  }
  for (const auto& [name, t] : T) {
    const auto slash = name.find('/');
    const auto kind = name.substr(0, slash), rest = name.substr(slash + 1);
    const bool known = (kind == "model" && params.count(rest)) || (kind == "buffer" && buffers.count(rest)) ||
                       (kind == "frozen" && frozen.count(rest)) ||
                       (kind == "optim" && params.count(rest.substr(0, rest.rfind('/')))) || kind == "scaler";
    MEMTRAIN_CHECK(known, DataError, "[checkpoint] ", path, ": unexpected tensor '", name,
                   "': this model has no such parameter or buffer (a checkpoint of another model?)");
  }
  const auto plan = field("recompute_plan");
  MEMTRAIN_CHECK(plan.empty() || static_cast<int64_t>(plan.size()) == model_->num_blocks(), DataError, "[checkpoint] ",
                 path, ": its recompute plan covers ", plan.size(), " blocks; the model has ", model_->num_blocks());

  return stepped_names;
}

void Trainer::load_checkpoint(const std::string& path) {
  const auto begin = std::chrono::steady_clock::now();
  const auto ck = ::memtrain::load_checkpoint(path);
  const auto& T = ck.tensors;
  const auto& fields = ck.meta.fields;
  auto field = [&](const std::string& key) {
    auto it = fields.find(key);
    return it == fields.end() ? std::string() : it->second;
  };
  // 1. Everything is checked before anything is copied.
  const auto stepped_names = check_checkpoint(path, ck);
  const auto plan = field("recompute_plan");
  std::map<std::string, torch::Tensor> params;
  for (size_t i = 0; i < params_.size(); ++i) params[param_names_[i]] = params_[i];
  std::map<std::string, torch::Tensor> buffers;
  for (const auto& item : model_->named_buffers()) buffers[item.key()] = item.value();

  // 2. Copy. Parameters are replicated in stages 0-2: every rank takes the whole tensor, and its own
  //    part of the fp32 masters and the optimizer state.
  torch::NoGradGuard no_grad;
  // Elements [begin, end) of this rank's slice of `name` (tensor parallel: taken from their places in the whole).
  auto slice_of = [&](const std::string& name, const torch::Tensor& whole, int64_t begin, int64_t end, int64_t k = 1) {
    return local_slice(name, whole, params.at(name).sizes(), begin, end, k);
  };
  auto state_of = [&](const std::string& name, int64_t begin, int64_t end) {
    std::map<std::string, torch::Tensor> state;
    const auto numel = whole_numel(name, params.at(name).sizes());
    for (const auto& f : param_state_fields(*optimizer_, numel)) {
      const auto& t = T.at("optim/" + name + "/" + f.name);
      state[f.name] = f.per_value == 0 ? t : slice_of(name, t, begin, end, f.per_value);
    }
    return state;
  };
  if (dp_) {
    // Stage 3 holds no full parameters: the parts come from the stepped tensors.
    if (!dims_.gathers_parameters())
      for (const auto& [name, p] : params)  // with masters: fp32 -> bf16 once
        p.copy_(slice_of(name, T.at("model/" + name), 0, p.numel()).view(p.sizes()));
    for (const auto& seg : dp_->segments()) {
      seg.stepped.copy_(slice_of(seg.name, T.at("model/" + seg.name), seg.begin, seg.end));
      if (stepped_names.count(seg.name)) set_param_state(*optimizer_, seg.stepped, state_of(seg.name, seg.begin, seg.end));
    }
    dp_->parameters_from_stepped();
  } else {
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& name = param_names_[i];
      auto& stepped = master_.empty() ? params_[i] : master_[i];
      stepped.copy_(T.at("model/" + name));
      if (!master_.empty()) params_[i].copy_(master_[i]);  // fp32 -> bf16, as after every step
      if (stepped_names.count(name)) set_param_state(*optimizer_, stepped, state_of(name, 0, stepped.numel()));
    }
  }
  for (auto& [name, b] : buffers) b.copy_(T.at("buffer/" + name));
  // What does not train: this rank's elements (tensor parallel: from their places in the whole).
  if (frozen_sharded()) {
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const auto& slot : dp_->frozen_index()) shapes[slot.name] = slot.shape;
    for (const auto& seg : dp_->frozen_segments())
      if (!nf4_.count(seg.name))
        seg.stepped.copy_(local_slice(seg.name, T.at("frozen/" + seg.name), shapes.at(seg.name), seg.begin, seg.end));
  } else {
    for (size_t i = 0; i < frozen_.size(); ++i)
      if (!nf4_.count(frozen_names_[i]))
        frozen_[i].copy_(local_slice(frozen_names_[i], T.at("frozen/" + frozen_names_[i]), frozen_[i].sizes(), 0,
                                     frozen_[i].numel()).view(frozen_[i].sizes()));
  }
  if (scaler_ && T.count("scaler/scale") && T.count("scaler/growth_tracker"))
    scaler_->load_state(T.at("scaler/scale"), T.at("scaler/growth_tracker"));
  if (!plan.empty() && policy_.mode == RecomputePolicy::Mode::kBudget) {
    policy_.blocks.clear();
    for (char c : plan) policy_.blocks.push_back(c == '1');
  }
  step_ = ck.meta.step;
  // Saved already when it came from this run's own checkpoint folder; taken up from another (a checkpoint
  // resharded into a new run), the final save still writes it here, so the run's folder holds its state.
  std::error_code ec;
  last_saved_step_ = fs::equivalent(fs::path(path).parent_path(), ckpt_dir_, ec) ? step_ : -1;
  // An out-of-memory split and a run of skipped steps continue as they were (bit-exact resume).
  auto count = [&](const char* key) { return field(key).empty() ? int64_t{0} : std::stoll(field(key)); };
  split_ = std::max<int64_t>(1, count("micro_batch_split"));
  nonfinite_run_ = count("nonfinite_run");

  say_resumed(path, ck, std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
}

void Trainer::say_resumed(const std::string& path, const LoadedCheckpoint& ck, double seconds) const {
  const auto& T = ck.tensors;
  auto field = [&](const std::string& key) {
    auto it = ck.meta.fields.find(key);
    return it == ck.meta.fields.end() ? std::string() : it->second;
  };
  if (world_.is_main()) {
    std::cout << "resumed:    step " << step_ << " from " << path << " (saved by " << ck.meta.world_size
              << (ck.meta.world_size == 1 ? " rank" : " ranks") << ", ZeRO stage " << ck.meta.zero_stage << "; read and checked in "
              << std::fixed << std::setprecision(3) << seconds << " s)\n"
              << std::defaultfloat;
    if (scaler_ && !T.count("scaler/scale")) std::cout << "            (no loss-scaler state in it: the scale starts afresh)\n";
    // Settings that change the training itself and differ from the checkpoint's: said, not refused.
    const auto before = Config::ini_values(field("config")), now = Config::ini_values(config_.to_ini());
    for (const auto& [key, value] : now) {
      if (key.rfind("log.", 0) == 0 || key.rfind("checkpoint.", 0) == 0) continue;
      auto it = before.find(key);
      if (it != before.end() && it->second != value)
        std::cout << "            note: " << key << " = " << value << " (the checkpoint's run had " << it->second << ")\n";
    }
    std::cout << std::flush;
  }
}

void Trainer::resume_or_refuse() {
  const bool main = world_.is_main();
  std::string path;  // the checkpoint to resume from ("" = start fresh)
  if (config_.checkpoint.resume.empty())
    refuse_or_overwrite_run();
  else
    path = agreed_resume_path();
  if (path.empty()) return;
  // Every rank reads the checkpoint; a failure on one (a missing file on its node, no host memory) stops
  // them all instead of leaving the others in the first collective.
  std::string error;
  try {
    load_checkpoint(path);
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!agree(error.empty()))
    throw DataError(error.empty() ? "[checkpoint] another rank could not load " + path + " (its message names the cause)"
                                  : error);
  resumed_from_ = path;
  // Checkpoints of this folder newer than the one resumed from belong to the abandoned continuation:
  // moved aside (not deleted), so that `auto` and pruning see only this timeline.
  std::error_code same_ec;
  if (main && fs::equivalent(fs::path(path).parent_path(), ckpt_dir_, same_ec)) {
    for (const auto& c : list_checkpoints(ckpt_dir_)) {
      const auto newer = read_manifest(c).step > step_;
      if (!newer) continue;
      const auto aside = fs::path(ckpt_dir_) / "abandoned" / fs::path(c).filename();
      fs::create_directories(aside.parent_path());
      fs::remove_all(aside);
      fs::rename(c, aside);
      std::cout << "            moved " << c << " (newer than the checkpoint resumed from) to " << aside.string() << "\n";
    }
  }
}

// No checkpoint.resume: a run folder that already holds a run is refused on every rank, or cleared (log.overwrite).
void Trainer::refuse_or_overwrite_run() {
  const bool main = world_.is_main();
  const auto metrics = fs::path(RunReport::metrics_file(run_dir_));
  // Every rank looks (a folder local to one node shows the run to its ranks only); all refuse together.
  const auto existing = list_checkpoints(ckpt_dir_);
  const bool other_run = fs::exists(metrics) || !existing.empty();
  const bool refuse = other_run && !config_.log.overwrite;
  if (!agree(!refuse))
    throw ConfigError(detail::concat(
        "[config] the run folder ", run_dir_, " already holds a run (",
        !refuse ? std::string("seen by another rank")
                : existing.empty() ? std::string("metrics.jsonl")
                                   : std::to_string(existing.size()) + " checkpoint(s) in " + ckpt_dir_,
        "): continue it with --checkpoint.resume=auto, start over with --log.overwrite=true (its checkpoints are "
        "deleted), or choose another --log.name"));
  if (other_run && main) {
    for (const auto& c : existing) fs::remove_all(c);
    std::error_code ec;
    fs::remove(fs::path(ckpt_dir_) / "latest", ec);
    std::cout << "overwrite:  started over in " << run_dir_ << " (log.overwrite = true)\n";
  }
}

// checkpoint.resume: the checkpoint every rank found ("" = none with `auto`: start fresh); the ranks refuse together
// when they found different ones.
std::string Trainer::agreed_resume_path() {
  const auto& ck = config_.checkpoint;
  const bool main = world_.is_main();
  const auto metrics = fs::path(RunReport::metrics_file(run_dir_));
  std::string path = ck.resume == "auto" ? find_latest_checkpoint(ckpt_dir_) : ck.resume;
  // Every rank looks for itself (a checkpoint folder local to each node): they agree on the step found (-1:
  // none) before any of them loads, and refuse together when they differ. A rank that started fresh while
  // the others loaded would leave them all in different collectives.
  int64_t found = -1;
  try {
    if (!path.empty() && fs::is_directory(path)) found = read_manifest(path).step;
  } catch (const std::exception&) {
    found = -2;  // unreadable: load_checkpoint below names why
  }
  const auto ranks = agreement();
  const auto lowest = static_cast<int64_t>(ranks.min(static_cast<double>(found)));
  const auto highest = static_cast<int64_t>(ranks.max(static_cast<double>(found)));
  if (lowest != highest)
    throw DataError(detail::concat(
        "[checkpoint] checkpoint.resume = ", ck.resume, ": the ranks found different checkpoints (this rank, ",
        world_.rank, ": ", found >= 0 ? "step " + std::to_string(found) + " in " + path : std::string("none"),
        "; over all ranks the steps range from ", lowest, " to ", highest, ", -1 for none): is ", ckpt_dir_,
        " a folder every node sees? Nothing was loaded"));
  MEMTRAIN_CHECK(ck.resume == "auto" || found != -1, ConfigError, "[config] checkpoint.resume = ", path,
                 ": no such checkpoint folder (expected auto, or the path of a step-N folder)");
  if (ck.resume == "auto" && found == -1) {
    if (main)
      std::cout << "resume:     no checkpoint in " << ckpt_dir_ << ": starting fresh"
                << (fs::exists(metrics) ? " (metrics.jsonl is started anew)" : "") << "\n";
    path.clear();
  }
  return path;
}

bool Trainer::stop_requested() {
  return agreement().any(detail::StopSignals::received() != 0);  // a signal to any rank stops them all after the same step
}

}  // namespace memtrain
