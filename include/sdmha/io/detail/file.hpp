// sdmha/io/detail/file.hpp — whole files in and out: a regular file read into memory (IoError
// saying why it could not be), and a write through a temporary and a rename, so that a reader
// sees either the old file or the complete new one.
#pragma once

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include "sdmha/errors.hpp"

namespace sdmha::detail {

inline std::string system_reason(int error_number) {
  return std::error_code(error_number, std::generic_category()).message();
}

// The size of the regular file `path`; IoError if it has none (missing, a directory, ...).
inline std::uintmax_t regular_file_size(const char* where, const std::string& path) {
  std::error_code error;
  const auto status = std::filesystem::status(path, error);
  if (error) fail<IoError>(where, "cannot open '", path, "': ", error.message());
  if (!std::filesystem::is_regular_file(status)) {
    fail<IoError>(where, "cannot read '", path, "': not a regular file");
  }
  const std::uintmax_t size = std::filesystem::file_size(path, error);
  if (error) fail<IoError>(where, "cannot read the size of '", path, "': ", error.message());
  return size;
}

// Checks that `path` is a regular file this process can open for reading; returns its size.
inline std::uint64_t readable_file_size(const char* where, const std::string& path) {
  const std::uintmax_t size = regular_file_size(where, path);
  std::ifstream stream(path, std::ios::binary);
  if (!stream) fail<IoError>(where, "cannot open '", path, "' for reading");
  return static_cast<std::uint64_t>(size);
}

// Reads a whole regular file; IoError says why it could not.
inline std::vector<std::uint8_t> read_file_bytes(const char* where, const std::string& path) {
  const std::uintmax_t size = regular_file_size(where, path);
  if (size > std::numeric_limits<std::size_t>::max()) {
    fail<IoError>(where, "'", path, "' is ", size, " bytes, more than this platform can address");
  }
  errno = 0;
  std::ifstream stream(path, std::ios::binary);
  if (!stream) fail<IoError>(where, "cannot open '", path, "': ", system_reason(errno));
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(size));
  stream.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (static_cast<std::uintmax_t>(stream.gcount()) != size) {
    fail<IoError>(where, "cannot read '", path, "': got ", stream.gcount(), " of its ", size,
                  " bytes");
  }
  return bytes;
}

struct ByteSpan {
  const std::uint8_t* data;
  std::size_t size;
};

// Writes the concatenated chunks to `path` through a temporary file in the same directory and a
// rename, so that a reader sees either the old file or the complete new one, never a partial
// write. On any failure the temporary is removed and IoError is thrown.
inline void write_file_atomically(const char* where, const std::string& path,
                                  std::initializer_list<ByteSpan> chunks) {
  static std::atomic<std::uint64_t> counter{0};
  const std::uint64_t seed =
      static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
      (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ counter.fetch_add(1);
  std::string temporary;
  std::FILE* file = nullptr;
  int open_error = 0;
  // "x" makes fopen fail rather than truncate if the name is taken; a few seeds make a
  // collision with another writer's temporary practically impossible.
  for (std::uint64_t attempt = 0; attempt < 8 && file == nullptr; ++attempt) {
    std::mt19937_64 generator(seed + attempt);
    temporary = path + ".tmp-" + std::to_string(generator() % 1000000000000ull);
    errno = 0;
    file = std::fopen(temporary.c_str(), "wbx");
    open_error = errno;
    if (file == nullptr && open_error != EEXIST) break;
  }
  if (file == nullptr) {
    fail<IoError>(where, "cannot create a temporary file next to '", path, "' ('", temporary,
                  "'): ", system_reason(open_error));
  }
  const auto discard = [&](const std::string& reason) {
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
    fail<IoError>(where, "cannot write '", path, "': ", reason);
  };
  errno = 0;
  bool written = true;
  for (const ByteSpan& chunk : chunks) {
    if (chunk.size > 0 && std::fwrite(chunk.data, 1, chunk.size, file) != chunk.size) {
      written = false;
      break;
    }
  }
  int write_error = errno;
  bool flushed = written && std::fflush(file) == 0;
  if (written && !flushed) write_error = errno;
#if defined(__unix__) || defined(__APPLE__)
  // Without fsync the rename can reach the disk before the data does, and a crash would leave an
  // empty file under the final name.
  if (flushed && ::fsync(::fileno(file)) != 0) {
    flushed = false;
    write_error = errno;
  }
#endif
  if (std::fclose(file) != 0 && flushed) {
    flushed = false;
    write_error = errno;
  }
  if (!written || !flushed) discard(system_reason(write_error));
  std::error_code rename_error;
  std::filesystem::rename(temporary, path, rename_error);
  if (rename_error) {
    discard("cannot rename the temporary file '" + temporary +
            "' to it: " + rename_error.message());
  }
}

}  // namespace sdmha::detail
