// sdmha/stages/query_kernel_gradient.hpp — QueryKernelGradient: the gradient of the loss with
// respect to the query kernel, the sparse query transposed times the projected query's gradient.
//
//   math:  dWq = Xᵀ·dQ, X sparse (rows × Eq, CSR), dQ dense (rows × N), dWq (Eq × N)
//   pre:   X validated (columns in [0, Eq)); dQ X.rows × N; dWq Eq × N (overwritten), or with
//          X's CSC given, a block of its rows
//   cost:  2·nnz(X)·N flops plus Eq·N to clear dWq; X is neither densified nor transposed here
//
// By rows: row r of X scatters x_rc·dQ[r, :] into row c of dWq. Rows are visited in order, so
// every entry of dWq is a sum in a fixed order: a caller that splits N into column panels (each
// panel its own dWq block) gets the same bits for any split and any thread count. When dWq is
// far beyond L2 (`bow`: 32768 × 512, 64 MB), each stored value then reads and writes a random
// row of it, and clearing it first is one more pass.
// By features, given X's CSC (detail::build_feature_groups over all of X's rows, for
// detail::query_gradients_by_feature shapes): row c of dWq is Σ x_rc·dQ[r, :] over the feature's
// entries, accumulated in L1 and written once, rows in order; the random reads go to dQ, which
// is the smaller. The CSC keeps CSR order within a feature, so each sum has the terms, and the
// order, of the by-rows loop; a caller may split the features into blocks (each its own rows of
// dWq) for any thread count.
#pragma once

#include "sdmha/config.hpp"
#include "sdmha/detail/csr_dense_product.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/sparse_query.hpp"

namespace sdmha {

template <typename Scalar, typename StorageIndex = int>
struct QueryKernelGradient {
  using ScalarType = Scalar;
  using StorageIndexType = StorageIndex;
  using FeatureGroups = detail::CsrProductScratch<Scalar, StorageIndex>;

  struct Arguments {
    CsrView<Scalar, StorageIndex> query;  // rows × Eq
    ConstMatrixRef<Scalar> d_query;       // rows × N (may be a column panel)
    mutable MatrixRef<Scalar> d_kernel;   // Eq × N (the matching column panel), or see below
    // Optional: X's CSC. Then the loop goes by feature and d_kernel holds rows
    // [first_feature, first_feature + d_kernel.rows()) of dWq.
    const FeatureGroups* feature_groups = nullptr;
    Index first_feature = 0;
  };

  static void can_implement(const Arguments& args) {
    constexpr const char* where = "QueryKernelGradient";
    if (args.d_query.rows() != args.query.rows)
      detail::fail<ShapeError>(where, "d_query has ", args.d_query.rows(), " rows; expected ",
                               args.query.rows, " (one per query row)");
    if (args.feature_groups == nullptr) {
      if (args.d_kernel.rows() != args.query.cols || args.d_kernel.cols() != args.d_query.cols())
        detail::fail<ShapeError>(where, "d_kernel is ", args.d_kernel.rows(), " x ",
                                 args.d_kernel.cols(), "; expected ", args.query.cols, " x ",
                                 args.d_query.cols());
      return;
    }
    if (args.d_kernel.cols() != args.d_query.cols())
      detail::fail<ShapeError>(where, "d_kernel has ", args.d_kernel.cols(),
                               " columns; expected d_query's ", args.d_query.cols());
    detail::check_feature_groups(where, args.query, *args.feature_groups, false);
    if (args.first_feature < 0 || args.first_feature + args.d_kernel.rows() > args.query.cols)
      detail::fail<ShapeError>(where, "d_kernel holds features [", args.first_feature, ", ",
                               args.first_feature + args.d_kernel.rows(), "); expected a range in [0, ",
                               args.query.cols, ")");
  }

  void operator()(const Arguments& args) const {
    if (args.feature_groups != nullptr) {
      by_feature(args);
      return;
    }
    const auto& query = args.query;
    args.d_kernel.setZero();
    for (Index row = 0; row < query.rows; ++row) {
      const auto d_query_row = args.d_query.row(row);
      for (Index k = query.row_begin(row); k < query.row_end(row); ++k)
        args.d_kernel.row(query.column_indices[k]).noalias() += query.values[k] * d_query_row;
    }
  }

 private:
  static void by_feature(const Arguments& args) {
    const auto* offsets = args.feature_groups->feature_offsets.data();
    const auto* entries = args.feature_groups->entries.data();
    for (Index i = 0; i < args.d_kernel.rows(); ++i) {
      const Index feature = args.first_feature + i;
      auto d_kernel_row = args.d_kernel.row(i);
      d_kernel_row.setZero();
      for (Index k = offsets[feature]; k < offsets[feature + 1]; ++k)
        d_kernel_row.noalias() += entries[k].value * args.d_query.row(Index(entries[k].row));
    }
  }
};

}  // namespace sdmha
