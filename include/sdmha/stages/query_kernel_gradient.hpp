// sdmha/stages/query_kernel_gradient.hpp — QueryKernelGradient: the gradient of the loss with
// respect to the query kernel, the sparse query transposed times the projected query's gradient.
//
//   math:  dWq = Xᵀ·dQ, X sparse (rows × Eq, CSR), dQ dense (rows × N), dWq (Eq × N)
//   pre:   X validated (columns in [0, Eq)); dQ X.rows × N; dWq Eq × N (overwritten)
//   cost:  2·nnz(X)·N flops plus Eq·N to clear dWq; X is neither densified nor transposed
//
// Row r of X scatters x_rc·dQ[r, :] into row c of dWq. Rows are visited in order, so every entry
// of dWq is a sum in a fixed order: a caller that splits N into column panels (each panel its
// own dWq block) gets the same bits for any split and any thread count.
#pragma once

#include "sdmha/config.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/sparse_query.hpp"

namespace sdmha {

template <typename Scalar, typename StorageIndex = int>
struct QueryKernelGradient {
  using ScalarType = Scalar;
  using StorageIndexType = StorageIndex;

  struct Arguments {
    CsrView<Scalar, StorageIndex> query;  // rows × Eq
    ConstMatrixRef<Scalar> d_query;       // rows × N (may be a column panel)
    mutable MatrixRef<Scalar> d_kernel;   // Eq × N (the matching column panel)
  };

  static void can_implement(const Arguments& args) {
    constexpr const char* where = "QueryKernelGradient";
    if (args.d_query.rows() != args.query.rows)
      detail::fail<ShapeError>(where, "d_query has ", args.d_query.rows(), " rows; expected ",
                               args.query.rows, " (one per query row)");
    if (args.d_kernel.rows() != args.query.cols || args.d_kernel.cols() != args.d_query.cols())
      detail::fail<ShapeError>(where, "d_kernel is ", args.d_kernel.rows(), " x ",
                               args.d_kernel.cols(), "; expected ", args.query.cols, " x ",
                               args.d_query.cols());
  }

  void operator()(const Arguments& args) const {
    const auto& query = args.query;
    args.d_kernel.setZero();
    for (Index row = 0; row < query.rows; ++row) {
      const auto d_query_row = args.d_query.row(row);
      for (Index k = query.row_begin(row); k < query.row_end(row); ++k)
        args.d_kernel.row(query.column_indices[k]).noalias() += query.values[k] * d_query_row;
    }
  }
};

}  // namespace sdmha
