// Tests of SparseDenseMHA::set_precision(Precision::bfloat16_query_kernel): a forward with the
// query kernel in bfloat16 is the float32 layer whose Wq is rounded to bfloat16, bit for bit, and
// agrees with the float64 reference on that rounding; the snapshot's staleness, the backward and
// the regrouped strategy are refused with clear errors.
#include "test_support.hpp"

namespace sdmha_test {
namespace {

using Layer = sdmha::SparseDenseMHA<float>;

// Wq rounded to the nearest bfloat16 and widened back to float (exact).
sdmha::RowMatrix<float> rounded(const sdmha::RowMatrix<float>& kernel) {
  return kernel.cast<Eigen::bfloat16>().cast<float>();
}

// The case's layer with its query kernel replaced by that rounding (in float32 and in the
// reference's problem).
Case<float> with_rounded_query_kernel(Case<float> c) {
  c.weights.query_kernel = rounded(c.weights.query_kernel);
  for (Index i = 0; i < c.weights.query_kernel.size(); ++i)
    c.problem.query_kernel[std::size_t(i)] = double(c.weights.query_kernel.data()[i]);
  return c;
}

void expect_same_bits(const Tensor3<float>& a, const Tensor3<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), sizeof(float) * std::size_t(a.size()))) << what;
}

// The bfloat16 `layer` (the case's weights) projecting first over `query` (the case's entries,
// in any storage): bit for bit the float32 layer on the rounded Wq, and the float64 reference on
// it within float32's tolerance.
void expect_the_float_layer_on_the_rounded_kernel(const Case<float>& c, const Layer& layer,
                                                  const sdmha::SparseQuery<float>& query) {
  const auto twin = with_rounded_query_kernel(c);
  const Layer twin_layer(twin.config, twin.weights);
  auto options = c.options;
  options.score_strategy = sdmha::ScoreStrategy::project_first;
  const auto result = layer.forward(query, {c.key, c.value}, options);
  expect_same_bits(result.output, twin_layer.forward(query, {c.key, c.value}, options).output,
                   "against the float32 layer on the rounded Wq");
  const auto expected = sdmha_reference::forward(twin.problem);
  EXPECT_TRUE(all_near(result.output.data(), expected.output, relative_tolerance<float>()));
}

// Over the named shapes (every mask, empty and fully blocked rows, no bias, T ≠ S, …): the
// bfloat16 forward equals the float32 forward on the rounded Wq bit for bit, and the float64
// reference on it within float32's tolerance.
TEST(BFloat16QueryKernelTest, IsTheFloatLayerOnTheRoundedQueryKernel) {
  std::uint64_t seed = 300;
  for (const auto& variant : variants()) {
    SCOPED_TRACE(variant.name);
    const auto c = make_case<float>(variant.shape, seed++);
    Layer layer(c.config, c.weights);
    layer.set_precision(sdmha::Precision::bfloat16_query_kernel);
    EXPECT_EQ(layer.precision(), sdmha::Precision::bfloat16_query_kernel);
    expect_the_float_layer_on_the_rounded_kernel(c, layer, c.query());
  }
}

// A query kernel beyond the cache with rows that reuse features (where both layers go by
// feature, the bfloat16 one reading the rounded Wq): still the same bits as the float layer on
// the rounded Wq, for 1 and 2 threads; the automatic strategy projects first.
TEST(BFloat16QueryKernelTest, WideQueryKernelIsBitwiseAndThreadInvariant) {
  Shape s = Shape{}.sized(2, 40, 9).with_heads(4, 64);
  s.query_dim = 3000;
  s.density = 0.06;
  const auto c = make_case<float>(s, 41);
  const auto twin = with_rounded_query_kernel(c);
  Layer layer(c.config, c.weights);
  layer.set_precision(sdmha::Precision::bfloat16_query_kernel);
  const Layer twin_layer(twin.config, twin.weights);
  const auto query = c.query();
  ASSERT_GE(query.nonzeros(), 2 * s.query_dim);  // the float layer's by-feature kernel
  EXPECT_EQ(layer.resolve_strategy(sdmha::ScoreStrategy::automatic, query, s.key_steps, false),
            sdmha::ScoreStrategy::project_first);
  auto options = c.options;
  options.num_threads = 1;
  const auto single = layer.forward(query, {c.key, c.value}, options);
  options.score_strategy = sdmha::ScoreStrategy::project_first;
  expect_same_bits(single.output, twin_layer.forward(query, {c.key, c.value}, options).output,
                   "against the float32 layer on the rounded Wq");
  options.num_threads = 2;
  expect_same_bits(single.output, layer.forward(query, {c.key, c.value}, options).output,
                   "2 threads against 1");
  const auto expected = sdmha_reference::forward(twin.problem);
  EXPECT_TRUE(all_near(single.output.data(), expected.output, relative_tolerance<float>()));
}

// The same wide kernel with each row's columns given in descending order (a view of the
// caller's CSR arrays, not known sorted): the bfloat16 layer goes by feature over the CSC, and
// is the float32 layer on the rounded Wq over the same arrays, bit for bit, and the reference.
TEST(BFloat16QueryKernelTest, WideQueryKernelTakesRowsWithUnsortedColumns) {
  Shape s = Shape{}.sized(2, 40, 9);
  s.query_dim = 3000;
  s.heads = 3;
  s.key_dim = 64;  // N = 192: a panel and a partial one; Wq 2.3 MB, beyond the cache
  s.density = 0.06;
  const auto c = make_case<float>(s, 43);
  const auto sorted = c.query();
  const auto& csr = sorted.csr();
  std::vector<int> offsets(csr.row_offsets, csr.row_offsets + csr.rows + 1);
  std::vector<int> columns(csr.column_indices, csr.column_indices + csr.nonzeros());
  std::vector<float> values(csr.values, csr.values + csr.nonzeros());
  for (Index r = 0; r < csr.rows; ++r) {
    std::reverse(columns.begin() + offsets[std::size_t(r)],
                 columns.begin() + offsets[std::size_t(r) + 1]);
    std::reverse(values.begin() + offsets[std::size_t(r)],
                 values.begin() + offsets[std::size_t(r) + 1]);
  }
  const auto query = sdmha::SparseQuery<float>::view_csr(
      s.batch, s.steps, s.query_dim, offsets.data(), Index(offsets.size()), columns.data(),
      values.data(), Index(values.size()));
  ASSERT_FALSE(query.csr().sorted_columns);
  ASSERT_GE(query.nonzeros(), 2 * s.query_dim);
  Layer layer(c.config, c.weights);
  layer.set_precision(sdmha::Precision::bfloat16_query_kernel);
  expect_the_float_layer_on_the_rounded_kernel(c, layer, query);
}

// Back to float32, the layer is the float32 layer again (bit for bit what it gave before).
TEST(BFloat16QueryKernelTest, Float32PrecisionRestoresTheFloatLayer) {
  const auto c = make_case<float>(Shape{}, 51);
  Layer layer(c.config, c.weights);
  const auto query = c.query();
  const auto before = layer.forward(query, {c.key, c.value}, c.options);
  layer.set_precision(sdmha::Precision::bfloat16_query_kernel);
  layer.set_precision(sdmha::Precision::float32);
  EXPECT_EQ(layer.precision(), sdmha::Precision::float32);
  expect_same_bits(before.output, layer.forward(query, {c.key, c.value}, c.options).output,
                   "float32 again");
}

// The snapshot: a write access through weights() makes the next forward a ConfigError, as does
// a Wq replaced through the shared handle; rounding again serves the new Wq.
TEST(BFloat16QueryKernelTest, StaleSnapshotIsAConfigErrorUntilRoundedAgain) {
  const auto c = make_case<float>(Shape{}, 61);
  auto shared = std::make_shared<sdmha::MhaWeights<float>>(c.weights);
  Layer layer(c.config, shared);
  layer.set_precision(sdmha::Precision::bfloat16_query_kernel);
  const auto query = c.query();
  layer.weights().query_kernel *= 2.0f;
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, {c.key, c.value}, c.options), sdmha::ConfigError,
                          "the bfloat16 query kernel was rounded before the weights' last write "
                          "access; expected set_precision again");
  layer.set_precision(sdmha::Precision::bfloat16_query_kernel);
  auto twin = c;
  twin.weights.query_kernel *= 2.0f;
  twin = with_rounded_query_kernel(twin);
  expect_same_bits(
      layer.forward(query, {c.key, c.value}, c.options).output,
      Layer(twin.config, twin.weights).forward(query, {c.key, c.value}, c.options).output,
      "after rounding the doubled Wq");
  sdmha::RowMatrix<float> replacement = shared->query_kernel;
  shared->query_kernel.swap(replacement);  // the same values in another allocation
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, {c.key, c.value}, c.options), sdmha::ConfigError,
                          "rounded before the weights' last write access");
}

TEST(BFloat16QueryKernelTest, RefusesBackwardRegroupedScoresAndDoubleLayers) {
  const auto c = make_case<float>(Shape{}, 71);
  Layer layer(c.config, c.weights);
  layer.set_precision(sdmha::Precision::bfloat16_query_kernel);
  const auto query = c.query();
  Tensor3<float> d_output(c.shape.batch, c.shape.steps, c.problem.output_dim);
  d_output.setConstant(1.0f);
  SDMHA_EXPECT_THROW_WITH(layer.backward(query, {c.key, c.value}, d_output, c.options),
                          sdmha::ConfigError, "expected float32 for the backward");
  auto options = c.options;
  options.score_strategy = sdmha::ScoreStrategy::sparse_regrouped;
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, {c.key, c.value}, options), sdmha::ConfigError,
                          "score_strategy is sparse_regrouped with a bfloat16 query kernel");
  // A refused training call draws no dropout seed.
  sdmha::DropoutGenerator generator(9);
  options.training = true;
  options.dropout_rate = 0.2;
  options.dropout_generator = &generator;
  EXPECT_THROW(layer.forward(query, {c.key, c.value}, options), sdmha::ConfigError);
  EXPECT_EQ(generator.draws(), 0u);
  const auto c64 = make_case<double>(Shape{}, 72);
  sdmha::SparseDenseMHA<double> layer64(c64.config, c64.weights);
  SDMHA_EXPECT_THROW_WITH(layer64.set_precision(sdmha::Precision::bfloat16_query_kernel),
                          sdmha::ConfigError,
                          "precision is bfloat16_query_kernel for a double layer; expected float32 "
                          "(bfloat16 kernels need Scalar = float)");
  EXPECT_EQ(layer64.precision(), sdmha::Precision::float32);
}

}  // namespace
}  // namespace sdmha_test
