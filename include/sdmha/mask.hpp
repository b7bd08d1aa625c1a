// sdmha/mask.hpp — BatchMask: the ANDed attention mask of one batch entry, and the convention
// that carries it through the pipeline: a blocked score is −∞.
//
// The score kernel writes −∞ at every blocked (t, s), overwriting whatever it computed there (so
// a NaN or Inf from a blocked key row is gone), and the softmax gives −∞ a probability of exactly
// zero; a row that is −∞ everywhere gets all-zero probabilities.
#pragma once

#include <limits>

#include "sdmha/config.hpp"

namespace sdmha {

struct BatchMask {
  const bool* attention = nullptr;    // T × S row-major, true = may attend; nullptr = none
  const bool* key_padding = nullptr;  // S, true = padding; nullptr = none
  bool causal = false;                // s <= t only
  Index steps = 0;                    // T
  Index key_steps = 0;                // S

  bool empty() const { return attention == nullptr && key_padding == nullptr && !causal; }

  bool allowed(Index t, Index s) const {
    if (causal && s > t) return false;
    if (key_padding != nullptr && key_padding[s]) return false;
    return attention == nullptr || attention[t * key_steps + s];
  }
};

// Writes −∞ into every blocked entry of `scores` (T × S). Cost O(T·S) when a mask is present.
template <typename Scalar>
void apply_mask(const BatchMask& mask, MatrixRef<Scalar> scores) {
  if (mask.empty()) return;
  SDMHA_ASSERT(scores.rows() == mask.steps && scores.cols() == mask.key_steps);
  constexpr Scalar blocked = -std::numeric_limits<Scalar>::infinity();
  for (Index t = 0; t < scores.rows(); ++t) {
    Scalar* row = scores.row(t).data();
    const bool* allowed_row = mask.attention == nullptr ? nullptr : mask.attention + t * mask.key_steps;
    for (Index s = 0; s < scores.cols(); ++s) {
      const bool keep = (!mask.causal || s <= t) &&
                        (mask.key_padding == nullptr || !mask.key_padding[s]) &&
                        (allowed_row == nullptr || allowed_row[s]);
      if (!keep) row[s] = blocked;
    }
  }
}

}  // namespace sdmha
