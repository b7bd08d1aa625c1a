// sdmha/stages/masked_softmax.hpp — MaskedSoftmax: probabilities over keys, in place, and the
// softmax's backward.
//
//   math:  P[t, s] = exp(S[t, s] − m_t) / Σ_s' exp(S[t, s'] − m_t), m_t = max_s S[t, s];
//          a row whose scores are all −∞ (every key blocked) gets P[t, ·] = 0 (Keras 3), or 1/keys
//          with FullyMaskedRows::uniform; a NaN or +∞ score makes its row NaN (among blocked
//          keys too)
//   pre:   blocked positions hold −∞ (ScoreKernel's convention); S is rows × keys, all keys of
//          its rows
//   cost:  O(rows·keys) exponentials
//
// Backward: dS = P ⊙ (dP − rowsum(P ⊙ dP)), exactly 0 wherever P = 0 (blocked entries, fully
// blocked rows), in place of dP; 0 on the rows flagged fully blocked (the uniform policy's rows,
// whose P does not depend on the scores).
#pragma once

#include <limits>

#include "sdmha/config.hpp"
#include "sdmha/detail/softmax_exp.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/options.hpp"
#include "sdmha/stage.hpp"

namespace sdmha {

template <typename Scalar>
struct MaskedSoftmax {
  using ScalarType = Scalar;
  using differentiates = MaskedSoftmax;
  // The forward may compute this math online, over key tiles (detail/attention_tile.hpp), for
  // long key ranges. Named, like `differentiates`, so that a stage derived from this one does not
  // inherit it: a custom softmax gets whole rows unless it declares the same of itself.
  using computes_online = MaskedSoftmax;

  struct Arguments : TilePosition {
    mutable MatrixRef<Scalar> scores;  // rows × keys, scores in, probabilities out
    StageScratch workspace = {};
    FullyMaskedRows fully_masked_rows = FullyMaskedRows::zeros;  // with uniform, keys must be all S
  };

  struct BackwardArguments : TilePosition {
    ConstMatrixRef<Scalar> probabilities;  // rows × keys, P as the forward gave it
    mutable MatrixRef<Scalar> d_scores;    // rows × keys: dP in, dS out
    // false: dP may hold NaN/Inf where P = 0 (from a blocked non-finite value row); those
    // entries are then set to 0 instead of multiplied.
    bool d_probabilities_are_finite = true;
    StageScratch workspace = {};
    const char* fully_masked = nullptr;  // per row: nonzero where every key was blocked, or none
  };

  static void can_implement(const Arguments&) {}
  static void can_implement(const BackwardArguments& args) {
    if (args.d_scores.rows() != args.probabilities.rows() ||
        args.d_scores.cols() != args.probabilities.cols())
      detail::fail<ShapeError>("MaskedSoftmax (backward)", "d_scores is ", args.d_scores.rows(),
                               " x ", args.d_scores.cols(), "; expected the probabilities' ",
                               args.probabilities.rows(), " x ", args.probabilities.cols());
  }

  // Subtracting the row maximum keeps every exponent ≤ 0, so logits of any size (±1e4 and more)
  // neither overflow nor lose the largest term. Blocked keys come out as exactly 0
  // (detail::exponentiate_shifted flushes below the smallest normal number).
  void operator()(const Arguments& args) const {
    constexpr Scalar minus_infinity = -std::numeric_limits<Scalar>::infinity();
    const Index columns = args.scores.cols();
    for (Index t = 0; t < args.scores.rows(); ++t) {
      auto row = args.scores.row(t).array();
      const Scalar row_max = detail::row_maximum(args.scores.row(t).data(), columns);
      if (row_max == minus_infinity) {
        if (row.isNaN().any())  // a NaN among blocked keys: the row is NaN, as everywhere else
          row.setConstant(std::numeric_limits<Scalar>::quiet_NaN());
        else if (args.fully_masked_rows == FullyMaskedRows::uniform && columns > 0)
          row.setConstant(Scalar(1) / Scalar(columns));
        else
          row.setZero();
        continue;
      }
      const Scalar sum = detail::exponentiate_shifted(args.scores.row(t).data(), columns, row_max);
      row *= Scalar(1) / sum;
    }
  }

  // With a finite dP, P·(…) is 0 where P = 0 by itself (a packet loop); otherwise dP may be NaN
  // where P = 0, and those entries are set, not multiplied.
  void backward(const BackwardArguments& args) const {
    for (Index t = 0; t < args.d_scores.rows(); ++t) {
      auto p = args.probabilities.row(t).array();
      auto d = args.d_scores.row(t).array();
      if (args.fully_masked != nullptr && args.fully_masked[t]) {
        d.setZero();
        continue;
      }
      if (args.d_probabilities_are_finite) {
        const Scalar weighted = (p * d).sum();
        d = p * (d - weighted);
      } else {
        const Scalar weighted = (p != Scalar(0)).select(p * d, Scalar(0)).sum();
        d = (p != Scalar(0)).select(p * (d - weighted), Scalar(0));
      }
    }
  }
};

}  // namespace sdmha
