// The steady state of forward allocates nothing: with a Workspace and an
// AttentionResult kept between calls, a repeated call with the same shapes performs no heap
// allocation at all — no buffer, no thread, no Eigen GEMM packing block. The same for backward
// with a Workspace and an MhaGradients kept.
//
// Its own executable because it counts every heap block of the process: operator new is
// replaced and malloc & co. are wrapped by the linker (tests/support/allocation_counter.hpp, which
// the bench shares), which the rest of the suite should not run under.
#include "allocation_counter.hpp"
#include "test_support.hpp"

#include "dense_mha.hpp"  // the bench's dense baseline (bench/), which the layers are compared with

#include "internal_access.hpp"
#include "same_bits.hpp"

#include <limits>

#include <sdmha/sparse_dense_mha.hpp>

namespace sdmha_test {
namespace {

using sdmha_bench::AllocationCounter;

// Heap blocks taken during `call` (each allocation counts; frees do not cancel them).
template <typename Call>
std::int64_t allocations_during(Call&& call) {
  const std::int64_t before = AllocationCounter::allocations();
  call();
  return AllocationCounter::allocations() - before;
}

TEST(SteadyState, CountingSeesTheHeap) {
  ASSERT_TRUE(AllocationCounter::counts_malloc())
      << "malloc is not wrapped: nothing would be counted";
  EXPECT_GE(allocations_during([] {
              sdmha::RowMatrix<float> m(100, 100);
              m.setZero();
            }),
            1);
  EXPECT_GE(allocations_during([] {
              std::vector<int> v(10);
              v[0] = 1;
            }),
            1);
  // And a plain forward does allocate (its workspace, result and threads): the counter would see
  // it.
  const auto c = make_case<float>(Shape{}, 1);
  const sdmha::SparseDenseMHA<float> layer(c.config, c.weights);
  const auto query = c.query();
  EXPECT_GE(allocations_during([&] { layer.forward(query, {c.key, c.value}, c.options); }), 3);
}

// Many work items of every kind (B·H·tiles, row blocks) so that, after the warm-up calls, every
// worker thread has run every kind of GEMM at its largest size and holds its packing blocks.
Shape steady_shape(bool masks) {
  // Widths large enough that Eigen's packing blocks for the projections pass its 128 KB stack
  // limit (a plain Eigen product would allocate them on the heap on every call).
  Shape s = Shape{}.sized(3, 150, 140).widths(300, 320, 288).with_heads(4, 32, 24, 200);
  s.density = 0.03;
  return s.with_masks(masks);
}

template <typename Layer, typename Query, typename Scalar>
void expect_no_allocation_after_warm_up(const Layer& layer, const Query& query,
                                        const Case<Scalar>& c,
                                        const sdmha::AttentionOptions<Scalar>& options) {
  sdmha::Workspace<Scalar> workspace;
  sdmha::AttentionResult<Scalar> result;
  for (int warm_up = 0; warm_up < 3; ++warm_up)
    layer.forward(query, {c.key, c.value}, options, workspace, result);
  const auto first = result.output;
  const std::int64_t allocations = allocations_during([&] {
    for (int call = 0; call < 5; ++call)
      layer.forward(query, {c.key, c.value}, options, workspace, result);
  });
  EXPECT_EQ(allocations, 0);
  // Still the same answer.
  ASSERT_EQ(first.size(), result.output.size());
  for (Index i = 0; i < first.size(); ++i) ASSERT_EQ(first.data()[i], result.output.data()[i]);
}

// The plain forward (no Workspace given) borrows the layer's cached workspace: once warm it
// allocates only the result it returns (its output tensor; the scores are not asked for).
TEST(SteadyState, PlainForwardAllocatesOnlyItsResultOnceWarm) {
  const auto c = make_case<float>(steady_shape(true), 5);
  const sdmha::SparseDenseMHA<float> layer(c.config, c.weights);
  const auto query = c.query();
  auto options = c.options;
  options.num_threads = 2;
  for (int warm_up = 0; warm_up < 3; ++warm_up) layer.forward(query, {c.key, c.value}, options);
  const std::int64_t allocations = allocations_during([&] {
    for (int call = 0; call < 5; ++call) layer.forward(query, {c.key, c.value}, options);
  });
  EXPECT_EQ(allocations, 5);
}

TEST(SteadyState, SparseForwardAllocatesNothingOnceWarm) {
  for (bool masks : {false, true}) {
    const auto c = make_case<float>(steady_shape(masks), 11);
    const sdmha::SparseDenseMHA<float> layer(c.config, c.weights);
    const auto query = c.query();
    for (auto strategy : {sdmha::ScoreStrategy::project_first,
                          sdmha::ScoreStrategy::sparse_regrouped, sdmha::ScoreStrategy::automatic})
      for (int threads : {1, 2}) {
        SCOPED_TRACE(testing::Message() << "masks=" << masks << " " << sdmha::to_string(strategy)
                                        << " threads=" << threads);
        auto options = c.options;
        options.score_strategy = strategy;
        options.num_threads = threads;
        expect_no_allocation_after_warm_up(layer, query, c, options);
        options.return_attention_scores = true;
        options.training = true;
        options.dropout_rate = 0.1;
        expect_no_allocation_after_warm_up(layer, query, c, options);
      }
  }
}

// K and V streamed in chunks (the budget lowered to 0, chunks of one key tile, S of two and a
// bit key tiles) and every kernel in bfloat16 (set_precision: the bfloat16 GEMM packs in the
// workers' scratch too): still nothing once warm.
TEST(SteadyState, StreamedContextAndBFloat16KernelsAllocateNothingOnceWarm) {
  Shape s = steady_shape(true);
  s.key_steps = 2 * sdmha::detail::kKeyTile + 37;
  const auto c = make_case<float>(s, 13);
  sdmha::SparseDenseMHA<float> layer(c.config, c.weights);
  sdmha::detail::ContextStreaming streaming;
  streaming.budget_bytes = 0;
  streaming.chunk_bytes = std::size_t(s.heads * (s.key_dim + s.value_dim)) * sizeof(float) *
                          std::size_t(sdmha::detail::kKeyTile);
  sdmha_test::ContextStreamingHook::set(layer, streaming);
  layer.set_precision(sdmha::Precision::bfloat16);
  const auto query = c.query();
  for (int threads : {1, 2}) {
    SCOPED_TRACE(testing::Message() << "threads=" << threads);
    auto options = c.options;
    options.num_threads = threads;
    expect_no_allocation_after_warm_up(layer, query, c, options);
  }
}

TEST(SteadyState, SparseForwardOnAProjectedContextAllocatesNothingOnceWarm) {
  const auto c = make_case<double>(steady_shape(true), 12);
  const sdmha::SparseDenseMHA<double> layer(c.config, c.weights);
  const auto query = c.query();
  const auto context = layer.project_context(c.key, c.value);
  auto options = c.options;
  options.num_threads = 2;
  sdmha::Workspace<double> workspace;
  sdmha::AttentionResult<double> result;
  for (int warm_up = 0; warm_up < 3; ++warm_up)
    layer.forward(query, context, options, workspace, result);
  EXPECT_EQ(allocations_during([&] { layer.forward(query, context, options, workspace, result); }),
            0);
}

TEST(SteadyState, DenseBaselineAllocatesNothingOnceWarm) {
  const auto c = make_case<float>(steady_shape(false), 13);
  const sdmha::DenseMHA<float> layer(c.config, c.weights);
  const auto dense = c.query().to_dense();
  const sdmha::TensorRef3<float> query(dense.data(), c.shape.batch, c.shape.steps,
                                       c.shape.query_dim);
  auto options = c.options;
  options.num_threads = 2;
  expect_no_allocation_after_warm_up(layer, query, c, options);
}

// After three warm-up calls of `call` (a backward into `gradients`), three more allocate nothing
// and give the same gradients, bit for bit.
template <typename Call>
void expect_steady_backward(Call& call, const sdmha::MhaGradients<float>& gradients) {
  for (int warm_up = 0; warm_up < 3; ++warm_up) call();
  const auto first = gradients;
  EXPECT_EQ(allocations_during([&] {
              for (int repeat = 0; repeat < 3; ++repeat) call();
            }),
            0);
  EXPECT_TRUE(same_gradients(first, gradients));
}

TEST(SteadyState, BackwardAllocatesNothingOnceWarm) {
  for (bool masks : {false, true}) {
    Shape shape = steady_shape(masks);
    shape.duplicates = masks;  // query_values then maps from_coo's entries onto the stored values
    auto c = make_case<float>(shape, 14);
    if (masks) {
      // A NaN in a padded key row: the key kernel's gradient takes its gathering path.
      for (Index s = 0; s < shape.key_steps; ++s)
        if (!c.key_mask()(0, s)) {
          c.key(0, s, 0) = std::numeric_limits<float>::quiet_NaN();
          break;
        }
    }
    const sdmha::SparseDenseMHA<float> layer(c.config, c.weights);
    const auto query = c.query();
    const auto context = layer.project_context(c.key, c.value);
    Tensor3<float> d_output(shape.batch, shape.steps, c.problem.output_dim);
    d_output.setConstant(0.25f);
    for (auto strategy : {sdmha::ScoreStrategy::project_first,
                          sdmha::ScoreStrategy::sparse_regrouped, sdmha::ScoreStrategy::automatic})
      for (int threads : {1, 2})
        for (bool with_context : {false, true}) {
          SCOPED_TRACE(testing::Message() << "masks=" << masks << " " << sdmha::to_string(strategy)
                                          << " threads=" << threads << " context=" << with_context);
          auto options = c.options;
          options.score_strategy = strategy;
          options.num_threads = threads;
          options.training = masks;
          options.dropout_rate = masks ? 0.1 : 0.0;
          sdmha::Workspace<float> workspace;
          sdmha::MhaGradients<float> gradients;
          auto call = [&] {
            if (with_context)
              layer.backward(query, {c.key, c.value, context}, d_output, options, workspace,
                             gradients);
            else
              layer.backward(query, {c.key, c.value}, d_output, options, workspace, gradients);
          };
          expect_steady_backward(call, gradients);
          EXPECT_TRUE(gradients.key_kernel.allFinite());
        }
  }
}

// A query kernel beyond L2 (4096 × 160 floats, 2.6 MB), each feature used about 3 times (12 rows
// at density 0.25): the query's gradients go by feature over
// a CSC of the query kept per calling thread; once built, a repeated call allocates nothing.
TEST(SteadyState, BackwardByFeatureAllocatesNothingOnceWarm) {
  Shape shape = Shape{}.sized(2, 6, 5).with_heads(2, 80);
  shape.query_dim = 4096;
  shape.density = 0.25;
  shape.duplicates = true;
  const auto c = make_case<float>(shape, 16);
  const sdmha::SparseDenseMHA<float> layer(c.config, c.weights);
  const auto query = c.query();
  ASSERT_TRUE(sdmha::detail::query_gradients_by_feature(query.csr(), shape.heads * shape.key_dim));
  Tensor3<float> d_output(shape.batch, shape.steps, c.problem.output_dim);
  d_output.setConstant(0.5f);
  for (int threads : {1, 2}) {
    SCOPED_TRACE(testing::Message() << "threads=" << threads);
    auto options = c.options;
    options.num_threads = threads;
    sdmha::Workspace<float> workspace;
    sdmha::MhaGradients<float> gradients;
    auto call = [&] {
      layer.backward(query, {c.key, c.value}, d_output, options, workspace, gradients);
    };
    expect_steady_backward(call, gradients);
  }
}

// A training loop whose padding changes from step to step: with a NaN in a padded key row, the
// key kernel's gradient gathers the rows that have a gradient, and their number changes with the
// padding. Its scratch is sized for all rows, so alternating two paddings allocates nothing.
TEST(SteadyState, BackwardWithAChangingPaddingAllocatesNothingOnceWarm) {
  Shape shape = steady_shape(false);
  shape.key_mask = true;
  auto c = make_case<float>(shape, 15);
  for (Index b = 0; b < shape.batch; ++b) c.key(b, 0, 0) = std::numeric_limits<float>::quiet_NaN();
  // The two key masks (true = may attend) the loop alternates: the first 1 or 7 key steps padded.
  KeyMask key_masks[2] = {KeyMask(shape.batch, shape.key_steps),
                          KeyMask(shape.batch, shape.key_steps)};
  auto padding = [&](Index padded_steps, int threads) {
    KeyMask& key_mask = key_masks[padded_steps == 1 ? 0 : 1];
    key_mask.setConstant(true);
    for (Index b = 0; b < shape.batch; ++b)
      for (Index s = 0; s < padded_steps; ++s) key_mask(b, s) = false;
    auto options = c.options;
    options.num_threads = threads;
    options.key_mask = key_mask;
    return options;
  };
  const sdmha::SparseDenseMHA<float> layer(c.config, c.weights);
  const auto query = c.query();
  Tensor3<float> d_output(shape.batch, shape.steps, c.problem.output_dim);
  d_output.setConstant(0.25f);
  for (int threads : {1, 2}) {
    SCOPED_TRACE(testing::Message() << "threads=" << threads);
    const sdmha::AttentionOptions<float> paddings[] = {padding(1, threads), padding(7, threads)};
    sdmha::Workspace<float> workspace;
    sdmha::MhaGradients<float> gradients;
    auto step = [&](const sdmha::AttentionOptions<float>& options) {
      layer.backward(query, {c.key, c.value}, d_output, options, workspace, gradients);
    };
    for (int warm_up = 0; warm_up < 2; ++warm_up)
      for (const auto& options : paddings) step(options);
    EXPECT_EQ(allocations_during([&] {
                for (int repeat = 0; repeat < 3; ++repeat)
                  for (const auto& options : paddings) step(options);
              }),
              0);
    EXPECT_TRUE(gradients.key_kernel.allFinite());
  }
}

}  // namespace
}  // namespace sdmha_test
