// sdmha/options.hpp — AttentionOptions (masks, bias, scale, threads, score strategy, dropout),
// DropoutGenerator, AttentionResult, ProjectedContext and TensorRef3, the read-only view through
// which dense (B, S, E) inputs come in.
#pragma once

#include <cstdint>
#include <optional>
#include <type_traits>

#include <unsupported/Eigen/CXX11/Tensor>

#include "sdmha/broadcast_ref.hpp"
#include "sdmha/config.hpp"
#include "sdmha/detail/dropout.hpp"
#include "sdmha/errors.hpp"

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

// The precision a layer's kernel is read in (SparseDenseMHA::set_query_kernel_precision):
//  float32   the weights as they are
//  bfloat16  each entry rounded to the nearest bfloat16 (ties to even; Eigen::bfloat16) once,
//            then widened exactly for float32 products and sums: the layer whose kernel is that
//            rounding, for half of the kernel's memory traffic (float layers only)
enum class Precision { float32, bfloat16 };

inline const char* to_string(Precision precision) {
  return precision == Precision::bfloat16 ? "bfloat16" : "float32";
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

// The seeds of dropout, one per training call, from one starting seed: Keras' SeedGenerator,
// PyTorch's generator. A training loop keeps one and points AttentionOptions::dropout_generator
// at it; every training forward then draws the next seed, and the backward of that step reuses
// it (the same mask). draw k (k = 1, 2, …) is mix(seed, k): the same starting seed gives the
// same sequence of masks. A generator serves one layer whose forward is followed by its own
// backward: give each layer its own, and where that order does not hold (gradient
// accumulation, recomputed forwards) pass the forward's result.dropout_seed as dropout_seed to
// the backward, without a generator. forward mutates it: not for concurrent calls.
class DropoutGenerator {
 public:
  explicit DropoutGenerator(std::uint64_t seed = 0) : seed_(seed) {}
  // The next call's seed.
  std::uint64_t next() { return last_ = draw(++draws_); }
  // The seed of the latest draw; the backward of a step uses it.
  std::uint64_t last() const {
    if (draws_ == 0)
      detail::fail<ConfigError>("DropoutGenerator",
                                "no seed drawn yet; expected a training "
                                "forward (or next()) before the backward that reuses its mask");
    return last_;
  }
  std::uint64_t seed() const { return seed_; }
  std::uint64_t draws() const { return draws_; }

 private:
  std::uint64_t draw(std::uint64_t k) const {  // SplitMix64: a Weyl step, then its finaliser
    return detail::mix64(seed_ + k * 0x9e3779b97f4a7c15ULL);
  }
  std::uint64_t seed_;
  std::uint64_t draws_ = 0;
  std::uint64_t last_ = 0;
};

template <typename Scalar>
struct AttentionOptions {
  // true = query step t may attend to key step s (Keras' polarity), as a view of (T, S),
  // (B, T, S), (B, 1, T, S), (B, H, T, S) or (1, H, T, S) booleans (sdmha/broadcast_ref.hpp),
  // never copied; none by default. The caller's tensor must outlive the call. A rank-3 tensor
  // is always (B, T, S): a per-head (H, T, S) one goes in as rank 4, (1, H, T, S).
  BroadcastRef<bool> attention_mask;
  // Added to the scaled scores before the softmax, S = scale·Q·Kᵀ + bias: relative positions,
  // ALiBi, time decay, PyTorch's float attn_mask. Same shapes as attention_mask, a view. −∞
  // blocks a position; a NaN or +∞ makes its row NaN, as in PyTorch. A position blocked by a
  // mask stays blocked whatever its bias.
  BroadcastRef<Scalar> attention_bias;
  // backward also returns ∂loss/∂attention_bias (MhaGradients::attention_bias), in the bias's
  // own shape: summed over the batch entries and heads it is broadcast to, in a fixed order.
  bool compute_bias_gradient = false;
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
  // Worker threads for the work items of every region; 0 means the physical cores available to
  // the process (detail::resolve_thread_count).
  // The output is bitwise the same for any value.
  int num_threads = 0;
  ScoreStrategy score_strategy = ScoreStrategy::automatic;
  // Dropout on the attention probabilities, applied only when `training` is true (Keras'
  // training=True): after the softmax, before the values; attention_scores are returned before
  // dropout. 0 <= dropout_rate < 1. The mask is a function of (seed, b, h, t, s). The seed is
  // the next draw of *dropout_generator in a training forward and its latest draw in backward
  // (a fresh mask every step, the step's own in its backward), or dropout_seed when there is no
  // generator (then the same options give the same mask on every call).
  bool training = false;
  double dropout_rate = 0.0;
  std::uint64_t dropout_seed = 0;
  DropoutGenerator* dropout_generator = nullptr;
};

// Keys and values already projected (K = key·Wk + bk, V = value·Wv + bv): made once by a layer's
// project_context and reused by forward against many query batches over the same context.
template <typename Scalar>
struct ProjectedContext {
  Index batch = 0;           // B
  Index key_steps = 0;       // S
  RowMatrix<Scalar> keys;    // B·S × H·Dk, row b·S + s
  RowMatrix<Scalar> values;  // B·S × H·Dv

  // Appends the key steps of `more` (the same layer's project_context of the new key and value
  // steps, same batch) after each batch entry's own: the result equals projecting the whole
  // key and value at once (bitwise where the GEMM's sums do not depend on the row count, as in
  // the float AVX-512 engine; up to rounding otherwise). Cost O(B·(S + S')·(H·Dk + H·Dv)) copies.
  void append(const ProjectedContext& more) {
    constexpr const char* where = "ProjectedContext::append";
    check_rows(where, "more", more);
    if (more.key_steps == 0 && more.batch == batch) return;
    if (key_steps == 0 && keys.size() == 0 && values.size() == 0) {
      *this = more;  // nothing held yet (a default context, or one of no key steps)
      return;
    }
    check_rows(where, "this context", *this);
    if (more.batch != batch)
      detail::fail<ShapeError>(where, "more has batch ", more.batch, "; expected ", batch);
    if (more.keys.cols() != keys.cols() || more.values.cols() != values.cols())
      detail::fail<ShapeError>(where, "more has key and value widths ", more.keys.cols(), " and ",
                               more.values.cols(), "; expected this context's ", keys.cols(),
                               " and ", values.cols(), " (the same layer)");
    keys = interleave(keys, key_steps, more.keys, more.key_steps);
    values = interleave(values, key_steps, more.values, more.key_steps);
    key_steps += more.key_steps;
  }

 private:
  static void check_rows(const char* where, const char* name, const ProjectedContext& context) {
    if (context.batch < 0 || context.key_steps < 0 ||
        context.keys.rows() != context.batch * context.key_steps ||
        context.values.rows() != context.keys.rows())
      detail::fail<ShapeError>(where, name, " has keys and values of ", context.keys.rows(),
                               " and ", context.values.rows(),
                               " rows; expected batch * key_steps = ", context.batch, " x ",
                               context.key_steps);
  }

  RowMatrix<Scalar> interleave(const RowMatrix<Scalar>& first, Index first_steps,
                               const RowMatrix<Scalar>& second, Index second_steps) const {
    RowMatrix<Scalar> joined(batch * (first_steps + second_steps), first.cols());
    for (Index b = 0; b < batch; ++b) {
      joined.middleRows(b * (first_steps + second_steps), first_steps) =
          first.middleRows(b * first_steps, first_steps);
      joined.middleRows(b * (first_steps + second_steps) + first_steps, second_steps) =
          second.middleRows(b * second_steps, second_steps);
    }
    return joined;
  }
};

template <typename Scalar>
struct AttentionResult {
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> output;            // (B, T, O)
  Eigen::Tensor<Scalar, 4, Eigen::RowMajor> attention_scores;  // (B, H, T, S) or empty
  std::uint64_t dropout_seed = 0;  // the seed of the call's dropout mask (0 without dropout)
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
