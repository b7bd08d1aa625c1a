// sdmha/io/detail/shape_format.hpp — the one way the file readers and writers print a shape in a
// message: as a list "[3, 4]" (safetensors, .npy, layer files) or as a Python tuple "(3, 4)",
// "(3,)" (Keras' shapes, the .npy header's 'shape').
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace sdmha::detail {

enum class ShapeNotation {
  list,   // "[3, 4]", every dimension as its number
  tuple,  // "(3, 4)", "(3,)", "()"; a negative dimension prints "any" (an expected shape's
          // wildcard)
};

inline std::string format_shape(const std::vector<std::int64_t>& shape,
                                ShapeNotation notation = ShapeNotation::list) {
  const bool tuple = notation == ShapeNotation::tuple;
  std::string text = tuple ? "(" : "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += ", ";
    text += tuple && shape[i] < 0 ? std::string("any") : std::to_string(shape[i]);
  }
  if (!tuple) return text + "]";
  return text + (shape.size() == 1 ? ",)" : ")");
}

}  // namespace sdmha::detail
