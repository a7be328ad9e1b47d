// The run's configuration: one struct per component, defaults where each field is declared.
// Loaded from an INI file (one section per component) with `--section.key=value` overrides on top.
//
//   auto cfg = memtrain::Config::load("examples/configs/gpt_austen_cpu.ini", {"--train.steps=50"});
//   std::cout << cfg.to_ini();
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace memtrain {

// The allowed values of every enumerated key, written once: the validator, the factories, --help and
// the docs read them from here.
namespace choices {
// model.name and model.preset: the registered families' (core/family_config.h), not a list here.
inline constexpr std::array<std::string_view, 3> attn_bias{"none", "qkv", "all"};
inline constexpr std::array<std::string_view, 3> estimate_method{"auto", "closed_form", "probe"};
inline constexpr std::array<std::string_view, 2> resnet_stem{"small", "imagenet"};
inline constexpr std::array<std::string_view, 4> dataset{"text", "fashion_mnist", "synthetic", "chat"};
inline constexpr std::array<std::string_view, 3> device{"cpu", "cuda", "auto"};
inline constexpr std::array<std::string_view, 5> optimizer{"adamw", "adamw_loop", "sgd", "adamw8bit", "adamw4bit"};
inline constexpr std::array<std::string_view, 3> precision{"fp32", "bf16", "fp16"};
inline constexpr std::array<std::string_view, 2> param_dtype{"fp32", "bf16"};
inline constexpr std::array<std::string_view, 3> backend{"auto", "gloo", "nccl"};
inline constexpr std::array<std::string_view, 2> dist_reduce{"step", "micro_batch"};
inline constexpr std::array<std::string_view, 2> offload_optimizer{"none", "cpu"};
inline constexpr std::array<std::string_view, 3> sequence_parallel{"auto", "on", "off"};
inline constexpr std::array<std::string_view, 2> cuda_allocator{"native", "cudaMallocAsync"};
inline constexpr std::array<std::string_view, 3> progress{"auto", "bar", "lines"};
inline constexpr std::array<std::string_view, 2> oom{"retry", "fail"};
inline constexpr std::array<std::string_view, 2> token_format{"llmc", "raw"};
inline constexpr std::array<std::string_view, 2> on_nonfinite{"skip", "stop"};
inline constexpr std::array<std::string_view, 3> host_reads{"auto", "each_step", "deferred"};
inline constexpr std::array<std::string_view, 2> quantize_base{"none", "nf4"};

// "a | b | c", for messages and help.
template <size_t N>
std::string join(const std::array<std::string_view, N>& values) {
  std::string out;
  for (auto v : values) out.append(out.empty() ? "" : " | ").append(v);
  return out;
}
}  // namespace choices

struct ModelConfig {
  std::string name = "gpt";     // a registered family: gpt | llama | phi3 | resnet | mlp
  // gpt and llama
  // A Hugging Face folder (config.json, *.safetensors): its config.json sets name and shape, its weights the
  // initial parameters.
  std::string init_from = "";
  std::string preset = "custom";  // custom | tiny | gpt2 | ... (gpt) | llama-3.2-1b | ... (llama)
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 128;
  int64_t block_size = 128;     // context length, tokens
  int64_t vocab_size = 0;       // 0: taken from the data (256 for byte-level text)
  // gpt
  double dropout = 0.0;
  bool bias = true;
  // llama
  int64_t n_kv_head = 0;        // grouped-query attention's k/v heads; 0 = n_head
  int64_t ffn_hidden = 0;       // the SwiGLU MLP's width (intermediate_size); 0 = 8/3 n_embd rounded up to 64
  double rope_theta = 10000.0;
  std::string rope_scaling = "none";  // none | llama3:FACTOR:LOW_FREQ:HIGH_FREQ:ORIGINAL_CONTEXT
  double norm_eps = 1e-5;       // RMSNorm's epsilon
  bool tie_embeddings = false;  // the output head is the token embedding
  std::string attn_bias = "none";  // none | qkv (Qwen2) | all (Llama's attention_bias)
  int64_t max_positions = 0;    // the longest context the model is made for (max_position_embeddings); 0 = block_size
  // resnet
  int64_t depth = 18;           // 18 | 50
  int64_t width = 64;           // channels of the first stage (64 in the published nets)
  std::string stem = "small";   // small (3x3 conv, no pool: 28x28 inputs) | imagenet (7x7/2 + maxpool)
  // mlp
  std::string hidden = "256,128";  // comma-separated hidden widths
};

struct DataConfig {
  std::string dataset = "text";  // text | fashion_mnist | synthetic | chat
  std::string path = "";         // file (text) or folder (fashion_mnist; chat: scripts/prepare_chat.py's); "" = prepared cache
  double val_fraction = 0.1;     // held out from the training data for evaluation
  // text: train on token ids instead of bytes. A prepared set's name (austen-bpe8192, austen-bpe50257:
  // set-up's BPE vocabularies, with their own validation file) or a token file's path.
  std::string tokens = "";
  std::string val_tokens = "";   // the validation token file; "" = the tail val_fraction of `tokens`
  std::string token_format = "llmc";  // llmc (llm.c's header) | raw (headerless uint16, nanoGPT's)
  bool pack = true;              // chat: records packed into rows; false = one record per row, padded
};

struct TrainOptions {
  std::string device = "cpu";      // cpu | cuda | auto
  std::string optimizer = "adamw"; // adamw (fused kernel) | adamw_loop | sgd | adamw8bit | adamw4bit
  double lr = 1e-3;
  double min_lr = 1e-4;            // floor of the cosine schedule
  int64_t warmup_steps = 20;
  int64_t steps = 200;             // optimizer steps
  double weight_decay = 0.1;       // applied to matrices/filters only, not biases or norms
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double momentum = 0.9;           // sgd
  int64_t optimizer_block = 0;     // adamw8bit/4bit: values per absmax; 0 = 256 (8-bit) or 128 (4-bit)
  int64_t optimizer_min_quantized = 4096;  // adamw8bit/4bit: smaller parameters keep fp32 moments
  double grad_clip = 1.0;          // max global grad norm; 0 = off
  int64_t micro_batch = 16;        // samples per forward/backward, per rank
  int64_t accum_steps = 1;         // micro-batches per optimizer step
  std::string precision = "fp32";  // fp32 | bf16 | fp16 (fp16: with dynamic loss scaling)
  std::string param_dtype = "fp32"; // fp32 | bf16 (bf16 parameters and gradients, fp32 master weights)
  // fp16 dynamic loss scaling (torch.amp.GradScaler's defaults)
  double loss_scale_init = 65536.0;
  double loss_scale_growth = 2.0;
  double loss_scale_backoff = 0.5;
  int64_t loss_scale_interval = 2000;
  int64_t seed = 1337;
  int64_t eval_every = 50;         // 0 = only at the end
  int64_t eval_batches = 10;
  int64_t threads = 0;             // intra-op threads; 0 = LibTorch's default
  // Out of memory in a step: retry it with half the micro-batch and twice the accumulation (the same
  // samples), or fail naming the peak and the limit.
  std::string oom = "retry";       // retry | fail
  // A non-finite loss or gradient norm without fp16's scaler: skip the update, or stop the run.
  std::string on_nonfinite = "skip";  // skip | stop
  int64_t max_nonfinite = 5;       // consecutive skipped steps before the run stops anyway
  // When the host reads a step's found-inf and stop flags: at its end (one host sync per step), or deferred
  // to the next step once its forward and backward are queued (the update is skipped on the device).
  std::string host_reads = "auto";  // auto (deferred on CUDA with the fused AdamW) | each_step | deferred
  // Parameters whose name matches this regular expression (ECMAScript, the whole name) do not train: no
  // gradient, optimizer state or master copy. "" = none.
  std::string freeze = "";
};

struct MemoryConfig {
  bool track = true;                // per-step peak memory, JSONL + summary
  // Activation recomputation ("activation checkpointing"): which blocks keep only their input and run
  // again in backward. Named as Megatron does, apart from [checkpoint], which saves training state.
  std::string recompute = "none";   // none | all | every:K | attn | mlp | budget:MiB
  bool offload = false;             // keep recomputed blocks' inputs in (pinned) CPU memory
  std::string head = "plain";       // plain | fused | fused:ROWS (linear + cross-entropy in chunks)
  int64_t limit_mib = 0;            // this process's memory limit (CPU: counting allocator; CUDA: allocator fraction); 0 = none
  bool estimate = true;             // estimate the peak before step 1, compare with the measured
  std::string estimate_method = "auto";  // auto (closed form where the model has one, else the probe) | closed_form | probe
  std::string budget_mib = "0";     // the planner: MiB per rank | auto (free device memory, less a margin) | 0 (off)
  double budget_headroom = 0.05;    // the planner: share of the budget a chosen plan's estimate leaves free (its error)
  bool allow_quantized_base = false;  // plan may store a LoRA base in NF4 (lora.quantize_base; changes the numerics)
  bool allow_lowbit_optimizer = false;  // the planner may store AdamW's moments in 8, then 4 bits when nothing else fits
  // CUDA's caching allocator (PYTORCH_CUDA_ALLOC_CONF's settings, as [memory] keys) and its history.
  bool snapshot = false;            // record the allocator's history; write memory_snapshot.rank<N>.pickle (memory_viz)
  bool expandable_segments = false; // segments that grow in place instead of new ones (less fragmentation)
  double gc_threshold = 0;          // garbage_collection_threshold: reclaim cached blocks above this share of the limit; 0 = off
  std::string cuda_allocator = "native";  // native | cudaMallocAsync (CUDA's stream-ordered allocator)
};

struct DistConfig {
  std::string backend = "auto";  // auto | gloo | nccl
  int64_t timeout_s = 300;       // rendezvous and every collective
  int64_t zero_stage = 0;        // 0: data parallel (all-reduce) | 1: + sharded optimizer state | 2: + sharded gradients
                                 // | 3: + sharded parameters, gathered per block
  int64_t prefetch = 1;          // stage 3: blocks gathered ahead of the one running
  std::string offload_optimizer = "none";  // none | cpu: masters, optimizer state and reduced gradients in host memory
  double bucket_mib = 25;        // gradient bucket size (DDP's default)
  std::string reduce = "step";   // step: accumulate micro-batches locally, reduce once | micro_batch: reduce each
  int64_t tensor_parallel = 1;   // T: consecutive ranks split each block's matrices (Megatron); data parallel across
  std::string sequence_parallel = "auto";  // auto (on when T > 1) | on | off: norms and residuals on 1/T of the tokens
};

struct LogConfig {
  int64_t every = 10;            // a log line every N steps
  std::string dir = "runs";      // run folders go under here
  std::string name = "";         // "" = the config file's stem
  std::string progress = "auto"; // auto (bar on a terminal) | bar | lines
  double peak_tflops = 0;        // the device's peak, for MFU; 0 = from the table of known GPUs (none on CPU)
  bool overwrite = false;        // start over in a run folder that holds another run (its checkpoints are deleted)
  bool trace = true;             // trace.json: a Chrome / Perfetto trace of each step's phases and memory
  bool trace_blocks = false;     // trace.json also holds a span per block, forward and backward
  int64_t profile_step = 0;      // this step is recorded by LibTorch's Kineto profiler (profile.json, profile.md); 0 = none
};

struct CheckpointConfig {
  std::string dir = "";     // "" = <run dir>/checkpoints
  int64_t every = 0;        // save the training state every N steps (step-000N/); 0 = only at the end
  bool save_final = true;   // at the end: the training state and model.safetensors (weights only)
  bool save_initial = false;  // before step 1: the weights as set up (initial.safetensors)
  int64_t keep = 3;         // training-state checkpoints kept (the newest)
  std::string resume = "";  // "" = start fresh | auto = the newest complete checkpoint, if any | a checkpoint folder
};

// Low-rank adapters (Hu et al. 2021, as Hugging Face peft makes them): beside each targeted linear map W,
// trainable A (rank, in) and B (out, rank) add B A x alpha / rank; everything else is frozen.
struct LoraConfig {
  int64_t rank = 0;              // 0 = no adapters
  double alpha = 16;             // the scale is alpha / rank
  double dropout = 0.0;          // on the adapters' input
  std::string targets = "";      // comma-separated module names: q_proj,v_proj (Llama) | c_attn (GPT)
  std::string init_from = "";    // a peft adapter folder (adapter_config.json, adapter_model.safetensors)
  // QLoRA: the frozen block linears stored in 4-bit NormalFloat (models/nf4.h), dequantized inside each product.
  std::string quantize_base = "none";  // none | nf4
  int64_t quantize_block = 64;         // values per absmax
  bool double_quant = true;            // the absmaxes in int8, groups of 256 (QLoRA's double quantization)
};

struct Config {
  ModelConfig model;
  DataConfig data;
  TrainOptions train;
  MemoryConfig memory;
  DistConfig dist;
  LogConfig log;
  CheckpointConfig checkpoint;
  LoraConfig lora;
  std::string source;  // the file it came from ("" if none)
  // Settings that do nothing in this combination (load() fills it; the binary prints each on rank 0).
  std::vector<std::string> warnings;

  // Reads `path` (may be empty: defaults only), then applies `overrides` ("--section.key=value").
  // Throws ConfigError naming the file, line, key, value and what is allowed.
  static Config load(const std::string& path, const std::vector<std::string>& overrides = {});
  // Checks values that the types alone cannot (enumerations, ranges). Called by load().
  void validate() const;
  // dist.tensor_parallel > 1 with the rest of this config: "" where they compose, else what does not (the ConfigError
  // validate() throws; plan --target skips such settings). "" with dist.tensor_parallel = 1.
  std::string tensor_parallel_refusal() const;
  // The resolved configuration, as an INI file that load() reads back to the same values. Model keys of
  // other models (ResNet's depth in a GPT run) are left out. Numbers in their shortest exact form.
  std::string to_ini() const;
  // The `key = value` lines of an INI text by "section.key", as the config reader reads them (Boost's, every
  // key kept, known or not): for comparing a saved config with this one. The one INI reader of the project.
  static std::map<std::string, std::string> ini_values(const std::string& ini_text);
  // Every known key ("--section.key=default" and what it does), for --help; model keys grouped by model.
  static std::string help();
  // The same as a Markdown page (docs/config-reference.md, checked against this by a test).
  static std::string reference_markdown();
};

// The grammar of memory.head: plain -> -1 (no fusion), fused -> 0 (automatic chunks), fused:ROWS -> ROWS.
// Throws ConfigError naming the value otherwise. Config::validate and the trainer both read it here.
int64_t parse_head_rows(const std::string& mode);
// memory.budget_mib: the budget in MiB (> 0), 0 (no planner) or -1 (auto). Throws ConfigError otherwise.
double parse_budget_mib(const std::string& value);
// model.rope_scaling: nullopt for none, else llama3's four numbers. Throws ConfigError naming the value otherwise.
struct RopeScalingValues {
  double factor, low_freq_factor, high_freq_factor;
  int64_t original_context;
};
std::optional<RopeScalingValues> parse_rope_scaling(const std::string& value);
// The value of model.rope_scaling that parse_rope_scaling reads back as `v` (llama3:F:L:H:O).
std::string format_rope_scaling(const RopeScalingValues& v);
// lora.targets as a list: the comma-separated names, empty ones dropped, in the order given.
std::vector<std::string> lora_targets(const LoraConfig& lora);
// A number as the config prints it: the shortest text that reads back to the same double (0.1, not
// 0.10000000000000001).
std::string format_shortest(double v);
// Levenshtein's distance between two words (insertions, deletions, substitutions): the "did you mean"
// suggestions of a misspelt key and of a misspelt subcommand.
size_t edit_distance(const std::string& a, const std::string& b);

namespace detail {
// "K" of the grammars every:K and fused:ROWS: a whole number >= 1 of at most 9 digits; nullopt otherwise.
std::optional<int64_t> parse_count(const std::string& digits);
}  // namespace detail

}  // namespace memtrain
