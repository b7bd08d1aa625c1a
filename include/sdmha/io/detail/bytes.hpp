// sdmha/io/detail/bytes.hpp — little-endian integers in untrusted bytes, and the sizes a file may
// declare: element and byte counts checked for overflow, the one bound on a layer's widths, and
// deflate's bound on expansion.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "sdmha/errors.hpp"
#include "sdmha/io/detail/shape_format.hpp"
#include "sdmha/io/dtype.hpp"

namespace sdmha::detail {

// The largest width a layer file may give one dimension of a kernel or a bias (Keras' config and
// datasets, safetensors and .npz kernels): products such as Eq·H·Dk or H·Dv·O then stay far from
// overflow, even for kernels that hold no bytes, and 2^24 is beyond any real layer.
constexpr std::int64_t kMaxLayerDimension = std::int64_t(1) << 24;

// Deflate expands data by at most 1032:1, so a compressed size bounds the size it may inflate to
// (zip members, chunked HDF5 datasets); a larger claim is forged or corrupt.
constexpr std::uint64_t kMaxDeflateRatio = 1032;

// A value of type U from `bytes` at any alignment, in the host's (little-endian) byte order.
template <typename U>
U load_unaligned(const std::uint8_t* bytes) {
  U value;
  std::memcpy(&value, bytes, sizeof(U));
  return value;
}

// The unsigned little-endian integer in bytes[0, count), count <= 8.
inline std::uint64_t read_little_endian(const std::uint8_t* bytes, std::size_t count) {
  std::uint64_t value = 0;
  for (std::size_t i = count; i-- > 0;) value = (value << 8) | bytes[i];
  return value;
}

// Appends the low `count` bytes of `value`, least significant first.
inline void append_little_endian(std::vector<std::uint8_t>& out, std::uint64_t value,
                                 std::size_t count) {
  for (std::size_t i = 0; i < count; ++i)
    out.push_back(static_cast<std::uint8_t>(value >> (8 * i)));
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

// Whether `count` elements of `element_size` bytes can be addressed (and so allocated at all).
inline bool addressable(std::int64_t count, std::size_t element_size) {
  return static_cast<std::uint64_t>(count) <=
         std::numeric_limits<std::size_t>::max() / element_size;
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
  if (!count || !addressable(*count, element_size)) {
    fail<ShapeError>(where, subject, ": shape ", format_shape(shape), " of ", io::dtype_name(dtype),
                     " overflows the addressable byte count");
  }
  return static_cast<std::size_t>(*count) * element_size;
}

}  // namespace sdmha::detail
