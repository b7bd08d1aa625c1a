// sdmha/stages/query_projection.hpp — SparseQueryProjection: the query projection from CSR.
//
//   math:  Q = X·Wq + bq, X sparse (rows × Eq, CSR), Wq dense row-major (Eq × N), bq (N) or none
//   pre:   X validated (columns in [0, Eq)); Wq has Eq rows; Q is rows × N
//   cost:  O(nnz(X)·N) flops, reading one row of Wq per stored value; X is never densified
#pragma once

#include "sdmha/config.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/sparse_query.hpp"

namespace sdmha {

template <typename Scalar, typename StorageIndex = int>
struct SparseQueryProjection {
  using ScalarType = Scalar;
  using StorageIndexType = StorageIndex;

  struct Arguments {
    CsrView<Scalar, StorageIndex> query;  // rows × Eq
    ConstMatrixRef<Scalar> kernel;        // Eq × N, row-major: a stored value reads one contiguous row
    ConstVectorRef<Scalar> bias;          // N, or empty for no bias
    mutable MatrixRef<Scalar> output;             // rows × N
  };

  static void can_implement(const Arguments& args) {
    constexpr const char* where = "SparseQueryProjection";
    if (args.kernel.rows() != args.query.cols)
      detail::fail<ShapeError>(where, "kernel has ", args.kernel.rows(),
                               " rows; expected the query's feature width ", args.query.cols);
    if (args.bias.size() != 0 && args.bias.size() != args.kernel.cols())
      detail::fail<ShapeError>(where, "bias has ", args.bias.size(), " entries; expected 0 or ",
                               args.kernel.cols());
    if (args.output.rows() != args.query.rows || args.output.cols() != args.kernel.cols())
      detail::fail<ShapeError>(where, "output is ", args.output.rows(), " x ", args.output.cols(),
                               "; expected ", args.query.rows, " x ", args.kernel.cols());
  }

  // Row by row: the output row starts as the bias and accumulates value · Wq[column] for each
  // stored value, so that it stays in L1 while the row's nonzeros stream through it.
  void operator()(const Arguments& args) const {
    const auto& query = args.query;
    for (Index row = 0; row < query.rows; ++row) {
      auto out = args.output.row(row);
      if (args.bias.size() != 0) {
        out = args.bias.transpose();
      } else {
        out.setZero();
      }
      for (Index k = query.row_begin(row); k < query.row_end(row); ++k)
        out.noalias() += query.values[k] * args.kernel.row(query.column_indices[k]);
    }
  }
};

}  // namespace sdmha
