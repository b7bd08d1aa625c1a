// sdmha/sparse_query.hpp — SparseQuery<Scalar>: the sparse query batch as CSR rows.
//
// Row r = b·T + t holds the query of batch b, step t, over Eq features. The rows come from COO
// coordinates (TensorFlow's SparseTensor convention), from an Eigen row-major SparseMatrix that is
// moved in, or from caller-owned CSR arrays viewed in place. Every constructor validates its input
// completely; afterwards every kernel may trust the structure (no checks in hot loops).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

#include <Eigen/SparseCore>

#include "sdmha/config.hpp"
#include "sdmha/errors.hpp"

namespace sdmha {

// A read-only view of CSR rows. Row r spans [row_begin(r), row_end(r)) of `column_indices` and
// `values`. A compressed matrix has `row_nonzeros == nullptr` and row r ends where row r + 1
// begins; an uncompressed Eigen matrix stores each row's count apart, and its rows may have slack.
template <typename Scalar, typename StorageIndex = int>
struct CsrView {
  Index rows = 0;
  Index cols = 0;
  const StorageIndex* row_offsets =
      nullptr;  // rows + 1 entries (only the first `rows` used when uncompressed)
  const StorageIndex* row_nonzeros = nullptr;  // rows entries, or nullptr when compressed
  const StorageIndex* column_indices = nullptr;
  const Scalar* values = nullptr;
  // Whether every row's columns are known to be non-decreasing: set by SparseQuery's validation
  // (false when not known; kernels that need sorted rows then take another path).
  bool sorted_columns = false;

  Index row_begin(Index row) const { return row_offsets[row]; }
  Index row_end(Index row) const {
    return row_nonzeros == nullptr ? Index(row_offsets[row + 1])
                                   : Index(row_offsets[row]) + Index(row_nonzeros[row]);
  }
  Index row_size(Index row) const { return row_end(row) - row_begin(row); }

  // The rows [first, first + count) as a view of their own (no copy).
  CsrView middle_rows(Index first, Index count) const {
    SDMHA_ASSERT(first >= 0 && count >= 0 && first + count <= rows);
    CsrView view = *this;
    view.rows = count;
    view.row_offsets = row_offsets + first;
    if (row_nonzeros != nullptr) view.row_nonzeros = row_nonzeros + first;
    return view;
  }

  // The number of stored entries in the rows (excluding slack of uncompressed rows).
  Index nonzeros() const {
    if (row_nonzeros == nullptr) return rows == 0 ? 0 : Index(row_offsets[rows]) - row_offsets[0];
    Index total = 0;
    for (Index row = 0; row < rows; ++row) total += row_nonzeros[row];
    return total;
  }
};

// Bounds on what from_coo allocates from its three shape numbers alone. A file of a few hundred
// bytes can declare a query of 10^9 steps: from_coo's O(B·T) row arrays (12 bytes a row with
// int offsets) would then be allocated before a single coordinate is read. B·T above max_rows is
// a ShapeError naming the shape and the limit. The default, 2^27 rows (1.5 GiB of row arrays,
// and B·T·O·sizeof(Scalar) more for a layer's output), is past any batch this library is meant
// for; raise it for a larger one, or lower it where the inputs come from untrusted files.
struct SparseQueryLimits {
  static constexpr Index default_max_rows = Index(1) << 27;
  Index max_rows = default_max_rows;  // B·T at most
};

template <typename Scalar, typename StorageIndex = int>
class SparseQuery {
  static_assert(std::is_floating_point<Scalar>::value,
                "SparseQuery: Scalar must be float or double");
  static_assert(std::is_integral<StorageIndex>::value && std::is_signed<StorageIndex>::value,
                "SparseQuery: StorageIndex must be a signed integer type");

 public:
  using ScalarType = Scalar;
  using StorageIndexType = StorageIndex;
  using SparseMatrixType = Eigen::SparseMatrix<Scalar, Eigen::RowMajor, StorageIndex>;
  using CooIndices = Eigen::Matrix<std::int64_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  SparseQuery() = default;

  // A copy is a query of its own: the arrays of a query made by from_coo or from_eigen are copied
  // (O(nnz + B·T)), and a copy of a view_csr query views the same caller-owned arrays, under
  // the same condition (they outlive it, unchanged). Moves take the arrays over, O(1).
  SparseQuery(const SparseQuery& other)
      : batch_(other.batch_),
        steps_(other.steps_),
        view_(other.view_),
        coo_to_stored_(other.coo_to_stored_) {
    if (other.owned_) {
      owned_ = std::make_unique<SparseMatrixType>(*other.owned_);
      const bool sorted = view_.sorted_columns;  // the copy keeps each row's order
      view_ = view_of(*owned_);
      view_.sorted_columns = sorted;
    }
  }
  SparseQuery& operator=(const SparseQuery& other) {
    if (this != &other) *this = SparseQuery(other);
    return *this;
  }
  SparseQuery(SparseQuery&&) noexcept = default;
  SparseQuery& operator=(SparseQuery&&) noexcept = default;
  ~SparseQuery() = default;

  // From COO coordinates in TensorFlow's SparseTensor convention: `indices` is nnz × 3 int64
  // (batch, step, feature), `values` has nnz entries, the dense shape is (batch, steps, features).
  // Entries may come in any order. Duplicate coordinates are summed into one stored value (as
  // tf.sparse.reorder followed by a dense conversion would do); `coo_to_stored()` keeps, for every
  // input entry, the position of the stored value it went into. Rows end up with sorted columns.
  // Cost: O(nnz log(nnz per row) + B·T); B·T is bounded by `limits.max_rows`.
  static SparseQuery from_coo(Index batch, Index steps, Index features,
                              const Eigen::Ref<const CooIndices>& indices,
                              const Eigen::Ref<const Vector<Scalar>>& values,
                              const SparseQueryLimits& limits = {}) {
    constexpr const char* where = "SparseQuery::from_coo";
    check_dense_shape(where, batch, steps, features);
    check_row_limit(where, batch, steps, features, limits);
    if (indices.cols() != 3)
      detail::fail<ShapeError>(where, "indices has ", indices.cols(),
                               " columns; expected 3 (batch, step, feature)");
    if (indices.rows() != values.size())
      detail::fail<ShapeError>(where, "indices has ", indices.rows(), " rows but values has ",
                               values.size(), " entries; expected equal lengths");
    const Index entry_count = indices.rows();
    if (entry_count > Index(std::numeric_limits<StorageIndex>::max()))
      detail::fail<ShapeError>(where, "nnz = ", entry_count,
                               " does not fit the storage index type; expected nnz <= ",
                               std::numeric_limits<StorageIndex>::max());
    const std::int64_t bounds[3] = {batch, steps, features};
    const char* axis_names[3] = {"batch", "step", "feature"};
    for (Index entry = 0; entry < entry_count; ++entry) {
      for (int axis = 0; axis < 3; ++axis) {
        const std::int64_t coordinate = indices(entry, axis);
        if (coordinate < 0 || coordinate >= bounds[axis])
          detail::fail<IndexError>(where, "indices[", entry, "] ", axis_names[axis], " = ",
                                   coordinate, " is out of range; expected 0 <= ", axis_names[axis],
                                   " < ", bounds[axis]);
      }
    }

    // Counting sort by row, then a sort by column inside each row, then duplicates merged.
    const Index rows = batch * steps;
    std::vector<StorageIndex> row_of_entry(static_cast<std::size_t>(entry_count));
    std::vector<Index> row_counts(static_cast<std::size_t>(rows) + 1, 0);
    for (Index entry = 0; entry < entry_count; ++entry) {
      const Index row = indices(entry, 0) * steps + indices(entry, 1);
      row_of_entry[entry] = static_cast<StorageIndex>(row);
      ++row_counts[row + 1];
    }
    std::partial_sum(row_counts.begin(), row_counts.end(), row_counts.begin());
    std::vector<StorageIndex> order(static_cast<std::size_t>(entry_count));
    {
      std::vector<Index> cursor(row_counts.begin(), row_counts.end() - 1);
      for (Index entry = 0; entry < entry_count; ++entry)
        order[cursor[row_of_entry[entry]]++] = static_cast<StorageIndex>(entry);
    }

    SparseQuery query;
    query.batch_ = batch;
    query.steps_ = steps;
    query.owned_ = std::make_unique<SparseMatrixType>(rows, features);
    SparseMatrixType& matrix = *query.owned_;
    matrix.resizeNonZeros(entry_count);  // compressed; shrunk below if duplicates merge
    StorageIndex* offsets = matrix.outerIndexPtr();
    StorageIndex* columns = matrix.innerIndexPtr();
    Scalar* stored_values = matrix.valuePtr();
    query.coo_to_stored_.resize(static_cast<std::size_t>(entry_count));

    Index stored = 0;
    offsets[0] = 0;
    for (Index row = 0; row < rows; ++row) {
      auto first = order.begin() + row_counts[row];
      auto last = order.begin() + row_counts[row + 1];
      // Stable, so that duplicates are summed in input order: the sum is reproducible.
      std::stable_sort(first, last, [&](StorageIndex a, StorageIndex b) {
        return indices(a, 2) < indices(b, 2);
      });
      for (auto it = first; it != last; ++it) {
        const StorageIndex column = static_cast<StorageIndex>(indices(*it, 2));
        if (stored > offsets[row] && columns[stored - 1] == column) {
          stored_values[stored - 1] += values[*it];
        } else {
          columns[stored] = column;
          stored_values[stored] = values[*it];
          ++stored;
        }
        query.coo_to_stored_[*it] = static_cast<StorageIndex>(stored - 1);
      }
      offsets[row + 1] = static_cast<StorageIndex>(stored);
    }
    if (stored != entry_count) matrix.data().resize(stored);
    query.view_ = view_of(matrix);
    query.view_.sorted_columns = true;  // sorted above, duplicates merged
    return query;
  }

  // From an Eigen row-major sparse matrix of this Scalar and StorageIndex (SparseMatrixType) with
  // batch·steps rows, compressed or not. An rvalue is taken over: its arrays are swapped in, not
  // copied, and `matrix` is left empty. An lvalue is copied (O(nnz + B·T)) and left as it was.
  // Any other sparse expression (column-major, another Scalar or StorageIndex, a Map) is refused
  // at compile time rather than converted behind the caller's back. The structure is validated
  // (offsets non-decreasing and within the arrays, columns in range).
  static SparseQuery from_eigen(Index batch, Index steps, const SparseMatrixType& matrix) {
    return from_eigen(batch, steps, SparseMatrixType(matrix));
  }
  template <typename Derived>
  static SparseQuery from_eigen(Index, Index, const Eigen::SparseMatrixBase<Derived>&) {
    static_assert(sizeof(Derived) == 0,
                  "SparseQuery::from_eigen takes SparseQuery::SparseMatrixType (Eigen::SparseMatrix"
                  "<Scalar, Eigen::RowMajor, StorageIndex>); convert other storage explicitly, "
                  "e.g. from_eigen(B, T, SparseQuery<Scalar>::SparseMatrixType(matrix)), a copy");
    return {};
  }
  static SparseQuery from_eigen(Index batch, Index steps, SparseMatrixType&& matrix) {
    constexpr const char* where = "SparseQuery::from_eigen";
    check_dense_shape(where, batch, steps, matrix.cols());
    if (Index(matrix.rows()) != batch * steps)
      detail::fail<ShapeError>(where, "matrix has ", matrix.rows(),
                               " rows; expected batch * steps = ", batch, " * ", steps, " = ",
                               batch * steps);
    SparseQuery query;
    query.batch_ = batch;
    query.steps_ = steps;
    query.owned_ = std::make_unique<SparseMatrixType>();
    query.owned_->swap(matrix);
    query.view_ = view_of(*query.owned_);
    // An uncompressed matrix keeps its rows inside the allocated storage, past data().size().
    const auto& storage = query.owned_->data();
    validate_view(where, query.view_,
                  Index(query.owned_->isCompressed() ? storage.size() : storage.allocatedSize()));
    return query;
  }

  // A view over caller-owned compressed CSR arrays: `row_offsets` has batch·steps + 1 entries,
  // starting at 0; `column_indices` and `values` have row_offsets[batch·steps] entries. Nothing is
  // copied: the arrays must outlive the query and stay unchanged while it is used.
  static SparseQuery view_csr(Index batch, Index steps, Index features,
                              const StorageIndex* row_offsets, Index row_offsets_size,
                              const StorageIndex* column_indices, const Scalar* values,
                              Index nonzero_count) {
    constexpr const char* where = "SparseQuery::view_csr";
    check_dense_shape(where, batch, steps, features);
    const Index rows = batch * steps;
    if (row_offsets_size != rows + 1)
      detail::fail<ShapeError>(where, "row_offsets has ", row_offsets_size,
                               " entries; expected batch * steps + 1 = ", rows + 1);
    if (nonzero_count < 0)
      detail::fail<ShapeError>(where, "nonzero_count = ", nonzero_count, "; expected >= 0");
    if (row_offsets == nullptr ||
        ((column_indices == nullptr || values == nullptr) && nonzero_count > 0))
      detail::fail<ShapeError>(where, "a CSR array pointer is null; expected valid arrays");
    if (row_offsets[0] != 0)
      detail::fail<IndexError>(where, "row_offsets[0] = ", row_offsets[0], "; expected 0");
    if (Index(row_offsets[rows]) != nonzero_count)
      detail::fail<IndexError>(where, "row_offsets[", rows, "] = ", row_offsets[rows],
                               "; expected nonzero_count = ", nonzero_count);
    SparseQuery query;
    query.batch_ = batch;
    query.steps_ = steps;
    query.view_.rows = rows;
    query.view_.cols = features;
    query.view_.row_offsets = row_offsets;
    query.view_.column_indices = column_indices;
    query.view_.values = values;
    validate_view(where, query.view_, nonzero_count);
    return query;
  }

  Index batch() const { return batch_; }
  Index steps() const { return steps_; }
  Index rows() const { return view_.rows; }
  Index features() const { return view_.cols; }
  Index nonzeros() const { return view_.nonzeros(); }
  const CsrView<Scalar, StorageIndex>& csr() const { return view_; }
  // The rows of one batch entry, b·T ... b·T + T − 1.
  CsrView<Scalar, StorageIndex> batch_rows(Index b) const {
    return view_.middle_rows(b * steps_, steps_);
  }
  // For a query made by from_coo: the stored position of every input entry (duplicates share one).
  const std::vector<StorageIndex>& coo_to_stored() const { return coo_to_stored_; }

  // A dense (B·T × Eq) copy, for tests and for the dense baseline only.
  RowMatrix<Scalar> to_dense() const {
    RowMatrix<Scalar> dense = RowMatrix<Scalar>::Zero(rows(), features());
    for (Index row = 0; row < rows(); ++row)
      for (Index k = view_.row_begin(row); k < view_.row_end(row); ++k)
        dense(row, view_.column_indices[k]) += view_.values[k];
    return dense;
  }

 private:
  static void check_dense_shape(const char* where, Index batch, Index steps, Index features) {
    if (batch < 0) detail::fail<ShapeError>(where, "batch = ", batch, "; expected >= 0");
    if (steps < 0) detail::fail<ShapeError>(where, "steps = ", steps, "; expected >= 0");
    if (features < 0) detail::fail<ShapeError>(where, "features = ", features, "; expected >= 0");
    constexpr Index limit = Index(std::numeric_limits<StorageIndex>::max());
    // Each dimension on its own fits the index type too: a zero batch must not let steps (or a
    // zero steps let batch) reach sizes whose later arithmetic (tiles, B·H·T·S) overflows.
    if (batch > limit)
      detail::fail<ShapeError>(where, "batch = ", batch,
                               " does not fit the storage index type; expected <= ", limit);
    if (steps > limit)
      detail::fail<ShapeError>(where, "steps = ", steps,
                               " does not fit the storage index type; expected <= ", limit);
    if (features > limit)
      detail::fail<ShapeError>(where, "features = ", features,
                               " does not fit the storage index type; expected <= ", limit);
    if (steps != 0 && batch > (limit - 1) / steps)
      detail::fail<ShapeError>(where, "batch * steps = ", batch, " * ", steps,
                               " does not fit the storage index type; expected < ", limit);
  }

  // After check_dense_shape, so that batch * steps does not overflow.
  static void check_row_limit(const char* where, Index batch, Index steps, Index features,
                              const SparseQueryLimits& limits) {
    if (batch * steps > limits.max_rows)
      detail::fail<ShapeError>(where, "dense shape (", batch, ", ", steps, ", ", features,
                               ") has batch * steps = ", batch * steps,
                               " rows; expected at most max_rows = ", limits.max_rows,
                               " (SparseQueryLimits)");
  }

  static CsrView<Scalar, StorageIndex> view_of(const SparseMatrixType& matrix) {
    CsrView<Scalar, StorageIndex> view;
    view.rows = matrix.rows();
    view.cols = matrix.cols();
    view.row_offsets = matrix.outerIndexPtr();
    view.row_nonzeros = matrix.isCompressed() ? nullptr : matrix.innerNonZeroPtr();
    view.column_indices = matrix.innerIndexPtr();
    view.values = matrix.valuePtr();
    return view;
  }

  // Checks that every row lies inside [0, capacity) of the index and value arrays, that
  // compressed offsets never decrease, and that every column is inside [0, cols); records
  // whether every row's columns are sorted.
  static void validate_view(const char* where, CsrView<Scalar, StorageIndex>& view,
                            Index capacity) {
    bool sorted = true;
    for (Index row = 0; row < view.rows; ++row) {
      const Index begin = view.row_offsets[row];
      const Index end = view.row_nonzeros == nullptr ? Index(view.row_offsets[row + 1])
                                                     : begin + Index(view.row_nonzeros[row]);
      if (begin < 0 || end < begin || end > capacity)
        detail::fail<IndexError>(where, "row ", row, " spans [", begin, ", ", end,
                                 "); expected 0 <= begin <= end <= ", capacity);
      for (Index k = begin; k < end; ++k) {
        const Index column = view.column_indices[k];
        if (column < 0 || column >= view.cols)
          detail::fail<IndexError>(where, "row ", row, " has column index ", column,
                                   " at position ", k, "; expected 0 <= column < ", view.cols);
        sorted = sorted && (k == begin || view.column_indices[k - 1] <= view.column_indices[k]);
      }
    }
    view.sorted_columns = sorted;
  }

  Index batch_ = 0;
  Index steps_ = 0;
  std::unique_ptr<SparseMatrixType> owned_;  // heap-held so that view_ survives moves of *this
  CsrView<Scalar, StorageIndex> view_;
  std::vector<StorageIndex> coo_to_stored_;
};

}  // namespace sdmha
