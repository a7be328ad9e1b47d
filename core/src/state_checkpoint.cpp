#include "memtrain/core/state_checkpoint.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <regex>

#include "memtrain/core/error.h"
#include "memtrain/core/safetensors.h"

namespace memtrain {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kFormat = "memtrain-training-state";
constexpr int kVersion = 1;

std::string rank_file_name(int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.safetensors", rank);
  return name;
}

// The JSON header of the safetensors file at `path`, read without its data.
json header_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uint64_t len = 0;
  in.read(reinterpret_cast<char*>(&len), 8);
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  MEMTRAIN_CHECK(in.good() && !ec && len <= size - 8, DataError, "[checkpoint] ", path, ": not a safetensors file");
  std::string text(len, '\0');
  in.read(text.data(), static_cast<std::streamsize>(len));
  return json::parse(text);
}

void fsync_folder(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) ::fsync(fd), ::close(fd);
}

// step-000100 -> 100; -1 for any other name (staging folders, files).
int64_t step_of(const std::string& name) {
  static const std::regex re("step-([0-9]{6,18})");
  std::smatch m;
  return std::regex_match(name, m, re) ? std::stoll(m[1]) : -1;
}

}  // namespace

std::string checkpoint_folder(const std::string& dir, int64_t step) {
  char name[40];
  std::snprintf(name, sizeof name, "step-%06lld", static_cast<long long>(step));
  return (fs::path(dir) / name).string();
}

std::string staging_folder(const std::string& dir, int64_t step) { return checkpoint_folder(dir, step) + ".staging"; }

SavedFile write_rank_file(const std::string& staging, int rank, const std::vector<ShardPiece>& pieces) {
  std::map<std::string, torch::Tensor> tensors;
  json index = json::object();
  for (const auto& p : pieces) {
    MEMTRAIN_CHECK(p.data.numel() == p.end - p.begin, Error, "[checkpoint] piece '", p.name, "' holds ",
                   p.data.numel(), " elements for the range [", p.begin, ", ", p.end, ")");
    // A second piece of one tensor (a tensor-parallel slice is several runs of the whole) is stored under
    // "<name>@<begin>", its entry naming the tensor it belongs to.
    const auto key = tensors.count(p.name) ? p.name + "@" + std::to_string(p.begin) : p.name;
    MEMTRAIN_CHECK(tensors.emplace(key, p.data.reshape({-1})).second, Error, "[checkpoint] piece '", p.name,
                   "' [", p.begin, ", ", p.end, ") given twice by rank ", rank);
    index[key] = {{"begin", p.begin}, {"end", p.end}, {"shape", p.full_shape}};
    if (key != p.name) index[key]["tensor"] = p.name;
  }
  return save_safetensors((fs::path(staging) / rank_file_name(rank)).string(), tensors,
                          {{"format", kFormat}, {"rank", std::to_string(rank)}, {"pieces", index.dump()}});
}

std::string commit_checkpoint(const std::string& dir, const CheckpointMeta& meta, const std::vector<SavedFile>& saved,
                              int64_t keep) {
  MEMTRAIN_CHECK(saved.size() == static_cast<size_t>(meta.world_size), Error, "[checkpoint] ", saved.size(),
                 " rank files for a world of ", meta.world_size);
  const auto staging = staging_folder(dir, meta.step);
  const auto final_dir = checkpoint_folder(dir, meta.step);
  json files = json::array(), tensors = json::object();
  for (int r = 0; r < meta.world_size; ++r) {
    const auto name = rank_file_name(r);
    const auto path = (fs::path(staging) / name).string();
    files.push_back({{"name", name}, {"rank", r}, {"bytes", saved[r].bytes}, {"crc32", std::to_string(saved[r].crc32)}});
    const auto header = header_of(path);
    const auto pieces = json::parse(header.at("__metadata__").at("pieces").get<std::string>());
    for (const auto& [key, piece] : pieces.items()) {
      const auto tname = piece.value("tensor", key);
      auto& t = tensors[tname];
      t["shape"] = piece.at("shape");
      t["dtype"] = header.at(key).at("dtype");
      t["pieces"].push_back({{"file", name}, {"begin", piece.at("begin")}, {"end", piece.at("end")}});
      if (key != tname) t["pieces"].back()["key"] = key;
    }
  }
  json manifest = {{"format", kFormat},       {"version", kVersion},           {"step", meta.step},
                   {"world_size", meta.world_size}, {"zero_stage", meta.zero_stage}, {"fields", meta.fields},
                   {"files", files},          {"tensors", tensors}};
  write_file_atomically((fs::path(staging) / "manifest.json").string(), manifest.dump(1) + "\n");
  fsync_folder(staging);
  // A checkpoint of this step from an earlier attempt (a resume from an older one) is replaced.
  if (fs::exists(final_dir)) {
    const auto old = final_dir + ".replaced";
    fs::remove_all(old);
    fs::rename(final_dir, old);
    fs::rename(staging, final_dir);
    fs::remove_all(old);
  } else {
    fs::rename(staging, final_dir);
  }
  fsync_folder(dir);
  // The checkpoint is complete now. What follows is housekeeping: a failure is said, not thrown
  // (find_latest_checkpoint does without `latest`, and a folder left over is removed by a later save).
  try {
    write_file_atomically((fs::path(dir) / "latest").string(), fs::path(final_dir).filename().string() + "\n");
  } catch (const std::exception& e) {
    std::cerr << "memtrain: warning: " << final_dir << " is saved, but `latest` was not updated: " << e.what() << "\n";
  }
  // Prune: all but the newest `keep` (never this one), and staging folders of saves that never finished.
  std::error_code ec;
  auto all = list_checkpoints(dir);
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i)
    if (all[i] != final_dir && !fs::remove_all(all[i], ec) && ec)
      std::cerr << "memtrain: warning: could not remove the old checkpoint " << all[i] << ": " << ec.message() << "\n";
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const auto n = e.path().filename().string();
    if (e.is_directory() && n.size() > 8 && n.rfind("step-", 0) == 0 && n != fs::path(staging).filename().string() &&
        (n.ends_with(".staging") || n.ends_with(".replaced")))
      fs::remove_all(e.path(), ec);
  }
  return final_dir;
}

std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return {};
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const auto step = step_of(e.path().filename().string());
    if (step >= 0 && e.is_directory() && fs::exists(e.path() / "manifest.json")) found.emplace_back(step, e.path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

std::string find_latest_checkpoint(const std::string& dir) {
  std::ifstream latest(fs::path(dir) / "latest");
  std::string name;
  std::getline(latest, name);
  const auto all = list_checkpoints(dir);
  if (!name.empty() && step_of(name) >= 0 && fs::exists(fs::path(dir) / name / "manifest.json")) {
    const auto named = (fs::path(dir) / name).string();
    // `latest` is written after the rename: a newer complete folder means the crash came in between.
    if (all.empty() || step_of(fs::path(all.back()).filename().string()) <= step_of(name)) return named;
  }
  return all.empty() ? "" : all.back();
}

namespace {

CheckpointMeta meta_of(const json& m, const std::string& where) {
  MEMTRAIN_CHECK(m.is_object() && m.value("format", "") == kFormat, DataError, "[checkpoint] ", where,
                 ": not a memtrain training-state manifest (format '", m.is_object() ? m.value("format", "") : "", "')");
  MEMTRAIN_CHECK(m.at("version").get<int>() == kVersion, DataError, "[checkpoint] ", where, ": version ",
                 m.at("version").dump(), "; this memtrain reads version ", kVersion);
  CheckpointMeta meta;
  meta.step = m.at("step").get<int64_t>();
  meta.world_size = m.at("world_size").get<int>();
  meta.zero_stage = m.at("zero_stage").get<int>();
  meta.fields = m.at("fields").get<std::map<std::string, std::string>>();
  MEMTRAIN_CHECK(meta.step >= 0 && meta.world_size >= 1, DataError, "[checkpoint] ", where, ": step ", meta.step,
                 " at world size ", meta.world_size, " is impossible");
  return meta;
}

}  // namespace

CheckpointMeta read_manifest(const std::string& path) {
  const auto file = (fs::path(path) / "manifest.json").string();
  MEMTRAIN_CHECK(fs::is_regular_file(file), DataError, "[checkpoint] '", path,
                 "' is not a complete checkpoint: it has no manifest.json");
  try {
    return meta_of(json::parse(read_file_bytes(file)), file);
  } catch (const json::exception& e) {
    throw DataError(detail::concat("[checkpoint] ", file, ": malformed manifest: ", e.what()));
  }
}

LoadedCheckpoint load_checkpoint(const std::string& path) {
  const auto manifest_path = (fs::path(path) / "manifest.json").string();
  LoadedCheckpoint out;
  out.path = path;
  out.meta = read_manifest(path);
  std::string where = manifest_path;
  try {
    const auto m = json::parse(read_file_bytes(manifest_path));
    // 1. Every file: present, of its size, with its checksum, and readable.
    std::map<std::string, std::map<std::string, torch::Tensor>> files;
    for (const auto& f : m.at("files")) {
      const auto name = f.at("name").get<std::string>();
      MEMTRAIN_CHECK(name.find('/') == std::string::npos && name.find("..") == std::string::npos, DataError,
                     "[checkpoint] ", manifest_path, ": file name '", name, "' leaves the checkpoint folder");
      const auto file = (fs::path(path) / name).string();
      where = file;
      MEMTRAIN_CHECK(fs::is_regular_file(file), DataError, "[checkpoint] ", file,
                     ": missing (the manifest lists it: a shard of rank ", f.at("rank").dump(), ")");
      const auto size = fs::file_size(file);
      MEMTRAIN_CHECK(size == f.at("bytes").get<uint64_t>(), DataError, "[checkpoint] ", file, ": ", size,
                     " bytes, the manifest says ", f.at("bytes").get<uint64_t>(), " (truncated or replaced)");
      MEMTRAIN_CHECK(!files.count(name), DataError, "[checkpoint] ", manifest_path, ": file '", name, "' listed twice");
      const auto bytes = read_file_bytes(file);  // read once: checksum, then tensors
      const auto crc = std::to_string(crc32_of(bytes));
      MEMTRAIN_CHECK(crc == f.at("crc32").get<std::string>(), DataError, "[checkpoint] ", file,
                     ": checksum mismatch (crc32 ", crc, ", the manifest says ", f.at("crc32").get<std::string>(),
                     "): the file is corrupt");
      files.emplace(name, parse_safetensors(bytes, file));
    }
    where = manifest_path;
    // 2. Every tensor: its pieces exist with the right size and dtype and cover it exactly once.
    std::map<std::string, size_t> used;  // file/tensor -> times named by the manifest
    for (const auto& [name, t] : m.at("tensors").items()) {
      const auto shape = t.at("shape").get<std::vector<int64_t>>();
      // At most 2^40 elements, and the product with zeros taken as 1 (which LibTorch's strides reach even
      // for an empty tensor: [0, 2^62, 2^62]) too.
      int64_t numel = 1, extent = 1;
      for (auto d : shape) {
        const int64_t span = std::max<int64_t>(d, 1);
        MEMTRAIN_CHECK(d >= 0 && extent <= (int64_t{1} << 40) / span, DataError, "[checkpoint] ", manifest_path,
                       ": tensor '", name, "' has an impossible shape ", t.at("shape").dump());
        numel *= d;
        extent *= span;
      }
      std::vector<std::tuple<int64_t, int64_t, torch::Tensor, std::string>> pieces;
      for (const auto& p : t.at("pieces")) {
        const auto file = p.at("file").get<std::string>();
        const auto begin = p.at("begin").get<int64_t>(), end = p.at("end").get<int64_t>();
        auto f = files.find(file);
        MEMTRAIN_CHECK(f != files.end(), DataError, "[checkpoint] ", manifest_path, ": tensor '", name,
                       "' has a piece in '", file, "', which the manifest does not list");
        const auto key = p.value("key", name);  // a second piece of the tensor in this file: "<name>@<begin>"
        auto data = f->second.find(key);
        MEMTRAIN_CHECK(data != f->second.end(), DataError, "[checkpoint] ", (fs::path(path) / file).string(),
                       ": no tensor '", key, "', which the manifest places there");
        MEMTRAIN_CHECK(begin >= 0 && begin <= end && end <= numel && data->second.numel() == end - begin, DataError,
                       "[checkpoint] ", (fs::path(path) / file).string(), ": tensor '", name, "' holds ",
                       data->second.numel(), " elements; the manifest says [", begin, ", ", end, ") of ", numel);
        MEMTRAIN_CHECK(safetensors_dtype(data->second.scalar_type()) == t.at("dtype").get<std::string>(), DataError,
                       "[checkpoint] ", (fs::path(path) / file).string(), ": tensor '", name, "' is ",
                       safetensors_dtype(data->second.scalar_type()), "; the manifest says ", t.at("dtype").dump());
        ++used[file + "/" + key];
        pieces.emplace_back(begin, end, data->second, file);
      }
      std::sort(pieces.begin(), pieces.end(), [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
      int64_t covered = 0;
      for (const auto& [b, e, d, f] : pieces) {
        MEMTRAIN_CHECK(b == covered, DataError, "[checkpoint] ", path, ": tensor '", name, "' ",
                       b > covered ? "has a gap" : "has overlapping pieces", " at element ", std::min(b, covered),
                       " (piece from '", f, "'): a shard is missing or the manifest does not match the files");
        covered = e;
      }
      MEMTRAIN_CHECK(covered == numel, DataError, "[checkpoint] ", path, ": tensor '", name, "' is covered up to element ",
                     covered, " of ", numel, ": a shard is missing");
      torch::Tensor full;
      if (pieces.empty()) {  // an empty tensor that no file holds (covered == numel == 0)
        const auto dtype = safetensors_scalar_type(t.at("dtype").get<std::string>());
        MEMTRAIN_CHECK(dtype.has_value(), DataError, "[checkpoint] ", manifest_path, ": tensor '", name,
                       "' has unknown dtype ", t.at("dtype").dump());
        full = torch::empty(shape, torch::TensorOptions().dtype(*dtype));
      } else if (pieces.size() == 1) {
        full = std::get<2>(pieces.front());
      } else {
        std::vector<torch::Tensor> parts;
        for (const auto& piece : pieces) parts.push_back(std::get<2>(piece));
        full = torch::cat(parts);
      }
      out.tensors.emplace(name, full.reshape(shape));
    }
    // 3. Nothing in the files that the manifest does not know about.
    for (const auto& [file, tensors] : files)
      for (const auto& [name, t] : tensors)
        MEMTRAIN_CHECK(used.count(file + "/" + name), DataError, "[checkpoint] ", (fs::path(path) / file).string(),
                       ": tensor '", name, "' is not in the manifest: the manifest does not match the files");
  } catch (const json::exception& e) {
    throw DataError(detail::concat("[checkpoint] ", where, ": malformed manifest entry: ", e.what()));
  }
  return out;
}

}  // namespace memtrain
