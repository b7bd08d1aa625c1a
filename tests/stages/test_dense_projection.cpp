// Tests of sdmha/stages/dense_projection.hpp: DenseProjection (the key, value and dense-query
// projections) against sdmha_reference::project, with and without bias, on blocks of larger
// matrices (outer stride ≠ columns), and its can_implement checks; detail::RowProjection's
// ranges of items, bitwise those of its single items; and sdmha/stages/context_projection.hpp's
// ContextProjection, the layers' key and value stage: DenseProjection's bits under its own name.
#include "test_support.hpp"

#include "stage_test.hpp"

#include <cstring>

namespace sdmha_test {
namespace {

SDMHA_SCALAR_TYPED_TEST_SUITE(DenseProjectionTest);

template <typename Scalar>
using Projection = sdmha::DenseProjection<Scalar>;

// A random matrix and its float64 twin, element by element the same values.
template <typename Scalar>
sdmha::RowMatrix<Scalar> random_matrix(Index rows, Index cols, std::mt19937_64& generator) {
  std::uniform_real_distribution<double> distribution(-1.0, 1.0);
  sdmha::RowMatrix<Scalar> matrix(rows, cols);
  for (Index i = 0; i < matrix.size(); ++i) matrix.data()[i] = Scalar(distribution(generator));
  return matrix;
}

template <typename Derived>
std::vector<double> twin_of(const Eigen::MatrixBase<Derived>& matrix) {
  std::vector<double> twin;
  for (Index r = 0; r < matrix.rows(); ++r)
    for (Index k = 0; k < matrix.cols(); ++k) twin.push_back(double(matrix(r, k)));
  return twin;
}

TYPED_TEST(DenseProjectionTest, KeyAndValueProjectionsMatchTheReference) {
  std::vector<Shape> shapes{Shape{}, Shape{}.sized(1, 5, 1).with_heads(1, 4),
                            Shape{}.sized(2, 5, 13).widths(16, 9, 5).with_heads(3, 5, 7), Shape{}};
  shapes[3].use_bias = false;
  std::uint64_t seed = 500;
  for (const auto& shape : shapes) {
    const auto c = make_case<TypeParam>(shape, seed++);
    const auto& p = c.problem;
    SCOPED_TRACE(::testing::Message() << "seed " << seed - 1);
    const sdmha::TensorRef3<TypeParam> key(c.key), value(c.value);
    const sdmha::Vector<TypeParam> no_bias;
    const auto keys =
        project<Projection<TypeParam>>(key.as_matrix(), c.weights.key_kernel, c.weights.key_bias);
    EXPECT_TRUE(all_near(keys.data(),
                         sdmha_reference::project(p.key, p.batch * p.key_steps, p.key_in_dim,
                                                  p.key_kernel, p.key_bias, p.heads * p.key_dim),
                         relative_tolerance<TypeParam>()));
    const auto values = project<Projection<TypeParam>>(value.as_matrix(), c.weights.value_kernel,
                                                       c.weights.value_bias);
    EXPECT_TRUE(
        all_near(values.data(),
                 sdmha_reference::project(p.value, p.batch * p.key_steps, p.value_in_dim,
                                          p.value_kernel, p.value_bias, p.heads * p.value_dim),
                 relative_tolerance<TypeParam>()));
    const auto unbiased =
        project<Projection<TypeParam>>(value.as_matrix(), c.weights.value_kernel, no_bias);
    EXPECT_TRUE(all_near(unbiased.data(),
                         sdmha_reference::project(p.value, p.batch * p.key_steps, p.value_in_dim,
                                                  p.value_kernel, {}, p.heads * p.value_dim),
                         relative_tolerance<TypeParam>()));
  }
}

TYPED_TEST(DenseProjectionTest, DenseQueryProjectionMatchesTheReference) {
  Shape s = query_shape(2, 9, 21, 0.4);
  s.heads = 3;
  s.key_dim = 5;
  s.empty_rows = true;
  const auto c = make_case<TypeParam>(s, 510);
  const auto dense_query = c.dense_query();
  const auto output =
      project<Projection<TypeParam>>(sdmha::TensorRef3<TypeParam>(dense_query).as_matrix(),
                                     c.weights.query_kernel, c.weights.query_bias);
  EXPECT_TRUE(all_near(output.data(), sdmha_reference::forward(c.problem).query,
                       relative_tolerance<TypeParam>()));
}

TYPED_TEST(DenseProjectionTest, WorksOnBlocksOfLargerMatrices) {
  std::mt19937_64 generator(520);
  const Index rows = 11, in = 7, out = 6;
  const auto big_input = random_matrix<TypeParam>(rows + 4, in + 3, generator);
  const auto big_kernel = random_matrix<TypeParam>(in, out + 9, generator);
  const sdmha::Vector<TypeParam> big_bias = random_matrix<TypeParam>(out + 4, 1, generator);
  const auto input = big_input.block(2, 1, rows, in);
  const auto kernel = big_kernel.middleCols(5, out);
  const auto bias = big_bias.segment(3, out);
  const auto expected =
      sdmha_reference::project(twin_of(input), rows, in, twin_of(kernel), twin_of(bias), out);
  constexpr TypeParam sentinel = TypeParam(-555);
  sdmha::RowMatrix<TypeParam> big_output =
      sdmha::RowMatrix<TypeParam>::Constant(rows + 2, out + 4, sentinel);
  typename Projection<TypeParam>::Arguments args{input, kernel, bias,
                                                 big_output.block(1, 3, rows, out)};
  ASSERT_EQ(args.input.outerStride(), in + 3);
  ASSERT_EQ(args.kernel.outerStride(), out + 9);
  ASSERT_EQ(args.output.outerStride(), out + 4);
  run_stage<Projection<TypeParam>>(args);
  const sdmha::RowMatrix<TypeParam> block = big_output.block(1, 3, rows, out);
  EXPECT_TRUE(all_near(block.data(), expected, relative_tolerance<TypeParam>()));
  ASSERT_TRUE(only_block_written(big_output, 1, 3, rows, out, sentinel));
}

// Whether two blocks hold the same bits, entry by entry (−0 and +0 differ).
template <typename Block>
bool same_bits(const Block& a, const Block& b) {
  for (Index r = 0; r < a.rows(); ++r)
    if (std::memcmp(&a(r, 0), &b(r, 0), sizeof(a(r, 0)) * std::size_t(a.cols())) != 0) return false;
  return true;
}

// detail::RowProjection (the pipeline's K, V and output projections in fixed items): any range of
// its items, run at once, gives each entry the bits that running the items one by one gives, on
// rows that are not a multiple of the row block and with 1, 2 or 4 column panels; and where the
// stage says blocks can be fused (float32 with the AVX-512 engine), it fuses them.
TYPED_TEST(DenseProjectionTest, RowProjectionRangesGiveTheBitsOfSingleItems) {
  using Scalar = TypeParam;
  std::mt19937_64 generator(17);
  const Index rows = 3 * sdmha::detail::kProjectionRowBlock + 5, depth = 96, columns = 512;
  const auto input = random_matrix<Scalar>(rows, depth, generator);
  const auto kernel = random_matrix<Scalar>(depth, columns, generator);
  const auto bias_matrix = random_matrix<Scalar>(1, columns, generator);
  const sdmha::Vector<Scalar> bias = bias_matrix.row(0).transpose();
  const Projection<Scalar> stage;
  sdmha::TileSizes sizes;
  sizes.rows = rows;
  sizes.input_width = depth;
  sizes.output_width = columns;
  sdmha::detail::ScratchBuffer scratch;
  scratch.reserve(sdmha::detail::stage_workspace_size<Projection<Scalar>>(sizes));
  for (Index panels : {1, 2, 4}) {
    sdmha::RowMatrix<Scalar> by_item(rows, columns), by_range(rows, columns);
    auto projection_into = [&](sdmha::RowMatrix<Scalar>& output) {
      sdmha::detail::RowProjection<Scalar, Projection<Scalar>> projection{
          stage, input, kernel, bias, sdmha::MatrixRef<Scalar>(output)};
      projection.column_panels = panels;
      return projection;
    };
    const auto single = projection_into(by_item);
    for (Index item = 0; item < single.items(); ++item) single.run_item(item, scratch.view());
    const auto ranged = projection_into(by_range);
    EXPECT_EQ(ranged.fuses(scratch.view()),
              sdmha::detail::same_bits_in_any_block<Projection<Scalar>>(false));
    for (Index first = 0; first < ranged.items(); ++first)
      for (Index last = first + 1; last <= ranged.items(); ++last) {
        by_range.setConstant(Scalar(7));
        ranged.run_items(first, last, scratch.view());
        for (Index item = first; item < last; ++item) {
          const Index block = item / panels, panel = item % panels;
          const Index width = ranged.panel_width(), row = block * ranged.block_rows;
          const Index height = std::min(ranged.block_rows, rows - row);
          const Index column = panel * width, span = std::min(width, columns - column);
          ASSERT_TRUE(same_bits(by_range.block(row, column, height, span),
                                by_item.block(row, column, height, span)))
              << "items [" << first << ", " << last << "), item " << item << ", " << panels
              << " panels";
        }
      }
  }
}

TYPED_TEST(DenseProjectionTest, ZeroRowsGiveZeroRows) {
  std::mt19937_64 generator(530);
  const auto kernel = random_matrix<TypeParam>(4, 3, generator);
  const sdmha::RowMatrix<TypeParam> input(0, 4);
  const sdmha::Vector<TypeParam> bias = sdmha::Vector<TypeParam>::Ones(3);
  EXPECT_EQ(project<Projection<TypeParam>>(input, kernel, bias).rows(), 0);
}

static_assert(
    !std::is_same<sdmha::ContextProjection<float>, sdmha::DenseProjection<float>>::value &&
        !std::is_same<sdmha::ContextProjection<float>, sdmha::OutputProjection<float>>::value,
    "the context projection is a type of its own, so that a layer can swap it alone");
static_assert(std::is_same<sdmha::SparseDenseMHA<float>::ContextProjection,
                           sdmha::ContextProjection<float>>::value,
              "the layer's default key and value stage is ContextProjection");
static_assert(std::is_same<sdmha::ContextProjection<double>::ScalarType, double>::value,
              "ContextProjection exports its ScalarType");

// ContextProjection computes what DenseProjection does, bit for bit, and names itself in its
// refusals.
TYPED_TEST(DenseProjectionTest, ContextProjectionIsDenseProjectionUnderItsOwnName) {
  using Scalar = TypeParam;
  using Context = sdmha::ContextProjection<Scalar>;
  std::mt19937_64 generator(77);
  const auto input = random_matrix<Scalar>(9, 5, generator);
  const auto kernel = random_matrix<Scalar>(5, 7, generator);
  const sdmha::Vector<Scalar> bias = random_matrix<Scalar>(7, 1, generator);
  sdmha::RowMatrix<Scalar> dense(9, 7), context(9, 7);
  const typename Projection<Scalar>::Arguments dense_args{input, kernel, bias, dense};
  const typename Context::Arguments context_args{input, kernel, bias, context};
  Context::can_implement(context_args);
  Projection<Scalar>()(dense_args);
  Context()(context_args);
  EXPECT_EQ(0,
            std::memcmp(dense.data(), context.data(), sizeof(Scalar) * std::size_t(dense.size())));
  const sdmha::RowMatrix<Scalar> tall_kernel = sdmha::RowMatrix<Scalar>::Zero(6, 7);
  expect_refused<Context>({input, tall_kernel, bias, context},
                          "ContextProjection: kernel has 6 rows; expected the input width 5");
}

TYPED_TEST(DenseProjectionTest, CanImplementRejectsEachMismatch) {
  using Scalar = TypeParam;
  const sdmha::RowMatrix<Scalar> input = sdmha::RowMatrix<Scalar>::Zero(5, 4);
  const sdmha::RowMatrix<Scalar> kernel = sdmha::RowMatrix<Scalar>::Zero(4, 6);
  const sdmha::RowMatrix<Scalar> tall_kernel = sdmha::RowMatrix<Scalar>::Zero(5, 6);
  const sdmha::Vector<Scalar> bias = sdmha::Vector<Scalar>::Zero(6),
                              short_bias = sdmha::Vector<Scalar>::Zero(5), no_bias;
  sdmha::RowMatrix<Scalar> output(5, 6), short_output(4, 6), wide_output(5, 7);
  expect_accepted<Projection<Scalar>>({input, kernel, bias, output});
  expect_accepted<Projection<Scalar>>({input, kernel, no_bias, output});
  expect_refused<Projection<Scalar>>(
      {input, tall_kernel, bias, output},
      "DenseProjection: kernel has 5 rows; expected the input width 4");
  expect_refused<Projection<Scalar>>({input, kernel, short_bias, output},
                                     "bias has 5 entries; expected 0 or 6");
  expect_refused<Projection<Scalar>>({input, kernel, bias, short_output},
                                     "output is 4 x 6; expected 5 x 6");
  expect_refused<Projection<Scalar>>({input, kernel, bias, wide_output},
                                     "output is 5 x 7; expected 5 x 6");
}

}  // namespace
}  // namespace sdmha_test
