// sdmha/io/detail/zip.hpp — the zip reader of the .npz and .keras readers, over libzip: an archive
// opened read-only, its members located by name or index and read whole.
//
// The sizes in a zip directory are untrusted: a member is read only after its sizes are checked
// against the archive (a stored member is exactly as large as its bytes in the archive, a deflated
// one at most kMaxDeflateRatio times as large), and its CRC is checked at the end. libzip's errors
// about the file system are IoError, the rest FormatError.
//
// Not thread-safe: a libzip archive may not be used from two threads at once.
#pragma once

#include <zip.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "sdmha/errors.hpp"
#include "sdmha/io/detail/bytes.hpp"

namespace sdmha::detail {

// libzip errors about the file system are I/O failures; the rest mean the archive is malformed.
inline bool is_zip_io_error(int code) {
  return code == ZIP_ER_OPEN || code == ZIP_ER_READ || code == ZIP_ER_SEEK || code == ZIP_ER_TELL ||
         code == ZIP_ER_NOENT || code == ZIP_ER_MEMORY;
}

template <typename... Parts>
[[noreturn]] void fail_zip(int code, const char* where, Parts&&... parts) {
  if (is_zip_io_error(code)) fail<IoError>(where, std::forward<Parts>(parts)...);
  fail<FormatError>(where, std::forward<Parts>(parts)...);
}

struct ZipArchiveCloser {
  // Read-only archives have nothing to write back, so discard rather than close.
  void operator()(zip_t* archive) const { zip_discard(archive); }
};

struct ZipMemberCloser {
  void operator()(zip_file_t* member) const { zip_fclose(member); }
};

class ZipArchive {
 public:
  // Opens `path`, a file of `size` bytes; `expected`, when not empty, ends the message of a
  // failure ("; expected " + expected).
  static ZipArchive open(const char* where, const std::string& path, std::uint64_t size,
                         const std::string& expected = std::string()) {
    int code = 0;
    zip_t* raw = zip_open(path.c_str(), ZIP_RDONLY, &code);
    if (raw == nullptr) {
      zip_error_t zip_error;
      zip_error_init_with_code(&zip_error, code);
      const std::string reason = zip_error_strerror(&zip_error);
      zip_error_fini(&zip_error);
      fail_zip(code, where, "cannot open '", path, "' as a zip archive: ", reason,
               expected.empty() ? std::string() : "; expected " + expected);
    }
    ZipArchive archive;
    archive.archive_.reset(raw);
    archive.path_ = path;
    archive.size_ = size;
    return archive;
  }

  const std::string& path() const { return path_; }

  zip_uint64_t member_count() const {
    const zip_int64_t entries = zip_get_num_entries(archive_.get(), 0);
    return entries < 0 ? 0 : zip_uint64_t(entries);
  }

  // The name of member `index`; FormatError if it has none.
  std::string member_name(const char* where, zip_uint64_t index) const {
    const char* name = zip_get_name(archive_.get(), index, 0);
    if (name == nullptr) {
      fail<FormatError>(where, "'", path_, "': member ", index,
                        " has no readable name: ", zip_strerror(archive_.get()));
    }
    return name;
  }

  // The index of the member called `name`, or nothing.
  std::optional<zip_uint64_t> locate(const char* name) const {
    const zip_int64_t index = zip_name_locate(archive_.get(), name, 0);
    if (index < 0) return std::nullopt;
    return zip_uint64_t(index);
  }

  // Member `index` (called `member` in messages), read whole.
  std::vector<std::uint8_t> read(const char* where, zip_uint64_t index,
                                 const std::string& member) const {
    zip_t* archive = archive_.get();
    zip_stat_t stat;
    zip_stat_init(&stat);
    if (zip_stat_index(archive, index, 0, &stat) != 0) {
      fail_zip(zip_error_code_zip(zip_get_error(archive)), where, "'", path_,
               "': cannot stat member '", member, "': ", zip_strerror(archive));
    }
    constexpr zip_uint64_t needed = ZIP_STAT_SIZE | ZIP_STAT_COMP_SIZE | ZIP_STAT_COMP_METHOD;
    if ((stat.valid & needed) != needed) {
      fail<FormatError>(where, "'", path_, "': member '", member,
                        "' does not record its sizes and compression method");
    }
    check_sizes(where, member, stat);

    std::vector<std::uint8_t> bytes(static_cast<std::size_t>(stat.size));
    std::unique_ptr<zip_file_t, ZipMemberCloser> file(zip_fopen_index(archive, index, 0));
    if (!file) {
      fail_zip(zip_error_code_zip(zip_get_error(archive)), where, "'", path_,
               "': cannot open member '", member, "': ", zip_strerror(archive));
    }
    std::size_t total = 0;
    while (total < bytes.size()) {
      const zip_int64_t got = zip_fread(file.get(), bytes.data() + total, bytes.size() - total);
      if (got < 0) fail_member_read(where, member, file.get());
      if (got == 0) {
        fail<FormatError>(where, "'", path_, "': member '", member, "' ends after ", total,
                          " bytes; expected ", bytes.size(), " (truncated)");
      }
      total += static_cast<std::size_t>(got);
    }
    // libzip checks the CRC when the member reports its end, so read once more to reach it.
    std::uint8_t extra = 0;
    const zip_int64_t got = zip_fread(file.get(), &extra, 1);
    if (got < 0) fail_member_read(where, member, file.get());
    if (got > 0) {
      fail<FormatError>(where, "'", path_, "': member '", member, "' is longer than its declared ",
                        bytes.size(), " bytes");
    }
    return bytes;
  }

 private:
  ZipArchive() = default;

  // A stored member is exactly as large as its bytes in the archive, and deflate cannot expand
  // data by more than kMaxDeflateRatio.
  void check_sizes(const char* where, const std::string& member, const zip_stat_t& stat) const {
    if (stat.comp_size > size_) {
      fail<FormatError>(where, "'", path_, "': member '", member, "' claims ", stat.comp_size,
                        " compressed bytes; expected at most the archive's ", size_);
    }
    if (stat.comp_method == ZIP_CM_STORE) {
      if (stat.size != stat.comp_size) {
        fail<FormatError>(where, "'", path_, "': stored member '", member, "' claims ", stat.size,
                          " bytes but occupies ", stat.comp_size, "; expected equal sizes");
      }
    } else if (stat.comp_method == ZIP_CM_DEFLATE) {
      if (stat.size > stat.comp_size * kMaxDeflateRatio + 1024) {
        fail<FormatError>(where, "'", path_, "': deflated member '", member, "' claims ", stat.size,
                          " bytes from ", stat.comp_size, " compressed; expected at most ",
                          kMaxDeflateRatio, " times as many");
      }
    } else {
      fail<FormatError>(where, "'", path_, "': member '", member, "' uses compression method ",
                        stat.comp_method, "; expected stored (0) or deflated (8)");
    }
    if (stat.size > std::numeric_limits<std::size_t>::max()) {
      fail<FormatError>(where, "'", path_, "': member '", member, "' is ", stat.size,
                        " bytes, more than this platform can address");
    }
  }

  [[noreturn]] void fail_member_read(const char* where, const std::string& member,
                                     zip_file_t* file) const {
    zip_error_t* error = zip_file_get_error(file);
    fail_zip(zip_error_code_zip(error), where, "'", path_, "': cannot read member '", member,
             "': ", zip_error_strerror(error));
  }

  std::unique_ptr<zip_t, ZipArchiveCloser> archive_;
  std::string path_;
  std::uint64_t size_ = 0;  // the archive's bytes, which bound every member's compressed size
};

}  // namespace sdmha::detail
