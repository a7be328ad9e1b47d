#include "memtrain/data/safetensors.h"

#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "memtrain/error.h"

namespace memtrain {
namespace {

const std::map<std::string, c10::ScalarType>& dtypes() {
  static const std::map<std::string, c10::ScalarType> m = {
      {"F64", torch::kDouble}, {"F32", torch::kFloat},  {"F16", torch::kHalf}, {"BF16", torch::kBFloat16},
      {"I64", torch::kLong},   {"I32", torch::kInt},    {"I16", torch::kShort}, {"I8", torch::kChar},
      {"U8", torch::kByte},    {"BOOL", torch::kBool}};
  return m;
}

uint32_t crc_of(const std::string& bytes) {
  return static_cast<uint32_t>(crc32(0L, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
}

}  // namespace

std::map<std::string, torch::Tensor> load_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MEMTRAIN_CHECK(in.good(), DataError, "[safetensors] cannot open '", path, "'");
  const auto file_size = std::filesystem::file_size(path);
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  MEMTRAIN_CHECK(in.good() && header_len > 1 && 8 + header_len <= file_size, DataError, "[safetensors] ", path,
                 ": corrupt header length ", header_len, " for a file of ", file_size, " bytes");
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const std::exception& e) {
    throw DataError(detail::concat("[safetensors] ", path, ": header is not valid JSON (", e.what(), ")"));
  }
  const uint64_t data_len = file_size - 8 - header_len;
  std::string data(data_len, '\0');
  in.read(data.data(), static_cast<std::streamsize>(data_len));
  MEMTRAIN_CHECK(in.good() || in.eof(), DataError, "[safetensors] ", path, ": short read");
  if (j.contains("__metadata__") && j["__metadata__"].contains("crc32")) {
    auto expected = j["__metadata__"]["crc32"].get<std::string>();
    auto actual = std::to_string(crc_of(data));
    MEMTRAIN_CHECK(expected == actual, DataError, "[safetensors] ", path, ": checksum mismatch (expected crc32 ",
                   expected, ", got ", actual, "): the file is corrupt");
  }
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, v] : j.items()) {
    if (name == "__metadata__") continue;
    auto dt = dtypes().find(v.at("dtype").get<std::string>());
    MEMTRAIN_CHECK(dt != dtypes().end(), DataError, "[safetensors] ", path, ": tensor '", name, "' has unsupported dtype ",
                   v.at("dtype").get<std::string>());
    std::vector<int64_t> shape = v.at("shape").get<std::vector<int64_t>>();
    auto range = v.at("data_offsets").get<std::vector<uint64_t>>();
    auto t = torch::empty(shape, torch::TensorOptions().dtype(dt->second));
    const uint64_t nbytes = t.numel() * t.element_size();
    MEMTRAIN_CHECK(range.size() == 2 && range[1] - range[0] == nbytes && range[1] <= data_len, DataError,
                   "[safetensors] ", path, ": tensor '", name, "' byte range does not match its shape");
    std::memcpy(t.data_ptr(), data.data() + range[0], nbytes);
    out.emplace(name, t);
  }
  return out;
}

void save_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto& [name, tensor] : tensors) {
    auto t = tensor.detach().to(torch::kCPU).contiguous();
    std::string dtype;
    for (const auto& [k, v] : dtypes())
      if (v == t.scalar_type()) dtype = k;
    MEMTRAIN_CHECK(!dtype.empty(), Error, "[safetensors] cannot save dtype ", t.scalar_type(), " of '", name, "'");
    const auto begin = data.size();
    data.append(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
    header[name] = {{"dtype", dtype}, {"shape", t.sizes().vec()}, {"data_offsets", {begin, data.size()}}};
  }
  auto meta = nlohmann::json(metadata);
  meta["crc32"] = std::to_string(crc_of(data));
  header["__metadata__"] = meta;
  auto text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  const uint64_t len = text.size();
  const auto tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    MEMTRAIN_CHECK(out.good(), Error, "[safetensors] cannot write '", tmp, "'");
    out.write(reinterpret_cast<const char*>(&len), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.write(data.data(), static_cast<std::streamsize>(data.size()));
    MEMTRAIN_CHECK(out.good(), Error, "[safetensors] write to '", tmp, "' failed (disk full?)");
  }
  std::filesystem::rename(tmp, path);  // atomic: a crash leaves the old file, never half a new one
}

}  // namespace memtrain

#include <torch/nn/module.h>

namespace memtrain {

void load_module_state(torch::nn::Module& module, const std::map<std::string, torch::Tensor>& tensors,
                       const std::string& source) {
  std::map<std::string, torch::Tensor> targets;
  for (const auto& item : module.named_parameters()) targets.emplace(item.key(), item.value());
  for (const auto& item : module.named_buffers()) targets.emplace(item.key(), item.value());
  for (const auto& [name, t] : targets) {
    auto it = tensors.find(name);
    MEMTRAIN_CHECK(it != tensors.end(), DataError, "[weights] ", source, ": no tensor '", name,
                   "' for the model's parameter of shape ", t.sizes(), ": weights of a different model?");
    MEMTRAIN_CHECK(it->second.sizes() == t.sizes(), DataError, "[weights] ", source, ": tensor '", name, "' has shape ",
                   it->second.sizes(), ", the model expects ", t.sizes());
  }
  for (const auto& [name, t] : tensors) {
    MEMTRAIN_CHECK(targets.count(name) == 1, DataError, "[weights] ", source, ": unexpected tensor '", name,
                   "': the model has no parameter or buffer of that name");
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : targets) t.copy_(tensors.at(name));
}

}  // namespace memtrain
