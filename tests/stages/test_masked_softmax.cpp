// Tests of sdmha/stages/masked_softmax.hpp: MaskedSoftmax against a naive float64 softmax, with
// blocked (−∞) entries giving exactly 0, rows blocked everywhere giving all zeros, and huge
// logits staying finite; rows sum to 1.
#include "test_support.hpp"

#include "stage_test.hpp"

namespace sdmha_test {
namespace {

SDMHA_SCALAR_TYPED_TEST_SUITE(MaskedSoftmaxTest);

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
  run_stage<Softmax<Scalar>>({{}, scores});
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
  ASSERT_TRUE(only_block_written(big, 1, 3, 5, 6, sentinel));
}

TYPED_TEST(MaskedSoftmaxTest, EmptyScoresAreAccepted) {
  for (auto dims : std::vector<std::array<Index, 2>>{{0, 5}, {4, 0}, {0, 0}}) {
    sdmha::RowMatrix<TypeParam> scores(dims[0], dims[1]);
    EXPECT_NO_THROW(run_softmax<TypeParam>(scores));
  }
}

// detail::exponentiate_shifted, the exponentials every softmax row goes through (the AVX-512
// pass for float where compiled, Eigen's exp otherwise), and its portable form: each result
// within a relative ulps·ε of exp in float64 of the same float difference, results below the
// smallest normal exactly 0, the returned sum that of the results; every length, so the vector
// loop's tails are covered.
template <typename Scalar, typename Exponentiate>
void expect_shifted_exponentials(Exponentiate exponentiate, double ulps) {
  const double smallest_normal = double(std::numeric_limits<Scalar>::min());
  const double tolerance = ulps * double(std::numeric_limits<Scalar>::epsilon());
  std::mt19937 generator(11);
  std::uniform_real_distribution<double> spread(-110.0, 0.0);
  for (Index n : {0, 1, 7, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 1000}) {
    const Scalar shift = Scalar(3.25);
    std::vector<Scalar> x(std::size_t(n), Scalar(0));
    for (auto& value : x) value = shift + Scalar(spread(generator));
    std::vector<double> expected(x.size());
    for (std::size_t s = 0; s < x.size(); ++s) expected[s] = std::exp(double(Scalar(x[s] - shift)));
    const Scalar sum = exponentiate(x.data(), n, shift);
    double total = 0.0;
    for (std::size_t s = 0; s < x.size(); ++s) {
      total += double(x[s]);
      if (expected[s] < smallest_normal * (1 - 1e-4)) {
        EXPECT_EQ(x[s], Scalar(0)) << "n " << n << ", entry " << s << ": exp " << expected[s];
      } else if (expected[s] > smallest_normal * (1 + 1e-4)) {
        EXPECT_NEAR(double(x[s]) / expected[s], 1.0, tolerance) << "n " << n << ", entry " << s;
      }
    }
    EXPECT_NEAR(double(sum), total, 4 * tolerance * std::max(total, 1.0)) << "n " << n;
  }
}

// −∞ gives exactly 0, the maximum itself exactly 1, NaN stays NaN in its entry and the sum, and
// arguments far below the float range give 0 (not a denormal).
template <typename Scalar, typename Exponentiate>
void expect_special_exponentials(Exponentiate exponentiate) {
  constexpr bool is_float = std::is_same<Scalar, float>::value;
  const Scalar inf = std::numeric_limits<Scalar>::infinity();
  const Scalar nan = std::numeric_limits<Scalar>::quiet_NaN();
  std::vector<Scalar> x(40, Scalar(2));
  x[0] = -inf;
  x[1] = Scalar(-1e30);
  x[2] = Scalar(-104);
  x[3] = Scalar(2) - Scalar(88);
  x[39] = -inf;
  const Scalar sum = exponentiate(x.data(), Index(x.size()), Scalar(2));
  EXPECT_EQ(x[0], Scalar(0));
  EXPECT_EQ(x[1], Scalar(0));
  if (is_float) {  // e⁻¹⁰⁶ and e⁻⁸⁸ are below FLT_MIN (not below DBL_MIN)
    EXPECT_EQ(x[2], Scalar(0));
    EXPECT_EQ(x[3], Scalar(0));
  }
  EXPECT_EQ(x[39], Scalar(0));
  for (std::size_t s = 4; s < 39; ++s) EXPECT_EQ(x[s], Scalar(1)) << "entry " << s;
  EXPECT_NEAR(double(sum), is_float ? 35.0 : 35.0 + std::exp(-106.0) + std::exp(-88.0), 1e-5);
  std::vector<Scalar> with_nan(20, Scalar(0));
  with_nan[17] = nan;
  EXPECT_TRUE(std::isnan(exponentiate(with_nan.data(), Index(with_nan.size()), Scalar(0))));
  EXPECT_TRUE(std::isnan(with_nan[17]));
  EXPECT_EQ(with_nan[16], Scalar(1));
}

// Relative to exp, our AVX-512 exp errs by less than 1·ε; Eigen 3.4's float exp by up to 3ε (and
// upwards on average), its double exp by less than 1·ε.
TYPED_TEST(MaskedSoftmaxTest, ShiftedExponentialsWithinTheirUlpsOfFloat64) {
  using Scalar = TypeParam;
  constexpr bool is_float = std::is_same<Scalar, float>::value;
  expect_shifted_exponentials<Scalar>(sdmha::detail::exponentiate_shifted_portable<Scalar>,
                                      is_float ? 3.0 : 1.0);
#if defined(__AVX512F__)
  expect_shifted_exponentials<Scalar>(sdmha::detail::exponentiate_shifted<Scalar>, 1.0);
#else
  expect_shifted_exponentials<Scalar>(sdmha::detail::exponentiate_shifted<Scalar>,
                                      is_float ? 3.0 : 1.0);
#endif
}

TYPED_TEST(MaskedSoftmaxTest, ShiftedExponentialsOfInfinityNaNAndTinyArguments) {
  using Scalar = TypeParam;
  expect_special_exponentials<Scalar>(sdmha::detail::exponentiate_shifted<Scalar>);
  expect_special_exponentials<Scalar>(sdmha::detail::exponentiate_shifted_portable<Scalar>);
}

// The flush's edge in float: the float just above ln FLT_MIN gives a normal number on both paths,
// the float below it exactly 0 (its exp is below FLT_MIN).
TEST(ShiftedExponentials, FloatFlushEdgeIsTheSmallestNormal) {
  const float edge = -87.3365402f, below = std::nextafter(edge, -100.0f);
  for (auto exponentiate : {sdmha::detail::exponentiate_shifted<float>,
                            sdmha::detail::exponentiate_shifted_portable<float>}) {
    std::vector<float> x = {edge, below, edge + 1.0f, below};
    exponentiate(x.data(), Index(x.size()), 0.0f);
    EXPECT_GE(x[0], std::numeric_limits<float>::min());
    EXPECT_NEAR(double(x[0]) / std::exp(double(edge)), 1.0, 1e-6);
    EXPECT_EQ(x[1], 0.0f);
    EXPECT_NEAR(double(x[2]) / std::exp(double(edge + 1.0f)), 1.0, 1e-6);
    EXPECT_EQ(x[3], 0.0f);
  }
}

// detail::row_maximum, what every softmax row is shifted by: the largest entry for every length
// (so the vector loop's four chains and its masked tail are all covered), wherever it sits, −∞
// for an empty or fully blocked row, and NaN entries skipped (−∞ if every entry is NaN).
TYPED_TEST(MaskedSoftmaxTest, RowMaximumOfEveryLengthAndPlace) {
  using Scalar = TypeParam;
  std::mt19937 generator(23);
  std::uniform_real_distribution<double> spread(-50.0, 50.0);
  EXPECT_EQ(sdmha::detail::row_maximum<Scalar>(nullptr, 0), kMinusInfinity<Scalar>);
  for (Index n = 1; n <= 200; ++n) {
    std::vector<Scalar> x(static_cast<std::size_t>(n));
    for (auto& value : x) value = Scalar(spread(generator));
    for (Index place : {Index(0), n / 2, n - 1}) {
      std::vector<Scalar> row = x;
      row[std::size_t(place)] = Scalar(1000);
      EXPECT_EQ(sdmha::detail::row_maximum(row.data(), n), Scalar(1000))
          << "n " << n << ", place " << place;
    }
    EXPECT_EQ(sdmha::detail::row_maximum(x.data(), n), *std::max_element(x.begin(), x.end()))
        << "n " << n;
    std::vector<Scalar> blocked(static_cast<std::size_t>(n), kMinusInfinity<Scalar>);
    EXPECT_EQ(sdmha::detail::row_maximum(blocked.data(), n), kMinusInfinity<Scalar>) << "n " << n;
    std::vector<Scalar> with_nan = x;  // NaN in every 5th entry from the third
    for (Index s = n / 3; s < n; s += 5)
      with_nan[std::size_t(s)] = std::numeric_limits<Scalar>::quiet_NaN();
    Scalar largest = kMinusInfinity<Scalar>;
    for (const Scalar value : with_nan)
      if (!std::isnan(value)) largest = std::max(largest, value);
    EXPECT_EQ(sdmha::detail::row_maximum(with_nan.data(), n), largest) << "n " << n;
    std::vector<Scalar> all_nan(static_cast<std::size_t>(n),
                                std::numeric_limits<Scalar>::quiet_NaN());
    EXPECT_EQ(sdmha::detail::row_maximum(all_nan.data(), n), kMinusInfinity<Scalar>) << "n " << n;
  }
}

// A NaN or +∞ score makes its row NaN wherever it is: a NaN among finite scores, among blocked
// keys only (where the row's maximum is −∞ and the row would otherwise be zeros or uniform) and
// before blocked keys; +∞ alone and +∞ with a NaN; under both policies, for lengths within one
// vector, across the four max chains and with a tail.
TYPED_TEST(MaskedSoftmaxTest, ANaNOrPlusInfinityScoreMakesItsRowNaN) {
  using Scalar = TypeParam;
  constexpr Scalar nan = std::numeric_limits<Scalar>::quiet_NaN();
  constexpr Scalar infinity = std::numeric_limits<Scalar>::infinity();
  constexpr Index poisoned_rows = 5;
  for (const auto policy : {sdmha::FullyMaskedRows::zeros, sdmha::FullyMaskedRows::uniform})
    for (Index cols : {1, 3, 17, 70, 130}) {
      sdmha::RowMatrix<Scalar> scores =
          sdmha::RowMatrix<Scalar>::Constant(poisoned_rows + 1, cols, Scalar(0.5));
      scores(0, cols - 1) = nan;
      scores.row(1).setConstant(kMinusInfinity<Scalar>);
      scores(1, cols / 2) = nan;
      scores.row(2).tail(cols - cols / 2).setConstant(kMinusInfinity<Scalar>);
      scores(2, cols / 2) = nan;
      scores(3, cols / 2) = infinity;
      scores(4, 0) = infinity;
      scores(4, cols - 1) = nan;
      typename Softmax<Scalar>::Arguments args{{}, scores};
      args.fully_masked_rows = policy;
      run_stage<Softmax<Scalar>>(args);
      for (Index t = 0; t < poisoned_rows; ++t)
        for (Index s = 0; s < cols; ++s)
          EXPECT_TRUE(std::isnan(scores(t, s))) << "cols " << cols << ", t " << t << ", s " << s;
      for (Index s = 0; s < cols; ++s)
        EXPECT_EQ(scores(poisoned_rows, s), Scalar(1) / Scalar(cols)) << "cols " << cols;
    }
}

}  // namespace
}  // namespace sdmha_test
