// Tests of sdmha/detail/backward_pass.hpp (SparseDenseMHA::backward) and of the backward of the
// sparse query projection (SparseQueryProjection's KernelGradientArguments and
// ValuesGradientArguments, in sdmha/stages/query_projection.hpp): gradients against central finite
// differences of the forward over random configurations, dropout, masks, non-finite blocked inputs,
// thread counts and bad input.
#include "test_support.hpp"

#include "gradient_check.hpp"

#include <cstdio>
#include <cstring>
#include <string>

#include <sdmha/sparse_dense_mha.hpp>

namespace sdmha_test {
namespace {

template <typename Scalar>
using Layer = sdmha::SparseDenseMHA<Scalar>;

using gradient_check::random_d_output;
using gradient_check::views;
using GradientCheckSummary = gradient_check::Summary;

template <typename Scalar>
sdmha::MhaGradients<Scalar> backward(const Case<Scalar>& c, const Tensor3<Scalar>& d_output,
                                     const sdmha::AttentionOptions<Scalar>& options) {
  const Layer<Scalar> layer(c.config, c.weights);
  return layer.backward(c.query(), {c.key, c.value}, d_output, options);
}

// ---- gradient check against central differences, in double ----

constexpr Index kMaxCheckedPerGradient = 1000;

// Checks every entry of every gradient (a random sample of `max_checked` for larger
// ones) against (L(θ + h) − L(θ − h)) / 2h (gradient_check.hpp).
void check_against_finite_differences(Case<double> c,
                                      const sdmha::AttentionOptions<double>& options,
                                      const std::string& label, std::uint64_t seed,
                                      GradientCheckSummary& summary,
                                      Index max_checked = kMaxCheckedPerGradient) {
  SCOPED_TRACE(label);
  summary += gradient_check::summarize<Layer<double>>(std::move(c), options, seed, max_checked);
}

TEST(BackwardGradientCheck, MatchesCentralDifferencesOnRandomConfigurations) {
  std::mt19937_64 generator(2024);
  auto pick = [&](long low, long high) {
    return std::uniform_int_distribution<long>(low, high)(generator);
  };
  GradientCheckSummary summary;
  constexpr int kConfigurations = 80;
  for (int round = 0; round < kConfigurations; ++round) {
    Shape s;  // one statement a draw: the order of the draws is fixed
    s.batch = pick(1, 3);
    s.steps = pick(1, 9);
    s.key_steps = pick(1, 9);
    s.query_dim = pick(1, 25);
    s.key_in_dim = pick(1, 9);
    s.value_in_dim = pick(1, 9);
    s.heads = pick(1, 3);
    s.key_dim = pick(1, 5);
    s.value_dim = round % 3 == 0 ? 0 : pick(1, 5);   // Dv ≠ Dk in most rounds
    s.output_dim = round % 4 == 0 ? 0 : pick(1, 6);  // O ≠ Eq in most rounds
    s.density = 0.25;
    s.random_mask = round % 2 == 0;
    s.causal = round % 3 == 1;
    s.key_mask = round % 5 == 2;
    s.empty_rows = round % 4 == 1;
    s.fully_blocked_rows = round % 6 == 3;
    s.duplicates = round % 3 == 2;
    s.use_bias = round % 7 != 5;
    // The last rounds: two query tiles (project-first) and two row blocks of the projections.
    // A causal mask keeps the forward's 64-row tiles; without one the backward takes as many rows
    // as fit 2^15 scores, so S = 600 is what splits 70 rows into two tiles there.
    const bool two_tiles = round >= kConfigurations - 2;
    if (two_tiles) {
      s.batch = 1;
      s.steps = 70;
      s.heads = 1;
      s.query_dim = 9;
      s.causal = round % 2 == 0;
      s.key_steps = s.causal ? 9 : 600;
      s.random_mask = true;
    }
    auto c = make_case<double>(s, 5000 + round);
    if (round % 8 == 6) c.weights.query_kernel *= 4.0;  // peaked attention
    auto options = c.options;
    options.num_threads = 1;
    const sdmha::ScoreStrategy strategies[] = {sdmha::ScoreStrategy::project_first,
                                               sdmha::ScoreStrategy::sparse_regrouped,
                                               sdmha::ScoreStrategy::automatic};
    options.score_strategy = two_tiles ? strategies[0] : strategies[round % 3 == 0 ? 2 : round % 2];
    if (round % 4 == 3) {  // dropout with a fixed seed: forward and backward see the same mask
      options.training = true;
      options.dropout_rate = 0.3;
      options.dropout_seed = 77 + round;
    }
    const std::string label =
        "round " + std::to_string(round) + ": B=" + std::to_string(s.batch) +
        " T=" + std::to_string(s.steps) + " S=" + std::to_string(s.key_steps) +
        " Eq=" + std::to_string(s.query_dim) + " H=" + std::to_string(s.heads) +
        " Dk=" + std::to_string(s.key_dim) + " Dv=" + std::to_string(s.value_dim) +
        " O=" + std::to_string(s.output_dim) + " " + sdmha::to_string(options.score_strategy) +
        (options.training ? " dropout" : "");
    check_against_finite_differences(c, options, label, 900 + round, summary);
  }
  EXPECT_EQ(summary.failed, 0) << "of " << summary.checked << " entries checked";
  EXPECT_GT(summary.checked, 25000);
  std::printf("%ld entries checked, worst error / tolerance %.3g\n", summary.checked,
              summary.worst);
}

TEST(BackwardGradientCheck, HighDropoutRateWithFixedSeed) {
  Shape s = Shape{}.sized(2, 6, 8).with_heads(2, 4, 3, 5);
  s.random_mask = true;
  auto c = make_case<double>(s, 31);
  GradientCheckSummary summary;
  for (auto strategy :
       {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
    auto options = c.options;
    options.score_strategy = strategy;
    options.training = true;
    options.dropout_rate = 0.6;
    options.dropout_seed = 123456789;
    options.num_threads = 1;
    check_against_finite_differences(c, options, sdmha::to_string(strategy), 32, summary);
  }
  EXPECT_EQ(summary.failed, 0) << "of " << summary.checked << " entries checked";
}

// ---- properties over float and double ----

SDMHA_SCALAR_TYPED_TEST_SUITE(BackwardTest);

template <typename Scalar>
::testing::AssertionResult same_bits(Case<Scalar>& c, const sdmha::MhaGradients<Scalar>& a,
                                     const sdmha::MhaGradients<Scalar>& b) {
  const auto left = views(c, a), right = views(c, b);
  for (std::size_t i = 0; i < left.size(); ++i) {
    if (left[i].gradient_size != right[i].gradient_size)
      return ::testing::AssertionFailure() << left[i].name << " sizes differ";
    if (std::memcmp(left[i].gradient, right[i].gradient,
                    sizeof(Scalar) * std::size_t(left[i].gradient_size)) != 0)
      return ::testing::AssertionFailure() << left[i].name << " differs";
  }
  return ::testing::AssertionSuccess();
}

// |a − b| ≤ tolerance · (1 + |b|) for every entry of every gradient.
template <typename Scalar, typename Other>
::testing::AssertionResult all_gradients_near(Case<Scalar>& c, const sdmha::MhaGradients<Scalar>& a,
                                              Case<Other>& c_other,
                                              const sdmha::MhaGradients<Other>& b,
                                              double tolerance) {
  const auto left = views(c, a);
  const auto right = views(c_other, b);
  for (std::size_t i = 0; i < left.size(); ++i) {
    if (left[i].gradient_size != right[i].gradient_size)
      return ::testing::AssertionFailure() << left[i].name << " sizes differ";
    for (Index k = 0; k < left[i].gradient_size; ++k) {
      const double got = double(left[i].gradient[k]), expected = double(right[i].gradient[k]);
      if (!(std::abs(got - expected) <= tolerance * (1.0 + std::abs(expected))))
        return ::testing::AssertionFailure()
               << left[i].name << "[" << k << "]: " << got << " vs " << expected;
    }
  }
  return ::testing::AssertionSuccess();
}

template <typename Scalar>
::testing::AssertionResult all_finite(Case<Scalar>& c, const sdmha::MhaGradients<Scalar>& g) {
  for (const auto& view : views(c, g))
    for (Index k = 0; k < view.gradient_size; ++k)
      if (!std::isfinite(double(view.gradient[k])))
        return ::testing::AssertionFailure() << view.name << "[" << k << "] = " << view.gradient[k];
  return ::testing::AssertionSuccess();
}

// A query kernel beyond L2 and larger than dQ (1024 × 272 doubles, 2.2 MB), each feature used
// about 3 times (16 rows, some empty, at density 0.25): dWq and dX go by feature over the
// query's CSC (detail::query_gradients_by_feature). Checked against central differences like
// the random configurations (150 entries of each larger gradient: every forward streams the
// kernel), and bitwise across thread counts on a wider kernel.
TEST(BackwardGradientCheck, WideQueryKernelTakesTheFeatureOrder) {
  Shape s = Shape{}.sized(2, 8, 6).widths(1024, 7, 5).with_heads(2, 136, 3, 4);
  s.density = 0.25;
  s.duplicates = true;
  s.random_mask = true;
  s.empty_rows = true;
  auto c = make_case<double>(s, 61);
  ASSERT_TRUE(sdmha::detail::query_gradients_by_feature(c.query().csr(), s.heads * s.key_dim));
  auto options = c.options;
  options.num_threads = 1;
  options.score_strategy =
      sdmha::ScoreStrategy::project_first;  // the query gradients are the point
  GradientCheckSummary summary;
  check_against_finite_differences(c, options, "wide query kernel", 62, summary, 150);
  EXPECT_EQ(summary.failed, 0) << "of " << summary.checked << " entries checked";
  EXPECT_GT(summary.checked, 800);

  // Bitwise across thread counts with several feature blocks (Eq = 3000: three of 1024), so that
  // the pool's workers take some of them.
  s.query_dim = 3000;
  auto wide = make_case<double>(s, 64);
  ASSERT_TRUE(sdmha::detail::query_gradients_by_feature(wide.query().csr(), s.heads * s.key_dim));
  const auto d_output = random_d_output(wide, 63);
  auto wide_options = wide.options;
  wide_options.num_threads = 1;
  const auto one = backward(wide, d_output, wide_options);
  wide_options.num_threads = 2;
  const auto two = backward(wide, d_output, wide_options);
  EXPECT_TRUE(same_bits(wide, one, two));
}

TYPED_TEST(BackwardTest, GradientsHaveTheWeightsShapesAndNoBiasWithoutBias) {
  for (bool use_bias : {true, false}) {
    Shape s = Shape{}.with_heads(2, 4, 3, 5);
    s.use_bias = use_bias;
    s.duplicates = true;
    s.density = 0.4;
    auto c = make_case<TypeParam>(s, 40);
    const auto g = backward(c, random_d_output(c, 41), c.options);
    for (const auto& view : views(c, g))
      EXPECT_EQ(view.gradient_size, view.parameter_size) << view.name;
    EXPECT_EQ(g.query_kernel.rows(), c.weights.query_kernel.rows());
    EXPECT_EQ(g.query_kernel.cols(), c.weights.query_kernel.cols());
    EXPECT_EQ(g.value_kernel.cols(), c.weights.value_kernel.cols());
    EXPECT_EQ(g.output_kernel.rows(), c.weights.output_kernel.rows());
    EXPECT_EQ(g.output_kernel.cols(), c.weights.output_kernel.cols());
    EXPECT_EQ(g.key.dimension(0), s.batch);
    EXPECT_EQ(g.key.dimension(1), s.key_steps);
    EXPECT_EQ(g.key.dimension(2), s.key_in_dim);
    EXPECT_EQ(g.output_bias.size(), use_bias ? 5 : 0);
    EXPECT_EQ(g.query_bias.size(), use_bias ? 8 : 0);
    // Duplicates each get their coordinate's gradient.
    const auto query = c.query();
    EXPECT_LT(query.nonzeros(), c.values.size());
    for (Index e = 0; e < c.values.size(); ++e)
      for (Index f = 0; f < e; ++f)
        if (c.indices.row(e) == c.indices.row(f)) {
          EXPECT_EQ(g.query_values[e], g.query_values[f]);
        }
  }
}

// Leaving input gradients out (AttentionOptions::input_gradients) empties them and changes no
// other bit, by rows and by feature (a Wq beyond the core's cache, a denser query).
TYPED_TEST(BackwardTest, InputGradientsLeftOutAreEmptyAndTheRestBitwiseUnchanged) {
  const Shape by_rows = Shape{}.sized(2, 7, 6);
  Shape by_feature = Shape{}.sized(4, 32, 9).widths(4096, 12, 10).with_heads(4, 64, 8, 16);
  by_feature.density = 0.2;
  for (const bool wide : {false, true}) {
    const Shape& s = wide ? by_feature : by_rows;
    auto c = make_case<TypeParam>(s, 44);
    const auto d_output = random_d_output(c, 45);
    const Layer<TypeParam> layer(c.config, c.weights);
    const auto query = c.query();
    ASSERT_EQ(sdmha::detail::query_gradients_by_feature(query.csr(), s.heads * s.key_dim), wide);
    const auto all = layer.backward(query, {c.key, c.value}, d_output, c.options);
    for (int mask = 0; mask < 8; ++mask) {
      auto options = c.options;
      options.input_gradients = {(mask & 1) != 0, (mask & 2) != 0, (mask & 4) != 0};
      auto g = layer.backward(query, {c.key, c.value}, d_output, options);
      EXPECT_EQ(g.query_values.size() == 0, (mask & 1) == 0) << mask;
      EXPECT_EQ(g.key.size() == 0, (mask & 2) == 0) << mask;
      EXPECT_EQ(g.value.size() == 0, (mask & 4) == 0) << mask;
      if ((mask & 1) == 0) g.query_values = all.query_values;
      if ((mask & 2) == 0) g.key = all.key;
      if ((mask & 4) == 0) g.value = all.value;
      EXPECT_TRUE(same_bits(c, all, g)) << mask;
    }
  }
}

TYPED_TEST(BackwardTest, FullyBlockedRowsPassExactlyZeroGradient) {
  Shape s = Shape{}.sized(3, 7, 7);
  s.fully_blocked_rows = true;
  s.random_mask = true;
  s.density = 0.3;
  auto c = make_case<TypeParam>(s, 42);
  // Batch entry 2 attends nothing at all.
  for (long t = 0; t < s.steps; ++t)
    for (long k = 0; k < s.key_steps; ++k) c.mutable_mask()(2, t, k) = false;
  const auto d_output = random_d_output(c, 43);
  for (auto strategy :
       {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
    auto options = c.options;
    options.score_strategy = strategy;
    const auto g = backward(c, d_output, options);
    ASSERT_TRUE(all_finite(c, g));
    long blocked_rows = 0;
    for (Index e = 0; e < c.values.size(); ++e) {
      const long b = long(c.indices(e, 0)), t = long(c.indices(e, 1));
      bool any_allowed = false;
      for (long k = 0; k < s.key_steps; ++k) any_allowed |= c.mask()(b, t, k);
      if (!any_allowed) {
        ++blocked_rows;
        EXPECT_EQ(g.query_values[e], TypeParam(0)) << "entry " << e;
      }
    }
    EXPECT_GT(blocked_rows, 0);
    for (long k = 0; k < s.key_steps; ++k) {
      for (long e = 0; e < s.key_in_dim; ++e) EXPECT_EQ(g.key(2, k, e), TypeParam(0));
      for (long e = 0; e < s.value_in_dim; ++e) EXPECT_EQ(g.value(2, k, e), TypeParam(0));
    }
  }
}

TYPED_TEST(BackwardTest, NonFiniteKeyAndValueInBlockedRowsNeverReachAGradient) {
  Shape s;
  s.random_mask = true;
  s.key_mask = true;
  auto clean = make_case<TypeParam>(s, 44);
  // Key step 3 of batch 0 blocked for every query; key step 5 of batch 1 padded.
  for (long t = 0; t < s.steps; ++t) clean.mutable_mask()(0, t, 3) = false;
  clean.mutable_key_mask()(1, 5) = false;
  auto poisoned = clean;
  constexpr TypeParam nan = std::numeric_limits<TypeParam>::quiet_NaN();
  constexpr TypeParam inf = std::numeric_limits<TypeParam>::infinity();
  for (long e = 0; e < s.key_in_dim; ++e) {
    poisoned.key(0, 3, e) = nan;
    poisoned.key(1, 5, e) = e % 2 ? inf : -inf;
  }
  for (long e = 0; e < s.value_in_dim; ++e) {
    poisoned.value(0, 3, e) = e % 2 ? inf : nan;
    poisoned.value(1, 5, e) = nan;
  }
  const auto d_output = random_d_output(clean, 45);
  for (auto strategy :
       {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
    for (double rate : {0.0, 0.4}) {
      SCOPED_TRACE(std::string(sdmha::to_string(strategy)) + " dropout " + std::to_string(rate));
      auto options = clean.options;
      options.score_strategy = strategy;
      options.training = rate > 0;
      options.dropout_rate = rate;
      options.dropout_seed = 9;
      const auto expected = backward(clean, d_output, options);
      const auto got = backward(poisoned, d_output, options);
      ASSERT_TRUE(all_finite(poisoned, got));
      EXPECT_TRUE(
          all_gradients_near(poisoned, got, clean, expected, relative_tolerance<TypeParam>()));
      for (long e = 0; e < s.key_in_dim; ++e) {
        EXPECT_EQ(got.key(0, 3, e), TypeParam(0));
        EXPECT_EQ(got.key(1, 5, e), TypeParam(0));
      }
    }
  }
}

// Every key step padded, a NaN in a key and a value row, widths above one weight-gradient tile
// (256): the kernel gradients take their gathering path and find no row with a gradient. The
// gathered matrices are then empty, and no tile may be taken of them (UBSan: offsets on null
// data). Nothing is attended, so every gradient but dbo is exactly 0.
TYPED_TEST(BackwardTest, NonFiniteContextWithEveryKeyPaddedAndWideKernelsGivesZeroGradients) {
  Shape s = Shape{}.widths(20, 270, 300).with_heads(2, 150, 140);
  s.key_mask = true;
  auto c = make_case<TypeParam>(s, 46);
  c.mutable_key_mask().setConstant(false);
  c.key(0, 1, 3) = std::numeric_limits<TypeParam>::quiet_NaN();
  c.value(1, 2, 280) = std::numeric_limits<TypeParam>::infinity();
  const auto d_output = random_d_output(c, 47);
  for (auto strategy :
       {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
    SCOPED_TRACE(sdmha::to_string(strategy));
    auto options = c.options;
    options.score_strategy = strategy;
    const auto g = backward(c, d_output, options);
    for (const auto& view : views(c, g)) {
      ASSERT_EQ(view.gradient_size, view.parameter_size) << view.name;
      if (view.name == "output_bias") continue;
      for (Index k = 0; k < view.gradient_size; ++k)
        ASSERT_EQ(view.gradient[k], TypeParam(0)) << view.name << "[" << k << "]";
    }
  }
}

TYPED_TEST(BackwardTest, ThreadCountDoesNotChangeGradientsBitwise) {
  Shape s = Shape{}.sized(2, 70, 20).widths(70, 66, 12).with_heads(3, 23);
  s.random_mask = true;
  s.empty_rows = true;
  for (bool causal : {true, false}) {
    for (auto strategy :
         {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
      SCOPED_TRACE(std::string(sdmha::to_string(strategy)) + (causal ? " causal" : ""));
      s.causal = causal;
      auto c = make_case<TypeParam>(s, 46);
      const auto d_output = random_d_output(c, 47);
      const Layer<TypeParam> layer(c.config, c.weights);
      const auto query = c.query();
      auto options = c.options;
      options.score_strategy = strategy;
      options.training = true;
      options.dropout_rate = 0.2;
      options.num_threads = 1;
      const auto single = layer.backward(query, {c.key, c.value}, d_output, options);
      for (int threads : {2, 3, 8}) {
        options.num_threads = threads;
        const auto multi = layer.backward(query, {c.key, c.value}, d_output, options);
        EXPECT_TRUE(same_bits(c, single, multi)) << threads << " threads";
      }
    }
  }
}

// Four 64-row query tiles per (b, h) (T = 200; S = 600 keeps the backward's tiles at 64 rows)
// and B·H = 2·heads: the backward's items are (b, h, query tile), one tile per group (too few
// (b, h) for 64 items alone), each group's terms of dK and dV added in group order.
Shape many_tiles_shape(long heads) {
  Shape s = Shape{}.sized(2, 200, 600).with_heads(heads, 8);
  return s;
}

// Whichever worker runs a group, the same bits on 1 to 64 threads (more threads than cores).
TEST(BackwardTiles, EveryThreadCountGivesTheSameBits) {
  Shape s = many_tiles_shape(3);
  s.random_mask = true;
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    s.causal = causal;
    auto c = make_case<float>(s, 72);
    const auto d_output = random_d_output(c, 73);
    const Layer<float> layer(c.config, c.weights);
    const auto query = c.query();
    auto options = c.options;
    options.num_threads = 1;
    const auto single = layer.backward(query, {c.key, c.value}, d_output, options);
    for (int threads : {2, 3, 16, 64}) {
      options.num_threads = threads;
      EXPECT_TRUE(same_bits(c, single, layer.backward(query, {c.key, c.value}, d_output, options)))
          << threads << " threads";
    }
  }
}

// The default score kernel, whose backward throws on one tile: the tile of rows 64… of head 1.
template <typename Scalar>
struct ThrowingScoreBackward : sdmha::ScoreKernel<Scalar> {
  using differentiates = ThrowingScoreBackward;
  void backward(const typename sdmha::ScoreKernel<Scalar>::BackwardArguments& args) const {
    if (args.head == 1 && args.query_begin == 64) throw std::runtime_error("tile (h 1, t 64)");
    sdmha::ScoreKernel<Scalar>::backward(args);
  }
};

// A tile that throws ends the call with its exception, on one thread and on several (the items
// that wait for its turn to add to dK and dV give up rather than wait forever), and the same
// workspace then serves a call that succeeds, with the same bits as a fresh one.
TEST(BackwardTiles, AFailingTileEndsTheCallWithItsException) {
  auto c = make_case<float>(many_tiles_shape(2), 74);
  const auto d_output = random_d_output(c, 75);
  const sdmha::SparseDenseMHA<float, sdmha::SparseQueryProjection<float>,
                              ThrowingScoreBackward<float>>
      failing(c.config, c.weights);
  const Layer<float> layer(c.config, c.weights);
  const auto query = c.query();
  for (int threads : {1, 4, 16}) {
    auto options = c.options;
    options.num_threads = threads;
    sdmha::Workspace<float> workspace;
    sdmha::MhaGradients<float> gradients;
    SDMHA_EXPECT_THROW_WITH(
        failing.backward(query, {c.key, c.value}, d_output, options, workspace, gradients),
        std::runtime_error, "tile (h 1, t 64)");
    layer.backward(query, {c.key, c.value}, d_output, options, workspace, gradients);
    EXPECT_TRUE(same_bits(c, gradients, layer.backward(query, {c.key, c.value}, d_output, options)))
        << threads << " threads";
  }
}

TYPED_TEST(BackwardTest, ReusingTheProjectedContextGivesTheSameGradients) {
  Shape s;
  s.steps = 9;
  s.random_mask = true;
  s.value_dim = 3;
  auto c = make_case<TypeParam>(s, 58);
  const auto d_output = random_d_output(c, 59);
  const Layer<TypeParam> layer(c.config, c.weights);
  const auto query = c.query();
  const auto context = layer.project_context(c.key, c.value);
  for (auto strategy : {sdmha::ScoreStrategy::automatic, sdmha::ScoreStrategy::project_first,
                        sdmha::ScoreStrategy::sparse_regrouped}) {
    auto options = c.options;
    options.score_strategy = strategy;
    EXPECT_TRUE(same_bits(c, layer.backward(query, {c.key, c.value}, d_output, options),
                          layer.backward(query, {c.key, c.value, context}, d_output, options)))
        << sdmha::to_string(strategy);
  }
  Tensor3<TypeParam> other_key(2, 6, s.key_in_dim), other_value(2, 6, s.value_in_dim);
  other_key.setZero();
  other_value.setZero();
  const auto short_context = layer.project_context(other_key, other_value);
  SDMHA_EXPECT_THROW_WITH(
      layer.backward(query, {c.key, c.value, short_context}, d_output, c.options),
      sdmha::ShapeError, "context's projected keys and values have 6 key steps but value has");
}

// One Workspace and one MhaGradients kept across calls of different shapes (growing, then
// shrinking), both forms, masks and dropout: every call gives the bits of a fresh backward.
TYPED_TEST(BackwardTest, AKeptWorkspaceAndGradientsGiveTheBitsOfAFreshCall) {
  Shape small = Shape{}.sized(2, 7, 5);
  small.random_mask = true;
  Shape large = Shape{}.sized(3, 80, 70).with_heads(3, 9, 5).with_masks();
  large.random_mask = false;
  large.query_dim = 40;
  large.duplicates = true;
  sdmha::Workspace<TypeParam> workspace;
  sdmha::MhaGradients<TypeParam> kept;
  int call = 0;
  for (const Shape& shape : {small, large, small, large}) {
    auto c = make_case<TypeParam>(shape, 70 + call);
    const auto d_output = random_d_output(c, 80 + call);
    const Layer<TypeParam> layer(c.config, c.weights);
    const auto query = c.query();
    const auto context = layer.project_context(c.key, c.value);
    auto options = c.options;
    options.num_threads = 2;
    options.training = call % 2 == 1;
    options.dropout_rate = 0.25;
    options.dropout_seed = 5;
    SCOPED_TRACE("call " + std::to_string(call));
    layer.backward(query, {c.key, c.value}, d_output, options, workspace, kept);
    EXPECT_TRUE(same_bits(c, layer.backward(query, {c.key, c.value}, d_output, options), kept));
    layer.backward(query, {c.key, c.value, context}, d_output, options, workspace, kept);
    EXPECT_TRUE(
        same_bits(c, layer.backward(query, {c.key, c.value, context}, d_output, options), kept));
    ++call;
  }
  EXPECT_GT(workspace.bytes(), 0u);
  EXPECT_EQ(workspace.threads(), 1);
}

TYPED_TEST(BackwardTest, AWorkspaceInUseOrBadInputLeavesTheGradientsUntouched) {
  Shape s;
  auto c = make_case<TypeParam>(s, 90);
  const auto d_output = random_d_output(c, 91);
  const Layer<TypeParam> layer(c.config, c.weights);
  const auto query = c.query();
  sdmha::Workspace<TypeParam> workspace;
  sdmha::MhaGradients<TypeParam> gradients;
  {
    const typename sdmha::Workspace<TypeParam>::Lease held(workspace, "another call");
    SDMHA_EXPECT_THROW_WITH(
        layer.backward(query, {c.key, c.value}, d_output, c.options, workspace, gradients),
        sdmha::ConfigError, "SparseDenseMHA::backward: workspace is in use by another call");
  }
  Tensor3<TypeParam> short_d_output(c.problem.batch, c.problem.steps, 1);
  short_d_output.setZero();
  SDMHA_EXPECT_THROW_WITH(
      layer.backward(query, {c.key, c.value}, short_d_output, c.options, workspace, gradients),
      sdmha::ShapeError, "d_output is (");
  EXPECT_EQ(gradients.query_kernel.size(), 0);
  EXPECT_EQ(gradients.key.size(), 0);
  EXPECT_EQ(workspace.bytes(), 0u);
  layer.backward(query, {c.key, c.value}, d_output, c.options, workspace, gradients);  // free again
  EXPECT_TRUE(
      same_bits(c, layer.backward(query, {c.key, c.value}, d_output, c.options), gradients));
}

TYPED_TEST(BackwardTest, DropoutRateZeroEqualsNoDropout) {
  Shape s;
  s.random_mask = true;
  s.causal = true;
  auto c = make_case<TypeParam>(s, 48);
  const auto d_output = random_d_output(c, 49);
  const auto plain = backward(c, d_output, c.options);
  auto options = c.options;
  options.training = true;
  options.dropout_rate = 0.0;
  options.dropout_seed = 1234;
  EXPECT_TRUE(same_bits(c, plain, backward(c, d_output, options)));
  // Dropout off outside training, whatever the rate.
  options.training = false;
  options.dropout_rate = 0.5;
  EXPECT_TRUE(same_bits(c, plain, backward(c, d_output, options)));
  // And on in training: the gradients change, and change with the seed.
  options.training = true;
  const auto seeded = backward(c, d_output, options);
  EXPECT_FALSE(same_bits(c, plain, seeded));
  options.dropout_seed = 1235;
  EXPECT_FALSE(same_bits(c, seeded, backward(c, d_output, options)));
}

TYPED_TEST(BackwardTest, ScoreStrategiesGiveTheSameGradients) {
  for (int round = 0; round < 4; ++round) {
    Shape s = Shape{}.sized(2, 9, 6).with_heads(2, 4, 3, 4);
    s.query_dim = 30;
    s.random_mask = round % 2 == 0;
    s.causal = round >= 2;
    s.empty_rows = true;
    s.duplicates = true;
    auto c = make_case<TypeParam>(s, 50 + round);
    const auto d_output = random_d_output(c, 60 + round);
    auto options = c.options;
    options.training = round == 3;
    options.dropout_rate = 0.25;
    const auto first = backward(c, d_output, options);
    options.score_strategy = sdmha::ScoreStrategy::sparse_regrouped;
    const auto regrouped = backward(c, d_output, options);
    EXPECT_TRUE(all_gradients_near(c, regrouped, c, first, relative_tolerance<TypeParam>()))
        << "round " << round;
  }
}

// Also with a query kernel beyond L2 (3000 × 272), where dX goes by feature and is written through
// each entry's CSR position: the slack between the rows must not shift them.
TYPED_TEST(BackwardTest, QueryFromAnUncompressedEigenMatrixGetsOneGradientPerStoredValue) {
  for (bool wide : {false, true}) {
    SCOPED_TRACE(wide ? "wide kernel, by feature" : "by rows");
    Shape s;
    s.empty_rows = true;
    s.density = 0.3;
    s.shuffle = false;
    if (wide) {
      s.steps = 8;
      s.query_dim = 3000;
      s.key_dim = 136;
      s.density = 0.25;
    }
    auto c = make_case<TypeParam>(s, 52);
    const auto d_output = random_d_output(c, 53);
    const auto from_coo = backward(c, d_output, c.options);  // COO entries are in CSR order here
    using Sparse = typename sdmha::SparseQuery<TypeParam>::SparseMatrixType;
    Sparse matrix(s.batch * s.steps, s.query_dim);
    // Slack between rows: room for more entries than any row holds.
    matrix.reserve(Eigen::VectorXi::Constant(s.batch * s.steps, int(s.query_dim * s.density) + 6));
    for (Index e = 0; e < c.values.size(); ++e)
      matrix.insert(c.indices(e, 0) * s.steps + c.indices(e, 1), c.indices(e, 2)) = c.values[e];
    ASSERT_FALSE(matrix.isCompressed());
    const auto query =
        sdmha::SparseQuery<TypeParam>::from_eigen(s.batch, s.steps, std::move(matrix));
    EXPECT_EQ(sdmha::detail::query_gradients_by_feature(query.csr(), s.heads * s.key_dim), wide);
    const Layer<TypeParam> layer(c.config, c.weights);
    const auto g = layer.backward(query, {c.key, c.value}, d_output, c.options);
    ASSERT_EQ(g.query_values.size(), c.values.size());
    // from_coo's gradients are in COO order; the Eigen query's in CSR order.
    const auto coo_query = c.query();
    const auto& coo_to_stored = coo_query.coo_to_stored();
    std::vector<double> expected(coo_to_stored.size());
    for (std::size_t e = 0; e < coo_to_stored.size(); ++e)
      expected[std::size_t(coo_to_stored[e])] = double(from_coo.query_values[Index(e)]);
    EXPECT_TRUE(all_near(g.query_values.data(), expected, relative_tolerance<TypeParam>()));
    const std::vector<double> expected_kernel(
        from_coo.query_kernel.data(), from_coo.query_kernel.data() + from_coo.query_kernel.size());
    EXPECT_TRUE(all_near(g.query_kernel.data(), expected_kernel, relative_tolerance<TypeParam>()));
  }
}

TYPED_TEST(BackwardTest, ZeroSizedBatchStepsAndKeys) {
  for (auto dims : std::vector<std::array<long, 3>>{{0, 5, 7}, {2, 0, 7}, {2, 5, 0}}) {
    Shape s = Shape{}.sized(dims[0], dims[1], dims[2]);
    auto c = make_case<TypeParam>(s, 54);
    const auto g = backward(c, random_d_output(c, 55), c.options);
    EXPECT_TRUE(all_finite(c, g));
    EXPECT_EQ(g.key.dimension(1), dims[2]);
    for (Index i = 0; i < g.query_values.size(); ++i) EXPECT_EQ(g.query_values[i], TypeParam(0));
  }
}

// The same with every width above one weight-gradient tile (256): with B·T = 0 or S = 0 the
// column panels of dWq, the tiles of dWo, dWk and dWv and the bias sums used to be taken from
// matrices without rows, whose data is null (UBSan: "applying non-zero offset to null pointer").
// Nothing is attended, so every gradient is exactly 0 but dbo, which is 1ᵀ·dY.
TYPED_TEST(BackwardTest, ZeroSizedDimensionsWithGradientsWiderThanATile) {
  for (auto dims : std::vector<std::array<long, 3>>{{0, 3, 2}, {2, 0, 2}, {2, 3, 0}}) {
    Shape s =
        Shape{}.sized(dims[0], dims[1], dims[2]).widths(300, 270, 260).with_heads(2, 150, 140);
    auto c = make_case<TypeParam>(s, 58);
    const auto d_output = random_d_output(c, 59);
    const auto g = backward(c, d_output, c.options);
    for (const auto& view : views(c, g)) {
      ASSERT_EQ(view.gradient_size, view.parameter_size) << view.name;
      if (view.name == "output_bias") continue;
      for (Index k = 0; k < view.gradient_size; ++k)
        ASSERT_EQ(view.gradient[k], TypeParam(0))
            << view.name << "[" << k << "], dims " << dims[0] << ", " << dims[1] << ", " << dims[2];
    }
    ASSERT_EQ(g.output_bias.size(), 300);
    for (Index o = 0; o < 300; ++o) {
      double sum = 0.0;
      for (Index b = 0; b < s.batch; ++b)
        for (Index t = 0; t < s.steps; ++t) sum += double(d_output(b, t, o));
      EXPECT_NEAR(double(g.output_bias[o]), sum, 1e-5) << "output_bias[" << o << "]";
    }
  }
}

TYPED_TEST(BackwardTest, RejectsBadInput) {
  auto c = make_case<TypeParam>(Shape{}, 56);
  const Layer<TypeParam> layer(c.config, c.weights);
  const auto query = c.query();
  const auto d_output = random_d_output(c, 57);
  Tensor3<TypeParam> wrong(2, 5, 15), short_steps(2, 4, 16), other_batch(3, 5, 16);
  wrong.setZero();
  short_steps.setZero();
  other_batch.setZero();
  SDMHA_EXPECT_THROW_WITH(layer.backward(query, {c.key, c.value}, wrong, c.options),
                          sdmha::ShapeError,
                          "d_output is (2, 5, 15); expected (B, T, O) = (2, 5, 16)");
  SDMHA_EXPECT_THROW_WITH(layer.backward(query, {c.key, c.value}, short_steps, c.options),
                          sdmha::ShapeError, "d_output is (2, 4, 16)");
  SDMHA_EXPECT_THROW_WITH(layer.backward(query, {c.key, c.value}, other_batch, c.options),
                          sdmha::ShapeError, "d_output is (3, 5, 16)");
  Tensor3<TypeParam> narrow_key(2, 7, 11);
  narrow_key.setZero();
  SDMHA_EXPECT_THROW_WITH(layer.backward(query, {narrow_key, c.value}, d_output, c.options),
                          sdmha::ShapeError,
                          "key has width 11; expected the kernel's input width 12");
  const auto wide_query = sdmha::SparseQuery<TypeParam>::from_coo(2, 5, 17, c.indices, c.values);
  SDMHA_EXPECT_THROW_WITH(layer.backward(wide_query, {c.key, c.value}, d_output, c.options),
                          sdmha::ShapeError,
                          "query has 17 features; expected the query kernel's input width 16");
  auto options = c.options;
  Tensor3<bool> short_mask(2, 5, 6);
  short_mask.setConstant(true);
  options.attention_mask = short_mask;
  SDMHA_EXPECT_THROW_WITH(
      layer.backward(query, {c.key, c.value}, d_output, options), sdmha::ShapeError,
      "attention_mask is (2, 5, 6); expected (B, T, S) = (2, 5, 7), (T, S) = (5, 7) "
      "or (B, H, T, S) = (2, 2, 5, 7) with B or H possibly 1");
  options = c.options;
  options.dropout_rate = 1.0;
  SDMHA_EXPECT_THROW_WITH(layer.backward(query, {c.key, c.value}, d_output, options),
                          sdmha::ConfigError, "dropout_rate = 1; expected 0 <= dropout_rate < 1");
  options = c.options;
  options.num_threads = -2;
  SDMHA_EXPECT_THROW_WITH(layer.backward(query, {c.key, c.value}, d_output, options),
                          sdmha::ConfigError, "num_threads = -2");
}

// ---- float against double, and dropout's expectation ----

// The same problem in double: every input and weight of the float case, widened.
Case<double> widened(const Case<float>& c) {
  Case<double> d;
  d.shape = c.shape;
  d.problem = c.problem;
  d.config = c.config;
  d.weights.query_kernel = c.weights.query_kernel.cast<double>();
  d.weights.query_bias = c.weights.query_bias.cast<double>();
  d.weights.key_kernel = c.weights.key_kernel.cast<double>();
  d.weights.key_bias = c.weights.key_bias.cast<double>();
  d.weights.value_kernel = c.weights.value_kernel.cast<double>();
  d.weights.value_bias = c.weights.value_bias.cast<double>();
  d.weights.output_kernel = c.weights.output_kernel.cast<double>();
  d.weights.output_bias = c.weights.output_bias.cast<double>();
  d.indices = c.indices;
  d.values = c.values.cast<double>();
  d.key = c.key.cast<double>();
  d.value = c.value.cast<double>();
  d.use_mask(c.mask_storage);
  d.use_key_mask(c.key_mask_storage);
  d.options.use_causal_mask = c.options.use_causal_mask;
  return d;
}

TEST(BackwardPrecision, FloatGradientsAgreeWithDouble) {
  for (int round = 0; round < 6; ++round) {
    Shape s = Shape{}.sized(2, 11, 13).with_heads(2, 6, 5, 7);
    s.query_dim = 40;
    s.random_mask = round % 2 == 0;
    s.causal = round % 3 == 0;
    s.empty_rows = true;
    s.fully_blocked_rows = round % 2 == 1;
    s.duplicates = true;
    auto single = make_case<float>(s, 70 + round);
    auto wide = widened(single);
    const auto d_single = random_d_output(single, 80 + round);
    const Tensor3<double> d_wide = d_single.cast<double>();
    auto options_single = single.options;
    auto options_wide = wide.options;
    if (round >= 3) {
      options_single.score_strategy = options_wide.score_strategy =
          sdmha::ScoreStrategy::sparse_regrouped;
      options_single.training = options_wide.training = true;
      options_single.dropout_rate = options_wide.dropout_rate = 0.3;
      options_single.dropout_seed = options_wide.dropout_seed = 5;
    }
    const auto g_single = backward(single, d_single, options_single);
    const auto g_wide = backward(wide, d_wide, options_wide);
    EXPECT_TRUE(all_gradients_near(single, g_single, wide, g_wide, relative_tolerance<float>()))
        << "round " << round;
  }
}

TEST(BackwardDropout, KeepsTheExpectationOverSeeds) {
  Shape s = Shape{}.sized(1, 3, 5).with_heads(2, 3);
  s.query_dim = 8;
  s.density = 0.5;
  s.random_mask = true;
  const auto c = make_case<double>(s, 90);
  const Layer<double> layer(c.config, c.weights);
  const auto query = c.query();
  auto options = c.options;
  options.num_threads = 1;
  const auto expected = layer.forward(query, {c.key, c.value}, options).output;
  options.training = true;
  options.dropout_rate = 0.3;
  constexpr int kSeeds = 4000;
  std::vector<double> sum(std::size_t(expected.size()), 0.0), sum_of_squares(sum.size(), 0.0);
  for (int seed = 0; seed < kSeeds; ++seed) {
    options.dropout_seed = std::uint64_t(seed) * 7919 + 1;
    const auto output = layer.forward(query, {c.key, c.value}, options).output;
    for (std::size_t i = 0; i < sum.size(); ++i) {
      sum[i] += output.data()[i];
      sum_of_squares[i] += output.data()[i] * output.data()[i];
    }
  }
  double largest_spread = 0.0;
  for (std::size_t i = 0; i < sum.size(); ++i) {
    const double mean = sum[i] / kSeeds;
    const double variance = std::max(0.0, sum_of_squares[i] / kSeeds - mean * mean);
    const double standard_error = std::sqrt(variance / kSeeds);
    largest_spread = std::max(largest_spread, std::sqrt(variance));
    // Five standard errors: the mean of the dropped-out outputs is the output without dropout.
    EXPECT_NEAR(mean, expected.data()[i], 5.0 * standard_error + 1e-12) << "output entry " << i;
  }
  EXPECT_GT(largest_spread, 1e-3);  // dropout did act
}

// ---- the sparse query projection's backward against dense twins ----

// X's CSC (detail::build_feature_groups) in memory of its own, as the backward carves it from
// the workspace: FeatureGroups::bytes, a ScratchBuffer, FeatureGroups::carve.
template <typename Scalar>
struct CarvedFeatureGroups {
  using Groups = typename sdmha::SparseQueryProjection<Scalar>::FeatureGroups;
  sdmha::detail::ScratchBuffer memory;
  Groups groups;

  CarvedFeatureGroups(const sdmha::CsrView<Scalar>& x, bool with_positions) {
    memory.reserve(Groups::bytes(x.cols, x.nonzeros(), with_positions));
    sdmha::detail::ScratchCarver carver(memory.view());
    groups = Groups::carve(carver, x.cols, x.nonzeros(), with_positions);
    sdmha::detail::build_feature_groups(x, groups, with_positions);
  }
};

SDMHA_SCALAR_TYPED_TEST_SUITE(QueryGradientStagesTest);

TYPED_TEST(QueryGradientStagesTest, MatchDenseProducts) {
  using Scalar = TypeParam;
  using Projection = sdmha::SparseQueryProjection<Scalar>;
  Shape s = Shape{}.sized(3, 9, 7);
  s.query_dim = 37;
  s.density = 0.15;
  s.empty_rows = true;
  s.duplicates = true;
  const auto c = make_case<Scalar>(s, 91);
  const auto query = c.query();
  const Index rows = query.rows(), features = query.features(), width = 19;
  std::mt19937_64 generator(92);
  Filler<Scalar> fill{generator};
  sdmha::RowMatrix<Scalar> kernel(features, width), d_query(rows, width);
  for (Index i = 0; i < kernel.size(); ++i) kernel.data()[i] = fill(-1, 1);
  for (Index i = 0; i < d_query.size(); ++i) d_query.data()[i] = fill(-1, 1);
  const sdmha::RowMatrix<double> dense = query.to_dense().template cast<double>();
  const sdmha::RowMatrix<double> d_query_wide = d_query.template cast<double>();
  const sdmha::RowMatrix<double> kernel_wide = kernel.template cast<double>();
  const Projection stage;

  sdmha::Vector<Scalar> d_values(query.nonzeros());
  typename Projection::ValuesGradientArguments values_args{query.csr(), kernel, d_query, d_values};
  Projection::can_implement(values_args);
  stage.backward(values_args);
  const sdmha::RowMatrix<double> full = d_query_wide * kernel_wide.transpose();  // the dense twin
  std::vector<double> expected_values;
  const auto& csr = query.csr();
  for (Index r = 0; r < rows; ++r)
    for (Index k = csr.row_begin(r); k < csr.row_end(r); ++k)
      expected_values.push_back(full(r, csr.column_indices[k]));
  EXPECT_TRUE(all_near(d_values.data(), expected_values, relative_tolerance<Scalar>()));

  sdmha::RowMatrix<Scalar> d_kernel(features, width);
  d_kernel.setConstant(Scalar(42));  // overwritten, not accumulated into
  typename Projection::KernelGradientArguments kernel_args{query.csr(), d_query, d_kernel};
  Projection::can_implement(kernel_args);
  stage.backward(kernel_args);
  const sdmha::RowMatrix<double> expected_kernel = dense.transpose() * d_query_wide;
  const std::vector<double> expected_kernel_entries(
      expected_kernel.data(), expected_kernel.data() + expected_kernel.size());
  EXPECT_TRUE(all_near(d_kernel.data(), expected_kernel_entries, relative_tolerance<Scalar>()));

  // By feature over X's CSC, in two blocks of features as the backward splits them.
  const CarvedFeatureGroups<Scalar> carved(query.csr(), true);
  const Index split = features / 2;
  sdmha::Vector<Scalar> d_values_by_feature = sdmha::Vector<Scalar>::Constant(d_values.size(), 42);
  sdmha::RowMatrix<Scalar> d_kernel_by_feature =
      sdmha::RowMatrix<Scalar>::Constant(features, width, 42);
  for (auto [first, count] : {std::pair<Index, Index>{0, split}, {split, features - split}}) {
    typename Projection::ValuesGradientArguments feature_values_args{
        query.csr(), kernel, d_query, d_values_by_feature, &carved.groups, first, count};
    Projection::can_implement(feature_values_args);
    stage.backward(feature_values_args);
    typename Projection::KernelGradientArguments feature_kernel_args{
        query.csr(), d_query, d_kernel_by_feature.middleRows(first, count), &carved.groups, first};
    Projection::can_implement(feature_kernel_args);
    stage.backward(feature_kernel_args);
  }
  EXPECT_TRUE(all_near(d_values_by_feature.data(), expected_values, relative_tolerance<Scalar>()));
  EXPECT_TRUE(
      all_near(d_kernel_by_feature.data(), expected_kernel_entries, relative_tolerance<Scalar>()));
}

TYPED_TEST(QueryGradientStagesTest, RejectMismatchedShapes) {
  using Scalar = TypeParam;
  using Projection = sdmha::SparseQueryProjection<Scalar>;
  const auto c = make_case<Scalar>(Shape{}, 93);  // 10 rows, 16 features
  const auto query = c.query();
  sdmha::RowMatrix<Scalar> kernel = sdmha::RowMatrix<Scalar>::Zero(16, 8),
                           d_query = sdmha::RowMatrix<Scalar>::Zero(10, 8);
  sdmha::RowMatrix<Scalar> short_kernel = sdmha::RowMatrix<Scalar>::Zero(15, 8);
  sdmha::RowMatrix<Scalar> narrow_d_query = sdmha::RowMatrix<Scalar>::Zero(10, 7);
  sdmha::Vector<Scalar> d_values(query.nonzeros()), short_values(query.nonzeros() - 1);
  using Values = typename Projection::ValuesGradientArguments;
  SDMHA_EXPECT_THROW_WITH(
      Projection::can_implement(Values{query.csr(), short_kernel, d_query, d_values}),
      sdmha::ShapeError,
      "SparseQueryProjection (values gradient): kernel has 15 rows; expected the "
      "query's feature width 16");
  SDMHA_EXPECT_THROW_WITH(
      Projection::can_implement(Values{query.csr(), kernel, narrow_d_query, d_values}),
      sdmha::ShapeError, "d_query is 10 x 7; expected 10 x 8");
  SDMHA_EXPECT_THROW_WITH(
      Projection::can_implement(Values{query.csr(), kernel, d_query, short_values}),
      sdmha::ShapeError, "d_values has " + std::to_string(query.nonzeros() - 1) + " entries");
  using Kernel = typename Projection::KernelGradientArguments;
  sdmha::RowMatrix<Scalar> d_kernel(16, 8), wrong_d_kernel(16, 7);
  SDMHA_EXPECT_THROW_WITH(
      Projection::can_implement(Kernel{query.csr(), d_query.topRows(9), d_kernel}),
      sdmha::ShapeError,
      "SparseQueryProjection (kernel gradient): d_query has 9 rows; expected 10");
  SDMHA_EXPECT_THROW_WITH(Projection::can_implement(Kernel{query.csr(), d_query, wrong_d_kernel}),
                          sdmha::ShapeError, "d_kernel is 16 x 7; expected 16 x 8");

  // The by-feature forms: a CSC that is not the query's (or lacks positions), a feature range
  // outside [0, Eq).
  const CarvedFeatureGroups<Scalar> groups(query.csr(), true),
      without_positions(query.csr(), false), stale(query.csr().middle_rows(0, 5), true);
  SDMHA_EXPECT_THROW_WITH(Projection::can_implement(
                              Values{query.csr(), kernel, d_query, d_values, &stale.groups, 0, 16}),
                          sdmha::ShapeError, "expected build_feature_groups of the query");
  SDMHA_EXPECT_THROW_WITH(Projection::can_implement(Values{query.csr(), kernel, d_query, d_values,
                                                           &without_positions.groups, 0, 16}),
                          sdmha::ShapeError, "and positions");
  SDMHA_EXPECT_THROW_WITH(Projection::can_implement(
                              Values{query.csr(), kernel, d_query, d_values, &groups.groups, 8, 9}),
                          sdmha::ShapeError,
                          "features [8, 17) asked for; expected a range in [0, 16)");
  SDMHA_EXPECT_THROW_WITH(
      Projection::can_implement(Kernel{query.csr(), d_query, d_kernel, &stale.groups, 0}),
      sdmha::ShapeError, "expected build_feature_groups of the query");
  SDMHA_EXPECT_THROW_WITH(
      Projection::can_implement(Kernel{query.csr(), d_query, d_kernel, &groups.groups, 1}),
      sdmha::ShapeError, "features [1, 17) asked for; expected a range in [0, 16)");
  SDMHA_EXPECT_THROW_WITH(
      Projection::can_implement(Kernel{query.csr(), d_query, wrong_d_kernel, &groups.groups, 0}),
      sdmha::ShapeError, "d_kernel has 7 columns; expected d_query's 8");
  EXPECT_NO_THROW(Projection::can_implement(
      Kernel{query.csr(), d_query, d_kernel.middleRows(4, 12), &groups.groups, 4}));
}

}  // namespace
}  // namespace sdmha_test
