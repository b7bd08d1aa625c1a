// sdmha/stages/context_projection.hpp — ContextProjection: the key and the value to K and V.
//
//   math:  K = key·Wk + bk, V = value·Wv + bv; key (B·S × Ek), Wk (Ek × H·Dk), bk (H·Dk) or none
//   pre:   key has Ek columns, value Ev; K is B·S × H·Dk, V is B·S × H·Dv
//   cost:  2·B·S·(Ek·H·Dk + Ev·H·Dv) flops in two GEMMs; backward as DenseProjection's (dWk =
//   keyᵀ·dK, dkey = dK·Wkᵀ; likewise V)
#pragma once

#include "sdmha/stages/dense_projection.hpp"

namespace sdmha {

// The computation of DenseProjection, once for the key and once for the value; a type of its own
// so that a layer can swap it without the output projection, and names it in its errors.
template <typename Scalar>
struct ContextProjection : NamedDenseProjection<Scalar, ContextProjection<Scalar>> {
  static constexpr const char* kName = "ContextProjection";
};

}  // namespace sdmha
