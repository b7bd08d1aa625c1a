// sdmha/errors.hpp — the exceptions that sdmha throws for bad input.
//
// Every check happens at a boundary (a constructor, a factory, the start of forward, a file
// reader) before any work is done, and in Release builds too. Messages name the argument, the
// value found and what was expected, e.g.
//   "sdmha: SparseQuery::from_coo: indices[4] feature = 70000 is out of range; expected 0 <=
//   feature < 32768"
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace sdmha {

// The root of the hierarchy: catch this to catch anything sdmha rejects.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// A dimension, a length or a shape does not match what another argument or the configuration
// requires, or is negative, or overflows the storage index type.
class ShapeError : public Error {
 public:
  using Error::Error;
};

// An index (a sparse coordinate, a row pointer, a column index) is out of range or out of order.
class IndexError : public Error {
 public:
  using Error::Error;
};

// A configuration value is invalid on its own (num_heads <= 0, key_dim <= 0, ...).
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A file or a byte buffer is malformed: bad header, unknown dtype, truncated data, ...
class FormatError : public Error {
 public:
  using Error::Error;
};

// A file could not be opened, read or written.
class IoError : public Error {
 public:
  using Error::Error;
};

namespace detail {

// Builds "sdmha: <where>: <parts...>" with operator<<, so that call sites read as one sentence.
template <typename... Parts>
std::string message(const char* where, Parts&&... parts) {
  std::ostringstream stream;
  stream << "sdmha: " << where << ": ";
  (stream << ... << std::forward<Parts>(parts));
  return stream.str();
}

template <typename ErrorType, typename... Parts>
[[noreturn]] void fail(const char* where, Parts&&... parts) {
  throw ErrorType(message(where, std::forward<Parts>(parts)...));
}

}  // namespace detail
}  // namespace sdmha
