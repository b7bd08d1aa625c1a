// sdmha/io/detail/npy_header.hpp — the header of a .npy file, read and written: the dict literal
// {'descr': '<f8', 'fortran_order': False, 'shape': (3, 4), } parsed strictly (the subset of
// Python literal syntax that numpy writes) and encoded byte for byte as numpy.save encodes it;
// the descrs that map onto DType; and the reorder of a Fortran-order array into C order.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "sdmha/errors.hpp"
#include "sdmha/io/detail/bytes.hpp"
#include "sdmha/io/detail/shape_format.hpp"
#include "sdmha/io/dtype.hpp"

namespace sdmha::detail {

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

// The magic, version, header length and padded header dict of a C-order .npy file of `descr`
// and `shape`: version 1.0, or 2.0 if the header outgrows 64 KiB, byte for byte what numpy.save
// writes.
inline std::vector<std::uint8_t> encode_npy_header(const char* descr,
                                                   const std::vector<std::int64_t>& shape) {
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " +
                       format_shape(shape, ShapeNotation::tuple) + ", }";
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
    append_little_endian(head, text.size(), 2);
  } else {
    text = padded(12);
    head.insert(head.end(), {2, 0});
    append_little_endian(head, text.size(), 4);
  }
  head.insert(head.end(), text.begin(), text.end());
  return head;
}

}  // namespace sdmha::detail
