// Tests of sdmha/sparse_dense_mha.hpp that concern the sparse query: a query kernel beyond L2 on
// any thread count, the key mask, the projected context, the score strategy's cost model, and the
// checks of configuration, weights and query. What the layer shares with the dense baseline (the
// float64 reference over every variant and random shapes, masks, threads, bad keys and values) is
// tested on both in test_layer_behaviour.cpp.
#include "test_support.hpp"

namespace sdmha_test {
namespace {

SDMHA_SCALAR_TYPED_TEST_SUITE(SparseDenseMhaTest);

// Bitwise the same output for any thread count (test_layer_behaviour.cpp has the small case) with
// a query kernel beyond L2 and rows that reuse its features (the query projection
// in its own region: one CSC per 512-row block, 64-column windows), over two row blocks, the
// second partial: one thread runs each block's windows as one call, two claim whole blocks
// (RowQueue), more share a block's windows; and with more threads than items.
TYPED_TEST(SparseDenseMhaTest, WideQueryKernelOutputIsBitwiseTheSameForAnyThreadCount) {
  Shape s = Shape{}.sized(2, 300, 9).with_heads(4, 64);
  s.query_dim = 3000;
  s.density = 0.01;
  const auto c = make_case<TypeParam>(s, 23);
  const sdmha::SparseDenseMHA<TypeParam> layer(c.config, c.weights);
  const auto query = c.query();
  ASSERT_GE(query.nonzeros(), 2 * s.query_dim);  // the by-feature kernel, its CSC per block
  auto options = c.options;
  options.score_strategy = sdmha::ScoreStrategy::project_first;
  options.num_threads = 1;
  const auto single = layer.forward(query, {c.key, c.value}, options);
  // Another query of the same pattern, run on one thread before each call: the layer's cached
  // workspace keeps Q between calls, and a window the call left out would otherwise still hold
  // the previous call's values.
  const sdmha::Vector<TypeParam> negated = -c.values;
  const auto other =
      sdmha::SparseQuery<TypeParam>::from_coo(s.batch, s.steps, s.query_dim, c.indices, negated);
  for (int threads : {2, 3, 16, 64}) {
    options.num_threads = 1;
    layer.forward(other, {c.key, c.value}, options);
    options.num_threads = threads;
    const auto multi = layer.forward(query, {c.key, c.value}, options);
    ASSERT_EQ(0, std::memcmp(single.output.data(), multi.output.data(),
                             sizeof(TypeParam) * std::size_t(single.output.size())))
        << threads << " threads";
  }
}

// key_mask has attention_mask's polarity: a key step whose entry is false gets probability 0 from
// every query and head of its batch entry, one whose entry is true is attended as without a mask,
// and a batch entry whose keys are all false gives the output bias (fully masked, zeros policy).
TYPED_TEST(SparseDenseMhaTest, KeyMaskFalseKeysGetNoAttention) {
  Shape s;
  s.batch = 3;
  const auto c = make_case<TypeParam>(s, 17);
  KeyMask key_mask(s.batch, s.key_steps);
  key_mask.setConstant(true);
  key_mask(0, 2) = false;
  key_mask(0, 5) = false;
  for (long k = 0; k < s.key_steps; ++k) key_mask(2, k) = false;
  auto options = c.options;
  options.key_mask = key_mask;
  options.return_attention_scores = true;
  const sdmha::SparseDenseMHA<TypeParam> layer(c.config, c.weights);
  for (auto strategy :
       {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
    SCOPED_TRACE(sdmha::to_string(strategy));
    options.score_strategy = strategy;
    const auto result = layer.forward(c.query(), {c.key, c.value}, options);
    auto unmasked = c.options;
    unmasked.score_strategy = strategy;
    unmasked.return_attention_scores = true;
    const auto plain = layer.forward(c.query(), {c.key, c.value}, unmasked);
    for (long h = 0; h < s.heads; ++h)
      for (long t = 0; t < s.steps; ++t) {
        double row_sum = 0.0;
        for (long k = 0; k < s.key_steps; ++k) {
          SCOPED_TRACE(::testing::Message() << "h " << h << ", t " << t << ", s " << k);
          const TypeParam p = result.attention_scores(0, h, t, k);
          if (key_mask(0, k)) {
            EXPECT_GT(p, TypeParam(0));
          } else {
            EXPECT_EQ(p, TypeParam(0));
          }
          row_sum += double(p);
          // Batch entry 1 (every key allowed) is the unmasked layer's.
          EXPECT_NEAR(double(result.attention_scores(1, h, t, k)),
                      double(plain.attention_scores(1, h, t, k)), relative_tolerance<TypeParam>());
          EXPECT_EQ(result.attention_scores(2, h, t, k), TypeParam(0));
        }
        EXPECT_NEAR(row_sum, 1.0, 1e-5);
      }
    for (long t = 0; t < s.steps; ++t)
      for (long o = 0; o < result.output.dimension(2); ++o) {
        EXPECT_NEAR(
            double(result.output(1, t, o)), double(plain.output(1, t, o)),
            relative_tolerance<TypeParam>() * (1.0 + std::abs(double(plain.output(1, t, o)))));
        EXPECT_EQ(result.output(2, t, o), c.weights.output_bias[o]);
      }
  }
  // The same through the reference: key_mask false is a blocked key.
  auto p = c.problem;
  p.key_mask.assign(std::size_t(s.batch * s.key_steps), 1);
  for (Index i = 0; i < key_mask.size(); ++i) p.key_mask[std::size_t(i)] = key_mask.data()[i];
  const auto expected = sdmha_reference::forward(p);
  const auto result = layer.forward(c.query(), {c.key, c.value}, options);
  EXPECT_TRUE(all_near(result.output.data(), expected.output, relative_tolerance<TypeParam>()));
}

TYPED_TEST(SparseDenseMhaTest, ProjectedContextGivesTheSameOutputBitwise) {
  Shape s;
  s.random_mask = true;
  s.steps = 70;
  const auto c = make_case<TypeParam>(s, 21);
  const sdmha::SparseDenseMHA<TypeParam> layer(c.config, c.weights);
  const auto query = c.query();
  const auto context = layer.project_context(c.key, c.value, 2);
  EXPECT_EQ(context.batch, s.batch);
  EXPECT_EQ(context.key_steps, s.key_steps);
  for (auto strategy :
       {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
    auto options = c.options;
    options.score_strategy = strategy;
    const auto direct = layer.forward(query, {c.key, c.value}, options);
    const auto cached = layer.forward(query, context, options);
    ASSERT_EQ(0, std::memcmp(direct.output.data(), cached.output.data(),
                             sizeof(TypeParam) * std::size_t(direct.output.size())));
    // With the key and value beside it, the forward still reads the projected ones.
    const auto both = layer.forward(query, {c.key, c.value, context}, options);
    ASSERT_EQ(0, std::memcmp(direct.output.data(), both.output.data(),
                             sizeof(TypeParam) * std::size_t(direct.output.size())));
  }
}

TYPED_TEST(SparseDenseMhaTest, AContextOfProjectedKeysAndValuesOnlyServesTheForwardAlone) {
  const auto c = make_case<TypeParam>(Shape{}, 23);
  const sdmha::SparseDenseMHA<TypeParam> layer(c.config, c.weights);
  const auto query = c.query();
  const auto context = layer.project_context(c.key, c.value);
  Tensor3<TypeParam> d_output(c.shape.batch, c.shape.steps, layer.dims().output_dim);
  d_output.setConstant(TypeParam(1));
  SDMHA_EXPECT_THROW_WITH(layer.backward(query, context, d_output), sdmha::ShapeError,
                          "context holds projected keys and values only; expected {key, value} "
                          "or {key, value, projected}");
  Tensor3<TypeParam> short_key(c.shape.batch, c.shape.key_steps - 1, c.shape.key_in_dim);
  Tensor3<TypeParam> short_value(c.shape.batch, c.shape.key_steps - 1, c.shape.value_in_dim);
  short_key.setZero();
  short_value.setZero();
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, {short_key, short_value, context}),
                          sdmha::ShapeError,
                          "context's projected keys and values have 7 key steps but value has 6");
}

TYPED_TEST(SparseDenseMhaTest, RejectsAProjectedContextThatDoesNotFit) {
  const auto c = make_case<TypeParam>(Shape{}, 22);
  const sdmha::SparseDenseMHA<TypeParam> layer(c.config, c.weights);
  const auto query = c.query();
  auto context = layer.project_context(c.key, c.value);
  context.batch = 3;
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, context), sdmha::ShapeError,
                          "context has batch 3; expected the query's batch 2");
  context = layer.project_context(c.key, c.value);
  context.keys.conservativeResize(Eigen::NoChange, 7);
  SDMHA_EXPECT_THROW_WITH(
      layer.forward(query, context), sdmha::ShapeError,
      "context.keys is 14 x 7; expected batch * key_steps x num_heads * key_dim = 14 x 8");
  context = layer.project_context(c.key, c.value);
  context.values.resize(13, 8);
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, context), sdmha::ShapeError,
                          "context.values is 13 x 8");
  Tensor3<TypeParam> other_batch(3, 7, 12);
  other_batch.setZero();
  SDMHA_EXPECT_THROW_WITH(layer.project_context(c.key, other_batch), sdmha::ShapeError,
                          "value has batch 3; expected the query's batch 2");
}

// The cost model: regrouped when T is long against the distinct features a batch entry uses,
// project-first when every row touches many features of a wide query.
TYPED_TEST(SparseDenseMhaTest, AutomaticStrategyFollowsTheCostModel) {
  Shape few_features = Shape{}.sized(2, 400, 50).widths(6, 12, 12).with_heads(2, 32);
  few_features.density = 0.2;
  const auto a = make_case<TypeParam>(few_features, 23);
  const sdmha::SparseDenseMHA<TypeParam> layer_a(a.config, a.weights);
  EXPECT_EQ(layer_a.resolve_strategy(sdmha::ScoreStrategy::automatic, a.query(), 50, false),
            sdmha::ScoreStrategy::sparse_regrouped);
  Shape many_features = Shape{}.sized(2, 4, 50).widths(400, 12, 12);
  many_features.density = 0.3;
  const auto b = make_case<TypeParam>(many_features, 24);
  const sdmha::SparseDenseMHA<TypeParam> layer_b(b.config, b.weights);
  EXPECT_EQ(layer_b.resolve_strategy(sdmha::ScoreStrategy::automatic, b.query(), 50, false),
            sdmha::ScoreStrategy::project_first);
  // A forced strategy is kept whatever the cost.
  EXPECT_EQ(layer_b.resolve_strategy(sdmha::ScoreStrategy::sparse_regrouped, b.query(), 50, false),
            sdmha::ScoreStrategy::sparse_regrouped);
  // The regrouped form it chose gives the reference's output.
  const auto expected = sdmha_reference::forward(a.problem);
  const auto result = layer_a.forward(a.query(), {a.key, a.value}, a.options);
  EXPECT_TRUE(all_near(result.output.data(), expected.output, relative_tolerance<TypeParam>()));
}

// The distinct features are counted (a pass over every stored value) only where the count can
// change the choice: skipping it is right exactly when regrouped loses at every possible count.
TEST(StrategyPlanning, CountsDistinctFeaturesOnlyWhereTheyCanChangeTheChoice) {
  using sdmha::ScoreStrategy;
  sdmha::detail::AttentionPlan plan;
  plan.dims.num_heads = 8;
  plan.dims.key_dim = 64;
  plan.batch = 8;
  plan.steps = 128;
  plan.key_steps = 256;
  const Index bow_nonzeros = 8 * 128 * 328;  // `bow` at 1 %: 328 stored values a row
  EXPECT_FALSE(
      sdmha::detail::counts_distinct_features(ScoreStrategy::automatic, plan, bow_nonzeros));
  EXPECT_TRUE(
      sdmha::detail::counts_distinct_features(ScoreStrategy::sparse_regrouped, plan, bow_nonzeros));
  EXPECT_FALSE(sdmha::detail::counts_distinct_features(ScoreStrategy::project_first, plan, 1));
  // `seed` at 1 %: 5 stored values a row, 128 keys; regrouped can win if the rows share features.
  plan.batch = 32;
  plan.key_steps = 128;
  EXPECT_TRUE(
      sdmha::detail::counts_distinct_features(ScoreStrategy::automatic, plan, 32 * 128 * 5));
  for (const Index steps : {1, 16, 400})
    for (const Index key_steps : {1, 50, 64, 2048})
      for (const bool causal : {false, true})
        for (const Index per_row : {1, 3, 40, 500}) {
          plan.batch = 2;
          plan.steps = steps;
          plan.key_steps = key_steps;
          plan.causal = causal;
          const Index nonzeros = 2 * steps * per_row;
          if (sdmha::detail::counts_distinct_features(ScoreStrategy::automatic, plan, nonzeros))
            continue;
          for (const Index distinct : {Index(0), per_row, nonzeros / 2, nonzeros}) {
            plan.query.distinct_total = distinct;
            EXPECT_EQ(sdmha::detail::choose_strategy(ScoreStrategy::automatic, plan, nonzeros),
                      ScoreStrategy::project_first)
                << "T " << steps << ", S " << key_steps << ", causal " << causal << ", " << per_row
                << " a row, " << distinct << " distinct";
          }
        }
}

// ---- bad input: every check names the argument, the value and the expectation ----

TYPED_TEST(SparseDenseMhaTest, RejectsInvalidConfiguration) {
  auto c = make_case<TypeParam>(Shape{}, 17);
  auto config = c.config;
  config.num_heads = 0;
  SDMHA_EXPECT_THROW_WITH((sdmha::SparseDenseMHA<TypeParam>(config, c.weights)), sdmha::ConfigError,
                          "num_heads = 0; expected > 0");
  config = c.config;
  config.key_dim = -3;
  SDMHA_EXPECT_THROW_WITH((sdmha::SparseDenseMHA<TypeParam>(config, c.weights)), sdmha::ConfigError,
                          "key_dim = -3; expected > 0");
  config = c.config;
  config.key_dim = 3;  // weights were made for key_dim 4
  SDMHA_EXPECT_THROW_WITH((sdmha::SparseDenseMHA<TypeParam>(config, c.weights)), sdmha::ShapeError,
                          "query_kernel is 16 x 8; expected (input width > 0) x 6");
}

TYPED_TEST(SparseDenseMhaTest, RejectsWeightsThatDisagreeWithTheConfiguration) {
  const auto c = make_case<TypeParam>(Shape{}, 18);
  auto weights = c.weights;
  weights.output_kernel.resize(8, 15);
  SDMHA_EXPECT_THROW_WITH(
      (sdmha::SparseDenseMHA<TypeParam>(c.config, weights)), sdmha::ShapeError,
      "output_kernel is 8 x 15; expected num_heads * value_dim x output_dim = 8 x 16");
  weights = c.weights;
  weights.key_bias.resize(3);
  SDMHA_EXPECT_THROW_WITH((sdmha::SparseDenseMHA<TypeParam>(c.config, weights)), sdmha::ShapeError,
                          "key_bias has 3 entries; expected 8");
  auto config = c.config;
  config.use_bias = false;
  SDMHA_EXPECT_THROW_WITH((sdmha::SparseDenseMHA<TypeParam>(config, c.weights)), sdmha::ShapeError,
                          "query_bias has 8 entries; expected 0 (use_bias is false)");
}

TYPED_TEST(SparseDenseMhaTest, RejectsAQueryOfTheWrongWidth) {
  const auto c = make_case<TypeParam>(Shape{}, 19);
  const sdmha::SparseDenseMHA<TypeParam> layer(c.config, c.weights);
  const auto wide_query = sdmha::SparseQuery<TypeParam>::from_coo(2, 5, 17, c.indices, c.values);
  SDMHA_EXPECT_THROW_WITH(layer.forward(wide_query, {c.key, c.value}), sdmha::ShapeError,
                          "query has 17 features; expected the query kernel's input width 16");
}

}  // namespace
}  // namespace sdmha_test
