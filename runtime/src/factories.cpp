#include "memtrain/runtime/factories.h"

#include <filesystem>
#include <numeric>
#include <sstream>

#include "memtrain/core/error.h"
#include "memtrain/models/family.h"
#include "memtrain/models/gpt.h"
#include "memtrain/models/hugging_face.h"
#include "memtrain/models/mlp.h"
#include "memtrain/models/resnet.h"
#include "memtrain/optim/lowbit_adamw.h"

namespace memtrain {

namespace fs = std::filesystem;

namespace {
// Each factory branches on values of one choices:: table; a value the table has and the factory does
// not is a programming error, named here (tests build every value of every table).
[[noreturn]] void unhandled(const char* key, const std::string& value) {
  throw Error(detail::concat("[factory] ", key, " = '", value, "' is listed in choices:: but not built here"));
}

}  // namespace

int64_t context_length(const ModelConfig& c) {
  const auto& f = model_family(c.name);
  return f.context ? f.context(c) : c.block_size;
}

LoraOptions lora_options(const LoraConfig& l) {
  return {.rank = l.rank, .alpha = l.alpha, .dropout = l.dropout, .targets = lora_targets(l)};
}

Nf4Options nf4_options(const LoraConfig& l) { return {.block = l.quantize_block, .double_quant = l.double_quant}; }

std::string nf4_source(const Config& c) {
  return c.model.init_from.empty() ? "train.seed " + std::to_string(c.train.seed) : "model.init_from " + c.model.init_from;
}

TrainableSelection select_trainable(Model& model, const Config& c) {
  TrainableSelection out;
  if (c.lora.rank > 0) {
    out.adapted = add_lora(model, lora_options(c.lora));
    if (!c.lora.init_from.empty()) out.adapters = load_lora_adapter(model, c.model, c.lora.init_from);
    out.frozen = freeze_all_but_lora(model);
  } else if (!c.train.freeze.empty()) {
    out.frozen = freeze_matching(model, c.train.freeze);
  }
  return out;
}

bool is_language_model(const ModelConfig& c) { return model_family(c.name).reads_tokens; }

bool has_closed_form(const ModelConfig& c) { return static_cast<bool>(model_family(c.name).shape); }

namespace {
// The families with a property: "a | b | c", or as prose ("a, b and c") when separator is " and ".
std::string families_where(bool (*has)(const ModelFamily&), const char* separator) {
  std::vector<std::string> names;
  for (const auto* f : model_families())
    if (has(*f)) names.push_back(f->config.name);
  const bool prose = std::string(separator) == " and ";
  std::string out;
  for (size_t i = 0; i < names.size(); ++i)
    out += (i == 0 ? "" : prose && i + 1 < names.size() ? ", " : separator) + names[i];
  return out;
}
}  // namespace

std::string closed_form_families() {
  return families_where([](const ModelFamily& f) { return static_cast<bool>(f.shape); }, " and ");
}

double reduced_part_bytes_per_element(const TrainOptions& t, const DistConfig& d, int world, bool cuda) {
  const bool bf16 = t.param_dtype == "bf16";
  const auto dims = ParallelDims::of(d, world);  // sharded on any world above one; ZeRO over its dp ranks
  const bool held_across = t.accum_steps > 1 && reduces_each_micro_batch(static_cast<int>(d.zero_stage), d.reduce == "micro_batch" || bf16);
  if (!dims.sharded() || d.zero_stage < 2 || held_across || (cuda && d.offload_optimizer == "cpu")) return 0;
  return 4.0 / static_cast<double>(dims.dp);  // the stepped tensor's dtype: fp32 masters or fp32 parameters
}

int64_t config_vocab(const Config& config) {
  // The vocabulary without reading the data: the key, the preset's, or byte-level text's 256.
  const auto& c = config.model;
  int64_t vocab = c.vocab_size;
  const auto& family = model_family(c.name);
  if (vocab == 0 && family.preset_vocab) vocab = family.preset_vocab(c);
  if (vocab == 0 && config.data.dataset == "text" && config.data.tokens.empty()) vocab = 256;
  MEMTRAIN_CHECK(vocab > 0, ConfigError, "[estimate] --target reads no data: set model.vocab_size (the token set's "
                 "vocabulary) or a preset");
  return vocab;
}

TransformerShape config_transformer_shape(const Config& config) {
  MEMTRAIN_CHECK(has_closed_form(config.model), ConfigError, "[estimate] model.name = ", config.model.name,
                 " has no closed form (", closed_form_families(), " do)");
  // dist.tensor_parallel: one rank's slice.
  const auto& d = config.dist;
  return split_transformer(model_family(config.model.name).shape(config.model, config_vocab(config)), d.tensor_parallel,
                           d.tensor_parallel > 1 && d.sequence_parallel != "off");
}

EstimateInputs model_state_inputs(const Config& config, int world) {
  const auto& c = config.model;
  MEMTRAIN_CHECK(has_closed_form(c), ConfigError, "[estimate] --target estimates ", closed_form_families(),
                 " without building them; model.name = ", c.name,
                 " is estimated by building it and probing (memtrain estimate without --target)");
  MEMTRAIN_CHECK(config.train.freeze.empty(), ConfigError, "[estimate] --target does not count train.freeze (a pattern "
                 "over the built model's names); estimate it without --target");
  const int64_t vocab = config_vocab(config);
  // Each tensor's elements, a block's and the rest's (the root unit: embeddings, final norm, an untied head).
  auto shapes = model_family(c.name).tensors(c, vocab);
  const auto whole = shapes;  // low-bit state: a slice is quantized as its whole parameter
  // dist.tensor_parallel = T: a rank holds 1/T of each block's linear weights and of the vocabulary's rows (the
  // embedding, an untied head); norms and biases are counted whole (the column-parallel biases are split: a few
  // elements over).
  if (const int64_t T = config.dist.tensor_parallel; T > 1) {
    for (int64_t i = 0; i < shapes.block_linears; ++i) shapes.block[static_cast<size_t>(i)] /= T;
    const int64_t C = config_transformer_shape(config).hidden;
    for (auto& n : shapes.root)
      if (n == vocab * C) n = (vocab + T - 1) / T * C;
  }
  const auto& block = shapes.block;
  const auto& root = shapes.root;
  const int64_t layers = shapes.layers;
  const int64_t block_all = std::accumulate(block.begin(), block.end(), int64_t{0});
  const int64_t root_all = std::accumulate(root.begin(), root.end(), int64_t{0});
  if (config.lora.rank > 0) {
    // LoRA: the adapters train (A rank x in, B out x rank per adapted linear); the base is frozen, its bytes only.
    const LoraShape lora{.rank = config.lora.rank, .dropout = config.lora.dropout, .targets = lora_targets(config.lora)};
    const auto shape = config_transformer_shape(config);
    const int64_t adapters = lora.block_elements(shape);
    MEMTRAIN_CHECK(adapters > 0, ConfigError, "[config] lora.targets = '", config.lora.targets, "' names no linear map of ",
                   c.name, "'s blocks");
    std::vector<int64_t> trained, whole_trained;  // (a split adapter's state is quantized as its whole adapter's)
    const auto tensors = lora.block_tensors(shape), whole_tensors = lora.block_tensors(model_family(c.name).shape(c, vocab));
    for (int64_t l = 0; l < layers; ++l) {
      trained.insert(trained.end(), tensors.begin(), tensors.end());
      whole_trained.insert(whole_trained.end(), whole_tensors.begin(), whole_tensors.end());
    }
    auto in = estimate_settings(config.train, config.dist, world, config.train.param_dtype == "bf16", trained, whole_trained);
    in.block_elements.assign(static_cast<size_t>(layers), adapters);
    // lora.quantize_base = nf4: each block linear of whole NF4 groups counts its packed bytes (in parameter-sized
    // elements, as the frozen parameters are counted). Split T: a slice of a weight whose whole is eligible, its
    // blocks' absmaxes kept dequantized in bf16 (Nf4Format::split).
    int64_t frozen_block = block_all;
    if (config.lora.quantize_base == "nf4") {
      const auto nf4 = nf4_options(config.lora);
      const auto slice = config.dist.tensor_parallel > 1 ? nf4_slice_options(nf4) : nf4;
      for (int64_t i = 0; i < shapes.block_linears; ++i) {
        const int64_t n = block[static_cast<size_t>(i)];
        if (!nf4_eligible(whole.block[static_cast<size_t>(i)], nf4)) continue;
        const int64_t packed = nf4_format({n}, torch::kBFloat16, slice).packed_bytes();
        frozen_block += (packed + in.param_bytes - 1) / in.param_bytes - n;
      }
    }
    in.frozen_block_elements.assign(static_cast<size_t>(layers), frozen_block);
    in.frozen_root_elements = root_all;
    in.frozen_elements = layers * frozen_block + root_all;
    // NF4: the fill reads one whole weight at a time (a slice's too)
    for (const auto* list : {config.lora.quantize_base == "nf4" ? &whole.block : &block, &root})
      for (auto n : *list) in.largest_elements = std::max(in.largest_elements, n);
    return in;
  }
  auto trained = root, whole_trained = whole.root;
  for (int64_t l = 0; l < layers; ++l) {
    trained.insert(trained.end(), block.begin(), block.end());
    whole_trained.insert(whole_trained.end(), whole.block.begin(), whole.block.end());
  }
  auto in = estimate_settings(config.train, config.dist, world, config.train.param_dtype == "bf16", trained, whole_trained);
  in.block_elements.assign(static_cast<size_t>(layers), block_all);
  in.root_elements = root_all;
  return in;
}

EstimateInputs estimate_settings(const TrainOptions& t, const DistConfig& d, int world, bool bf16,
                                 const std::vector<int64_t>& trained, const std::vector<int64_t>& whole) {
  EstimateInputs in;
  in.param_bytes = bf16 ? 2 : 4;
  in.master_weights = bf16;
  in.state_bytes = t.optimizer == "sgd" ? (t.momentum != 0 ? 4 : 0) : 8;
  if (const auto low = lowbit_options(optimizer_options(t))) {
    in.quantized_state_bytes = quantized_bytes_per_element(*low);
    for (size_t i = 0; i < trained.size(); ++i)
      if (quantizes(*low, whole.empty() ? trained[i] : whole.at(i))) in.quantized_elements += trained[i];
  }
  const auto dims = ParallelDims::of(d, world);
  in.world = dims.dp;  // ZeRO's ranks
  in.tensor_parallel = dims.tp > 1;
  in.stage = static_cast<int>(d.zero_stage);
  in.offload = d.offload_optimizer == "cpu";
  in.bucket_mib = d.bucket_mib;
  in.prefetch = d.prefetch;
  in.micro_batch = t.micro_batch;
  in.accum_steps = t.accum_steps;
  in.reduce_every_micro_batch = d.reduce == "micro_batch" || bf16;  // as asked; stage 3 adds itself (reduces_each_micro_batch)
  for (auto n : trained) in.largest_elements = std::max(in.largest_elements, n);
  return in;
}

std::shared_ptr<Model> make_model(const ModelConfig& c, const DataInfo& data, const ParameterBuild& how) {
  MEMTRAIN_CHECK(!how.shapes_only || model_family(c.name).init, Error, "[model] ", c.name,
                 " has no table of initial values: it is built whole, not from shapes");
  return model_family(c.name).build(c, data, how);
}

std::unique_ptr<Dataset> make_dataset(const Config& c, const Shard& shard) {
  const auto& d = c.data;
  if (d.dataset == "text") {
    MEMTRAIN_CHECK(is_language_model(c.model), ConfigError,
                   "[config] data.dataset = text needs a language model (model.name = ",
                   families_where([](const ModelFamily& f) { return f.reads_tokens; }, " | "), "), got '", c.model.name, "'");
    TextDataOptions o;
    o.path = d.path.empty() ? (fs::path(default_data_dir()) / "text" / "austen.txt").string() : d.path;
    o.tokens = d.tokens, o.val_tokens = d.val_tokens, o.token_format = d.token_format;
    o.vocab_size = c.model.vocab_size;
    if (!d.tokens.empty() && d.tokens.find('/') == std::string::npos && !fs::path(d.tokens).has_extension()) {
      // A prepared set: set-up's folder with train.bin and val.bin.
      const auto set = fs::path(default_data_dir()) / "tokens" / d.tokens;
      o.tokens = (set / "train.bin").string();
      if (d.val_tokens.empty()) o.val_tokens = (set / "val.bin").string();
    }
    o.block_size = context_length(c.model);
    o.val_fraction = d.val_fraction, o.seed = c.train.seed, o.accum_steps = c.train.accum_steps;
    return make_text_dataset(o, shard);
  }
  if (d.dataset == "chat") {
    MEMTRAIN_CHECK(is_language_model(c.model), ConfigError, "[config] data.dataset = chat needs a language model, got '",
                   c.model.name, "'");
    // data.path: the folder scripts/prepare_chat.py wrote; empty = set-up's example (Austen "continue this passage").
    ChatDataOptions o;
    o.dir = d.path.empty() ? (fs::path(default_data_dir()) / "chat" / "austen-continue").string() : d.path;
    o.vocab_size = c.model.vocab_size, o.block_size = context_length(c.model);
    o.seed = c.train.seed, o.accum_steps = c.train.accum_steps, o.pack = d.pack;
    return make_chat_dataset(o, shard);
  }
  if (d.dataset == "fashion_mnist") {
    MEMTRAIN_CHECK(!is_language_model(c.model), ConfigError,
                   "[config] data.dataset = fashion_mnist needs an image model (",
                   families_where([](const ModelFamily& f) { return !f.reads_tokens; }, " | "), "), got '", c.model.name, "'");
    FashionMnistOptions o;
    o.root = d.path.empty() ? (fs::path(default_data_dir()) / "fashion-mnist").string() : d.path;
    o.val_fraction = d.val_fraction, o.seed = c.train.seed, o.accum_steps = c.train.accum_steps;
    return make_fashion_mnist(o, shard);
  }
  if (d.dataset == "synthetic") {
    SyntheticDataOptions o;
    o.seed = c.train.seed;
    o.text = is_language_model(c.model);
    if (o.text) {
      const auto& family = model_family(c.model.name);
      const int64_t preset_vocab = family.preset_vocab ? family.preset_vocab(c.model) : 0;
      o.info.vocab_size = c.model.vocab_size > 0 ? c.model.vocab_size : preset_vocab > 0 ? preset_vocab : 256;
      o.block_size = context_length(c.model);
    } else {
      o.info = DataInfo{};  // Fashion-MNIST's shape: 1 x 28 x 28, 10 classes
    }
    return make_synthetic_dataset(o, shard);
  }
  unhandled("data.dataset", d.dataset);
}

bool steps_in_parts(const std::string& optimizer) {
  return optimizer == "adamw" || optimizer == "adamw8bit" || optimizer == "adamw4bit";
}

OptimizerOptions optimizer_options(const TrainOptions& t) {
  OptimizerOptions o;
  if (t.optimizer == "adamw") o.kind = OptimizerOptions::Kind::kAdamW;
  else if (t.optimizer == "adamw_loop") o.kind = OptimizerOptions::Kind::kAdamWLoop;
  else if (t.optimizer == "sgd") o.kind = OptimizerOptions::Kind::kSgd;
  else if (t.optimizer == "adamw8bit") o.kind = OptimizerOptions::Kind::kAdamW8bit;
  else if (t.optimizer == "adamw4bit") o.kind = OptimizerOptions::Kind::kAdamW4bit;
  else unhandled("train.optimizer", t.optimizer);
  o.lr = t.lr, o.weight_decay = t.weight_decay, o.beta1 = t.beta1, o.beta2 = t.beta2, o.eps = t.eps;
  o.momentum = t.momentum;
  o.block = t.optimizer_block, o.min_quantized = t.optimizer_min_quantized;
  return o;
}

int64_t optimizer_block(const TrainOptions& t) {
  const auto low = lowbit_options(optimizer_options(t));
  return low ? low->block : 0;
}

CosineScheduleOptions schedule_options(const TrainOptions& t) {
  return {.peak = t.lr, .min = t.min_lr, .warmup_steps = t.warmup_steps, .total_steps = t.steps};
}

GradScalerOptions scaler_options(const TrainOptions& t) {
  return {.init_scale = t.loss_scale_init,
          .growth_factor = t.loss_scale_growth,
          .backoff_factor = t.loss_scale_backoff,
          .growth_interval = t.loss_scale_interval};
}

DataParallelOptions data_parallel_options(const Config& c, const ParallelDims& dims, bool bf16_parameters,
                                          const std::vector<int64_t>& units) {
  const auto& d = c.dist;
  return {.stage = dims.zero_stage,
          .bucket_mib = d.bucket_mib,
          .reduce_every_micro_batch = reduces_each_micro_batch(dims.zero_stage, d.reduce == "micro_batch" || bf16_parameters),
          .master_weights = bf16_parameters,
          .units = dims.gathers_parameters() ? units : std::vector<int64_t>{},
          .prefetch = d.prefetch,
          .offload = dims.offload,
          .align = std::max<int64_t>(1, optimizer_block(c.train)),
          .align_min_numel = c.train.optimizer_min_quantized};
}

}  // namespace memtrain
