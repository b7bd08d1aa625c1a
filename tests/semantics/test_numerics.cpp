// Numerical robustness of the whole layer: logits up to ±1e4 through the stable
// softmax, NaN and Inf in key and value rows at blocked positions (attention mask, causal mask,
// key padding; both score strategies), and float against double on every golden case's shape.
#include "test_support.hpp"

#include "dense_mha.hpp"  // the bench's dense baseline (bench/), which the layers are compared with

#include <sdmha/detail/finite.hpp>
#include <sdmha/io/layer_files.hpp>

#include <cstdio>
#include <limits>
#include <string>

#ifndef SDMHA_TEST_DATA_DIR
#error "SDMHA_TEST_DATA_DIR must name tests/data"
#endif

namespace sdmha_test {
namespace {

SDMHA_SCALAR_TYPED_TEST_SUITE(Numerics);

constexpr sdmha::ScoreStrategy kStrategies[] = {sdmha::ScoreStrategy::project_first,
                                                sdmha::ScoreStrategy::sparse_regrouped};

double max_abs_finite(const std::vector<double>& values) {
  double largest = 0.0;
  for (double x : values)
    if (std::isfinite(x)) largest = std::max(largest, std::abs(x));
  return largest;
}

// Scales the query and key projections (kernels and biases) by `factor`, in the layer's weights
// and in the reference's twin alike: every logit scales by factor².
template <typename Scalar>
void scale_logits(Case<Scalar>& c, double factor) {
  auto& p = c.problem;
  auto& w = c.weights;
  auto scale = [&](auto& matrix, std::vector<double>& twin) {
    for (Index i = 0; i < matrix.size(); ++i) {
      matrix.data()[i] = Scalar(double(matrix.data()[i]) * factor);
      twin[std::size_t(i)] = double(matrix.data()[i]);
    }
  };
  scale(w.query_kernel, p.query_kernel);
  scale(w.key_kernel, p.key_kernel);
  if (c.shape.use_bias) {
    scale(w.query_bias, p.query_bias);
    scale(w.key_bias, p.key_bias);
  }
}

// ---- logits up to ±1e4 ----

// The options of `c` under `strategy`, with the scores returned.
template <typename Scalar>
sdmha::AttentionOptions<Scalar> with_scores(const Case<Scalar>& c, sdmha::ScoreStrategy strategy) {
  auto options = c.options;
  options.score_strategy = strategy;
  options.return_attention_scores = true;
  return options;
}

// The layer's forward of `c` with `options`, each output entry checked finite.
template <typename Scalar>
sdmha::AttentionResult<Scalar> finite_forward(const sdmha::SparseDenseMHA<Scalar>& layer,
                                              const Case<Scalar>& c,
                                              const sdmha::AttentionOptions<Scalar>& options) {
  auto result = layer.forward(c.query(), {c.key, c.value}, options);
  for (Index i = 0; i < result.output.size(); ++i)
    EXPECT_TRUE(std::isfinite(result.output.data()[i])) << "output entry " << i;
  return result;
}

TYPED_TEST(Numerics, LogitsOfTenThousandGiveFiniteProbabilitiesThatSumToOne) {
  using Scalar = TypeParam;
  Shape s = Shape{}.sized(2, 9, 11);
  s.random_mask = true;
  s.fully_blocked_rows = true;
  auto c = make_case<Scalar>(s, 31);
  // Bring the largest logit to 1e4 (the scores are bilinear in the two projections).
  const double largest = max_abs_finite(sdmha_reference::forward(c.problem).scores);
  scale_logits(c, std::sqrt(1e4 / largest));
  const auto expected = sdmha_reference::forward(c.problem);
  ASSERT_GT(max_abs_finite(expected.scores), 5e3);
  ASSERT_LE(max_abs_finite(expected.scores), 1.01e4);
  double most_negative = 0.0;
  for (double x : expected.scores)
    if (std::isfinite(x)) most_negative = std::min(most_negative, x);
  ASSERT_LT(most_negative, -1e3) << "the logits should reach far below zero too";

  const sdmha::SparseDenseMHA<Scalar> layer(c.config, c.weights);
  for (auto strategy : kStrategies) {
    SCOPED_TRACE(sdmha::to_string(strategy));
    const auto result = finite_forward(layer, c, with_scores(c, strategy));
    const auto& p = result.attention_scores;
    const Index S = p.dimension(3);
    for (Index row = 0; row < p.size() / S; ++row) {
      double sum = 0.0;
      for (Index k = 0; k < S; ++k) {
        const Scalar probability = p.data()[row * S + k];
        ASSERT_TRUE(std::isfinite(probability));
        ASSERT_GE(probability, Scalar(0));
        sum += double(probability);
      }
      // A fully blocked row sums to 0; every other row to 1 within rounding.
      if (sum != 0.0) {
        EXPECT_NEAR(sum, 1.0, 16 * S * double(std::numeric_limits<Scalar>::epsilon()));
      }
    }
    // float64 keeps about 12 digits of a logit of 1e4 and so matches the reference tightly; float
    // keeps about 3, so its probabilities may move by ~1e-3 relative where logits nearly tie.
    const double tolerance = std::is_same<Scalar, double>::value ? 1e-8 : 2e-2;
    EXPECT_TRUE(all_near(p.data(), expected.probabilities, tolerance));
    EXPECT_TRUE(all_near(result.output.data(), expected.output, tolerance));
  }
}

TYPED_TEST(Numerics, EqualHugeLogitsShareTheProbabilityAndNegativeOnesVanish) {
  using Scalar = TypeParam;
  // The softmax alone, on rows that would overflow exp without the max subtraction.
  sdmha::RowMatrix<Scalar> scores(3, 4);
  const Scalar blocked = -std::numeric_limits<Scalar>::infinity();
  scores << Scalar(1e4), Scalar(1e4), Scalar(-1e4), blocked, Scalar(-1e4), Scalar(-1e4),
      Scalar(-1e4), Scalar(-1e4), Scalar(1e4), Scalar(0), Scalar(-1e4), Scalar(1e4) - Scalar(1);
  sdmha::MaskedSoftmax<Scalar> softmax;
  softmax(typename sdmha::MaskedSoftmax<Scalar>::Arguments{{}, scores});
  // exp(−2e4) is 0, or a denormal from a vectorised exp that clamps its argument: either way
  // below the smallest normal number.
  const double epsilon = 4 * double(std::numeric_limits<Scalar>::epsilon());
  const Scalar negligible = std::numeric_limits<Scalar>::min();
  EXPECT_NEAR(double(scores(0, 0)), 0.5, epsilon);
  EXPECT_NEAR(double(scores(0, 1)), 0.5, epsilon);
  EXPECT_LT(scores(0, 2), negligible);
  EXPECT_EQ(scores(0, 3), Scalar(0));  // blocked: exactly zero
  for (Index k = 0; k < 4; ++k) EXPECT_NEAR(double(scores(1, k)), 0.25, epsilon);
  const double e = std::exp(-1.0);
  EXPECT_NEAR(double(scores(2, 0)), 1.0 / (1.0 + e), epsilon);
  EXPECT_NEAR(double(scores(2, 3)), e / (1.0 + e), epsilon);
  EXPECT_LT(scores(2, 1), negligible);
  EXPECT_LT(scores(2, 2), negligible);
  for (Index t = 0; t < 3; ++t)
    for (Index k = 0; k < 4; ++k) EXPECT_TRUE(std::isfinite(scores(t, k)));
}

// ---- NaN and Inf at blocked positions ----

enum class Blocking { attention_mask, causal, key_mask };

const char* name_of(Blocking blocking) {
  switch (blocking) {
    case Blocking::attention_mask:
      return "attention_mask";
    case Blocking::causal:
      return "causal";
    default:
      return "key_mask";
  }
}

// A problem in which some key steps are blocked for every query of their batch entry by
// `blocking` alone, and the list of those (b, s).
template <typename Scalar>
Case<Scalar> blocked_problem(Blocking blocking, long steps, long key_steps,
                             std::vector<std::pair<long, long>>& blocked) {
  Shape s = Shape{}.sized(2, steps, key_steps);
  s.heads = 2;
  s.random_mask = blocking == Blocking::attention_mask;
  s.causal = blocking == Blocking::causal;
  s.key_mask = blocking == Blocking::key_mask;
  auto c = make_case<Scalar>(s, 40 + std::uint64_t(blocking) + std::uint64_t(steps));
  auto& p = c.problem;
  blocked.clear();
  for (long b = 0; b < s.batch; ++b) {
    if (blocking == Blocking::attention_mask) {
      // Key steps 1 and S − 2 blocked for every query of this batch entry.
      for (long k : {1L, key_steps - 2}) {
        for (long t = 0; t < steps; ++t) {
          c.mutable_mask()(b, t, k) = false;
          p.attention_mask[std::size_t((b * steps + t) * key_steps + k)] = 0;
        }
        blocked.push_back({b, k});
      }
    } else if (blocking == Blocking::causal) {
      for (long k = steps; k < key_steps; ++k) blocked.push_back({b, k});  // s > t for every t < T
    } else {
      for (long k : {0L, key_steps / 2}) {
        c.mutable_key_mask()(b, k) = false;
        p.key_mask[std::size_t(b * key_steps + k)] = 0;
      }
      for (long k = 0; k < key_steps; ++k)
        if (!c.key_mask()(b, k)) blocked.push_back({b, k});
    }
  }
  return c;
}

TYPED_TEST(Numerics, NonFiniteKeysAndValuesAtBlockedPositionsNeverReachTheOutput) {
  using Scalar = TypeParam;
  const Scalar poisons[] = {
      std::numeric_limits<Scalar>::quiet_NaN(), std::numeric_limits<Scalar>::infinity(),
      -std::numeric_limits<Scalar>::infinity(), std::numeric_limits<Scalar>::max()};
  // (T, S): a small case, and one whose T crosses a causal mask's 64-step query tile (causal
  // skips tiles).
  const std::pair<long, long> sizes[] = {{5, 9}, {70, 75}};
  for (Blocking blocking : {Blocking::attention_mask, Blocking::causal, Blocking::key_mask}) {
    for (const auto& [steps, key_steps] : sizes) {
      SCOPED_TRACE(std::string(name_of(blocking)) + ", T = " + std::to_string(steps));
      std::vector<std::pair<long, long>> blocked;
      auto c = blocked_problem<Scalar>(blocking, steps, key_steps, blocked);
      ASSERT_FALSE(blocked.empty());
      // Expected from the clean data: blocked rows cannot matter.
      const auto expected = sdmha_reference::forward(c.problem);
      int which = 0;
      for (const auto& [b, k] : blocked) {
        for (long e = 0; e < c.shape.key_in_dim; ++e) c.key(b, k, e) = poisons[which++ % 4];
        for (long e = 0; e < c.shape.value_in_dim; ++e) c.value(b, k, e) = poisons[which++ % 4];
      }
      const sdmha::SparseDenseMHA<Scalar> layer(c.config, c.weights);
      const sdmha::DenseMHA<Scalar> dense(c.config, c.weights);
      for (auto strategy : kStrategies) {
        SCOPED_TRACE(sdmha::to_string(strategy));
        const auto options = with_scores(c, strategy);
        const auto result = finite_forward(layer, c, options);
        EXPECT_TRUE(all_near(result.output.data(), expected.output, relative_tolerance<Scalar>()));
        EXPECT_TRUE(all_near(result.attention_scores.data(), expected.probabilities,
                             relative_tolerance<Scalar>()));
        for (const auto& [b, k] : blocked)
          for (long h = 0; h < c.shape.heads; ++h)
            for (long t = 0; t < steps; ++t)
              EXPECT_EQ(result.attention_scores(b, h, t, k), Scalar(0));
        // Through a context projected once, too.
        const auto context = layer.project_context(c.key, c.value);
        EXPECT_TRUE(all_near(layer.forward(c.query(), context, options).output.data(),
                             expected.output, relative_tolerance<Scalar>()));
      }
      const auto dense_result = dense.forward(c.dense_query(), {c.key, c.value}, c.options);
      EXPECT_TRUE(
          all_near(dense_result.output.data(), expected.output, relative_tolerance<Scalar>()));
    }
  }
}

// ---- float against double on the golden cases' shapes ----

std::string golden_path(const std::string& name) {
  return std::string(SDMHA_TEST_DATA_DIR) + "/goldens/" + name + ".safetensors";
}

// The shape of a golden case, read from its file (random data of that shape is used below).
Shape golden_shape(const std::string& name) {
  const auto source = sdmha::io::TensorSource::open(golden_path(name));
  const auto layer = sdmha::io::load_layer<double>(source);
  const auto inputs = sdmha::io::load_inputs<double>(source);
  const sdmha::LayerDims dims = layer.weights.validate(layer.config);
  Shape s = Shape{}
                .sized(inputs.query.batch(), inputs.query.steps(), inputs.value.dimension(1))
                .widths(dims.query_dim, dims.key_in_dim, dims.value_in_dim)
                .with_heads(dims.num_heads, dims.key_dim, dims.value_dim, dims.output_dim);
  s.use_bias = layer.config.use_bias;
  s.causal = layer.use_causal_mask;
  s.random_mask = inputs.attention_mask.size() != 0;
  s.density = double(inputs.query.nonzeros()) /
              double(std::max<Index>(1, inputs.query.rows() * dims.query_dim));
  return s;
}

// detail::all_finite, which decides whether the layer may use a plain GEMM (0·NaN = NaN), must
// see every NaN and ±Inf: at any row and column, inside a block with a stride, next to entries
// that are finite but extreme (largest, smallest subnormal, −0).
TYPED_TEST(Numerics, AllFiniteFindsEveryNonFiniteEntryAndNoFiniteOne) {
  using Scalar = TypeParam;
  using Limits = std::numeric_limits<Scalar>;
  sdmha::RowMatrix<Scalar> matrix = sdmha::RowMatrix<Scalar>::Constant(7, 37, Scalar(1));
  matrix(0, 0) = Limits::max();
  matrix(1, 1) = -Limits::max();
  matrix(2, 2) = Limits::denorm_min();
  matrix(3, 3) = Scalar(-0.0);
  EXPECT_TRUE(sdmha::detail::all_finite<Scalar>(matrix));
  EXPECT_TRUE(sdmha::detail::all_finite<Scalar>(matrix.block(0, 0, 0, 37)));
  for (Scalar bad : {Limits::quiet_NaN(), Limits::infinity(), -Limits::infinity()})
    for (Index row = 0; row < matrix.rows(); ++row)
      for (Index column = 0; column < matrix.cols(); ++column) {
        sdmha::RowMatrix<Scalar> copy = matrix;
        copy(row, column) = bad;
        ASSERT_FALSE(sdmha::detail::all_finite<Scalar>(copy)) << row << ", " << column;
        // A block that holds the entry sees it; one beside it, with the same stride, does not.
        const Index first = column >= 16 ? 16 : 0;
        ASSERT_FALSE(
            sdmha::detail::all_finite<Scalar>(copy.block(0, first, 7, first == 16 ? 21 : 16)))
            << row << ", " << column;
        const Index other = first == 16 ? 0 : 16;
        ASSERT_TRUE(sdmha::detail::all_finite<Scalar>(copy.block(0, other, 7, 16)))
            << row << ", " << column;
      }
}

TEST(NumericsPrecision, FloatAgreesWithDoubleOnEveryGoldenShape) {
  const char* const cases[] = {"keras_basic_f64",  "keras_value_dim_f64",  "keras_mask_f64",
                               "keras_causal_f64", "keras_empty_rows_f64", "keras_fully_masked_f64",
                               "torch_packed_f64", "keras_medium_f32"};
  for (const char* name : cases) {
    SCOPED_TRACE(name);
    Shape s = golden_shape(name);
    if (std::string(name) == "keras_empty_rows_f64") s.empty_rows = true;
    if (std::string(name) == "keras_fully_masked_f64") s.fully_blocked_rows = true;
    // float inputs, and the same numbers widened exactly for the double layer: the two results
    // differ only by the arithmetic.
    const auto c = make_case<float>(s, 50);
    sdmha::MhaWeights<double> weights;
    weights.query_kernel = c.weights.query_kernel.cast<double>();
    weights.key_kernel = c.weights.key_kernel.cast<double>();
    weights.value_kernel = c.weights.value_kernel.cast<double>();
    weights.output_kernel = c.weights.output_kernel.cast<double>();
    weights.query_bias = c.weights.query_bias.cast<double>();
    weights.key_bias = c.weights.key_bias.cast<double>();
    weights.value_bias = c.weights.value_bias.cast<double>();
    weights.output_bias = c.weights.output_bias.cast<double>();
    const Tensor3<double> key = c.key.cast<double>(), value = c.value.cast<double>();
    sdmha::AttentionOptions<double> options;
    options.attention_mask = c.options.attention_mask;
    options.use_causal_mask = c.options.use_causal_mask;
    options.return_attention_scores = true;
    const auto query = sdmha::SparseQuery<double>::from_coo(s.batch, s.steps, s.query_dim,
                                                            c.indices, c.values.cast<double>());
    const sdmha::SparseDenseMHA<float> float_layer(c.config, c.weights);
    const sdmha::SparseDenseMHA<double> double_layer(c.config, weights);
    for (auto strategy : kStrategies) {
      SCOPED_TRACE(sdmha::to_string(strategy));
      auto float_options = c.options;
      float_options.score_strategy = options.score_strategy = strategy;
      float_options.return_attention_scores = true;
      const auto single = float_layer.forward(c.query(), {c.key, c.value}, float_options);
      const auto wide = double_layer.forward(query, {key, value}, options);
      std::vector<double> wide_output(wide.output.data(), wide.output.data() + wide.output.size());
      std::vector<double> wide_scores(wide.attention_scores.data(),
                                      wide.attention_scores.data() + wide.attention_scores.size());
      ASSERT_EQ(single.output.size(), wide.output.size());
      EXPECT_TRUE(all_near(single.output.data(), wide_output, relative_tolerance<float>()));
      EXPECT_TRUE(
          all_near(single.attention_scores.data(), wide_scores, relative_tolerance<float>()));
      // And the double result against the float64 reference on the same numbers.
      const auto expected = sdmha_reference::forward(c.problem);
      EXPECT_TRUE(all_near(wide.output.data(), expected.output, relative_tolerance<double>()));
    }
  }
}

}  // namespace
}  // namespace sdmha_test
