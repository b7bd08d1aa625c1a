// sdmha/io/detail/json.hpp — JSON from untrusted bytes, over nlohmann/json, with the one guard on
// nesting: nlohmann/json builds and destroys nested values recursively, so a file of a million
// '[' exhausts the stack; the bytes are scanned for nesting deeper than the caller allows first.
//
// Cost: one pass over the bytes before the parse.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>

namespace sdmha::detail {

// The offset of the first '[' or '{' (outside strings) that opens a level deeper than
// `max_nesting`, or nothing when the bytes nest no deeper. Only brackets are counted: the bytes
// need not be valid JSON, which the parse checks afterwards.
inline std::optional<std::size_t> excess_json_nesting(const std::uint8_t* bytes, std::size_t size,
                                                      int max_nesting) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (std::size_t i = 0; i < size; ++i) {
    const char c = static_cast<char>(bytes[i]);
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
      if (++depth > max_nesting) return i;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return std::nullopt;
}

// Parses bytes[0, size) as JSON. Nesting deeper than `max_nesting` calls too_deep(offset), and
// invalid JSON calls invalid(exception); both must throw, so that each reader words its own
// message.
template <typename TooDeep, typename Invalid>
nlohmann::json parse_json(const std::uint8_t* bytes, std::size_t size, int max_nesting,
                          TooDeep&& too_deep, Invalid&& invalid) {
  if (const auto offset = excess_json_nesting(bytes, size, max_nesting)) too_deep(*offset);
  try {
    return nlohmann::json::parse(bytes, bytes + size);
  } catch (const nlohmann::json::exception& error) {
    invalid(error);
  }
  return nlohmann::json();  // not reached: invalid throws
}

}  // namespace sdmha::detail
