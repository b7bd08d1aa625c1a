// Tests of sdmha/io/layer_files.hpp's LayerFile::attention_options: the attention settings a file
// carries (use_causal_mask, causal_alignment, scale, fully_masked_rows) reach forward through the
// obvious code, options = layer_file.attention_options(), on golden files whose expected output
// depends on each setting (tests/data/goldens/, tests/data/semantics/, float64 references).
#include "test_support.hpp"

#include <string>
#include <vector>

#include <sdmha/io/layer_files.hpp>

#ifndef SDMHA_TEST_DATA_DIR
#error "SDMHA_TEST_DATA_DIR must name tests/data"
#endif

namespace sdmha_test {
namespace {

// The goldens' float64 tolerance (tests/semantics/test_goldens.cpp): 1e-10·(1 + |expected|).
constexpr double kGoldenTolerance = 1e-10;

struct GoldenRun {
  std::vector<double> expected;
  std::vector<double> with_file_options;
  std::vector<double> with_default_options;
};

// Runs the file's layer on the file's inputs, once with the file's options and once with default
// ones (the settings dropped), masks and bias bound in both.
GoldenRun run_file(const std::string& relative) {
  const auto source = sdmha::io::TensorSource::open(std::string(SDMHA_TEST_DATA_DIR) + "/" +
                                                    relative + ".safetensors");
  const auto layer_file = sdmha::io::load_layer<double>(source);
  const auto inputs = sdmha::io::load_inputs<double>(source);
  const sdmha::SparseDenseMHA<double> layer(layer_file.config, layer_file.weights);
  GoldenRun run;
  run.expected = source.read<double>("expected/output");
  auto options = layer_file.attention_options();
  options.attention_mask = inputs.attention_mask;
  options.attention_bias = inputs.attention_bias;
  const auto output = layer.forward(inputs.query, {inputs.key, inputs.value}, options).output;
  run.with_file_options.assign(output.data(), output.data() + output.size());
  sdmha::AttentionOptions<double> defaults;
  defaults.attention_mask = inputs.attention_mask;
  defaults.attention_bias = inputs.attention_bias;
  const auto plain = layer.forward(inputs.query, {inputs.key, inputs.value}, defaults).output;
  run.with_default_options.assign(plain.data(), plain.data() + plain.size());
  return run;
}

TEST(LayerFileSettings, OptionsCarryEveryMetadataSetting) {
  const auto source = sdmha::io::TensorSource::open(
      std::string(SDMHA_TEST_DATA_DIR) +
      "/semantics/causal_bottom_right_t6_s4_uniform_torch_f64.safetensors");
  const auto options = sdmha::io::load_layer<double>(source).attention_options();
  EXPECT_TRUE(options.use_causal_mask);
  EXPECT_EQ(options.causal_alignment, sdmha::CausalAlignment::bottom_right);
  EXPECT_EQ(options.fully_masked_rows, sdmha::FullyMaskedRows::uniform);
  EXPECT_FALSE(options.scale.has_value());
  const auto scaled = sdmha::io::load_layer<double>(sdmha::io::TensorSource::open(
      std::string(SDMHA_TEST_DATA_DIR) + "/semantics/scale_keras_f64.safetensors"));
  EXPECT_EQ(scaled.attention_options().scale, std::optional<double>(0.7));
  // Everything else is AttentionOptions' default.
  const sdmha::AttentionOptions<double> defaults;
  EXPECT_EQ(options.num_threads, defaults.num_threads);
  EXPECT_EQ(options.score_strategy, defaults.score_strategy);
  EXPECT_EQ(options.return_attention_scores, defaults.return_attention_scores);
  EXPECT_EQ(options.training, defaults.training);
  EXPECT_TRUE(options.attention_mask.empty());
  EXPECT_TRUE(options.attention_bias.empty());
}

// Each file's expected output depends on its settings: the file's options meet it, default
// options do not (so the comparison would catch a setting lost on the way).
TEST(LayerFileSettings, TheFilesOptionsGiveTheExpectedOutput) {
  for (const char* name : {"goldens/keras_causal_f64", "semantics/scale_keras_f64",
                           "semantics/causal_bottom_right_t3_s5_keras_f64",
                           "semantics/causal_bottom_right_t6_s4_uniform_torch_f64",
                           "semantics/fully_masked_mask_uniform_keras_f64"}) {
    SCOPED_TRACE(name);
    const GoldenRun run = run_file(name);
    ASSERT_EQ(run.with_file_options.size(), run.expected.size());
    EXPECT_TRUE(all_near(run.with_file_options.data(), run.expected, kGoldenTolerance));
    EXPECT_FALSE(all_near(run.with_default_options.data(), run.expected, kGoldenTolerance));
  }
}

// docs/api.md's file-reader example prints output(0, 0, 0) of the causal golden file.
TEST(LayerFileSettings, TheCausalGoldenFirstOutputIsTheDocumentedOne) {
  const GoldenRun run = run_file("goldens/keras_causal_f64");
  EXPECT_NEAR(run.with_file_options[0], 0.0641, 5e-5);
  EXPECT_NEAR(run.expected[0], 0.0641, 5e-5);
}

}  // namespace
}  // namespace sdmha_test
