// Tests of sdmha/stages/masked_softmax.hpp: MaskedSoftmax against a naive float64 softmax, with
// blocked (−∞) entries giving exactly 0, rows blocked everywhere giving all zeros, and huge
// logits staying finite; rows sum to 1.
#include "test_support.hpp"

namespace sdmha_test {
namespace {

template <typename Scalar>
class MaskedSoftmaxTest : public ::testing::Test {};
TYPED_TEST_SUITE(MaskedSoftmaxTest, ScalarTypes, );

template <typename Scalar>
using Softmax = sdmha::MaskedSoftmax<Scalar>;

template <typename Scalar>
constexpr Scalar kMinusInfinity = -std::numeric_limits<Scalar>::infinity();

// Softmax of each row in float64; −∞ entries get 0, a row of −∞ only gets all zeros.
template <typename Scalar>
std::vector<double> naive_softmax(const sdmha::RowMatrix<Scalar>& scores) {
  const double minus_infinity = -std::numeric_limits<double>::infinity();
  std::vector<double> result(static_cast<std::size_t>(scores.size()), 0.0);
  for (Index t = 0; t < scores.rows(); ++t) {
    double row_max = minus_infinity;
    for (Index s = 0; s < scores.cols(); ++s) row_max = std::max(row_max, double(scores(t, s)));
    if (row_max == minus_infinity) continue;
    double total = 0.0;
    for (Index s = 0; s < scores.cols(); ++s) {
      const double x = double(scores(t, s));
      const double e = x == minus_infinity ? 0.0 : std::exp(x - row_max);
      result[t * scores.cols() + s] = e;
      total += e;
    }
    for (Index s = 0; s < scores.cols(); ++s) result[t * scores.cols() + s] /= total;
  }
  return result;
}

template <typename Scalar>
void run_softmax(sdmha::MatrixRef<Scalar> scores) {
  typename Softmax<Scalar>::Arguments args{{}, scores};
  Softmax<Scalar>::can_implement(args);
  Softmax<Scalar>{}(args);
}

// Random logits in [-spread, spread], ~30% blocked, and some rows blocked everywhere.
template <typename Scalar>
sdmha::RowMatrix<Scalar> random_scores(Index rows, Index cols, double spread, std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::uniform_real_distribution<double> logit(-spread, spread);
  std::bernoulli_distribution blocked(0.3), whole_row(0.15);
  sdmha::RowMatrix<Scalar> scores(rows, cols);
  for (Index t = 0; t < rows; ++t) {
    const bool row_blocked = whole_row(generator);
    for (Index s = 0; s < cols; ++s)
      scores(t, s) =
          row_blocked || blocked(generator) ? kMinusInfinity<Scalar> : Scalar(logit(generator));
  }
  return scores;
}

// Every row sums to 1, or is exactly 0 everywhere when every entry was −∞; blocked entries are
// exactly 0 (not a denormal); everything is finite.
template <typename Scalar>
void expect_probabilities(const sdmha::RowMatrix<Scalar>& input,
                          const sdmha::RowMatrix<Scalar>& output) {
  for (Index t = 0; t < input.rows(); ++t) {
    bool any_allowed = false;
    double total = 0.0;
    for (Index s = 0; s < input.cols(); ++s) {
      ASSERT_TRUE(std::isfinite(output(t, s))) << t << ", " << s;
      ASSERT_GE(output(t, s), Scalar(0)) << t << ", " << s;
      if (input(t, s) == kMinusInfinity<Scalar>)
        ASSERT_EQ(output(t, s), Scalar(0)) << t << ", " << s << " is blocked";
      else
        any_allowed = true;
      total += double(output(t, s));
    }
    if (any_allowed)
      EXPECT_NEAR(total, 1.0, relative_tolerance<Scalar>()) << "row " << t;
    else
      EXPECT_EQ(total, 0.0) << "row " << t;
  }
}

TYPED_TEST(MaskedSoftmaxTest, MatchesANaiveSoftmax) {
  std::uint64_t seed = 800;
  for (auto dims :
       std::vector<std::array<Index, 2>>{{1, 1}, {3, 1}, {5, 7}, {8, 16}, {9, 37}, {4, 130}}) {
    SCOPED_TRACE(::testing::Message() << dims[0] << " x " << dims[1]);
    const auto input = random_scores<TypeParam>(dims[0], dims[1], 6.0, seed++);
    sdmha::RowMatrix<TypeParam> scores = input;
    run_softmax<TypeParam>(scores);
    EXPECT_TRUE(all_near(scores.data(), naive_softmax(input), relative_tolerance<TypeParam>()));
    expect_probabilities(input, scores);
  }
}

TYPED_TEST(MaskedSoftmaxTest, RowsBlockedEverywhereGiveZeros) {
  sdmha::RowMatrix<TypeParam> scores =
      sdmha::RowMatrix<TypeParam>::Constant(3, 9, kMinusInfinity<TypeParam>);
  scores(1, 4) = TypeParam(2);
  run_softmax<TypeParam>(scores);
  for (Index s = 0; s < 9; ++s) {
    EXPECT_EQ(scores(0, s), TypeParam(0)) << s;
    EXPECT_EQ(scores(1, s), TypeParam(s == 4 ? 1 : 0)) << s;
    EXPECT_EQ(scores(2, s), TypeParam(0)) << s;
  }
}

TYPED_TEST(MaskedSoftmaxTest, BlockedEntriesAreExactlyZeroNextToHugeLogits) {
  // A long row (vectorised body and tail) with few allowed entries, far from the blocked ones.
  sdmha::RowMatrix<TypeParam> scores =
      sdmha::RowMatrix<TypeParam>::Constant(2, 37, kMinusInfinity<TypeParam>);
  scores(0, 3) = TypeParam(1e4);
  scores(0, 20) = TypeParam(1e4);
  scores(0, 36) = TypeParam(-1e4);
  scores(1, 0) = TypeParam(-1e4);
  scores(1, 35) = TypeParam(-1e4 + 1);
  const sdmha::RowMatrix<TypeParam> input = scores;
  run_softmax<TypeParam>(scores);
  EXPECT_TRUE(all_near(scores.data(), naive_softmax(input), relative_tolerance<TypeParam>()));
  expect_probabilities(input, scores);
  EXPECT_EQ(scores(0, 3), TypeParam(0.5));
  EXPECT_EQ(scores(0, 20), TypeParam(0.5));
}

TYPED_TEST(MaskedSoftmaxTest, HugeLogitsStayFinite) {
  std::vector<double> magnitudes{1e4, 1e30};
  if (std::is_same<TypeParam, double>::value) magnitudes.push_back(1e300);
  std::uint64_t seed = 810;
  for (const double magnitude : magnitudes) {
    SCOPED_TRACE(::testing::Message() << "logits up to " << magnitude);
    auto input = random_scores<TypeParam>(6, 19, magnitude, seed++);
    input(0, 0) = TypeParam(magnitude);
    input(0, 1) = TypeParam(-magnitude);
    input(1, 2) = TypeParam(-magnitude);
    input(1, 3) = TypeParam(-magnitude);
    sdmha::RowMatrix<TypeParam> scores = input;
    run_softmax<TypeParam>(scores);
    EXPECT_TRUE(all_near(scores.data(), naive_softmax(input), relative_tolerance<TypeParam>()));
    expect_probabilities(input, scores);
  }
}

TYPED_TEST(MaskedSoftmaxTest, WorksInPlaceOnABlockOfALargerMatrix) {
  const auto input = random_scores<TypeParam>(5, 6, 4.0, 820);
  constexpr TypeParam sentinel = TypeParam(-9);
  sdmha::RowMatrix<TypeParam> big = sdmha::RowMatrix<TypeParam>::Constant(7, 10, sentinel);
  big.block(1, 3, 5, 6) = input;
  run_softmax<TypeParam>(big.block(1, 3, 5, 6));
  const sdmha::RowMatrix<TypeParam> block = big.block(1, 3, 5, 6);
  EXPECT_TRUE(all_near(block.data(), naive_softmax(input), relative_tolerance<TypeParam>()));
  for (Index r = 0; r < big.rows(); ++r)
    for (Index k = 0; k < big.cols(); ++k)
      if (r < 1 || r > 5 || k < 3) {
        ASSERT_EQ(big(r, k), sentinel) << r << ", " << k;
      }
}

TYPED_TEST(MaskedSoftmaxTest, EmptyScoresAreAccepted) {
  for (auto dims : std::vector<std::array<Index, 2>>{{0, 5}, {4, 0}, {0, 0}}) {
    sdmha::RowMatrix<TypeParam> scores(dims[0], dims[1]);
    EXPECT_NO_THROW(run_softmax<TypeParam>(scores));
  }
}

}  // namespace
}  // namespace sdmha_test
