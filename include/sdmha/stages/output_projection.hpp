// sdmha/stages/output_projection.hpp — OutputProjection: the concatenated heads to the output.
//
//   math:  Y = A·Wo + bo, A = [A_0 … A_{H−1}] (rows × H·Dv), Wo (H·Dv × O), bo (O) or none
//   pre:   A has H·Dv columns; Y is rows × O
//   cost:  2·rows·H·Dv·O flops in one GEMM; backward as DenseProjection's (dWo = Aᵀ·dY, dA =
//   dY·Woᵀ)
#pragma once

#include "sdmha/stages/dense_projection.hpp"

namespace sdmha {

// The same computation as the key and value projections; a type of its own so that a layer can
// swap one without the other.
template <typename Scalar>
struct OutputProjection : NamedDenseProjection<Scalar, OutputProjection<Scalar>> {
  static constexpr const char* kName = "OutputProjection";
};

}  // namespace sdmha
