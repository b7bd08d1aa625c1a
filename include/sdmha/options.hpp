// sdmha/options.hpp — AttentionOptions (masks, threads, score strategy), AttentionResult and
// TensorRef3, the read-only view through which dense (B, S, E) inputs come in.
#pragma once

#include <cstdint>
#include <optional>
#include <type_traits>

#include <unsupported/Eigen/CXX11/Tensor>

#include "sdmha/config.hpp"

namespace sdmha {

// How the score kernel gets the query (both are exact; they differ in cost):
//  project_first     Q = X·Wq + bq for all rows, then S_bh = (Q_bh/√Dk)·K_bhᵀ: 2·nnz·H·Dk +
//  2·T·S·Dk per (b, h). sparse_regrouped  S_bh = X_b·M_bh + 1·c_bh with M_bh = Wq_h·K_bhᵀ/√Dk
//  restricted to the features
//                    that batch b uses (U_b of them): 2·U_b·Dk·S + 2·nnz_b·S per (b, h).
// The regrouped form wins when batch b's rows touch few distinct features relative to T.
// automatic       a cost model on the shapes and the query's nonzeros picks one per call.
enum class ScoreStrategy { automatic, project_first, sparse_regrouped };

inline const char* to_string(ScoreStrategy strategy) {
  switch (strategy) {
    case ScoreStrategy::project_first:
      return "project_first";
    case ScoreStrategy::sparse_regrouped:
      return "sparse_regrouped";
    default:
      return "automatic";
  }
}

// Which key steps a causal mask lets query step t see, for T query and S key steps:
//  top_left      s <= t          (Keras' use_causal_mask, PyTorch's is_causal / causal_upper_left)
//  bottom_right  s <= t + S − T  (PyTorch's causal_lower_right: the last query step sees every key,
//                                 as when decoding T new steps against S cached ones)
enum class CausalAlignment { top_left, bottom_right };

inline const char* to_string(CausalAlignment alignment) {
  return alignment == CausalAlignment::bottom_right ? "bottom_right" : "top_left";
}

// What a query row gets when every key is blocked for it:
//  zeros    all-zero probabilities, so its head is 0 and its output the output bias (Keras 3's
//           explicit softmax path, PyTorch's scaled_dot_product_attention)
//  uniform  probability 1/S on every key, as when blocked scores get a large finite negative
//           instead of −∞ (Keras' fused dot_product_attention path, Keras 2, TF.js): the row
//           averages every value row, including blocked ones, and passes no gradient to scores
enum class FullyMaskedRows { zeros, uniform };

inline const char* to_string(FullyMaskedRows policy) {
  return policy == FullyMaskedRows::uniform ? "uniform" : "zeros";
}

template <typename Scalar>
struct AttentionOptions {
  // (B, T, S), true = query step t may attend to key step s (Keras' polarity). A tensor with all
  // dimensions zero (the default) means no mask.
  Eigen::Tensor<bool, 3, Eigen::RowMajor> attention_mask;
  // Keras' use_causal_mask: step t may attend to key steps s <= t (T and S may differ), or
  // s <= t + S − T with causal_alignment = bottom_right.
  bool use_causal_mask = false;
  CausalAlignment causal_alignment = CausalAlignment::top_left;
  // The factor on the scores, S = scale·Q·Kᵀ; unset means 1/√key_dim (Keras). PyTorch's
  // scaled_dot_product_attention(scale=…). Must be finite.
  std::optional<double> scale;
  FullyMaskedRows fully_masked_rows = FullyMaskedRows::zeros;
  // (B, S), true = padding, never attended (PyTorch's key_padding_mask polarity). All dimensions
  // zero means none. All masks are ANDed.
  Eigen::Tensor<bool, 2, Eigen::RowMajor> key_padding_mask;
  // Return the (B, H, T, S) softmax probabilities in AttentionResult::attention_scores.
  bool return_attention_scores = false;
  // Worker threads for the batch × head work and the projections; 0 means all hardware threads.
  // The output is bitwise the same for any value.
  int num_threads = 0;
  ScoreStrategy score_strategy = ScoreStrategy::automatic;
  // Dropout on the attention probabilities, applied only when `training` is true (Keras'
  // training=True): after the softmax, before the values; attention_scores are returned before
  // dropout. The mask is a function of (dropout_seed, b, h, t, s): forward and backward with the
  // same seed see the same mask. 0 <= dropout_rate < 1.
  bool training = false;
  double dropout_rate = 0.0;
  std::uint64_t dropout_seed = 0;
};

// Keys and values already projected (K = key·Wk + bk, V = value·Wv + bv): made once by a layer's
// project_context and reused by forward against many query batches over the same context.
template <typename Scalar>
struct ProjectedContext {
  Index batch = 0;           // B
  Index key_steps = 0;       // S
  RowMatrix<Scalar> keys;    // B·S × H·Dk, row b·S + s
  RowMatrix<Scalar> values;  // B·S × H·Dv
};

template <typename Scalar>
struct AttentionResult {
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> output;            // (B, T, O)
  Eigen::Tensor<Scalar, 4, Eigen::RowMajor> attention_scores;  // (B, H, T, S) or empty
};

// A read-only view of a row-major rank-3 tensor: binds to Eigen::Tensor and Eigen::TensorMap
// (of const or mutable data) without copying. The caller's memory must outlive the call.
template <typename Scalar>
class TensorRef3 {
 public:
  TensorRef3(const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& tensor)  // NOLINT: implicit by design
      : data_(tensor.data()),
        dims_{tensor.dimension(0), tensor.dimension(1), tensor.dimension(2)} {}

  template <typename PlainTensor, int MapOptions, template <class> class MakePointer>
  TensorRef3(const Eigen::TensorMap<PlainTensor, MapOptions, MakePointer>& map)  // NOLINT
      : data_(map.data()), dims_{map.dimension(0), map.dimension(1), map.dimension(2)} {
    using Plain = std::remove_const_t<PlainTensor>;
    static_assert(std::is_same<std::remove_const_t<typename Plain::Scalar>, Scalar>::value,
                  "TensorRef3: the tensor's scalar type must match the layer's Scalar");
    static_assert(Plain::NumIndices == 3, "TensorRef3: expected a rank-3 tensor (B, S, E)");
    static_assert(int(Plain::Layout) == int(Eigen::RowMajor),
                  "TensorRef3: expected a RowMajor tensor");
  }

  TensorRef3(const Scalar* data, Index batch, Index steps, Index width)
      : data_(data), dims_{batch, steps, width} {}

  const Scalar* data() const { return data_; }
  Index dimension(int axis) const { return dims_[axis]; }
  // The tensor as a (B·S × E) row-major matrix.
  Eigen::Map<const RowMatrix<Scalar>> as_matrix() const {
    return Eigen::Map<const RowMatrix<Scalar>>(data_, dims_[0] * dims_[1], dims_[2]);
  }

 private:
  const Scalar* data_;
  Index dims_[3];
};

}  // namespace sdmha
