// Tests of sdmha/tensor_ref.hpp and sdmha/options.hpp: TensorRef3 binds to a Tensor, a TensorMap
// (const or not) and a raw pointer without copying, and sees them as (B·S × E) matrices; so does
// the key mask's TensorRef<bool, 2>; AttentionOptions' defaults; to_string(ScoreStrategy) and
// to_string(Precision).
#include "test_support.hpp"

namespace sdmha_test {
namespace {

SDMHA_SCALAR_TYPED_TEST_SUITE(OptionsTest);

template <typename Scalar>
Tensor3<Scalar> counting_tensor(Index batch, Index steps, Index width) {
  Tensor3<Scalar> tensor(batch, steps, width);
  for (Index i = 0; i < tensor.size(); ++i) tensor.data()[i] = Scalar(i) * Scalar(0.5) - Scalar(3);
  return tensor;
}

// Checks the view's shape, that it points at `data`, and that as_matrix(b·S + s, e) is
// element (b, s, e) of the row-major buffer.
template <typename Scalar>
void expect_view_of(const sdmha::TensorRef3<Scalar>& view, const Scalar* data, Index batch,
                    Index steps, Index width) {
  EXPECT_EQ(view.data(), data);
  EXPECT_EQ(view.dimension(0), batch);
  EXPECT_EQ(view.dimension(1), steps);
  EXPECT_EQ(view.dimension(2), width);
  const auto matrix = view.as_matrix();
  EXPECT_EQ(matrix.rows(), batch * steps);
  EXPECT_EQ(matrix.cols(), width);
  EXPECT_EQ(matrix.data(), data);
  for (Index b = 0; b < batch; ++b)
    for (Index s = 0; s < steps; ++s)
      for (Index e = 0; e < width; ++e)
        ASSERT_EQ(matrix(b * steps + s, e), data[(b * steps + s) * width + e])
            << b << ", " << s << ", " << e;
}

// Accepts its argument by implicit conversion, as the layers' forward does.
template <typename Scalar>
const Scalar* data_of(const sdmha::TensorRef3<Scalar>& view) {
  return view.data();
}

TYPED_TEST(OptionsTest, TensorRef3ViewsATensorInPlace) {
  const auto tensor = counting_tensor<TypeParam>(2, 3, 4);
  expect_view_of<TypeParam>(tensor, tensor.data(), 2, 3, 4);
  EXPECT_EQ(data_of<TypeParam>(tensor), tensor.data());
}

TYPED_TEST(OptionsTest, TensorRef3ViewsMutableAndConstTensorMapsInPlace) {
  auto storage = counting_tensor<TypeParam>(3, 2, 5);
  std::vector<TypeParam> caller_memory(storage.data(), storage.data() + storage.size());
  Eigen::TensorMap<Tensor3<TypeParam>> mutable_map(caller_memory.data(), 3, 2, 5);
  Eigen::TensorMap<const Tensor3<TypeParam>> const_map(caller_memory.data(), 3, 2, 5);
  expect_view_of<TypeParam>(mutable_map, caller_memory.data(), 3, 2, 5);
  expect_view_of<TypeParam>(const_map, caller_memory.data(), 3, 2, 5);
  EXPECT_EQ(data_of<TypeParam>(mutable_map), caller_memory.data());
  EXPECT_EQ(data_of<TypeParam>(const_map), caller_memory.data());
  // A view, not a copy: the caller's later writes show through.
  const sdmha::TensorRef3<TypeParam> view(const_map);
  caller_memory[7] = TypeParam(42);
  EXPECT_EQ(view.as_matrix()(1, 2), TypeParam(42));
}

TYPED_TEST(OptionsTest, TensorRef3ViewsARawPointer) {
  const std::vector<TypeParam> caller_memory(4 * 1 * 3, TypeParam(1.25));
  const sdmha::TensorRef3<TypeParam> view(caller_memory.data(), 4, 1, 3);
  expect_view_of(view, caller_memory.data(), 4, 1, 3);
}

TYPED_TEST(OptionsTest, TensorRef3OfEmptyTensorsHasEmptyMatrices) {
  const Tensor3<TypeParam> no_batch(0, 3, 4), no_steps(2, 0, 4);
  EXPECT_EQ(sdmha::TensorRef3<TypeParam>(no_batch).as_matrix().rows(), 0);
  EXPECT_EQ(sdmha::TensorRef3<TypeParam>(no_batch).as_matrix().cols(), 4);
  EXPECT_EQ(sdmha::TensorRef3<TypeParam>(no_steps).as_matrix().rows(), 0);
  EXPECT_EQ(sdmha::TensorRef3<TypeParam>(nullptr, 0, 0, 0).as_matrix().size(), 0);
}

// The key mask is a view too: of a (B, S) bool tensor, a map or a raw pointer, never a copy.
TEST(KeyMaskTest, TensorRefOfBoolViewsTheCallersMaskInPlace) {
  Eigen::Tensor<bool, 2, Eigen::RowMajor> mask(2, 3);
  mask.setConstant(true);
  sdmha::AttentionOptions<float> options;
  options.key_mask = mask;
  EXPECT_FALSE(options.key_mask.empty());
  EXPECT_EQ(options.key_mask.data(), mask.data());
  EXPECT_EQ(options.key_mask.dimension(0), 2);
  EXPECT_EQ(options.key_mask.dimension(1), 3);
  EXPECT_EQ(options.key_mask.size(), 6);
  mask(1, 2) = false;  // a later write shows through
  EXPECT_FALSE(options.key_mask.as_matrix()(1, 2));
  bool raw[4] = {true, false, false, true};
  const Eigen::TensorMap<const Eigen::Tensor<const bool, 2, Eigen::RowMajor>> map(raw, 1, 4);
  options.key_mask = map;
  EXPECT_EQ(options.key_mask.data(), raw);
  EXPECT_EQ(options.key_mask.dimension(1), 4);
  options.key_mask = sdmha::TensorRef<bool, 2>(raw, 2, 2);
  EXPECT_EQ(options.key_mask.as_matrix()(1, 0), false);
  EXPECT_EQ(options.key_mask.as_matrix()(1, 1), true);
  // The default view is none; a view of (B, 0) keys is not (its shape is checked).
  using KeyMaskRef = sdmha::TensorRef<bool, 2>;
  EXPECT_TRUE(KeyMaskRef().empty());
  const KeyMask no_keys(2, 0);
  EXPECT_FALSE(KeyMaskRef(no_keys).empty());
}

TYPED_TEST(OptionsTest, AttentionOptionsDefaultToNoMaskAllThreadsAutomaticStrategyNoDropout) {
  const sdmha::AttentionOptions<TypeParam> options;
  EXPECT_TRUE(options.attention_mask.empty());
  EXPECT_EQ(options.attention_mask.size(), 0);
  for (int axis = 0; axis < 4; ++axis) EXPECT_EQ(options.attention_mask.dimension(axis), 0);
  EXPECT_FALSE(options.use_causal_mask);
  EXPECT_TRUE(options.key_mask.empty());
  EXPECT_EQ(options.key_mask.data(), nullptr);
  EXPECT_EQ(options.key_mask.size(), 0);
  for (int axis = 0; axis < 2; ++axis) EXPECT_EQ(options.key_mask.dimension(axis), 0);
  EXPECT_FALSE(options.return_attention_scores);
  EXPECT_EQ(options.num_threads, 0);
  EXPECT_EQ(options.score_strategy, sdmha::ScoreStrategy::automatic);
  EXPECT_FALSE(options.training);
  EXPECT_EQ(options.dropout_rate, 0.0);
  EXPECT_EQ(options.dropout_seed, 0u);
}

TYPED_TEST(OptionsTest, AttentionResultStartsEmpty) {
  const sdmha::AttentionResult<TypeParam> result;
  EXPECT_EQ(result.output.size(), 0);
  EXPECT_EQ(result.attention_scores.size(), 0);
}

TEST(ScoreStrategyTest, ToStringNamesEachStrategy) {
  EXPECT_STREQ(sdmha::to_string(sdmha::ScoreStrategy::project_first), "project_first");
  EXPECT_STREQ(sdmha::to_string(sdmha::ScoreStrategy::automatic), "automatic");
  EXPECT_STREQ(sdmha::to_string(sdmha::ScoreStrategy::sparse_regrouped), "sparse_regrouped");
}

TEST(PrecisionTest, ToStringNamesEachMode) {
  EXPECT_STREQ(sdmha::to_string(sdmha::Precision::float32), "float32");
  EXPECT_STREQ(sdmha::to_string(sdmha::Precision::bfloat16), "bfloat16");
  EXPECT_STREQ(sdmha::to_string(sdmha::Precision::bfloat16_query_kernel), "bfloat16_query_kernel");
}

}  // namespace
}  // namespace sdmha_test
