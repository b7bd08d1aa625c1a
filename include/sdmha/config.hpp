// sdmha/config.hpp — the library's version, its macros and its basic type aliases.
//
// Every macro of the library is defined here and carries the SDMHA_ prefix.
#pragma once

#include <cassert>

#include <Eigen/Core>

#define SDMHA_VERSION_MAJOR 0
#define SDMHA_VERSION_MINOR 1
#define SDMHA_VERSION_PATCH 0

// SDMHA_ASSERT guards invariants inside inner loops, which run on data already validated at the
// boundary. It is compiled out under NDEBUG; define it before including sdmha to make it throw
// (the tests do) or to route it to your own handler.
#ifndef SDMHA_ASSERT
#define SDMHA_ASSERT(condition) assert(condition)
#endif

namespace sdmha {

using Eigen::Index;

// Row-major dense storage is the library's working layout: a row is one (batch, step) position,
// contiguous, which is what the CSR × dense product and the per-head column blocks want.
template <typename Scalar>
using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename Scalar>
using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;
template <typename Scalar>
using RowVector = Eigen::Matrix<Scalar, 1, Eigen::Dynamic>;

// Views over caller or library memory: a Ref binds to a whole row-major matrix, a Map or a
// column block of one (outer stride ≥ columns, inner stride 1) without copying.
template <typename Scalar>
using ConstMatrixRef = Eigen::Ref<const RowMatrix<Scalar>>;
template <typename Scalar>
using MatrixRef = Eigen::Ref<RowMatrix<Scalar>>;
template <typename Scalar>
using ConstVectorRef = Eigen::Ref<const Vector<Scalar>>;
template <typename Scalar>
using ConstRowVectorRef = Eigen::Ref<const RowVector<Scalar>>;

}  // namespace sdmha
