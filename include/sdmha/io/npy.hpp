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

#include <algorithm>
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

}  // namespace io

namespace detail {

struct NpyHeader {
  io::DType dtype = io::DType::F64;
  bool fortran_order = false;
  std::vector<std::int64_t> shape;
};

// The header dict of a .npy file, parsed as the subset of Python literal syntax that numpy writes:
// exactly the keys 'descr' (a string), 'fortran_order' (True or False) and 'shape' (a tuple of
// non-negative integers), in any order, each once, an optional trailing comma, and only
// whitespace after the closing brace. numpy's own reader evaluates the literal; no Debian C++
// library parses Python literals, hence this small parser.
class NpyHeaderParser {
 public:
  NpyHeaderParser(std::string text, std::string source)
      : text_(std::move(text)), source_(std::move(source)) {}

  NpyHeader parse() {
    NpyHeader header;
    bool have_descr = false, have_fortran_order = false, have_shape = false;
    skip_space();
    expect('{', "'{' opening the header dict");
    skip_space();
    while (peek() != '}') {
      const std::size_t key_position = position_;
      const std::string key = parse_string("a quoted key");
      skip_space();
      expect(':', "':' after key '" + key + "'");
      skip_space();
      bool* seen = nullptr;
      if (key == "descr") {
        seen = &have_descr;
        header.dtype = parse_descr();
      } else if (key == "fortran_order") {
        seen = &have_fortran_order;
        header.fortran_order = parse_bool();
      } else if (key == "shape") {
        seen = &have_shape;
        header.shape = parse_shape();
      } else {
        fail_at(key_position, "unknown key '" + key + "'",
                "only 'descr', 'fortran_order' and 'shape'");
      }
      if (*seen) fail_at(key_position, "key '" + key + "' appears twice", "each key once");
      *seen = true;
      skip_space();
      if (peek() == ',') {
        ++position_;
        skip_space();
      } else if (peek() != '}') {
        fail_at(position_, "found " + describe_next(),
                "',' or '}' after the value of '" + key + "'");
      }
    }
    ++position_;
    skip_space();
    if (position_ != text_.size()) {
      fail_at(position_, "found " + describe_next() + " after the dict",
              "only spaces and a newline");
    }
    if (!have_descr || !have_fortran_order || !have_shape) {
      fail_at(position_,
              std::string("the dict lacks ") + (!have_descr           ? "'descr'"
                                                : !have_fortran_order ? "'fortran_order'"
                                                                      : "'shape'"),
              "'descr', 'fortran_order' and 'shape'");
    }
    return header;
  }

 private:
  char peek() const { return position_ < text_.size() ? text_[position_] : '\0'; }

  void skip_space() {
    while (position_ < text_.size() && (text_[position_] == ' ' || text_[position_] == '\t' ||
                                        text_[position_] == '\n' || text_[position_] == '\r')) {
      ++position_;
    }
  }

  std::string describe_next() const {
    if (position_ >= text_.size()) return "the end of the header";
    const unsigned char next = static_cast<unsigned char>(text_[position_]);
    if (next >= 0x20 && next < 0x7f) return std::string("'") + static_cast<char>(next) + "'";
    static const char digits[] = "0123456789abcdef";
    return std::string("byte 0x") + digits[next >> 4] + digits[next & 0xf];
  }

  [[noreturn]] void fail_at(std::size_t position, const std::string& problem,
                            const std::string& expected) const {
    fail<FormatError>("parse_npy", source_, ": header at offset ", position, ": ", problem,
                      "; expected ", expected);
  }

  void expect(char wanted, const std::string& what) {
    if (peek() != wanted) fail_at(position_, "found " + describe_next(), what);
    ++position_;
  }

  std::string parse_string(const char* what) {
    const char quote = peek();
    if (quote != '\'' && quote != '"') fail_at(position_, "found " + describe_next(), what);
    const std::size_t start = ++position_;
    while (position_ < text_.size() && text_[position_] != quote) {
      // numpy never writes escapes or line breaks inside these strings.
      if (text_[position_] == '\\' || text_[position_] == '\n') {
        fail_at(position_, "found " + describe_next() + " inside a string", "a plain string");
      }
      ++position_;
    }
    if (position_ >= text_.size()) fail_at(start - 1, "unterminated string", "a closing quote");
    return text_.substr(start, position_++ - start);
  }

  io::DType parse_descr() {
    using io::DType;
    if (peek() == '[') {
      fail_at(position_, "a structured dtype (a list of fields)", "a plain descr such as '<f8'");
    }
    const std::size_t start = position_;
    const std::string descr = parse_string("a quoted descr");
    static const std::pair<const char*, DType> known[] = {
        {"<f2", DType::F16}, {"<f4", DType::F32}, {"<f8", DType::F64}, {"<i4", DType::I32},
        {"<i8", DType::I64}, {"|u1", DType::U8},  {"|b1", DType::BOOL}};
    for (const auto& [name, dtype] : known) {
      if (descr == name) return dtype;
    }
    if (!descr.empty() && descr[0] == '>') {
      fail_at(start, "descr '" + descr + "' is big-endian, which is not supported",
              "a little-endian descr (re-save with arr.astype(arr.dtype.newbyteorder('<')))");
    }
    fail_at(start, "descr '" + descr + "' is not supported",
            "one of '<f2', '<f4', '<f8', '<i4', '<i8', '|u1', '|b1'");
  }

  bool parse_bool() {
    if (text_.compare(position_, 4, "True") == 0) {
      position_ += 4;
      return true;
    }
    if (text_.compare(position_, 5, "False") == 0) {
      position_ += 5;
      return false;
    }
    fail_at(position_, "found " + describe_next(), "True or False for 'fortran_order'");
  }

  std::int64_t parse_dimension() {
    const std::size_t start = position_;
    if (peek() == '-') {
      fail_at(start, "a negative dimension", "dimensions >= 0");
    }
    if (peek() < '0' || peek() > '9') {
      fail_at(start, "found " + describe_next(), "a dimension (a non-negative integer)");
    }
    std::int64_t value = 0;
    while (peek() >= '0' && peek() <= '9') {
      const int digit = peek() - '0';
      if (value > (std::numeric_limits<std::int64_t>::max() - digit) / 10) {
        fail_at(start, "a dimension that overflows int64", "dimensions below 2^63");
      }
      value = value * 10 + digit;
      ++position_;
    }
    if (peek() == 'L') ++position_;  // Python 2's long suffix, found in old version 1.0 files
    return value;
  }

  std::vector<std::int64_t> parse_shape() {
    const std::size_t start = position_;
    expect('(', "a tuple '(...)' for 'shape'");
    std::vector<std::int64_t> shape;
    skip_space();
    bool trailing_comma = false;
    while (peek() != ')') {
      shape.push_back(parse_dimension());
      skip_space();
      trailing_comma = peek() == ',';
      if (trailing_comma) {
        ++position_;
        skip_space();
      } else if (peek() != ')') {
        fail_at(position_, "found " + describe_next(), "',' or ')' in 'shape'");
      }
    }
    ++position_;
    if (shape.size() == 1 && !trailing_comma) {
      fail_at(start, "'shape' is a parenthesized integer, not a tuple", "a tuple such as (3,)");
    }
    return shape;
  }

  std::string text_;
  std::string source_;
  std::size_t position_ = 0;
};

// Reorders Fortran-order (first axis fastest) elements into C order (last axis fastest).
inline std::vector<std::uint8_t> fortran_to_c_order(const std::uint8_t* source,
                                                    const std::vector<std::int64_t>& shape,
                                                    std::size_t count, std::size_t item_size) {
  std::vector<std::uint8_t> result(count * item_size);
  if (count == 0) return result;
  const std::size_t rank = shape.size();
  std::vector<std::size_t> stride(rank), index(rank, 0);  // strides in elements, Fortran order
  std::size_t next_stride = 1;
  for (std::size_t axis = 0; axis < rank; ++axis) {
    stride[axis] = next_stride;
    next_stride *= static_cast<std::size_t>(shape[axis]);
  }
  std::size_t offset = 0;  // Fortran-order position of the C-order element `element`
  for (std::size_t element = 0; element < count; ++element) {
    std::memcpy(result.data() + element * item_size, source + offset * item_size, item_size);
    for (std::size_t axis = rank; axis-- > 0;) {
      offset += stride[axis];
      if (++index[axis] < static_cast<std::size_t>(shape[axis])) break;
      offset -= stride[axis] * index[axis];
      index[axis] = 0;
    }
  }
  return result;
}

inline const char* npy_descr(const char* where, const std::string& path, io::DType dtype) {
  switch (dtype) {
    case io::DType::F16:
      return "<f2";
    case io::DType::F32:
      return "<f4";
    case io::DType::F64:
      return "<f8";
    case io::DType::I32:
      return "<i4";
    case io::DType::I64:
      return "<i8";
    case io::DType::U8:
      return "|u1";
    case io::DType::BOOL:
      return "|b1";
    case io::DType::BF16:
      break;
  }
  fail<FormatError>(where, "'", path, "': dtype ", io::dtype_name(dtype),
                    " has no .npy descr; expected F16, F32, F64, I32, I64, U8 or BOOL");
}

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

}  // namespace detail

namespace io {

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
  std::size_t header_length = 0;
  for (std::size_t i = prefix; i-- > 8;) header_length = (header_length << 8) | bytes[i];
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

  std::string shape_text = "(";
  for (std::size_t axis = 0; axis < shape.size(); ++axis) {
    shape_text += (axis > 0 ? ", " : "") + std::to_string(shape[axis]);
  }
  shape_text += shape.size() == 1 ? ",)" : ")";
  std::string header = std::string("{'descr': '") + descr +
                       "', 'fortran_order': False, 'shape': " + shape_text + ", }";
  // numpy leaves room for the first dimension to grow to 21 digits, so that appending rows can
  // rewrite the header in place; matching it keeps the files identical to numpy.save's.
  constexpr std::size_t growth_digits = 21;
  if (!shape.empty()) {
    header.append(growth_digits - std::min(growth_digits, std::to_string(shape[0]).size()), ' ');
  }
  // The data starts at a multiple of 64 bytes; numpy pads a full 64 when already aligned.
  const auto padded = [&](std::size_t prefix) {
    return header + std::string(64 - (prefix + header.size() + 1) % 64, ' ') + "\n";
  };
  std::vector<std::uint8_t> head = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  std::string text = padded(10);
  if (text.size() <= 0xffff) {
    head.insert(head.end(), {1, 0});
    for (int i = 0; i < 2; ++i) head.push_back(static_cast<std::uint8_t>(text.size() >> (8 * i)));
  } else {
    text = padded(12);
    head.insert(head.end(), {2, 0});
    for (int i = 0; i < 4; ++i) head.push_back(static_cast<std::uint8_t>(text.size() >> (8 * i)));
  }
  head.insert(head.end(), text.begin(), text.end());
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
    int code = 0;
    zip_t* raw = zip_open(path.c_str(), ZIP_RDONLY, &code);
    if (raw == nullptr) {
      zip_error_t zip_error;
      zip_error_init_with_code(&zip_error, code);
      const std::string reason = zip_error_strerror(&zip_error);
      zip_error_fini(&zip_error);
      detail::fail_zip(code, where, "cannot open '", path, "' as a zip archive: ", reason);
    }
    NpzFile file;
    file.archive_.reset(raw);
    file.path_ = path;
    file.archive_size_ = size;
    const zip_int64_t entries = zip_get_num_entries(raw, 0);
    for (zip_int64_t index = 0; index < entries; ++index) {
      const char* name = zip_get_name(raw, static_cast<zip_uint64_t>(index), 0);
      if (name == nullptr) {
        detail::fail<FormatError>(where, "'", path, "': member ", index,
                                  " has no readable name: ", zip_strerror(raw));
      }
      const std::string member = name;
      constexpr std::size_t suffix = 4;  // ".npy"
      if (member.size() < suffix || member.compare(member.size() - suffix, suffix, ".npy") != 0) {
        continue;
      }
      const std::string array = member.substr(0, member.size() - suffix);
      if (!file.members_.emplace(array, static_cast<zip_uint64_t>(index)).second) {
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

  const std::string& source() const { return path_; }

  NpyArray read(const std::string& name) const {
    constexpr const char* where = "NpzFile::read";
    const auto it = members_.find(name);
    if (it == members_.end()) {
      std::string available;
      for (const auto& member : members_) {
        available += (available.empty() ? "'" : ", '") + member.first + "'";
      }
      detail::fail<FormatError>(
          where, "'", path_, "': no array named '", name, "' (member '", name,
          ".npy'); expected one of: ", available.empty() ? std::string("(none)") : available);
    }
    const std::string member = name + ".npy";
    const zip_uint64_t index = it->second;
    std::lock_guard<std::mutex> lock(*mutex_);
    zip_t* archive = archive_.get();

    zip_stat_t stat;
    zip_stat_init(&stat);
    if (zip_stat_index(archive, index, 0, &stat) != 0) {
      detail::fail_zip(zip_error_code_zip(zip_get_error(archive)), where, "'", path_,
                       "': cannot stat member '", member, "': ", zip_strerror(archive));
    }
    constexpr zip_uint64_t needed = ZIP_STAT_SIZE | ZIP_STAT_COMP_SIZE | ZIP_STAT_COMP_METHOD;
    if ((stat.valid & needed) != needed) {
      detail::fail<FormatError>(where, "'", path_, "': member '", member,
                                "' does not record its sizes and compression method");
    }
    check_sizes(member, stat);

    std::vector<std::uint8_t> bytes(static_cast<std::size_t>(stat.size));
    std::unique_ptr<zip_file_t, detail::ZipMemberCloser> file(zip_fopen_index(archive, index, 0));
    if (!file) {
      detail::fail_zip(zip_error_code_zip(zip_get_error(archive)), where, "'", path_,
                       "': cannot open member '", member, "': ", zip_strerror(archive));
    }
    std::size_t total = 0;
    while (total < bytes.size()) {
      const zip_int64_t got = zip_fread(file.get(), bytes.data() + total, bytes.size() - total);
      if (got < 0) fail_member_read(where, member, file.get());
      if (got == 0) {
        detail::fail<FormatError>(where, "'", path_, "': member '", member, "' ends after ", total,
                                  " bytes; expected ", bytes.size(), " (truncated)");
      }
      total += static_cast<std::size_t>(got);
    }
    // libzip checks the CRC when the member reports its end, so read once more to reach it.
    std::uint8_t extra = 0;
    const zip_int64_t got = zip_fread(file.get(), &extra, 1);
    if (got < 0) fail_member_read(where, member, file.get());
    if (got > 0) {
      detail::fail<FormatError>(where, "'", path_, "': member '", member,
                                "' is longer than its declared ", bytes.size(), " bytes");
    }
    return parse_npy(bytes.data(), bytes.size(), path_ + "[" + member + "]");
  }

 private:
  NpzFile() : mutex_(std::make_unique<std::mutex>()) {}

  // The sizes in the zip directory are untrusted: a stored member is exactly as large as its
  // bytes in the archive, and deflate cannot expand data by more than 1032:1.
  void check_sizes(const std::string& member, const zip_stat_t& stat) const {
    constexpr const char* where = "NpzFile::read";
    if (stat.comp_size > archive_size_) {
      detail::fail<FormatError>(
          where, "'", path_, "': member '", member, "' claims ", stat.comp_size,
          " compressed bytes; expected at most the archive's ", archive_size_);
    }
    constexpr zip_uint64_t max_deflate_ratio = 1032;
    if (stat.comp_method == ZIP_CM_STORE) {
      if (stat.size != stat.comp_size) {
        detail::fail<FormatError>(where, "'", path_, "': stored member '", member, "' claims ",
                                  stat.size, " bytes but occupies ", stat.comp_size,
                                  "; expected equal sizes");
      }
    } else if (stat.comp_method == ZIP_CM_DEFLATE) {
      if (stat.size > stat.comp_size * max_deflate_ratio + 1024) {
        detail::fail<FormatError>(where, "'", path_, "': deflated member '", member, "' claims ",
                                  stat.size, " bytes from ", stat.comp_size,
                                  " compressed; expected at most 1032 times as many");
      }
    } else {
      detail::fail<FormatError>(where, "'", path_, "': member '", member,
                                "' uses compression method ", stat.comp_method,
                                "; expected stored (0) or deflated (8)");
    }
    if (stat.size > std::numeric_limits<std::size_t>::max()) {
      detail::fail<FormatError>(where, "'", path_, "': member '", member, "' is ", stat.size,
                                " bytes, more than this platform can address");
    }
  }

  [[noreturn]] void fail_member_read(const char* where, const std::string& member,
                                     zip_file_t* file) const {
    zip_error_t* error = zip_file_get_error(file);
    detail::fail_zip(zip_error_code_zip(error), where, "'", path_, "': cannot read member '",
                     member, "': ", zip_error_strerror(error));
  }

  std::unique_ptr<zip_t, detail::ZipArchiveCloser> archive_;
  std::unique_ptr<std::mutex> mutex_;  // held by read(); see the class comment
  std::string path_;
  std::uintmax_t archive_size_ = 0;
  std::map<std::string, zip_uint64_t> members_;  // array name → member index
};

}  // namespace io
}  // namespace sdmha
