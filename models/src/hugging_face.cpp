#include "memtrain/models/hugging_face.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "memtrain/core/error.h"
#include "memtrain/core/files.h"
#include "memtrain/core/hugging_face_config.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/models/lora.h"
#include "memtrain/models/nf4.h"

namespace memtrain {

namespace fs = std::filesystem;

HuggingFaceName hugging_face_name(const ModelConfig& config, const std::string& parameter) {
  const auto& family = model_family(config.name);
  MEMTRAIN_CHECK(family.hf_name != nullptr, ConfigError, "[weights] model.name = ", config.name,
                 " has no Hugging Face layout");
  return family.hf_name(config, parameter);
}

std::vector<std::string> hugging_face_weight_files(const std::string& dir) {
  const auto index = fs::path(dir) / "model.safetensors.index.json";
  const auto single = fs::path(dir) / "model.safetensors";
  std::error_code ec;
  if (!fs::exists(index, ec)) {
    MEMTRAIN_CHECK(fs::is_regular_file(single, ec), DataError, "[weights] ", dir,
                   ": no model.safetensors and no model.safetensors.index.json (a PyTorch .bin checkpoint can be "
                   "converted with transformers: from_pretrained, then save_pretrained(safe_serialization=True))");
    return {single.string()};
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file_bytes(index.string()));
  } catch (const nlohmann::json::exception& e) {
    throw DataError(detail::concat("[weights] ", index.string(), ": not valid JSON: ", e.what()));
  }
  MEMTRAIN_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), DataError, "[weights] ",
                 index.string(), ": no weight_map object");
  std::vector<std::string> files;
  std::set<std::string> seen;
  for (auto& [tensor, file] : j["weight_map"].items()) {
    MEMTRAIN_CHECK(file.is_string(), DataError, "[weights] ", index.string(), ": weight_map['", tensor, "'] is not a file name");
    const auto name = file.get<std::string>();
    if (!seen.insert(name).second) continue;
    const auto path = fs::path(dir) / name;
    MEMTRAIN_CHECK(fs::is_regular_file(path, ec), DataError, "[weights] ", dir, ": missing shard ", name,
                   " (model.safetensors.index.json names it for '", tensor, "')");
    files.push_back(path.string());
  }
  MEMTRAIN_CHECK(!files.empty(), DataError, "[weights] ", index.string(), ": weight_map names no file");
  return files;
}

namespace {

struct Located {
  const SafetensorsIndex* file = nullptr;
  const SafetensorsEntry* entry = nullptr;
};

// Names a checkpoint may hold that are not parameters: GPT-2's causal-mask buffers, rotary tables.
bool is_buffer(const std::string& name) {
  return name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") || name.ends_with("rotary_emb.inv_freq");
}

}  // namespace

struct HuggingFaceWeights::Impl {
  struct Fill {
    Located from;
    bool transposed = false;
    int64_t first = 0;  // the element of the stored tensor where memtrain's begins (a block of rows of a fused one)
  };
  std::vector<SafetensorsIndex> files;
  std::map<std::string, Fill> fills;  // by memtrain's parameter name
  std::vector<std::pair<std::string, torch::Tensor>> parameters;
  int64_t bytes_read = 0, total_bytes = 0;
};

HuggingFaceWeights::~HuggingFaceWeights() = default;
const std::vector<std::pair<std::string, torch::Tensor>>& HuggingFaceWeights::parameters() const { return impl_->parameters; }
int64_t HuggingFaceWeights::files() const { return static_cast<int64_t>(impl_->files.size()); }
int64_t HuggingFaceWeights::bytes_read() const { return impl_->bytes_read; }
int64_t HuggingFaceWeights::total_bytes() const { return impl_->total_bytes; }

HuggingFaceWeights::HuggingFaceWeights(Model& model, const std::string& dir) : impl_(std::make_unique<Impl>()) {
  // The checkpoint's names are its family's, from its own config.json.
  const auto config = model_from_hugging_face(dir, ModelConfig{}).config;
  const auto& family = model_family(config.name);
  auto& files = impl_->files;
  // 1. Every file's header (no tensor data yet); which file holds which tensor. `files` is not resized after
  // this: `where` points into it.
  for (const auto& path : hugging_face_weight_files(dir)) files.push_back(read_safetensors_index(path));
  std::map<std::string, Located> where;
  for (const auto& f : files)
    for (const auto& e : f.tensors) {
      auto [it, added] = where.emplace(e.name, Located{&f, &e});
      MEMTRAIN_CHECK(added, DataError, "[weights] ", dir, ": tensor '", e.name, "' is in both ", it->second.file->path,
                     " and ", f.path);
    }
  // Older checkpoints of a family may leave its prefix out (openai-community/gpt2's own names h.0..., not
  // transformer.h.0...).
  const auto& prefix = family.hf_optional_prefix;
  const bool bare = !prefix.empty() && std::none_of(where.begin(), where.end(), [&](const auto& w) {
    return w.first.rfind(prefix, 0) == 0;
  });

  // 2. Each parameter's tensor, its shape and dtype checked. (Under ZeRO-3 a parameter's storage may be
  // released; its shape is still the full one.)
  std::set<std::string> used;
  std::map<std::string, int64_t> rows_filled;  // fused tensors: the rows memtrain's parameters take
  const auto nf4 = nf4_weights(model);         // NF4 weights: their values' shape, not their packed bytes
  std::set<const void*> seen;
  for (const auto& item : model.named_parameters()) {
    const auto& p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;  // a tied weight once
    if (is_lora_parameter(item.key())) continue;                 // adapters: a peft folder's (load_lora_adapter)
    auto hf = family.hf_name(config, item.key());
    if (bare && hf.name.rfind(prefix, 0) == 0) hf.name = hf.name.substr(prefix.size());
    auto it = where.find(hf.name);
    MEMTRAIN_CHECK(it != where.end(), DataError, "[weights] ", dir, ": no tensor '", hf.name, "' (memtrain's ",
                   item.key(), ", shape ", p.sizes(), ") in ", files.size() == 1 ? files[0].path : detail::concat(files.size(), " shards"));
    const auto& e = *it->second.entry;
    const auto packed = nf4.find(item.key());
    // A tensor-parallel slice reads from its whole parameter (InitialValues maps its elements to their places).
    const auto split = model.tensor_split(item.key());
    auto expected = packed == nf4.end() ? whole_sizes(split, p.sizes()) : packed->second.whole_shape();
    const int64_t numel = c10::multiply_integers(expected);
    if (hf.transposed) std::reverse(expected.begin(), expected.end());
    auto stored = e.shape;
    if (hf.rows > 0) {  // rows [row_begin, row_begin + rows) of the stored tensor
      MEMTRAIN_CHECK(!stored.empty() && stored[0] >= hf.row_begin + hf.rows, DataError, "[weights] ",
                     it->second.file->path, ": tensor '", hf.name, "' has shape ", c10::IntArrayRef(e.shape),
                     "; the model (", dir, "/config.json) expects at least ", hf.row_begin + hf.rows, " rows");
      stored[0] = hf.rows;
      rows_filled[hf.name] += hf.rows;
    }
    MEMTRAIN_CHECK(stored == expected, DataError, "[weights] ", it->second.file->path, ": tensor '", hf.name,
                   "' has shape ", c10::IntArrayRef(e.shape), "; the model (", dir, "/config.json) expects ",
                   c10::IntArrayRef(expected), hf.rows > 0 ? detail::concat(" in rows ", hf.row_begin, "..") : std::string());
    MEMTRAIN_CHECK(c10::isFloatingType(e.dtype), DataError, "[weights] ", it->second.file->path, ": tensor '", hf.name,
                   "' is ", e.dtype, ", not a floating-point weight");
    const int64_t row_elements = hf.rows > 0 ? numel / hf.rows : 0;
    impl_->fills[item.key()] = {it->second, hf.transposed, hf.row_begin * row_elements};
    impl_->parameters.emplace_back(item.key(), p);
    impl_->total_bytes += numel * static_cast<int64_t>(c10::elementSize(e.dtype));
    used.insert(hf.name);
  }
  // A fused tensor is taken whole by the parameters that share it.
  for (const auto& [name, rows] : rows_filled)
    MEMTRAIN_CHECK(rows == where.at(name).entry->shape[0], DataError, "[weights] ", where.at(name).file->path,
                   ": tensor '", name, "' has ", where.at(name).entry->shape[0], " rows; the model's parameters take ",
                   rows);
  // 3. Every tensor of the checkpoint is used (or is a known non-parameter). A stored lm_head.weight no parameter
  // takes is a tied head's copy, stored besides the embedding (an untied model's head would have taken it).
  for (const auto& [name, loc] : where) {
    if (used.count(name) || is_buffer(name) || name == "lm_head.weight") continue;
    throw DataError(detail::concat("[weights] ", loc.file->path, ": unexpected tensor '", name,
                                   "': the model (", dir, "/config.json) has no parameter of that name"));
  }
}

torch::Tensor HuggingFaceWeights::read(const std::string& name, int64_t begin, int64_t end) {
  const auto& f = impl_->fills.at(name);
  const auto& e = *f.from.entry;
  const auto item = static_cast<int64_t>(c10::elementSize(e.dtype));
  if (!f.transposed) {
    impl_->bytes_read += (end - begin) * item;
    return read_safetensors_elements(*f.from.file, e, f.first + begin, f.first + end);
  }
  const auto numel = static_cast<int64_t>(e.end - e.begin) / item;
  impl_->bytes_read += numel * item;
  auto whole = read_safetensors_elements(*f.from.file, e, 0, numel).view(e.shape);
  return whole.t().contiguous().view({-1}).slice(0, begin, end);
}

HuggingFaceLoad load_hugging_face_weights(Model& model, const std::string& dir) {
  HuggingFaceWeights weights(model, dir);  // every check first: nothing is copied unless all pass
  torch::NoGradGuard no_grad;
  HuggingFaceLoad out;
  const auto nf4 = nf4_weights(model);
  for (const auto& [name, p] : weights.parameters()) {  // one tensor at a time
    if (auto it = nf4.find(name); it != nf4.end()) {  // an NF4 weight: quantized from its values in its dtype
      const auto& f = it->second;
      p.copy_(nf4_pack(weights.read(name, 0, f.numel()).view(f.shape).to(p.device(), f.dtype), f));
    } else {
      p.copy_(weights.read(name, 0, p.numel()).view(p.sizes()));
    }
    ++out.tensors;
  }
  out.files = weights.files();
  out.bytes_read = weights.bytes_read();
  return out;
}

namespace {
std::string torch_dtype_name(c10::ScalarType t) {
  if (t == torch::kFloat) return "float32";
  if (t == torch::kBFloat16) return "bfloat16";
  if (t == torch::kHalf) return "float16";
  throw ConfigError(detail::concat("[export] weights in ", t, ": expected float32, bfloat16 or float16"));
}
}  // namespace

std::vector<std::string> save_hugging_face(const std::string& dir, const ModelConfig& config,
                                           const std::map<std::string, torch::Tensor>& parameters,
                                           const HuggingFaceSaveOptions& options) {
  std::error_code ec;
  MEMTRAIN_CHECK(!fs::exists(dir, ec), ConfigError, "[export] ", dir,
                 " already exists: an export never overwrites a folder; choose a new one or remove it");
  MEMTRAIN_CHECK(config.name != "gpt" || config.bias, ConfigError,
                 "[export] GPT-2's layout has biases in every Linear; this GPT has model.bias = false");
  const auto config_json = hugging_face_config_json(config, torch_dtype_name(options.dtype));
  // The tensors by checkpoint name (save_pretrained's files hold them sorted), and the shards: a new one
  // whenever the next tensor would take the current one past max_shard_bytes.
  // hf name -> (memtrain's tensor, transposed); the parameters a fused tensor holds, in their rows' order.
  std::map<std::string, std::pair<torch::Tensor, bool>> named;
  std::map<std::string, std::map<int64_t, torch::Tensor>> fused;
  for (const auto& [name, t] : parameters) {
    auto hf = hugging_face_name(config, name);
    if (hf.rows > 0) fused[hf.name].emplace(hf.row_begin, t);
    else named.emplace(hf.name, std::make_pair(t, hf.transposed));
  }
  for (const auto& [name, parts] : fused) {
    std::vector<torch::Tensor> rows;
    for (const auto& [begin, t] : parts) rows.push_back(t.detach().to(torch::kCPU));
    named.emplace(name, std::make_pair(torch::cat(rows, 0), false));
  }
  std::vector<std::vector<std::string>> shards(1);
  int64_t in_shard = 0, total = 0;
  for (const auto& [name, entry] : named) {
    const int64_t bytes = entry.first.numel() * static_cast<int64_t>(c10::elementSize(options.dtype));
    if (in_shard > 0 && in_shard + bytes > options.max_shard_bytes) shards.emplace_back(), in_shard = 0;
    shards.back().push_back(name);
    in_shard += bytes, total += bytes;
  }
  const auto partial = dir + ".partial";
  fs::remove_all(partial, ec);
  fs::create_directories(partial);
  std::vector<std::string> written;
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t k = 0; k < shards.size(); ++k) {
    char file[64];
    if (shards.size() == 1) std::snprintf(file, sizeof file, "model.safetensors");
    else std::snprintf(file, sizeof file, "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
    std::map<std::string, torch::Tensor> tensors;  // this shard's, converted: one shard in memory at a time
    for (const auto& name : shards[k]) {
      const auto& [t, transposed] = named.at(name);
      auto stored = t.detach().to(torch::kCPU).to(options.dtype);
      tensors.emplace(name, transposed ? stored.t().contiguous() : stored.contiguous());
      weight_map[name] = file;
    }
    save_safetensors((fs::path(partial) / file).string(), tensors, {{"format", "pt"}});
    written.push_back((fs::path(dir) / file).string());
  }
  if (shards.size() > 1) {
    nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_file_atomically((fs::path(partial) / "model.safetensors.index.json").string(), index.dump(2) + "\n");
    written.push_back((fs::path(dir) / "model.safetensors.index.json").string());
  }
  write_file_atomically((fs::path(partial) / "config.json").string(), config_json);
  written.push_back((fs::path(dir) / "config.json").string());
  fs::rename(partial, dir);
  return written;
}

std::string peft_name(const ModelConfig& model, const std::string& parameter) {
  MEMTRAIN_CHECK(is_lora_parameter(parameter), Error, "[lora] '", parameter, "' is not an adapter parameter");
  const auto dot = parameter.rfind('.');
  const auto module = parameter.substr(0, dot), which = parameter.substr(dot + 1);
  const auto hf = hugging_face_name(model, module + ".weight");
  MEMTRAIN_CHECK(hf.rows == 0, ConfigError, "[lora] model.name = ", model.name, " stores ", module, " inside ", hf.name,
                 ": a peft adapter targets the fused module, which memtrain's adapters (one per projection) are not; "
                 "export merged weights instead (memtrain export without --adapter)");
  auto base = hf.name;
  base.resize(base.size() - std::string(".weight").size());
  return "base_model.model." + base + "." + which + ".weight";
}

std::map<std::string, torch::Tensor> load_lora_adapter(Model& model, const ModelConfig& config, const std::string& dir) {
  const auto path = (fs::path(dir) / "adapter_model.safetensors").string();
  std::error_code ec;
  MEMTRAIN_CHECK(fs::is_regular_file(path, ec), DataError, "[lora] ", dir,
                 ": no adapter_model.safetensors (peft's save_pretrained writes it beside adapter_config.json)");
  const auto stored = load_safetensors(path);
  std::map<std::string, torch::Tensor> whole;  // by memtrain name
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;
  std::set<std::string> used;
  const auto* tp = model.tensor_parallel();
  for (const auto& item : model.named_parameters()) {
    if (!is_lora_parameter(item.key())) continue;
    const auto name = peft_name(config, item.key());
    auto it = stored.find(name);
    // A split model's adapter is a slice: the file holds the whole adapter, of the whole map's shape.
    const auto split = tp ? model.tensor_split(item.key()) : TensorSplit{};
    const auto expected = whole_sizes(split, item.value().sizes());
    MEMTRAIN_CHECK(it != stored.end(), DataError, "[lora] ", path, ": no tensor '", name, "' (memtrain's ", item.key(),
                   ", shape ", c10::IntArrayRef(expected), "): an adapter of other targets?");
    MEMTRAIN_CHECK(it->second.sizes() == c10::IntArrayRef(expected), DataError, "[lora] ", path, ": tensor '", name,
                   "' has shape ", it->second.sizes(), "; the adapter expects ", c10::IntArrayRef(expected),
                   " (another rank or base?)");
    whole.emplace(item.key(), it->second);
    auto value = it->second;
    if (split.split())  // this rank's elements, from their places in the whole
      value = slice_of_whole(split, item.value().sizes(), tp->rank(), tp->size(), it->second, 0, item.value().numel())
                  .view(item.value().sizes());
    copies.emplace_back(item.value(), value);
    used.insert(name);
  }
  for (const auto& [name, t] : stored)
    MEMTRAIN_CHECK(used.count(name), DataError, "[lora] ", path, ": unexpected tensor '", name,
                   "': this model has no adapter of that name (lora.targets differ?)");
  torch::NoGradGuard no_grad;
  for (auto& [p, t] : copies) p.copy_(t);
  return whole;
}

std::vector<std::string> save_lora_adapter(const std::string& dir, const ModelConfig& model, const LoraConfig& lora,
                                           const std::map<std::string, torch::Tensor>& adapters,
                                           const std::string& base_model) {
  std::error_code ec;
  MEMTRAIN_CHECK(!fs::exists(dir, ec), ConfigError, "[export] ", dir,
                 " already exists: an export never overwrites a folder; choose a new one or remove it");
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& [name, t] : adapters) tensors.emplace(peft_name(model, name), t.detach().to(torch::kCPU, torch::kFloat).contiguous());
  const auto partial = dir + ".partial";
  fs::remove_all(partial, ec);
  fs::create_directories(partial);
  save_safetensors((fs::path(partial) / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
  write_file_atomically((fs::path(partial) / "adapter_config.json").string(), peft_adapter_config_json(lora, model, base_model));
  fs::rename(partial, dir);
  return {(fs::path(dir) / "adapter_model.safetensors").string(), (fs::path(dir) / "adapter_config.json").string()};
}

std::map<std::string, torch::Tensor> merge_lora(const std::map<std::string, torch::Tensor>& parameters, double scale) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : parameters)
    if (!is_lora_parameter(name)) out[name] = t;
  for (const auto& [name, t] : parameters) {
    if (!name.ends_with(".lora_A")) continue;
    const auto module = name.substr(0, name.size() - std::string(".lora_A").size());
    auto& w = out.at(module + ".weight");
    const auto& b = parameters.at(module + ".lora_B");
    w = w.to(torch::kFloat) + torch::matmul(b.to(torch::kFloat), t.to(torch::kFloat)) * scale;  // (out, r) (r, in)
  }
  return out;
}

}  // namespace memtrain
