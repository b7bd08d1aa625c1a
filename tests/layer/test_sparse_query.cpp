// Tests of sdmha/sparse_query.hpp: SparseQuery from COO, from an Eigen matrix (compressed and
// not) and from caller-owned CSR arrays, its row views, and every bad input. Stored rows are read
// back by a naive walk over the raw CSR arrays and compared with the dense twin of make_case.
#include "test_support.hpp"

#include "stage_test.hpp"

namespace sdmha_test {
namespace {

SDMHA_SCALAR_TYPED_TEST_SUITE(SparseQueryTest);

template <typename Scalar>
using Query = sdmha::SparseQuery<Scalar>;

// The rows of a view, densified in float64 by reading the raw arrays (not row_begin/row_end).
template <typename Scalar, typename StorageIndex>
std::vector<double> naive_dense(const sdmha::CsrView<Scalar, StorageIndex>& view) {
  std::vector<double> dense(static_cast<std::size_t>(view.rows * view.cols), 0.0);
  for (Index row = 0; row < view.rows; ++row) {
    const Index begin = view.row_offsets[row];
    const Index end = view.row_nonzeros != nullptr ? begin + Index(view.row_nonzeros[row])
                                                   : Index(view.row_offsets[row + 1]);
    for (Index k = begin; k < end; ++k)
      dense[row * view.cols + view.column_indices[k]] += double(view.values[k]);
  }
  return dense;
}

// The distinct (row, feature) coordinates of a case's COO entries.
template <typename Scalar>
Index distinct_coordinates(const Case<Scalar>& c) {
  std::vector<std::int64_t> keys;
  for (Index i = 0; i < c.indices.rows(); ++i)
    keys.push_back((c.indices(i, 0) * c.shape.steps + c.indices(i, 1)) * c.shape.query_dim +
                   c.indices(i, 2));
  std::sort(keys.begin(), keys.end());
  return Index(std::unique(keys.begin(), keys.end()) - keys.begin());
}

template <typename Scalar>
EigenSparse<Scalar> compressed_matrix(const Case<Scalar>& c) {
  std::vector<Eigen::Triplet<Scalar>> triplets;
  for (Index i = 0; i < c.indices.rows(); ++i)
    triplets.emplace_back(int(c.indices(i, 0) * c.shape.steps + c.indices(i, 1)),
                          int(c.indices(i, 2)), c.values[i]);
  EigenSparse<Scalar> matrix(c.shape.batch * c.shape.steps, c.shape.query_dim);
  matrix.setFromTriplets(triplets.begin(), triplets.end());
  return matrix;
}

constexpr double kExact = 0.0;

// ---- from_coo ----

TYPED_TEST(SparseQueryTest, FromCooMatchesTheDenseTwinWithSortedDistinctColumns) {
  std::vector<std::pair<const char*, Shape>> shapes;
  Shape s;
  shapes.push_back({"basic", s});
  s = Shape{};
  s.shuffle = false;
  shapes.push_back({"in_order", s});
  s = Shape{};
  s.duplicates = true;
  s.density = 0.5;
  shapes.push_back({"duplicates", s});
  s = Shape{};
  s.empty_rows = true;
  s.steps = 11;
  shapes.push_back({"empty_rows", s});
  shapes.push_back({"one_by_one", query_shape(1, 1, 1)});
  s = query_shape(3, 7, 37, 0.6);
  s.duplicates = true;
  s.empty_rows = true;
  shapes.push_back({"odd_dense_duplicates", s});
  std::uint64_t seed = 200;
  for (const auto& [name, shape] : shapes) {
    SCOPED_TRACE(name);
    const auto c = make_case<TypeParam>(shape, seed++);
    const auto query = c.query();
    EXPECT_EQ(query.batch(), shape.batch);
    EXPECT_EQ(query.steps(), shape.steps);
    EXPECT_EQ(query.rows(), shape.batch * shape.steps);
    EXPECT_EQ(query.features(), shape.query_dim);
    EXPECT_EQ(query.nonzeros(), distinct_coordinates(c));
    const auto& csr = query.csr();
    EXPECT_EQ(csr.row_nonzeros, nullptr) << "from_coo should give compressed rows";
    EXPECT_EQ(csr.row_offsets[0], 0);
    for (Index row = 0; row < csr.rows; ++row)
      for (Index k = csr.row_offsets[row] + 1; k < csr.row_offsets[row + 1]; ++k)
        ASSERT_LT(csr.column_indices[k - 1], csr.column_indices[k]) << "row " << row;
    EXPECT_TRUE(
        all_near(naive_dense(csr).data(), c.problem.query, relative_tolerance<TypeParam>()));
    const auto dense = query.to_dense();
    ASSERT_EQ(dense.rows(), query.rows());
    ASSERT_EQ(dense.cols(), query.features());
    EXPECT_TRUE(all_near(dense.data(), c.problem.query, relative_tolerance<TypeParam>()));
  }
}

TYPED_TEST(SparseQueryTest, FromCooSumsDuplicatesAndMapsEveryEntryToItsStoredValue) {
  using Scalar = TypeParam;
  // B = 2, T = 2, Eq = 5; row r = b·T + t. Row 3 is empty; row 2 gets (1, 0, 3) three times.
  CooIndices indices(7, 3);
  indices << 1, 0, 3,  //
      0, 1, 2,         //
      1, 0, 0,         //
      0, 1, 2,         //
      1, 0, 3,         //
      0, 0, 4,         //
      1, 0, 3;
  sdmha::Vector<Scalar> values(7);
  values << 1.5, 2.0, -1.0, 0.25, 4.0, 3.0, -0.5;
  const auto query = Query<Scalar>::from_coo(2, 2, 5, indices, values);
  const auto& csr = query.csr();
  ASSERT_EQ(query.nonzeros(), 4);
  const std::vector<int> offsets(csr.row_offsets, csr.row_offsets + 5);
  const std::vector<int> columns(csr.column_indices, csr.column_indices + 4);
  const std::vector<Scalar> stored(csr.values, csr.values + 4);
  EXPECT_EQ(offsets, (std::vector<int>{0, 1, 2, 4, 4}));
  EXPECT_EQ(columns, (std::vector<int>{4, 2, 0, 3}));
  EXPECT_EQ(stored, (std::vector<Scalar>{3.0, 2.25, -1.0, 5.0}));
  EXPECT_EQ(query.coo_to_stored(), (std::vector<int>{3, 1, 2, 1, 3, 0, 3}));
}

TYPED_TEST(SparseQueryTest, CooToStoredIsConsistentOnRandomDuplicates) {
  Shape s = query_shape(3, 6, 9, 0.6);
  s.duplicates = true;
  s.empty_rows = true;
  const auto c = make_case<TypeParam>(s, 210);
  const auto query = c.query();
  const auto& csr = query.csr();
  const auto& mapping = query.coo_to_stored();
  ASSERT_EQ(Index(mapping.size()), c.indices.rows());
  // Summing the inputs in input order, per stored position, gives the stored values exactly:
  // duplicates are summed in input order, so the sum is reproducible.
  std::vector<TypeParam> sums(static_cast<std::size_t>(query.nonzeros()), TypeParam(0));
  std::vector<int> hits(sums.size(), 0);
  for (Index entry = 0; entry < c.indices.rows(); ++entry) {
    const Index position = mapping[entry];
    const Index row = c.indices(entry, 0) * s.steps + c.indices(entry, 1);
    ASSERT_GE(position, csr.row_offsets[row]) << "entry " << entry;
    ASSERT_LT(position, csr.row_offsets[row + 1]) << "entry " << entry;
    ASSERT_EQ(csr.column_indices[position], c.indices(entry, 2)) << "entry " << entry;
    sums[position] += c.values[entry];
    ++hits[position];
  }
  for (Index position = 0; position < query.nonzeros(); ++position) {
    EXPECT_GT(hits[position], 0) << "stored position " << position << " has no input entry";
    EXPECT_EQ(sums[position], csr.values[position]) << "stored position " << position;
  }
  EXPECT_LT(query.nonzeros(), c.indices.rows()) << "the case should contain duplicates";
}

TYPED_TEST(SparseQueryTest, FromCooAcceptsEmptyShapesAndEmptyEntries) {
  using Scalar = TypeParam;
  const CooIndices no_indices(0, 3);
  const sdmha::Vector<Scalar> no_values;
  for (auto dims :
       std::vector<std::array<Index, 3>>{{0, 5, 16}, {2, 0, 16}, {2, 3, 0}, {2, 3, 8}}) {
    SCOPED_TRACE(::testing::Message() << dims[0] << " x " << dims[1] << " x " << dims[2]);
    const auto query = Query<Scalar>::from_coo(dims[0], dims[1], dims[2], no_indices, no_values);
    EXPECT_EQ(query.rows(), dims[0] * dims[1]);
    EXPECT_EQ(query.features(), dims[2]);
    EXPECT_EQ(query.nonzeros(), 0);
    EXPECT_TRUE(query.coo_to_stored().empty());
    for (Index row = 0; row <= query.rows(); ++row) EXPECT_EQ(query.csr().row_offsets[row], 0);
    const auto dense = query.to_dense();
    EXPECT_EQ(dense.rows(), dims[0] * dims[1]);
    EXPECT_EQ(dense.cols(), dims[2]);
    EXPECT_TRUE((dense.array() == Scalar(0)).all());
    for (Index b = 0; b < dims[0]; ++b) {
      EXPECT_EQ(query.batch_rows(b).rows, dims[1]);
      EXPECT_EQ(query.batch_rows(b).nonzeros(), 0);
    }
  }
}

TYPED_TEST(SparseQueryTest, MovingTheQueryKeepsItsArrays) {
  const auto c = make_case<TypeParam>(Shape{}, 211);
  auto query = c.query();
  const TypeParam* values = query.csr().values;
  const auto moved = std::move(query);
  EXPECT_EQ(moved.csr().values, values);
  EXPECT_TRUE(
      all_near(naive_dense(moved.csr()).data(), c.problem.query, relative_tolerance<TypeParam>()));
}

// The case's query in both of its storage forms: from_coo's compressed CSR, and from_eigen over an
// uncompressed Eigen matrix (room for 2 more entries a row).
template <typename Scalar>
std::vector<std::pair<const char*, Query<Scalar>>> both_forms(const Case<Scalar>& c) {
  std::vector<std::pair<const char*, Query<Scalar>>> queries;
  queries.emplace_back("from_coo, compressed", c.query());
  queries.emplace_back(
      "from_eigen, uncompressed",
      Query<Scalar>::from_eigen(c.shape.batch, c.shape.steps, uncompressed_matrix(c, 2)));
  return queries;
}

// A copy owns arrays of its own (for from_coo and from_eigen queries): same rows, other memory,
// independent of the original's later life; a copy of a view_csr query views the same arrays.
TYPED_TEST(SparseQueryTest, CopyingAnOwningQueryCopiesItsArrays) {
  using Scalar = TypeParam;
  Shape s = query_shape(2, 5, 9, 0.5);
  s.duplicates = true;
  const auto c = make_case<Scalar>(s, 212);
  auto originals = both_forms(c);
  for (auto& [name, original] : originals) {
    SCOPED_TRACE(name);
    const std::vector<double> expected = naive_dense(original.csr());
    Query<Scalar> copy(original);
    Query<Scalar> assigned;
    assigned = original;
    for (const Query<Scalar>* duplicate : {&copy, &assigned}) {
      EXPECT_NE(duplicate->csr().values, original.csr().values);
      EXPECT_NE(duplicate->csr().column_indices, original.csr().column_indices);
      EXPECT_EQ(duplicate->batch(), s.batch);
      EXPECT_EQ(duplicate->steps(), s.steps);
      EXPECT_EQ(duplicate->csr().sorted_columns, original.csr().sorted_columns);
      EXPECT_EQ(duplicate->coo_to_stored(), original.coo_to_stored());
    }
    original = Query<Scalar>();  // the original's arrays are freed
    EXPECT_TRUE(all_near(naive_dense(copy.csr()).data(), expected, kExact));
    EXPECT_TRUE(all_near(naive_dense(assigned.csr()).data(), expected, kExact));
  }
  EXPECT_EQ(originals[0].second.nonzeros(), 0);
  EXPECT_FALSE(originals[0].second.csr().sorted_columns);

  const std::vector<int> offsets{0, 1, 1, 2};
  const std::vector<int> columns{2, 0};
  const std::vector<Scalar> values{Scalar(1), Scalar(-3)};
  const auto view =
      Query<Scalar>::view_csr(1, 3, 4, offsets.data(), 4, columns.data(), values.data(), 2);
  const Query<Scalar> view_copy = view;
  EXPECT_EQ(view_copy.csr().values, values.data());
  EXPECT_EQ(view_copy.csr().row_offsets, offsets.data());
  EXPECT_TRUE(all_near(view_copy.to_dense().data(), naive_dense(view.csr()), kExact));
}

// ---- from_eigen ----

TYPED_TEST(SparseQueryTest, FromEigenTakesOverACompressedMatrixWithoutCopying) {
  Shape s;
  s.duplicates = true;
  s.empty_rows = true;
  s.steps = 6;
  const auto c = make_case<TypeParam>(s, 220);
  auto matrix = compressed_matrix(c);
  ASSERT_TRUE(matrix.isCompressed());
  const TypeParam* values = matrix.valuePtr();
  const int* columns = matrix.innerIndexPtr();
  const int* offsets = matrix.outerIndexPtr();
  auto query = Query<TypeParam>::from_eigen(s.batch, s.steps, std::move(matrix));
  EXPECT_EQ(query.csr().values, values);
  EXPECT_EQ(query.csr().column_indices, columns);
  EXPECT_EQ(query.csr().row_offsets, offsets);
  EXPECT_EQ(query.csr().row_nonzeros, nullptr);
  EXPECT_EQ(matrix.nonZeros(), 0) << "the moved-from matrix should be left empty";
  EXPECT_EQ(query.batch(), s.batch);
  EXPECT_EQ(query.steps(), s.steps);
  EXPECT_EQ(query.features(), s.query_dim);
  EXPECT_EQ(query.nonzeros(), distinct_coordinates(c));
  EXPECT_TRUE(
      all_near(naive_dense(query.csr()).data(), c.problem.query, relative_tolerance<TypeParam>()));
  EXPECT_TRUE(all_near(query.to_dense().data(), c.problem.query, relative_tolerance<TypeParam>()));
  const auto moved = std::move(query);
  EXPECT_EQ(moved.csr().values, values);
  EXPECT_TRUE(all_near(moved.to_dense().data(), c.problem.query, relative_tolerance<TypeParam>()));
}

TYPED_TEST(SparseQueryTest, FromEigenTakesOverAnUncompressedMatrixWithSlack) {
  const Shape s = uncompressed_query_shape();  // 6 per row: outgrows the reserve of 3
  const auto c = make_case<TypeParam>(s, 221);
  auto matrix = uncompressed_matrix(c, 3);
  ASSERT_FALSE(matrix.isCompressed());
  const TypeParam* values = matrix.valuePtr();
  const int* row_nonzeros = matrix.innerNonZeroPtr();
  const auto query = Query<TypeParam>::from_eigen(s.batch, s.steps, std::move(matrix));
  EXPECT_EQ(query.csr().values, values);
  EXPECT_EQ(query.csr().row_nonzeros, row_nonzeros);
  EXPECT_EQ(query.nonzeros(), distinct_coordinates(c));
  EXPECT_TRUE(
      all_near(naive_dense(query.csr()).data(), c.problem.query, relative_tolerance<TypeParam>()));
  EXPECT_TRUE(all_near(query.to_dense().data(), c.problem.query, relative_tolerance<TypeParam>()));
}

// An lvalue is copied and left as it was (compressed or not); the rvalue form above takes over.
TYPED_TEST(SparseQueryTest, FromEigenCopiesAnLvalueAndLeavesItUnchanged) {
  const Shape s = uncompressed_query_shape();
  const auto c = make_case<TypeParam>(s, 222);
  const EigenSparse<TypeParam> compressed = compressed_matrix(c);
  EigenSparse<TypeParam> uncompressed = uncompressed_matrix(c, 3);
  ASSERT_FALSE(uncompressed.isCompressed());
  const std::vector<const EigenSparse<TypeParam>*> matrices{&compressed, &uncompressed};
  for (const EigenSparse<TypeParam>* matrix : matrices) {
    SCOPED_TRACE(matrix->isCompressed() ? "compressed" : "uncompressed");
    const Index stored = matrix->nonZeros();
    const auto query = Query<TypeParam>::from_eigen(s.batch, s.steps, *matrix);
    EXPECT_NE(query.csr().values, matrix->valuePtr());
    EXPECT_EQ(matrix->nonZeros(), stored) << "the caller's matrix should be untouched";
    EXPECT_EQ(query.nonzeros(), distinct_coordinates(c));
    EXPECT_TRUE(all_near(naive_dense(query.csr()).data(), c.problem.query,
                         relative_tolerance<TypeParam>()));
  }
  // A non-const lvalue takes the copying form too.
  const auto query = Query<TypeParam>::from_eigen(s.batch, s.steps, uncompressed);
  EXPECT_EQ(uncompressed.nonZeros(), distinct_coordinates(c));
  EXPECT_NE(query.csr().values, uncompressed.valuePtr());
}

// A matrix filled by insert() alone (no reserve, no makeCompressed) is uncompressed, and Eigen
// parks the offsets of the rows after the last insertion at the end of its allocation, beyond
// data().size(). Those rows are empty, and the matrix is valid.
TYPED_TEST(SparseQueryTest, FromEigenAcceptsAMatrixFilledByInsertAlone) {
  using Scalar = TypeParam;
  EigenSparse<Scalar> matrix(6, 4);  // B = 2, T = 3
  matrix.insert(0, 1) = Scalar(1.5);
  matrix.insert(2, 3) = Scalar(-2);
  matrix.insert(2, 0) = Scalar(0.5);
  ASSERT_FALSE(matrix.isCompressed());
  const Scalar* values = matrix.valuePtr();
  std::vector<double> expected(24, 0.0);
  expected[0 * 4 + 1] = 1.5;
  expected[2 * 4 + 3] = -2;
  expected[2 * 4 + 0] = 0.5;
  try {
    const auto query = Query<Scalar>::from_eigen(2, 3, std::move(matrix));
    EXPECT_EQ(query.csr().values, values);
    EXPECT_EQ(query.nonzeros(), 3);
    EXPECT_TRUE(all_near(naive_dense(query.csr()).data(), expected, kExact));
    EXPECT_TRUE(all_near(query.to_dense().data(), expected, kExact));
    EXPECT_EQ(query.batch_rows(1).nonzeros(), 0);
  } catch (const sdmha::Error& error) {
    ADD_FAILURE() << "a valid uncompressed matrix was rejected: " << error.what();
  }
}

// ---- view_csr ----

TYPED_TEST(SparseQueryTest, ViewCsrReadsTheCallersArraysInPlace) {
  using Scalar = TypeParam;
  // B = 2, T = 2, Eq = 6; row 1 empty; row 3 with unsorted columns.
  const std::vector<int> offsets{0, 2, 2, 3, 5};
  const std::vector<int> columns{1, 4, 0, 5, 2};
  std::vector<Scalar> values{1, -2, 3, 0.5, -0.25};
  const auto query = Query<Scalar>::view_csr(2, 2, 6, offsets.data(), Index(offsets.size()),
                                             columns.data(), values.data(), Index(values.size()));
  EXPECT_EQ(query.csr().values, values.data());
  EXPECT_EQ(query.csr().column_indices, columns.data());
  EXPECT_EQ(query.csr().row_offsets, offsets.data());
  EXPECT_EQ(query.nonzeros(), 5);
  std::vector<double> expected(24, 0.0);
  expected[0 * 6 + 1] = 1;
  expected[0 * 6 + 4] = -2;
  expected[2 * 6 + 0] = 3;
  expected[3 * 6 + 5] = 0.5;
  expected[3 * 6 + 2] = -0.25;
  EXPECT_TRUE(all_near(query.to_dense().data(), expected, kExact));
  values[2] = 7;  // the view sees the caller's memory, not a copy
  expected[2 * 6 + 0] = 7;
  EXPECT_TRUE(all_near(query.to_dense().data(), expected, kExact));
}

// Validation records whether every row's columns are non-decreasing (the bfloat16 query
// projection's feature-block kernel needs it): from_coo sorts; view_csr and from_eigen take rows
// as they come, and one row out of order, or a view built by hand, is "not known sorted".
TYPED_TEST(SparseQueryTest, ValidationRecordsWhetherRowsAreSorted) {
  using Scalar = TypeParam;
  const std::vector<int> offsets{0, 2, 2, 3, 5};
  std::vector<int> columns{1, 4, 0, 2, 2};  // row 3 holds column 2 twice: still non-decreasing
  const std::vector<Scalar> values{1, -2, 3, 0.5, -0.25};
  auto view = [&] {
    return Query<Scalar>::view_csr(2, 2, 6, offsets.data(), Index(offsets.size()), columns.data(),
                                   values.data(), Index(values.size()));
  };
  EXPECT_TRUE(view().csr().sorted_columns);
  EXPECT_TRUE(view().batch_rows(1).sorted_columns);
  columns[4] = 1;  // row 3: 2, 1
  EXPECT_FALSE(view().csr().sorted_columns);
  columns[4] = 2;
  columns[1] = 0;  // row 0: 1, 0
  EXPECT_FALSE(view().csr().sorted_columns);
  EXPECT_FALSE(sdmha::CsrView<Scalar>().sorted_columns);

  const auto c = make_case<Scalar>(Shape{}, 17);
  EXPECT_TRUE(c.query().csr().sorted_columns);  // from_coo
  EigenSparse<Scalar> matrix = uncompressed_matrix(c, 2);
  EXPECT_TRUE(Query<Scalar>::from_eigen(c.shape.batch, c.shape.steps, std::move(matrix))
                  .csr()
                  .sorted_columns);  // Eigen keeps each row's inner indices sorted
  // A compressed Eigen matrix whose arrays were written out of order by hand.
  EigenSparse<Scalar> by_hand(2, 6);
  by_hand.resizeNonZeros(3);
  by_hand.outerIndexPtr()[0] = 0;
  by_hand.outerIndexPtr()[1] = 2;
  by_hand.outerIndexPtr()[2] = 3;
  by_hand.innerIndexPtr()[0] = 4;
  by_hand.innerIndexPtr()[1] = 1;
  by_hand.innerIndexPtr()[2] = 0;
  std::fill(by_hand.valuePtr(), by_hand.valuePtr() + 3, Scalar(1));
  EXPECT_FALSE(Query<Scalar>::from_eigen(1, 2, std::move(by_hand)).csr().sorted_columns);
}

TYPED_TEST(SparseQueryTest, ViewCsrAcceptsNullArraysWhenNothingIsStored) {
  const std::vector<int> offsets(7, 0);
  const auto query = Query<TypeParam>::view_csr(2, 3, 4, offsets.data(), 7, nullptr, nullptr, 0);
  EXPECT_EQ(query.nonzeros(), 0);
  EXPECT_TRUE((query.to_dense().array() == TypeParam(0)).all());
}

// ---- row views ----

TYPED_TEST(SparseQueryTest, BatchRowsAndMiddleRowsViewTheRightRowsInPlace) {
  Shape s = query_shape(3, 5, 11, 0.4);
  s.empty_rows = true;
  const auto c = make_case<TypeParam>(s, 230);
  const auto queries = both_forms(c);
  std::mt19937_64 generator(231);
  for (const auto& [name, query] : queries) {
    SCOPED_TRACE(name);
    const auto& csr = query.csr();
    Index total = 0;
    for (Index b = 0; b < s.batch; ++b) {
      const auto rows = query.batch_rows(b);
      EXPECT_EQ(rows.rows, s.steps);
      EXPECT_EQ(rows.cols, s.query_dim);
      EXPECT_EQ(rows.values, csr.values);
      EXPECT_EQ(rows.column_indices, csr.column_indices);
      EXPECT_TRUE(all_near(naive_dense(rows).data(),
                           twin_rows(c.problem.query, b * s.steps, s.steps, s.query_dim), kExact));
      total += rows.nonzeros();
    }
    EXPECT_EQ(total, query.nonzeros());
    for (int round = 0; round < 20; ++round) {
      const Index first = std::uniform_int_distribution<Index>(0, query.rows())(generator);
      const Index count = std::uniform_int_distribution<Index>(0, query.rows() - first)(generator);
      const auto rows = csr.middle_rows(first, count);
      EXPECT_EQ(rows.rows, count);
      EXPECT_TRUE(all_near(naive_dense(rows).data(),
                           twin_rows(c.problem.query, first, count, s.query_dim), kExact))
          << "rows [" << first << ", " << first + count << ")";
      Index stored = 0;
      for (Index row = 0; row < count; ++row) stored += rows.row_size(row);
      EXPECT_EQ(rows.nonzeros(), stored);
    }
    EXPECT_THROW(csr.middle_rows(2, query.rows()), std::logic_error);
  }
}

// ---- bad input ----

TYPED_TEST(SparseQueryTest, RejectsNegativeDimensions) {
  using Scalar = TypeParam;
  const CooIndices no_indices(0, 3);
  const sdmha::Vector<Scalar> no_values;
  SDMHA_EXPECT_THROW_WITH(Query<Scalar>::from_coo(-1, 2, 3, no_indices, no_values),
                          sdmha::ShapeError, "SparseQuery::from_coo: batch = -1; expected >= 0");
  SDMHA_EXPECT_THROW_WITH(Query<Scalar>::from_coo(1, -2, 3, no_indices, no_values),
                          sdmha::ShapeError, "steps = -2; expected >= 0");
  SDMHA_EXPECT_THROW_WITH(Query<Scalar>::from_coo(1, 2, -3, no_indices, no_values),
                          sdmha::ShapeError, "features = -3; expected >= 0");
  const int offsets[1] = {0};
  SDMHA_EXPECT_THROW_WITH(Query<Scalar>::view_csr(-1, 2, 3, offsets, 1, nullptr, nullptr, 0),
                          sdmha::ShapeError, "SparseQuery::view_csr: batch = -1; expected >= 0");
  SDMHA_EXPECT_THROW_WITH(Query<Scalar>::view_csr(0, 2, -3, offsets, 1, nullptr, nullptr, 0),
                          sdmha::ShapeError, "features = -3; expected >= 0");
  SDMHA_EXPECT_THROW_WITH(Query<Scalar>::from_eigen(2, -1, EigenSparse<Scalar>(4, 3)),
                          sdmha::ShapeError, "SparseQuery::from_eigen: steps = -1; expected >= 0");
}

TYPED_TEST(SparseQueryTest, RejectsShapesThatOverflowTheStorageIndex) {
  using Scalar = TypeParam;
  const CooIndices no_indices(0, 3);
  const sdmha::Vector<Scalar> no_values;
  SDMHA_EXPECT_THROW_WITH(
      Query<Scalar>::from_coo(65536, 32768, 4, no_indices, no_values), sdmha::ShapeError,
      "batch * steps = 65536 * 32768 does not fit the storage index type; expected < 2147483647");
  SDMHA_EXPECT_THROW_WITH(
      Query<Scalar>::from_coo(2, 3, Index(1) << 31, no_indices, no_values), sdmha::ShapeError,
      "features = 2147483648 does not fit the storage index type; expected <= 2147483647");
  const int offsets[1] = {0};
  SDMHA_EXPECT_THROW_WITH(Query<Scalar>::view_csr(65536, 32768, 4, offsets, 1, nullptr, nullptr, 0),
                          sdmha::ShapeError, "batch * steps = 65536 * 32768 does not fit");
  SDMHA_EXPECT_THROW_WITH(Query<Scalar>::from_eigen(65536, 32768, EigenSparse<Scalar>(4, 3)),
                          sdmha::ShapeError, "batch * steps = 65536 * 32768 does not fit");
  // With a 16-bit storage index the limits are small enough to reach, the entry count included.
  using ShortQuery = sdmha::SparseQuery<Scalar, std::int16_t>;
  SDMHA_EXPECT_THROW_WITH(
      ShortQuery::from_coo(200, 200, 4, no_indices, no_values), sdmha::ShapeError,
      "batch * steps = 200 * 200 does not fit the storage index type; expected < 32767");
  SDMHA_EXPECT_THROW_WITH(
      ShortQuery::from_coo(1, 1, 40000, no_indices, no_values), sdmha::ShapeError,
      "features = 40000 does not fit the storage index type; expected <= 32767");
  const CooIndices many = CooIndices::Zero(40000, 3);
  const sdmha::Vector<Scalar> many_values = sdmha::Vector<Scalar>::Ones(40000);
  SDMHA_EXPECT_THROW_WITH(ShortQuery::from_coo(1, 1, 4, many, many_values), sdmha::ShapeError,
                          "nnz = 40000 does not fit the storage index type; expected nnz <= 32767");
}

// from_coo allocates O(B·T) from its three shape numbers: past SparseQueryLimits::max_rows it
// refuses before allocating, naming the shape and the limit.
TYPED_TEST(SparseQueryTest, FromCooRejectsRowsPastItsLimit) {
  using Scalar = TypeParam;
  const CooIndices no_indices(0, 3);
  const sdmha::Vector<Scalar> no_values;
  const sdmha::SparseQueryLimits ten_rows{10};
  SDMHA_EXPECT_THROW_WITH(Query<Scalar>::from_coo(4, 5, 3, no_indices, no_values, ten_rows),
                          sdmha::ShapeError,
                          "SparseQuery::from_coo: dense shape (4, 5, 3) has batch * steps = 20 "
                          "rows; expected at most max_rows = 10 (SparseQueryLimits)");
  const auto at_limit = Query<Scalar>::from_coo(2, 5, 3, no_indices, no_values, ten_rows);
  EXPECT_EQ(at_limit.rows(), 10);
  // The default bounds a dense shape read from a small file: (2, 10^9, 16) fits the storage
  // index but not the default limit of 2^27 rows.
  EXPECT_EQ(sdmha::SparseQueryLimits().max_rows, Index(1) << 27);
  SDMHA_EXPECT_THROW_WITH(Query<Scalar>::from_coo(2, 1000000000, 16, no_indices, no_values),
                          sdmha::ShapeError,
                          "dense shape (2, 1000000000, 16) has batch * steps = 2000000000 rows; "
                          "expected at most max_rows = 134217728");
  // Zero steps ask for no rows whatever the batch; a raised limit lets more rows through.
  EXPECT_EQ(Query<Scalar>::from_coo(Index(1) << 28, 0, 4, no_indices, no_values).rows(), 0);
  EXPECT_EQ(Query<Scalar>::from_coo(10, 50, 4, no_indices, no_values, {500}).rows(), 500);
}

TYPED_TEST(SparseQueryTest, RejectsIndicesOfTheWrongShape) {
  using Scalar = TypeParam;
  const typename Query<Scalar>::CooIndices two_columns = Query<Scalar>::CooIndices::Zero(4, 2);
  const sdmha::Vector<Scalar> four_values = sdmha::Vector<Scalar>::Ones(4);
  SDMHA_EXPECT_THROW_WITH(Query<Scalar>::from_coo(2, 3, 5, two_columns, four_values),
                          sdmha::ShapeError,
                          "indices has 2 columns; expected 3 (batch, step, feature)");
  const CooIndices three_rows = CooIndices::Zero(3, 3);
  SDMHA_EXPECT_THROW_WITH(Query<Scalar>::from_coo(2, 3, 5, three_rows, four_values),
                          sdmha::ShapeError,
                          "indices has 3 rows but values has 4 entries; expected equal lengths");
}

TYPED_TEST(SparseQueryTest, RejectsCoordinatesOutOfRangeOnEachAxis) {
  using Scalar = TypeParam;
  const sdmha::Vector<Scalar> values = sdmha::Vector<Scalar>::Ones(3);
  const char* axis_names[3] = {"batch", "step", "feature"};
  const std::int64_t bounds[3] = {2, 3, 5};
  for (int axis = 0; axis < 3; ++axis) {
    for (std::int64_t bad : {std::int64_t(-1), bounds[axis], std::int64_t(1) << 40}) {
      CooIndices indices = CooIndices::Zero(3, 3);
      indices(2, 0) = 1;
      indices(2, 1) = 2;
      indices(2, 2) = 4;  // the largest valid coordinate
      indices(1, axis) = bad;
      const std::string fragment = "indices[1] " + std::string(axis_names[axis]) + " = " +
                                   std::to_string(bad) +
                                   " is out of range; expected 0 <= " + axis_names[axis] + " < " +
                                   std::to_string(bounds[axis]);
      SDMHA_EXPECT_THROW_WITH(Query<Scalar>::from_coo(2, 3, 5, indices, values), sdmha::IndexError,
                              fragment);
    }
  }
}

TYPED_TEST(SparseQueryTest, ViewCsrRejectsEveryMalformedArray) {
  using Scalar = TypeParam;
  // B = 2, T = 2, Eq = 6: four rows, five entries.
  const std::vector<int> offsets{0, 2, 2, 3, 5};
  const std::vector<int> columns{1, 4, 0, 5, 2};
  const std::vector<Scalar> values{1, 2, 3, 4, 5};
  auto view = [&](const std::vector<int>& row_offsets, const std::vector<int>& column_indices,
                  Index nonzero_count) {
    return Query<Scalar>::view_csr(2, 2, 6, row_offsets.data(), Index(row_offsets.size()),
                                   column_indices.data(), values.data(), nonzero_count);
  };
  EXPECT_NO_THROW(view(offsets, columns, 5));
  SDMHA_EXPECT_THROW_WITH(view({0, 2, 2, 3}, columns, 5), sdmha::ShapeError,
                          "row_offsets has 4 entries; expected batch * steps + 1 = 5");
  SDMHA_EXPECT_THROW_WITH(view({0, 2, 2, 3, 5, 5}, columns, 5), sdmha::ShapeError,
                          "row_offsets has 6 entries; expected batch * steps + 1 = 5");
  SDMHA_EXPECT_THROW_WITH(view(offsets, columns, -1), sdmha::ShapeError,
                          "nonzero_count = -1; expected >= 0");
  SDMHA_EXPECT_THROW_WITH(view({1, 2, 2, 3, 5}, columns, 5), sdmha::IndexError,
                          "row_offsets[0] = 1; expected 0");
  SDMHA_EXPECT_THROW_WITH(view({0, 2, 3, 2, 5}, columns, 5), sdmha::IndexError,
                          "row 2 spans [3, 2); expected 0 <= begin <= end <= 5");
  SDMHA_EXPECT_THROW_WITH(view({0, 7, 2, 3, 5}, columns, 5), sdmha::IndexError,
                          "row 0 spans [0, 7); expected 0 <= begin <= end <= 5");
  SDMHA_EXPECT_THROW_WITH(view({0, -1, 2, 3, 5}, columns, 5), sdmha::IndexError,
                          "row 0 spans [0, -1)");
  SDMHA_EXPECT_THROW_WITH(view(offsets, columns, 4), sdmha::IndexError,
                          "row_offsets[4] = 5; expected nonzero_count = 4");
  SDMHA_EXPECT_THROW_WITH(view(offsets, {1, 4, 0, 6, 2}, 5), sdmha::IndexError,
                          "row 3 has column index 6 at position 3; expected 0 <= column < 6");
  SDMHA_EXPECT_THROW_WITH(view(offsets, {1, -4, 0, 5, 2}, 5), sdmha::IndexError,
                          "row 0 has column index -4 at position 1; expected 0 <= column < 6");
  SDMHA_EXPECT_THROW_WITH(
      Query<Scalar>::view_csr(2, 2, 6, nullptr, 5, columns.data(), values.data(), 5),
      sdmha::ShapeError, "a CSR array pointer is null");
  SDMHA_EXPECT_THROW_WITH(
      Query<Scalar>::view_csr(2, 2, 6, offsets.data(), 5, nullptr, values.data(), 5),
      sdmha::ShapeError, "a CSR array pointer is null");
  SDMHA_EXPECT_THROW_WITH(
      Query<Scalar>::view_csr(2, 2, 6, offsets.data(), 5, columns.data(), nullptr, 5),
      sdmha::ShapeError, "a CSR array pointer is null");
}

TYPED_TEST(SparseQueryTest, FromEigenRejectsAMatrixWithTheWrongRowCount) {
  using Scalar = TypeParam;
  EigenSparse<Scalar> matrix(9, 4);
  matrix.insert(3, 1) = Scalar(1);
  matrix.makeCompressed();
  SDMHA_EXPECT_THROW_WITH(
      Query<Scalar>::from_eigen(2, 5, std::move(matrix)), sdmha::ShapeError,
      "SparseQuery::from_eigen: matrix has 9 rows; expected batch * steps = 2 * 5 = 10");
}

}  // namespace
}  // namespace sdmha_test
