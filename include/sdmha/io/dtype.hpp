// sdmha/io/dtype.hpp — the element types that sdmha's file readers and writers know (safetensors'
// names, which the .npy reader maps its descrs onto), their sizes, and what each C++ element type
// of the typed reads and writes is stored as.
//
// Shared by io/safetensors.hpp and io/npy.hpp; both formats store little-endian data, which the
// readers copy out and the zero-copy view hands out as is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>

// Supporting big-endian hosts would mean a byte swap on every read and write path.
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

// The DType whose safetensors name is `name`, or nothing.
inline std::optional<io::DType> dtype_from_name(const std::string& name) {
  using io::DType;
  for (DType dtype : {DType::F16, DType::BF16, DType::F32, DType::F64, DType::I32, DType::I64,
                      DType::U8, DType::BOOL}) {
    if (name == io::dtype_name(dtype)) return dtype;
  }
  return std::nullopt;
}

}  // namespace detail
}  // namespace sdmha
