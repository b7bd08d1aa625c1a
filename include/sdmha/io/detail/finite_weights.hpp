// sdmha/io/detail/finite_weights.hpp — check_finite_weights: a loaded layer's weights refused when
// one holds a NaN or an infinity, naming the tensor and the first such entry.
//
//   math:  every entry of Wq, Wk, Wv, Wo and the biases finite
//   pre:   the weights' shapes validated (any shapes are read as they are)
//   cost:  one pass over the weights, stopping at the first bad entry
#pragma once

#include <cmath>
#include <string>

#include "sdmha/errors.hpp"
#include "sdmha/weights.hpp"

namespace sdmha::detail {

template <typename Scalar>
void check_finite_weights(const char* where, const std::string& subject,
                          const MhaWeights<Scalar>& weights) {
  struct Tensor {
    const char* name;
    const Scalar* data;
    Index rows, cols;
  };
  const auto kernel = [](const char* name, const RowMatrix<Scalar>& matrix) {
    return Tensor{name, matrix.data(), matrix.rows(), matrix.cols()};
  };
  const auto bias = [](const char* name, const Vector<Scalar>& vector) {
    return Tensor{name, vector.data(), vector.size(), 1};
  };
  const Tensor tensors[] = {
      kernel("query kernel", weights.query_kernel),   bias("query bias", weights.query_bias),
      kernel("key kernel", weights.key_kernel),       bias("key bias", weights.key_bias),
      kernel("value kernel", weights.value_kernel),   bias("value bias", weights.value_bias),
      kernel("output kernel", weights.output_kernel), bias("output bias", weights.output_bias)};
  for (const Tensor& tensor : tensors) {
    for (Index i = 0; i < tensor.rows * tensor.cols; ++i) {
      if (std::isfinite(tensor.data[i])) continue;
      const char* what = std::isnan(tensor.data[i]) ? "NaN" : tensor.data[i] > 0 ? "+Inf" : "-Inf";
      fail<FormatError>(where, subject, ": the ", tensor.name, " holds ", what, " at (",
                        i / tensor.cols, ", ", i % tensor.cols,
                        ") (row, column of the layer's matrix); expected finite weights "
                        "(allow_non_finite_weights to load them anyway)");
    }
  }
}

}  // namespace sdmha::detail
