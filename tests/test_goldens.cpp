// The golden cases of tests/data/goldens/ (computed with PyTorch in float64, Keras 3 math), read
// through sdmha's own safetensors reader and weight mapping, run through the layer with both
// score strategies, compared elementwise with the README's tolerances.
#include "test_support.hpp"

#include <sdmha/io/layer_files.hpp>

#ifndef SDMHA_TEST_DATA_DIR
#error "SDMHA_TEST_DATA_DIR must name tests/data"
#endif

namespace sdmha_test {
namespace {

const char* const kGoldenCases[] = {
    "keras_basic_f64",      "keras_value_dim_f64", "keras_mask_f64",   "keras_causal_f64",
    "keras_empty_rows_f64", "keras_fully_masked_f64", "torch_packed_f64", "keras_medium_f32"};

std::string golden_path(const std::string& name) {
  return std::string(SDMHA_TEST_DATA_DIR) + "/goldens/" + name + ".safetensors";
}

// The README's tolerances: float64 1e-10·(1 + |expected|), float32 2e-5·(1 + |expected|).
template <typename Scalar>
double golden_tolerance() {
  return std::is_same<Scalar, double>::value ? 1e-10 : 2e-5;
}

template <typename Scalar>
void run_golden(const std::string& name, double tolerance) {
  SCOPED_TRACE(name);
  const auto source = sdmha::io::TensorSource::open(golden_path(name));
  const auto layer_file = sdmha::io::load_layer<Scalar>(source);
  const auto inputs = sdmha::io::load_inputs<Scalar>(source);
  const auto expected_output = source.read<double>("expected/output");
  const auto expected_scores = source.read<double>("expected/attention_scores");

  const sdmha::SparseDenseMHA<Scalar> layer(layer_file.config, layer_file.weights);
  sdmha::AttentionOptions<Scalar> options;
  options.attention_mask = inputs.attention_mask;
  options.use_causal_mask = layer_file.use_causal_mask;
  options.return_attention_scores = true;
  for (auto strategy : {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
    SCOPED_TRACE(sdmha::to_string(strategy));
    options.score_strategy = strategy;
    const auto result = layer.forward(inputs.query, inputs.key, inputs.value, options);
    ASSERT_EQ(std::size_t(result.output.size()), expected_output.size());
    ASSERT_EQ(std::size_t(result.attention_scores.size()), expected_scores.size());
    EXPECT_TRUE(all_near(result.output.data(), expected_output, tolerance));
    EXPECT_TRUE(all_near(result.attention_scores.data(), expected_scores, tolerance));
  }
  // The dense baseline meets the same tolerance on the densified query.
  const sdmha::DenseMHA<Scalar> baseline(layer_file.config, layer_file.weights);
  const auto dense = inputs.query.to_dense();
  Eigen::TensorMap<const Tensor3<Scalar>> dense_query(dense.data(), inputs.query.batch(),
                                                      inputs.query.steps(), inputs.query.features());
  const auto result = baseline.forward(dense_query, inputs.key, inputs.value, options);
  EXPECT_TRUE(all_near(result.output.data(), expected_output, tolerance));
}

bool is_float32_case(const std::string& name) { return name.find("_f32") != std::string::npos; }

TEST(Goldens, EveryCaseInItsOwnPrecision) {
  for (const char* name : kGoldenCases) {
    if (is_float32_case(name)) {
      run_golden<float>(name, golden_tolerance<float>());
    } else {
      run_golden<double>(name, golden_tolerance<double>());
    }
  }
}

// Float computation of the float64 cases stays within float tolerance of the float64 answer.
TEST(Goldens, FloatAgreesWithDoubleOnEveryCase) {
  for (const char* name : kGoldenCases) run_golden<float>(name, 2e-5);
}

TEST(Goldens, LayoutAndCausalFlagComeFromTheMetadata) {
  const auto torch = sdmha::io::load_layer<double>(sdmha::io::TensorSource::open(golden_path("torch_packed_f64")));
  EXPECT_EQ(torch.layout, sdmha::io::WeightLayout::torch);
  EXPECT_EQ(torch.config.num_heads, 4);
  const auto causal = sdmha::io::load_layer<double>(sdmha::io::TensorSource::open(golden_path("keras_causal_f64")));
  EXPECT_TRUE(causal.use_causal_mask);
  EXPECT_EQ(causal.layout, sdmha::io::WeightLayout::keras);
}

}  // namespace
}  // namespace sdmha_test
