#include "memtrain/core/files.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "memtrain/core/error.h"

namespace memtrain {

uint32_t crc32_of(const void* data, size_t n, uint32_t crc) {
  // crc32_z takes a size_t length: files over 4 GiB are covered whole.
  return static_cast<uint32_t>(crc32_z(crc, static_cast<const Bytef*>(data), n));
}

uint32_t crc32_of(const std::string& bytes) { return crc32_of(bytes.data(), bytes.size()); }

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  MEMTRAIN_CHECK(fd_ >= 0, Error, "[io] cannot write '", tmp_, "': ", std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_), ::unlink(tmp_.c_str());
}

void AtomicFile::write(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  for (size_t done = 0; done < n;) {
    auto w = ::write(fd_, p + done, std::min<size_t>(n - done, size_t{1} << 30));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0)
      throw Error(detail::concat("[io] writing '", tmp_, "' failed after ", written_ + done, " bytes: ",
                                 std::strerror(w < 0 ? errno : ENOSPC), "; '", path_, "' is untouched"));
    done += static_cast<size_t>(w);
  }
  written_ += n;
}

void AtomicFile::finish() {
  const bool synced = ::fsync(fd_) == 0;
  const int err = errno;
  const bool closed = ::close(fd_) == 0;
  fd_ = -1;
  if (!synced || !closed) {
    ::unlink(tmp_.c_str());
    throw Error(detail::concat("[io] flushing '", tmp_, "' failed: ", std::strerror(synced ? errno : err), "; '", path_,
                               "' is untouched"));
  }
  std::error_code ec;
  std::filesystem::rename(tmp_, path_, ec);
  if (ec) {
    ::unlink(tmp_.c_str());
    throw Error(detail::concat("[io] renaming '", tmp_, "' to '", path_, "' failed: ", ec.message()));
  }
  auto dir = std::filesystem::path(path_).parent_path();
  int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) ::fsync(dfd), ::close(dfd);  // the rename itself; best effort
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  AtomicFile f(path);
  f.write(bytes.data(), bytes.size());
  f.finish();
}

std::string read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MEMTRAIN_CHECK(in.good(), DataError, "[io] cannot open '", path, "'");
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  MEMTRAIN_CHECK(!ec, DataError, "[io] cannot read the size of '", path, "': ", ec.message());
  std::string bytes(size, '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(size));
  MEMTRAIN_CHECK(static_cast<uint64_t>(in.gcount()) == size, DataError, "[io] short read of '", path, "' (",
                 in.gcount(), " of ", size, " bytes)");
  return bytes;
}

}  // namespace memtrain
