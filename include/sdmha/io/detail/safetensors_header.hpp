// sdmha/io/detail/safetensors_header.hpp — the header of a safetensors file, validated in full:
// the 8-byte little-endian length, the JSON (nesting bounded before the parse), every entry's
// dtype, shape and data_offsets, the metadata, and that the tensors tile the data buffer exactly,
// without overlaps or holes. After it, every read of a tensor stays inside the file's bytes.
//
// Cost: O(header bytes + tensors · log tensors).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "sdmha/errors.hpp"
#include "sdmha/io/detail/bytes.hpp"
#include "sdmha/io/detail/json.hpp"
#include "sdmha/io/dtype.hpp"

namespace sdmha::io {

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

}  // namespace sdmha::io

namespace sdmha::detail {

// What a validated header says: where the data buffer starts, the tensors by name, the metadata.
struct SafetensorsHeader {
  std::size_t data_start = 0;  // offset of the data buffer in the file's bytes
  std::map<std::string, io::TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
};

// Parses the header of a whole safetensors file held in `bytes`; `source` names the file in
// FormatError's messages.
class SafetensorsHeaderParser {
 public:
  SafetensorsHeaderParser(const std::vector<std::uint8_t>& bytes, const std::string& source,
                          std::uint64_t max_header_bytes)
      : bytes_(bytes), source_(source), max_header_bytes_(max_header_bytes) {}

  SafetensorsHeader parse(const char* where) {
    parse_header(where);
    return std::move(header_);
  }

 private:
  using json = nlohmann::json;
  using DType = io::DType;
  using TensorInfo = io::TensorInfo;

  void parse_header(const char* where) {
    if (bytes_.size() < 8) {
      detail::fail<FormatError>(where, source_, ": file is ", bytes_.size(),
                                " bytes long; expected at least 8 (the header length)");
    }
    const std::uint64_t header_length = read_little_endian(bytes_.data(), 8);
    const std::uint64_t remaining = bytes_.size() - 8;
    if (header_length > max_header_bytes_) {
      detail::fail<FormatError>(where, source_, ": header length is ", header_length,
                                " bytes; expected at most ", max_header_bytes_);
    }
    if (header_length > remaining) {
      detail::fail<FormatError>(where, source_, ": header length is ", header_length,
                                " bytes but only ", remaining,
                                " bytes follow the length field; expected a complete header");
    }
    header_.data_start = 8 + static_cast<std::size_t>(header_length);
    const std::size_t buffer_size = bytes_.size() - header_.data_start;

    // A safetensors header nests three levels deep; far deeper nesting is refused.
    constexpr int kMaxNesting = 64;
    const json header = parse_json(
        bytes_.data() + 8, static_cast<std::size_t>(header_length), kMaxNesting,
        [&](std::size_t offset) {
          detail::fail<FormatError>(
              where, source_, ": header nests JSON arrays or objects more than ", kMaxNesting,
              " levels deep at byte ", offset, "; expected a flat safetensors header");
        },
        [&](const json::exception& error) {
          detail::fail<FormatError>(where, source_, ": header is not valid JSON (", error.what(),
                                    "); expected a JSON object");
        });
    if (!header.is_object()) {
      detail::fail<FormatError>(where, source_, ": header is a JSON ", header.type_name(),
                                "; expected a JSON object");
    }
    for (const auto& [key, value] : header.items()) {
      if (key == "__metadata__") {
        parse_metadata(where, value);
      } else {
        header_.tensors.emplace(key, parse_entry(where, key, value, buffer_size));
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
      header_.metadata.emplace(key, value.get<std::string>());
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
    for (const auto& entry : header_.tensors) {
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
    const std::size_t buffer_size = bytes_.size() - header_.data_start;
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

  const std::vector<std::uint8_t>& bytes_;
  const std::string& source_;
  std::uint64_t max_header_bytes_;
  SafetensorsHeader header_;
};

}  // namespace sdmha::detail
