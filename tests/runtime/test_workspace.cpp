// Tests of sdmha/workspace.hpp: forward with a Workspace and a reused AttentionResult gives
// bitwise the results of the plain forward, through shape changes in both directions, for both
// layers and every strategy; a workspace serves one call at a time. (That the steady state does
// not allocate is tested in tests/allocation/, which counts the heap.)
#include "test_support.hpp"

#include "dense_mha.hpp"  // the bench's dense baseline (bench/), which the layers are compared with

#include <cstring>

namespace sdmha_test {
namespace {

SDMHA_SCALAR_TYPED_TEST_SUITE(WorkspaceTest);

template <typename Scalar>
bool bitwise_equal(const Scalar* a, const Scalar* b, Index count) {
  return count == 0 || std::memcmp(a, b, sizeof(Scalar) * std::size_t(count)) == 0;
}

template <typename Scalar, typename Tensor>
void expect_same_tensor(const Tensor& actual, const Tensor& expected) {
  ASSERT_EQ(actual.dimensions(), expected.dimensions());
  EXPECT_TRUE(bitwise_equal<Scalar>(actual.data(), expected.data(), expected.size()));
}

// The same layer widths with different (B, T, S): larger, smaller, larger again.
Shape sized(long batch, long steps, long key_steps, bool masks) {
  Shape s = Shape{}.sized(batch, steps, key_steps).widths(40, 12, 9).with_heads(3, 5, 4, 7);
  s.density = 0.1;
  return s.with_masks(masks);
}

TYPED_TEST(WorkspaceTest, ReusedWorkspaceGivesThePlainForwardsBitsThroughShapeChanges) {
  using Scalar = TypeParam;
  sdmha::Workspace<Scalar> workspace;
  sdmha::AttentionResult<Scalar> result;
  const Shape shapes[] = {sized(3, 70, 90, true), sized(1, 5, 3, false), sized(2, 130, 20, true),
                          sized(3, 70, 90, false)};
  std::uint64_t seed = 40;
  for (const auto& shape : shapes) {
    const auto c = make_case<Scalar>(shape, seed++);
    const sdmha::SparseDenseMHA<Scalar> layer(c.config, c.weights);
    const auto query = c.query();
    for (auto strategy : {sdmha::ScoreStrategy::project_first,
                          sdmha::ScoreStrategy::sparse_regrouped, sdmha::ScoreStrategy::automatic})
      for (bool scores : {false, true})
        for (int threads : {1, 3}) {
          SCOPED_TRACE(testing::Message()
                       << "T=" << shape.steps << " " << sdmha::to_string(strategy)
                       << " scores=" << scores << " threads=" << threads);
          auto options = c.options;
          options.score_strategy = strategy;
          options.return_attention_scores = scores;
          options.num_threads = threads;
          options.training = scores;  // dropout (with its copy of the probabilities) on some calls
          options.dropout_rate = 0.25;
          options.dropout_seed = 9;
          const auto expected = layer.forward(query, {c.key, c.value}, options);
          layer.forward(query, {c.key, c.value}, options, workspace, result);
          expect_same_tensor<Scalar>(result.output, expected.output);
          expect_same_tensor<Scalar>(result.attention_scores, expected.attention_scores);
          // And against the reference, so that a shared bug in both paths is caught too.
          if (!scores) {
            const auto reference = sdmha_reference::forward(c.problem);
            EXPECT_TRUE(
                all_near(result.output.data(), reference.output, relative_tolerance<Scalar>()));
          }
        }
    // The projected-context form through the same workspace.
    const auto context = layer.project_context(c.key, c.value);
    const auto expected = layer.forward(query, context, c.options);
    layer.forward(query, context, c.options, workspace, result);
    expect_same_tensor<Scalar>(result.output, expected.output);
  }
  EXPECT_GT(workspace.bytes(), 0u);
  EXPECT_GE(workspace.threads(), 2);  // threads = 3: the caller and two kept workers
}

TYPED_TEST(WorkspaceTest, DenseBaselineReusesAWorkspaceToo) {
  using Scalar = TypeParam;
  sdmha::Workspace<Scalar> workspace;
  sdmha::AttentionResult<Scalar> result;
  std::uint64_t seed = 60;
  for (const Shape& shape : {sized(2, 66, 40, true), sized(1, 3, 2, false)}) {
    const auto c = make_case<Scalar>(shape, seed++);
    const sdmha::DenseMHA<Scalar> layer(c.config, c.weights);
    const auto dense = c.query().to_dense();
    const sdmha::TensorRef3<Scalar> dense_query(dense.data(), shape.batch, shape.steps,
                                                shape.query_dim);
    auto options = c.options;
    options.num_threads = 2;
    const auto expected = layer.forward(dense_query, {c.key, c.value}, options);
    layer.forward(dense_query, {c.key, c.value}, options, workspace, result);
    expect_same_tensor<Scalar>(result.output, expected.output);
    const auto reference = sdmha_reference::forward(c.problem);
    EXPECT_TRUE(all_near(result.output.data(), reference.output, relative_tolerance<Scalar>()));
  }
}

// The calls given no Workspace borrow one the layer keeps: a second plain forward gives the first's
// bits (and a caller's Workspace's), the layer holds that memory until
// release_workspace_cache(), project_context borrows it too, and a copy of the layer starts
// with none.
TYPED_TEST(WorkspaceTest, PlainCallsReuseTheLayersCachedWorkspace) {
  using Scalar = TypeParam;
  const auto c = make_case<Scalar>(sized(2, 70, 90, true), 71);
  const sdmha::SparseDenseMHA<Scalar> layer(c.config, c.weights);
  const auto query = c.query();
  auto options = c.options;
  options.num_threads = 2;
  EXPECT_EQ(layer.workspace_cache_bytes(), 0u);
  const auto first = layer.forward(query, {c.key, c.value}, options);
  const std::size_t kept = layer.workspace_cache_bytes();
  EXPECT_GT(kept, 0u);
  const auto second = layer.forward(query, {c.key, c.value}, options);
  expect_same_tensor<Scalar>(second.output, first.output);
  EXPECT_EQ(layer.workspace_cache_bytes(), kept);  // the same workspace again, not a second one
  sdmha::Workspace<Scalar> workspace;
  sdmha::AttentionResult<Scalar> result;
  layer.forward(query, {c.key, c.value}, options, workspace, result);
  expect_same_tensor<Scalar>(result.output, first.output);
  const auto context = layer.project_context(c.key, c.value, 2);
  expect_same_tensor<Scalar>(layer.forward(query, context, options).output, first.output);
  const sdmha::SparseDenseMHA<Scalar> copy = layer;
  EXPECT_EQ(copy.workspace_cache_bytes(), 0u);
  layer.release_workspace_cache();
  EXPECT_EQ(layer.workspace_cache_bytes(), 0u);
  expect_same_tensor<Scalar>(layer.forward(query, {c.key, c.value}, options).output, first.output);
  const auto reference = sdmha_reference::forward(c.problem);
  EXPECT_TRUE(all_near(first.output.data(), reference.output, relative_tolerance<Scalar>()));
}

TYPED_TEST(WorkspaceTest, AWorkspaceInUseIsRefusedWithConfigError) {
  using Scalar = TypeParam;
  const auto c = make_case<Scalar>(Shape{}, 3);
  const sdmha::SparseDenseMHA<Scalar> layer(c.config, c.weights);
  sdmha::Workspace<Scalar> workspace;
  sdmha::AttentionResult<Scalar> result;
  {
    // What a second thread meets while a call holds the workspace.
    const typename sdmha::Workspace<Scalar>::Lease held(workspace, "another call");
    SDMHA_EXPECT_THROW_WITH(
        layer.forward(c.query(), {c.key, c.value}, c.options, workspace, result),
        sdmha::ConfigError, "workspace is in use by another call");
  }
  layer.forward(c.query(), {c.key, c.value}, c.options, workspace, result);  // free again
  EXPECT_EQ(result.output.dimension(0), c.problem.batch);

  sdmha::Workspace<Scalar> moved_to(std::move(workspace));
  SDMHA_EXPECT_THROW_WITH(layer.forward(c.query(), {c.key, c.value}, c.options, workspace, result),
                          sdmha::ConfigError, "workspace was moved from");
  layer.forward(c.query(), {c.key, c.value}, c.options, moved_to, result);
}

TYPED_TEST(WorkspaceTest, BadInputIsRefusedBeforeTheWorkspaceIsTouched) {
  using Scalar = TypeParam;
  const auto c = make_case<Scalar>(Shape{}, 4);
  const sdmha::SparseDenseMHA<Scalar> layer(c.config, c.weights);
  sdmha::Workspace<Scalar> workspace;
  sdmha::AttentionResult<Scalar> result;
  auto options = c.options;
  options.num_threads = -1;
  SDMHA_EXPECT_THROW_WITH(layer.forward(c.query(), {c.key, c.value}, options, workspace, result),
                          sdmha::ConfigError, "num_threads = -1");
  EXPECT_EQ(workspace.bytes(), 0u);
  EXPECT_EQ(result.output.size(), 0);
}

// The persistent pool: exceptions from an item reach the caller, and the pool serves later calls.
TEST(ThreadPoolTest, RethrowsAnItemsExceptionAndStaysUsable) {
  sdmha::detail::ThreadPool pool;
  std::vector<int> hits(100, 0);
  EXPECT_THROW(sdmha::detail::parallel_for(
                   100, 4,
                   [&](Index item, int) {
                     if (item == 37) throw std::runtime_error("item 37");
                   },
                   &pool),
               std::runtime_error);
  EXPECT_EQ(pool.started_threads(), 3);
  for (int round = 0; round < 50; ++round)
    sdmha::detail::parallel_for(
        100, 4,
        [&](Index item, int worker) {
          EXPECT_GE(worker, 0);
          EXPECT_LT(worker, 4);
          ++hits[std::size_t(item)];
        },
        &pool);
  for (int count : hits) EXPECT_EQ(count, 50);
  // Fewer workers than threads started: the spare threads sit the call out.
  std::atomic<int> done{0};
  sdmha::detail::parallel_for(
      10, 2,
      [&](Index, int worker) {
        EXPECT_LT(worker, 2);
        ++done;
      },
      &pool);
  EXPECT_EQ(done.load(), 10);
}

}  // namespace
}  // namespace sdmha_test
