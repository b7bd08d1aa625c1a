// sdmha/stages/query_values_gradient.hpp — QueryValuesGradient: the gradient of the loss with
// respect to the query's stored values, a sampled dense product over the query's pattern.
//
//   math:  dX[r, c] = dQ[r, :]·Wq[c, :] for every stored (r, c) of X, and nowhere else (an SDDMM)
//   pre:   X validated (columns in [0, Eq)); Wq Eq × N; dQ X.rows × N; dX has nnz(X) entries
//   cost:  2·nnz(X)·N flops, one row of Wq and one row of dQ read per stored value
//
// dX is in CSR order: the stored values of row 0, then of row 1, …, without the slack an
// uncompressed Eigen matrix keeps between rows.
#pragma once

#include "sdmha/config.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/sparse_query.hpp"

namespace sdmha {

template <typename Scalar, typename StorageIndex = int>
struct QueryValuesGradient {
  using ScalarType = Scalar;
  using StorageIndexType = StorageIndex;

  struct Arguments {
    CsrView<Scalar, StorageIndex> query;  // rows × Eq: only its pattern is read
    ConstMatrixRef<Scalar> query_kernel;  // Eq × N, row-major: a stored value reads one row
    ConstMatrixRef<Scalar> d_query;       // rows × N, the gradient of the projected query
    mutable Eigen::Ref<Vector<Scalar>> d_values;  // nnz(X), one per stored value in CSR order
  };

  static void can_implement(const Arguments& args) {
    constexpr const char* where = "QueryValuesGradient";
    if (args.query_kernel.rows() != args.query.cols)
      detail::fail<ShapeError>(where, "query_kernel has ", args.query_kernel.rows(),
                               " rows; expected the query's feature width ", args.query.cols);
    if (args.d_query.rows() != args.query.rows || args.d_query.cols() != args.query_kernel.cols())
      detail::fail<ShapeError>(where, "d_query is ", args.d_query.rows(), " x ",
                               args.d_query.cols(), "; expected ", args.query.rows, " x ",
                               args.query_kernel.cols());
    if (args.d_values.size() != args.query.nonzeros())
      detail::fail<ShapeError>(where, "d_values has ", args.d_values.size(),
                               " entries; expected one per stored value, ", args.query.nonzeros());
  }

  void operator()(const Arguments& args) const {
    const auto& query = args.query;
    Index position = 0;
    for (Index row = 0; row < query.rows; ++row) {
      const auto d_query_row = args.d_query.row(row);
      for (Index k = query.row_begin(row); k < query.row_end(row); ++k)
        args.d_values[position++] = d_query_row.dot(args.query_kernel.row(query.column_indices[k]));
    }
  }
};

}  // namespace sdmha
