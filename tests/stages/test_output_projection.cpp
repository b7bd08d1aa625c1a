// Tests of sdmha/stages/output_projection.hpp: OutputProjection, the concatenated heads through
// the output kernel, against the reference's heads → output, with and without bias, on blocks
// of larger matrices, and its can_implement checks.
#include "test_support.hpp"

#include "stage_test.hpp"

namespace sdmha_test {
namespace {

SDMHA_SCALAR_TYPED_TEST_SUITE(OutputProjectionTest);

template <typename Scalar>
using Projection = sdmha::OutputProjection<Scalar>;

static_assert(!std::is_same<sdmha::OutputProjection<float>, sdmha::DenseProjection<float>>::value,
              "the output projection is a type of its own, so that a layer can swap it alone");
static_assert(std::is_same<sdmha::OutputProjection<double>::ScalarType, double>::value,
              "OutputProjection exports its ScalarType");

TYPED_TEST(OutputProjectionTest, HeadsToOutputMatchesTheReference) {
  std::vector<Shape> shapes{Shape{}, Shape{}.sized(1, 5, 7).with_heads(1, 4),
                            Shape{}.sized(2, 7, 7).with_heads(3, 5, 6, 9), Shape{}};
  shapes[3].use_bias = false;
  shapes[3].output_dim = 3;
  std::uint64_t seed = 600;
  const sdmha::Vector<TypeParam> no_bias;
  for (const auto& shape : shapes) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    const auto c = make_case<TypeParam>(shape, seed++);
    const auto& p = c.problem;
    const auto r = sdmha_reference::forward(p);
    const Index rows = p.batch * p.steps, width = p.heads * p.value_dim;
    // The reference's heads, rounded to Scalar: the input of the stage.
    const auto heads = to_matrix<TypeParam>(r.heads.data(), rows, width);
    const auto output =
        project<Projection<TypeParam>>(heads, c.weights.output_kernel, c.weights.output_bias);
    EXPECT_TRUE(all_near(output.data(), r.output, relative_tolerance<TypeParam>()));
    const auto unbiased = project<Projection<TypeParam>>(heads, c.weights.output_kernel, no_bias);
    EXPECT_TRUE(
        all_near(unbiased.data(),
                 sdmha_reference::project(r.heads, rows, width, p.output_kernel, {}, p.output_dim),
                 relative_tolerance<TypeParam>()));
  }
}

TYPED_TEST(OutputProjectionTest, WorksOnBlocksOfLargerMatrices) {
  Shape s = Shape{}.with_heads(3, 4, 5, 7);
  s.steps = 6;
  const auto c = make_case<TypeParam>(s, 610);
  const auto& p = c.problem;
  const auto r = sdmha_reference::forward(p);
  const Index rows = p.batch * p.steps, width = p.heads * p.value_dim, out = p.output_dim;
  // The heads sit in a wider matrix, the output goes into a block of another.
  sdmha::RowMatrix<TypeParam> wide_heads =
      sdmha::RowMatrix<TypeParam>::Constant(rows + 1, width + 4, TypeParam(9));
  wide_heads.block(1, 2, rows, width) = to_matrix<TypeParam>(r.heads.data(), rows, width);
  constexpr TypeParam sentinel = TypeParam(-555);
  sdmha::RowMatrix<TypeParam> big_output =
      sdmha::RowMatrix<TypeParam>::Constant(rows + 3, out + 2, sentinel);
  typename Projection<TypeParam>::Arguments args{wide_heads.block(1, 2, rows, width),
                                                 c.weights.output_kernel, c.weights.output_bias,
                                                 big_output.block(2, 1, rows, out)};
  ASSERT_EQ(args.input.outerStride(), width + 4);
  ASSERT_EQ(args.output.outerStride(), out + 2);
  run_stage<Projection<TypeParam>>(args);
  const sdmha::RowMatrix<TypeParam> block = big_output.block(2, 1, rows, out);
  EXPECT_TRUE(all_near(block.data(), r.output, relative_tolerance<TypeParam>()));
  ASSERT_TRUE(only_block_written(big_output, 2, 1, rows, out, sentinel));
}

TYPED_TEST(OutputProjectionTest, CanImplementRejectsEachMismatch) {
  using Scalar = TypeParam;
  // rows = 3, H·Dv = 8, O = 5.
  const sdmha::RowMatrix<Scalar> heads = sdmha::RowMatrix<Scalar>::Zero(3, 8);
  const sdmha::RowMatrix<Scalar> kernel = sdmha::RowMatrix<Scalar>::Zero(8, 5);
  const sdmha::RowMatrix<Scalar> short_kernel = sdmha::RowMatrix<Scalar>::Zero(7, 5);
  const sdmha::Vector<Scalar> bias = sdmha::Vector<Scalar>::Zero(5),
                              long_bias = sdmha::Vector<Scalar>::Zero(8);
  sdmha::RowMatrix<Scalar> output(3, 5), tall_output(4, 5), narrow_output(3, 4);
  expect_accepted<Projection<Scalar>>({heads, kernel, bias, output});
  expect_refused<Projection<Scalar>>({heads, short_kernel, bias, output},
                                     "kernel has 7 rows; expected the input width 8");
  expect_refused<Projection<Scalar>>({heads, kernel, long_bias, output},
                                     "bias has 8 entries; expected 0 or 5");
  expect_refused<Projection<Scalar>>({heads, kernel, bias, tall_output},
                                     "output is 4 x 5; expected 3 x 5");
  expect_refused<Projection<Scalar>>({heads, kernel, bias, narrow_output},
                                     "output is 3 x 4; expected 3 x 5");
}

}  // namespace
}  // namespace sdmha_test
