// Tests of SparseDenseMHA::set_precision: with every kernel in bfloat16 the key and value
// projections (ProjectedContext) are bitwise the bias plus detail::gemm_bfloat16 of the inputs
// on the rounded kernels, the forward is the float64 model of the bfloat16 mode (operands of the
// projections, the scores and P·V rounded) and agrees with the unrounded float64 reference
// within bfloat16's tolerance, is bitwise invariant to the thread count and to streaming K and
// V, and equals its own forward over a ProjectedContext; the snapshot's staleness, the backward and
// double layers are refused with clear errors, and float32 restores the float layer. These tests
// force the bfloat16 GEMMs on (SDMHA_BFLOAT16_GEMMS=on), whatever this CPU would choose; the
// choice itself is tested at the end, then every GEMM stage on the AMX tiles (amx-emulated on
// every machine, amx where AMX is usable), and in a build with oneDNN the projections on it
// (forced: onednn), which a CPU without AMX runs on oneDNN's AVX512_BF16 kernels.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "internal_access.hpp"
#include "test_support.hpp"

namespace sdmha_test {
namespace {

using Layer = sdmha::SparseDenseMHA<float>;
using sdmha::detail::BFloat16Kernel;

// Sets SDMHA_BFLOAT16_GEMMS for the lifetime of the object, then restores what was there.
class ScopedBFloat16Gemms {
 public:
  explicit ScopedBFloat16Gemms(const char* value) {
    if (const char* old = std::getenv(kName)) previous_ = old;
    had_value_ = std::getenv(kName) != nullptr;
    ::setenv(kName, value, 1);
  }
  ~ScopedBFloat16Gemms() {
    if (had_value_)
      ::setenv(kName, previous_.c_str(), 1);
    else
      ::unsetenv(kName);
  }
  ScopedBFloat16Gemms(const ScopedBFloat16Gemms&) = delete;
  ScopedBFloat16Gemms& operator=(const ScopedBFloat16Gemms&) = delete;

 private:
  static constexpr const char* kName = "SDMHA_BFLOAT16_GEMMS";
  std::string previous_;
  bool had_value_ = false;
};

// The bfloat16 GEMMs on, on any CPU (the portable loop where it lacks AVX512_BF16).
class BFloat16LayerTest : public ::testing::Test {
  ScopedBFloat16Gemms gemms_on_{"on"};
};

// Each term x·w of a projection is within 2⁻⁷ of itself (gemm_bfloat16.hpp); through the four
// projections and the softmax the test shapes' outputs (|y| ≲ 1) move by well under 2⁻⁵, while
// a dropped term, a wrong pairing of rows or a missing bias moves them by O(|y|).
constexpr double kBFloat16LayerTolerance = 1.0 / 32;

::testing::AssertionResult same_bits(const float* a, const float* b, Index count) {
  for (Index i = 0; i < count; ++i)
    if (std::memcmp(a + i, b + i, sizeof(float)) != 0)
      return ::testing::AssertionFailure() << "entry " << i << ": " << a[i] << " vs " << b[i];
  return ::testing::AssertionSuccess();
}
::testing::AssertionResult same_bits(const Tensor3<float>& a, const Tensor3<float>& b) {
  if (a.dimensions() != b.dimensions()) return ::testing::AssertionFailure() << "shapes differ";
  return same_bits(a.data(), b.data(), a.size());
}

// bias + bf16(input)·bf16(kernel), as the bfloat16 projection stage computes it.
sdmha::RowMatrix<float> bfloat16_projection(const Tensor3<float>& input,
                                            const sdmha::RowMatrix<float>& kernel,
                                            const sdmha::Vector<float>& bias) {
  const Eigen::Map<const sdmha::RowMatrix<float>> rows(
      input.data(), input.dimension(0) * input.dimension(1), input.dimension(2));
  sdmha::RowMatrix<float> output(rows.rows(), kernel.cols());
  if (bias.size() != 0)
    output.rowwise() = bias.transpose();
  else
    output.setZero();
  sdmha::detail::gemm_bfloat16(rows, BFloat16Kernel(kernel), output, true, {});
  return output;
}

TEST_F(BFloat16LayerTest, ProjectedContextIsTheBFloat16GemmOfTheInputs) {
  const auto c = make_case<float>(Shape{}, 400);
  Layer layer(c.config, c.weights);
  layer.set_precision(sdmha::Precision::bfloat16);
  EXPECT_EQ(layer.precision(), sdmha::Precision::bfloat16);
  const auto context = layer.project_context(c.key, c.value);
  const auto keys = bfloat16_projection(c.key, c.weights.key_kernel, c.weights.key_bias);
  const auto values = bfloat16_projection(c.value, c.weights.value_kernel, c.weights.value_bias);
  ASSERT_EQ(context.keys.rows(), keys.rows());
  ASSERT_EQ(context.keys.cols(), keys.cols());
  EXPECT_TRUE(same_bits(context.keys.data(), keys.data(), keys.size()));
  EXPECT_TRUE(same_bits(context.values.data(), values.data(), values.size()));
  // Rounding did happen: the float32 layer's K differs.
  const auto float_context = Layer(c.config, c.weights).project_context(c.key, c.value);
  EXPECT_FALSE(same_bits(context.keys.data(), float_context.keys.data(), keys.size()));
}

// Over the named shapes (every mask, empty and fully blocked rows, no bias, T ≠ S, …): within
// bfloat16's tolerance of the float64 reference, bitwise for 1 and 2 threads, and bitwise the
// forward over its own ProjectedContext; the GEMMs on the engine the environment forced.
enum class Engine { pairs, onednn, amx };
void expect_agreement_and_thread_invariance(std::uint64_t seed, Engine engine) {
  for (const auto& variant : variants()) {
    SCOPED_TRACE(variant.name);
    const auto c = make_case<float>(variant.shape, seed++);
    Layer layer(c.config, c.weights);
    layer.set_precision(sdmha::Precision::bfloat16);
    EXPECT_EQ(layer.bfloat16_gemms_through_onednn(), engine == Engine::onednn);
    EXPECT_EQ(layer.bfloat16_gemms_on_amx(), engine == Engine::amx);
    const auto query = c.query();
    auto options = c.options;
    options.num_threads = 1;
    const auto single = layer.forward(query, {c.key, c.value}, options);
    const auto expected = sdmha_reference::forward(c.problem);
    EXPECT_TRUE(all_near(single.output.data(), expected.output, kBFloat16LayerTolerance));
    options.num_threads = 2;
    EXPECT_TRUE(same_bits(single.output, layer.forward(query, {c.key, c.value}, options).output));
    const auto context = layer.project_context(c.key, c.value);
    EXPECT_TRUE(same_bits(single.output, layer.forward(query, context, options).output));
  }
}

TEST_F(BFloat16LayerTest, AgreesWithTheReferenceAndIsThreadInvariant) {
  expect_agreement_and_thread_invariance(410, Engine::pairs);
}

double largest_difference(const float* got, const std::vector<double>& expected) {
  double largest = 0.0;
  for (std::size_t i = 0; i < expected.size(); ++i)
    largest = std::max(largest, std::abs(double(got[i]) - expected[i]));
  return largest;
}
double largest_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double largest = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) largest = std::max(largest, std::abs(a[i] - b[i]));
  return largest;
}

// The bfloat16 forward of case c against the float64 model of the mode (online_key_tile as in
// sdmha_reference::Problem), at least 8 times closer to it than the model is to the one whose
// scores and P·V keep their operands unrounded.
void expect_the_rounded_model(const Case<float>& c, long online_key_tile) {
  Layer layer(c.config, c.weights);
  layer.set_precision(sdmha::Precision::bfloat16);
  const auto result = layer.forward(c.query(), {c.key, c.value}, c.options);
  auto model = c.problem;
  model.bfloat16_projections = true;
  auto float_attention = model;
  model.bfloat16_attention = true;
  model.online_key_tile = online_key_tile;
  const auto expected = sdmha_reference::forward(model).output;
  const double error = largest_difference(result.output.data(), expected);
  const double separation =
      largest_difference(expected, sdmha_reference::forward(float_attention).output);
  EXPECT_LT(error, separation / 8) << "error " << error << ", separation " << separation;
}

// The forward is the bfloat16 mode's model: the float64 reference with the kernels, the
// projections' inputs, scale·q and k in the scores and p and v in P·V rounded to bfloat16. The
// model whose scores and P·V keep their operands unrounded is 8 times as far from it at least:
// a forward that did not round them (or rounded other things) would be close to that one
// instead. What remains is float32's sums, and the rare operand that float32 and float64 round
// to neighbouring bfloat16 values. One key tile (S ≤ kKeyTile): P is normalised as the model's.
TEST_F(BFloat16LayerTest, ComputesTheRoundedModel) {
  Shape wide = Shape{}.sized(2, 24, 40).widths(64, 32, 24).with_heads(2, 16, 8, 12);
  wide.random_mask = true;
  std::uint64_t seed = 460;
  for (const Shape& shape : {Shape{}, wide}) {
    expect_the_rounded_model(make_case<float>(shape, seed++), 0);
  }
}

// The same beyond one key tile (S > kKeyTile), where the forward runs the online softmax and P·V
// rounds each key tile's unnormalised probabilities: the model rounds them as it does.
TEST_F(BFloat16LayerTest, ComputesTheRoundedModelUnderTheOnlineSoftmax) {
  Shape s =
      Shape{}.sized(1, 6, 2 * sdmha::detail::kKeyTile + 37).widths(24, 10, 9).with_heads(2, 8, 4);
  s.random_mask = true;
  expect_the_rounded_model(make_case<float>(s, 470), sdmha::detail::kKeyTile);
}

// K and V streamed in chunks of one key tile give the bits of the unstreamed bfloat16 forward,
// whichever bfloat16 engine the environment chose.
void expect_streamed_context_is_bitwise_the_whole_one(std::uint64_t seed) {
  Shape s =
      Shape{}.sized(2, 9, 2 * sdmha::detail::kKeyTile + 37).widths(24, 10, 9).with_heads(2, 4, 3);
  s.density = 0.2;
  const auto c = make_case<float>(s, seed);
  Layer whole(c.config, c.weights), streamed(c.config, c.weights);
  whole.set_precision(sdmha::Precision::bfloat16);
  streamed.set_precision(sdmha::Precision::bfloat16);
  sdmha::detail::ContextStreaming streaming;
  streaming.budget_bytes = 0;
  streaming.chunk_bytes = std::size_t(s.heads * (s.key_dim + s.value_dim)) * sizeof(float) *
                          std::size_t(sdmha::detail::kKeyTile);
  sdmha_test::ContextStreamingHook::set(streamed, streaming);
  const auto query = c.query();
  EXPECT_TRUE(same_bits(whole.forward(query, {c.key, c.value}, c.options).output,
                        streamed.forward(query, {c.key, c.value}, c.options).output));
}

TEST_F(BFloat16LayerTest, StreamedContextIsBitwiseTheWholeOne) {
  expect_streamed_context_is_bitwise_the_whole_one(420);
}

// Back to float32, the layer is the float32 layer again; precision() is the mode last set, and
// bfloat16_query_kernel after bfloat16 drops the dense kernels' copies (the layer is then the one
// set to bfloat16_query_kernel from float32, bit for bit).
TEST_F(BFloat16LayerTest, Float32RestoresTheFloatLayer) {
  const auto c = make_case<float>(Shape{}, 430);
  Layer layer(c.config, c.weights);
  const auto query = c.query();
  const auto before = layer.forward(query, {c.key, c.value}, c.options);
  layer.set_precision(sdmha::Precision::bfloat16);
  EXPECT_FALSE(same_bits(before.output, layer.forward(query, {c.key, c.value}, c.options).output));
  layer.set_precision(sdmha::Precision::float32);
  EXPECT_EQ(layer.precision(), sdmha::Precision::float32);
  EXPECT_TRUE(same_bits(before.output, layer.forward(query, {c.key, c.value}, c.options).output));
  Layer query_only(c.config, c.weights);
  query_only.set_precision(sdmha::Precision::bfloat16_query_kernel);
  EXPECT_EQ(query_only.precision(), sdmha::Precision::bfloat16_query_kernel);
  layer.set_precision(sdmha::Precision::bfloat16);
  layer.set_precision(sdmha::Precision::bfloat16_query_kernel);
  EXPECT_EQ(layer.precision(), sdmha::Precision::bfloat16_query_kernel);
  const auto query_rounded = layer.forward(query, {c.key, c.value}, c.options);
  EXPECT_TRUE(same_bits(query_rounded.output,
                        query_only.forward(query, {c.key, c.value}, c.options).output));
  EXPECT_FALSE(same_bits(before.output, query_rounded.output));
}

// The snapshot: a write access through weights() or an output kernel replaced through the shared
// handle makes the next forward (and project_context) a ConfigError; rounding again serves the
// new kernels.
TEST_F(BFloat16LayerTest, StaleKernelsAreAConfigErrorUntilRoundedAgain) {
  const auto c = make_case<float>(Shape{}, 440);
  auto shared = std::make_shared<sdmha::MhaWeights<float>>(c.weights);
  Layer layer(c.config, shared);
  layer.set_precision(sdmha::Precision::bfloat16);
  const auto query = c.query();
  layer.weights().key_kernel *= 2.0f;
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, {c.key, c.value}, c.options), sdmha::ConfigError,
                          "rounded before the weights' last write access; expected set_precision");
  SDMHA_EXPECT_THROW_WITH(layer.project_context(c.key, c.value), sdmha::ConfigError,
                          "rounded before the weights' last write access; expected set_precision");
  layer.set_precision(sdmha::Precision::bfloat16);
  Layer twin(c.config, shared);  // the doubled Wk, rounded afresh
  twin.set_precision(sdmha::Precision::bfloat16);
  EXPECT_TRUE(same_bits(layer.forward(query, {c.key, c.value}, c.options).output,
                        twin.forward(query, {c.key, c.value}, c.options).output));
  sdmha::RowMatrix<float> replacement = shared->output_kernel;
  shared->output_kernel.swap(replacement);  // the same values in another allocation
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, {c.key, c.value}, c.options), sdmha::ConfigError,
                          "rounded before the weights' last write access");
}

TEST_F(BFloat16LayerTest, RefusesBackwardAndDoubleLayers) {
  const auto c = make_case<float>(Shape{}, 450);
  Layer layer(c.config, c.weights);
  layer.set_precision(sdmha::Precision::bfloat16);
  const auto query = c.query();
  Tensor3<float> d_output(c.shape.batch, c.shape.steps, c.problem.output_dim);
  d_output.setConstant(1.0f);
  SDMHA_EXPECT_THROW_WITH(layer.backward(query, {c.key, c.value}, d_output, c.options),
                          sdmha::ConfigError, "expected float32 for the backward");
  const auto c64 = make_case<double>(Shape{}, 451);
  sdmha::SparseDenseMHA<double> layer64(c64.config, c64.weights);
  SDMHA_EXPECT_THROW_WITH(layer64.set_precision(sdmha::Precision::bfloat16), sdmha::ConfigError,
                          "precision is bfloat16 for a double layer; expected float32 (bfloat16 "
                          "kernels need Scalar = float)");
  EXPECT_EQ(layer64.precision(), sdmha::Precision::float32);
}

// ---- the choice of the bfloat16 GEMMs ----

// Where the GEMMs stay float32 the bfloat16 mode is the bfloat16_query_kernel layer, bit for bit:
// only Wq is rounded.
TEST(BFloat16GemmChoice, OffIsTheQueryKernelLayerBitForBit) {
  const ScopedBFloat16Gemms off("off");
  Shape s = Shape{}.sized(2, 40, 30).with_heads(3, 8).with_masks();
  s.query_dim = 60;
  const auto c = make_case<float>(s, 460);
  Layer layer(c.config, c.weights);
  layer.set_precision(sdmha::Precision::bfloat16);
  EXPECT_EQ(layer.precision(), sdmha::Precision::bfloat16);
  EXPECT_FALSE(layer.bfloat16_gemms());
  Layer query_only(c.config, c.weights);
  query_only.set_precision(sdmha::Precision::bfloat16_query_kernel);
  const auto query = c.query();
  auto options = c.options;
  options.return_attention_scores = true;
  for (int threads : {1, 2}) {
    options.num_threads = threads;
    const auto result = layer.forward(query, {c.key, c.value}, options);
    const auto expected = query_only.forward(query, {c.key, c.value}, options);
    EXPECT_TRUE(same_bits(result.output, expected.output)) << threads << " threads";
    EXPECT_TRUE(same_bits(result.attention_scores.data(), expected.attention_scores.data(),
                          expected.attention_scores.size()));
  }
  // The backward still refuses: Wq is rounded.
  Tensor3<float> d_output(s.batch, s.steps, c.problem.output_dim);
  d_output.setConstant(1.0f);
  SDMHA_EXPECT_THROW_WITH(layer.backward(query, {c.key, c.value}, d_output, c.options),
                          sdmha::ConfigError, "expected float32 for the backward");
}

// Unset, empty or auto: this CPU's choice, which the rule of cpu_features.hpp gives.
TEST(BFloat16GemmChoice, AutomaticFollowsThisCpu) {
  using sdmha::detail::BFloat16GemmEngine;
  const auto c = make_case<float>(Shape{}, 461);
  const BFloat16GemmEngine expected = sdmha::detail::bfloat16_gemm_engine(
      sdmha::detail::BFloat16Gemms::automatic, sdmha::detail::bfloat16_gemm_machine());
  for (const char* value : {"auto", ""}) {
    const ScopedBFloat16Gemms automatic(value);
    Layer layer(c.config, c.weights);
    layer.set_precision(sdmha::Precision::bfloat16);
    EXPECT_EQ(layer.bfloat16_gemms(), expected != BFloat16GemmEngine::float32) << "'" << value;
    EXPECT_EQ(layer.bfloat16_gemms_through_onednn(), expected == BFloat16GemmEngine::onednn);
    EXPECT_EQ(layer.bfloat16_gemms_on_amx(), expected == BFloat16GemmEngine::amx);
    EXPECT_STREQ(layer.bfloat16_gemm_engine(), sdmha::detail::to_string(expected));
    layer.set_precision(sdmha::Precision::bfloat16_query_kernel);
    EXPECT_FALSE(layer.bfloat16_gemms());
    EXPECT_STREQ(layer.bfloat16_gemm_engine(), "off");
  }
}

// A value other than auto, on or off is refused before the layer changes.
TEST(BFloat16GemmChoice, AnUnknownValueIsAConfigErrorAndChangesNothing) {
  const auto c = make_case<float>(Shape{}, 462);
  Layer layer(c.config, c.weights);
  layer.set_precision(sdmha::Precision::bfloat16_query_kernel);
  const auto query = c.query();
  const auto before = layer.forward(query, {c.key, c.value}, c.options).output;
  const ScopedBFloat16Gemms typo("yes");
  const std::string expected =
      std::string(
          "SparseDenseMHA::set_precision: SDMHA_BFLOAT16_GEMMS = 'yes'; expected auto, "
          "on, off") +
      (sdmha::detail::kHaveOneDnnGemm ? ", onednn" : "") +
      (sdmha::detail::bfloat16_gemm_machine().amx_usable ? ", amx" : "") + " or amx-emulated";
  SDMHA_EXPECT_THROW_WITH(layer.set_precision(sdmha::Precision::bfloat16), sdmha::ConfigError,
                          expected);
  EXPECT_EQ(layer.precision(), sdmha::Precision::bfloat16_query_kernel);
  EXPECT_TRUE(same_bits(before, layer.forward(query, {c.key, c.value}, c.options).output));
}

// A forced engine that this build or CPU lacks is refused the same way, naming what is missing:
// onednn in a build without oneDNN, amx where AMX is not usable.
void expect_refused(const char* value, std::uint64_t seed, const std::string& message) {
  const auto c = make_case<float>(Shape{}, seed);
  Layer layer(c.config, c.weights);
  const ScopedBFloat16Gemms forced(value);
  SDMHA_EXPECT_THROW_WITH(layer.set_precision(sdmha::Precision::bfloat16), sdmha::ConfigError,
                          message);
  EXPECT_EQ(layer.precision(), sdmha::Precision::float32);
}
TEST(BFloat16GemmChoice, OneDnnWithoutOneDnnIsAConfigError) {
  if (sdmha::detail::kHaveOneDnnGemm) GTEST_SKIP() << "this build has oneDNN";
  expect_refused("onednn", 463, "SDMHA_BFLOAT16_GEMMS = 'onednn' but this build has no oneDNN");
}
TEST(BFloat16GemmChoice, AmxWithoutAmxIsAConfigError) {
  if (sdmha::detail::bfloat16_gemm_machine().amx_usable) GTEST_SKIP() << "AMX is usable here";
  expect_refused("amx", 464, "SDMHA_BFLOAT16_GEMMS = 'amx' but AMX is not usable here");
}

// ---- every GEMM stage on the AMX tiles: their emulation (SDMHA_BFLOAT16_GEMMS=amx-emulated) on
// every machine, the CPU's (amx) where AMX is usable ----

class BFloat16AmxEmulatedLayerTest : public ::testing::Test {
  ScopedBFloat16Gemms gemms_emulated_{"amx-emulated"};
};
class BFloat16AmxLayerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!sdmha::detail::bfloat16_gemm_machine().amx_usable)
      GTEST_SKIP() << "no AMX here: BFloat16AmxEmulatedLayerTest runs the same on the emulation";
  }
  ScopedBFloat16Gemms gemms_amx_{"amx"};
};

TEST_F(BFloat16AmxEmulatedLayerTest, AgreesWithTheReferenceAndIsThreadInvariant) {
  expect_agreement_and_thread_invariance(500, Engine::amx);
}
TEST_F(BFloat16AmxLayerTest, AgreesWithTheReferenceAndIsThreadInvariant) {
  expect_agreement_and_thread_invariance(500, Engine::amx);
}

// The bfloat16 mode's model, one key tile and the online softmax, with the tiles reached by the
// projections, the scores and P·V (the emulation counts its tile products: more than the
// projections alone take).
void expect_the_rounded_model_on_the_tiles(std::uint64_t seed) {
  Shape wide = Shape{}.sized(2, 24, 40).widths(64, 32, 24).with_heads(2, 16, 8, 12);
  wide.random_mask = true;
  for (const Shape& shape : {Shape{}, wide})
    expect_the_rounded_model(make_case<float>(shape, seed++), 0);
  Shape online =
      Shape{}.sized(1, 6, 2 * sdmha::detail::kKeyTile + 37).widths(24, 10, 9).with_heads(2, 8, 4);
  online.random_mask = true;
  expect_the_rounded_model(make_case<float>(online, seed), sdmha::detail::kKeyTile);
}
TEST_F(BFloat16AmxEmulatedLayerTest, ComputesTheRoundedModel) {
  using sdmha::detail::amx::EmulatedTiles;
  const auto before = EmulatedTiles::products().load();
  expect_the_rounded_model_on_the_tiles(505);
  EXPECT_GT(EmulatedTiles::products().load(), before);
  // One head, 16 query rows, 32 keys, every width 16 (one 32-deep step each): the K and V
  // projections take 2 tile products each (32 rows), the output projection 1, the scores 2 (32
  // keys) and P·V 1.
  const auto c =
      make_case<float>(Shape{}.sized(1, 16, 32).widths(16, 16, 16).with_heads(1, 16, 16, 16), 509);
  Layer layer(c.config, c.weights);
  layer.set_precision(sdmha::Precision::bfloat16);
  EXPECT_STREQ(layer.bfloat16_gemm_engine(), "amx-emulated");
  auto options = c.options;
  options.num_threads = 1;
  const auto start = EmulatedTiles::products().load();
  layer.forward(c.query(), {c.key, c.value}, options);
  EXPECT_EQ(EmulatedTiles::products().load() - start, 2u + 2u + 1u + 2u + 1u);
}
TEST_F(BFloat16AmxLayerTest, ComputesTheRoundedModel) {
  expect_the_rounded_model_on_the_tiles(505);
}

TEST_F(BFloat16AmxEmulatedLayerTest, StreamedContextIsBitwiseTheWholeOne) {
  expect_streamed_context_is_bitwise_the_whole_one(515);
}
TEST_F(BFloat16AmxLayerTest, StreamedContextIsBitwiseTheWholeOne) {
  expect_streamed_context_is_bitwise_the_whole_one(515);
}

#if defined(SDMHA_WITH_ONEDNN)
// ---- the projections on oneDNN (SDMHA_BFLOAT16_GEMMS=onednn): AMX tiles where usable, its
// AVX512_BF16 kernels elsewhere, as on the machines without AMX that run these tests ----

class BFloat16OneDnnLayerTest : public ::testing::Test {
  ScopedBFloat16Gemms gemms_onednn_{"onednn"};
};

// The same through oneDNN: bitwise for 1 and 2 threads too, each row block being one call on its
// worker's thread, whichever worker.
TEST_F(BFloat16OneDnnLayerTest, AgreesWithTheReferenceAndIsThreadInvariant) {
  expect_agreement_and_thread_invariance(480, Engine::onednn);
}

// Many row blocks of K, V and the output (3·300 rows: 15 blocks each) on 1, 2 and 3 workers,
// which share each kernel's primitives: the same bits, within tolerance of the reference.
TEST_F(BFloat16OneDnnLayerTest, WorkersSharingTheKernelsGiveTheSameBits) {
  const auto c = make_case<float>(Shape{}.sized(3, 300, 300).widths(40, 48, 36), 485);
  Layer layer(c.config, c.weights);
  layer.set_precision(sdmha::Precision::bfloat16);
  const auto query = c.query();
  auto options = c.options;
  options.num_threads = 1;
  const auto single = layer.forward(query, {c.key, c.value}, options);
  EXPECT_TRUE(all_near(single.output.data(), sdmha_reference::forward(c.problem).output,
                       kBFloat16LayerTolerance));
  for (int threads : {2, 3}) {
    options.num_threads = threads;
    EXPECT_TRUE(same_bits(single.output, layer.forward(query, {c.key, c.value}, options).output))
        << threads << " threads";
  }
}

// The forward is the float64 model with the projections rounded (kernels and their inputs) and
// the scores and P·V in float32: 8 times closer to it at least than that model is to the
// unrounded one. A forward that rounded nothing, or also the scores' operands, would not be.
TEST_F(BFloat16OneDnnLayerTest, ComputesTheModelWithRoundedProjections) {
  Shape wide = Shape{}.sized(2, 24, 70).widths(64, 32, 24).with_heads(2, 16, 8, 12);
  wide.random_mask = true;
  std::uint64_t seed = 490;
  for (const Shape& shape : {Shape{}, wide}) {
    const auto c = make_case<float>(shape, seed++);
    Layer layer(c.config, c.weights);
    layer.set_precision(sdmha::Precision::bfloat16);
    const auto result = layer.forward(c.query(), {c.key, c.value}, c.options);
    auto model = c.problem;
    model.bfloat16_projections = true;
    const auto expected = sdmha_reference::forward(model).output;
    const double error = largest_difference(result.output.data(), expected);
    const double separation =
        largest_difference(expected, sdmha_reference::forward(c.problem).output);
    EXPECT_LT(error, separation / 8) << "error " << error << ", separation " << separation;
  }
}

TEST_F(BFloat16OneDnnLayerTest, StreamedContextIsBitwiseTheWholeOne) {
  expect_streamed_context_is_bitwise_the_whole_one(495);
}
#endif  // SDMHA_WITH_ONEDNN

}  // namespace
}  // namespace sdmha_test
