// sdmha/options.hpp — AttentionOptions (masks, bias, scale, threads, score strategy, dropout), the
// enumerations they take, and DropoutGenerator.
#pragma once

#include <cstdint>
#include <optional>
#include <type_traits>

#include <unsupported/Eigen/CXX11/Tensor>

#include "sdmha/broadcast_ref.hpp"
#include "sdmha/config.hpp"
#include "sdmha/detail/dropout.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/tensor_ref.hpp"

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

// The precision of a layer's kernels (SparseDenseMHA::set_precision), float layers only for the
// bfloat16 modes:
//  float32                the weights as they are
//  bfloat16               every kernel rounded to the nearest bfloat16 (ties to even) once, the
//                         projections, scores and P·V on bfloat16 operands with float32 sums
//  bfloat16_query_kernel  only Wq rounded, widened exactly for float32 products and sums: the
//                         layer whose Wq is that rounding, for half of Wq's memory traffic
enum class Precision { float32, bfloat16, bfloat16_query_kernel };

inline const char* to_string(Precision precision) {
  if (precision == Precision::bfloat16_query_kernel) return "bfloat16_query_kernel";
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

// The inputs whose gradients backward returns (the weights' it always returns): one left out
// comes back empty in MhaGradients and its work is skipped. ∂loss/∂key and ∂loss/∂value cost
// what the K and V projections cost (B·S·E·H·D multiply-adds each): leave them out where key and
// value are data, not parameters, as in most training.
struct InputGradients {
  bool query_values = true;
  bool key = true;
  bool value = true;
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
  // The inputs whose gradients backward returns (InputGradients; all by default).
  InputGradients input_gradients;
  // Keras' use_causal_mask: step t may attend to key steps s <= t (T and S may differ), or
  // s <= t + S − T with causal_alignment = bottom_right.
  bool use_causal_mask = false;
  CausalAlignment causal_alignment = CausalAlignment::top_left;
  // The factor on the scores, S = scale·Q·Kᵀ; unset means 1/√key_dim (Keras). PyTorch's
  // scaled_dot_product_attention(scale=…). Must be finite.
  std::optional<double> scale;
  FullyMaskedRows fully_masked_rows = FullyMaskedRows::zeros;
  // (B, S), true = key step s of batch entry b may be attended (attention_mask's polarity; the
  // negation of PyTorch's key_padding_mask), a view, never copied; none by default. All masks
  // are ANDed.
  TensorRef<bool, 2> key_mask;
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

}  // namespace sdmha
