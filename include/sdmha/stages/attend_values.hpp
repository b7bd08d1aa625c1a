// sdmha/stages/attend_values.hpp — AttendValues: one head's output, P·V_h.
//
//   math:  A_h = P·V_h, written into head h's column block of the concatenated heads
//   pre:   P T × S (rows sum to 1 or are all 0); V_h S × Dv; A_h T × Dv
//   cost:  2·T·S·Dv flops (one GEMM); plus an O(S·Dv) finiteness scan of V_h unless the caller knows
#pragma once

#include <optional>

#include "sdmha/config.hpp"
#include "sdmha/detail/finite.hpp"
#include "sdmha/detail/gemm.hpp"
#include "sdmha/errors.hpp"

namespace sdmha {

template <typename Scalar>
struct AttendValues {
  using ScalarType = Scalar;

  struct Arguments {
    ConstMatrixRef<Scalar> probabilities;  // T × S
    ConstMatrixRef<Scalar> value;          // S × Dv
    mutable MatrixRef<Scalar> output;              // T × Dv
    // Whether every entry of `value` is finite, when the caller knows it already (a layer checks
    // V_h once per (batch, head), not once per query tile); unknown means this stage checks.
    std::optional<bool> value_is_finite = std::nullopt;
  };

  static void can_implement(const Arguments& args) {
    constexpr const char* where = "AttendValues";
    if (args.value.rows() != args.probabilities.cols())
      detail::fail<ShapeError>(where, "value has ", args.value.rows(), " rows; expected ",
                               args.probabilities.cols(), " (one per key step)");
    if (args.output.rows() != args.probabilities.rows() || args.output.cols() != args.value.cols())
      detail::fail<ShapeError>(where, "output is ", args.output.rows(), " x ", args.output.cols(),
                               "; expected ", args.probabilities.rows(), " x ", args.value.cols());
  }

  // A GEMM would turn 0 · NaN into NaN, letting a non-finite value row that is blocked for a
  // query reach that query's output. Such rows are rare, so: one GEMM when V_h is finite, and a
  // product that skips zero probabilities when it is not.
  void operator()(const Arguments& args) const {
    if (args.value_is_finite.has_value() ? *args.value_is_finite
                                         : detail::all_finite<Scalar>(args.value)) {
      detail::gemm<Scalar>(detail::as_operand<Scalar>(args.probabilities),
                           detail::as_operand<Scalar>(args.value), args.output, Scalar(1), false);
      return;
    }
    args.output.setZero();
    for (Index t = 0; t < args.probabilities.rows(); ++t)
      for (Index s = 0; s < args.probabilities.cols(); ++s) {
        const Scalar probability = args.probabilities(t, s);
        if (probability != Scalar(0)) args.output.row(t).noalias() += probability * args.value.row(s);
      }
  }
};

}  // namespace sdmha
