// Context streaming (detail/attention_core.hpp, attend_streamed): a forward given key and value
// that runs the online softmax and whose K and V exceed the layer's budget projects them per
// batch entry in chunks of whole key tiles instead of whole. The budget and chunk size are
// lowered here through ContextStreamingHook (support/internal_access.hpp) so that small problems
// stream in several chunks and a ragged tail. Streamed results must be bitwise those of the
// unstreamed path (same key tiles, same order of updates per row), for both layers, every kind of
// mask, a bias, dropout and any thread count; and they agree with the float64 reference.
#include <cstring>
#include <limits>

#include "internal_access.hpp"
#include "test_support.hpp"

#include "dense_mha.hpp"  // the bench's dense baseline (bench/), which the layers are compared with

namespace {

using namespace sdmha_test;
using sdmha::detail::ContextStreaming;
using sdmha::detail::kForwardQueryTile;
using sdmha::detail::kKeyTile;
using sdmha_test::ContextStreamingHook;

template <typename T>
using Tensor2 = Eigen::Tensor<T, 2, Eigen::RowMajor>;
template <typename T>
using Tensor4 = Eigen::Tensor<T, 4, Eigen::RowMajor>;

SDMHA_SCALAR_TYPED_TEST_SUITE(ContextStreamingTest);

// Three whole key tiles and a ragged tail; two query tiles per (b, h) under a causal mask (one
// otherwise) at the default `steps`; past kForwardQueryTile, several either way.
Shape streamed_shape(Index steps = 70) {
  Shape s = Shape{}.sized(2, steps, 3 * kKeyTile + 37).widths(24, 10, 9).with_heads(2, 4, 3);
  s.density = 0.2;
  return s;
}

// Bytes of K and V projected whole: B·S·(H·Dk + H·Dv) scalars.
template <typename Scalar>
std::size_t context_bytes(const Shape& s) {
  const long value_dim = s.value_dim == 0 ? s.key_dim : s.value_dim;
  return std::size_t(s.batch * s.key_steps * s.heads * (s.key_dim + value_dim)) * sizeof(Scalar);
}

// Streaming sizes with chunks of `tiles` key tiles for this shape (budget 0: always streamed).
template <typename Scalar>
ContextStreaming chunks_of(const Shape& s, long tiles) {
  ContextStreaming streaming;
  streaming.budget_bytes = 0;
  streaming.chunk_bytes =
      context_bytes<Scalar>(s) / std::size_t(s.batch * s.key_steps) * std::size_t(tiles * kKeyTile);
  return streaming;
}

// Equal bit for bit (NaN included), reporting the first entry that differs.
template <typename Scalar>
::testing::AssertionResult bitwise_equal(const Tensor3<Scalar>& got,
                                         const Tensor3<Scalar>& expected) {
  if (got.dimensions() != expected.dimensions())
    return ::testing::AssertionFailure() << "shapes differ";
  for (Index i = 0; i < got.size(); ++i)
    if (std::memcmp(got.data() + i, expected.data() + i, sizeof(Scalar)) != 0)
      return ::testing::AssertionFailure() << "entry " << i << ": " << double(got.data()[i])
                                           << " against " << double(expected.data()[i]);
  return ::testing::AssertionSuccess();
}

// The options of one variant: masks of several broadcast shapes, a bias, causal alignments and
// dropout, over make_case's own (B, T, S) mask and key padding when the shape has them. The
// tensors the views point at live in `owned`.
template <typename Scalar>
struct VariantOptions {
  Tensor2<bool> mask_t_s;
  Tensor4<bool> mask_1_h_t_s;
  Tensor4<Scalar> bias;
};

template <typename Scalar>
void apply_variant(int variant, const Shape& s, sdmha::AttentionOptions<Scalar>& options,
                   VariantOptions<Scalar>& owned, std::mt19937_64& generator) {
  std::bernoulli_distribution blocked(0.3), minus_infinity(0.05);
  std::uniform_real_distribution<double> value(-2.0, 2.0);
  if (variant == 1) {  // causal, bottom-right: the last rows see (almost) every key
    options.use_causal_mask = true;
    options.causal_alignment = sdmha::CausalAlignment::bottom_right;
  }
  if (variant == 2) {  // a (T, S) mask
    owned.mask_t_s.resize(s.steps, s.key_steps);
    for (Index i = 0; i < owned.mask_t_s.size(); ++i)
      owned.mask_t_s.data()[i] = !blocked(generator);
    options.attention_mask = owned.mask_t_s;
  }
  if (variant == 3) {  // a (1, H, T, S) mask with causal top-left
    owned.mask_1_h_t_s.resize(1, s.heads, s.steps, s.key_steps);
    for (Index i = 0; i < owned.mask_1_h_t_s.size(); ++i)
      owned.mask_1_h_t_s.data()[i] = !blocked(generator);
    options.attention_mask = owned.mask_1_h_t_s;
    options.use_causal_mask = true;
  }
  if (variant == 4 || variant == 5) {  // a (B, H, T, S) bias, some of it −∞
    owned.bias.resize(s.batch, s.heads, s.steps, s.key_steps);
    for (Index i = 0; i < owned.bias.size(); ++i)
      owned.bias.data()[i] = minus_infinity(generator) ? -std::numeric_limits<Scalar>::infinity()
                                                       : Scalar(value(generator));
    options.attention_bias = owned.bias;
  }
  if (variant == 5) {  // dropout in training, with the bias
    options.training = true;
    options.dropout_rate = 0.3;
    options.dropout_seed = 17;
  }
}

constexpr int kVariants = 6;

// Every variant, 1 and 2 threads, chunks of 1 and 2 key tiles, one query tile or several (each
// carrying its rows' online-softmax state from chunk to chunk): the sparse layer streamed equals
// the sparse layer unstreamed, bit for bit.
TYPED_TEST(ContextStreamingTest, SparseLayerStreamedEqualsUnstreamedBitwise) {
  using Scalar = TypeParam;
  for (Index steps : {Index(70), kForwardQueryTile + 44})
    for (long tiles : {1L, 2L}) {
      Shape shape = streamed_shape(steps);
      shape.random_mask = true;
      shape.key_mask = true;
      const auto c = make_case<Scalar>(shape, 21);
      const sdmha::SparseDenseMHA<Scalar> whole(c.config, c.weights);
      sdmha::SparseDenseMHA<Scalar> streamed(c.config, c.weights);
      ContextStreamingHook::set(streamed, chunks_of<Scalar>(shape, tiles));
      for (int variant = 0; variant < kVariants; ++variant) {
        std::mt19937_64 generator(100 + variant);
        VariantOptions<Scalar> owned;
        auto options = c.options;
        options.score_strategy = sdmha::ScoreStrategy::project_first;
        apply_variant(variant, shape, options, owned, generator);
        for (int threads : {1, 2}) {
          SCOPED_TRACE(::testing::Message()
                       << "T = " << steps << ", variant " << variant << ", chunks of " << tiles
                       << " key tiles, " << threads << " threads");
          options.num_threads = threads;
          const auto expected = whole.forward(c.query(), {c.key, c.value}, options);
          const auto got = streamed.forward(c.query(), {c.key, c.value}, options);
          EXPECT_TRUE(bitwise_equal(got.output, expected.output));
          EXPECT_EQ(got.dropout_seed, expected.dropout_seed);
        }
      }
    }
}

// The dense layer streamed equals the dense layer unstreamed, bit for bit, in every variant at 1
// and 2 threads.
template <typename Scalar>
void dense_layer_streamed_equals_unstreamed(Shape shape) {
  shape.key_mask = true;
  const auto c = make_case<Scalar>(shape, 22);
  const sdmha::DenseMHA<Scalar> whole(c.config, c.weights);
  sdmha::DenseMHA<Scalar> streamed(c.config, c.weights);
  ContextStreamingHook::set(streamed, chunks_of<Scalar>(shape, 1));
  const Tensor3<Scalar> query = c.dense_query();
  for (int variant = 0; variant < kVariants; ++variant) {
    std::mt19937_64 generator(200 + variant);
    VariantOptions<Scalar> owned;
    auto options = c.options;
    apply_variant(variant, shape, options, owned, generator);
    for (int threads : {1, 2}) {
      SCOPED_TRACE(::testing::Message() << "T = " << shape.steps << ", variant " << variant << ", "
                                        << threads << " threads");
      options.num_threads = threads;
      const auto expected = whole.forward(query, {c.key, c.value}, options);
      const auto got = streamed.forward(query, {c.key, c.value}, options);
      EXPECT_TRUE(bitwise_equal(got.output, expected.output));
    }
  }
}

// The dense layer likewise, over one query tile and several.
TYPED_TEST(ContextStreamingTest, DenseLayerStreamedEqualsUnstreamedBitwise) {
  using Scalar = TypeParam;
  for (Index steps : {Index(70), kForwardQueryTile + 44})
    dense_layer_streamed_equals_unstreamed<Scalar>(streamed_shape(steps));
}

// A value row that is not finite, blocked for every query, in one chunk only: the other chunks
// still take the GEMM, and the result is the unstreamed one, bit for bit, and finite.
TYPED_TEST(ContextStreamingTest, NonFiniteValuesInOneChunkOnly) {
  using Scalar = TypeParam;
  Shape shape = streamed_shape();
  auto c = make_case<Scalar>(shape, 23);
  KeyMask& key_mask = c.set_key_mask(true);
  for (Index b = 0; b < shape.batch; ++b)
    for (Index s : {kKeyTile + 5, kKeyTile + 300}) {
      key_mask(b, s) = false;
      for (Index e = 0; e < shape.value_in_dim; ++e)
        c.value(b, s, e) = std::numeric_limits<Scalar>::quiet_NaN();
    }
  const sdmha::SparseDenseMHA<Scalar> whole(c.config, c.weights);
  sdmha::SparseDenseMHA<Scalar> streamed(c.config, c.weights);
  ContextStreamingHook::set(streamed, chunks_of<Scalar>(shape, 1));
  auto options = c.options;
  options.score_strategy = sdmha::ScoreStrategy::project_first;
  const auto expected = whole.forward(c.query(), {c.key, c.value}, options);
  const auto got = streamed.forward(c.query(), {c.key, c.value}, options);
  EXPECT_TRUE(bitwise_equal(got.output, expected.output));
  for (Index i = 0; i < got.output.size(); ++i)
    ASSERT_TRUE(std::isfinite(double(got.output.data()[i]))) << "entry " << i;
}

// Streamed, both layers agree with the float64 reference over make_case's masks, key masks,
// causal and fully blocked rows.
TYPED_TEST(ContextStreamingTest, AgreesWithReference) {
  using Scalar = TypeParam;
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(::testing::Message() << "variant " << variant);
    Shape shape = streamed_shape();
    shape.random_mask = variant == 0;
    shape.key_mask = variant != 2;
    shape.causal = variant >= 1;
    shape.fully_blocked_rows = variant == 2;
    if (variant == 1) shape.steps = kKeyTile + 90;  // causal top-left: rows past one key tile
    const auto c = make_case<Scalar>(shape, 30 + variant);
    const auto expected = sdmha_reference::forward(c.problem);
    auto options = c.options;
    options.num_threads = 2;
    options.score_strategy = sdmha::ScoreStrategy::project_first;
    sdmha::SparseDenseMHA<Scalar> sparse_layer(c.config, c.weights);
    ContextStreamingHook::set(sparse_layer, chunks_of<Scalar>(shape, 1));
    const auto sparse = sparse_layer.forward(c.query(), {c.key, c.value}, options);
    EXPECT_TRUE(all_near(sparse.output.data(), expected.output, relative_tolerance<Scalar>()));
    sdmha::DenseMHA<Scalar> dense_layer(c.config, c.weights);
    ContextStreamingHook::set(dense_layer, chunks_of<Scalar>(shape, 2));
    const auto dense = dense_layer.forward(c.dense_query(), {c.key, c.value}, options);
    EXPECT_TRUE(all_near(dense.output.data(), expected.output, relative_tolerance<Scalar>()));
  }
}

// The budget decides: at exactly the bytes of K and V they are projected whole (the workspace
// holds them); one byte less and they stream, the workspace holding one chunk's K and V (its
// rows widened to whole projection blocks) instead. A streamed call again on the same workspace
// grows nothing. A call that does not run the online softmax (scores returned) never streams.
TYPED_TEST(ContextStreamingTest, BudgetDecides) {
  using Scalar = TypeParam;
  const Shape shape = streamed_shape();
  const auto c = make_case<Scalar>(shape, 24);
  const std::size_t whole_bytes = context_bytes<Scalar>(shape);
  auto options = c.options;
  options.num_threads = 2;
  options.score_strategy = sdmha::ScoreStrategy::project_first;
  auto workspace_bytes = [&](std::size_t budget, bool return_scores) {
    sdmha::SparseDenseMHA<Scalar> layer(c.config, c.weights);
    ContextStreaming streaming = chunks_of<Scalar>(shape, 1);
    streaming.budget_bytes = budget;
    ContextStreamingHook::set(layer, streaming);
    auto call_options = options;
    call_options.return_attention_scores = return_scores;
    sdmha::Workspace<Scalar> workspace;
    sdmha::AttentionResult<Scalar> result;
    layer.forward(c.query(), {c.key, c.value}, call_options, workspace, result);
    const std::size_t first = workspace.bytes();
    layer.forward(c.query(), {c.key, c.value}, call_options, workspace, result);
    EXPECT_EQ(workspace.bytes(), first) << "a second call grew the workspace";
    return first;
  };
  const std::size_t whole = workspace_bytes(whole_bytes, false);
  const std::size_t streamed = workspace_bytes(whole_bytes - 1, false);
  const std::size_t chunk_rows = std::size_t(kKeyTile + 2 * sdmha::detail::kProjectionRowBlock);
  const std::size_t chunk_bytes =
      whole_bytes / std::size_t(shape.batch * shape.key_steps) * chunk_rows;
  EXPECT_GE(whole, whole_bytes);
  EXPECT_LE(streamed + (whole_bytes - chunk_bytes), whole);
  EXPECT_GE(workspace_bytes(0, true), whole_bytes);
}

}  // namespace
