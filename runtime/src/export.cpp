#include "memtrain/runtime/export.h"

#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <sstream>

#include "memtrain/core/error.h"
#include "memtrain/core/files.h"
#include "memtrain/core/state_checkpoint.h"
#include "memtrain/data/datasets.h"
#include "memtrain/models/gpt.h"
#include "memtrain/models/hugging_face.h"
#include "memtrain/models/lora.h"
#include "memtrain/models/nf4.h"
#include "memtrain/runtime/factories.h"

namespace memtrain {

namespace fs = std::filesystem;

ModelConfig resolved_model_config(const ModelConfig& c, int64_t vocab) {
  const auto& family = model_family(c.name);
  if (!family.resolved) {
    ModelConfig m = c;
    m.preset = "custom";
    return m;
  }
  return family.resolved(c, vocab);
}

namespace {

// The run's config, as saved in the manifest (`saved`, its INI text: its model keys already resolved from
// init_from's config.json), loaded through a temporary file.
Config load_saved_config(const std::string& saved) {
  std::error_code ec;
  const auto ini = (fs::temp_directory_path() / ("memtrain-export-" + std::to_string(::getpid()) + ".ini")).string();
  // Without init_from: the model keys it resolved are in the saved config, and the folder may be gone.
  std::istringstream lines(saved);
  std::string text;
  for (std::string line; std::getline(lines, line);)
    if (!line.starts_with("init_from")) text += line + "\n";
  write_file_atomically(ini, text);
  Config config;
  try {
    config = Config::load(ini);
  } catch (...) {
    fs::remove(ini, ec);
    throw;
  }
  fs::remove(ini, ec);
  return config;
}

// The tokenizer files beside the exported weights; each file copied is added to out.files.
void copy_tokenizer_files(const ExportOptions& options, const Config& config, const std::string& init_from,
                          ExportResult& out) {
  std::error_code ec;
  // The tokenizer of the folder the run started from, so that the export is a whole model folder.
  if (!init_from.empty())
    for (const char* f : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                          "vocab.json", "merges.txt", "tokenizer.model"})
      if (fs::is_regular_file(fs::path(init_from) / f, ec)) {
        fs::copy_file(fs::path(init_from) / f, fs::path(options.out) / f, ec);
        if (!ec) out.files.push_back((fs::path(options.out) / f).string());
      }
  // Or the tokenizer the run's token files were made with (a prepared set, or prepare_tokens.py --tokenizer's
  // copy beside them), with the config transformers' AutoTokenizer needs to take it as it is.
  const auto out_tokenizer = fs::path(options.out) / "tokenizer.json";
  if (!fs::exists(out_tokenizer, ec) && !config.data.tokens.empty()) {
    const auto& t = config.data.tokens;
    const bool prepared = t.find('/') == std::string::npos && !fs::path(t).has_extension();
    const auto beside = prepared ? fs::path(default_data_dir()) / "tokens" / t / "tokenizer.json"
                                 : fs::path(t).parent_path() / "tokenizer.json";
    if (fs::is_regular_file(beside, ec) && fs::copy_file(beside, out_tokenizer, ec)) {
      out.files.push_back(out_tokenizer.string());
      if (!fs::exists(fs::path(options.out) / "tokenizer_config.json", ec)) {
        write_file_atomically((fs::path(options.out) / "tokenizer_config.json").string(),
                              "{\n  \"tokenizer_class\": \"PreTrainedTokenizerFast\"\n}\n");
        out.files.push_back((fs::path(options.out) / "tokenizer_config.json").string());
      }
    }
  }
}

// A checkpoint trained on an NF4 base (lora.quantize_base = nf4) holds no base weights: they are made again from their
// source exactly as the run made them (quantized), dequantized to bf16 values, and checked against the manifest's
// record, so the merge adds the adapters to the weights they were trained against.
void add_nf4_base(const Config& config, const std::string& init_from, const std::string& path, const std::string& record,
                  const std::string& embedding, std::map<std::string, torch::Tensor>& parameters) {
  MEMTRAIN_CHECK(parameters.count(embedding), DataError, "[export] ", path, ": no parameter '", embedding, "'");
  auto c = config;
  c.model.init_from = init_from;  // the manifest's (the saved config is read without it)
  c.lora.init_from.clear();       // the adapters come from the checkpoint
  auto model = make_model(c.model, DataInfo{.vocab_size = parameters.at(embedding).size(0)},
                          {.shapes_only = true, .dtype = torch::kFloat, .device = torch::kCPU});
  select_trainable(*model, c);
  const auto weights = quantize_frozen_linears(*model, nf4_options(c.lora), /*quantize_values=*/false);
  std::unique_ptr<HuggingFaceWeights> source;
  if (!c.model.init_from.empty()) source = std::make_unique<HuggingFaceWeights>(*model, c.model.init_from);
  const auto& init = model_family(c.model.name).init;
  std::map<std::string, uint64_t> digests;
  torch::NoGradGuard no_grad;
  for (const auto& [name, f] : weights) {
    auto values = torch::empty({f.numel()});
    if (source) values.copy_(source->read(name, 0, f.numel()).reshape({-1}));
    else fill_initial(values, init(c.model, name), static_cast<uint64_t>(c.train.seed), name, 0);
    const auto rounded = values.view(f.shape).to(f.dtype);
    digests[name] = nf4_digest(rounded);
    const auto packed = nf4_pack(rounded, f);
    parameters[name] = nf4_dequantize(packed, f).to(torch::kFloat);
  }
  const auto remade = nf4_base_record(digests, c.lora.quantize_block, c.lora.double_quant, nf4_source(c));
  MEMTRAIN_CHECK(nf4_same_base(remade, record), DataError, "[export] ", path, " was trained on the quantized base '", record,
                 "'; made again now it is '", remade, "': ", nf4_source(c), " changed since the run");
  std::cout << "export:     merging the adapters into the dequantized NF4 base (" << weights.size()
            << " weights, bf16 values of their 4-bit codes): the weights the adapters were trained against. The "
               "merged model differs from the original base plus the adapters (merging into a quantized base loses "
               "what the 4-bit codes rounded off; users report quality loss either way): compare its evaluation "
               "before serving it, or serve the original base with the adapter folder\n";
}

}  // namespace

ExportResult export_hugging_face(const ExportOptions& options) {
  std::error_code ec;
  std::string path = options.checkpoint;
  if (!fs::exists(fs::path(path) / "manifest.json", ec)) {
    path = find_latest_checkpoint(options.checkpoint);
    MEMTRAIN_CHECK(!path.empty(), DataError, "[export] --checkpoint ", options.checkpoint,
                   ": neither a checkpoint (step-N/ with manifest.json) nor a folder holding one");
  }
  MEMTRAIN_CHECK(!fs::exists(options.out, ec), ConfigError, "[export] --out ", options.out,
                 " already exists: an export never overwrites a folder; choose a new one or remove it");
  const auto ck = load_checkpoint(path);  // every file's checksum and every tensor's pieces checked
  auto field = ck.meta.fields.find("config");
  MEMTRAIN_CHECK(field != ck.meta.fields.end(), DataError, "[export] ", path, ": the manifest holds no config");
  const auto config = load_saved_config(field->second);
  const auto init_from = Config::ini_values(field->second)["model.init_from"];

  std::map<std::string, torch::Tensor> parameters;  // what trained (model/) and what did not (frozen/)
  ExportResult out;
  for (const auto& [name, t] : ck.tensors) {
    const auto slash = name.find('/');
    if (name.substr(0, slash) != "model" && name.substr(0, slash) != "frozen") continue;
    parameters.emplace(name.substr(slash + 1), t);
    out.parameters += t.numel();
  }
  const auto& lora = config.lora;
  if (lora.rank > 0 && !options.merged) {
    std::map<std::string, torch::Tensor> adapters;
    out.parameters = 0;
    for (const auto& [name, t] : parameters)
      if (is_lora_parameter(name)) adapters.emplace(name, t), out.parameters += t.numel();
    MEMTRAIN_CHECK(!adapters.empty(), DataError, "[export] ", path, ": a LoRA run's checkpoint without adapters");
    out.files = save_lora_adapter(options.out, config.model, lora, adapters, init_from);
    out.checkpoint = path;
    out.step = ck.meta.step;
    return out;
  }
  const auto& embedding = model_family(config.model.name).embedding;
  if (const auto base = ck.meta.fields.find("quantized_base"); base != ck.meta.fields.end() && !base->second.empty())
    add_nf4_base(config, init_from, path, base->second, embedding, parameters);
  if (lora.rank > 0) parameters = merge_lora(parameters, lora.alpha / static_cast<double>(lora.rank));
  MEMTRAIN_CHECK(!embedding.empty(), ConfigError, "[export] model.name = ", config.model.name,
                 " has no Hugging Face layout");
  MEMTRAIN_CHECK(parameters.count(embedding), DataError, "[export] ", path, ": no parameter '", embedding,
                 "': a checkpoint of model.name = ", config.model.name, " without its embedding");
  const auto model = resolved_model_config(config.model, parameters.at(embedding).size(0));
  out.files = save_hugging_face(options.out, model, parameters, {.dtype = options.dtype, .max_shard_bytes = options.max_shard_bytes});
  copy_tokenizer_files(options, config, init_from, out);
  out.checkpoint = path;
  out.step = ck.meta.step;
  return out;
}

}  // namespace memtrain
