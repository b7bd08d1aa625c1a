// Tests of bench/dense_mha.hpp: the bench's dense baseline against the float64 reference over the
// same variants as the sparse layer, its agreement with SparseDenseMHA on the densified query, and
// its checks of the dense query.
#include "test_support.hpp"

#include "dense_mha.hpp"  // the bench's dense baseline (bench/), which the layers are compared with

#include <cstring>

namespace sdmha_test {
namespace {

template <typename Scalar>
class DenseMhaTest : public ::testing::Test {};
TYPED_TEST_SUITE(DenseMhaTest, ScalarTypes, );

template <typename Scalar>
void check_layer(const Case<Scalar>& c, const char* name) {
  SCOPED_TRACE(name);
  const auto expected = sdmha_reference::forward(c.problem);
  const sdmha::DenseMHA<Scalar> layer(c.config, c.weights);
  auto options = c.options;
  options.return_attention_scores = true;
  const auto result = layer.forward(c.dense_query(), c.key, c.value, options);
  ASSERT_EQ(result.output.dimension(0), c.problem.batch);
  ASSERT_EQ(result.output.dimension(1), c.problem.steps);
  ASSERT_EQ(result.output.dimension(2), c.problem.output_dim);
  ASSERT_EQ(result.attention_scores.dimension(0), c.problem.batch);
  ASSERT_EQ(result.attention_scores.dimension(1), c.problem.heads);
  ASSERT_EQ(result.attention_scores.dimension(2), c.problem.steps);
  ASSERT_EQ(result.attention_scores.dimension(3), c.problem.key_steps);
  EXPECT_TRUE(all_near(result.output.data(), expected.output, relative_tolerance<Scalar>()));
  EXPECT_TRUE(all_near(result.attention_scores.data(), expected.probabilities,
                       relative_tolerance<Scalar>()));
  // The score strategy is ignored: a dense query has only the project-first form.
  options.score_strategy = sdmha::ScoreStrategy::sparse_regrouped;
  const auto regrouped = layer.forward(c.dense_query(), c.key, c.value, options);
  EXPECT_TRUE(all_near(regrouped.output.data(), expected.output, relative_tolerance<Scalar>()));
}

TYPED_TEST(DenseMhaTest, MatchesReferenceOverVariants) {
  std::uint64_t seed = 1100;
  for (const auto& variant : variants())
    check_layer(make_case<TypeParam>(variant.shape, seed++), variant.name);
}

TYPED_TEST(DenseMhaTest, MatchesReferenceOnRandomShapes) {
  std::mt19937_64 generator(1110);
  for (int round = 0; round < 10; ++round) {
    Shape s = random_small_shape(generator);
    s.density = 0.15;
    s.random_mask = round % 2 == 0;
    s.causal = round % 3 == 0;
    s.empty_rows = round % 4 == 0;
    s.key_mask = round % 5 == 0;
    s.use_bias = round % 6 != 5;
    check_layer(make_case<TypeParam>(s, 1120 + round), "random");
  }
}

TYPED_TEST(DenseMhaTest, AgreesWithTheSparseLayerOnTheDensifiedQuery) {
  std::uint64_t seed = 1130;
  for (const auto& variant : variants()) {
    SCOPED_TRACE(variant.name);
    const auto c = make_case<TypeParam>(variant.shape, seed++);
    auto options = c.options;
    options.return_attention_scores = true;
    const sdmha::DenseMHA<TypeParam> dense_layer(c.config, c.weights);
    const sdmha::SparseDenseMHA<TypeParam> sparse_layer(c.config, c.weights);
    const auto query = c.query();
    // The densified query, from the sparse one: the dense layer sees the same values.
    const auto dense_rows = query.to_dense();
    const sdmha::TensorRef3<TypeParam> dense_query(dense_rows.data(), query.batch(), query.steps(),
                                                   query.features());
    const auto dense = dense_layer.forward(dense_query, c.key, c.value, options);
    for (auto strategy :
         {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
      SCOPED_TRACE(sdmha::to_string(strategy));
      options.score_strategy = strategy;
      const auto sparse = sparse_layer.forward(query, c.key, c.value, options);
      ASSERT_EQ(sparse.output.size(), dense.output.size());
      const std::vector<double> dense_output(dense.output.data(),
                                             dense.output.data() + dense.output.size());
      const std::vector<double> dense_scores(
          dense.attention_scores.data(),
          dense.attention_scores.data() + dense.attention_scores.size());
      EXPECT_TRUE(all_near(sparse.output.data(), dense_output, relative_tolerance<TypeParam>()));
      EXPECT_TRUE(
          all_near(sparse.attention_scores.data(), dense_scores, relative_tolerance<TypeParam>()));
    }
  }
}

TYPED_TEST(DenseMhaTest, OutputIsBitwiseTheSameForAnyThreadCount) {
  Shape s;
  s.batch = 3;
  s.steps = 70;
  s.key_steps = 20;
  s.query_dim = 50;
  s.heads = 3;
  s.random_mask = true;
  const auto c = make_case<TypeParam>(s, 1140);
  const sdmha::DenseMHA<TypeParam> layer(c.config, c.weights);
  const auto dense_query = c.dense_query();
  auto options = c.options;
  options.num_threads = 1;
  const auto single = layer.forward(dense_query, c.key, c.value, options);
  for (int threads : {2, 3, 8}) {
    options.num_threads = threads;
    const auto multi = layer.forward(dense_query, c.key, c.value, options);
    ASSERT_EQ(0, std::memcmp(single.output.data(), multi.output.data(),
                             sizeof(TypeParam) * std::size_t(single.output.size())))
        << threads << " threads";
  }
}

TYPED_TEST(DenseMhaTest, FullyBlockedRowGivesTheOutputBias) {
  Shape s;
  s.fully_blocked_rows = true;
  const auto c = make_case<TypeParam>(s, 1150);
  auto options = c.options;
  Tensor3<bool> mask(s.batch, s.steps, s.key_steps);
  mask.setConstant(true);
  for (long key_step = 0; key_step < s.key_steps; ++key_step) mask(1, 2, key_step) = false;
  options.attention_mask = mask;
  options.return_attention_scores = true;
  const sdmha::DenseMHA<TypeParam> layer(c.config, c.weights);
  const auto result = layer.forward(c.dense_query(), c.key, c.value, options);
  for (long o = 0; o < result.output.dimension(2); ++o)
    EXPECT_EQ(result.output(1, 2, o), c.weights.output_bias[o]);
  for (long h = 0; h < s.heads; ++h)
    for (long key_step = 0; key_step < s.key_steps; ++key_step)
      EXPECT_EQ(result.attention_scores(1, h, 2, key_step), TypeParam(0));
}

TYPED_TEST(DenseMhaTest, NonFiniteKeyAndValueInBlockedPositionsDoNotReachTheOutput) {
  Shape s;
  s.random_mask = true;
  auto c = make_case<TypeParam>(s, 1160);
  for (long t = 0; t < s.steps; ++t) {
    c.mutable_mask()(0, t, 3) = false;
    c.problem.attention_mask[(0 * s.steps + t) * s.key_steps + 3] = 0;
  }
  const auto expected = sdmha_reference::forward(c.problem);
  for (long e = 0; e < s.key_in_dim; ++e)
    c.key(0, 3, e) = std::numeric_limits<TypeParam>::quiet_NaN();
  for (long e = 0; e < s.value_in_dim; ++e)
    c.value(0, 3, e) = e % 2 ? std::numeric_limits<TypeParam>::infinity()
                             : std::numeric_limits<TypeParam>::quiet_NaN();
  const sdmha::DenseMHA<TypeParam> layer(c.config, c.weights);
  const auto result = layer.forward(c.dense_query(), c.key, c.value, c.options);
  EXPECT_TRUE(all_near(result.output.data(), expected.output, relative_tolerance<TypeParam>()));
}

TYPED_TEST(DenseMhaTest, ZeroSizeBatchStepsAndKeysGiveEmptyOrBiasOutputs) {
  for (auto dims : std::vector<std::array<long, 3>>{{0, 5, 7}, {2, 0, 7}, {2, 5, 0}}) {
    Shape s;
    s.batch = dims[0];
    s.steps = dims[1];
    s.key_steps = dims[2];
    const auto c = make_case<TypeParam>(s, 1170);
    const auto expected = sdmha_reference::forward(c.problem);
    const sdmha::DenseMHA<TypeParam> layer(c.config, c.weights);
    const auto result = layer.forward(c.dense_query(), c.key, c.value, c.options);
    EXPECT_EQ(result.output.dimension(0), dims[0]);
    EXPECT_EQ(result.output.dimension(1), dims[1]);
    EXPECT_EQ(result.output.size(), Index(expected.output.size()));
    EXPECT_TRUE(all_near(result.output.data(), expected.output, relative_tolerance<TypeParam>()));
  }
}

// Self-attention passes the value as the key too (there is no two-tensor overload).
TYPED_TEST(DenseMhaTest, ValueAsKeyAndTensorMapsAreAccepted) {
  Shape s;
  s.key_in_dim = s.value_in_dim;
  auto c = make_case<TypeParam>(s, 1180);
  c.key = c.value;
  c.problem.key = c.problem.value;
  const auto expected = sdmha_reference::forward(c.problem);
  const sdmha::DenseMHA<TypeParam> layer(c.config, c.weights);
  const auto dense_query = c.dense_query();
  const auto self = layer.forward(dense_query, c.value, c.value);
  EXPECT_TRUE(all_near(self.output.data(), expected.output, relative_tolerance<TypeParam>()));
  std::vector<TypeParam> query_memory(dense_query.data(), dense_query.data() + dense_query.size());
  Eigen::TensorMap<const Tensor3<TypeParam>> query_map(query_memory.data(), s.batch, s.steps,
                                                       s.query_dim);
  std::vector<TypeParam> value_memory(c.value.data(), c.value.data() + c.value.size());
  Eigen::TensorMap<Tensor3<TypeParam>> value_map(value_memory.data(), s.batch, s.key_steps,
                                                 s.value_in_dim);
  const auto mapped = layer.forward(query_map, value_map, value_map);
  EXPECT_TRUE(all_near(mapped.output.data(), expected.output, relative_tolerance<TypeParam>()));
  const sdmha::TensorRef3<TypeParam> raw(query_memory.data(), s.batch, s.steps, s.query_dim);
  EXPECT_TRUE(all_near(layer.forward(raw, c.value, c.value).output.data(), expected.output,
                       relative_tolerance<TypeParam>()));
}

// ---- bad input ----

TYPED_TEST(DenseMhaTest, RejectsADenseQueryOfTheWrongShape) {
  const auto c = make_case<TypeParam>(Shape{}, 1190);  // B = 2, T = 5, Eq = 16
  const sdmha::DenseMHA<TypeParam> layer(c.config, c.weights);
  Tensor3<TypeParam> wide_query(2, 5, 17), other_batch(3, 5, 16);
  wide_query.setZero();
  other_batch.setZero();
  SDMHA_EXPECT_THROW_WITH(
      layer.forward(wide_query, c.key, c.value), sdmha::ShapeError,
      "DenseMHA::forward: query has width 17; expected the query kernel's input width 16");
  SDMHA_EXPECT_THROW_WITH(layer.forward(other_batch, c.key, c.value), sdmha::ShapeError,
                          "key has batch 2; expected the query's batch 3");
  const sdmha::TensorRef3<TypeParam> no_data(nullptr, 2, 5, 16);
  SDMHA_EXPECT_THROW_WITH(layer.forward(no_data, c.key, c.value), sdmha::ShapeError,
                          "query has no data; expected 2 x 5 x 16 values");
  // Nothing to read: a null query of zero steps is fine.
  const sdmha::TensorRef3<TypeParam> no_steps(nullptr, 2, 0, 16);
  EXPECT_EQ(layer.forward(no_steps, c.key, c.value).output.size(), 0);
}

TYPED_TEST(DenseMhaTest, RejectsKeysValuesAndMasksOfTheWrongShape) {
  const auto c = make_case<TypeParam>(Shape{}, 1200);
  const sdmha::DenseMHA<TypeParam> layer(c.config, c.weights);
  const auto query = c.dense_query();
  Tensor3<TypeParam> narrow_value(2, 7, 11), short_value(2, 6, 12);
  narrow_value.setZero();
  short_value.setZero();
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, c.key, narrow_value), sdmha::ShapeError,
                          "value has width 11; expected the kernel's input width 12");
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, c.key, short_value), sdmha::ShapeError,
                          "key has 7 steps but value has 6");
  auto options = c.options;
  Tensor3<bool> short_mask(2, 4, 7);
  short_mask.setConstant(true);
  options.attention_mask = short_mask;
  SDMHA_EXPECT_THROW_WITH(
      layer.forward(query, c.key, c.value, options), sdmha::ShapeError,
      "attention_mask is (2, 4, 7); expected (B, T, S) = (2, 5, 7), (T, S) = (5, 7) "
      "or (B, H, T, S) = (2, 2, 5, 7) with B or H possibly 1");
  options = c.options;
  options.num_threads = -2;
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, c.key, c.value, options), sdmha::ConfigError,
                          "num_threads = -2");
  auto config = c.config;
  config.num_heads = 0;
  SDMHA_EXPECT_THROW_WITH((sdmha::DenseMHA<TypeParam>(config, c.weights)), sdmha::ConfigError,
                          "num_heads = 0; expected > 0");
}

}  // namespace
}  // namespace sdmha_test
