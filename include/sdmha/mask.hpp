// sdmha/mask.hpp — BatchMask: the ANDed masks of one tile of one (batch entry, head), and the
// convention that carries it through the pipeline: a blocked score is −∞.
//
// The score kernel writes −∞ at every blocked (t, s), overwriting whatever it computed there (so
// a NaN or Inf from a blocked key row is gone), and the softmax gives −∞ a probability of exactly
// zero; a row that is −∞ everywhere gets all-zero probabilities.
#pragma once

#include <limits>

#include "sdmha/config.hpp"

namespace sdmha {

// The mask of one block of scores: rows t = 0 … steps − 1 and columns s = 0 … key_steps − 1 of
// the block are the query steps first_step + t and key steps first_key_step + s of one batch
// entry (a whole (T × S) matrix has both offsets 0).
struct BatchMask {
  const bool* attention = nullptr;  // the block's (0, 0) in a row-major mask; nullptr = none
  const bool* key_mask = nullptr;   // the block's column 0 in its (S) key mask row; nullptr = none
  bool causal = false;              // key step <= query step + causal_offset only
  Index causal_offset = 0;          // 0 (top-left alignment) or S − T (bottom-right)
  Index steps = 0;                  // rows of the block
  Index key_steps = 0;              // columns of the block
  Index first_step = 0;             // query step of row 0 (for causal)
  Index first_key_step = 0;         // key step of column 0 (for causal)
  Index attention_stride = 0;       // distance between rows of `attention`; 0 means key_steps

  bool empty() const { return attention == nullptr && key_mask == nullptr && !causal; }

  Index row_stride() const { return attention_stride == 0 ? key_steps : attention_stride; }

  bool allowed(Index t, Index s) const {
    if (causal && first_key_step + s > first_step + t + causal_offset) return false;
    if (key_mask != nullptr && !key_mask[s]) return false;
    return attention == nullptr || attention[t * row_stride() + s];
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
    const bool* allowed_row =
        mask.attention == nullptr ? nullptr : mask.attention + t * mask.row_stride();
    // Causal: key steps up to the query step (plus the offset) stay; so column s stays while
    // s <= causal_limit.
    const Index causal_limit = mask.first_step + t + mask.causal_offset - mask.first_key_step;
    for (Index s = 0; s < scores.cols(); ++s) {
      const bool keep = (!mask.causal || s <= causal_limit) &&
                        (mask.key_mask == nullptr || mask.key_mask[s]) &&
                        (allowed_row == nullptr || allowed_row[s]);
      if (!keep) row[s] = blocked;
    }
  }
}

}  // namespace sdmha
