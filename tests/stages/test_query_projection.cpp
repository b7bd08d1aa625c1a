// Tests of sdmha/stages/query_projection.hpp: SparseQueryProjection against the reference's
// projection of the dense twin, with and without bias, on compressed and uncompressed rows,
// caller CSR with unsorted duplicate columns, sub-views of rows, and its can_implement checks;
// then both kernels behind it on every panel tail, strided operands, full rows and caller scratch.
#include "test_support.hpp"

#include "stage_test.hpp"

namespace sdmha_test {
namespace {

SDMHA_SCALAR_TYPED_TEST_SUITE(QueryProjectionTest);

template <typename Scalar>
using Projection = sdmha::SparseQueryProjection<Scalar>;

// The by-feature kernel's memory for X of `features` columns and up to `nonzeros` stored values
// (its CSC, detail::FeatureGroups), carved from a ScratchBuffer of its own as a stage carves it
// from its workspace.
template <typename Scalar>
struct CarvedFeatureGroups {
  using Groups = sdmha::detail::FeatureGroups<Scalar, int>;
  sdmha::detail::ScratchBuffer memory;
  Groups groups;

  CarvedFeatureGroups(Index features, Index nonzeros) {
    memory.reserve(Groups::bytes(features, nonzeros, false));
    sdmha::detail::ScratchCarver carver(memory.view());
    groups = Groups::carve(carver, features, nonzeros, false);
  }
};

// A stage's workspace of workspace_size() bytes for a by-feature call over `features` columns,
// `width` outputs and up to `nonzeros` stored values.
template <typename Scalar>
struct StageWorkspace {
  sdmha::detail::ScratchBuffer memory;

  StageWorkspace(Index features, Index width, Index nonzeros) {
    sdmha::TileSizes sizes;
    sizes.features = features;
    sizes.output_width = width;
    sizes.nonzeros = nonzeros;
    memory.reserve(Projection<Scalar>::workspace_size(sizes));
  }
  sdmha::StageScratch view() const { return memory.view(); }
};

// The reference's Q = X·Wq (+ bq) of the case, over all rows.
template <typename Scalar>
std::vector<double> reference_projection(const Case<Scalar>& c, bool with_bias) {
  const auto& p = c.problem;
  return sdmha_reference::project(p.query, p.batch * p.steps, p.query_dim, p.query_kernel,
                                  with_bias ? p.query_bias : std::vector<double>{},
                                  p.heads * p.key_dim);
}

std::vector<std::pair<const char*, Shape>> projection_shapes() {
  std::vector<std::pair<const char*, Shape>> shapes;
  Shape s;
  shapes.push_back({"basic", s});
  s = Shape{};
  s.batch = 1;
  s.steps = 1;
  s.heads = 1;
  shapes.push_back({"one_row_one_head", s});
  s = query_shape(2, 7, 29, 0.3);
  s.heads = 3;
  s.key_dim = 5;
  shapes.push_back({"odd_sizes", s});
  s = Shape{};
  s.duplicates = true;
  s.density = 0.5;
  shapes.push_back({"duplicates", s});
  s = Shape{};
  s.empty_rows = true;
  s.steps = 9;
  shapes.push_back({"empty_rows", s});
  s = Shape{};
  s.use_bias = false;
  s.empty_rows = true;
  shapes.push_back({"no_bias", s});
  s = query_shape(3, 40, 70, 0.05);
  s.heads = 4;
  s.key_dim = 6;
  s.empty_rows = true;
  shapes.push_back({"larger", s});
  return shapes;
}

TYPED_TEST(QueryProjectionTest, MatchesTheReferenceWithAndWithoutBias) {
  std::uint64_t seed = 400;
  const sdmha::Vector<TypeParam> no_bias;
  for (const auto& [name, shape] : projection_shapes()) {
    SCOPED_TRACE(name);
    const auto c = make_case<TypeParam>(shape, seed++);
    const auto query = c.query();
    const auto with_bias =
        project<Projection<TypeParam>>(query.csr(), c.weights.query_kernel, c.weights.query_bias);
    EXPECT_TRUE(all_near(with_bias.data(), reference_projection(c, shape.use_bias),
                         relative_tolerance<TypeParam>()));
    const auto without_bias =
        project<Projection<TypeParam>>(query.csr(), c.weights.query_kernel, no_bias);
    EXPECT_TRUE(all_near(without_bias.data(), reference_projection(c, false),
                         relative_tolerance<TypeParam>()));
  }
}

TYPED_TEST(QueryProjectionTest, MatchesTheReferenceOnUncompressedRows) {
  const Shape s = uncompressed_query_shape();
  const auto c = make_case<TypeParam>(s, 410);
  auto matrix = uncompressed_matrix(c, 4);
  ASSERT_FALSE(matrix.isCompressed());
  const auto query = sdmha::SparseQuery<TypeParam>::from_eigen(s.batch, s.steps, std::move(matrix));
  ASSERT_NE(query.csr().row_nonzeros, nullptr);
  const auto output =
      project<Projection<TypeParam>>(query.csr(), c.weights.query_kernel, c.weights.query_bias);
  EXPECT_TRUE(
      all_near(output.data(), reference_projection(c, true), relative_tolerance<TypeParam>()));
  // And a sub-view of uncompressed rows.
  const Index width = s.heads * s.key_dim;
  const auto middle = project<Projection<TypeParam>>(query.csr().middle_rows(5, 8),
                                                     c.weights.query_kernel, c.weights.query_bias);
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
  dense[0 * 5 + 3] = 1.75;
  dense[0 * 5 + 0] = -2;
  dense[0 * 5 + 1] = 1;
  dense[2 * 5 + 4] = -0.75;
  dense[2 * 5 + 2] = 2;
  Shape s = Shape{}.sized(1, 3, 7);
  s.query_dim = 5;
  const auto c = make_case<Scalar>(s, 420);  // for its weights
  const auto query = sdmha::SparseQuery<Scalar>::view_csr(1, 3, 5, offsets.data(), 4,
                                                          columns.data(), values.data(), 6);
  const auto output =
      project<Projection<Scalar>>(query.csr(), c.weights.query_kernel, c.weights.query_bias);
  const auto expected = sdmha_reference::project(dense, 3, 5, c.problem.query_kernel,
                                                 c.problem.query_bias, s.heads * s.key_dim);
  EXPECT_TRUE(all_near(output.data(), expected, relative_tolerance<Scalar>()));
}

TYPED_TEST(QueryProjectionTest, ProjectsRowSubViewsIntoABlockOfALargerOutput) {
  Shape s = Shape{}.sized(3, 8, 7);
  s.empty_rows = true;
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
    sdmha::RowMatrix<TypeParam> big =
        sdmha::RowMatrix<TypeParam>::Constant(count + 3, width + 5, sentinel);
    typename Projection<TypeParam>::Arguments args{query.csr().middle_rows(first, count),
                                                   c.weights.query_kernel, c.weights.query_bias,
                                                   big.block(1, 2, count, width)};
    run_stage<Projection<TypeParam>>(args);
    const sdmha::RowMatrix<TypeParam> block = big.block(1, 2, count, width);
    EXPECT_TRUE(all_near(block.data(), twin_rows(expected, first, count, width),
                         relative_tolerance<TypeParam>()));
    ASSERT_TRUE(only_block_written(big, 1, 2, count, width, sentinel));
  }
}

TYPED_TEST(QueryProjectionTest, EmptyRowsGiveExactlyTheBias) {
  Shape s;
  s.steps = 12;
  s.empty_rows = true;
  const auto c = make_case<TypeParam>(s, 440);
  const auto query = c.query();
  const auto output =
      project<Projection<TypeParam>>(query.csr(), c.weights.query_kernel, c.weights.query_bias);
  const sdmha::Vector<TypeParam> no_bias;
  const auto unbiased =
      project<Projection<TypeParam>>(query.csr(), c.weights.query_kernel, no_bias);
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
  const auto biases =
      project<Projection<TypeParam>>(nothing.csr(), c.weights.query_kernel, c.weights.query_bias);
  for (Index row = 0; row < biases.rows(); ++row)
    EXPECT_TRUE((biases.row(row).transpose().array() == c.weights.query_bias.array()).all()) << row;
  const auto no_rows = sdmha::SparseQuery<TypeParam>::from_coo(0, 3, s.query_dim, no_indices,
                                                               sdmha::Vector<TypeParam>());
  EXPECT_EQ(
      project<Projection<TypeParam>>(no_rows.csr(), c.weights.query_kernel, c.weights.query_bias)
          .rows(),
      0);
}

TYPED_TEST(QueryProjectionTest, CanImplementRejectsEachMismatch) {
  using Scalar = TypeParam;
  const auto c = make_case<Scalar>(Shape{}, 450);  // 10 rows, Eq = 16, H·Dk = 8
  const auto query = c.query();
  const sdmha::RowMatrix<Scalar> short_kernel = sdmha::RowMatrix<Scalar>::Zero(15, 8);
  const sdmha::Vector<Scalar> long_bias = sdmha::Vector<Scalar>::Zero(9), no_bias;
  sdmha::RowMatrix<Scalar> output(10, 8), short_output(9, 8), narrow_output(10, 7);
  expect_accepted<Projection<Scalar>>({query.csr(), c.weights.query_kernel, no_bias, output});
  expect_refused<Projection<Scalar>>(
      {query.csr(), short_kernel, c.weights.query_bias, output},
      "SparseQueryProjection: kernel has 15 rows; expected the query's feature width 16");
  expect_refused<Projection<Scalar>>({query.csr(), c.weights.query_kernel, long_bias, output},
                                     "bias has 9 entries; expected 0 or 8");
  expect_refused<Projection<Scalar>>({query.csr(), c.weights.query_kernel, no_bias, short_output},
                                     "output is 9 x 8; expected 10 x 8");
  expect_refused<Projection<Scalar>>({query.csr(), c.weights.query_kernel, no_bias, narrow_output},
                                     "output is 10 x 7; expected 10 x 8");
}

// ---- the two kernels behind the stage: by rows and by features ----

SDMHA_SCALAR_TYPED_TEST_SUITE(QueryProjectionKernelsTest);

// Both kernels against a naive product, over widths that exercise full panels, the narrower
// panels (8, 4 and 1 packets with AVX-512's 16 floats: 128, 192 and 464 columns) and the scalar
// tail, with and without bias; on sorted rows they agree bitwise.
TYPED_TEST(QueryProjectionKernelsTest, ByRowsAndByFeaturesMatchTheNaiveProductAndEachOther) {
  using Scalar = TypeParam;
  std::mt19937_64 generator(31);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  for (Index columns : {1, 3, 16, 37, 128, 192, 256, 300, 464, 517}) {
    Shape s = query_shape(3, 11, 50, 0.3);
    s.empty_rows = true;
    s.duplicates = true;
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
      sdmha::detail::csr_dense_product(query.csr(), kernel.data(), columns, bias_data,
                                       by_rows.data(), columns, columns);
      CarvedFeatureGroups<Scalar> scratch(query.features(), query.nonzeros());
      sdmha::detail::csr_dense_product_by_feature(query.csr(), kernel.data(), columns, bias_data,
                                                  by_features.data(), columns, columns,
                                                  scratch.groups);
      EXPECT_TRUE(all_near(by_rows.data(), expected, relative_tolerance<Scalar>()))
          << columns << " columns";
      EXPECT_TRUE(all_near(by_features.data(), expected, relative_tolerance<Scalar>()))
          << columns << " columns";
      EXPECT_EQ(0, std::memcmp(by_rows.data(), by_features.data(),
                               sizeof(Scalar) * std::size_t(by_rows.size())))
          << columns << " columns";
    }
  }
}

// The stage takes the by-feature kernel for a kernel beyond the cache that the rows reuse (given
// its workspace_size() bytes of workspace), and still gives the naive product; without a workspace
// it falls back to the by-row kernel, with the same bits.
TYPED_TEST(QueryProjectionKernelsTest, StageOnAWideKernelMatchesTheNaiveProduct) {
  using Scalar = TypeParam;
  const Index features = 4200, columns = 40 + 4 * 1024 * 1024 / (4200 * Index(sizeof(Scalar)));
  const auto c = make_case<Scalar>(query_shape(2, 60, features, 0.04), 77);
  const auto query = c.query();
  ASSERT_GE(query.nonzeros(), 2 * features);
  std::mt19937_64 generator(5);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  sdmha::RowMatrix<Scalar> kernel(features, columns);
  for (Index i = 0; i < kernel.size(); ++i) kernel.data()[i] = Scalar(uniform(generator));
  sdmha::Vector<Scalar> bias = sdmha::Vector<Scalar>::Constant(columns, Scalar(0.25));
  sdmha::RowMatrix<Scalar> output(query.rows(), columns), by_rows(query.rows(), columns);
  sdmha::RowMatrix<Scalar> without_workspace(query.rows(), columns);
  const sdmha::SparseQueryProjection<Scalar> stage;
  const StageWorkspace<Scalar> workspace(features, columns, query.nonzeros());
  const typename sdmha::SparseQueryProjection<Scalar>::Arguments args{query.csr(), kernel, bias,
                                                                      output, workspace.view()};
  EXPECT_TRUE(sdmha::SparseQueryProjection<Scalar>::by_feature(args));
  EXPECT_GT(workspace.view().bytes, 0u);
  stage(args);
  // Without a workspace the stage goes by rows: the same sums in the same order.
  stage({query.csr(), kernel, bias, without_workspace});
  sdmha::detail::csr_dense_product(query.csr(), kernel.data(), columns, bias.data(), by_rows.data(),
                                   columns, columns);
  EXPECT_EQ(
      0, std::memcmp(output.data(), by_rows.data(), sizeof(Scalar) * std::size_t(output.size())));
  EXPECT_EQ(0, std::memcmp(without_workspace.data(), by_rows.data(),
                           sizeof(Scalar) * std::size_t(output.size())));
  const auto& csr = query.csr();
  for (Index r = 0; r < query.rows(); r += 17)
    for (Index j = 0; j < columns; j += 13) {
      double sum = 0.25;
      for (Index k = csr.row_begin(r); k < csr.row_end(r); ++k)
        sum += double(csr.values[k]) * double(kernel(csr.column_indices[k], j));
      EXPECT_NEAR(double(output(r, j)), sum, relative_tolerance<Scalar>() * (1 + std::abs(sum)));
    }
}

// ---- the kernels on hand-made CSR: every panel tail, empty and full rows, strides, scratch ----
// (QueryProjection in the suite name so that --gtest_filter='*QueryProjection*' selects them.)

SDMHA_SCALAR_TYPED_TEST_SUITE(QueryProjectionCsrKernelsTest);

// A CSR of `rows` × `features` with sorted distinct columns; row r holds row_sizes[r % size]
// values (clamped to `features`), so rows can be empty or full.
template <typename Scalar>
struct HandCsr {
  std::vector<int> offsets{0}, columns;
  std::vector<Scalar> values;
  Index rows = 0, features = 0;

  HandCsr(Index row_count, Index feature_count, const std::vector<Index>& row_sizes,
          std::uint64_t seed)
      : rows(row_count), features(feature_count) {
    std::mt19937_64 generator(seed);
    std::uniform_real_distribution<double> uniform(-1.0, 1.0);
    std::vector<int> all(static_cast<std::size_t>(features));
    std::iota(all.begin(), all.end(), 0);
    for (Index r = 0; r < rows; ++r) {
      const Index size = std::min(features, row_sizes[std::size_t(r) % row_sizes.size()]);
      std::shuffle(all.begin(), all.end(), generator);
      std::vector<int> chosen(all.begin(), all.begin() + size);
      std::sort(chosen.begin(), chosen.end());
      for (int c : chosen) {
        columns.push_back(c);
        values.push_back(Scalar(uniform(generator)));
      }
      offsets.push_back(int(columns.size()));
    }
  }
  sdmha::CsrView<Scalar> view() const {
    return sdmha::CsrView<Scalar>{rows,    features,       offsets.data(),
                                  nullptr, columns.data(), values.data()};
  }
  // The product in double, from the stored values (same values the kernels see).
  std::vector<double> reference(const Scalar* weight, Index weight_stride, const Scalar* bias,
                                Index width) const {
    std::vector<double> result(std::size_t(rows * width));
    for (Index r = 0; r < rows; ++r)
      for (Index j = 0; j < width; ++j) {
        double sum = bias != nullptr ? double(bias[j]) : 0.0;
        for (int k = offsets[std::size_t(r)]; k < offsets[std::size_t(r) + 1]; ++k)
          sum += double(values[std::size_t(k)]) *
                 double(weight[Index(columns[std::size_t(k)]) * weight_stride + j]);
        result[std::size_t(r * width + j)] = sum;
      }
    return result;
  }
};

template <typename Scalar>
std::vector<Scalar> random_values(Index count, std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  std::vector<Scalar> result(static_cast<std::size_t>(count));
  for (auto& value : result) value = Scalar(uniform(generator));
  return result;
}

// Widths around every panel boundary of the kernels: 16-, 8-, 4- and 1-packet panels and the
// scalar tail, for this build's packet size.
template <typename Scalar>
std::vector<Index> panel_tail_widths() {
  const Index p =
      sdmha::detail::PacketOf<Scalar>::vectorized ? sdmha::detail::PacketOf<Scalar>::size : 1;
  const Index panel = sdmha::detail::kPanelPackets * p;
  std::vector<Index> widths{1,
                            2,
                            p - 1,
                            p,
                            p + 1,
                            4 * p - 1,
                            4 * p,
                            4 * p + 1,
                            5 * p + 1,
                            8 * p - 1,
                            8 * p,
                            8 * p + 1,
                            13 * p + 1,
                            panel - 1,
                            panel,
                            panel + 1,
                            panel + 4 * p + p + 1,
                            panel + 13 * p + 1,
                            2 * panel,
                            2 * panel + 3};
  std::sort(widths.begin(), widths.end());
  widths.erase(std::unique(widths.begin(), widths.end()), widths.end());
  widths.erase(std::remove_if(widths.begin(), widths.end(), [](Index w) { return w < 1; }),
               widths.end());
  return widths;
}

// Both kernels (by rows also with streaming stores), every tail width, with and without bias, on
// strided W and strided Y (the padding of Y must stay untouched), rows empty, short and full;
// against the double reference, and bitwise against each other (sorted rows).
TYPED_TEST(QueryProjectionCsrKernelsTest,
           EveryPanelTailOnStridedOperandsMatchesTheDoubleReference) {
  using Scalar = TypeParam;
  constexpr Scalar sentinel = Scalar(-777);
  const Index features = 37;
  const HandCsr<Scalar> x(23, features, {0, 1, 2, 7, features, 3, 0, 20}, 901);
  CarvedFeatureGroups<Scalar> scratch(features, Index(x.columns.size()));  // reused over all widths
  for (const Index width : panel_tail_widths<Scalar>()) {
    SCOPED_TRACE(::testing::Message() << width << " columns");
    const Index weight_stride = width + 3, output_stride = width + 5;
    const auto weight = random_values<Scalar>(features * weight_stride, 902 + std::uint64_t(width));
    const auto bias_values = random_values<Scalar>(width, 903);
    for (const Scalar* bias : {static_cast<const Scalar*>(nullptr), bias_values.data()}) {
      const auto expected = x.reference(weight.data(), weight_stride, bias, width);
      std::vector<Scalar> by_rows(std::size_t(x.rows * output_stride), sentinel),
          by_features = by_rows, streamed = by_rows;
      sdmha::detail::csr_dense_product(x.view(), weight.data(), weight_stride, bias, by_rows.data(),
                                       output_stride, width);
      // Streaming stores where a packet is aligned (with AVX or AVX-512), plain ones elsewhere.
      sdmha::detail::csr_dense_product(x.view(), weight.data(), weight_stride, bias,
                                       streamed.data(), output_stride, width, /*stream=*/true);
      EXPECT_EQ(0, std::memcmp(by_rows.data(), streamed.data(), sizeof(Scalar) * by_rows.size()));
      sdmha::detail::csr_dense_product_by_feature(x.view(), weight.data(), weight_stride, bias,
                                                  by_features.data(), output_stride, width,
                                                  scratch.groups);
      for (const auto* result : {&by_rows, &by_features}) {
        std::vector<Scalar> packed(std::size_t(x.rows * width));
        for (Index r = 0; r < x.rows; ++r)
          for (Index j = 0; j < output_stride; ++j) {
            const Scalar value = (*result)[std::size_t(r * output_stride + j)];
            if (j < width) {
              packed[std::size_t(r * width + j)] = value;
            } else {
              ASSERT_EQ(value, sentinel) << "padding of row " << r << " written";
            }
          }
        EXPECT_TRUE(all_near(packed.data(), expected, relative_tolerance<Scalar>()))
            << (result == &by_rows ? "by rows" : "by features") << (bias ? ", bias" : ", no bias");
      }
      EXPECT_EQ(0,
                std::memcmp(by_rows.data(), by_features.data(), sizeof(Scalar) * by_rows.size()));
    }
  }
}

// Rows with many stored values (every feature of a wide query), where long FMA chains and many
// W rows per output row are exercised.
TYPED_TEST(QueryProjectionCsrKernelsTest, RowsWithManyStoredValuesMatchTheDoubleReference) {
  using Scalar = TypeParam;
  const Index features = 700,
              width = 2 * sdmha::detail::kPanelPackets * sdmha::detail::PacketOf<Scalar>::size + 7;
  const HandCsr<Scalar> x(9, features, {features, 500, 0, 1}, 911);
  const auto weight = random_values<Scalar>(features * width, 912);
  const auto bias = random_values<Scalar>(width, 913);
  const auto expected = x.reference(weight.data(), width, bias.data(), width);
  sdmha::RowMatrix<Scalar> by_rows(x.rows, width), by_features(x.rows, width);
  sdmha::detail::csr_dense_product(x.view(), weight.data(), width, bias.data(), by_rows.data(),
                                   width, width);
  CarvedFeatureGroups<Scalar> scratch(features, Index(x.columns.size()));
  sdmha::detail::csr_dense_product_by_feature(x.view(), weight.data(), width, bias.data(),
                                              by_features.data(), width, width, scratch.groups);
  EXPECT_TRUE(all_near(by_rows.data(), expected, relative_tolerance<Scalar>()));
  EXPECT_TRUE(all_near(by_features.data(), expected, relative_tolerance<Scalar>()));
  EXPECT_EQ(0, std::memcmp(by_rows.data(), by_features.data(),
                           sizeof(Scalar) * std::size_t(by_rows.size())));
}

// The stage on a kernel beyond L2 that its rows reuse takes the by-feature path; with a caller
// workspace (workspace_size() bytes for the largest call) reused over row ranges of different
// sizes (larger and smaller), writing into a block of a larger output from a block of a larger
// kernel, it matches the double reference and leaves the rest of the output alone.
TYPED_TEST(QueryProjectionCsrKernelsTest,
           StageByFeaturesWithCallerScratchOnStridedOutputAndKernel) {
  using Scalar = TypeParam;
  using Projection = sdmha::SparseQueryProjection<Scalar>;
  constexpr Scalar sentinel = Scalar(-777);
  const Index features = 3000;
  const Index width = 3 * 1024 * 1024 / (features * Index(sizeof(Scalar))) + 5;  // W > 2 MB
  const HandCsr<Scalar> x(160, features, {60, 0, 45, 90, 1, 70}, 921);
  ASSERT_GE(Index(x.columns.size()), 2 * features);
  sdmha::RowMatrix<Scalar> big_kernel(features + 2, width + 6);
  {
    const auto values = random_values<Scalar>(big_kernel.size(), 922);
    std::copy(values.begin(), values.end(), big_kernel.data());
  }
  const auto kernel = big_kernel.block(1, 4, features, width);
  const sdmha::RowMatrix<Scalar> kernel_copy = kernel;
  const auto bias_values = random_values<Scalar>(width, 923);
  const sdmha::Vector<Scalar> bias =
      Eigen::Map<const sdmha::Vector<Scalar>>(bias_values.data(), width);
  const auto expected = x.reference(kernel_copy.data(), width, bias.data(), width);
  // One workspace for every call, sized by workspace_size() for the largest (all 160 rows).
  const StageWorkspace<Scalar> workspace(features, width, Index(x.columns.size()));
  const Projection stage;
  for (const auto& [first, count] :
       std::vector<std::pair<Index, Index>>{{0, 160}, {7, 40}, {3, 150}, {159, 1}}) {
    SCOPED_TRACE(::testing::Message() << "rows [" << first << ", " << first + count << ")");
    sdmha::RowMatrix<Scalar> big =
        sdmha::RowMatrix<Scalar>::Constant(count + 2, width + 3, sentinel);
    typename Projection::Arguments args{x.view().middle_rows(first, count), kernel, bias,
                                        big.block(1, 1, count, width), workspace.view()};
    Projection::can_implement(args);
    if (count >= 150) {
      EXPECT_TRUE(Projection::by_feature(args));
    }
    stage(args);
    const sdmha::RowMatrix<Scalar> block = big.block(1, 1, count, width);
    EXPECT_TRUE(all_near(block.data(), twin_rows(expected, first, count, width),
                         relative_tolerance<Scalar>()));
    ASSERT_TRUE(only_block_written(big, 1, 1, count, width, sentinel));
  }
  // A small kernel stays on the by-row path.
  sdmha::RowMatrix<Scalar> small_output(x.rows, 8);
  const sdmha::RowMatrix<Scalar> small_kernel = sdmha::RowMatrix<Scalar>::Ones(features, 8);
  const sdmha::Vector<Scalar> no_bias;
  EXPECT_FALSE(Projection::by_feature(
      typename Projection::Arguments{x.view(), small_kernel, no_bias, small_output}));
}

// The stage on a kernel within L2 and an output beyond kStreamOutputBytes streams its stores
// (where the build has them); into the whole output and into a block of a larger one, whose
// rows are then not all aligned, it matches the double reference and leaves the rest alone.
TYPED_TEST(QueryProjectionCsrKernelsTest, StageWithStreamingStoresMatchesTheDoubleReference) {
  using Scalar = TypeParam;
  using Projection = sdmha::SparseQueryProjection<Scalar>;
  constexpr Scalar sentinel = Scalar(-777);
  const Index features = 96, width = 2 * sdmha::detail::kPanelPackets * 8 + 8 + 3;  // 267
  const Index rows = Index(sdmha::detail::kStreamOutputBytes) / (width * Index(sizeof(Scalar))) + 9;
  const HandCsr<Scalar> x(rows, features, {5, 0, 1, 40, features}, 931);
  sdmha::RowMatrix<Scalar> kernel(features, width);
  {
    const auto values = random_values<Scalar>(kernel.size(), 932);
    std::copy(values.begin(), values.end(), kernel.data());
  }
  const sdmha::Vector<Scalar> bias = sdmha::Vector<Scalar>::LinSpaced(width, Scalar(-1), Scalar(1));
  const auto expected = x.reference(kernel.data(), width, bias.data(), width);
  const Projection stage;
  sdmha::RowMatrix<Scalar> output(rows, width);
  typename Projection::Arguments whole{x.view(), kernel, bias, output};
  EXPECT_TRUE(Projection::stream_output(whole));
  EXPECT_FALSE(Projection::by_feature(whole));
  stage(whole);
  EXPECT_TRUE(all_near(output.data(), expected, relative_tolerance<Scalar>()));
  sdmha::RowMatrix<Scalar> big = sdmha::RowMatrix<Scalar>::Constant(rows + 2, width + 5, sentinel);
  typename Projection::Arguments block{x.view(), kernel, bias, big.block(1, 3, rows, width)};
  EXPECT_TRUE(Projection::stream_output(block));
  stage(block);
  const sdmha::RowMatrix<Scalar> inner = big.block(1, 3, rows, width);
  EXPECT_TRUE(all_near(inner.data(), expected, relative_tolerance<Scalar>()));
  ASSERT_TRUE(only_block_written(big, 1, 3, rows, width, sentinel));
}

// ---- the query kernel in bfloat16 ----
// (QueryProjection in the suite name so that --gtest_filter='*QueryProjection*' selects them.)

using BFloat16Matrix = sdmha::RowMatrix<Eigen::bfloat16>;
using FloatProjection = sdmha::SparseQueryProjection<float>;

// Wq rounded to bfloat16, and that rounding widened back to float (exact).
struct RoundedKernel {
  BFloat16Matrix rounded;
  sdmha::RowMatrix<float> widened;
  sdmha::detail::BFloat16Panels panels;  // the same rounding, by column panels
  explicit RoundedKernel(const sdmha::RowMatrix<float>& kernel)
      : rounded(kernel.cast<Eigen::bfloat16>()), widened(rounded.cast<float>()), panels(kernel) {}
};

sdmha::RowMatrix<float> random_kernel(Index rows, Index columns, std::uint64_t seed) {
  sdmha::RowMatrix<float> kernel(rows, columns);
  const auto values = random_values<float>(kernel.size(), seed);
  std::copy(values.begin(), values.end(), kernel.data());
  return kernel;
}

// Both kernels with W in bfloat16 are the float by-row kernel on the widened rounding, bit for
// bit: on every panel tail, with and without bias, with empty and full rows, and for a kernel
// beyond the cache (the by-row kernel's prefetching path) whose rows are long enough to prefetch
// ahead.
TEST(QueryProjectionBFloat16Test, IsTheFloatKernelOnTheRoundedWeightsBitForBit) {
  struct Size {
    Index rows, features, width;
    std::vector<Index> row_sizes;
  };
  const std::vector<Size> sizes = {{9, 40, 1, {5, 0, 1, 40}},     {9, 40, 17, {5, 0, 1, 40}},
                                   {7, 64, 255, {3, 64, 0}},      {7, 64, 256, {3, 64, 0}},
                                   {5, 33, 300, {33, 2}},         {4, 4096, 300, {90, 0, 17, 400}},
                                   {3, 2100, 520, {200, 1, 2100}}};
  for (const Size& size : sizes) {
    const HandCsr<float> x(size.rows, size.features, size.row_sizes,
                           70 + std::uint64_t(size.width));
    const RoundedKernel kernel(random_kernel(size.features, size.width, 71));
    const sdmha::Vector<float> bias = sdmha::Vector<float>::LinSpaced(size.width, -1.0f, 1.0f);
    for (const float* bias_data : {static_cast<const float*>(nullptr), bias.data()}) {
      sdmha::RowMatrix<float> from_bfloat16(size.rows, size.width), widened(size.rows, size.width);
      sdmha::detail::csr_bfloat16_product(x.view(), kernel.rounded.data(), size.width, bias_data,
                                          from_bfloat16.data(), size.width, size.width);
      sdmha::detail::csr_dense_product(x.view(), kernel.widened.data(), size.width, bias_data,
                                       widened.data(), size.width, size.width);
      EXPECT_EQ(0, std::memcmp(from_bfloat16.data(), widened.data(),
                               sizeof(float) * std::size_t(widened.size())))
          << size.rows << " x " << size.features << " x " << size.width;
      // By features: the same bits again (the rows are sorted).
      CarvedFeatureGroups<float> scratch(size.features, x.view().nonzeros());
      sdmha::detail::csr_dense_product_by_feature(x.view(), kernel.rounded.data(), size.width,
                                                  bias_data, from_bfloat16.data(), size.width,
                                                  size.width, scratch.groups);
      EXPECT_EQ(0, std::memcmp(from_bfloat16.data(), widened.data(),
                               sizeof(float) * std::size_t(widened.size())))
          << "by feature, " << size.rows << " x " << size.features << " x " << size.width;
    }
  }
}

// The panels hold the rounding of every entry, panel after panel, the last one padded with zeros.
TEST(QueryProjectionBFloat16Test, PanelsHoldTheRoundedKernelByColumnPanels) {
  constexpr Index kColumns = sdmha::detail::kBFloat16PanelColumns;
  for (const Index width : {Index(1), Index(100), kColumns, kColumns + 1, Index(300)}) {
    const RoundedKernel kernel(random_kernel(7, width, 60 + std::uint64_t(width)));
    const auto& panels = kernel.panels;
    ASSERT_EQ(panels.rows(), 7);
    ASSERT_EQ(panels.cols(), width);
    ASSERT_EQ(panels.panel_count(), (width + kColumns - 1) / kColumns);
    for (Index p = 0; p < panels.panel_count(); ++p) {
      const Index expected_width = std::min(kColumns, width - p * kColumns);
      ASSERT_EQ(panels.panel_width(p), expected_width);
      for (Index r = 0; r < 7; ++r)
        for (Index j = 0; j < kColumns; ++j) {
          const Eigen::bfloat16 stored = panels.panel(p)[r * kColumns + j];
          const Eigen::bfloat16 expected =
              j < expected_width ? kernel.rounded(r, p * kColumns + j) : Eigen::bfloat16(0.0f);
          ASSERT_EQ(Eigen::numext::bit_cast<std::uint16_t>(stored),
                    Eigen::numext::bit_cast<std::uint16_t>(expected))
              << "width " << width << ", panel " << p << ", row " << r << ", column " << j;
        }
    }
    for (Index r = 0; r < 7; ++r)
      for (Index j = 0; j < width; ++j) ASSERT_EQ(panels(r, j), kernel.widened(r, j));
  }
}

// The three kernels over the panels (by rows, by feature, by feature blocks) are the float by-row
// kernel on the widened rounding, bit for bit: panel tails, with and without bias, empty and full
// rows, and more features than one block holds (the blocks and their prefetch of the next one,
// across panels).
TEST(QueryProjectionBFloat16Test, PanelKernelsAreTheFloatKernelOnTheRoundedWeightsBitForBit) {
  struct Size {
    Index rows, features, width;
    std::vector<Index> row_sizes;
  };
  const std::vector<Size> sizes = {{9, 40, 1, {5, 0, 1, 40}},      {7, 64, 128, {3, 64, 0}},
                                   {5, 33, 300, {33, 2}},          {4, 4096, 300, {90, 0, 17, 400}},
                                   {3, 2100, 520, {200, 1, 2100}}, {6, 5000, 129, {0, 700, 3}}};
  for (const Size& size : sizes) {
    SCOPED_TRACE(::testing::Message()
                 << size.rows << " x " << size.features << " x " << size.width);
    const HandCsr<float> x(size.rows, size.features, size.row_sizes,
                           170 + std::uint64_t(size.width));
    sdmha::CsrView<float> sorted = x.view();
    sorted.sorted_columns = true;  // HandCsr sorts each row's columns
    const RoundedKernel kernel(random_kernel(size.features, size.width, 171));
    const sdmha::Vector<float> bias = sdmha::Vector<float>::LinSpaced(size.width, -1.0f, 1.0f);
    for (const float* bias_data : {static_cast<const float*>(nullptr), bias.data()}) {
      sdmha::RowMatrix<float> widened(size.rows, size.width), by_rows(size.rows, size.width),
          by_feature(size.rows, size.width), by_blocks(size.rows, size.width);
      sdmha::detail::csr_dense_product(x.view(), kernel.widened.data(), size.width, bias_data,
                                       widened.data(), size.width, size.width);
      sdmha::detail::bfloat16_panels_product(x.view(), kernel.panels, bias_data, by_rows.data(),
                                             size.width);
      CarvedFeatureGroups<float> scratch(size.features, x.view().nonzeros());
      sdmha::detail::bfloat16_panels_by_feature(x.view(), kernel.panels, bias_data,
                                                by_feature.data(), size.width, scratch.groups);
      std::vector<int> cursors(std::size_t(size.rows), -1);
      sdmha::detail::bfloat16_panels_by_feature_blocks(
          sorted, kernel.panels, bias_data, by_blocks.data(), size.width, cursors.data());
      const std::size_t bytes = sizeof(float) * std::size_t(widened.size());
      EXPECT_EQ(0, std::memcmp(by_rows.data(), widened.data(), bytes)) << "by rows";
      EXPECT_EQ(0, std::memcmp(by_feature.data(), widened.data(), bytes)) << "by feature";
      EXPECT_EQ(0, std::memcmp(by_blocks.data(), widened.data(), bytes)) << "by feature blocks";
    }
  }
}

// The stage over a kernel beyond the cache (by feature): rows known to be sorted go by feature
// blocks, others over the CSC; either way the float stage's bits on the widened rounding, for
// the same rows. Rows with unsorted columns not marked sorted give those bits too (the CSC adds
// in ascending feature order, as the float stage does there).
TEST(QueryProjectionBFloat16Test, StageBeyondTheCacheTakesSortedAndUnsortedRows) {
  const Index rows = 24, features = 4096, width = 300;
  const HandCsr<float> x(rows, features, {400, 0, 3, 1000}, 181);
  ASSERT_TRUE(FloatProjection::kernel_beyond_cache(features, width));
  ASSERT_GE(x.view().nonzeros(), 2 * features);
  HandCsr<float> reversed = x;  // each row's columns in descending order
  for (Index r = 0; r < rows; ++r) {
    const auto first = std::size_t(x.offsets[std::size_t(r)]);
    const auto last = std::size_t(x.offsets[std::size_t(r) + 1]);
    std::reverse(reversed.columns.begin() + std::ptrdiff_t(first),
                 reversed.columns.begin() + std::ptrdiff_t(last));
    std::reverse(reversed.values.begin() + std::ptrdiff_t(first),
                 reversed.values.begin() + std::ptrdiff_t(last));
  }
  const RoundedKernel kernel(random_kernel(features, width, 182));
  const sdmha::Vector<float> bias = sdmha::Vector<float>::LinSpaced(width, -1.0f, 1.0f);
  const StageWorkspace<float> workspace(features, width, x.view().nonzeros());
  sdmha::CsrView<float> sorted = x.view();
  sorted.sorted_columns = true;
  for (const sdmha::CsrView<float>& view : {sorted, x.view(), reversed.view()}) {
    SCOPED_TRACE(view.sorted_columns                       ? "sorted"
                 : view.column_indices == x.columns.data() ? "sorted, not marked"
                                                           : "unsorted");
    sdmha::RowMatrix<float> output(rows, width), in_float(rows, width);
    FloatProjection::Arguments args{view, kernel.widened, bias, output, workspace.view()};
    args.kernel_bfloat16 = &kernel.panels;
    run_stage<FloatProjection>(args);
    FloatProjection()({view, kernel.widened, bias, in_float, workspace.view()});
    EXPECT_EQ(
        0, std::memcmp(output.data(), in_float.data(), sizeof(float) * std::size_t(rows * width)));
    const auto expected = x.reference(kernel.widened.data(), width, bias.data(), width);
    EXPECT_TRUE(all_near(output.data(), expected, relative_tolerance<float>()));
  }
}

// Which path the stage took, seen where the paths differ: rows in descending order marked sorted
// (a lie only a test tells) go by feature blocks, which add in CSR order, the by-row kernel's
// order, where the CSC would add in ascending feature order. The blocks kernel is exact for any
// order (its cursors only move forward); the mark only picks it.
TEST(QueryProjectionBFloat16Test, StageTakesFeatureBlocksForRowsMarkedSorted) {
  const Index rows = 24, features = 4096, width = 300;
  HandCsr<float> x(rows, features, {400, 0, 3, 1000}, 191);
  for (Index r = 0; r < rows; ++r) {
    const auto first = std::ptrdiff_t(x.offsets[std::size_t(r)]);
    const auto last = std::ptrdiff_t(x.offsets[std::size_t(r) + 1]);
    std::reverse(x.columns.begin() + first, x.columns.begin() + last);
    std::reverse(x.values.begin() + first, x.values.begin() + last);
  }
  const RoundedKernel kernel(random_kernel(features, width, 192));
  const sdmha::Vector<float> bias = sdmha::Vector<float>::LinSpaced(width, -1.0f, 1.0f);
  const StageWorkspace<float> workspace(features, width, x.view().nonzeros());
  sdmha::CsrView<float> marked = x.view();
  marked.sorted_columns = true;
  sdmha::RowMatrix<float> output(rows, width), by_rows(rows, width), over_csc(rows, width);
  FloatProjection::Arguments args{marked, kernel.widened, bias, output, workspace.view()};
  args.kernel_bfloat16 = &kernel.panels;
  FloatProjection()(args);
  sdmha::detail::csr_dense_product(x.view(), kernel.widened.data(), width, bias.data(),
                                   by_rows.data(), width, width);
  FloatProjection()({x.view(), kernel.widened, bias, over_csc, workspace.view()});
  const std::size_t bytes = sizeof(float) * std::size_t(rows * width);
  EXPECT_EQ(0, std::memcmp(output.data(), by_rows.data(), bytes)) << "not by feature blocks";
  EXPECT_NE(0, std::memcmp(output.data(), over_csc.data(), bytes)) << "orders not told apart";
}

// The feature-block kernel on views other than HandCsr's plain one: an uncompressed view (row
// counts apart, slack between rows), rows viewed from the middle (offsets not starting at 0), a
// column repeated within a row, 64-bit indices (the scalar count); and no rows at all, with a
// null output. Each time csr_dense_product's bits on the widened rounding.
TEST(QueryProjectionBFloat16Test, FeatureBlocksTakeUncompressedMiddleRepeatedAndWideIndexRows) {
  const Index features = 2500, width = 140, rows = 5;
  // Row r holds entries [starts[r], starts[r] + counts[r]); the slack in between is garbage.
  const std::vector<std::int64_t> starts{0, 700, 710, 1500, 1501, 2300};
  const std::vector<std::int64_t> counts{600, 3, 0, 1, 700};
  std::vector<std::int64_t> columns(2300, 999999);  // out of range: read only if slack were
  std::vector<float> values(2300, std::numeric_limits<float>::quiet_NaN());
  std::mt19937_64 generator(201);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (Index r = 0; r < rows; ++r) {
    std::vector<std::int64_t> chosen;
    for (std::int64_t k = 0; k < counts[std::size_t(r)]; ++k)
      chosen.push_back(std::int64_t(generator() % std::uint64_t(features)));
    std::sort(chosen.begin(), chosen.end());  // repeats kept: a column may come twice
    for (std::size_t k = 0; k < chosen.size(); ++k) {
      columns[std::size_t(starts[std::size_t(r)]) + k] = chosen[k];
      values[std::size_t(starts[std::size_t(r)]) + k] = uniform(generator);
    }
  }
  sdmha::CsrView<float, std::int64_t> uncompressed{rows,          features,       starts.data(),
                                                   counts.data(), columns.data(), values.data()};
  uncompressed.sorted_columns = true;
  const RoundedKernel kernel(random_kernel(features, width, 202));
  const sdmha::Vector<float> bias = sdmha::Vector<float>::LinSpaced(width, -1.0f, 1.0f);
  for (const auto& view :
       {uncompressed, uncompressed.middle_rows(1, 4), uncompressed.middle_rows(3, 2)}) {
    SCOPED_TRACE(::testing::Message() << view.rows << " rows from offset " << view.row_offsets[0]);
    sdmha::RowMatrix<float> expected(view.rows, width), output(view.rows, width);
    sdmha::detail::csr_dense_product(view, kernel.widened.data(), width, bias.data(),
                                     expected.data(), width, width);
    std::vector<std::int64_t> cursors(std::size_t(view.rows), -1);
    sdmha::detail::bfloat16_panels_by_feature_blocks(view, kernel.panels, bias.data(),
                                                     output.data(), width, cursors.data());
    EXPECT_EQ(0, std::memcmp(output.data(), expected.data(),
                             sizeof(float) * std::size_t(expected.size())));
  }
  const auto none = uncompressed.middle_rows(2, 0);
  sdmha::detail::bfloat16_panels_by_feature_blocks(none, kernel.panels, bias.data(),
                                                   static_cast<float*>(nullptr), width,
                                                   static_cast<std::int64_t*>(nullptr));
  sdmha::detail::bfloat16_panels_product(none, kernel.panels, bias.data(),
                                         static_cast<float*>(nullptr), width);
}

// No query rows through the stage with the bfloat16 kernel: an empty output (null data), nothing
// written, nothing offset from null.
TEST(QueryProjectionBFloat16Test, StageTakesNoRows) {
  const Index features = 4096, width = 300;
  const HandCsr<float> x(0, features, {1}, 211);
  const RoundedKernel kernel(random_kernel(features, width, 212));
  const sdmha::Vector<float> bias = sdmha::Vector<float>::Ones(width);
  sdmha::RowMatrix<float> output(0, width);
  const StageWorkspace<float> workspace(features, width, 0);
  FloatProjection::Arguments args{x.view(), kernel.widened, bias, output, workspace.view()};
  args.kernel_bfloat16 = &kernel.panels;
  run_stage<FloatProjection>(args);
  EXPECT_EQ(output.size(), 0);
}

// Against the float64 product with the exact weights: rounding each weight to nearest bfloat16
// (8 significant bits) moves it by at most 2⁻⁸ of itself, so |Q̃ − Q| ≤ 2⁻⁸·Σ|x·w| plus float32's
// own summation error
// (at most (n + 1)·2⁻²⁴·Σ|x·w| for n stored values). Also at least one entry must differ from the
// float kernel's, or the test would not see the rounding at all.
TEST(QueryProjectionBFloat16Test, StageStaysWithinTheRoundingBoundOfTheExactProduct) {
  const Index rows = 6, features = 3000, width = 260;
  const HandCsr<float> x(rows, features, {300, 0, 7, 1500}, 81);
  const sdmha::RowMatrix<float> exact = random_kernel(features, width, 82);
  const RoundedKernel kernel(exact);
  const sdmha::Vector<float> bias = sdmha::Vector<float>::Constant(width, 0.5f);
  sdmha::RowMatrix<float> output(rows, width), in_float(rows, width);
  const FloatProjection stage;
  FloatProjection::Arguments args{x.view(), exact, bias, output};
  args.kernel_bfloat16 = &kernel.panels;
  FloatProjection::can_implement(args);
  stage(args);
  stage({x.view(), exact, bias, in_float});
  const auto expected = x.reference(exact.data(), width, bias.data(), width);
  bool differs = false;
  for (Index r = 0; r < rows; ++r) {
    const Index stored = x.offsets[std::size_t(r) + 1] - x.offsets[std::size_t(r)];
    for (Index j = 0; j < width; ++j) {
      double magnitude = 0.5;
      for (int k = x.offsets[std::size_t(r)]; k < x.offsets[std::size_t(r) + 1]; ++k)
        magnitude += std::abs(double(x.values[std::size_t(k)]) *
                              double(exact(x.columns[std::size_t(k)], j)));
      const double bound = (std::ldexp(1.0, -8) + double(stored + 1) * std::ldexp(1.0, -24)) *
                           magnitude * (1 + 1e-6);
      ASSERT_LE(std::abs(double(output(r, j)) - expected[std::size_t(r * width + j)]), bound)
          << r << ", " << j;
      differs = differs || output(r, j) != in_float(r, j);
    }
  }
  EXPECT_TRUE(differs);
}

TEST(QueryProjectionBFloat16Test, CanImplementRejectsAMismatchedOrDoubleKernel) {
  const HandCsr<float> x(3, 20, {4}, 91);
  const sdmha::RowMatrix<float> kernel = random_kernel(20, 8, 92);
  const RoundedKernel wrong(random_kernel(20, 9, 93));
  sdmha::RowMatrix<float> output(3, 8);
  FloatProjection::Arguments args{x.view(), kernel, sdmha::Vector<float>(), output};
  args.kernel_bfloat16 = &wrong.panels;
  SDMHA_EXPECT_THROW_WITH(FloatProjection::can_implement(args), sdmha::ShapeError,
                          "kernel_bfloat16 is 20 x 9; expected the kernel's 20 x 8");
  const HandCsr<double> x64(3, 20, {4}, 94);
  const sdmha::RowMatrix<double> kernel64 = kernel.cast<double>();
  const RoundedKernel rounded(kernel);
  sdmha::RowMatrix<double> output64(3, 8);
  sdmha::SparseQueryProjection<double>::Arguments args64{x64.view(), kernel64,
                                                         sdmha::Vector<double>(), output64};
  args64.kernel_bfloat16 = &rounded.panels;
  SDMHA_EXPECT_THROW_WITH(sdmha::SparseQueryProjection<double>::can_implement(args64),
                          sdmha::ConfigError, "bfloat16 kernels need Scalar = float");
}

// Q in windows of Wq's columns (first_column, kernel_columns), with and without a CSC built once
// for the rows (build_query_groups), is bitwise the whole call: by rows (Wq in L2) and by feature
// (Wq beyond L2), widths that leave a narrower last window.
TEST(QueryProjectionWindows, WindowsEqualTheWholeCallBitForBit) {
  using WindowProjection = sdmha::SparseQueryProjection<float>;
  const std::pair<Index, Index> shapes[] = {{512, 200}, {8192, 136}};  // Eq, N
  std::mt19937_64 random(17);
  std::normal_distribution<float> normal;
  for (const auto& [features, columns] : shapes) {
    const Index rows = 96, per_row = std::max<Index>(2, features / 40);
    Eigen::SparseMatrix<float, Eigen::RowMajor, int> x(rows, features);
    std::vector<Eigen::Triplet<float, int>> entries;
    for (Index r = 0; r < rows; ++r)
      for (Index k = 0; k < per_row; ++k)
        entries.emplace_back(int(r), int((k * 37 + r * 11) % features), normal(random));
    x.setFromTriplets(entries.begin(), entries.end());
    x.makeCompressed();
    const Index stored = x.nonZeros();
    const auto query = sdmha::SparseQuery<float>::from_eigen(1, rows, std::move(x));
    const auto& view = query.csr();
    sdmha::RowMatrix<float> kernel(features, columns);
    for (Index i = 0; i < kernel.size(); ++i) kernel.data()[i] = normal(random);
    sdmha::Vector<float> bias(columns);
    for (Index i = 0; i < columns; ++i) bias[i] = normal(random);
    const WindowProjection projection;
    sdmha::detail::ScratchBuffer scratch, groups_memory;
    sdmha::TileSizes sizes;
    sizes.rows = rows;
    sizes.features = features;
    sizes.output_width = columns;
    sizes.nonzeros = stored;
    scratch.reserve(WindowProjection::workspace_size(sizes));
    groups_memory.reserve(WindowProjection::query_groups_bytes(features, stored));
    sdmha::RowMatrix<float> whole(rows, columns), windowed(rows, columns), shared(rows, columns);
    projection({view, kernel, bias, whole, scratch.view()});
    const auto groups = WindowProjection::build_query_groups(view, groups_memory.view());
    const Index width = WindowProjection::column_window_width(false);
    for (Index first = 0; first < columns; first += width) {
      const Index w = std::min(width, columns - first);
      for (const bool prebuilt : {false, true}) {
        sdmha::RowMatrix<float>& out = prebuilt ? shared : windowed;
        WindowProjection::Arguments args{view, kernel.middleCols(first, w), bias.segment(first, w),
                                         out.middleCols(first, w), scratch.view()};
        args.first_column = first;
        args.kernel_columns = columns;
        if (prebuilt && WindowProjection::reads_feature_groups(args)) args.feature_groups = &groups;
        WindowProjection::can_implement(args);
        projection(args);
      }
    }
    EXPECT_EQ(0, std::memcmp(whole.data(), windowed.data(), sizeof(float) * whole.size()))
        << "Eq " << features;
    EXPECT_EQ(0, std::memcmp(whole.data(), shared.data(), sizeof(float) * whole.size()))
        << "Eq " << features;
  }
}

}  // namespace
}  // namespace sdmha_test
