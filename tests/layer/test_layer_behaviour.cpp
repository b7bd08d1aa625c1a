// What the sparse layer (sdmha/sparse_dense_mha.hpp) and the bench's dense baseline
// (bench/dense_mha.hpp) share: each test runs on SparseDenseMHA with the sparse query and on
// DenseMHA with the same query densified, in float and double, against the float64 reference.
// What only one of them does stays in test_sparse_dense_mha.cpp and test_dense_mha.cpp.
#include "test_support.hpp"

#include "dense_mha.hpp"  // the bench's dense baseline (bench/)

#include <cstring>

namespace sdmha_test {
namespace {

// A layer under test: its type and the form of a case's query it takes.
template <typename Scalar>
struct SparseLayer {
  using ScalarType = Scalar;
  using Layer = sdmha::SparseDenseMHA<Scalar>;
  static sdmha::SparseQuery<Scalar> query(const Case<Scalar>& c) { return c.query(); }
};
template <typename Scalar>
struct DenseLayer {
  using ScalarType = Scalar;
  using Layer = sdmha::DenseMHA<Scalar>;
  static Tensor3<Scalar> query(const Case<Scalar>& c) { return c.dense_query(); }
};

template <typename Kind>
class LayerBehaviour : public ::testing::Test {};
using LayerKinds = ::testing::Types<SparseLayer<float>, SparseLayer<double>, DenseLayer<float>,
                                    DenseLayer<double>>;
TYPED_TEST_SUITE(LayerBehaviour, LayerKinds, );

// The strategies a test runs each call under: the dense layer ignores the choice (a dense query
// has only the project-first form), so the same expectation must hold for every one.
constexpr sdmha::ScoreStrategy every_strategy[] = {sdmha::ScoreStrategy::project_first,
                                                   sdmha::ScoreStrategy::sparse_regrouped,
                                                   sdmha::ScoreStrategy::automatic};

template <typename Kind>
void check_layer(const Case<typename Kind::ScalarType>& c, const char* name) {
  using Scalar = typename Kind::ScalarType;
  SCOPED_TRACE(name);
  const auto expected = sdmha_reference::forward(c.problem);
  const typename Kind::Layer layer(c.config, c.weights);
  const auto query = Kind::query(c);
  auto options = c.options;
  options.return_attention_scores = true;
  for (auto strategy : every_strategy) {
    SCOPED_TRACE(sdmha::to_string(strategy));
    options.score_strategy = strategy;
    const auto result = layer.forward(query, {c.key, c.value}, options);
    const std::array<Index, 3> output_shape{c.problem.batch, c.problem.steps, c.problem.output_dim};
    const std::array<Index, 4> scores_shape{c.problem.batch, c.problem.heads, c.problem.steps,
                                            c.problem.key_steps};
    ASSERT_EQ(result.output.dimensions(), output_shape);
    ASSERT_EQ(result.attention_scores.dimensions(), scores_shape);
    EXPECT_TRUE(all_near(result.output.data(), expected.output, relative_tolerance<Scalar>()));
    EXPECT_TRUE(all_near(result.attention_scores.data(), expected.probabilities,
                         relative_tolerance<Scalar>()));
  }
}

template <typename Scalar>
bool same_bits(const Tensor3<Scalar>& a, const Tensor3<Scalar>& b) {
  return a.dimensions() == b.dimensions() &&
         std::memcmp(a.data(), b.data(), sizeof(Scalar) * std::size_t(a.size())) == 0;
}

TYPED_TEST(LayerBehaviour, MatchesReferenceOverVariants) {
  std::uint64_t seed = 100;
  for (const auto& variant : variants())
    check_layer<TypeParam>(make_case<typename TypeParam::ScalarType>(variant.shape, seed++),
                           variant.name);
}

TYPED_TEST(LayerBehaviour, MatchesReferenceOnRandomShapes) {
  std::mt19937_64 generator(7);
  for (int round = 0; round < 12; ++round) {
    Shape s = random_small_shape(generator);
    s.density = 0.15;
    s.random_mask = round % 2 == 0;
    s.causal = round % 3 == 0;
    s.empty_rows = round % 4 == 0;
    s.duplicates = round % 5 == 0;
    s.key_mask = round % 5 == 1;
    s.use_bias = round % 6 != 5;
    check_layer<TypeParam>(make_case<typename TypeParam::ScalarType>(s, 1000 + round), "random");
  }
}

TYPED_TEST(LayerBehaviour, OutputIsBitwiseTheSameForAnyThreadCount) {
  Shape s = Shape{}.sized(3, 70, 20);
  s.query_dim = 50;
  s.heads = 3;
  s.random_mask = true;
  const auto c = make_case<typename TypeParam::ScalarType>(s, 5);
  const typename TypeParam::Layer layer(c.config, c.weights);
  const auto query = TypeParam::query(c);
  for (auto strategy : every_strategy) {
    SCOPED_TRACE(sdmha::to_string(strategy));
    auto options = c.options;
    options.score_strategy = strategy;
    options.num_threads = 1;
    const auto single = layer.forward(query, {c.key, c.value}, options);
    for (int threads : {2, 3, 8}) {
      options.num_threads = threads;
      EXPECT_TRUE(same_bits(single.output, layer.forward(query, {c.key, c.value}, options).output))
          << threads << " threads";
    }
  }
}

TYPED_TEST(LayerBehaviour, FullyBlockedRowGivesTheOutputBias) {
  using Scalar = typename TypeParam::ScalarType;
  Shape s;
  s.fully_blocked_rows = true;
  const auto c = make_case<Scalar>(s, 11);
  auto options = c.options;
  Tensor3<bool> mask(s.batch, s.steps, s.key_steps);
  mask.setConstant(true);
  for (Index key_step = 0; key_step < s.key_steps; ++key_step) mask(1, 2, key_step) = false;
  options.attention_mask = mask;
  options.return_attention_scores = true;
  const typename TypeParam::Layer layer(c.config, c.weights);
  const auto result = layer.forward(TypeParam::query(c), {c.key, c.value}, options);
  for (Index o = 0; o < result.output.dimension(2); ++o)
    EXPECT_EQ(result.output(1, 2, o), c.weights.output_bias[o]);
  for (Index h = 0; h < s.heads; ++h)
    for (Index key_step = 0; key_step < s.key_steps; ++key_step)
      EXPECT_EQ(result.attention_scores(1, h, 2, key_step), Scalar(0));
}

TYPED_TEST(LayerBehaviour, NonFiniteKeyAndValueInBlockedPositionsDoNotReachTheOutput) {
  using Scalar = typename TypeParam::ScalarType;
  Shape s;
  s.random_mask = true;
  auto c = make_case<Scalar>(s, 12);
  // Block key step 3 for every query of batch 0, then poison key and value at that step.
  for (Index t = 0; t < s.steps; ++t) {
    c.mutable_mask()(0, t, 3) = false;
    c.problem.attention_mask[std::size_t((0 * s.steps + t) * s.key_steps + 3)] = 0;
  }
  const auto expected = sdmha_reference::forward(c.problem);
  for (Index e = 0; e < s.key_in_dim; ++e)
    c.key(0, 3, e) = std::numeric_limits<Scalar>::quiet_NaN();
  for (Index e = 0; e < s.value_in_dim; ++e)
    c.value(0, 3, e) =
        e % 2 ? std::numeric_limits<Scalar>::infinity() : std::numeric_limits<Scalar>::quiet_NaN();
  const typename TypeParam::Layer layer(c.config, c.weights);
  for (auto strategy : every_strategy) {
    auto options = c.options;
    options.score_strategy = strategy;
    const auto result = layer.forward(TypeParam::query(c), {c.key, c.value}, options);
    EXPECT_TRUE(all_near(result.output.data(), expected.output, relative_tolerance<Scalar>()));
  }
}

TYPED_TEST(LayerBehaviour, ExtremeLogitsStayFinite) {
  using Scalar = typename TypeParam::ScalarType;
  auto c = make_case<Scalar>(Shape{}, 13);
  c.weights.query_kernel *= Scalar(300);
  c.weights.key_kernel *= Scalar(300);
  const typename TypeParam::Layer layer(c.config, c.weights);
  auto options = c.options;
  options.return_attention_scores = true;
  const auto result = layer.forward(TypeParam::query(c), {c.key, c.value}, options);
  for (Index i = 0; i < result.output.size(); ++i)
    ASSERT_TRUE(std::isfinite(result.output.data()[i]));
  for (Index i = 0; i < result.attention_scores.size(); ++i)
    ASSERT_TRUE(std::isfinite(result.attention_scores.data()[i]));
}

TYPED_TEST(LayerBehaviour, ZeroSizeBatchStepsAndKeysGiveEmptyOrBiasOutputs) {
  using Scalar = typename TypeParam::ScalarType;
  for (auto dims : std::vector<std::array<Index, 3>>{{0, 5, 7}, {2, 0, 7}, {2, 5, 0}}) {
    Shape s = Shape{}.sized(dims[0], dims[1], dims[2]);
    const auto c = make_case<Scalar>(s, 14);
    const auto expected = sdmha_reference::forward(c.problem);
    const typename TypeParam::Layer layer(c.config, c.weights);
    auto options = c.options;
    options.return_attention_scores = true;
    const auto result = layer.forward(TypeParam::query(c), {c.key, c.value}, options);
    EXPECT_EQ(result.output.dimension(0), dims[0]);
    EXPECT_EQ(result.output.dimension(1), dims[1]);
    EXPECT_EQ(result.output.size(), Index(expected.output.size()));
    EXPECT_TRUE(all_near(result.output.data(), expected.output, relative_tolerance<Scalar>()));
  }
}

// Self-attention passes the value as the key too (there is no two-tensor overload); key and value
// may be Eigen::TensorMaps of the caller's memory, const or not.
TYPED_TEST(LayerBehaviour, ValueAsKeyAndTensorMapsAreAccepted) {
  using Scalar = typename TypeParam::ScalarType;
  Shape s;
  s.key_in_dim = s.value_in_dim;
  auto c = make_case<Scalar>(s, 15);
  c.key = c.value;
  c.problem.key = c.problem.value;
  const auto expected = sdmha_reference::forward(c.problem);
  const typename TypeParam::Layer layer(c.config, c.weights);
  const auto query = TypeParam::query(c);
  const auto self = layer.forward(query, {c.value, c.value});
  EXPECT_TRUE(all_near(self.output.data(), expected.output, relative_tolerance<Scalar>()));
  std::vector<Scalar> caller_memory(c.value.data(), c.value.data() + c.value.size());
  Eigen::TensorMap<Tensor3<Scalar>> mutable_map(caller_memory.data(), s.batch, s.key_steps,
                                                s.value_in_dim);
  Eigen::TensorMap<const Tensor3<Scalar>> const_map(caller_memory.data(), s.batch, s.key_steps,
                                                    s.value_in_dim);
  const auto mapped = layer.forward(query, {mutable_map, const_map});
  EXPECT_TRUE(all_near(mapped.output.data(), expected.output, relative_tolerance<Scalar>()));
}

TYPED_TEST(LayerBehaviour, AttentionScoresStayEmptyUnlessAsked) {
  const auto c = make_case<typename TypeParam::ScalarType>(Shape{}, 16);
  const typename TypeParam::Layer layer(c.config, c.weights);
  EXPECT_EQ(layer.forward(TypeParam::query(c), {c.key, c.value}, c.options).attention_scores.size(),
            0);
}

// ---- bad input: every check names the argument, the value and the expectation ----

TYPED_TEST(LayerBehaviour, RejectsKeysAndValuesOfTheWrongShape) {
  using Scalar = typename TypeParam::ScalarType;
  const auto c = make_case<Scalar>(Shape{}, 19);  // B = 2, S = 7, key and value width 12
  const typename TypeParam::Layer layer(c.config, c.weights);
  const auto query = TypeParam::query(c);
  Tensor3<Scalar> narrow(2, 7, 11), short_value(2, 6, 12), other_batch(3, 7, 12);
  narrow.setZero();
  short_value.setZero();
  other_batch.setZero();
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, {narrow, c.value}), sdmha::ShapeError,
                          "key has width 11; expected the kernel's input width 12");
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, {c.key, narrow}), sdmha::ShapeError,
                          "value has width 11; expected the kernel's input width 12");
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, {c.key, short_value}), sdmha::ShapeError,
                          "key has 7 steps but value has 6");
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, {other_batch, other_batch}), sdmha::ShapeError,
                          "key has batch 3; expected the query's batch 2");
}

TYPED_TEST(LayerBehaviour, RejectsMasksOfTheWrongShapeNegativeThreadsAndNoHeads) {
  using Scalar = typename TypeParam::ScalarType;
  const auto c = make_case<Scalar>(Shape{}, 20);
  const typename TypeParam::Layer layer(c.config, c.weights);
  const auto query = TypeParam::query(c);
  auto options = c.options;
  Tensor3<bool> short_mask(2, 5, 6);
  short_mask.setConstant(true);
  options.attention_mask = short_mask;
  SDMHA_EXPECT_THROW_WITH(
      layer.forward(query, {c.key, c.value}, options), sdmha::ShapeError,
      "attention_mask is (2, 5, 6); expected (B, T, S) = (2, 5, 7), (T, S) = (5, 7) "
      "or (B, H, T, S) = (2, 2, 5, 7) with B or H possibly 1");
  options = c.options;
  const KeyMask short_key_mask(1, 7);
  options.key_mask = short_key_mask;
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, {c.key, c.value}, options), sdmha::ShapeError,
                          "key_mask is (1, 7); expected (B, S) = (2, 7)");
  options.key_mask = sdmha::TensorRef<bool, 2>(nullptr, 2, 7);
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, {c.key, c.value}, options), sdmha::ShapeError,
                          "key_mask has no data; expected 2 x 7 booleans");
  options = c.options;
  options.num_threads = -1;
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, {c.key, c.value}, options), sdmha::ConfigError,
                          "num_threads = -1");
  auto config = c.config;
  config.num_heads = 0;
  SDMHA_EXPECT_THROW_WITH((typename TypeParam::Layer(config, c.weights)), sdmha::ConfigError,
                          "num_heads = 0; expected > 0");
}

}  // namespace
}  // namespace sdmha_test
