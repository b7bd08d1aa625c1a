// sdmha/attention_result.hpp — AttentionResult: what a forward returns (the output, the
// probabilities when asked, the call's dropout seed).
#pragma once

#include <cstdint>

#include <unsupported/Eigen/CXX11/Tensor>

namespace sdmha {

template <typename Scalar>
struct AttentionResult {
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> output;            // (B, T, O)
  Eigen::Tensor<Scalar, 4, Eigen::RowMajor> attention_scores;  // (B, H, T, S) or empty
  std::uint64_t dropout_seed = 0;  // the seed of the call's dropout mask (0 without dropout)
};

}  // namespace sdmha
