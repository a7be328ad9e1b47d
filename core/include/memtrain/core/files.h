// Files as memtrain writes and reads them: written whole or not at all (a temporary name, fsynced, renamed
// over the old file), read whole, checked by CRC-32 (zlib's). The bottom layer: the tracker, checkpoints and
// safetensors all write through here.
//
//   memtrain::write_file_atomically(dir + "/summary.json", text);   // the old file, or the whole new one
//   memtrain::AtomicFile f(path); f.write(header.data(), header.size()); ...; f.finish();
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace memtrain {

// A file written to path.tmp, fsynced and renamed over path by finish(); removed if never finished. Errors
// (a full disk, an unwritable folder) are Errors naming the file, and leave the old file untouched.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  void write(const void* data, size_t n);
  void finish();  // on disk before the rename: a crash leaves either the old file or the whole new one

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  uint64_t written_ = 0;
};

// Writes `bytes` to path.tmp, fsyncs it and renames it over `path` (AtomicFile).
void write_file_atomically(const std::string& path, const std::string& bytes);
// A whole file read into memory; DataError naming the file when it cannot be read whole.
std::string read_file_bytes(const std::string& path);
// CRC-32 (zlib's) of bytes, continuing from `crc` (0 to start): what checkpoint manifests record.
uint32_t crc32_of(const void* data, size_t n, uint32_t crc = 0);
uint32_t crc32_of(const std::string& bytes);
// Size and CRC-32 of a file as written.
struct SavedFile {
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};

}  // namespace memtrain
