// The config: one table of every key (entries(): its reader, printer, default, help and own rule), the
// INI and command-line parsing with errors that say where a value was set, the cross-key rules, --help and
// the reference page. Over 600 lines on purpose: a key is added in one row here, and every reader of the
// table (parser, validator, --help, docs/config-reference.md) follows it.
#include "memtrain/core/config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <boost/program_options.hpp>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <functional>
#include <map>
#include <regex>
#include <sstream>

#include "memtrain/core/recompute_policy.h"
#include "memtrain/core/error.h"
#include "memtrain/core/family_config.h"
#include "memtrain/core/hugging_face_config.h"

namespace po = boost::program_options;

namespace memtrain {
namespace {

// One config key: how Boost parses it into the struct, how to print it back, and the rule its value must
// keep on its own (rules that span keys stay in Config::validate()).
struct Entry {
  std::string key;    // "section.key"
  std::string help;
  std::string group;  // model keys: the models they belong to, space-separated ("gpt llama"); "" for all
  std::function<void(po::options_description&)> declare;
  std::function<std::string()> show;
  std::function<void()> check;  // throws ConfigError naming the key, the value and what is allowed
};

// The family of model.name, null for a name no family has (validate() says so).
const FamilyConfig* family_or_null(const std::string& name) {
  for (const auto* f : family_configs())
    if (f->name == name) return f;
  return nullptr;
}

// The keys a model's preset fixes (none for preset = custom): an error beside it, and not printed by to_ini().
std::vector<std::string> preset_fixed_keys(const ModelConfig& m) {
  const auto* f = family_or_null(m.name);
  if (m.preset == "custom" || !f) return {};
  return f->fixed_keys;
}

// Whether model.name reads key `e`: its family's key group is among the key's.
bool applies_to(const Entry& e, const std::string& model) {
  if (e.group.empty()) return true;
  const auto* f = family_or_null(model);
  std::istringstream words(e.group);
  for (std::string w; words >> w;)
    if (f ? w == f->keys : w == model) return true;
  return false;
}

// The families that read a key group, "gpt llama" -> "gpt | llama | phi3", for --help and the reference page.
std::string group_names(const std::string& group) {
  std::istringstream words(group);
  std::string out;
  for (std::string w; words >> w;)
    for (const auto* f : family_configs())
      if (f->keys == w) out.append(out.empty() ? "" : " | ").append(f->name);
  return out;
}

// model.name: a registered family.
void check_family_name(const std::string& key, const std::string& value) {
  if (!family_or_null(value))
    throw ConfigError(detail::concat("[config] ", key, " = '", value, "' is not allowed; expected one of: ", family_names()));
}

// model.preset: custom or some family's (validate() checks it is model.name's).
void check_preset_name(const std::string& key, const std::string& value) {
  if (value == "custom" || family_with_preset(value)) return;
  std::string all = "custom";
  for (const auto* f : family_configs())
    for (const auto& p : f->presets)
      if (p != "custom") all += " | " + p;
  throw ConfigError(detail::concat("[config] ", key, " = '", value, "' is not allowed; expected one of: ", all));
}

// "gpt: custom | tiny | ...; llama: ...": each family's presets, for the help.
std::string preset_help() {
  std::string out;
  for (const auto* f : family_configs()) {
    if (f->presets.empty()) continue;
    std::string names;
    for (const auto& p : f->presets) names += (names.empty() ? "" : " | ") + p;
    out += (out.empty() ? "" : "; ") + f->name + ": " + names;
  }
  return out;
}

template <size_t N>
void check_one_of(const std::string& key, const std::string& value, const std::array<std::string_view, N>& allowed) {
  for (auto a : allowed)
    if (value == a) return;
  throw ConfigError(detail::concat("[config] ", key, " = '", value, "' is not allowed; expected one of: ",
                                   choices::join(allowed)));
}

template <class T>
void check_range(const std::string& key, T value, bool ok, const std::string& allowed) {
  MEMTRAIN_CHECK(ok, ConfigError, "[config] ", key, " = ", value, " is out of range: expected ", allowed);
}

// The rules of a table row: a value's own check, given the key.
template <class T>
using Check = std::function<void(const std::string& key, const T& value)>;

template <class T>
Check<T> at_least(T lo, std::string allowed = "") {
  if (allowed.empty()) {
    if constexpr (std::is_floating_point_v<T>) allowed = ">= " + format_shortest(lo);
    else allowed = ">= " + std::to_string(lo);
  }
  return [lo, allowed](const std::string& key, const T& v) { check_range(key, v, v >= lo, allowed); };
}

template <class T>
Check<T> where(bool (*ok)(T), std::string allowed) {
  return [ok, allowed](const std::string& key, const T& v) { check_range(key, v, ok(v), allowed); };
}

template <size_t N>
Check<std::string> one_of(const std::array<std::string_view, N>& allowed) {
  return [&allowed](const std::string& key, const std::string& v) { check_one_of(key, v, allowed); };
}

// A grammar's own parser (memory.recompute, memory.head): it throws the ConfigError.
Check<std::string> parses_with(void (*parse)(const std::string&)) {
  return [parse](const std::string&, const std::string& v) { parse(v); };
}

std::string trim(const std::string& s);

// train.freeze: a regular expression std::regex accepts.
void check_regex(const std::string& value) {
  try {
    std::regex re(value);
  } catch (const std::regex_error& e) {
    throw ConfigError(detail::concat("[config] train.freeze = '", value, "' is not a regular expression: ", e.what()));
  }
}

// model.hidden: comma-separated positive integers.
Check<std::string> positive_list() {
  return [](const std::string& key, const std::string& value) {
    std::stringstream ss(value);
    for (std::string item; std::getline(ss, item, ',');) {
      bool ok = false;
      try {
        size_t used = 0;
        ok = std::stoll(trim(item), &used) > 0 && used == trim(item).size();
      } catch (...) {
      }
      MEMTRAIN_CHECK(ok, ConfigError, "[config] ", key, " = '", value,
                     "' is invalid: expected comma-separated positive integers, e.g. 256,128");
    }
  };
}

template <class T>
std::string show_value(const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else if constexpr (std::is_floating_point_v<T>) {
    return format_shortest(v);
  } else {
    std::ostringstream os;
    os << v;
    return os.str();
  }
}

template <class T>
Entry entry(std::string key, T* field, std::string help, std::string group, Check<T> check = {}) {
  Entry e;
  e.key = key;
  e.help = help;
  e.group = group;
  e.declare = [key, field, help](po::options_description& d) {
    d.add_options()(key.c_str(), po::value<T>(field)->default_value(*field, show_value(*field)),
                    help.c_str());
  };
  e.show = [field] { return show_value(*field); };
  if (check) e.check = [key, field, check] { check(key, *field); };
  return e;
}

template <class T>
Entry entry(std::string key, T* field, std::string help, Check<T> check = {}) {
  return entry(key, field, std::move(help), "", std::move(check));
}

std::vector<Entry> entries(Config& c) {
  auto& m = c.model;
  auto& d = c.data;
  auto& t = c.train;
  auto& mem = c.memory;
  auto& dist = c.dist;
  auto& l = c.log;
  auto& ck = c.checkpoint;
  auto& lo = c.lora;
  return {
      entry("model.name", &m.name, family_names(), Check<std::string>(check_family_name)),
      entry("model.init_from", &m.init_from, "a Hugging Face model folder (config.json, model*.safetensors): its config.json sets model.name and the shape, its weights the starting point; empty = random weights", "gpt llama"),
      entry("model.preset", &m.preset, preset_help() + " (a preset fixes the shape; a Llama-shaped preset leaves block_size, the training context, free)", "gpt llama", Check<std::string>(check_preset_name)),
      entry("model.n_layer", &m.n_layer, "transformer blocks (preset = custom only)", "gpt llama", at_least<int64_t>(1)),
      entry("model.n_head", &m.n_head, "attention heads (preset = custom only)", "gpt llama", at_least<int64_t>(1)),
      entry("model.n_embd", &m.n_embd, "embedding width (preset = custom only)", "gpt llama"),
      entry("model.block_size", &m.block_size, "context length in tokens (gpt: preset = custom only)", "gpt llama", at_least<int64_t>(1)),
      entry("model.vocab_size", &m.vocab_size, "vocabulary; 0 = from the data", "gpt llama", at_least<int64_t>(0, ">= 0 (0 = from the data)")),
      entry("model.dropout", &m.dropout, "dropout probability (attention, residual and embedding)", "gpt", where<double>([](double v) { return v >= 0 && v < 1; }, "in [0, 1)")),
      entry("model.bias", &m.bias, "biases in the Linear layers", "gpt"),
      entry("model.n_kv_head", &m.n_kv_head, "grouped-query attention: key/value heads, a divisor of n_head; 0 = n_head", "llama", at_least<int64_t>(0, ">= 0 (0 = n_head)")),
      entry("model.ffn_hidden", &m.ffn_hidden, "width of the SwiGLU MLP (intermediate_size); 0 = 8/3 n_embd rounded up to a multiple of 64", "llama", at_least<int64_t>(0, ">= 0 (0 = 8/3 n_embd)")),
      entry("model.rope_theta", &m.rope_theta, "rotary embeddings' base", "llama", where<double>([](double v) { return v > 1; }, "> 1")),
      entry("model.rope_scaling", &m.rope_scaling, "none | llama3:FACTOR:LOW_FREQ_FACTOR:HIGH_FREQ_FACTOR:ORIGINAL_CONTEXT (Llama 3.1's, e.g. llama3:8:1:4:8192)", "llama", parses_with([](const std::string& v) { parse_rope_scaling(v); })),
      entry("model.norm_eps", &m.norm_eps, "RMSNorm's epsilon", "llama", where<double>([](double v) { return v > 0; }, "> 0")),
      entry("model.tie_embeddings", &m.tie_embeddings, "the output head is the token embedding", "llama"),
      entry("model.max_positions", &m.max_positions, "the longest context the model is made for (config.json's max_position_embeddings); 0 = block_size", "llama", at_least<int64_t>(0, ">= 0 (0 = block_size)")),
      entry("model.attn_bias", &m.attn_bias, choices::join(choices::attn_bias) + " (qkv: Qwen2's biases on q, k, v; all: also on the output projection)", "llama", one_of(choices::attn_bias)),
      entry("model.depth", &m.depth, "18 | 50", "resnet", where<int64_t>([](int64_t v) { return v == 18 || v == 50; }, "18 or 50")),
      entry("model.width", &m.width, "channels of the first stage", "resnet", at_least<int64_t>(1)),
      entry("model.stem", &m.stem, choices::join(choices::resnet_stem) + " (small: 3x3 stem for 28x28 images)", "resnet", one_of(choices::resnet_stem)),
      entry("model.hidden", &m.hidden, "comma-separated hidden widths", "mlp", positive_list()),
      entry("data.dataset", &d.dataset, choices::join(choices::dataset), one_of(choices::dataset)),
      entry("data.path", &d.path, "text file or Fashion-MNIST folder; empty = prepared cache"),
      entry("data.val_fraction", &d.val_fraction, "fraction held out for validation, in [0, 0.5]", where<double>([](double v) { return v >= 0 && v <= 0.5; }, "in [0, 0.5]")),
      entry("data.tokens", &d.tokens,
            "text: token ids instead of bytes; a prepared BPE set (austen-bpe8192 | austen-bpe50257) or the path of a "
            "token file (llm.c's .bin or headerless uint16), memory-mapped; empty = byte-level"),
      entry("data.pack", &d.pack, "chat: several records per row of model.block_size, each attending to itself only; false = one record per row, padded (the unpacked baseline)"),
      entry("data.val_tokens", &d.val_tokens, "validation token file; empty = the tail val_fraction of data.tokens"),
      entry("data.token_format", &d.token_format,
            choices::join(choices::token_format) + " (llmc: 256 x int32 header, magic 20240520; raw: headerless uint16)", one_of(choices::token_format)),
      entry("train.device", &t.device, choices::join(choices::device), one_of(choices::device)),
      entry("train.optimizer", &t.optimizer, choices::join(choices::optimizer) + " (adamw: ATen's fused kernel; adamw_loop: LibTorch's per-parameter AdamW; adamw8bit / adamw4bit: AdamW whose moments are stored blockwise-quantized in 8 or 4 bits, as torchao's AdamW8bit / AdamW4bit)", one_of(choices::optimizer)),
      entry("train.lr", &t.lr, "peak learning rate", where<double>([](double v) { return v > 0; }, "> 0")),
      entry("train.min_lr", &t.min_lr, "learning rate at the end of the cosine decay"),
      entry("train.warmup_steps", &t.warmup_steps, "linear warm-up steps", at_least<int64_t>(0)),
      entry("train.steps", &t.steps, "optimizer steps", at_least<int64_t>(1)),
      entry("train.weight_decay", &t.weight_decay, "decoupled weight decay (matrices only)", at_least<double>(0)),
      entry("train.beta1", &t.beta1, "adamw beta1", where<double>([](double v) { return v >= 0 && v < 1; }, "in [0, 1)")),
      entry("train.beta2", &t.beta2, "adamw beta2", where<double>([](double v) { return v >= 0 && v < 1; }, "in [0, 1)")),
      entry("train.eps", &t.eps, "adamw epsilon", where<double>([](double v) { return v > 0; }, "> 0")),
      entry("train.momentum", &t.momentum, "sgd momentum", where<double>([](double v) { return v >= 0 && v < 1; }, "in [0, 1)")),
      entry("train.optimizer_block", &t.optimizer_block,
            "adamw8bit / adamw4bit: values per block (one fp32 absmax each); 0 = 256 for 8 bits, 128 for 4 bits",
            where<int64_t>([](int64_t v) { return v == 0 || (v >= 2 && v % 2 == 0); }, "0 or an even number >= 2")),
      entry("train.optimizer_min_quantized", &t.optimizer_min_quantized,
            "adamw8bit / adamw4bit: parameters with fewer elements (or not a whole number of blocks) keep fp32 moments",
            at_least<int64_t>(1)),
      entry("train.grad_clip", &t.grad_clip, "max global gradient norm; 0 = off", at_least<double>(0, ">= 0 (0 = off)")),
      entry("train.micro_batch", &t.micro_batch, "samples per micro-batch per rank", at_least<int64_t>(1)),
      entry("train.accum_steps", &t.accum_steps, "micro-batches per optimizer step", at_least<int64_t>(1)),
      entry("train.precision", &t.precision, choices::join(choices::precision) + " (fp16: with dynamic loss scaling, on CUDA or a CPU)", one_of(choices::precision)),
      entry("train.param_dtype", &t.param_dtype, choices::join(choices::param_dtype) + " (bf16: bf16 parameters, fp32 master weights in the optimizer)", one_of(choices::param_dtype)),
      entry("train.loss_scale_init", &t.loss_scale_init, "fp16: initial loss scale", where<double>([](double v) { return v > 0; }, "> 0")),
      entry("train.loss_scale_growth", &t.loss_scale_growth, "fp16: scale multiplier after loss_scale_interval finite steps", where<double>([](double v) { return v > 1; }, "> 1")),
      entry("train.loss_scale_backoff", &t.loss_scale_backoff, "fp16: scale multiplier after an inf/NaN step", where<double>([](double v) { return v > 0 && v < 1; }, "in (0, 1)")),
      entry("train.loss_scale_interval", &t.loss_scale_interval, "fp16: finite steps before the scale grows", at_least<int64_t>(1)),
      entry("train.seed", &t.seed, "seed for weights, data order and dropout"),
      entry("train.eval_every", &t.eval_every, "evaluate every N steps; 0 = at the end only", at_least<int64_t>(0)),
      entry("train.eval_batches", &t.eval_batches, "validation batches per evaluation", at_least<int64_t>(1)),
      entry("train.threads", &t.threads, "intra-op CPU threads; 0 = LibTorch default", at_least<int64_t>(0)),
      entry("train.oom", &t.oom,
            choices::join(choices::oom) + " (out of memory in a step: retry it with half the micro-batch and twice the "
            "accumulation, the same samples; or stop, naming the peak and the limit)", one_of(choices::oom)),
      entry("train.on_nonfinite", &t.on_nonfinite,
            choices::join(choices::on_nonfinite) + " (a non-finite loss or gradient norm without fp16: skip the update, "
            "or stop the run; fp16's loss scaler skips such steps itself)", one_of(choices::on_nonfinite)),
      entry("train.max_nonfinite", &t.max_nonfinite, "consecutive skipped non-finite steps before the run stops", at_least<int64_t>(1)),
      entry("train.host_reads", &t.host_reads,
            choices::join(choices::host_reads) + " (when the host reads a step's found-inf and stop flags: each_step at "
            "its end, one host sync per step; deferred: the fused AdamW skips a non-finite update on the device and "
            "the host reads the flags once the next step's forward and backward are queued, at once on log, "
            "evaluation, save and last steps; auto: deferred on CUDA with train.optimizer = adamw and no "
            "dist.offload_optimizer, each_step otherwise)", one_of(choices::host_reads)),
      entry("train.freeze", &t.freeze, "a regular expression (ECMAScript, matching the whole name) of parameters that do not train: no gradient, optimizer state or master copy (names as --print-parameters lists them: Hugging Face's for imported models); empty = none", parses_with(check_regex)),
      entry("memory.track", &mem.track, "record per-step peak memory"),
      entry("memory.recompute", &mem.recompute, "activation recomputation (checkpointing): none | all | every:K | attn | mlp | budget:MiB", parses_with([](const std::string& v) { RecomputePolicy::parse(v); })),
      entry("memory.offload", &mem.offload, "keep recomputed blocks' inputs in pinned CPU memory (CUDA)"),
      entry("memory.head", &mem.head, "plain | fused | fused:ROWS (LM head + loss in chunks of ROWS tokens; the logits never exist whole)", parses_with([](const std::string& v) { parse_head_rows(v); })),
      entry("memory.estimate", &mem.estimate,
            "estimate each rank's peak before step 1 (model states from element counts, activations in closed form "
            "or from a probe) and print it beside the measured peak"),
      entry("memory.estimate_method", &mem.estimate_method,
            "auto: activations in closed form for a model family that has one (memtrain estimate --target names them) "
            "without [lora] or train.freeze (nothing run or "
            "allocated; docs/ESTIMATE.md), a probe forward + backward at two small micro-batches otherwise | "
            "closed_form (an error where there is none) | probe", one_of(choices::estimate_method)),
      entry("memory.budget_mib", &mem.budget_mib,
            "plan to a memory budget per rank: MiB | auto (the device's free memory, on CPU the machine's available "
            "memory, less 10%) | 0 (off). The planner keeps the global batch and chooses train.micro_batch / "
            "accum_steps, memory.recompute, memory.head, (several ranks) dist.zero_stage and (CUDA) "
            "dist.offload_optimizer: the fastest whose estimate fits the budget less memory.budget_headroom"),
      entry("memory.budget_headroom", &mem.budget_headroom,
            "the share of memory.budget_mib that a planned setting's estimate must leave free, for the estimate's "
            "error (measured within 3.2% of the peak on CPU, docs/benchmarks/estimate_cpu.md): in [0, 0.5)", where<double>([](double v) { return v >= 0 && v < 0.5; }, "in [0, 0.5)")),
      entry("memory.allow_quantized_base", &mem.allow_quantized_base,
            "plan / estimate --target may store a LoRA model's frozen base in NF4 (lora.quantize_base = nf4, QLoRA) "
            "when it helps a setting fit: it changes the numerics, so only when allowed, and it says so"),
      entry("memory.allow_lowbit_optimizer", &mem.allow_lowbit_optimizer,
            "the planner (memory.budget_mib) may switch train.optimizer = adamw / adamw_loop to adamw8bit, then "
            "adamw4bit, when no setting with fp32 moments fits: it changes the numerics, so only when allowed, and "
            "it says so"),
      entry("memory.snapshot", &mem.snapshot,
            "CUDA: record the caching allocator's history and write memory_snapshot.rank<N>.pickle at the end, for "
            "python -m torch.cuda._memory_viz trace_plot FILE -o memory_viz.html"),
      entry("memory.expandable_segments", &mem.expandable_segments,
            "CUDA: the caching allocator's expandable_segments (segments grow in place: less fragmentation)"),
      entry("memory.gc_threshold", &mem.gc_threshold,
            "CUDA: the caching allocator's garbage_collection_threshold in (0, 1); 0 = off", where<double>([](double v) { return v >= 0 && v < 1; }, "in [0, 1) (0 = off)")),
      entry("memory.cuda_allocator", &mem.cuda_allocator,
            choices::join(choices::cuda_allocator) + " (CUDA: the caching allocator's backend, chosen when the process starts: "
            "export PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync before it; this key checks that it was)", one_of(choices::cuda_allocator)),
      entry("memory.limit_mib", &mem.limit_mib,
            "this process's memory limit in MiB (CPU: enforced by the counting allocator; CUDA: the caching "
            "allocator's fraction of the device); 0 = none", at_least<int64_t>(0, ">= 0 (0 = no limit)")),
      entry("dist.backend", &dist.backend, choices::join(choices::backend), one_of(choices::backend)),
      entry("dist.timeout_s", &dist.timeout_s, "rendezvous and collective timeout in seconds", at_least<int64_t>(1)),
      entry("dist.zero_stage", &dist.zero_stage,
            "0: data parallel, gradients all-reduced | 1: optimizer state (and fp32 masters) sharded over ranks | "
            "2: gradients sharded too | 3: parameters sharded too, each block's gathered just before it runs (forward and "
            "backward) and freed after", where<int64_t>([](int64_t v) { return v >= 0 && v <= 3; }, "0, 1, 2 or 3")),
      entry("dist.prefetch", &dist.prefetch, "zero_stage 3: blocks gathered ahead of the one running (0: none)", at_least<int64_t>(0)),
      entry("dist.offload_optimizer", &dist.offload_optimizer,
            choices::join(choices::offload_optimizer) +
                " (cpu: this rank's fp32 masters, optimizer state and reduced gradients live in host memory, pinned on "
                "CUDA; the optimizer steps there; zero_stage 1-3; also in a single process: ZeRO-Offload on one device)", one_of(choices::offload_optimizer)),
      entry("dist.bucket_mib", &dist.bucket_mib, "gradient bucket size in MiB; a bucket's reduction starts when it is full", where<double>([](double v) { return v > 0; }, "> 0")),
      entry("dist.reduce", &dist.reduce,
            choices::join(choices::dist_reduce) +
                " (step: accumulate micro-batches locally and reduce once, least traffic; micro_batch: reduce after "
                "each, least memory with zero_stage 2)", one_of(choices::dist_reduce)),
      entry("dist.tensor_parallel", &dist.tensor_parallel,
            "T: groups of T consecutive ranks split every block's attention (by head) and MLP (column then row), the "
            "embedding and head by vocabulary (gpt, llama); ZeRO (dist.zero_stage) runs over the world / T groups across "
            "them; 1 = none", at_least<int64_t>(1)),
      entry("dist.sequence_parallel", &dist.sequence_parallel,
            choices::join(choices::sequence_parallel) +
                " (with dist.tensor_parallel > 1: between the split regions each rank keeps 1/T of the tokens, norms and "
                "residuals included; auto = on)", one_of(choices::sequence_parallel)),
      entry("log.every", &l.every, "a log line every N steps", at_least<int64_t>(1)),
      entry("log.dir", &l.dir, "folder for run outputs"),
      entry("log.name", &l.name, "run name; empty = config file stem"),
      entry("log.progress", &l.progress, choices::join(choices::progress), one_of(choices::progress)),
      entry("log.trace", &l.trace,
            "write trace.json (trace.rank<N>.json with several ranks): each step's phases, evaluations and saves "
            "with the running memory peak, for chrome://tracing or ui.perfetto.dev"),
      entry("log.trace_blocks", &l.trace_blocks,
            "the trace also holds a span per block, forward and backward (a hook on each block's output; with "
            "dist.zero_stage = 3 the spans include the block's gather)"),
      entry("log.profile_step", &l.profile_step,
            "record this step with the Kineto profiler that ships in LibTorch: profile.json (profile.rank<N>.json with "
            "several ranks), a Chrome trace of its ATen ops and CUDA kernels, and profile.md, a table of its time by "
            "kernel (CUDA; by op's self time on a CPU) and by kind (GEMM, attention, loss, normalization, ...); 0 = none",
            at_least<int64_t>(0)),
      entry("log.peak_tflops", &l.peak_tflops,
            "the device's peak TFLOP/s for MFU; 0 = from memtrain's table of known GPUs by name and precision "
            "(on CPU: MFU is not reported unless this is set)", at_least<double>(0, ">= 0 (0 = from the table of known GPUs)")),
      entry("log.overwrite", &l.overwrite,
            "start over in a run folder that already holds a run (its metrics are truncated and its checkpoints "
            "deleted); false: such a folder is an error unless checkpoint.resume is set"),
      entry("checkpoint.dir", &ck.dir, "where checkpoints are saved; empty = <run>/checkpoints"),
      entry("checkpoint.every", &ck.every,
            "save the whole training state (step-00000N/: weights, optimizer, scaler, step) every N steps; 0 = only "
            "at the end", at_least<int64_t>(0)),
      entry("checkpoint.save_final", &ck.save_final,
            "when training ends: save the training state and the weights alone (model.safetensors)"),
      entry("checkpoint.save_initial", &ck.save_initial,
            "before step 1 of a fresh run: save the weights as set up (initial.safetensors beside model.safetensors): the "
            "model the run starts from, for a baseline or to compare initialisations"),
      entry("checkpoint.keep", &ck.keep, "training-state checkpoints kept: the newest K", at_least<int64_t>(1)),
      entry("checkpoint.resume", &ck.resume,
            "empty: start fresh | auto: continue from the newest complete checkpoint in checkpoint.dir (none: start "
            "fresh and say so) | a checkpoint folder"),
      entry("lora.rank", &lo.rank, "low-rank adapters' rank; 0 = none (every parameter trains, unless train.freeze)", at_least<int64_t>(0)),
      entry("lora.alpha", &lo.alpha, "the adapters' scale is alpha / rank", where<double>([](double v) { return v > 0; }, "> 0")),
      entry("lora.dropout", &lo.dropout, "dropout on the adapters' input", where<double>([](double v) { return v >= 0 && v < 1; }, "in [0, 1)")),
      entry("lora.targets", &lo.targets, "comma-separated names of the linear maps that get adapters: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj (llama) | c_attn,c_proj,c_fc (gpt)"),
      entry("lora.quantize_base", &lo.quantize_base, choices::join(choices::quantize_base) + " (nf4: QLoRA; the frozen block linears stored in 4-bit NormalFloat as torchao's NF4Tensor, about 0.52 byte per weight, dequantized to bf16 inside each product; the output head, embeddings, norms and tensors that are not whole blocks stay as they are)", one_of(choices::quantize_base)),
      entry("lora.quantize_block", &lo.quantize_block, "nf4: values per absmax (QLoRA's 64)", where<int64_t>([](int64_t v) { return v >= 2 && v % 2 == 0; }, "an even number >= 2")),
      entry("lora.double_quant", &lo.double_quant, "nf4: the absmaxes themselves in int8, in groups of 256 with one factor each, less their mean (QLoRA's double quantization); false: one bf16 absmax per block"),
      entry("lora.init_from", &lo.init_from, "a peft adapter folder (adapter_config.json + adapter_model.safetensors) to start the adapters from; empty = A Kaiming-uniform, B zero (the first forward is the base model's)"),
  };
}

// Where a key sits in an INI file, so errors can name the line and the raw value.
struct Location {
  int line = 0;
  std::string raw;
};

std::string trim(const std::string& s) {
  auto b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  auto e = s.find_last_not_of(" \t\r");
  return s.substr(b, e - b + 1);
}

std::map<std::string, Location> scan_ini(const std::string& path) {
  std::map<std::string, Location> out;
  std::ifstream in(path);
  std::string line, section;
  for (int n = 1; std::getline(in, line); ++n) {
    auto s = trim(line);
    if (s.empty() || s[0] == '#' || s[0] == ';') continue;
    if (s.front() == '[' && s.back() == ']') {
      section = trim(s.substr(1, s.size() - 2));
      continue;
    }
    auto eq = s.find('=');
    if (eq == std::string::npos) continue;
    auto key = trim(s.substr(0, eq));
    out[section.empty() ? key : section + "." + key] = {n, trim(s.substr(eq + 1))};
  }
  return out;
}

std::string known_keys_hint(const std::vector<Entry>& all, const std::string& bad) {
  auto section = bad.substr(0, bad.find('.'));
  std::string best;
  size_t best_d = 4;  // suggest only close matches
  std::string in_section;
  for (const auto& e : all) {
    auto d = edit_distance(e.key, bad);
    if (d < best_d) best_d = d, best = e.key;
    if (e.key.rfind(section + ".", 0) == 0) in_section += (in_section.empty() ? "" : ", ") + e.key;
  }
  std::string hint;
  if (!best.empty()) hint += "; did you mean '" + best + "'?";
  if (!in_section.empty()) hint += " Known keys in [" + section + "]: " + in_section;
  else hint += " Known sections: [model] [data] [train] [memory] [dist] [log] [checkpoint] [lora]";
  return hint;
}

}  // namespace

namespace {

// Keys that were renamed: the old name is an error that names the new one.
const std::map<std::string, std::string>& renamed_keys() {
  static const std::map<std::string, std::string> renamed = {
      {"memory.checkpoint", "memory.recompute (activation recomputation; [checkpoint] is about saving)"},
  };
  return renamed;
}

void refuse_renamed(const std::string& key, const std::string& where) {
  auto it = renamed_keys().find(key);
  if (it != renamed_keys().end())
    throw ConfigError(detail::concat("[config] ", where, ": '", key, "' was renamed: use ", it->second));
}

// "--a.b=1 --c.d 2 --a.b=3" -> "--c.d 2 --a.b=3": the last value of a key wins, as in torchrun, argparse
// and Hydra, so a script can append an override to a command line that already has one.
std::vector<std::string> last_override_wins(const std::vector<std::string>& args) {
  std::vector<std::pair<std::string, std::vector<std::string>>> groups;  // (key, tokens)
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& a = args[i];
    if (a.rfind("--", 0) != 0) {  // a stray value: leave it to Boost to report
      groups.push_back({"", {a}});
      continue;
    }
    const auto eq = a.find('=');
    std::vector<std::string> tokens{a};
    if (eq == std::string::npos && i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) tokens.push_back(args[++i]);
    groups.push_back({a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2), tokens});
  }
  std::vector<std::string> out;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& key = groups[g].first;
    bool later = false;
    for (size_t h = g + 1; h < groups.size() && !key.empty(); ++h) later = later || groups[h].first == key;
    if (!later) out.insert(out.end(), groups[g].second.begin(), groups[g].second.end());
  }
  return out;
}

}  // namespace

Config Config::load(const std::string& path, const std::vector<std::string>& raw_overrides) {
  Config c;
  c.source = path;
  auto all = entries(c);
  po::options_description desc;
  for (const auto& e : all) e.declare(desc);
  const auto overrides = last_override_wins(raw_overrides);

  po::variables_map vm;
  // Command-line overrides first: Boost keeps the first value stored for a key.
  try {
    po::store(po::command_line_parser(overrides).options(desc).style(po::command_line_style::default_style &
                                                                       ~po::command_line_style::allow_guessing)
                  .run(),
              vm);
  } catch (const po::unknown_option& e) {
    auto key = e.get_option_name();
    if (key.rfind("--", 0) == 0) key = key.substr(2);
    key = key.substr(0, key.find('='));
    refuse_renamed(key, "command line");
    throw ConfigError(detail::concat("[config] command line: unknown option '--", key, "'",
                                     known_keys_hint(all, key)));
  } catch (const po::error& e) {
    throw ConfigError(detail::concat("[config] command line: ", e.what()));
  }

  std::map<std::string, Location> where;  // key -> line in the file
  auto at = [&](const std::string& key) {
    auto it = where.find(key);
    return it == where.end() ? path : detail::concat(path, ":", it->second.line);
  };
  if (!path.empty()) {
    std::error_code ec;
    MEMTRAIN_CHECK(std::filesystem::is_regular_file(path, ec), ConfigError, "[config] cannot open config file '",
                   path, "': ", std::filesystem::exists(path, ec) ? "not a regular file" : "no such file");
    std::ifstream in(path);
    MEMTRAIN_CHECK(in.good(), ConfigError, "[config] cannot read config file '", path, "'");
    where = scan_ini(path);
    try {
      po::store(po::parse_config_file(in, desc, /*allow_unregistered=*/false), vm);
    } catch (const po::unknown_option& e) {
      auto key = e.get_option_name();
      MEMTRAIN_CHECK(key.find('.') != std::string::npos, ConfigError, "[config] ", at(key), ": key '", key,
                     "' is outside any section; put it under one of [model] [data] [train] [memory] [dist] [log] "
                     "[checkpoint]");
      refuse_renamed(key, at(key));
      throw ConfigError(detail::concat("[config] ", at(key), ": unknown key '", key.substr(key.find('.') + 1),
                                       "' in section [", key.substr(0, key.find('.')), "]",
                                       known_keys_hint(all, key)));
    } catch (const po::invalid_option_value& e) {
      auto key = e.get_option_name();
      auto it = where.find(key);
      throw ConfigError(detail::concat("[config] ", at(key), ": invalid value '",
                                       it == where.end() ? "" : it->second.raw, "' for ", key, " (", e.what(), ")"));
    } catch (const po::error& e) {
      throw ConfigError(detail::concat("[config] ", path, ": ", e.what()));
    }
  }
  try {
    po::notify(vm);
  } catch (const po::error& e) {
    throw ConfigError(detail::concat("[config] ", e.what()));
  }
  // Where a key's value came from, for messages: the command line, the file's line, or the default.
  auto origin = [&](const std::string& key) -> std::string {
    auto on_cmdline = std::any_of(overrides.begin(), overrides.end(),
                                  [&](const std::string& o) { return o.rfind("--" + key, 0) == 0; });
    if (on_cmdline) return "set on the command line";
    if (where.count(key)) return detail::concat("set at ", path, ":", where[key].line);
    return "the default";
  };
  auto given = [&](const std::string& key) { return vm.count(key) && !vm[key].defaulted(); };

  // A preset names its family: --model.preset=llama-3.1-8b alone is a Llama (a model.name given beside it must agree,
  // as validate() checks).
  if (given("model.preset") && !given("model.name"))
    if (const auto* f = family_with_preset(c.model.preset)) c.model.name = f->name;
  // A folder that sets keys (model.init_from's config.json, lora.init_from's adapter_config.json): a key also
  // given here must say the same, compared as `canonical` shows it.
  auto must_agree = [&](const Config& from_folder, const std::vector<std::string>& keys, const std::string& source,
                        const std::string& file, const std::function<std::string(const std::string&)>& canonical) {
    auto theirs = entries(const_cast<Config&>(from_folder));
    for (size_t i = 0; i < all.size(); ++i) {
      const auto& key = all[i].key;
      if (!given(key) || std::find(keys.begin(), keys.end(), key) == keys.end()) continue;
      MEMTRAIN_CHECK(canonical(all[i].show()) == canonical(theirs[i].show()), ConfigError, "[config] ", key, " = ",
                     all[i].show(), " (", origin(key), ") disagrees with ", source, ", whose ", file, " makes it ",
                     theirs[i].show(), ": remove ", key);
    }
  };
  // model.init_from: config.json sets the name and shape.
  if (!c.model.init_from.empty()) {
    auto hf = model_from_hugging_face(c.model.init_from, c.model);
    Config from_folder = c;
    from_folder.model = hf.config;
    must_agree(from_folder, hf.keys, "model.init_from = " + c.model.init_from,
               "config.json (model_type " + hf.model_type + ")", [](const std::string& v) { return v; });
    c.model = hf.config;
    // The default context, when it is more than the model was made for (a tiny test model), is the model's.
    if (!given("model.block_size") && c.model.max_positions > 0 && c.model.block_size > c.model.max_positions)
      c.model.block_size = c.model.max_positions;
  }
  // lora.init_from: adapter_config.json sets the rank, alpha, dropout and targets (targets in any order).
  if (!c.lora.init_from.empty()) {
    auto peft = lora_from_peft(c.lora.init_from, c.lora);
    Config from_folder = c;
    from_folder.lora = peft.config;
    must_agree(from_folder, peft.keys, "lora.init_from = " + c.lora.init_from, "adapter_config.json",
               [](const std::string& v) {
                 LoraConfig listed;
                 listed.targets = v;
                 auto names = lora_targets(listed);
                 std::sort(names.begin(), names.end());
                 std::string out;
                 for (const auto& t : names) out += (out.empty() ? "" : ",") + t;
                 return out;
               });
    c.lora = peft.config;
  }

  try {
    c.validate();
  } catch (const ConfigError& e) {
    std::string msg = e.what();
    const auto begin = std::string("[config] ").size();
    const auto key = msg.substr(begin, msg.find(' ', begin) - begin);
    if (given(key)) msg += " (" + origin(key) + ")";
    throw ConfigError(msg);
  }

  // A preset fixes the shape: a shape key beside it would be silently ignored.
  for (const auto& key : preset_fixed_keys(c.model)) {
    if (!given(key)) continue;
    const auto e = std::find_if(all.begin(), all.end(), [&](const Entry& x) { return x.key == key; });
    throw ConfigError(detail::concat("[config] model.preset = ", c.model.preset, " (", origin("model.preset"),
                                     ") fixes the model's shape, but ", key, " = ", e->show(), " is also given (",
                                     origin(key), "): remove ", key, " or set model.preset = custom"));
  }

  // Settings that do nothing in this combination: one line each.
  auto warn = [&](const std::string& text) { c.warnings.push_back("[config] " + text); };
  for (const auto& e : all) {
    if (!applies_to(e, c.model.name) && given(e.key))
      warn(detail::concat(e.key, " (", origin(e.key), ") is a ", group_names(e.group), " key; model.name = ", c.model.name,
                          " ignores it"));
  }
  if (c.memory.offload && c.memory.recompute == "none")
    warn(detail::concat("memory.offload = true (", origin("memory.offload"),
                        ") does nothing without activation recomputation (memory.recompute = none)"));
  if (c.dist.backend == "nccl" && c.train.device == "cpu")
    warn(detail::concat("dist.backend = nccl (", origin("dist.backend"),
                        ") does nothing with train.device = cpu: NCCL moves CUDA tensors; CPU tensors go through Gloo"));
  if (c.train.precision != "fp16") {
    for (const char* key : {"train.loss_scale_init", "train.loss_scale_growth", "train.loss_scale_backoff",
                            "train.loss_scale_interval"})
      if (given(key))
        warn(detail::concat(key, " (", origin(key), ") applies to train.precision = fp16 only; this run is ",
                            c.train.precision));
  }
  if (c.train.optimizer != "sgd" && given("train.momentum"))
    warn(detail::concat("train.momentum (", origin("train.momentum"), ") applies to train.optimizer = sgd only"));
  if (c.train.optimizer != "adamw8bit" && c.train.optimizer != "adamw4bit" && !c.memory.allow_lowbit_optimizer)
    for (const char* key : {"train.optimizer_block", "train.optimizer_min_quantized"})
      if (given(key))
        warn(detail::concat(key, " (", origin(key), ") applies to train.optimizer = adamw8bit | adamw4bit only; this run uses ",
                            c.train.optimizer));
  return c;
}


std::string Config::tensor_parallel_refusal() const {
  const auto T = dist.tensor_parallel;
  if (T <= 1) return "";
  const auto with = detail::concat("[config] dist.tensor_parallel = ", T);
  if (model.name != "gpt" && model.name != "llama") return with + " splits gpt and llama models; model.name is " + model.name;
  return "";
}

void Config::validate() const {
  // Each key's own rule, from its row of the table (entries()).
  for (const auto& e : entries(const_cast<Config&>(*this)))
    if (e.check) e.check();
  // The rules that span keys.
  check_range("model.n_embd", model.n_embd, model.n_embd >= 1 && model.n_embd % model.n_head == 0,
              "a positive multiple of model.n_head");
  // model.name's family: its presets and the rules across its keys.
  const auto& family = family_config(model.name);
  if (!family.presets.empty()) {
    std::string names;
    for (const auto& p : family.presets) names += (names.empty() ? "" : " | ") + p;
    MEMTRAIN_CHECK(std::find(family.presets.begin(), family.presets.end(), model.preset) != family.presets.end(),
                   ConfigError, "[config] model.preset = '", model.preset, "' is not a ", model.name,
                   " preset; expected one of: ", names);
  }
  if (family.validate) family.validate(model);
  MEMTRAIN_CHECK(lora.rank == 0 || !lora.targets.empty(), ConfigError, "[config] lora.rank = ", lora.rank,
                 " needs lora.targets: the names of the linear maps to adapt (q_proj,v_proj for a Llama, c_attn for a GPT)");
  MEMTRAIN_CHECK(lora.rank > 0 || lora.init_from.empty(), ConfigError, "[config] lora.init_from = ", lora.init_from,
                 " needs lora.rank > 0 (the adapter folder's rank)");
  MEMTRAIN_CHECK(lora.rank == 0 || train.freeze.empty(), ConfigError, "[config] train.freeze = ", train.freeze,
                 " with lora.rank = ", lora.rank, ": LoRA freezes every parameter but its adapters already; set one of them");
  MEMTRAIN_CHECK(lora.quantize_base == "none" || lora.rank > 0 || !train.freeze.empty(), ConfigError,
                 "[config] lora.quantize_base = ", lora.quantize_base, " stores frozen weights in 4 bits: it needs a "
                 "frozen base (lora.rank > 0, or train.freeze)");
  MEMTRAIN_CHECK(lora.quantize_base == "none" || model.name == "gpt" || model.name == "llama" || model.name == "phi3",
                 ConfigError, "[config] lora.quantize_base = ", lora.quantize_base, " needs a model built from shapes "
                 "(gpt, llama, phi3); model.name is ", model.name);
  MEMTRAIN_CHECK(data.tokens.empty() || data.dataset == "text", ConfigError, "[config] data.tokens = ", data.tokens,
                 " needs data.dataset = text (token ids for a language model), got ", data.dataset);
  check_range("train.min_lr", train.min_lr, train.min_lr >= 0 && train.min_lr <= train.lr, "in [0, train.lr]");
  MEMTRAIN_CHECK(!(train.param_dtype == "bf16" && train.precision == "fp16"), ConfigError,
                 "[config] train.param_dtype = bf16 with train.precision = fp16 mixes two half types; use "
                 "precision bf16 (or fp32) with bf16 parameters");
  MEMTRAIN_CHECK(dist.offload_optimizer == "none" || dist.zero_stage >= 1, ConfigError,
                 "[config] dist.offload_optimizer = cpu needs dist.zero_stage = 1, 2 or 3 (it moves the sharded "
                 "optimizer's part to host memory); dist.zero_stage is 0");
  MEMTRAIN_CHECK(dist.offload_optimizer == "none" || train.precision != "fp16", ConfigError,
                 "[config] dist.offload_optimizer = cpu with train.precision = fp16 is not supported (the loss "
                 "scaler's inf check runs on the device); use bf16 or fp32");
  if (const auto why = tensor_parallel_refusal(); !why.empty()) throw ConfigError(why);
  const auto& b = memory.budget_mib;
  const bool planning = parse_budget_mib(b) != 0;  // its own grammar's check, with the recompute budget's below
  MEMTRAIN_CHECK(!planning || memory.recompute.rfind("budget:", 0) != 0, ConfigError,
                 "[config] memory.budget_mib = ", b, " plans the recompute policy itself; memory.recompute = ",
                 memory.recompute, " is another budget: set one of them");
  MEMTRAIN_CHECK(!planning || (memory.track && memory.estimate), ConfigError, "[config] memory.budget_mib = ", b,
                 " needs memory.track = true and memory.estimate = true (the planner works from the estimate)");
}

std::map<std::string, std::string> Config::ini_values(const std::string& ini_text) {
  std::istringstream in(ini_text);
  po::options_description none;
  std::map<std::string, std::string> out;
  for (const auto& o : po::parse_config_file(in, none, /*allow_unregistered=*/true).options)
    if (!o.value.empty()) out[o.string_key] = o.value.front();
  return out;
}

std::string Config::to_ini() const {
  auto all = entries(const_cast<Config&>(*this));
  const auto fixed = preset_fixed_keys(model);
  std::ostringstream os;
  std::string section;
  if (!source.empty()) os << "# resolved from " << source << "\n";
  for (const auto& e : all) {
    if (!applies_to(e, model.name)) continue;  // another model's keys
    if (std::find(fixed.begin(), fixed.end(), e.key) != fixed.end()) continue;  // the preset's
    auto s = e.key.substr(0, e.key.find('.'));
    if (s != section) {
      os << (section.empty() ? "" : "\n") << "[" << s << "]\n";
      section = s;
    }
    os << e.key.substr(e.key.find('.') + 1) << " = " << e.show() << "\n";
  }
  return os.str();
}

namespace {
// Calls fn(section, group, entries) for each section and, in [model], each model's group of keys.
template <class Fn>
void for_each_group(const std::vector<Entry>& all, Fn&& fn) {
  std::vector<std::pair<std::string, std::string>> order;  // (section, group) in first-seen order
  for (const auto& e : all) {
    std::pair<std::string, std::string> g{e.key.substr(0, e.key.find('.')), e.group};
    if (std::find(order.begin(), order.end(), g) == order.end()) order.push_back(g);
  }
  for (const auto& [section, group] : order) {
    std::vector<const Entry*> members;
    for (const auto& e : all)
      if (e.key.substr(0, e.key.find('.')) == section && e.group == group) members.push_back(&e);
    fn(section, group, members);
  }
}
}  // namespace

std::string Config::help() {
  Config c;
  std::ostringstream os;
  for_each_group(entries(c), [&](const std::string& section, const std::string& group,
                                 const std::vector<const Entry*>& members) {
    os << "\n[" << section << "]" << (group.empty() ? "" : " model.name = " + group_names(group) + ":") << "\n";
    for (const auto* e : members) os << "  --" << e->key << "=" << e->show() << "\n      " << e->help << "\n";
  });
  return os.str();
}

std::string Config::reference_markdown() {
  Config c;
  std::ostringstream os;
  os << "# memtrain configuration reference\n\n"
     << "Generated from the code's own option table by `memtrain --print-config-reference`; the test\n"
     << "`Config.ReferencePageIsCurrent` fails when this page and the binary disagree.\n\n"
     << "Every key sits in an INI section and can be overridden on the command line as `--section.key=value`\n"
     << "(the last value of a key wins). Model keys apply to the model they are listed under; a run of\n"
     << "another model ignores them (with a warning when they are set).\n";
  for_each_group(entries(c), [&](const std::string& section, const std::string& group,
                                 const std::vector<const Entry*>& members) {
    if (group.empty()) os << "\n## [" << section << "]\n\n";
    else os << "\n### [" << section << "] for model.name = " << group_names(group) << "\n\n";
    os << "| key | default | meaning |\n|---|---|---|\n";
    for (const auto* e : members) {
      auto shown = e->show();
      std::string help;  // a '|' inside a table cell is escaped
      for (char ch : e->help) help += ch == '|' ? std::string("\\|") : std::string(1, ch);
      os << "| `" << e->key << "` | " << (shown.empty() ? "(empty)" : "`" + shown + "`") << " | " << help << " |\n";
    }
  });
  return os.str();
}

std::optional<RopeScalingValues> parse_rope_scaling(const std::string& value) {
  if (value == "none") return std::nullopt;
  std::vector<double> numbers;
  bool ok = value.rfind("llama3:", 0) == 0;
  std::stringstream ss(ok ? value.substr(7) : "");
  for (std::string item; ok && std::getline(ss, item, ':');) {
    double v = 0;
    auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    ok = ec == std::errc() && end == item.data() + item.size() && v > 0;
    numbers.push_back(v);
  }
  ok = ok && numbers.size() == 4 && numbers[2] > numbers[1] && numbers[3] == std::floor(numbers[3]);
  MEMTRAIN_CHECK(ok, ConfigError, "[config] model.rope_scaling = '", value,
                 "' is invalid: expected none or llama3:FACTOR:LOW_FREQ_FACTOR:HIGH_FREQ_FACTOR:ORIGINAL_CONTEXT with "
                 "positive numbers, HIGH_FREQ_FACTOR > LOW_FREQ_FACTOR and a whole ORIGINAL_CONTEXT (e.g. llama3:8:1:4:8192)");
  return RopeScalingValues{numbers[0], numbers[1], numbers[2], static_cast<int64_t>(numbers[3])};
}

std::string format_rope_scaling(const RopeScalingValues& v) {
  return detail::concat("llama3:", format_shortest(v.factor), ":", format_shortest(v.low_freq_factor), ":",
                        format_shortest(v.high_freq_factor), ":", v.original_context);
}

std::vector<std::string> lora_targets(const LoraConfig& lora) {
  std::vector<std::string> out;
  std::stringstream ss(lora.targets);
  for (std::string t; std::getline(ss, t, ',');)
    if (!t.empty()) out.push_back(t);
  return out;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string format_shortest(double v) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, end);
}

double parse_budget_mib(const std::string& value) {
  if (value == "auto") return -1;
  size_t used = 0;
  double v = -1;
  try {
    v = std::stod(value, &used);
  } catch (const std::exception&) {
  }
  MEMTRAIN_CHECK(used == value.size() && v >= 0, ConfigError, "[config] memory.budget_mib = '", value,
                 "': expected MiB (a number >= 0; 0 = no planner) or auto");
  return v;
}

int64_t parse_head_rows(const std::string& mode) {
  if (mode == "plain") return -1;
  if (mode == "fused") return 0;
  const auto rows = mode.rfind("fused:", 0) == 0 ? detail::parse_count(mode.substr(6)) : std::nullopt;
  MEMTRAIN_CHECK(rows.has_value(), ConfigError, "[config] memory.head = '", mode,
                 "' is not allowed; expected plain | fused | fused:ROWS (rows per chunk, >= 1)");
  return *rows;
}

std::optional<int64_t> detail::parse_count(const std::string& digits) {
  if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  const auto n = std::stoll(digits);
  return n >= 1 ? std::optional<int64_t>(n) : std::nullopt;
}

}  // namespace memtrain
