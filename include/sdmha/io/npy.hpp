// sdmha/io/npy.hpp — reads and writes NumPy .npy arrays and reads .npz archives of them.
//
// A .npy file is the magic "\x93NUMPY", a version byte pair, a little-endian header length
// (2 bytes in version 1.0, 4 in 2.0 and 3.0), a header that is a Python dict literal such as
//   {'descr': '<f8', 'fortran_order': False, 'shape': (3, 4), }
// padded with spaces and a newline, then the raw elements. A .npz file is a zip archive of .npy
// members, stored (numpy.savez) or deflated (numpy.savez_compressed).
//
// Files are untrusted input: the header is parsed strictly, the data must hold exactly the
// elements the shape declares, and no allocation is sized by a field the bytes do not back.
// Fortran-order arrays are accepted and transposed to C order on read.
#pragma once

#include <zip.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "sdmha/errors.hpp"
#include "sdmha/io/detail/bytes.hpp"
#include "sdmha/io/detail/elements.hpp"
#include "sdmha/io/detail/file.hpp"
#include "sdmha/io/detail/npy_header.hpp"
#include "sdmha/io/detail/shape_format.hpp"
#include "sdmha/io/detail/zip.hpp"
#include "sdmha/io/dtype.hpp"
// Not needed here; kept because npy.hpp has always made SafetensorsFile and its writer visible.
#include "sdmha/io/safetensors.hpp"

namespace sdmha {
namespace io {

// One array read from a .npy file or an .npz member.
struct NpyArray {
  DType dtype = DType::F64;
  std::vector<std::int64_t> shape;
  // The layout the file declared; `data` is in C order either way.
  bool fortran_order = false;
  // Little-endian elements in C (row-major) order.
  std::vector<std::uint8_t> data;
  // The file (and member) the array came from, for error messages.
  std::string source;

  // The product of the dimensions; 1 for a scalar (empty shape).
  std::int64_t element_count() const {
    std::int64_t count = 1;
    for (std::int64_t dimension : shape) count *= dimension;
    return count;
  }

  // The elements as T, with the conversions of SafetensorsFile::read.
  template <typename T>
  std::vector<T> as() const {
    // The members are public, so check that they still agree before decoding.
    const std::optional<std::int64_t> count = detail::checked_element_count(shape);
    const std::size_t item_size = dtype_size(dtype);
    if (!count || static_cast<std::uint64_t>(*count) != data.size() / item_size ||
        data.size() % item_size != 0) {
      detail::fail<FormatError>("NpyArray::as", source, ": array of shape ",
                                detail::format_shape(shape), " and dtype ", dtype_name(dtype),
                                " holds ", data.size(), " bytes; expected the element count times ",
                                item_size);
    }
    return detail::decode_elements<T>("NpyArray::as", source, "array", dtype, data.data(),
                                      static_cast<std::size_t>(*count));
  }
};

// Parses a whole .npy file held in memory; `source_name` names it in error messages.
inline NpyArray parse_npy(const std::uint8_t* bytes, std::size_t size,
                          const std::string& source_name) {
  constexpr const char* where = "parse_npy";
  if (size < 10) {
    detail::fail<FormatError>(where, source_name, ": file is ", size,
                              " bytes long; expected at least 10 (magic, version, header length)");
  }
  if (std::memcmp(bytes, "\x93NUMPY", 6) != 0) {
    detail::fail<FormatError>(where, source_name,
                              ": does not start with the .npy magic; expected \"\\x93NUMPY\"");
  }
  const int major = bytes[6], minor = bytes[7];
  if (major < 1 || major > 3 || minor != 0) {
    detail::fail<FormatError>(where, source_name, ": format version ", major, ".", minor,
                              " is not supported; expected 1.0, 2.0 or 3.0");
  }
  const std::size_t prefix = major == 1 ? 10 : 12;
  if (size < prefix) {
    detail::fail<FormatError>(where, source_name, ": file is ", size, " bytes long; expected at ",
                              "least ", prefix, " for a version ", major, ".0 header length");
  }
  const auto header_length =
      static_cast<std::size_t>(detail::read_little_endian(bytes + 8, prefix - 8));
  if (header_length > size - prefix) {
    detail::fail<FormatError>(where, source_name, ": header length is ", header_length,
                              " bytes but only ", size - prefix,
                              " bytes follow; expected a complete header");
  }
  const detail::NpyHeader header =
      detail::NpyHeaderParser(
          std::string(reinterpret_cast<const char*>(bytes) + prefix, header_length), source_name)
          .parse();

  const std::optional<std::int64_t> count = detail::checked_element_count(header.shape);
  const std::size_t item_size = dtype_size(header.dtype);
  if (!count ||
      static_cast<std::uint64_t>(*count) > std::numeric_limits<std::size_t>::max() / item_size) {
    detail::fail<FormatError>(where, source_name, ": shape ", detail::format_shape(header.shape),
                              " overflows the element count; expected a shape that fits in memory");
  }
  const std::size_t expected = static_cast<std::size_t>(*count) * item_size;
  const std::size_t available = size - prefix - header_length;
  if (available != expected) {
    detail::fail<FormatError>(where, source_name, ": data is ", available, " bytes",
                              available < expected ? " (truncated)" : " (trailing bytes)",
                              "; expected ", expected, " (", *count, " elements of ",
                              dtype_name(header.dtype), ", shape ",
                              detail::format_shape(header.shape), ")");
  }

  NpyArray array;
  array.dtype = header.dtype;
  array.shape = header.shape;
  array.fortran_order = header.fortran_order;
  array.source = source_name;
  const std::uint8_t* data = bytes + prefix + header_length;
  if (header.fortran_order && header.shape.size() > 1) {
    array.data =
        detail::fortran_to_c_order(data, header.shape, static_cast<std::size_t>(*count), item_size);
  } else {
    array.data.assign(data, data + expected);
  }
  return array;
}

// Reads a .npy file; IoError if it cannot be read, FormatError if it is malformed.
inline NpyArray read_npy(const std::string& path) {
  const std::vector<std::uint8_t> bytes = detail::read_file_bytes("read_npy", path);
  return parse_npy(bytes.data(), bytes.size(), path);
}

// Writes `bytes` of little-endian C-order elements as a version 1.0 .npy file (2.0 if the header
// outgrows 64 KiB), byte for byte what numpy.save writes, through a temporary file and a rename.
// ShapeError unless bytes equals the shape's element count times dtype_size(dtype); FormatError
// for BF16, which .npy cannot describe.
inline void write_npy(const std::string& path, DType dtype, const std::vector<std::int64_t>& shape,
                      const void* data, std::size_t bytes) {
  constexpr const char* where = "write_npy";
  const char* descr = detail::npy_descr(where, path, dtype);
  const std::string subject = "'" + path + "'";
  const std::size_t expected = detail::checked_byte_count(where, subject, shape, dtype);
  if (bytes != expected) {
    detail::fail<ShapeError>(where, subject, ": got ", bytes, " bytes for shape ",
                             detail::format_shape(shape), " of ", dtype_name(dtype), "; expected ",
                             expected);
  }
  if (data == nullptr && bytes > 0) {
    detail::fail<ShapeError>(where, subject, ": data is null; expected ", bytes, " bytes");
  }
  const std::vector<std::uint8_t> head = detail::encode_npy_header(descr, shape);
  detail::write_file_atomically(
      where, path, {{head.data(), head.size()}, {static_cast<const std::uint8_t*>(data), bytes}});
}

// Writes product(shape) elements of T (float → '<f4', double → '<f8', int64 → '<i8',
// int32 → '<i4', uint8 → '|u1', bool → '|b1') as a .npy file.
template <typename T>
void write_npy(const std::string& path, const std::vector<std::int64_t>& shape, const T* data) {
  static_assert(detail::IsIoElement<T>::value,
                "write_npy takes float, double, int64_t, int32_t, uint8_t or bool");
  static_assert(sizeof(T) == dtype_size(detail::IoElement<T>::dtype),
                "the element type's size must match its dtype's");
  const std::size_t bytes =
      detail::checked_byte_count("write_npy", "'" + path + "'", shape, detail::IoElement<T>::dtype);
  write_npy(path, detail::IoElement<T>::dtype, shape, data, bytes);
}

// A .npz archive (numpy.savez or numpy.savez_compressed) kept open for reading its members.
//
// Members are named without their ".npy" suffix; other members are not listed. Each read checks
// the member's sizes against the archive before allocating and its CRC after inflating. Reads of
// one NpzFile are serialized, since a libzip archive is not safe to use from two threads at once.
class NpzFile {
 public:
  static NpzFile open(const std::string& path) {
    constexpr const char* where = "NpzFile::open";
    std::error_code error;
    const std::uintmax_t size = std::filesystem::file_size(path, error);
    if (error) detail::fail<IoError>(where, "cannot open '", path, "': ", error.message());
    // libzip opens an empty file as an empty archive; numpy.savez never writes one.
    if (size == 0) {
      detail::fail<FormatError>(where, "'", path, "' is empty; expected a zip archive");
    }
    NpzFile file(detail::ZipArchive::open(where, path, size));
    for (zip_uint64_t index = 0; index < file.archive_.member_count(); ++index) {
      const std::string member = file.archive_.member_name(where, index);
      constexpr std::size_t suffix = 4;  // ".npy"
      if (member.size() < suffix || member.compare(member.size() - suffix, suffix, ".npy") != 0) {
        continue;
      }
      const std::string array = member.substr(0, member.size() - suffix);
      if (!file.members_.emplace(array, index).second) {
        detail::fail<FormatError>(where, "'", path, "': member '", member,
                                  "' appears twice; expected unique member names");
      }
    }
    return file;
  }

  // Array names (member names without ".npy"), sorted.
  std::vector<std::string> names() const {
    std::vector<std::string> result;
    result.reserve(members_.size());
    for (const auto& member : members_) result.push_back(member.first);
    return result;
  }

  bool contains(const std::string& name) const { return members_.count(name) != 0; }

  const std::string& source() const { return archive_.path(); }

  NpyArray read(const std::string& name) const {
    constexpr const char* where = "NpzFile::read";
    const auto it = members_.find(name);
    if (it == members_.end()) {
      std::string available;
      for (const auto& member : members_) {
        available += (available.empty() ? "'" : ", '") + member.first + "'";
      }
      detail::fail<FormatError>(
          where, "'", archive_.path(), "': no array named '", name, "' (member '", name,
          ".npy'); expected one of: ", available.empty() ? std::string("(none)") : available);
    }
    const std::string member = name + ".npy";
    std::vector<std::uint8_t> bytes;
    {
      std::lock_guard<std::mutex> lock(*mutex_);
      bytes = archive_.read(where, it->second, member);
    }
    return parse_npy(bytes.data(), bytes.size(), archive_.path() + "[" + member + "]");
  }

 private:
  explicit NpzFile(detail::ZipArchive archive)
      : archive_(std::move(archive)), mutex_(std::make_unique<std::mutex>()) {}

  detail::ZipArchive archive_;
  std::unique_ptr<std::mutex> mutex_;  // held while reading a member; see the class comment
  std::map<std::string, zip_uint64_t> members_;  // array name → member index
};

}  // namespace io
}  // namespace sdmha
