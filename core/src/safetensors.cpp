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
#include "memtrain/core/files.h"

namespace memtrain {
namespace {

const std::map<std::string, c10::ScalarType>& dtypes() {
  static const std::map<std::string, c10::ScalarType> m = {
      {"F64", torch::kDouble}, {"F32", torch::kFloat},  {"F16", torch::kHalf}, {"BF16", torch::kBFloat16},
      {"I64", torch::kLong},   {"I32", torch::kInt},    {"I16", torch::kShort}, {"I8", torch::kChar},
      {"U8", torch::kByte},    {"BOOL", torch::kBool}};
  return m;
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


std::map<std::string, torch::Tensor> load_safetensors(const std::string& path) {
  return parse_safetensors(read_file_bytes(path), path);
}

namespace {

// The header's tensors, each checked against `data_len` (the bytes after the header): a dtype the format
// defines, a shape whose elements fit, and a byte range inside the data that the shape fills exactly.
// Offsets are relative to the data's start.
std::vector<SafetensorsEntry> parse_header(const std::string& header, uint64_t data_len, const std::string& path,
                                           nlohmann::json& j) {
  std::vector<SafetensorsEntry> out;
  std::string current = "<header>";
  try {
    j = nlohmann::json::parse(header);
    MEMTRAIN_CHECK(j.is_object(), DataError, "[safetensors] ", path, ": header is not a JSON object");
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
                     " (the file is truncated or corrupt); its shape needs ", nbytes);
      out.push_back({name, dt->second, shape, range[0], range[1]});
    }
  } catch (const nlohmann::json::exception& e) {
    throw DataError(detail::concat("[safetensors] ", path, ": malformed header at '", current, "': ", e.what()));
  }
  return out;
}

// The header length of a file of `file_size` bytes, checked.
uint64_t checked_header_length(const char* first8, uint64_t file_size, const std::string& path) {
  uint64_t header_len = 0;
  if (file_size >= 8) std::memcpy(&header_len, first8, 8);
  MEMTRAIN_CHECK(file_size >= 8 && header_len > 1 && header_len <= file_size - 8, DataError, "[safetensors] ", path,
                 ": corrupt header length ", header_len, " for a file of ", file_size, " bytes");
  return header_len;
}

}  // namespace

std::map<std::string, torch::Tensor> parse_safetensors(const std::string& bytes, const std::string& path) {
  const uint64_t file_size = bytes.size();
  const uint64_t header_len = checked_header_length(bytes.data(), file_size, path);
  const char* data = bytes.data() + 8 + header_len;
  const uint64_t data_len = file_size - 8 - header_len;
  nlohmann::json j;
  auto entries = parse_header(bytes.substr(8, header_len), data_len, path, j);
  if (j.contains("__metadata__") && j["__metadata__"].is_object() && j["__metadata__"].contains("crc32")) {
    const auto& field = j["__metadata__"]["crc32"];
    MEMTRAIN_CHECK(field.is_string(), DataError, "[safetensors] ", path, ": __metadata__.crc32 is ", field.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
                   ", not a string");
    auto expected = field.get<std::string>();
    auto actual = std::to_string(crc32_of(data, data_len));
    MEMTRAIN_CHECK(expected == actual, DataError, "[safetensors] ", path, ": checksum mismatch (expected crc32 ",
                   expected, ", got ", actual, "): the file is corrupt");
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& e : entries) {
    auto t = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
    // An empty tensor's data_ptr() is null, and memcpy from or to null is undefined even for 0 bytes.
    if (e.end > e.begin) std::memcpy(t.data_ptr(), data + e.begin, e.end - e.begin);
    out.emplace(e.name, t);
  }
  return out;
}

SafetensorsIndex read_safetensors_index(const std::string& path) {
  SafetensorsIndex index;
  index.path = path;
  std::error_code ec;
  index.file_size = std::filesystem::file_size(path, ec);
  MEMTRAIN_CHECK(!ec, DataError, "[safetensors] cannot open ", path, ": ", ec.message());
  std::ifstream in(path, std::ios::binary);
  char first8[8] = {};
  in.read(first8, 8);
  const uint64_t header_len = checked_header_length(first8, in ? index.file_size : 0, path);
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  MEMTRAIN_CHECK(in.good(), DataError, "[safetensors] ", path, ": cannot read its ", header_len, "-byte header");
  index.data_offset = 8 + header_len;
  nlohmann::json j;
  index.tensors = parse_header(header, index.file_size - index.data_offset, path, j);
  return index;
}

torch::Tensor read_safetensors_elements(const SafetensorsIndex& index, const SafetensorsEntry& entry, int64_t begin,
                                        int64_t end) {
  const auto item = static_cast<int64_t>(c10::elementSize(entry.dtype));
  const int64_t numel = static_cast<int64_t>(entry.end - entry.begin) / item;
  MEMTRAIN_CHECK(0 <= begin && begin <= end && end <= numel, Error, "[safetensors] elements [", begin, ", ", end,
                 ") of '", entry.name, "' (", numel, " elements)");
  auto t = torch::empty({end - begin}, torch::TensorOptions().dtype(entry.dtype));
  const int fd = ::open(index.path.c_str(), O_RDONLY | O_CLOEXEC);
  MEMTRAIN_CHECK(fd >= 0, DataError, "[safetensors] cannot open ", index.path, ": ", std::strerror(errno));
  auto* dst = static_cast<char*>(t.data_ptr());
  uint64_t want = static_cast<uint64_t>(end - begin) * item, done = 0;
  const uint64_t at = index.data_offset + entry.begin + static_cast<uint64_t>(begin) * item;
  while (done < want) {
    const auto got = ::pread(fd, dst + done, want - done, static_cast<off_t>(at + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const int err = errno;
      ::close(fd);
      throw DataError(detail::concat("[safetensors] ", index.path, ": tensor '", entry.name, "' ends early (read ",
                                     done, " of ", want, " bytes", got < 0 ? std::string(": ") + std::strerror(err) : "",
                                     "): the file is truncated"));
    }
    done += static_cast<uint64_t>(got);
  }
  ::close(fd);
  return t;
}

SavedFile save_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                           const std::map<std::string, std::string>& metadata) {
  // The header first (offsets follow from the shapes), then each tensor's bytes straight from its memory:
  // no copy of the data is assembled. The data's CRC-32 goes into the header, so it is computed first.
  nlohmann::json header = nlohmann::json::object();
  std::vector<torch::Tensor> host;  // CPU and contiguous: views where they already are
  uint64_t offset = 0;
  uint32_t data_crc = 0;
  for (const auto& [name, tensor] : tensors) {
    auto t = tensor.detach().to(torch::kCPU).contiguous();
    const auto dtype = safetensors_dtype(t.scalar_type());
    MEMTRAIN_CHECK(!dtype.empty(), Error, "[safetensors] cannot save dtype ", t.scalar_type(), " of '", name, "'");
    const uint64_t n = static_cast<uint64_t>(t.numel()) * t.element_size();
    header[name] = {{"dtype", dtype}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + n}}};
    if (n > 0) data_crc = crc32_of(t.data_ptr(), n, data_crc);
    offset += n;
    host.push_back(std::move(t));
  }
  auto meta = nlohmann::json(metadata);
  meta["crc32"] = std::to_string(data_crc);
  header["__metadata__"] = meta;
  auto text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  const uint64_t len = text.size();
  AtomicFile f(path);
  f.write(&len, 8);
  f.write(text.data(), text.size());
  for (const auto& t : host)
    if (t.numel() > 0) f.write(t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size());
  f.finish();
  // The whole file's CRC-32, from the header's and the data's (zlib combines them without a second pass).
  const uint32_t head_crc = crc32_of(text.data(), text.size(), crc32_of(&len, 8));
  return {8 + len + offset, static_cast<uint32_t>(crc32_combine(head_crc, data_crc, static_cast<z_off_t>(offset)))};
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
