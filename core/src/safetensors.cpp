#include "memtrain/core/safetensors.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "memtrain/core/error.h"

namespace memtrain {
namespace {

const std::map<std::string, c10::ScalarType>& dtypes() {
  static const std::map<std::string, c10::ScalarType> m = {
      {"F64", torch::kDouble}, {"F32", torch::kFloat},  {"F16", torch::kHalf}, {"BF16", torch::kBFloat16},
      {"I64", torch::kLong},   {"I32", torch::kInt},    {"I16", torch::kShort}, {"I8", torch::kChar},
      {"U8", torch::kByte},    {"BOOL", torch::kBool}};
  return m;
}

std::string crc_of(const std::string& bytes) {
  // crc32_z takes a size_t length: files over 4 GiB are covered whole.
  return std::to_string(crc32_z(0L, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size()));
}

}  // namespace

std::string safetensors_dtype(c10::ScalarType type) {
  for (const auto& [name, t] : dtypes())
    if (t == type) return name;
  return "";
}

std::optional<c10::ScalarType> safetensors_scalar_type(const std::string& name) {
  auto it = dtypes().find(name);
  return it == dtypes().end() ? std::nullopt : std::optional<c10::ScalarType>(it->second);
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  const auto tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  MEMTRAIN_CHECK(fd >= 0, Error, "[io] cannot write '", tmp, "': ", std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    auto n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw Error(detail::concat("[io] writing '", tmp, "' failed after ", done, " of ", bytes.size(),
                                 " bytes: ", std::strerror(err), "; '", path, "' is untouched"));
    }
    done += static_cast<size_t>(n);
  }
  // On disk before the rename, so that a crash leaves either the old file or the whole new one.
  const bool synced = ::fsync(fd) == 0;
  const bool closed = ::close(fd) == 0;
  if (!synced || !closed) {
    ::unlink(tmp.c_str());
    throw Error(detail::concat("[io] flushing '", tmp, "' failed: ", std::strerror(errno), "; '", path, "' is untouched"));
  }
  std::filesystem::rename(tmp, path);
  auto dir = std::filesystem::path(path).parent_path();
  int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) ::fsync(dfd), ::close(dfd);  // the rename itself; best effort
}

std::map<std::string, torch::Tensor> load_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MEMTRAIN_CHECK(in.good(), DataError, "[safetensors] cannot open '", path, "'");
  const uint64_t file_size = std::filesystem::file_size(path);
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  MEMTRAIN_CHECK(in.good() && file_size >= 8 && header_len > 1 && header_len <= file_size - 8, DataError,
                 "[safetensors] ", path, ": corrupt header length ", header_len, " for a file of ", file_size, " bytes");
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  const uint64_t data_len = file_size - 8 - header_len;
  std::string data(data_len, '\0');
  in.read(data.data(), static_cast<std::streamsize>(data_len));
  MEMTRAIN_CHECK(static_cast<uint64_t>(in.gcount()) == data_len, DataError, "[safetensors] ", path, ": short read (",
                 in.gcount(), " of ", data_len, " data bytes)");
  std::map<std::string, torch::Tensor> out;
  std::string current = "<header>";
  try {
    auto j = nlohmann::json::parse(header);
    MEMTRAIN_CHECK(j.is_object(), DataError, "[safetensors] ", path, ": header is not a JSON object");
    if (j.contains("__metadata__") && j["__metadata__"].contains("crc32")) {
      auto expected = j["__metadata__"]["crc32"].get<std::string>();
      auto actual = crc_of(data);
      MEMTRAIN_CHECK(expected == actual, DataError, "[safetensors] ", path, ": checksum mismatch (expected crc32 ",
                     expected, ", got ", actual, "): the file is corrupt");
    }
    for (auto& [name, v] : j.items()) {
      if (name == "__metadata__") continue;
      current = name;
      auto dt = dtypes().find(v.at("dtype").get<std::string>());
      MEMTRAIN_CHECK(dt != dtypes().end(), DataError, "[safetensors] ", path, ": tensor '", name,
                     "' has unsupported dtype ", v.at("dtype").get<std::string>());
      auto shape = v.at("shape").get<std::vector<int64_t>>();
      auto range = v.at("data_offsets").get<std::vector<uint64_t>>();
      // numel must fit the data; `extent` (the product with zeros taken as 1, which LibTorch's strides
      // reach even when numel is 0) must fit an int64_t: shape [0, 2^62, 2^62] has no elements, but
      // torch::empty refuses it with a c10::Error.
      uint64_t numel = 1, extent = 1;
      for (auto d : shape) {
        const auto span = static_cast<uint64_t>(std::max<int64_t>(d, 1));
        MEMTRAIN_CHECK(d >= 0 && (d == 0 || numel <= data_len / static_cast<uint64_t>(d)) &&
                           extent <= static_cast<uint64_t>(INT64_MAX) / span,
                       DataError, "[safetensors] ", path, ": tensor '", name, "' has an impossible shape ",
                       c10::IntArrayRef(shape), " for ", data_len, " data bytes");
        numel *= static_cast<uint64_t>(d);
        extent *= span;
      }
      const uint64_t nbytes = numel * c10::elementSize(dt->second);
      MEMTRAIN_CHECK(range.size() == 2 && range[0] <= range[1] && range[1] <= data_len && range[1] - range[0] == nbytes,
                     DataError, "[safetensors] ", path, ": tensor '", name, "' claims bytes [",
                     range.empty() ? 0 : range[0], ", ", range.size() < 2 ? 0 : range[1], ") of ", data_len,
                     "; its shape needs ", nbytes);
      auto t = torch::empty(shape, torch::TensorOptions().dtype(dt->second));
      // An empty tensor's data_ptr() is null, and memcpy from or to null is undefined even for 0 bytes.
      if (nbytes > 0) std::memcpy(t.data_ptr(), data.data() + range[0], nbytes);
      out.emplace(name, t);
    }
  } catch (const nlohmann::json::exception& e) {
    throw DataError(detail::concat("[safetensors] ", path, ": malformed header at '", current, "': ", e.what()));
  }
  return out;
}

void save_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto& [name, tensor] : tensors) {
    auto t = tensor.detach().to(torch::kCPU).contiguous();
    const auto dtype = safetensors_dtype(t.scalar_type());
    MEMTRAIN_CHECK(!dtype.empty(), Error, "[safetensors] cannot save dtype ", t.scalar_type(), " of '", name, "'");
    const auto begin = data.size();
    data.append(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
    header[name] = {{"dtype", dtype}, {"shape", t.sizes().vec()}, {"data_offsets", {begin, data.size()}}};
  }
  auto meta = nlohmann::json(metadata);
  meta["crc32"] = crc_of(data);
  header["__metadata__"] = meta;
  auto text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  const uint64_t len = text.size();
  std::string bytes(reinterpret_cast<const char*>(&len), 8);
  bytes += text;
  bytes += data;
  write_file_atomically(path, bytes);
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
