// tests/compile_fail/from_eigen_forms.cpp — compiled (never run) by the `compile.from_eigen.*`
// tests of tests/CMakeLists.txt, once per macro setting:
//
//   (none)                     SparseQuery::from_eigen of its own SparseMatrixType as an rvalue
//                              (taken over), a const and a non-const lvalue (copied), and a
//                              column-major matrix converted explicitly       → must compile
//   SDMHA_FROM_COLUMN_MAJOR    a column-major matrix passed as it is          → must fail, with
//                              the static_assert naming the accepted type alone
//   SDMHA_FROM_OTHER_INDEX     a row-major matrix of another StorageIndex     → the same
//
// Without the refusal Eigen would convert either matrix into a temporary and the query would take
// that copy over, where the caller asked for no copy.
#include <utility>

#include <sdmha/sdmha.hpp>

using Query = sdmha::SparseQuery<float>;

int main() {
  Query::SparseMatrixType row_major(6, 4);
  const Query::SparseMatrixType const_row_major(6, 4);
  Eigen::SparseMatrix<float, Eigen::ColMajor, int> column_major(6, 4);
  Eigen::SparseMatrix<float, Eigen::RowMajor, long> other_index(6, 4);
#if defined(SDMHA_FROM_COLUMN_MAJOR)
  Query::from_eigen(2, 3, column_major);
#elif defined(SDMHA_FROM_OTHER_INDEX)
  Query::from_eigen(2, 3, std::move(other_index));
#else
  Query::from_eigen(2, 3, const_row_major);
  Query::from_eigen(2, 3, row_major);
  Query::from_eigen(2, 3, std::move(row_major));
  Query::from_eigen(2, 3, Query::SparseMatrixType(column_major));
  Query::from_eigen(2, 3, Query::SparseMatrixType(other_index));
#endif
  return 0;
}
