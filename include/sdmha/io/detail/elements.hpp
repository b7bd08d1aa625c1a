// sdmha/io/detail/elements.hpp — stored elements decoded into the C++ type a caller asked for:
// halves and bfloat16 widened exactly, F64 narrowed to float with IEEE rounding, integers widened,
// booleans checked to be 0 or 1. Any other pairing is a FormatError naming the file and tensor.
//
// Cost: one pass over the elements; a plain memcpy where the stored type is the requested one.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "sdmha/errors.hpp"
#include "sdmha/io/detail/bytes.hpp"
#include "sdmha/io/dtype.hpp"

namespace sdmha::detail {

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

}  // namespace sdmha::detail
