// sdmha/gradients.hpp — MhaGradients<Scalar>: every gradient of one backward call.
//
// The weight gradients have the weights' names and shapes (see weights.hpp), so that a training
// step reads `weights.query_kernel -= rate * gradients.query_kernel` member by member.
#pragma once

#include <unsupported/Eigen/CXX11/Tensor>

#include "sdmha/config.hpp"

namespace sdmha {

template <typename Scalar>
struct MhaGradients {
  RowMatrix<Scalar> query_kernel;   // Eq × H·Dk
  RowMatrix<Scalar> key_kernel;     // Ek × H·Dk
  RowMatrix<Scalar> value_kernel;   // Ev × H·Dv
  RowMatrix<Scalar> output_kernel;  // H·Dv × O
  Vector<Scalar> query_bias;        // H·Dk, empty when use_bias is false
  Vector<Scalar> key_bias;          // H·Dk, empty when use_bias is false
  Vector<Scalar> value_bias;        // H·Dv, empty when use_bias is false
  Vector<Scalar> output_bias;       // O, empty when use_bias is false
  // The query's values: for a query made by SparseQuery::from_coo, one entry per COO input entry
  // in the order from_coo received them (entries summed as duplicates each get their
  // coordinate's gradient); otherwise one per stored value in CSR order. Only the stored
  // positions have a gradient: the query's pattern is not a parameter.
  // Empty where AttentionOptions::input_gradients leaves it out, as key and value below.
  Vector<Scalar> query_values;
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> key;    // (B, S, Ek)
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> value;  // (B, S, Ev)
  // ∂loss/∂attention_bias when AttentionOptions::compute_bias_gradient is set (else empty): the
  // bias's own (B', H', T, S), in its element order, each element the sum over the batch entries
  // and heads it serves (the same sum for any thread count). 0 at blocked positions.
  Eigen::Tensor<Scalar, 4, Eigen::RowMajor> attention_bias;
};

}  // namespace sdmha
