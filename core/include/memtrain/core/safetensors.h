// The safetensors format (8-byte little-endian header length, a JSON header naming each tensor's
// dtype, shape and byte range, then the raw data): what the Python reference scripts write and what
// memtrain saves weights in. save_safetensors writes a temporary file and renames it, and records a
// CRC-32 of the data in the header's __metadata__, which load_safetensors checks when present.
#pragma once

#include <torch/types.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "memtrain/core/files.h"  // SavedFile

namespace memtrain {

std::map<std::string, torch::Tensor> load_safetensors(const std::string& path);
// The same from a file's bytes already in memory; `path` names it in errors.
std::map<std::string, torch::Tensor> parse_safetensors(const std::string& bytes, const std::string& path);
// The format's name of a dtype ("F32", "BF16", ...); "" for one it cannot hold.
std::string safetensors_dtype(c10::ScalarType type);
// The dtype of a name of the format ("F32" -> kFloat); nullopt for a name it does not define.
std::optional<c10::ScalarType> safetensors_scalar_type(const std::string& name);
// One tensor of a file's header: its dtype, shape and byte range [begin, end) after the header.
struct SafetensorsEntry {
  std::string name;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};
// A file's header alone (the data is not read): every entry checked against the file's size, so a
// truncated file is an error naming the first tensor that does not fit.
struct SafetensorsIndex {
  std::string path;
  uint64_t file_size = 0;
  uint64_t data_offset = 0;  // 8 + header length
  std::vector<SafetensorsEntry> tensors;
};
SafetensorsIndex read_safetensors_index(const std::string& path);
// Elements [begin, end) of a tensor, flattened, read from the file at their offset (no other byte is read).
torch::Tensor read_safetensors_elements(const SafetensorsIndex& index, const SafetensorsEntry& entry, int64_t begin,
                                        int64_t end);
// Streams the header and then each tensor's bytes from its own memory (no assembled copy), to path.tmp,
// fsynced and renamed.
SavedFile save_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                           const std::map<std::string, std::string>& metadata = {});

}  // namespace memtrain

namespace torch::nn {
class Module;
}

namespace memtrain {

// Copies `tensors` into the module's parameters and buffers by name. Every name must match, both ways,
// with the same shape: a missing, unexpected or mis-shaped tensor is an error naming it (a checkpoint
// from another model), and nothing is copied unless everything matches.
void load_module_state(torch::nn::Module& module, const std::map<std::string, torch::Tensor>& tensors,
                       const std::string& source);

}  // namespace memtrain
