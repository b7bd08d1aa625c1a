// Tests of sdmha/stages/attend_values.hpp: AttendValues (P·V_h into head h's columns) against a
// naive loop, the reference's heads, non-finite value rows that only zero probabilities reach,
// and its can_implement checks; with bfloat16_operands, the products of the rounded operands.
#include "test_support.hpp"

#include "stage_test.hpp"

#include <cstring>

namespace sdmha_test {
namespace {

SDMHA_SCALAR_TYPED_TEST_SUITE(AttendValuesTest);

template <typename Scalar>
using Attend = sdmha::AttendValues<Scalar>;

// Σ_s P[t, s]·V[s, d] in float64, over the nonzero probabilities only (a zero weight means the
// key is not attended, whatever its value row holds).
template <typename Scalar>
std::vector<double> naive_attend(const sdmha::RowMatrix<Scalar>& probabilities,
                                 const sdmha::RowMatrix<Scalar>& value) {
  std::vector<double> result(static_cast<std::size_t>(probabilities.rows() * value.cols()), 0.0);
  for (Index t = 0; t < probabilities.rows(); ++t)
    for (Index d = 0; d < value.cols(); ++d) {
      double sum = 0.0;
      for (Index s = 0; s < probabilities.cols(); ++s)
        if (probabilities(t, s) != Scalar(0))
          sum += double(probabilities(t, s)) * double(value(s, d));
      result[t * value.cols() + d] = sum;
    }
  return result;
}

// Random rows that sum to 1, ~30% of entries exactly 0, and row `zero_row` (if any) all 0.
template <typename Scalar>
sdmha::RowMatrix<Scalar> random_probabilities(Index rows, Index cols, std::uint64_t seed,
                                              Index zero_row = -1) {
  std::mt19937_64 generator(seed);
  std::uniform_real_distribution<double> weight(0.1, 1.0);
  std::bernoulli_distribution blocked(0.3);
  sdmha::RowMatrix<Scalar> probabilities = sdmha::RowMatrix<Scalar>::Zero(rows, cols);
  for (Index t = 0; t < rows; ++t) {
    if (t == zero_row || cols == 0) continue;
    for (Index s = 0; s < cols; ++s)
      probabilities(t, s) = blocked(generator) ? Scalar(0) : Scalar(weight(generator));
    if (probabilities.row(t).sum() == Scalar(0)) probabilities(t, 0) = Scalar(1);
    probabilities.row(t) /= probabilities.row(t).sum();
  }
  return probabilities;
}

template <typename Scalar>
sdmha::RowMatrix<Scalar> attend(const sdmha::RowMatrix<Scalar>& probabilities,
                                const sdmha::RowMatrix<Scalar>& value,
                                bool bfloat16_operands = false) {
  sdmha::RowMatrix<Scalar> output =
      sdmha::RowMatrix<Scalar>::Constant(probabilities.rows(), value.cols(), Scalar(-1));
  typename Attend<Scalar>::Arguments args{{}, probabilities, value, output};
  args.bfloat16_operands = bfloat16_operands;
  run_stage<Attend<Scalar>>(args);
  return output;
}

TYPED_TEST(AttendValuesTest, MatchesANaiveLoop) {
  std::uint64_t seed = 900;
  for (auto dims : std::vector<std::array<Index, 3>>{
           {1, 1, 1}, {5, 7, 4}, {9, 3, 11}, {6, 40, 8}, {3, 0, 5}, {0, 4, 3}}) {
    SCOPED_TRACE(::testing::Message()
                 << "T " << dims[0] << ", S " << dims[1] << ", Dv " << dims[2]);
    const auto probabilities = random_probabilities<TypeParam>(dims[0], dims[1], seed++, 1);
    const auto value = uniform_matrix<TypeParam>(dims[1], dims[2], 2.0, seed++);
    const auto output = attend(probabilities, value);
    EXPECT_TRUE(all_near(output.data(), naive_attend(probabilities, value),
                         relative_tolerance<TypeParam>()));
    for (Index d = 0; dims[0] > 1 && d < dims[2]; ++d)
      EXPECT_EQ(output(1, d), TypeParam(0)) << "all-zero row " << d;
  }
}

TYPED_TEST(AttendValuesTest, MatchesTheReferenceHeads) {
  Shape s = Shape{}.sized(2, 6, 9).with_heads(3, 4, 5);
  s.random_mask = true;
  s.fully_blocked_rows = true;
  const auto c = make_case<TypeParam>(s, 910);
  const auto& p = c.problem;
  const auto r = sdmha_reference::forward(p);
  const Index T = p.steps, S = p.key_steps, H = p.heads, Dv = p.value_dim;
  const auto values = to_matrix<TypeParam>(r.value.data(), p.batch * S, H * Dv);
  sdmha::RowMatrix<TypeParam> heads(p.batch * T, H * Dv);
  for (Index b = 0; b < p.batch; ++b)
    for (Index h = 0; h < H; ++h) {
      const auto probabilities =
          to_matrix<TypeParam>(r.probabilities.data() + (b * H + h) * T * S, T, S);
      typename Attend<TypeParam>::Arguments args{sdmha::TilePosition{b, h, 0, 0}, probabilities,
                                                 values.block(b * S, h * Dv, S, Dv),
                                                 heads.block(b * T, h * Dv, T, Dv)};
      run_stage<Attend<TypeParam>>(args);
    }
  EXPECT_TRUE(all_near(heads.data(), r.heads, relative_tolerance<TypeParam>()));
}

TYPED_TEST(AttendValuesTest, NonFiniteValueRowsWithZeroProbabilityDoNotReachTheOutput) {
  constexpr TypeParam nan = std::numeric_limits<TypeParam>::quiet_NaN();
  constexpr TypeParam infinity = std::numeric_limits<TypeParam>::infinity();
  const Index T = 6, S = 8, Dv = 5;
  auto probabilities = random_probabilities<TypeParam>(T, S, 920, 4);
  auto value = uniform_matrix<TypeParam>(S, Dv, 2.0, 921);
  // Key step 2 is blocked for every query, key step 5 for every query but query 0 (its weight
  // moves to key step 3); query 0 attends key steps 5 and 6 only, query 4 nothing.
  for (Index t = 0; t < T; ++t)
    for (const Index s : {Index(2), Index(5)}) {
      probabilities(t, 3) += probabilities(t, s);
      probabilities(t, s) = TypeParam(0);
    }
  probabilities.row(0).setZero();
  probabilities(0, 5) = TypeParam(0.5);
  probabilities(0, 6) = TypeParam(0.5);
  value.row(2) << nan, infinity, -infinity, nan, TypeParam(1);
  value.row(5) << TypeParam(1), nan, TypeParam(2), infinity, TypeParam(3);
  const auto output = attend(probabilities, value);
  const auto expected = naive_attend(probabilities, value);
  for (Index t = 0; t < T; ++t)
    for (Index d = 0; d < Dv; ++d) {
      const double want = expected[t * Dv + d];
      if (std::isfinite(want)) {
        EXPECT_NEAR(double(output(t, d)), want,
                    relative_tolerance<TypeParam>() * (1.0 + std::abs(want)))
            << t << ", " << d;
      } else {
        // Only query 0 attends key step 5: a non-finite value it does attend stays visible.
        EXPECT_EQ(t, 0) << d;
        EXPECT_FALSE(std::isfinite(output(t, d))) << t << ", " << d;
      }
    }
  for (Index t = 1; t < T; ++t) EXPECT_TRUE(output.row(t).allFinite()) << "row " << t;
}

// With bfloat16_operands, A = bf16(P)·bf16(V): within float32's summation error of the float64
// sum of the rounded operands' products, onto C when multiply() accumulates; non-finite value
// rows, and finite ones that round to ±∞, take the float path that skips zero probabilities
// (the same bits as without the flag);
// a double stage refuses the flag.
TEST(AttendValuesBFloat16, OutputIsTheRoundedOperandsProducts) {
  std::uint64_t seed = 950;
  auto rounded = [](float x) { return double(float(Eigen::bfloat16(x))); };
  for (auto dims : std::vector<std::array<Index, 3>>{
           {1, 1, 1}, {5, 7, 4}, {9, 3, 11}, {6, 40, 8}, {30, 65, 33}, {3, 0, 5}, {0, 4, 3}}) {
    SCOPED_TRACE(::testing::Message()
                 << "T " << dims[0] << ", S " << dims[1] << ", Dv " << dims[2]);
    const auto probabilities = random_probabilities<float>(dims[0], dims[1], seed++, 1);
    const auto value = uniform_matrix<float>(dims[1], dims[2], 2.0, seed++);
    const auto start = uniform_matrix<float>(dims[0], dims[2], 2.0, seed++);
    const auto output = attend(probabilities, value, true);
    sdmha::RowMatrix<float> accumulated = start;
    typename Attend<float>::Arguments args{{}, probabilities, value, accumulated};
    args.bfloat16_operands = true;
    Attend<float>::multiply(args, true);
    for (Index t = 0; t < dims[0]; ++t)
      for (Index d = 0; d < dims[2]; ++d) {
        double sum = 0.0, magnitude = 0.0;
        for (Index s = 0; s < dims[1]; ++s) {
          const double term = rounded(probabilities(t, s)) * rounded(value(s, d));
          sum += term;
          magnitude += std::abs(term);
        }
        const double bound = (dims[1] + 1) * 0x1p-24 * magnitude;
        EXPECT_LE(std::abs(double(output(t, d)) - sum), bound) << t << ", " << d;
        EXPECT_LE(std::abs(double(accumulated(t, d)) - (double(start(t, d)) + sum)),
                  bound + (dims[1] + 1) * 0x1p-24 * std::abs(double(start(t, d))))
            << t << ", " << d;
      }
  }
  auto probabilities = random_probabilities<float>(4, 6, 960);
  auto value = uniform_matrix<float>(6, 3, 2.0, 961);
  probabilities.col(2).setZero();
  value.row(2).setConstant(std::numeric_limits<float>::quiet_NaN());
  const auto skipped = attend(probabilities, value, true);
  EXPECT_TRUE(skipped.allFinite());
  EXPECT_EQ(std::memcmp(skipped.data(), attend(probabilities, value).data(),
                        sizeof(float) * std::size_t(skipped.size())),
            0);
  // A finite value that rounds to ±∞ in bfloat16 (here 3.4e38 > 0x1.FEp127) behind a zero
  // probability: the stage takes the product that skips it, as for a non-finite one.
  // (Without the flag V is finite, so the float32 GEMM serves: the skipping product is asked
  // for explicitly, value_is_finite = false.)
  value.row(2).setConstant(3.4e38f);
  const auto beyond = attend(probabilities, value, true);
  EXPECT_TRUE(beyond.allFinite());
  sdmha::RowMatrix<float> skipping(probabilities.rows(), value.cols());
  typename Attend<float>::Arguments skip_args{{}, probabilities, value, skipping, false};
  Attend<float>{}(skip_args);
  EXPECT_EQ(std::memcmp(beyond.data(), skipping.data(), sizeof(float) * std::size_t(beyond.size())),
            0);
  const auto p64 = random_probabilities<double>(2, 3, 962);
  const auto v64 = uniform_matrix<double>(3, 2, 2.0, 963);
  SDMHA_EXPECT_THROW_WITH(attend(p64, v64, true), sdmha::ConfigError,
                          "bfloat16_operands is set for a double stage");
}

TYPED_TEST(AttendValuesTest, WritesOnlyItsHeadsColumnsOfALargerMatrix) {
  const Index T = 4, S = 6, Dv = 3;
  const auto probabilities = random_probabilities<TypeParam>(T, S, 930);
  for (const bool finite : {true, false}) {
    SCOPED_TRACE(finite ? "finite values" : "a non-finite value row");
    auto value = uniform_matrix<TypeParam>(S, Dv, 2.0, 931);
    if (!finite) {
      value.row(1).setConstant(std::numeric_limits<TypeParam>::quiet_NaN());
    }
    auto weights = probabilities;
    if (!finite) weights.col(1).setZero();  // rows no longer sum to 1; the product does not care
    constexpr TypeParam sentinel = TypeParam(-7);
    sdmha::RowMatrix<TypeParam> heads = sdmha::RowMatrix<TypeParam>::Constant(T, 4 * Dv, sentinel);
    typename Attend<TypeParam>::Arguments args{{}, weights, value, heads.middleCols(2 * Dv, Dv)};
    ASSERT_EQ(args.output.outerStride(), 4 * Dv);
    run_stage<Attend<TypeParam>>(args);
    const sdmha::RowMatrix<TypeParam> block = heads.middleCols(2 * Dv, Dv);
    EXPECT_TRUE(
        all_near(block.data(), naive_attend(weights, value), relative_tolerance<TypeParam>()));
    ASSERT_TRUE(only_block_written(heads, 0, 2 * Dv, T, Dv, sentinel));
  }
}

TYPED_TEST(AttendValuesTest, CanImplementRejectsEachMismatch) {
  using Scalar = TypeParam;
  const sdmha::RowMatrix<Scalar> probabilities = sdmha::RowMatrix<Scalar>::Zero(5, 7);
  const sdmha::RowMatrix<Scalar> value = sdmha::RowMatrix<Scalar>::Zero(7, 3);
  const sdmha::RowMatrix<Scalar> short_value = sdmha::RowMatrix<Scalar>::Zero(6, 3);
  sdmha::RowMatrix<Scalar> output(5, 3), tall_output(6, 3), wide_output(5, 4);
  expect_accepted<Attend<Scalar>>({{}, probabilities, value, output});
  expect_refused<Attend<Scalar>>({{}, probabilities, short_value, output},
                                 "AttendValues: value has 6 rows; expected 7 (one per key step)");
  expect_refused<Attend<Scalar>>({{}, probabilities, value, tall_output},
                                 "output is 6 x 3; expected 5 x 3");
  expect_refused<Attend<Scalar>>({{}, probabilities, value, wide_output},
                                 "output is 5 x 4; expected 5 x 3");
}

}  // namespace
}  // namespace sdmha_test
