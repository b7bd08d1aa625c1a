// Tests of sdmha/weights.hpp: MhaConfig's checks and resolved widths, Keras' GlorotUniform
// initialisation (shapes, limits from Keras' fans, reproducibility, variance), and every shape
// check of MhaWeights::validate.
#include "test_support.hpp"

namespace sdmha_test {
namespace {

SDMHA_SCALAR_TYPED_TEST_SUITE(WeightsTest);

using Dims = std::pair<Index, Index>;

// rows × cols of a kernel, to check both in one assertion.
template <typename Scalar>
Dims dims_of(const sdmha::RowMatrix<Scalar>& kernel) {
  return {kernel.rows(), kernel.cols()};
}

// MhaConfig is an aggregate: {num_heads, key_dim, value_dim, output_dim, use_bias}.
sdmha::MhaConfig make_config(Index heads, Index key_dim, Index value_dim, Index output_dim,
                             bool use_bias = true) {
  return sdmha::MhaConfig{heads, key_dim, value_dim, output_dim, use_bias};
}

// GlorotUniform's limit for a Keras kernel of shape (receptive, input_depth, output_depth):
// fan_in = receptive · input_depth, fan_out = receptive · output_depth.
double keras_limit(Index receptive, Index input_depth, Index output_depth) {
  return std::sqrt(6.0 / double(receptive * input_depth + receptive * output_depth));
}

template <typename Scalar>
double max_abs(const sdmha::RowMatrix<Scalar>& kernel) {
  return kernel.size() == 0 ? 0.0 : double(kernel.cwiseAbs().maxCoeff());
}

TEST(MhaConfigTest, ValidateRejectsEachBadField) {
  EXPECT_NO_THROW(make_config(2, 4, 0, 0).validate());
  EXPECT_NO_THROW(make_config(1, 1, 3, 5).validate());
  SDMHA_EXPECT_THROW_WITH(make_config(0, 4, 0, 0).validate(), sdmha::ConfigError,
                          "MhaConfig: num_heads = 0; expected > 0");
  SDMHA_EXPECT_THROW_WITH(make_config(-2, 4, 0, 0).validate(), sdmha::ConfigError,
                          "num_heads = -2; expected > 0");
  SDMHA_EXPECT_THROW_WITH(make_config(2, 0, 0, 0).validate(), sdmha::ConfigError,
                          "key_dim = 0; expected > 0");
  SDMHA_EXPECT_THROW_WITH(make_config(2, -1, 0, 0).validate(), sdmha::ConfigError,
                          "key_dim = -1; expected > 0");
  SDMHA_EXPECT_THROW_WITH(make_config(2, 4, -1, 0).validate(), sdmha::ConfigError,
                          "value_dim = -1; expected >= 0 (0 means key_dim)");
  SDMHA_EXPECT_THROW_WITH(make_config(2, 4, 0, -3).validate(), sdmha::ConfigError,
                          "output_dim = -3; expected >= 0 (0 means the query's feature width)");
  EXPECT_THROW(make_config(0, 4, 0, 0).validate(), sdmha::Error);
}

TEST(MhaConfigTest, ResolvesDefaultWidths) {
  EXPECT_EQ(make_config(2, 4, 0, 0).resolved_value_dim(), 4);
  EXPECT_EQ(make_config(2, 4, 7, 0).resolved_value_dim(), 7);
  EXPECT_EQ(make_config(2, 4, 0, 0).resolved_output_dim(13), 13);
  EXPECT_EQ(make_config(2, 4, 0, 5).resolved_output_dim(13), 5);
}

TYPED_TEST(WeightsTest, GlorotUniformGivesKerasShapesAndZeroBiases) {
  using Weights = sdmha::MhaWeights<TypeParam>;
  // Dv ≠ Dk, O ≠ Eq, and Eq, Ek, Ev all different.
  const auto config = make_config(3, 4, 6, 5);
  const auto w = Weights::glorot_uniform(config, 10, 7, 9, 1);
  EXPECT_EQ(dims_of(w.query_kernel), Dims(10, 12));
  EXPECT_EQ(dims_of(w.key_kernel), Dims(7, 12));
  EXPECT_EQ(dims_of(w.value_kernel), Dims(9, 18));
  EXPECT_EQ(dims_of(w.output_kernel), Dims(18, 5));
  EXPECT_EQ(w.query_bias.size(), 12);
  EXPECT_EQ(w.key_bias.size(), 12);
  EXPECT_EQ(w.value_bias.size(), 18);
  EXPECT_EQ(w.output_bias.size(), 5);
  for (const auto* bias : {&w.query_bias, &w.key_bias, &w.value_bias, &w.output_bias})
    EXPECT_TRUE((bias->array() == TypeParam(0)).all());

  const auto dims = w.validate(config);
  EXPECT_EQ(dims.num_heads, 3);
  EXPECT_EQ(dims.key_dim, 4);
  EXPECT_EQ(dims.value_dim, 6);
  EXPECT_EQ(dims.query_dim, 10);
  EXPECT_EQ(dims.key_in_dim, 7);
  EXPECT_EQ(dims.value_in_dim, 9);
  EXPECT_EQ(dims.output_dim, 5);
  EXPECT_EQ(dims.projected_key_width(), 12);
  EXPECT_EQ(dims.projected_value_width(), 18);

  // Defaults: Dv = Dk and O = Eq.
  const auto defaults = Weights::glorot_uniform(make_config(2, 3, 0, 0), 11, 4, 6, 1);
  EXPECT_EQ(defaults.value_kernel.cols(), 6);
  EXPECT_EQ(dims_of(defaults.output_kernel), Dims(6, 11));
  EXPECT_EQ(defaults.output_bias.size(), 11);
  EXPECT_EQ(defaults.validate(make_config(2, 3, 0, 0)).output_dim, 11);
}

TYPED_TEST(WeightsTest, GlorotUniformWithoutBiasLeavesTheBiasesEmpty) {
  const auto config = make_config(2, 4, 3, 6, false);
  const auto w = sdmha::MhaWeights<TypeParam>::glorot_uniform(config, 8, 5, 7, 2);
  EXPECT_EQ(w.query_bias.size(), 0);
  EXPECT_EQ(w.key_bias.size(), 0);
  EXPECT_EQ(w.value_bias.size(), 0);
  EXPECT_EQ(w.output_bias.size(), 0);
  EXPECT_EQ(w.query_kernel.cols(), 8);
  EXPECT_NO_THROW(w.validate(config));
}

TYPED_TEST(WeightsTest, GlorotUniformStaysWithinTheLimitOfKerasFans) {
  // Eq, Ek, Ev, H, Dk, Dv, O all distinct, so that a fan taken from the wrong axis shows.
  const Index Eq = 40, Ek = 24, Ev = 30, H = 3, Dk = 8, Dv = 5, O = 11;
  const auto w =
      sdmha::MhaWeights<TypeParam>::glorot_uniform(make_config(H, Dk, Dv, O), Eq, Ek, Ev, 3);
  const struct {
    const char* name;
    const sdmha::RowMatrix<TypeParam>& kernel;
    double limit;
  } kernels[] = {
      {"query_kernel", w.query_kernel, keras_limit(Eq, H, Dk)},
      {"key_kernel", w.key_kernel, keras_limit(Ek, H, Dk)},
      {"value_kernel", w.value_kernel, keras_limit(Ev, H, Dv)},
      {"output_kernel", w.output_kernel, keras_limit(H, Dv, O)},
  };
  // A float entry may round up onto the limit itself.
  const double rounding = 1.0 + double(std::numeric_limits<TypeParam>::epsilon());
  for (const auto& k : kernels) {
    SCOPED_TRACE(k.name);
    const double largest = max_abs(k.kernel);
    EXPECT_LE(largest, k.limit * rounding);
    // Hundreds of uniform draws reach close to the limit.
    EXPECT_GT(largest, 0.9 * k.limit);
  }
}

TYPED_TEST(WeightsTest, GlorotUniformHasTheVarianceOfItsLimit) {
  // 100 × 128 = 12800 draws: the sample variance is within 1% (1 sd) of limit²/3.
  const Index Eq = 100, H = 4, Dk = 32;
  const auto w =
      sdmha::MhaWeights<TypeParam>::glorot_uniform(make_config(H, Dk, 0, 0), Eq, 3, 3, 4);
  const double limit = keras_limit(Eq, H, Dk);
  const auto& kernel = w.query_kernel;
  const double n = double(kernel.size());
  double sum = 0.0, sum_squares = 0.0;
  for (Index i = 0; i < kernel.size(); ++i) {
    sum += double(kernel.data()[i]);
    sum_squares += double(kernel.data()[i]) * double(kernel.data()[i]);
  }
  const double mean = sum / n;
  const double variance = sum_squares / n - mean * mean;
  const double expected_variance = limit * limit / 3.0;
  EXPECT_LT(std::abs(mean), 5.0 * std::sqrt(expected_variance / n));
  EXPECT_NEAR(variance, expected_variance, 0.05 * expected_variance);
}

TYPED_TEST(WeightsTest, GlorotUniformIsReproducibleFromItsSeed) {
  using Weights = sdmha::MhaWeights<TypeParam>;
  const auto config = make_config(2, 4, 3, 5);
  const auto a = Weights::glorot_uniform(config, 9, 6, 7, 42);
  const auto b = Weights::glorot_uniform(config, 9, 6, 7, 42);
  const auto other = Weights::glorot_uniform(config, 9, 6, 7, 43);
  EXPECT_TRUE((a.query_kernel.array() == b.query_kernel.array()).all());
  EXPECT_TRUE((a.key_kernel.array() == b.key_kernel.array()).all());
  EXPECT_TRUE((a.value_kernel.array() == b.value_kernel.array()).all());
  EXPECT_TRUE((a.output_kernel.array() == b.output_kernel.array()).all());
  EXPECT_EQ((a.query_kernel.array() == other.query_kernel.array()).count(), 0);
  EXPECT_EQ((a.output_kernel.array() == other.output_kernel.array()).count(), 0);
  // The four kernels come from one stream, not four copies of it.
  EXPECT_NE(a.query_kernel(0, 0), a.key_kernel(0, 0));
}

TYPED_TEST(WeightsTest, GlorotUniformRejectsBadWidths) {
  using Weights = sdmha::MhaWeights<TypeParam>;
  const auto config = make_config(2, 4, 0, 0);
  SDMHA_EXPECT_THROW_WITH(Weights::glorot_uniform(config, 0, 6, 7, 1), sdmha::ShapeError,
                          "MhaWeights::glorot_uniform: query_dim = 0; expected > 0");
  SDMHA_EXPECT_THROW_WITH(Weights::glorot_uniform(config, 9, -1, 7, 1), sdmha::ShapeError,
                          "key_in_dim = -1; expected > 0");
  SDMHA_EXPECT_THROW_WITH(Weights::glorot_uniform(config, 9, 6, 0, 1), sdmha::ShapeError,
                          "value_in_dim = 0; expected > 0");
  SDMHA_EXPECT_THROW_WITH(Weights::glorot_uniform(make_config(0, 4, 0, 0), 9, 6, 7, 1),
                          sdmha::ConfigError, "num_heads = 0");
}

TYPED_TEST(WeightsTest, ValidateNamesEachKernelAndBiasOfTheWrongShape) {
  using Weights = sdmha::MhaWeights<TypeParam>;
  // H = 3, Dk = 4, Dv = 6, O = 5; Eq = 10, Ek = 7, Ev = 9.
  const auto config = make_config(3, 4, 6, 5);
  const auto valid = Weights::glorot_uniform(config, 10, 7, 9, 5);
  ASSERT_NO_THROW(valid.validate(config));
  auto check = [&](auto&& mutate, const std::string& fragment) {
    Weights w = valid;
    mutate(w);
    SDMHA_EXPECT_THROW_WITH(w.validate(config), sdmha::ShapeError, fragment);
  };
  check([](Weights& w) { w.query_kernel.resize(10, 11); },
        "MhaWeights: query_kernel is 10 x 11; expected (input width > 0) x 12");
  check([](Weights& w) { w.query_kernel.resize(0, 12); },
        "query_kernel is 0 x 12; expected (input width > 0) x 12");
  check([](Weights& w) { w.key_kernel.resize(7, 13); },
        "key_kernel is 7 x 13; expected (input width > 0) x 12");
  check([](Weights& w) { w.key_kernel.resize(0, 12); }, "key_kernel is 0 x 12");
  check([](Weights& w) { w.value_kernel.resize(9, 12); },
        "value_kernel is 9 x 12; expected (input width > 0) x 18");
  check([](Weights& w) { w.output_kernel.resize(12, 5); },
        "output_kernel is 12 x 5; expected num_heads * value_dim x output_dim = 18 x 5");
  check([](Weights& w) { w.output_kernel.resize(18, 10); },
        "output_kernel is 18 x 10; expected num_heads * value_dim x output_dim = 18 x 5");
  check([](Weights& w) { w.query_bias.resize(11); }, "query_bias has 11 entries; expected 12");
  check([](Weights& w) { w.key_bias.resize(0); }, "key_bias has 0 entries; expected 12");
  check([](Weights& w) { w.value_bias.resize(12); }, "value_bias has 12 entries; expected 18");
  check([](Weights& w) { w.output_bias.resize(10); }, "output_bias has 10 entries; expected 5");

  // Without bias every bias must be empty.
  const auto no_bias = make_config(3, 4, 6, 5, false);
  SDMHA_EXPECT_THROW_WITH(valid.validate(no_bias), sdmha::ShapeError,
                          "query_bias has 12 entries; expected 0 (use_bias is false)");
  Weights stripped = valid;
  stripped.query_bias.resize(0);
  stripped.key_bias.resize(0);
  stripped.value_bias.resize(0);
  SDMHA_EXPECT_THROW_WITH(stripped.validate(no_bias), sdmha::ShapeError,
                          "output_bias has 5 entries; expected 0 (use_bias is false)");
  stripped.output_bias.resize(0);
  EXPECT_NO_THROW(stripped.validate(no_bias));
  SDMHA_EXPECT_THROW_WITH(valid.validate(make_config(0, 4, 6, 5)), sdmha::ConfigError,
                          "num_heads = 0");
}

}  // namespace
}  // namespace sdmha_test
