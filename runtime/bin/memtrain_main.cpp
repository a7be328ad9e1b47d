// memtrain: train a model from a config file.
//
//   memtrain [--config examples/configs/gpt_austen_cpu.ini] [--section.key=value ...]
//   memtrain --help                      every key, its default and what it does
//   memtrain --config X --print-config   the resolved config, without training
//   memtrain --print-config-reference    the Markdown page docs/config-reference.md
//   memtrain eval --config X [--model.init_from=DIR | --weights W]   the validation loss, without training
//   memtrain export --checkpoint PATH --out DIR [--dtype float32|bfloat16|float16] [--max-shard-mb N]
//                                        a training-state checkpoint as a Hugging Face folder
//   memtrain --config X --generate N --weights W [--prompt-ids 1,2,3] [--temperature T] [--top-k K]
//                                        N token ids sampled from a trained GPT (scripts/sample.py
//                                        turns text into the prompt's ids and the ids back into text)
//
// Launched once per device, torchrun-style (RANK, WORLD_SIZE, LOCAL_RANK, ... from the environment).
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "memtrain/core/config.h"
#include "memtrain/core/cpu_memory.h"
#include "memtrain/core/error.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/distributed/world.h"
#include "memtrain/core/files.h"
#include "memtrain/runtime/export.h"
#include "memtrain/runtime/factories.h"
#include "memtrain/runtime/generate.h"
#include "memtrain/runtime/run_report.h"
#include "memtrain/runtime/step_time.h"
#include "memtrain/runtime/target_estimate.h"
#include "memtrain/runtime/trainer.h"

namespace {
constexpr const char* kUsage =
    "usage: memtrain [--config FILE.ini] [--section.key=value ...] [--print-config] [--print-config-reference]\n"
    "Trains the model the config describes; without --config, the defaults below (a small byte-level GPT on\n"
    "the prepared Jane Austen text, on the CPU). A key given twice: the last value wins.\n"
    "Sampling: memtrain --config X --generate N --weights FILE.safetensors [--prompt-ids 1,2,3] [--temperature T]\n"
    "[--top-k K] prints N token ids continuing the prompt (default: token 0).\n"
    "Estimate: memtrain estimate [--ranks N] --config X [--section.key=value ...] prints each rank's peak memory by\n"
    "component before anything trains (a probe forward + backward at two small micro-batches), and by ZeRO stage.\n"
    "memtrain estimate --target h100-80gb|h200-141gb|a100-40gb|a100-80gb|cpu:64GiB|BYTES [--nproc-per-node N]\n"
    "[--nnodes M] --config X answers for a machine that need not be this one, without building the model (gpt,\n"
    "llama; --model.preset=llama-3.1-8b): each rank's model states, activations in closed form and a GPU's own\n"
    "terms (context, cuBLAS, NCCL, allocator rounding), by ZeRO stage, against the target's memory.\n"
    "Plan: memtrain plan --target T [--nproc-per-node N] [--nnodes M] [--out plan.ini] --config X lists, fastest first,\n"
    "the settings that fit (micro-batch x accumulation, recompute, head, stage, offload) with each one's predicted step\n"
    "time and tokens/s, and with --out writes the best as an INI.\n"
    "Evaluate: memtrain eval --config X [--model.init_from=DIR | --weights FILE.safetensors] prints 'val loss L' over\n"
    "the validation windows (train.eval_batches of train.micro_batch) and writes it to <log.dir>/<log.name>-eval/summary.json.\n"
    "Export: memtrain export --checkpoint PATH --out DIR [--dtype float32|bfloat16|float16] [--max-shard-mb N] writes a\n"
    "training-state checkpoint (any world size and ZeRO stage) as a Hugging Face folder (config.json + safetensors);\n"
    "a LoRA run's as a peft adapter folder, or with --merged the whole model with the adapters merged in.\n"
    "Parameters: memtrain --config X --print-parameters lists every parameter's name, shape and whether it trains\n"
    "(the names train.freeze matches).\n";

// "1,2,3" -> {1, 2, 3}.
std::vector<int64_t> parse_ids(const std::string& text) {
  std::vector<int64_t> ids;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    size_t used = 0;
    int64_t v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
    }
    if (used != item.size() || v < 0) throw memtrain::ConfigError("--prompt-ids: '" + item + "' is not a token id");
    ids.push_back(v);
  }
  return ids;
}

int sample(const memtrain::Config& config, const std::map<std::string, std::string>& flags) {
  auto data = memtrain::make_dataset(config, {});
  auto model = memtrain::make_model(config.model, data->info());
  auto weights = flags.find("--weights");
  MEMTRAIN_CHECK(weights != flags.end(), memtrain::ConfigError, "--generate needs --weights FILE.safetensors");
  memtrain::load_module_state(*model, memtrain::load_safetensors(weights->second), weights->second);
  memtrain::GenerateOptions o;
  o.tokens = std::stoll(flags.at("--generate"));
  if (flags.count("--temperature")) o.temperature = std::stod(flags.at("--temperature"));
  if (flags.count("--top-k")) o.top_k = std::stoll(flags.at("--top-k"));
  o.seed = static_cast<uint64_t>(config.train.seed);
  const auto prompt = flags.count("--prompt-ids") ? parse_ids(flags.at("--prompt-ids")) : std::vector<int64_t>{0};
  for (auto id : prompt)
    MEMTRAIN_CHECK(id < data->info().vocab_size, memtrain::ConfigError, "--prompt-ids: id ", id,
                   " is outside the vocabulary of ", data->info().vocab_size);
  const auto ids = memtrain::generate(*model, memtrain::context_length(config.model), prompt, o);
  std::cout << "ids:";
  for (auto id : ids) std::cout << " " << id;
  std::cout << "\n";
  return 0;
}
// `memtrain estimate`: the model and data are built in this one process (the probe needs no peers) and
// the estimate is made for `ranks` ranks (default: WORLD_SIZE, else 1), then for every ZeRO stage.
int estimate(const memtrain::Config& config, int ranks) {
  if (ranks == 0) ranks = memtrain::World::from_env().world_size;
  memtrain::Trainer trainer(config, memtrain::World{});
  const auto in = trainer.estimate_inputs_for(ranks);
  const auto e = memtrain::estimate_memory(in);
  const auto device = trainer.device().is_cuda() ? trainer.device().str() : std::string("cpu");
  std::cout << "model:  " << trainer.model().describe() << "\n"
            << "memory estimate per rank, " << ranks << (ranks == 1 ? " rank" : " ranks") << ", " << device
            << ", micro-batch " << config.train.micro_batch << ", recompute " << config.memory.recompute << ", head "
            << config.memory.head << (ranks > 1 || in.offload ? ", ZeRO stage " + std::to_string(in.stage) : std::string())
            << (in.offload ? " + offload" : "") << ":\n"
            << e.table();
  if (ranks > 1) {
    std::cout << "by ZeRO stage (" << ranks << " ranks):\n";
    for (int stage = 0; stage <= 3; ++stage) {
      for (bool offload : {false, true}) {
        if (offload && stage == 0) continue;
        auto v = in;
        v.stage = stage, v.offload = offload;
        const auto s = memtrain::estimate_memory(v);
        std::cout << "  stage " << stage << (offload ? " + offload" : "          ") << "  peak "
                  << memtrain::format_bytes(s.peak_device())
                  << (s.cuda ? ", host " + memtrain::format_bytes(s.host.peak()) : std::string()) << "\n";
      }
    }
  }
  std::cout << "json: " << e.to_json() << "\n";
  return 0;
}

// `memtrain estimate --target T`: each rank's memory for a machine that need not be this one, from the config's
// shapes alone (nothing built, no data read, no CUDA): every term of the configured setting, then each ZeRO stage.
int estimate_target(const memtrain::Config& config, const std::string& target_spec, int nproc_per_node, int nnodes) {
  const auto begin = std::chrono::steady_clock::now();
  const auto target = memtrain::parse_target(target_spec);
  const int world = nproc_per_node * nnodes;
  const auto e = memtrain::estimate_for_target(config, target, world);
  const auto shape = memtrain::config_transformer_shape(config);
  const int64_t params = shape.layers * shape.block_parameters + shape.root_parameters;
  std::cout << "model: " << config.model.name << (config.model.preset != "custom" ? " " + config.model.preset : std::string())
            << ", " << params << " parameters (" << shape.layers << " blocks), context " << shape.context
            << ", param_dtype " << config.train.param_dtype << ", precision " << config.train.precision << ", optimizer "
            << config.train.optimizer << "\n"
            << "target: " << target.name << ", " << memtrain::format_bytes(target.bytes) << " per "
            << (target.cuda ? "GPU" : "host") << ", " << world << (world == 1 ? " rank" : " ranks") << " (" << nnodes
            << " x " << nproc_per_node << ")\n"
            << "per rank, micro-batch " << config.train.micro_batch << " x " << config.train.accum_steps << ", recompute "
            << config.memory.recompute << ", head " << config.memory.head << ", ZeRO stage " << config.dist.zero_stage
            << (config.dist.offload_optimizer == "cpu" ? " + offload" : "") << " (the data is not counted: none is read):\n"
            << e.table();
  // The time model (step_time.h): the same step's predicted time, term by term.
  const auto speed = memtrain::target_speed(target, config.train.param_dtype == "bf16" || config.train.precision != "fp32");
  const auto t = memtrain::predict_step(memtrain::step_settings(config, world, nproc_per_node), speed);
  std::ostringstream time;
  time << std::fixed << std::setprecision(1) << "step time: predicted " << t.total_s * 1e3 << " ms (compute "
       << t.compute_s * 1e3 << " with " << t.recompute_s * 1e3 << " recomputing, communication exposed " << t.exposed_s * 1e3
       << " of " << t.communication_s * 1e3 << ", optimizer " << t.optimizer_s * 1e3 << ", offload " << t.offload_s * 1e3
       << ", kernel launches " << t.overhead_s * 1e3 << "), " << std::setprecision(0) << t.tokens_per_s
       << " tokens/s in all\n  speeds: " << speed.source << "\n";
  std::cout << time.str();
  std::cout << "by ZeRO stage:\n";
  for (int stage = 0; stage <= 3; ++stage) {
    for (bool offload : {false, true}) {
      if ((offload && stage == 0) || (world == 1 && stage > 1) || (world == 1 && stage == 1 && !offload)) continue;
      auto v = config;
      v.dist.zero_stage = stage, v.dist.offload_optimizer = offload ? "cpu" : "none";
      const auto s = memtrain::estimate_for_target(v, target, world);
      std::ostringstream share;
      share << std::fixed << std::setprecision(1) << 100.0 * static_cast<double>(s.device_peak()) / static_cast<double>(target.bytes);
      std::cout << "  stage " << stage << (offload ? " + offload" : "          ") << "  device "
                << memtrain::format_bytes(s.device_peak()) << " (" << share.str() << "% of " << target.name << ")"
                << (offload ? ", host " + memtrain::format_bytes(s.states.host.peak()) : std::string())
                << (s.fits() ? "" : "  does not fit") << "\n";
    }
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
  std::cout << "answered in " << ms << " ms, nothing allocated for the model\n";
  return 0;
}

// `memtrain plan --target T`: the settings that fit the target, best first, and the best written as an INI.
int plan_target(const memtrain::Config& config, const std::string& target_spec, int nproc_per_node, int nnodes,
                const std::string& out) {
  const auto begin = std::chrono::steady_clock::now();
  const auto target = memtrain::parse_target(target_spec);
  const int world = nproc_per_node * nnodes;
  const auto plan = memtrain::plan_for_target(config, target, world, nproc_per_node);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
  const int64_t global = config.train.micro_batch * config.train.accum_steps;  // per data-parallel rank
  const int64_t data = world / std::max<int64_t>(1, config.dist.tensor_parallel);
  std::cout << "plan for " << world << " x " << target.name << " (" << memtrain::format_bytes(target.bytes) << " each), "
            << global << " samples per data-parallel rank per step (" << global * data << " in all; tensor "
            << "parallelism up to the GPUs of a node keeps them), leaving memory.budget_headroom = "
            << config.memory.budget_headroom << " free: " << plan.fitting.size() << " of " << plan.considered
            << " settings fit (" << ms << " ms)\n";
  MEMTRAIN_CHECK(!plan.fitting.empty(), memtrain::ConfigError, "[plan] nothing fits ", world, " x ", target.name,
                 ": lower the batch or the context, add ranks, or allow low-bit state (memory.allow_lowbit_optimizer",
                 config.lora.rank > 0 ? "; a LoRA base in NF4: memory.allow_quantized_base" : "",
                 "); memtrain estimate --target shows each term");
  const auto& best = plan.fitting.front();
  if (!best.quantize_base.empty())
    std::cout << "lora.quantize_base = " << best.quantize_base << " (memory.allow_quantized_base = true): no setting with "
              << "the " << config.train.param_dtype << " base fits; the frozen block linears are stored in 4-bit "
              << "NormalFloat (QLoRA), which changes the numerics\n";
  std::cout << "  #  setting                                                                        device peak   host       step ms"
               "    tokens/s\n";
  const size_t shown = std::min<size_t>(plan.fitting.size(), 12);
  for (size_t i = 0; i < shown; ++i) {
    const auto& c = plan.fitting[i];
    std::ostringstream line;
    line << std::fixed << std::setprecision(1) << "  " << std::setw(2) << i + 1 << " " << std::left << std::setw(76)
         << c.describe() << std::right << std::setw(11) << memtrain::format_bytes(c.estimate.peak_device()) << "  "
         << std::setw(9) << memtrain::format_bytes(c.estimate.host.peak()) << std::setw(11) << c.step_ms
         << std::setprecision(0) << std::setw(12) << c.tokens_per_s << "\n";
    std::cout << line.str();
  }
  std::cout << "predicted by the time model (docs/ESTIMATE.md, \"Step time\"): " << plan.speed_source
            << "; it leaves out the data loader, evaluation, logging, elementwise kernels' own time on a CPU and "
               "contention between ranks sharing cores\n";
  auto chosen = config;
  best.apply_to(chosen);
  if (out.empty()) {
    std::cout << "chosen: " << best.describe() << " (memtrain plan ... --out FILE.ini writes it as a config to run)\n";
    return 0;
  }
  memtrain::write_file_atomically(out, "# memtrain plan --target " + target_spec + " --nproc-per-node " +
                                           std::to_string(nproc_per_node) + " --nnodes " + std::to_string(nnodes) +
                                           ": " + best.describe() + "\n" + chosen.to_ini());
  std::cout << "chosen: " << best.describe() << "; written to " << out << " (run it: memtrain --config " << out << ")\n";
  return 0;
}

// `memtrain eval`: the validation loss of the config's model (its init_from weights, or --weights), without
// training. Every rank takes part (ZeRO stage 3 gathers as in training); rank 0 prints and writes.
int eval(const memtrain::Config& config, const std::map<std::string, std::string>& flags) {
  memtrain::Trainer trainer(config);
  if (flags.count("--weights"))
    memtrain::load_module_state(trainer.model(), memtrain::load_safetensors(flags.at("--weights")), flags.at("--weights"));
  const auto e = trainer.validate();
  if (!trainer.world().is_main()) return 0;
  const auto summary = memtrain::RunReport::write_evaluation(trainer, e, flags.count("--weights") ? flags.at("--weights") : "");
  std::cout << "model:   " << trainer.model().describe() << "\n"
            << "val loss " << memtrain::format_shortest(e.loss) << " over " << e.samples << " samples"
            << (e.accuracy >= 0 ? ", accuracy " + memtrain::format_shortest(e.accuracy) : std::string()) << "\n"
            << "summary: " << summary << "\n";
  return 0;
}

// --print-parameters: every parameter of the config's model (with LoRA's adapters, after train.freeze): name,
// shape, and whether it trains. Builds the model only (no weights read, nothing trained).
int print_parameters(const memtrain::Config& config) {
  auto data = memtrain::make_dataset(config, {});
  auto model = memtrain::make_model(config.model, data->info());
  memtrain::select_trainable(*model, config);
  // lora.quantize_base = nf4: which frozen weights are stored in NF4 (the others keep train.param_dtype).
  std::map<std::string, memtrain::Nf4Format> nf4;
  if (config.lora.quantize_base == "nf4")
    for (auto& [name, f] : memtrain::quantize_frozen_linears(*model, memtrain::nf4_options(config.lora), false)) nf4.emplace(name, f);
  int64_t trains = 0, frozen = 0, packed = 0;
  for (const auto& item : model->named_parameters()) {
    const auto& p = item.value();
    const auto q = nf4.find(item.key());
    if (q != nf4.end()) {
      frozen += q->second.numel(), packed += p.numel();
      std::cout << "frozen  " << item.key() << " " << c10::IntArrayRef(q->second.shape) << " nf4 (" << p.numel()
                << " bytes)\n";
      continue;
    }
    (p.requires_grad() ? trains : frozen) += p.numel();
    std::cout << (p.requires_grad() ? "trains  " : "frozen  ") << item.key() << " " << p.sizes() << "\n";
  }
  std::cout << "parameters: " << trains << " train, " << frozen << " frozen (tied weights are listed under each name)";
  if (!nf4.empty())
    std::cout << "; " << nf4.size() << " frozen weights in NF4: " << packed << " bytes; embeddings, norms, the output "
              << "head and tensors that are not whole NF4 groups stay in train.param_dtype";
  std::cout << "\n";
  return 0;
}

// `memtrain export`: no config; the checkpoint's own.
int export_checkpoint(const std::map<std::string, std::string>& flags) {
  auto need = [&](const char* flag) {
    auto it = flags.find(flag);
    MEMTRAIN_CHECK(it != flags.end() && !it->second.empty(), memtrain::ConfigError, "export needs ", flag,
                   " (memtrain export --checkpoint PATH --out DIR)");
    return it->second;
  };
  memtrain::ExportOptions o{.checkpoint = need("--checkpoint"), .out = need("--out"), .merged = flags.count("--merged") > 0};
  if (flags.count("--dtype")) {
    const auto& d = flags.at("--dtype");
    if (d == "float32") o.dtype = torch::kFloat;
    else if (d == "bfloat16") o.dtype = torch::kBFloat16;
    else if (d == "float16") o.dtype = torch::kHalf;
    else throw memtrain::ConfigError("export: --dtype '" + d + "' is not float32 | bfloat16 | float16");
  }
  if (flags.count("--max-shard-mb")) {
    const auto& v = flags.at("--max-shard-mb");
    const auto mb = memtrain::detail::parse_count(v);
    MEMTRAIN_CHECK(mb.has_value(), memtrain::ConfigError, "export: --max-shard-mb '", v, "' is not a whole number >= 1");
    o.max_shard_bytes = *mb * 1000 * 1000;
  }
  const auto r = memtrain::export_hugging_face(o);
  std::cout << "exported: " << r.checkpoint << " (step " << r.step << ", " << r.parameters << " parameters) to " << o.out
            << "\n";
  for (const auto& f : r.files) std::cout << "  " << f << "\n";
  return 0;
}

// The subcommands; training itself takes none.
constexpr const char* kSubcommands[] = {"estimate", "plan", "eval", "export"};

// A first word that is neither an option nor a subcommand ("memtrain estimat --config X"): an error naming the
// subcommands and the closest one, rather than a training run that silently ignores it.
std::string unknown_subcommand(const std::string& word) {
  std::string names, closest;
  size_t best = std::string::npos;
  for (const char* s : kSubcommands) {
    names += std::string(names.empty() ? "" : ", ") + s;
    if (const auto d = memtrain::edit_distance(word, s); d < best) best = d, closest = s;
  }
  std::string hint = best <= std::max<size_t>(2, word.size() / 3) ? " (did you mean '" + closest + "'?)" : "";
  return "memtrain: '" + word + "' is not a subcommand" + hint + "; the subcommands are: " + names +
         ". Training takes none: memtrain --config FILE.ini [--section.key=value ...]";
}
// The command line: a subcommand, the config file, overrides, and the flags of --generate and estimate.
struct Args {
  std::string config_path;
  std::vector<std::string> overrides;
  std::map<std::string, std::string> sampling;  // --generate and its flags
  bool print_only = false;
  bool print_parameters = false;
  bool estimate_only = false;
  int estimate_ranks = 0;
  std::string target;                          // estimate --target, plan --target
  std::string plan_out;                        // plan --out: where the best setting's INI goes ("" = not written)
  int nproc_per_node = 1, nnodes = 1;          // estimate --target's world
  std::string subcommand;                      // "" (train) | estimate | eval | export
  std::map<std::string, std::string> exporting;  // export's flags
};

// A flag's whole number >= 1 (--ranks, --nproc-per-node, --nnodes); 0 when it is not one.
int whole_number(const std::string& v) {
  size_t used = 0;
  int n = 0;
  try {
    n = std::stoi(v, &used);
  } catch (const std::exception&) {
  }
  return used == v.size() && n >= 1 ? n : 0;
}

// estimate's and plan's flags that take the next word (--target, --nproc-per-node, --nnodes, plan's --out), at
// argv[i]: i moves to the value. An exit code when the value is missing or wrong.
std::optional<int> parse_estimate_value(int argc, char** argv, int& i, const std::string& arg, Args& a) {
  if (i + 1 >= argc) {
    std::cerr << "memtrain: estimate: " << arg << " needs a value\n";
    return 2;
  }
  const std::string v = argv[++i];
  if (arg == "--target") {
    a.target = v;
    return std::nullopt;
  }
  if (arg == "--out") {
    a.plan_out = v;
    return std::nullopt;
  }
  const int n = whole_number(v);
  if (n == 0) {
    std::cerr << "memtrain: estimate: " << arg << " '" << v << "' is not a whole number >= 1\n";
    return 2;
  }
  (arg == "--nnodes" ? a.nnodes : a.nproc_per_node) = n;
  return std::nullopt;
}

// One of export's arguments at argv[i]: --merged, or a flag and its value (i moves to it). An exit code when the
// value is missing or the argument unknown.
std::optional<int> parse_export_arg(int argc, char** argv, int& i, const std::string& arg, Args& a) {
  if (arg == "--merged") {
    a.exporting[arg] = "true";
  } else if (arg == "--checkpoint" || arg == "--out" || arg == "--dtype" || arg == "--max-shard-mb") {
    if (i + 1 >= argc) {
      std::cerr << "memtrain: export: " << arg << " needs a value\n";
      return 2;
    }
    a.exporting[arg] = argv[++i];
  } else {
    std::cerr << "memtrain: export: unknown argument '" << arg
              << "' (memtrain export --checkpoint PATH --out DIR [--dtype float32|bfloat16|float16] [--max-shard-mb N] [--merged])\n";
    return 2;
  }
  return std::nullopt;
}

// Fills `a`; an exit code when the command line is answered here (--help, a bad word) or wrong.
std::optional<int> parse_args(int argc, char** argv, Args& a) {
  // memtrain estimate [--ranks N] [--config X] [overrides]: the memory estimate, without training.
  if (argc > 1 && argv[1][0] != '-') {
    a.subcommand = argv[1];
    if (std::find(std::begin(kSubcommands), std::end(kSubcommands), a.subcommand) == std::end(kSubcommands)) {
      std::cerr << unknown_subcommand(argv[1]) << "\n";
      return 2;
    }
  }
  a.estimate_only = a.subcommand == "estimate" || a.subcommand == "plan";
  const bool estimate_only = a.estimate_only;
  for (int i = a.subcommand.empty() ? 1 : 2; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage << "\nkeys:\n" << memtrain::Config::help();
      return 0;
    }
    if (arg == "--print-config-reference") {
      std::cout << memtrain::Config::reference_markdown();
      return 0;
    }
    if (estimate_only && (arg == "--ranks" || arg.rfind("--ranks=", 0) == 0)) {
      const std::string v = arg == "--ranks" ? (i + 1 < argc ? argv[++i] : "") : arg.substr(8);
      a.estimate_ranks = whole_number(v);
      if (a.estimate_ranks == 0) {
        std::cerr << "memtrain: estimate: --ranks '" << v << "' is not a whole number >= 1\n";
        return 2;
      }
    } else if (estimate_only && (arg == "--target" || arg == "--nproc-per-node" || arg == "--nnodes" ||
                                 (a.subcommand == "plan" && arg == "--out"))) {
      if (const auto failed = parse_estimate_value(argc, argv, i, arg, a)) return failed;
    } else if (a.subcommand == "export") {  // export takes only its own arguments
      if (const auto failed = parse_export_arg(argc, argv, i, arg, a)) return failed;
    } else if (arg == "--print-config") {
      a.print_only = true;
    } else if (arg == "--print-parameters") {
      a.print_parameters = true;
    } else if ((arg == "--generate" || arg == "--weights" || arg == "--prompt-ids" || arg == "--temperature" || arg == "--top-k") &&
               i + 1 < argc) {
      a.sampling[arg] = argv[++i];
    } else if (arg == "--config" && i + 1 < argc) {
      a.config_path = argv[++i];
    } else if (arg.rfind("--config=", 0) == 0) {
      a.config_path = arg.substr(9);
    } else {
      a.overrides.push_back(arg);
    }
  }
  return std::nullopt;
}
}  // namespace

int main(int argc, char** argv) {
  // Before any tensor exists: every CPU allocation from here on is counted.
  memtrain::cpu_memory::install();
  memtrain::cpu_memory::keep_freed_memory();
  // A file-size limit (RLIMIT_FSIZE) or a full quota makes a write fail with EFBIG: an error that names
  // the file and keeps the last checkpoint, not a signal that kills the run part way through a save.
  signal(SIGXFSZ, SIG_IGN);
  Args args;
  if (const auto done = parse_args(argc, argv, args)) return *done;
  // The trainer outlives the try: after a failure it is not destroyed, since tearing down a process group
  // waits for collectives queued to peers that will never answer. The error is printed and the process
  // ends at once; the launcher then stops the other ranks.
  std::unique_ptr<memtrain::Trainer> trainer;
  auto leave = [&trainer](int code) {
    std::cout.flush();
    std::cerr.flush();
    if (trainer && trainer->world().world_size > 1) std::_Exit(code);
    return code;
  };
  int64_t limit_mib = 0;  // for an out-of-memory error outside a step (the step's own names the step)
  try {
    if (args.subcommand == "export") return export_checkpoint(args.exporting);
    auto config = memtrain::Config::load(args.config_path, args.overrides);
    limit_mib = config.memory.limit_mib;
    if (memtrain::World::from_env().is_main())
      for (const auto& w : config.warnings) std::cerr << "memtrain: warning: " << w << "\n";
    if (args.print_only) {
      std::cout << config.to_ini();
      return 0;
    }
    if (args.print_parameters) return print_parameters(config);
    if (args.sampling.count("--generate")) return sample(config, args.sampling);
    if (args.subcommand == "eval") {
      for (const auto& [flag, value] : args.sampling)
        MEMTRAIN_CHECK(flag == "--weights", memtrain::ConfigError, flag, " is for --generate");
      return eval(config, args.sampling);
    }
    MEMTRAIN_CHECK(args.sampling.empty(), memtrain::ConfigError, args.sampling.begin()->first, " is for --generate");
    if (args.subcommand == "plan") {
      MEMTRAIN_CHECK(!args.target.empty(), memtrain::ConfigError, "plan needs --target (h100-80gb | h200-141gb | a100-40gb | "
                     "a100-80gb | cpu:<N>GiB | a byte count)");
      return plan_target(config, args.target, args.nproc_per_node, args.nnodes, args.plan_out);
    }
    if (args.estimate_only && !args.target.empty()) return estimate_target(config, args.target, args.nproc_per_node, args.nnodes);
    if (args.estimate_only) return estimate(config, args.estimate_ranks);
    trainer = std::make_unique<memtrain::Trainer>(config);
    trainer->fit();
    trainer.reset();
    return 0;
  } catch (const memtrain::Error& e) {
    std::cerr << "memtrain: " << e.what() << "\n";
    return leave(2);
  } catch (const c10::OutOfMemoryError& e) {
    // Outside a step (setup, a collective between steps, a save): the same form as a step's own error.
    const std::string what = e.what_without_backtrace();
    std::cerr << "memtrain: [memory] out of memory outside a training step (" << what.substr(0, what.find('\n'))
              << "); memory.limit_mib = " << limit_mib << (limit_mib == 0 ? " (none: the device is full)" : "")
              << ". Lower train.micro_batch, recompute more (memory.recompute), shard more (dist.zero_stage) or raise "
                 "the limit\n";
    return leave(2);
  } catch (const c10::Error& e) {
    std::cerr << "memtrain: LibTorch error: " << e.what_without_backtrace() << "\n";
    return leave(1);
  } catch (const std::exception& e) {
    std::cerr << "memtrain: " << e.what() << "\n";
    return leave(1);
  }
}
