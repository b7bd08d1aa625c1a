// sdmha/stages/attend_values.hpp — AttendValues: one head's output P·V_h, and its backward.
//
//   math:  A_h = P·V_h, written into head h's column block of the concatenated heads
//   pre:   P rows × keys (rows sum to 1 or are all 0, or after dropout); V_h keys × Dv; A_h rows ×
//   Dv cost:  2·rows·keys·Dv flops (one GEMM); plus an O(keys·Dv) finiteness scan of V_h unless the
//   caller knows
//
// Backward, given dA_h: dP = dA_h·V_hᵀ (overwritten), dV_h += Pᵀ·dA_h (accumulated over tiles).
#pragma once

#include <algorithm>
#include <optional>
#include <type_traits>

#include "sdmha/config.hpp"
#include "sdmha/detail/finite.hpp"
#include "sdmha/detail/gemm.hpp"
#include "sdmha/detail/gemm_amx.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/stage.hpp"

namespace sdmha {

template <typename Scalar>
struct AttendValues {
  using ScalarType = Scalar;
  using differentiates = AttendValues;
  // Honours Arguments::accumulate, so the forward may run the online softmax over key tiles
  // (see MaskedSoftmax); not inherited by a stage derived from this one.
  using computes_online = AttendValues;

  struct Arguments : TilePosition {
    ConstMatrixRef<Scalar> probabilities;  // rows × keys
    ConstMatrixRef<Scalar> value;          // keys × Dv
    mutable MatrixRef<Scalar> output;      // rows × Dv
    // Whether every entry of `value` is finite, when the caller knows it already (the layer
    // checks the rows its tile reads); unknown means this stage checks.
    std::optional<bool> value_is_finite = std::nullopt;
    StageScratch workspace = {};
    // Float only: with V_h finite, A_h = bf16(P)·bf16(V_h), the operands rounded to bfloat16,
    // each product exact and the sums in float32 (detail::gemm_bfloat16_operands).
    BFloat16Operands bfloat16_operands = false;
    // Whether the product adds into `output` (the online softmax's key tiles, which sum into
    // their rows) instead of overwriting it.
    bool accumulate = false;
  };

  struct BackwardArguments : TilePosition {
    ConstMatrixRef<Scalar> probabilities;       // rows × keys, as they met the values
    ConstMatrixRef<Scalar> value;               // keys × Dv
    ConstMatrixRef<Scalar> d_output;            // rows × Dv, ∂loss/∂A_h of the tile
    mutable MatrixRef<Scalar> d_probabilities;  // rows × keys, overwritten
    mutable MatrixRef<Scalar> d_value;          // keys × Dv, accumulated into
    StageScratch workspace = {};
  };

  static std::size_t workspace_size(const TileSizes& sizes) {
    const Index rows = sizes.rows, keys = sizes.key_steps, width = sizes.value_dim;
    return std::max({detail::gemm_workspace_size<Scalar>(rows, width, keys),
                     detail::gemm_workspace_size<Scalar>(rows, keys, width),
                     detail::gemm_workspace_size<Scalar>(keys, width, rows),
                     sizes.bfloat16_operands
                         ? detail::bfloat16_operands_workspace_size(rows, width, keys)
                         : 0});
  }

  static void can_implement(const Arguments& args) {
    constexpr const char* where = "AttendValues";
    if (args.value.rows() != args.probabilities.cols())
      detail::fail<ShapeError>(where, "value has ", args.value.rows(), " rows; expected ",
                               args.probabilities.cols(), " (one per key step)");
    if (args.output.rows() != args.probabilities.rows() || args.output.cols() != args.value.cols())
      detail::fail<ShapeError>(where, "output is ", args.output.rows(), " x ", args.output.cols(),
                               "; expected ", args.probabilities.rows(), " x ", args.value.cols());
    detail::check_bfloat16_operands<Scalar>(where, args.bfloat16_operands);
  }

  static void can_implement(const BackwardArguments& args) {
    constexpr const char* where = "AttendValues (backward)";
    const Index rows = args.probabilities.rows(), keys = args.probabilities.cols();
    if (args.value.rows() != keys)
      detail::fail<ShapeError>(where, "value has ", args.value.rows(), " rows; expected ", keys);
    if (args.d_output.rows() != rows || args.d_output.cols() != args.value.cols())
      detail::fail<ShapeError>(where, "d_output is ", args.d_output.rows(), " x ",
                               args.d_output.cols(), "; expected ", rows, " x ", args.value.cols());
    if (args.d_probabilities.rows() != rows || args.d_probabilities.cols() != keys)
      detail::fail<ShapeError>(where, "d_probabilities is ", args.d_probabilities.rows(), " x ",
                               args.d_probabilities.cols(), "; expected ", rows, " x ", keys);
    if (args.d_value.rows() != keys || args.d_value.cols() != args.value.cols())
      detail::fail<ShapeError>(where, "d_value is ", args.d_value.rows(), " x ",
                               args.d_value.cols(), "; expected ", keys, " x ", args.value.cols());
  }

  // A GEMM would turn 0 · NaN into NaN, letting a non-finite value row that is blocked for a
  // query reach that query's output. Such rows are rare, so: one GEMM when V_h is finite, and a
  // product that skips zero probabilities when it is not.
  void operator()(const Arguments& args) const { multiply(args, args.accumulate); }

  // output (+)= P·V_h (`accumulate`: the online softmax's key tiles add into their rows).
  // With bfloat16_operands, `value_is_finite` must also say that V_h stays finite when rounded
  // (detail::all_finite_doubled, which the stage uses when it is not given): a float value that
  // rounds to ±∞ would turn a zero probability's product into NaN.
  static void multiply(const Arguments& args, bool accumulate) {
    const bool finite = args.value_is_finite.has_value() ? *args.value_is_finite
                        : args.bfloat16_operands ? detail::all_finite_doubled<Scalar>(args.value)
                                                 : detail::all_finite<Scalar>(args.value);
    if (finite) {
      if constexpr (std::is_same<Scalar, float>::value) {
        if (args.bfloat16_operands) {
          detail::gemm_bfloat16_operands(args.probabilities, args.value, false, args.output,
                                         accumulate, args.workspace, 1.f, args.bfloat16_operands);
          return;
        }
      }
      detail::gemm<Scalar>(detail::as_operand<Scalar>(args.probabilities),
                           detail::as_operand<Scalar>(args.value), args.output, Scalar(1),
                           accumulate, args.workspace);
      return;
    }
    if (!accumulate) args.output.setZero();
    for (Index t = 0; t < args.probabilities.rows(); ++t)
      for (Index s = 0; s < args.probabilities.cols(); ++s) {
        const Scalar probability = args.probabilities(t, s);
        if (probability != Scalar(0))
          args.output.row(t).noalias() += probability * args.value.row(s);
      }
  }

  // dP may hold NaN where V_h does; the softmax's backward zeroes it where P = 0 (told so by its
  // d_probabilities_are_finite). dV_h's rows for keys that no query attends get 0·dA = 0.
  void backward(const BackwardArguments& args) const {
    detail::gemm<Scalar>(detail::as_operand<Scalar>(args.d_output),
                         detail::transposed<Scalar>(args.value), args.d_probabilities, Scalar(1),
                         false, args.workspace);
    detail::gemm<Scalar>(detail::transposed<Scalar>(args.probabilities),
                         detail::as_operand<Scalar>(args.d_output), args.d_value, Scalar(1), true,
                         args.workspace);
  }
};

}  // namespace sdmha
