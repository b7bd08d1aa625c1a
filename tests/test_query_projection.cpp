// Tests of sdmha/stages/query_projection.hpp: SparseQueryProjection against the reference's
// projection of the dense twin, with and without bias, on compressed and uncompressed rows,
// caller CSR with unsorted duplicate columns, sub-views of rows, and its can_implement checks.
#include "test_support.hpp"

namespace sdmha_test {
namespace {

template <typename Scalar>
class QueryProjectionTest : public ::testing::Test {};
TYPED_TEST_SUITE(QueryProjectionTest, ScalarTypes);

template <typename Scalar>
using Projection = sdmha::SparseQueryProjection<Scalar>;
template <typename Scalar>
using EigenSparse = typename sdmha::SparseQuery<Scalar>::SparseMatrixType;

std::vector<double> twin_rows(const std::vector<double>& twin, Index first, Index count, Index width) {
  return std::vector<double>(twin.begin() + first * width, twin.begin() + (first + count) * width);
}

// The reference's Q = X·Wq (+ bq) of the case, over all rows.
template <typename Scalar>
std::vector<double> reference_projection(const Case<Scalar>& c, bool with_bias) {
  const auto& p = c.problem;
  return sdmha_reference::project(p.query, p.batch * p.steps, p.query_dim, p.query_kernel,
                                  with_bias ? p.query_bias : std::vector<double>{}, p.heads * p.key_dim);
}

template <typename Scalar>
sdmha::RowMatrix<Scalar> project(const sdmha::CsrView<Scalar>& rows, const sdmha::RowMatrix<Scalar>& kernel,
                                 const sdmha::Vector<Scalar>& bias) {
  sdmha::RowMatrix<Scalar> output(rows.rows, kernel.cols());
  typename Projection<Scalar>::Arguments args{rows, kernel, bias, output};
  Projection<Scalar>::can_implement(args);
  Projection<Scalar>{}(args);
  return output;
}

std::vector<std::pair<const char*, Shape>> projection_shapes() {
  std::vector<std::pair<const char*, Shape>> shapes;
  Shape s;
  shapes.push_back({"basic", s});
  s = Shape{}; s.batch = 1; s.steps = 1; s.heads = 1; shapes.push_back({"one_row_one_head", s});
  s = Shape{}; s.steps = 7; s.query_dim = 29; s.heads = 3; s.key_dim = 5; s.density = 0.3;
  shapes.push_back({"odd_sizes", s});
  s = Shape{}; s.duplicates = true; s.density = 0.5; shapes.push_back({"duplicates", s});
  s = Shape{}; s.empty_rows = true; s.steps = 9; shapes.push_back({"empty_rows", s});
  s = Shape{}; s.use_bias = false; s.empty_rows = true; shapes.push_back({"no_bias", s});
  s = Shape{}; s.batch = 3; s.steps = 40; s.query_dim = 70; s.heads = 4; s.key_dim = 6;
  s.density = 0.05; s.empty_rows = true; shapes.push_back({"larger", s});
  return shapes;
}

TYPED_TEST(QueryProjectionTest, MatchesTheReferenceWithAndWithoutBias) {
  std::uint64_t seed = 400;
  const sdmha::Vector<TypeParam> no_bias;
  for (const auto& [name, shape] : projection_shapes()) {
    SCOPED_TRACE(name);
    const auto c = make_case<TypeParam>(shape, seed++);
    const auto query = c.query();
    const auto with_bias = project(query.csr(), c.weights.query_kernel, c.weights.query_bias);
    EXPECT_TRUE(all_near(with_bias.data(), reference_projection(c, shape.use_bias),
                         relative_tolerance<TypeParam>()));
    const auto without_bias = project(query.csr(), c.weights.query_kernel, no_bias);
    EXPECT_TRUE(all_near(without_bias.data(), reference_projection(c, false), relative_tolerance<TypeParam>()));
  }
}

TYPED_TEST(QueryProjectionTest, MatchesTheReferenceOnUncompressedRows) {
  Shape s;
  s.batch = 3; s.steps = 6; s.query_dim = 20; s.density = 0.3; s.duplicates = true; s.empty_rows = true;
  const auto c = make_case<TypeParam>(s, 410);
  EigenSparse<TypeParam> matrix(s.batch * s.steps, s.query_dim);
  matrix.reserve(Eigen::VectorXi::Constant(matrix.rows(), 4));
  for (Index i = 0; i < c.indices.rows(); ++i)
    matrix.coeffRef(c.indices(i, 0) * s.steps + c.indices(i, 1), c.indices(i, 2)) += c.values[i];
  ASSERT_FALSE(matrix.isCompressed());
  const auto query = sdmha::SparseQuery<TypeParam>::from_eigen(s.batch, s.steps, std::move(matrix));
  ASSERT_NE(query.csr().row_nonzeros, nullptr);
  const auto output = project(query.csr(), c.weights.query_kernel, c.weights.query_bias);
  EXPECT_TRUE(all_near(output.data(), reference_projection(c, true), relative_tolerance<TypeParam>()));
  // And a sub-view of uncompressed rows.
  const Index width = s.heads * s.key_dim;
  const auto middle = project(query.csr().middle_rows(5, 8), c.weights.query_kernel, c.weights.query_bias);
  EXPECT_TRUE(all_near(middle.data(), twin_rows(reference_projection(c, true), 5, 8, width),
                       relative_tolerance<TypeParam>()));
}

TYPED_TEST(QueryProjectionTest, MatchesTheReferenceOnCallerCsrWithUnsortedDuplicateColumns) {
  using Scalar = TypeParam;
  // B = 1, T = 3, Eq = 5; row 0 holds column 3 twice and out of order, row 1 is empty.
  const std::vector<int> offsets{0, 4, 4, 6};
  const std::vector<int> columns{3, 0, 3, 1, 4, 2};
  const std::vector<Scalar> values{1.5, -2, 0.25, 1, -0.75, 2};
  std::vector<double> dense(15, 0.0);
  dense[0 * 5 + 3] = 1.75; dense[0 * 5 + 0] = -2; dense[0 * 5 + 1] = 1;
  dense[2 * 5 + 4] = -0.75; dense[2 * 5 + 2] = 2;
  Shape s;
  s.batch = 1; s.steps = 3; s.query_dim = 5;
  const auto c = make_case<Scalar>(s, 420);  // for its weights
  const auto query = sdmha::SparseQuery<Scalar>::view_csr(1, 3, 5, offsets.data(), 4, columns.data(),
                                                          values.data(), 6);
  const auto output = project(query.csr(), c.weights.query_kernel, c.weights.query_bias);
  const auto expected = sdmha_reference::project(dense, 3, 5, c.problem.query_kernel, c.problem.query_bias,
                                                 s.heads * s.key_dim);
  EXPECT_TRUE(all_near(output.data(), expected, relative_tolerance<Scalar>()));
}

TYPED_TEST(QueryProjectionTest, ProjectsRowSubViewsIntoABlockOfALargerOutput) {
  Shape s;
  s.batch = 3; s.steps = 8; s.empty_rows = true;
  const auto c = make_case<TypeParam>(s, 430);
  const auto query = c.query();
  const Index width = s.heads * s.key_dim;
  const auto expected = reference_projection(c, true);
  constexpr TypeParam sentinel = TypeParam(-777);
  std::mt19937_64 generator(431);
  for (int round = 0; round < 12; ++round) {
    const Index first = std::uniform_int_distribution<Index>(0, query.rows())(generator);
    const Index count = std::uniform_int_distribution<Index>(0, query.rows() - first)(generator);
    SCOPED_TRACE(::testing::Message() << "rows [" << first << ", " << first + count << ")");
    // The output rows are a block in the middle of a wider, taller matrix.
    sdmha::RowMatrix<TypeParam> big = sdmha::RowMatrix<TypeParam>::Constant(count + 3, width + 5, sentinel);
    typename Projection<TypeParam>::Arguments args{query.csr().middle_rows(first, count),
                                                   c.weights.query_kernel, c.weights.query_bias,
                                                   big.block(1, 2, count, width)};
    Projection<TypeParam>::can_implement(args);
    Projection<TypeParam>{}(args);
    const sdmha::RowMatrix<TypeParam> block = big.block(1, 2, count, width);
    EXPECT_TRUE(all_near(block.data(), twin_rows(expected, first, count, width), relative_tolerance<TypeParam>()));
    for (Index r = 0; r < big.rows(); ++r)
      for (Index k = 0; k < big.cols(); ++k)
        if (r < 1 || r >= 1 + count || k < 2 || k >= 2 + width) {
          ASSERT_EQ(big(r, k), sentinel) << r << ", " << k;
        }
  }
}

TYPED_TEST(QueryProjectionTest, EmptyRowsGiveExactlyTheBias) {
  Shape s;
  s.steps = 12; s.empty_rows = true;
  const auto c = make_case<TypeParam>(s, 440);
  const auto query = c.query();
  const auto output = project(query.csr(), c.weights.query_kernel, c.weights.query_bias);
  const sdmha::Vector<TypeParam> no_bias;
  const auto unbiased = project(query.csr(), c.weights.query_kernel, no_bias);
  Index empty = 0;
  for (Index row = 0; row < query.rows(); ++row) {
    if (query.csr().row_size(row) != 0) continue;
    ++empty;
    for (Index k = 0; k < output.cols(); ++k) {
      EXPECT_EQ(output(row, k), c.weights.query_bias[k]) << row << ", " << k;
      EXPECT_EQ(unbiased(row, k), TypeParam(0)) << row << ", " << k;
    }
  }
  EXPECT_GT(empty, 0) << "the case should have empty rows";
  // A query with no stored value at all, and one with no rows.
  const CooIndices no_indices(0, 3);
  const auto nothing = sdmha::SparseQuery<TypeParam>::from_coo(2, 3, s.query_dim, no_indices,
                                                               sdmha::Vector<TypeParam>());
  const auto biases = project(nothing.csr(), c.weights.query_kernel, c.weights.query_bias);
  for (Index row = 0; row < biases.rows(); ++row)
    EXPECT_TRUE((biases.row(row).transpose().array() == c.weights.query_bias.array()).all()) << row;
  const auto no_rows = sdmha::SparseQuery<TypeParam>::from_coo(0, 3, s.query_dim, no_indices,
                                                               sdmha::Vector<TypeParam>());
  EXPECT_EQ(project(no_rows.csr(), c.weights.query_kernel, c.weights.query_bias).rows(), 0);
}

TYPED_TEST(QueryProjectionTest, CanImplementRejectsEachMismatch) {
  using Scalar = TypeParam;
  const auto c = make_case<Scalar>(Shape{}, 450);  // 10 rows, Eq = 16, H·Dk = 8
  const auto query = c.query();
  const sdmha::RowMatrix<Scalar> short_kernel = sdmha::RowMatrix<Scalar>::Zero(15, 8);
  const sdmha::Vector<Scalar> long_bias = sdmha::Vector<Scalar>::Zero(9), no_bias;
  sdmha::RowMatrix<Scalar> output(10, 8), short_output(9, 8), narrow_output(10, 7);
  using Arguments = typename Projection<Scalar>::Arguments;
  EXPECT_NO_THROW(Projection<Scalar>::can_implement(Arguments{query.csr(), c.weights.query_kernel, no_bias, output}));
  SDMHA_EXPECT_THROW_WITH(
      Projection<Scalar>::can_implement(Arguments{query.csr(), short_kernel, c.weights.query_bias, output}),
      sdmha::ShapeError, "SparseQueryProjection: kernel has 15 rows; expected the query's feature width 16");
  SDMHA_EXPECT_THROW_WITH(
      Projection<Scalar>::can_implement(Arguments{query.csr(), c.weights.query_kernel, long_bias, output}),
      sdmha::ShapeError, "bias has 9 entries; expected 0 or 8");
  SDMHA_EXPECT_THROW_WITH(
      Projection<Scalar>::can_implement(Arguments{query.csr(), c.weights.query_kernel, no_bias, short_output}),
      sdmha::ShapeError, "output is 9 x 8; expected 10 x 8");
  SDMHA_EXPECT_THROW_WITH(
      Projection<Scalar>::can_implement(Arguments{query.csr(), c.weights.query_kernel, no_bias, narrow_output}),
      sdmha::ShapeError, "output is 10 x 7; expected 10 x 8");
}

}  // namespace
}  // namespace sdmha_test

// ---- the two kernels behind the stage: by rows and by features ----

namespace sdmha_test {
namespace {

template <typename Scalar>
class QueryProjectionKernelsTest : public ::testing::Test {};
TYPED_TEST_SUITE(QueryProjectionKernelsTest, ScalarTypes);

// Both kernels against a naive product, over widths that exercise full panels, 4- and 1-packet
// panels and the scalar tail, with and without bias; on sorted rows they agree bitwise.
TYPED_TEST(QueryProjectionKernelsTest, ByRowsAndByFeaturesMatchTheNaiveProductAndEachOther) {
  using Scalar = TypeParam;
  std::mt19937_64 generator(31);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  for (Index columns : {1, 3, 16, 37, 256, 300, 517}) {
    Shape s;
    s.batch = 3; s.steps = 11; s.query_dim = 50; s.density = 0.3; s.empty_rows = true; s.duplicates = true;
    const auto c = make_case<Scalar>(s, 40 + std::uint64_t(columns));
    const auto query = c.query();
    sdmha::RowMatrix<Scalar> kernel(s.query_dim, columns);
    for (Index i = 0; i < kernel.size(); ++i) kernel.data()[i] = Scalar(uniform(generator));
    sdmha::Vector<Scalar> bias(columns);
    for (Index i = 0; i < bias.size(); ++i) bias[i] = Scalar(uniform(generator));
    const sdmha::RowMatrix<Scalar> dense = query.to_dense();
    for (bool with_bias : {false, true}) {
      std::vector<double> expected(std::size_t(query.rows() * columns));
      for (Index r = 0; r < query.rows(); ++r)
        for (Index j = 0; j < columns; ++j) {
          double sum = with_bias ? double(bias[j]) : 0.0;
          for (Index f = 0; f < s.query_dim; ++f) sum += double(dense(r, f)) * double(kernel(f, j));
          expected[std::size_t(r * columns + j)] = sum;
        }
      sdmha::RowMatrix<Scalar> by_rows(query.rows(), columns), by_features(query.rows(), columns);
      const Scalar* bias_data = with_bias ? bias.data() : nullptr;
      sdmha::detail::csr_dense_product(query.csr(), kernel.data(), columns, bias_data, by_rows.data(), columns, columns);
      sdmha::detail::csr_dense_product_by_feature(query.csr(), kernel.data(), columns, bias_data,
                                                  by_features.data(), columns, columns);
      EXPECT_TRUE(all_near(by_rows.data(), expected, relative_tolerance<Scalar>())) << columns << " columns";
      EXPECT_TRUE(all_near(by_features.data(), expected, relative_tolerance<Scalar>())) << columns << " columns";
      EXPECT_EQ(0, std::memcmp(by_rows.data(), by_features.data(), sizeof(Scalar) * std::size_t(by_rows.size())))
          << columns << " columns";
    }
  }
}

// The stage takes the by-feature kernel for a kernel beyond the cache that the rows reuse, and
// still gives the naive product.
TYPED_TEST(QueryProjectionKernelsTest, StageOnAWideKernelMatchesTheNaiveProduct) {
  using Scalar = TypeParam;
  const Index features = 4200, columns = 40 + 4 * 1024 * 1024 / (4200 * Index(sizeof(Scalar)));
  Shape s;
  s.batch = 2; s.steps = 60; s.query_dim = features; s.density = 0.04;
  const auto c = make_case<Scalar>(s, 77);
  const auto query = c.query();
  ASSERT_GE(query.nonzeros(), 2 * features);
  std::mt19937_64 generator(5);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  sdmha::RowMatrix<Scalar> kernel(features, columns);
  for (Index i = 0; i < kernel.size(); ++i) kernel.data()[i] = Scalar(uniform(generator));
  sdmha::Vector<Scalar> bias = sdmha::Vector<Scalar>::Constant(columns, Scalar(0.25));
  sdmha::RowMatrix<Scalar> output(query.rows(), columns), by_rows(query.rows(), columns);
  const sdmha::SparseQueryProjection<Scalar> stage;
  stage({query.csr(), kernel, bias, output});
  sdmha::detail::csr_dense_product(query.csr(), kernel.data(), columns, bias.data(), by_rows.data(), columns, columns);
  EXPECT_EQ(0, std::memcmp(output.data(), by_rows.data(), sizeof(Scalar) * std::size_t(output.size())));
  const auto& csr = query.csr();
  for (Index r = 0; r < query.rows(); r += 17)
    for (Index j = 0; j < columns; j += 13) {
      double sum = 0.25;
      for (Index k = csr.row_begin(r); k < csr.row_end(r); ++k)
        sum += double(csr.values[k]) * double(kernel(csr.column_indices[k], j));
      EXPECT_NEAR(double(output(r, j)), sum, relative_tolerance<Scalar>() * (1 + std::abs(sum)));
    }
}

}  // namespace
}  // namespace sdmha_test
