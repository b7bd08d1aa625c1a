// sdmha/stages/query_values_gradient.hpp — QueryValuesGradient: the gradient of the loss with
// respect to the query's stored values, a sampled dense product over the query's pattern.
//
//   math:  dX[r, c] = dQ[r, :]·Wq[c, :] for every stored (r, c) of X, and nowhere else (an SDDMM)
//   pre:   X validated (columns in [0, Eq)); Wq Eq × N; dQ X.rows × N; dX has nnz(X) entries
//   cost:  2·nnz(X)·N flops, one row of Wq and one row of dQ read per stored value
//
// dX is in CSR order: the stored values of row 0, then of row 1, …, without the slack an
// uncompressed Eigen matrix keeps between rows.
// By rows, each stored value reads a random row of Wq: when Wq is far beyond L2 (`bow`: 64 MB)
// that is a miss per stored value. By features, given X's CSC with its entries' CSR positions
// (detail::build_feature_groups(…, true), for detail::query_gradients_by_feature shapes), each
// used row of Wq is read once, in order, against the dQ rows of its entries, and each result goes
// to its CSR position; a caller may split the features into blocks, whose positions are
// disjoint. Each entry is the same dot product either way.
#pragma once

#include "sdmha/config.hpp"
#include "sdmha/detail/csr_dense_product.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/sparse_query.hpp"

namespace sdmha {

template <typename Scalar, typename StorageIndex = int>
struct QueryValuesGradient {
  using ScalarType = Scalar;
  using StorageIndexType = StorageIndex;
  using FeatureGroups = detail::CsrProductScratch<Scalar, StorageIndex>;

  struct Arguments {
    CsrView<Scalar, StorageIndex> query;  // rows × Eq: only its pattern is read
    ConstMatrixRef<Scalar> query_kernel;  // Eq × N, row-major: a stored value reads one row
    ConstMatrixRef<Scalar> d_query;       // rows × N, the gradient of the projected query
    mutable Eigen::Ref<Vector<Scalar>> d_values;  // nnz(X), one per stored value in CSR order
    // Optional: X's CSC with positions. Then the loop goes by feature over
    // [first_feature, first_feature + feature_count) and writes those features' entries only.
    const FeatureGroups* feature_groups = nullptr;
    Index first_feature = 0, feature_count = 0;
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
    if (args.feature_groups == nullptr) return;
    detail::check_feature_groups(where, args.query, *args.feature_groups, true);
    if (args.first_feature < 0 || args.feature_count < 0 ||
        args.first_feature + args.feature_count > args.query.cols)
      detail::fail<ShapeError>(where, "features [", args.first_feature, ", ",
                               args.first_feature + args.feature_count,
                               ") asked for; expected a range in [0, ", args.query.cols, ")");
  }

  void operator()(const Arguments& args) const {
    if (args.feature_groups != nullptr) {
      by_feature(args);
      return;
    }
    const auto& query = args.query;
    Index position = 0;
    for (Index row = 0; row < query.rows; ++row) {
      const auto d_query_row = args.d_query.row(row);
      for (Index k = query.row_begin(row); k < query.row_end(row); ++k)
        args.d_values[position++] = d_query_row.dot(args.query_kernel.row(query.column_indices[k]));
    }
  }

 private:
  static void by_feature(const Arguments& args) {
    const auto* offsets = args.feature_groups->feature_offsets.data();
    const auto* entries = args.feature_groups->entries.data();
    const auto* positions = args.feature_groups->positions.data();
    const Index last = args.first_feature + args.feature_count;
    for (Index feature = args.first_feature; feature < last; ++feature) {
      const auto kernel_row = args.query_kernel.row(feature);
      for (Index k = offsets[feature]; k < offsets[feature + 1]; ++k)
        args.d_values[Index(positions[k])] = args.d_query.row(Index(entries[k].row)).dot(kernel_row);
    }
  }
};

}  // namespace sdmha
