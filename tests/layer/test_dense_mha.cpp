// Tests of bench/dense_mha.hpp that concern the dense query only: its agreement with SparseDenseMHA
// on the densified query, its forms and its checks. What the dense baseline shares with the sparse
// layer (the float64 reference over every variant, masks, threads, bad keys and values) is tested
// on both in test_layer_behaviour.cpp.
#include "test_support.hpp"

#include "dense_mha.hpp"  // the bench's dense baseline (bench/), which the layers are compared with

#include <cstring>

namespace sdmha_test {
namespace {

SDMHA_SCALAR_TYPED_TEST_SUITE(DenseMhaTest);

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
    const auto dense = dense_layer.forward(dense_query, {c.key, c.value}, options);
    for (auto strategy :
         {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
      SCOPED_TRACE(sdmha::to_string(strategy));
      options.score_strategy = strategy;
      const auto sparse = sparse_layer.forward(query, {c.key, c.value}, options);
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

// The dense query may be an Eigen::TensorMap of the caller's memory or a TensorRef3 over it.
TYPED_TEST(DenseMhaTest, QueryAsTensorMapOrRawViewIsAccepted) {
  const auto c = make_case<TypeParam>(Shape{}, 1180);
  const auto expected = sdmha_reference::forward(c.problem);
  const sdmha::DenseMHA<TypeParam> layer(c.config, c.weights);
  const auto dense_query = c.dense_query();
  std::vector<TypeParam> query_memory(dense_query.data(), dense_query.data() + dense_query.size());
  const auto& s = c.shape;
  Eigen::TensorMap<const Tensor3<TypeParam>> query_map(query_memory.data(), s.batch, s.steps,
                                                       s.query_dim);
  const auto mapped = layer.forward(query_map, {c.key, c.value});
  EXPECT_TRUE(all_near(mapped.output.data(), expected.output, relative_tolerance<TypeParam>()));
  const sdmha::TensorRef3<TypeParam> raw(query_memory.data(), s.batch, s.steps, s.query_dim);
  EXPECT_TRUE(all_near(layer.forward(raw, {c.key, c.value}).output.data(), expected.output,
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
      layer.forward(wide_query, {c.key, c.value}), sdmha::ShapeError,
      "DenseMHA::forward: query has width 17; expected the query kernel's input width 16");
  SDMHA_EXPECT_THROW_WITH(layer.forward(other_batch, {c.key, c.value}), sdmha::ShapeError,
                          "key has batch 2; expected the query's batch 3");
  const sdmha::TensorRef3<TypeParam> no_data(nullptr, 2, 5, 16);
  SDMHA_EXPECT_THROW_WITH(layer.forward(no_data, {c.key, c.value}), sdmha::ShapeError,
                          "query has no data; expected 2 x 5 x 16 values");
  // Nothing to read: a null query of zero steps is fine.
  const sdmha::TensorRef3<TypeParam> no_steps(nullptr, 2, 0, 16);
  EXPECT_EQ(layer.forward(no_steps, {c.key, c.value}).output.size(), 0);
}

}  // namespace
}  // namespace sdmha_test
