// sdmha/io/safetensors.hpp — reads and writes safetensors files: named, typed, shaped tensors.
//
// Layout: an 8-byte little-endian header length N, N bytes of JSON (tensor name → {"dtype",
// "shape", "data_offsets": [begin, end)}, plus an optional "__metadata__" of string → string),
// then the data buffer that the offsets index. Files are untrusted input: the header is checked
// in full when the file is opened, so that every later read stays inside the bytes the file holds.
//
// Also home to what the .npy reader shares with this one: DType, the element conversions and the
// atomic file write.
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include "sdmha/errors.hpp"

// Both formats store little-endian data, which the readers copy out and the zero-copy view hands
// out as is; supporting big-endian hosts would mean a byte swap on every path.
#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__) && \
    __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "sdmha/io: safetensors and .npy data are little-endian; big-endian hosts are not supported"
#endif

namespace sdmha {
namespace io {

// The element types sdmha reads and writes; the names are safetensors' own.
enum class DType { F16, BF16, F32, F64, I32, I64, U8, BOOL };

constexpr const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F16:
      return "F16";
    case DType::BF16:
      return "BF16";
    case DType::F32:
      return "F32";
    case DType::F64:
      return "F64";
    case DType::I32:
      return "I32";
    case DType::I64:
      return "I64";
    case DType::U8:
      return "U8";
    case DType::BOOL:
      return "BOOL";
  }
  return "<invalid DType>";
}

// Bytes per element.
constexpr std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F16:
    case DType::BF16:
      return 2;
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::U8:
    case DType::BOOL:
      return 1;
  }
  return 0;
}

// One tensor of a safetensors header. begin and end are byte offsets into the data buffer (the
// bytes after the header), end exclusive.
struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  std::size_t begin = 0, end = 0;

  // The product of the dimensions; 1 for a scalar (empty shape).
  std::int64_t element_count() const {
    std::int64_t count = 1;
    for (std::int64_t dimension : shape) count *= dimension;
    return count;
  }
};

}  // namespace io

namespace detail {

// What the typed reads and writes know about each C++ element type: the dtype it is stored as,
// its name in messages, and the stored dtypes it may be read from.
template <typename T>
struct IoElement;
template <>
struct IoElement<float> {
  static constexpr io::DType dtype = io::DType::F32;
  static constexpr const char* name = "float";
  static constexpr const char* readable_from = "F16, BF16, F32 or F64";
};
template <>
struct IoElement<double> {
  static constexpr io::DType dtype = io::DType::F64;
  static constexpr const char* name = "double";
  static constexpr const char* readable_from = "F16, BF16, F32 or F64";
};
template <>
struct IoElement<std::int64_t> {
  static constexpr io::DType dtype = io::DType::I64;
  static constexpr const char* name = "int64";
  static constexpr const char* readable_from = "I32, I64, U8 or BOOL";
};
template <>
struct IoElement<std::int32_t> {
  static constexpr io::DType dtype = io::DType::I32;
  static constexpr const char* name = "int32";
  static constexpr const char* readable_from = "I32";
};
template <>
struct IoElement<std::uint8_t> {
  static constexpr io::DType dtype = io::DType::U8;
  static constexpr const char* name = "uint8";
  static constexpr const char* readable_from = "U8 or BOOL";
};
template <>
struct IoElement<bool> {
  static constexpr io::DType dtype = io::DType::BOOL;
  static constexpr const char* name = "bool";
  static constexpr const char* readable_from = "U8 or BOOL";
};

template <typename T, typename = void>
struct IsIoElement : std::false_type {};
template <typename T>
struct IsIoElement<T, std::void_t<decltype(IoElement<T>::dtype)>> : std::true_type {};

inline std::optional<io::DType> dtype_from_name(const std::string& name) {
  using io::DType;
  for (DType dtype : {DType::F16, DType::BF16, DType::F32, DType::F64, DType::I32, DType::I64,
                      DType::U8, DType::BOOL}) {
    if (name == io::dtype_name(dtype)) return dtype;
  }
  return std::nullopt;
}

inline std::string format_shape(const std::vector<std::int64_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

// The element count of a shape, or nothing if a dimension is negative or the product does not
// fit in int64 (a crafted header can claim [2^40, 2^40]).
inline std::optional<std::int64_t> checked_element_count(const std::vector<std::int64_t>& shape) {
  std::int64_t count = 1;
  for (std::int64_t dimension : shape) {
    if (dimension < 0) return std::nullopt;
    if (dimension != 0 && count > std::numeric_limits<std::int64_t>::max() / dimension) {
      return std::nullopt;
    }
    count *= dimension;
  }
  return count;
}

// The byte count of a caller-supplied shape, for the writers: ShapeError on a negative dimension
// or an overflow, so that nothing is allocated or copied from a nonsensical size.
inline std::size_t checked_byte_count(const char* where, const std::string& subject,
                                      const std::vector<std::int64_t>& shape, io::DType dtype) {
  for (std::size_t axis = 0; axis < shape.size(); ++axis) {
    if (shape[axis] < 0) {
      fail<ShapeError>(where, subject, ": shape ", format_shape(shape), " has dimension ", axis,
                       " = ", shape[axis], "; expected a dimension >= 0");
    }
  }
  const std::optional<std::int64_t> count = checked_element_count(shape);
  const std::size_t element_size = io::dtype_size(dtype);
  if (!count ||
      static_cast<std::uint64_t>(*count) > std::numeric_limits<std::size_t>::max() / element_size) {
    fail<ShapeError>(where, subject, ": shape ", format_shape(shape), " of ", io::dtype_name(dtype),
                     " overflows the addressable byte count");
  }
  return static_cast<std::size_t>(*count) * element_size;
}

template <typename U>
U load_unaligned(const std::uint8_t* bytes) {
  U value;
  std::memcpy(&value, bytes, sizeof(U));
  return value;
}

// IEEE binary16 → binary32 is exact: every half value, subnormals included, is a float.
inline float half_to_float(std::uint16_t half) {
  const std::uint32_t sign = static_cast<std::uint32_t>(half & 0x8000u) << 16;
  std::uint32_t exponent = (half >> 10) & 0x1fu;
  std::uint32_t mantissa = half & 0x3ffu;
  std::uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, or nan with its payload kept
  } else if (exponent != 0) {
    bits = sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;  // ±0
  } else {
    // A half subnormal is mantissa · 2^-24, a normal float: shift the leading 1 into the
    // implicit position, lowering the exponent once per shift.
    exponent = 127 - 15 + 1;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// bfloat16 is the high half of a binary32, so widening is a shift.
inline float bfloat16_to_float(std::uint16_t bfloat) {
  const std::uint32_t bits = static_cast<std::uint32_t>(bfloat) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// double → float with IEEE round-to-nearest semantics, overflow included: a plain cast of a finite
// double beyond the float range is undefined behaviour in C++.
inline float narrow_to_float(double value) {
  constexpr double float_max = std::numeric_limits<float>::max();
  // Halfway between FLT_MAX and 2^128; ties go to the even neighbour, 2^128, i.e. infinity.
  constexpr double overflow_threshold = float_max + 0x1p103;
  if (std::isfinite(value) && std::fabs(value) > float_max) {
    const float magnitude = std::fabs(value) >= overflow_threshold
                                ? std::numeric_limits<float>::infinity()
                                : std::numeric_limits<float>::max();
    return std::signbit(value) ? -magnitude : magnitude;
  }
  return static_cast<float>(value);
}

[[noreturn]] inline void reject_conversion(const char* where, const std::string& source,
                                           const std::string& subject, io::DType dtype,
                                           const char* requested, const char* readable_from) {
  fail<FormatError>(where, source, ": ", subject, " has dtype ", io::dtype_name(dtype),
                    ", which cannot be read as ", requested, "; expected dtype ", readable_from);
}

// Booleans are stored one byte each and must be 0 or 1: any other byte read into a bool is
// undefined behaviour, and in a mask it means the file is not what it claims.
inline void check_bool_bytes(const char* where, const std::string& source,
                             const std::string& subject, io::DType dtype, const std::uint8_t* bytes,
                             std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    if (bytes[i] > 1) {
      fail<FormatError>(where, source, ": ", subject, " (dtype ", io::dtype_name(dtype),
                        ") holds byte ", static_cast<int>(bytes[i]), " at element ", i,
                        "; expected 0 or 1 for a boolean");
    }
  }
}

// The floating-point reads: F16, BF16, F32 and F64 into float or double (F64 into float through
// narrow_to_float). False, with `out` untouched, for any other dtype.
template <typename T>
bool decode_floating(io::DType dtype, const std::uint8_t* bytes, std::size_t count,
                     std::vector<T>& out) {
  using io::DType;
  switch (dtype) {
    case DType::F16:
      out.resize(count);
      for (std::size_t i = 0; i < count; ++i)
        out[i] = static_cast<T>(half_to_float(load_unaligned<std::uint16_t>(bytes + 2 * i)));
      return true;
    case DType::BF16:
      out.resize(count);
      for (std::size_t i = 0; i < count; ++i)
        out[i] = static_cast<T>(bfloat16_to_float(load_unaligned<std::uint16_t>(bytes + 2 * i)));
      return true;
    case DType::F32:
      out.resize(count);
      if constexpr (std::is_same_v<T, float>) {
        if (count > 0) std::memcpy(out.data(), bytes, count * sizeof(T));
      } else {
        for (std::size_t i = 0; i < count; ++i) out[i] = load_unaligned<float>(bytes + 4 * i);
      }
      return true;
    case DType::F64:
      out.resize(count);
      if constexpr (std::is_same_v<T, double>) {
        if (count > 0) std::memcpy(out.data(), bytes, count * sizeof(T));
      } else {
        for (std::size_t i = 0; i < count; ++i)
          out[i] = narrow_to_float(load_unaligned<double>(bytes + 8 * i));
      }
      return true;
    default:
      return false;
  }
}

// Decodes `count` little-endian elements of `dtype` starting at `bytes` (any alignment) into T,
// widening or narrowing only along the conversions the typed reads allow.
template <typename T>
std::vector<T> decode_elements(const char* where, const std::string& source,
                               const std::string& subject, io::DType dtype,
                               const std::uint8_t* bytes, std::size_t count) {
  static_assert(IsIoElement<T>::value,
                "sdmha::io reads float, double, int64_t, int32_t, uint8_t or bool");
  using io::DType;
  std::vector<T> out;
  const auto copy_same = [&] {
    if constexpr (!std::is_same_v<T, bool>) {  // std::vector<bool> has no contiguous storage
      out.resize(count);
      if (count > 0) std::memcpy(out.data(), bytes, count * sizeof(T));
    }
  };
  if constexpr (std::is_floating_point_v<T>) {
    if (decode_floating(dtype, bytes, count, out)) return out;
  } else if constexpr (std::is_same_v<T, std::int64_t>) {
    switch (dtype) {
      case DType::I64:
        copy_same();
        return out;
      case DType::I32:
        out.resize(count);
        for (std::size_t i = 0; i < count; ++i) {
          out[i] = load_unaligned<std::int32_t>(bytes + 4 * i);
        }
        return out;
      case DType::BOOL:
        check_bool_bytes(where, source, subject, dtype, bytes, count);
        [[fallthrough]];
      case DType::U8:
        out.assign(bytes, bytes + count);
        return out;
      default:
        break;
    }
  } else if constexpr (std::is_same_v<T, std::int32_t>) {
    if (dtype == DType::I32) {
      copy_same();
      return out;
    }
  } else if constexpr (std::is_same_v<T, std::uint8_t>) {
    if (dtype == DType::BOOL) check_bool_bytes(where, source, subject, dtype, bytes, count);
    if (dtype == DType::U8 || dtype == DType::BOOL) {
      copy_same();
      return out;
    }
  } else {
    if (dtype == DType::U8 || dtype == DType::BOOL) {
      check_bool_bytes(where, source, subject, dtype, bytes, count);
      out.resize(count);
      for (std::size_t i = 0; i < count; ++i) out[i] = bytes[i] != 0;
      return out;
    }
  }
  reject_conversion(where, source, subject, dtype, IoElement<T>::name, IoElement<T>::readable_from);
}

inline std::string system_reason(int error_number) {
  return std::error_code(error_number, std::generic_category()).message();
}

// Reads a whole regular file; IoError says why it could not.
inline std::vector<std::uint8_t> read_file_bytes(const char* where, const std::string& path) {
  std::error_code error;
  const auto status = std::filesystem::status(path, error);
  if (error) fail<IoError>(where, "cannot open '", path, "': ", error.message());
  if (!std::filesystem::is_regular_file(status)) {
    fail<IoError>(where, "cannot read '", path, "': not a regular file");
  }
  const std::uintmax_t size = std::filesystem::file_size(path, error);
  if (error) fail<IoError>(where, "cannot read the size of '", path, "': ", error.message());
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

}  // namespace detail

namespace io {

// A safetensors file held in memory, its header validated on open.
//
// Every tensor's byte range lies inside the data buffer, matches its shape and dtype exactly and
// overlaps no other tensor and the tensors cover the data buffer without holes. Reads copy into a
// std::vector and work at any alignment; data_if_aligned gives a zero-copy view when the bytes
// allow one.
class SafetensorsFile {
 public:
  // The limit the reference implementation puts on the header; a larger one is not a model file.
  static constexpr std::uint64_t max_header_bytes = 100'000'000;

  // Reads the whole file into memory; IoError if it cannot, FormatError if it is malformed.
  static SafetensorsFile open(const std::string& path) {
    return parse("SafetensorsFile::open", detail::read_file_bytes("SafetensorsFile::open", path),
                 path);
  }

  // Parses bytes already in memory; `source_name` stands for the file in error messages.
  static SafetensorsFile from_bytes(std::vector<std::uint8_t> bytes,
                                    std::string source_name = "<buffer>") {
    return parse("SafetensorsFile::from_bytes", std::move(bytes), std::move(source_name));
  }

  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }

  const TensorInfo& info(const std::string& name) const {
    return find("SafetensorsFile::info", name);
  }

  // Tensor names in sorted order.
  std::vector<std::string> names() const {
    std::vector<std::string> result;
    result.reserve(tensors_.size());
    for (const auto& entry : tensors_) result.push_back(entry.first);
    return result;
  }

  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  std::optional<std::string> metadata_value(const std::string& key) const {
    const auto it = metadata_.find(key);
    if (it == metadata_.end()) return std::nullopt;
    return it->second;
  }

  // The path, or the source name given to from_bytes.
  const std::string& source() const { return source_; }

  // Copies a tensor out as T: float and double from F16, BF16, F32, F64 (halves widen exactly,
  // F64 → float rounds to nearest); int64 from I32, I64, U8, BOOL; int32 from I32; uint8 and bool
  // from U8 and BOOL (whose bytes must be 0 or 1 for bool). FormatError otherwise.
  template <typename T>
  std::vector<T> read(const std::string& name) const {
    const TensorInfo& tensor = find("SafetensorsFile::read", name);
    return detail::decode_elements<T>("SafetensorsFile::read", source_, "tensor '" + name + "'",
                                      tensor.dtype, tensor_bytes(tensor),
                                      static_cast<std::size_t>(tensor.element_count()));
  }

  // ShapeError unless the tensor has exactly this shape.
  void expect_shape(const std::string& name, const std::vector<std::int64_t>& shape) const {
    const TensorInfo& tensor = find("SafetensorsFile::expect_shape", name);
    if (tensor.shape != shape) {
      detail::fail<ShapeError>("SafetensorsFile::expect_shape", source_, ": tensor '", name,
                               "' has shape ", detail::format_shape(tensor.shape), "; expected ",
                               detail::format_shape(shape));
    }
  }

  // ShapeError unless the tensor has this many dimensions.
  void expect_rank(const std::string& name, std::size_t rank) const {
    const TensorInfo& tensor = find("SafetensorsFile::expect_rank", name);
    if (tensor.shape.size() != rank) {
      detail::fail<ShapeError>("SafetensorsFile::expect_rank", source_, ": tensor '", name,
                               "' has rank ", tensor.shape.size(), " (shape ",
                               detail::format_shape(tensor.shape), "); expected rank ", rank);
    }
  }

  // A view of the tensor's bytes as T when its dtype is exactly T's and the address is aligned for
  // T, else nullptr (fall back to read). Valid while this object lives. Not offered for bool: a
  // BOOL byte other than 0 or 1 read through a bool is undefined; read<bool> checks every byte.
  template <typename T>
  const T* data_if_aligned(const std::string& name) const {
    static_assert(detail::IsIoElement<T>::value && !std::is_same_v<T, bool>,
                  "data_if_aligned serves float, double, int64_t, int32_t and uint8_t; "
                  "read<bool> validates BOOL bytes instead");
    const TensorInfo& tensor = find("SafetensorsFile::data_if_aligned", name);
    if (tensor.dtype != detail::IoElement<T>::dtype) return nullptr;
    const std::uint8_t* bytes = tensor_bytes(tensor);
    if (reinterpret_cast<std::uintptr_t>(bytes) % alignof(T) != 0) return nullptr;
    return reinterpret_cast<const T*>(bytes);
  }

 private:
  using json = nlohmann::json;

  SafetensorsFile() = default;

  static SafetensorsFile parse(const char* where, std::vector<std::uint8_t> bytes,
                               std::string source) {
    SafetensorsFile file;
    file.bytes_ = std::move(bytes);
    file.source_ = std::move(source);
    file.parse_header(where);
    return file;
  }

  const TensorInfo& find(const char* where, const std::string& name) const {
    const auto it = tensors_.find(name);
    if (it == tensors_.end()) {
      std::string available;
      std::size_t listed = 0;
      for (const auto& entry : tensors_) {
        if (listed == 12) {
          available += ", ...";
          break;
        }
        available += (listed++ == 0 ? "'" : ", '") + entry.first + "'";
      }
      detail::fail<FormatError>(
          where, source_, ": no tensor named '", name, "'; expected one of ", tensors_.size(),
          " tensors: ", available.empty() ? std::string("(none)") : available);
    }
    return it->second;
  }

  const std::uint8_t* tensor_bytes(const TensorInfo& tensor) const {
    return bytes_.data() + data_start_ + tensor.begin;
  }

  void parse_header(const char* where) {
    if (bytes_.size() < 8) {
      detail::fail<FormatError>(where, source_, ": file is ", bytes_.size(),
                                " bytes long; expected at least 8 (the header length)");
    }
    std::uint64_t header_length = 0;
    for (std::size_t i = 8; i-- > 0;) header_length = (header_length << 8) | bytes_[i];
    const std::uint64_t remaining = bytes_.size() - 8;
    if (header_length > max_header_bytes) {
      detail::fail<FormatError>(where, source_, ": header length is ", header_length,
                                " bytes; expected at most ", max_header_bytes);
    }
    if (header_length > remaining) {
      detail::fail<FormatError>(where, source_, ": header length is ", header_length,
                                " bytes but only ", remaining,
                                " bytes follow the length field; expected a complete header");
    }
    data_start_ = 8 + static_cast<std::size_t>(header_length);
    const std::size_t buffer_size = bytes_.size() - data_start_;

    // A safetensors header nests three levels deep; refuse far deeper nesting before parsing,
    // since building and destroying a million nested arrays exhausts the stack.
    {
      constexpr int kMaxNesting = 64;
      int depth = 0;
      bool in_string = false, escaped = false;
      for (std::size_t i = 8; i < data_start_; ++i) {
        const char c = static_cast<char>(bytes_[i]);
        if (in_string) {
          if (escaped)
            escaped = false;
          else if (c == '\\')
            escaped = true;
          else if (c == '"')
            in_string = false;
        } else if (c == '"') {
          in_string = true;
        } else if (c == '[' || c == '{') {
          if (++depth > kMaxNesting)
            detail::fail<FormatError>(
                where, source_, ": header nests JSON arrays or objects more than ", kMaxNesting,
                " levels deep at byte ", i - 8, "; expected a flat safetensors header");
        } else if (c == ']' || c == '}') {
          --depth;
        }
      }
    }
    json header;
    try {
      header = json::parse(bytes_.data() + 8, bytes_.data() + data_start_);
    } catch (const json::exception& error) {
      detail::fail<FormatError>(where, source_, ": header is not valid JSON (", error.what(),
                                "); expected a JSON object");
    }
    if (!header.is_object()) {
      detail::fail<FormatError>(where, source_, ": header is a JSON ", header.type_name(),
                                "; expected a JSON object");
    }
    for (const auto& [key, value] : header.items()) {
      if (key == "__metadata__") {
        parse_metadata(where, value);
      } else {
        tensors_.emplace(key, parse_entry(where, key, value, buffer_size));
      }
    }
    check_disjoint(where);
  }

  void parse_metadata(const char* where, const json& metadata) {
    if (!metadata.is_object()) {
      detail::fail<FormatError>(where, source_, ": __metadata__ is a JSON ", metadata.type_name(),
                                "; expected an object of strings");
    }
    for (const auto& [key, value] : metadata.items()) {
      if (!value.is_string()) {
        detail::fail<FormatError>(where, source_, ": __metadata__ value of '", key, "' is a JSON ",
                                  value.type_name(), "; expected a string");
      }
      metadata_.emplace(key, value.get<std::string>());
    }
  }

  // The field `field` of a header entry; FormatError if it is absent.
  const json& field_of(const char* where, const std::string& name, const json& entry,
                       const char* field) const {
    const auto it = entry.find(field);
    if (it == entry.end()) {
      detail::fail<FormatError>(where, source_, ": tensor '", name, "' has no \"", field,
                                "\" field; expected dtype, shape and data_offsets");
    }
    return *it;
  }

  // A JSON integer >= 0 that fits in int64; `what` names it in messages.
  std::int64_t non_negative_integer(const char* where, const std::string& name, const json& value,
                                    const std::string& what) const {
    if (value.is_number_unsigned()) {
      const auto number = value.get<std::uint64_t>();
      if (number > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        detail::fail<FormatError>(where, source_, ": tensor '", name, "' ", what, " = ", number,
                                  " is too large; expected at most 2^63 - 1");
      }
      return static_cast<std::int64_t>(number);
    }
    if (value.is_number_integer()) {
      detail::fail<FormatError>(where, source_, ": tensor '", name, "' ", what, " = ",
                                value.get<std::int64_t>(), " is negative; expected >= 0");
    }
    detail::fail<FormatError>(where, source_, ": tensor '", name, "' ", what, " is ", value.dump(),
                              "; expected a non-negative integer");
  }

  TensorInfo parse_entry(const char* where, const std::string& name, const json& entry,
                         std::size_t buffer_size) const {
    if (!entry.is_object()) {
      detail::fail<FormatError>(where, source_, ": tensor '", name, "' is a JSON ",
                                entry.type_name(),
                                "; expected an object with dtype, shape and data_offsets");
    }
    TensorInfo tensor;
    tensor.name = name;

    const json& dtype = field_of(where, name, entry, "dtype");
    if (!dtype.is_string()) {
      detail::fail<FormatError>(where, source_, ": tensor '", name, "' dtype is a JSON ",
                                dtype.type_name(), "; expected a string");
    }
    const std::optional<DType> parsed = detail::dtype_from_name(dtype.get<std::string>());
    if (!parsed) {
      detail::fail<FormatError>(where, source_, ": tensor '", name, "' has dtype ", dtype.dump(),
                                ", which is not supported; expected one of F16, BF16, F32, F64, "
                                "I32, I64, U8, BOOL");
    }
    tensor.dtype = *parsed;

    const json& shape = field_of(where, name, entry, "shape");
    if (!shape.is_array()) {
      detail::fail<FormatError>(where, source_, ": tensor '", name, "' shape is a JSON ",
                                shape.type_name(), "; expected an array of integers");
    }
    for (std::size_t axis = 0; axis < shape.size(); ++axis) {
      tensor.shape.push_back(
          non_negative_integer(where, name, shape[axis], "shape[" + std::to_string(axis) + "]"));
    }
    const std::optional<std::int64_t> count = detail::checked_element_count(tensor.shape);
    const std::size_t element_size = dtype_size(tensor.dtype);
    if (!count || static_cast<std::uint64_t>(*count) >
                      std::numeric_limits<std::size_t>::max() / element_size) {
      detail::fail<FormatError>(where, source_, ": tensor '", name, "' shape ",
                                detail::format_shape(tensor.shape),
                                " overflows the element count; expected a shape that fits in "
                                "memory");
    }

    const json& offsets = field_of(where, name, entry, "data_offsets");
    if (!offsets.is_array() || offsets.size() != 2) {
      detail::fail<FormatError>(where, source_, ": tensor '", name, "' data_offsets is ",
                                offsets.dump(), "; expected an array [begin, end]");
    }
    const auto begin = static_cast<std::uint64_t>(
        non_negative_integer(where, name, offsets[0], "data_offsets[0]"));
    const auto end = static_cast<std::uint64_t>(
        non_negative_integer(where, name, offsets[1], "data_offsets[1]"));
    if (begin > end) {
      detail::fail<FormatError>(where, source_, ": tensor '", name, "' data_offsets [", begin, ", ",
                                end, "] begin after end; expected begin <= end");
    }
    if (end > buffer_size) {
      detail::fail<FormatError>(where, source_, ": tensor '", name, "' data_offsets [", begin, ", ",
                                end, "] end past the data buffer of ", buffer_size,
                                " bytes; expected end <= ", buffer_size);
    }
    const std::uint64_t expected_bytes = static_cast<std::uint64_t>(*count) * element_size;
    if (end - begin != expected_bytes) {
      detail::fail<FormatError>(where, source_, ": tensor '", name, "' data_offsets [", begin, ", ",
                                end, "] span ", end - begin, " bytes; expected ", expected_bytes,
                                " (", *count, " elements of ", dtype_name(tensor.dtype), ", shape ",
                                detail::format_shape(tensor.shape), ")");
    }
    tensor.begin = static_cast<std::size_t>(begin);
    tensor.end = static_cast<std::size_t>(end);
    return tensor;
  }

  // Two tensors may not share a byte; empty tensors occupy none.
  void check_disjoint(const char* where) const {
    std::vector<const TensorInfo*> occupied;
    for (const auto& entry : tensors_) {
      if (entry.second.end > entry.second.begin) occupied.push_back(&entry.second);
    }
    std::sort(occupied.begin(), occupied.end(),
              [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
    // Sorted by begin, a range that overlaps any earlier one overlaps its predecessor.
    for (std::size_t i = 1; i < occupied.size(); ++i) {
      const TensorInfo& previous = *occupied[i - 1];
      const TensorInfo& current = *occupied[i];
      if (current.begin < previous.end) {
        detail::fail<FormatError>(where, source_, ": tensors '", previous.name, "' data_offsets [",
                                  previous.begin, ", ", previous.end, "] and '", current.name,
                                  "' data_offsets [", current.begin, ", ", current.end,
                                  "] overlap; expected disjoint byte ranges");
      }
      if (current.begin > previous.end) {
        detail::fail<FormatError>(
            where, source_, ": bytes [", previous.end, ", ", current.begin, ") between tensors '",
            previous.name, "' and '", current.name,
            "' belong to no tensor; expected contiguous data_offsets (no holes)");
      }
    }
    // As in the reference implementation, the tensors tile the data buffer exactly.
    const std::size_t buffer_size = bytes_.size() - data_start_;
    const std::size_t first = occupied.empty() ? 0 : occupied.front()->begin;
    const std::size_t last = occupied.empty() ? 0 : occupied.back()->end;
    if (first != 0)
      detail::fail<FormatError>(where, source_, ": bytes [0, ", first,
                                ") of the data belong to no tensor ('", occupied.front()->name,
                                "' starts at ", first,
                                "); expected contiguous data_offsets from 0 (no holes)");
    if (last != buffer_size)
      detail::fail<FormatError>(where, source_, ": the data buffer holds ", buffer_size,
                                " bytes but the tensors cover [0, ", last,
                                "); expected the tensors to cover the whole buffer");
  }

  std::vector<std::uint8_t> bytes_;
  std::string source_;
  std::size_t data_start_ = 0;  // offset of the data buffer in bytes_
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Collects tensors and metadata, then serializes them as one safetensors file.
//
// Tensors are laid out largest element first (then by name), as the reference implementation
// does: with the header padded to a multiple of 8 bytes, every tensor then starts at an offset
// that is a multiple of its element size, so readers can map it without copying.
class SafetensorsWriter {
 public:
  // Adds a tensor from raw little-endian bytes; ShapeError unless bytes equals the shape's
  // element count times dtype_size(dtype), FormatError for a duplicate or reserved name.
  void add(const std::string& name, DType dtype, std::vector<std::int64_t> shape, const void* data,
           std::size_t bytes) {
    constexpr const char* where = "SafetensorsWriter::add";
    const std::string subject = "tensor '" + name + "'";
    if (name == "__metadata__") {
      detail::fail<FormatError>(where, subject,
                                ": the name is reserved for the metadata; expected another name");
    }
    for (const Entry& entry : entries_) {
      if (entry.tensor.name == name) {
        detail::fail<FormatError>(where, subject,
                                  ": already added; expected each tensor name once");
      }
    }
    const std::size_t expected = detail::checked_byte_count(where, subject, shape, dtype);
    if (bytes != expected) {
      detail::fail<ShapeError>(where, subject, ": got ", bytes, " bytes for shape ",
                               detail::format_shape(shape), " of ", dtype_name(dtype),
                               "; expected ", expected);
    }
    if (data == nullptr && bytes > 0) {
      detail::fail<ShapeError>(where, subject, ": data is null; expected ", bytes, " bytes");
    }
    Entry entry;
    entry.tensor.name = name;
    entry.tensor.dtype = dtype;
    entry.tensor.shape = std::move(shape);
    const auto* first = static_cast<const std::uint8_t*>(data);
    entry.data.assign(first, first + bytes);
    entries_.push_back(std::move(entry));
  }

  // Adds a tensor of T (float → F32, double → F64, int64 → I64, int32 → I32, uint8 → U8,
  // bool → BOOL) holding product(shape) elements read from `data`.
  template <typename T>
  void add(const std::string& name, const std::vector<std::int64_t>& shape, const T* data) {
    static_assert(detail::IsIoElement<T>::value,
                  "SafetensorsWriter::add takes float, double, int64_t, int32_t, uint8_t or bool");
    static_assert(sizeof(T) == dtype_size(detail::IoElement<T>::dtype),
                  "the element type's size must match its dtype's");
    const std::size_t bytes = detail::checked_byte_count(
        "SafetensorsWriter::add", "tensor '" + name + "'", shape, detail::IoElement<T>::dtype);
    add(name, detail::IoElement<T>::dtype, shape, data, bytes);
  }

  // Sets one "__metadata__" entry, replacing an earlier value of the same key.
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

  std::vector<std::uint8_t> to_bytes() const {
    std::vector<const Entry*> order;
    for (const Entry& entry : entries_) order.push_back(&entry);
    std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
      const std::size_t size_a = dtype_size(a->tensor.dtype);
      const std::size_t size_b = dtype_size(b->tensor.dtype);
      if (size_a != size_b) return size_a > size_b;
      return a->tensor.name < b->tensor.name;
    });

    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    if (!metadata_.empty()) {
      nlohmann::ordered_json metadata = nlohmann::ordered_json::object();
      for (const auto& [key, value] : metadata_) metadata[key] = value;
      header["__metadata__"] = std::move(metadata);
    }
    std::size_t offset = 0;
    for (const Entry* entry : order) {
      const std::size_t end = offset + entry->data.size();
      header[entry->tensor.name] = {{"dtype", dtype_name(entry->tensor.dtype)},
                                    {"shape", entry->tensor.shape},
                                    {"data_offsets", {offset, end}}};
      offset = end;
    }
    std::string text;
    try {
      text = header.dump();
    } catch (const nlohmann::json::exception& error) {
      // dump rejects names and metadata that are not valid UTF-8.
      detail::fail<FormatError>("SafetensorsWriter::to_bytes", "cannot encode the header (",
                                error.what(), "); expected UTF-8 names and metadata");
    }
    text.append((8 - text.size() % 8) % 8, ' ');

    std::vector<std::uint8_t> bytes;
    bytes.reserve(8 + text.size() + offset);
    std::uint64_t length = text.size();
    for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<std::uint8_t>(length >> (8 * i)));
    bytes.insert(bytes.end(), text.begin(), text.end());
    for (const Entry* entry : order) {
      bytes.insert(bytes.end(), entry->data.begin(), entry->data.end());
    }
    return bytes;
  }

  // Writes the file through a temporary and a rename: `path` is either untouched or complete.
  void write(const std::string& path) const {
    const std::vector<std::uint8_t> bytes = to_bytes();
    detail::write_file_atomically("SafetensorsWriter::write", path, {{bytes.data(), bytes.size()}});
  }

 private:
  struct Entry {
    TensorInfo tensor;  // begin and end are assigned when the file is laid out
    std::vector<std::uint8_t> data;
  };

  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace io
}  // namespace sdmha
