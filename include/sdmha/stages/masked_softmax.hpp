// sdmha/stages/masked_softmax.hpp — MaskedSoftmax: probabilities over keys, in place.
//
//   math:  P[t, s] = exp(S[t, s] − m_t) / Σ_s' exp(S[t, s'] − m_t), m_t = max_s S[t, s];
//          a row whose scores are all −∞ (every key blocked) gets P[t, ·] = 0 (Keras 3)
//   pre:   blocked positions hold −∞ (ScoreKernel's convention); S is T × S
//   cost:  O(T·S) exponentials
#pragma once

#include <limits>

#include "sdmha/config.hpp"

namespace sdmha {

template <typename Scalar>
struct MaskedSoftmax {
  using ScalarType = Scalar;

  struct Arguments {
    mutable MatrixRef<Scalar> scores;  // T × S, scores in, probabilities out
  };

  static void can_implement(const Arguments&) {}

  // Subtracting the row maximum keeps every exponent ≤ 0, so logits of any size (±1e4 and more)
  // neither overflow nor lose the largest term. Blocked keys are set to 0 by a select, not left
  // to exp(−∞): Eigen's vectorised exp clamps its argument and returns a denormal there, which
  // would let 0·NaN from a blocked value row through.
  void operator()(const Arguments& args) const {
    constexpr Scalar minus_infinity = -std::numeric_limits<Scalar>::infinity();
    for (Index t = 0; t < args.scores.rows(); ++t) {
      auto row = args.scores.row(t).array();
      const Scalar row_max = args.scores.cols() == 0 ? minus_infinity : row.maxCoeff();
      if (row_max == minus_infinity) {
        row.setZero();
        continue;
      }
      row = (row == minus_infinity).select(Scalar(0), (row - row_max).exp());
      row *= Scalar(1) / row.sum();
    }
  }
};

}  // namespace sdmha
