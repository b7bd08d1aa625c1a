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
  // neither overflow nor lose the largest term. Blocked keys must come out as exactly 0, but
  // Eigen's vectorised exp clamps its argument and turns exp(−∞) into a denormal (which would let
  // 0·NaN from a blocked value row through), and Eigen 3.4's select() is not vectorised. So the
  // exp stays vectorised and a plain loop, which the compiler vectorises, flushes every result
  // below the smallest normal number to 0: that catches the clamped exp(−∞), and the only
  // genuine probabilities it zeroes are below e⁻⁸⁷ (float) or e⁻⁷⁰⁸ (double) of the row's
  // largest, far below the precision of the sum.
  void operator()(const Arguments& args) const {
    constexpr Scalar minus_infinity = -std::numeric_limits<Scalar>::infinity();
    constexpr Scalar smallest_normal = std::numeric_limits<Scalar>::min();
    const Index columns = args.scores.cols();
    for (Index t = 0; t < args.scores.rows(); ++t) {
      auto row = args.scores.row(t).array();
      const Scalar row_max = columns == 0 ? minus_infinity : row.maxCoeff();
      if (row_max == minus_infinity) {
        row.setZero();
        continue;
      }
      row = (row - row_max).exp();
      Scalar* probabilities = args.scores.row(t).data();
      for (Index s = 0; s < columns; ++s)
        probabilities[s] = probabilities[s] < smallest_normal ? Scalar(0) : probabilities[s];
      row *= Scalar(1) / row.sum();
    }
  }
};

}  // namespace sdmha
