// tests/support/stage_test.hpp — what the stage tests (tests/stages/) and the sparse query's share:
// a stage run as a layer runs it, its can_implement checks, the check that a stage wrote only its
// block of a larger matrix, and query shapes and the query as an uncompressed Eigen matrix.
#pragma once

#include "test_support.hpp"  // first: it sets SDMHA_ASSERT before the library is included

#include <string>
#include <vector>

namespace sdmha_test {

// A rows × cols matrix of entries drawn uniformly from [-bound, bound) by a generator seeded
// with `seed`.
template <typename Scalar>
sdmha::RowMatrix<Scalar> uniform_matrix(Index rows, Index cols, double bound, std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::uniform_real_distribution<double> distribution(-bound, bound);
  sdmha::RowMatrix<Scalar> matrix(rows, cols);
  for (Index i = 0; i < matrix.size(); ++i) matrix.data()[i] = Scalar(distribution(generator));
  return matrix;
}

template <typename Scalar>
using EigenSparse = typename sdmha::SparseQuery<Scalar>::SparseMatrixType;

// Runs `Stage` on `args` as a layer does: can_implement first (it throws on a mismatch).
template <typename Stage>
void run_stage(const typename Stage::Arguments& args) {
  Stage::can_implement(args);
  Stage{}(args);
}

// The rows of a projection's input: a dense matrix, or the CSR rows of a sparse query.
template <typename Derived>
Index row_count(const Eigen::EigenBase<Derived>& input) {
  return input.rows();
}
template <typename Scalar, typename StorageIndex>
Index row_count(const sdmha::CsrView<Scalar, StorageIndex>& input) {
  return input.rows;
}

// input·kernel (+ bias) by a projection stage (dense, output or sparse query), into a matrix of
// its own.
template <typename Projection, typename Input>
sdmha::RowMatrix<typename Projection::ScalarType> project(
    const Input& input, const sdmha::ConstMatrixRef<typename Projection::ScalarType>& kernel,
    const sdmha::ConstVectorRef<typename Projection::ScalarType>& bias) {
  sdmha::RowMatrix<typename Projection::ScalarType> output(row_count(input), kernel.cols());
  run_stage<Projection>({input, kernel, bias, output});
  return output;
}

// A float64 twin (the reference's row-major values) rounded to Scalar.
template <typename Scalar>
sdmha::RowMatrix<Scalar> to_matrix(const double* twin, Index rows, Index cols) {
  sdmha::RowMatrix<Scalar> matrix(rows, cols);
  for (Index i = 0; i < matrix.size(); ++i) matrix.data()[i] = Scalar(twin[i]);
  return matrix;
}

// Rows [first, first + count) of a row-major twin `width` wide.
inline std::vector<double> twin_rows(const std::vector<double>& twin, Index first, Index count,
                                     Index width) {
  return std::vector<double>(twin.begin() + first * width, twin.begin() + (first + count) * width);
}

// Whether every entry of `big` outside the block of `rows` × `cols` at (`row`, `col`) still holds
// `sentinel`: the stage that wrote the block wrote nothing else.
template <typename Matrix, typename Scalar>
::testing::AssertionResult only_block_written(const Matrix& big, Index row, Index col, Index rows,
                                              Index cols, Scalar sentinel) {
  for (Index r = 0; r < big.rows(); ++r)
    for (Index k = 0; k < big.cols(); ++k) {
      const bool inside = r >= row && r < row + rows && k >= col && k < col + cols;
      if (!inside && !(big(r, k) == sentinel))
        return ::testing::AssertionFailure()
               << "entry " << r << ", " << k << " outside the block is " << big(r, k)
               << "; expected the sentinel " << sentinel;
    }
  return ::testing::AssertionSuccess();
}

// can_implement accepts `args`.
template <typename Stage>
void expect_accepted(const typename Stage::Arguments& args) {
  EXPECT_NO_THROW(Stage::can_implement(args));
}

// can_implement refuses `args` with a ShapeError whose message holds `fragment`.
template <typename Stage>
void expect_refused(const typename Stage::Arguments& args, const std::string& fragment) {
  SCOPED_TRACE(fragment);
  SDMHA_EXPECT_THROW_WITH(Stage::can_implement(args), sdmha::ShapeError, fragment);
}

// A Shape whose query is `batch` × `steps` rows of `features` columns, `density` of each row
// stored; the rest is Shape's defaults.
inline Shape query_shape(long batch, long steps, long features, double density = Shape{}.density) {
  Shape s;
  s.batch = batch;
  s.steps = steps;
  s.query_dim = features;
  s.density = density;
  return s;
}

// 6 stored values a row, with duplicates and empty rows: a query whose rows outgrow a small
// reserve of uncompressed_matrix.
inline Shape uncompressed_query_shape() {
  Shape s = query_shape(3, 6, 20, 0.3);
  s.duplicates = true;
  s.empty_rows = true;
  return s;
}

// The case's query as an uncompressed Eigen matrix: `reserve_per_row` slots of slack per row,
// rows that outgrow them reallocated by Eigen, duplicates summed by coeffRef.
template <typename Scalar>
EigenSparse<Scalar> uncompressed_matrix(const Case<Scalar>& c, int reserve_per_row) {
  EigenSparse<Scalar> matrix(c.shape.batch * c.shape.steps, c.shape.query_dim);
  matrix.reserve(Eigen::VectorXi::Constant(matrix.rows(), reserve_per_row));
  for (Index i = 0; i < c.indices.rows(); ++i)
    matrix.coeffRef(c.indices(i, 0) * c.shape.steps + c.indices(i, 1), c.indices(i, 2)) +=
        c.values[i];
  return matrix;
}

}  // namespace sdmha_test
