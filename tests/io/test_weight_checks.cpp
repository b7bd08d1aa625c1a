// Tests of sdmha/io/detail/finite_weights.hpp and of the loaders that call it (io/layer_files.hpp,
// io/keras_file.hpp, io/keras_isolated.hpp): a NaN or ±Inf weight is a FormatError naming the
// file, the tensor and its first bad entry, unless allow_non_finite_weights.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "sdmha/io/layer_files.hpp"

#ifdef SDMHA_HAS_KERAS_IO
#include "sdmha/io/keras_isolated.hpp"
#endif

namespace {

using sdmha::Index;

sdmha::MhaWeights<double> small_weights() {
  sdmha::MhaConfig config;
  config.num_heads = 2;
  config.key_dim = 3;
  return sdmha::MhaWeights<double>::glorot_uniform(config, 5, 4, 4, 9);
}

std::string refusal(const sdmha::MhaWeights<double>& weights) {
  try {
    sdmha::detail::check_finite_weights("test", "'w.bin'", weights);
  } catch (const sdmha::FormatError& error) {
    return error.what();
  }
  return "accepted";
}

TEST(FiniteWeights, NamesTheTensorTheValueAndTheFirstBadEntry) {
  auto weights = small_weights();
  EXPECT_EQ(refusal(weights), "accepted");
  weights.key_kernel(2, 4) = std::numeric_limits<double>::quiet_NaN();
  weights.key_kernel(3, 1) = std::numeric_limits<double>::infinity();  // later in row order
  const std::string message = refusal(weights);
  EXPECT_NE(message.find("'w.bin': the key kernel holds NaN at (2, 4)"), std::string::npos)
      << message;
  weights = small_weights();
  weights.output_bias[3] = -std::numeric_limits<double>::infinity();
  EXPECT_NE(refusal(weights).find("the output bias holds -Inf at (3, 0)"), std::string::npos)
      << refusal(weights);
  weights = small_weights();
  weights.query_kernel(0, 0) = std::numeric_limits<double>::infinity();
  EXPECT_NE(refusal(weights).find("the query kernel holds +Inf at (0, 0)"), std::string::npos);
}

// A Keras-layout layer file whose value kernel holds a NaN at flattened (1, 2).
sdmha::io::TensorSource layer_file_with_nan() {
  const auto weights = small_weights();
  sdmha::io::SafetensorsWriter writer;
  const auto add = [&](const std::string& name, std::vector<std::int64_t> shape, const double* data,
                       Index count, Index nan_at = -1) {
    std::vector<double> values(data, data + count);
    if (nan_at >= 0) values[std::size_t(nan_at)] = std::numeric_limits<double>::quiet_NaN();
    writer.add(name, sdmha::io::DType::F64, std::move(shape), values.data(),
               values.size() * sizeof(double));
  };
  const auto& w = weights;
  add("query/kernel", {5, 2, 3}, w.query_kernel.data(), w.query_kernel.size());
  add("query/bias", {2, 3}, w.query_bias.data(), w.query_bias.size());
  add("key/kernel", {4, 2, 3}, w.key_kernel.data(), w.key_kernel.size());
  add("key/bias", {2, 3}, w.key_bias.data(), w.key_bias.size());
  add("value/kernel", {4, 2, 3}, w.value_kernel.data(), w.value_kernel.size(), 1 * 6 + 2);
  add("value/bias", {2, 3}, w.value_bias.data(), w.value_bias.size());
  add("attention_output/kernel", {2, 3, 5}, w.output_kernel.data(), w.output_kernel.size());
  add("attention_output/bias", {5}, w.output_bias.data(), w.output_bias.size());
  return sdmha::io::TensorSource(
      sdmha::io::SafetensorsFile::from_bytes(writer.to_bytes(), "nan.safetensors"));
}

TEST(FiniteWeights, LayerFilesRefuseANaNUnlessAllowed) {
  const auto source = layer_file_with_nan();
  try {
    sdmha::io::load_layer<double>(source);
    FAIL() << "a NaN weight was loaded";
  } catch (const sdmha::FormatError& error) {
    EXPECT_NE(std::string(error.what()).find("nan.safetensors"), std::string::npos);
    EXPECT_NE(std::string(error.what()).find("the value kernel holds NaN at (1, 2)"),
              std::string::npos)
        << error.what();
  }
  sdmha::io::LayerFileOptions options;
  options.allow_non_finite_weights = true;
  const auto layer = sdmha::io::load_layer<double>(source, options);
  EXPECT_TRUE(std::isnan(layer.weights.value_kernel(1, 2)));
}

#ifdef SDMHA_HAS_KERAS_IO

// functional_bias.weights.h5 with the float32 of the query kernel's entry (0, 1) overwritten by a
// NaN (tests/data/keras/damaged/README.md).
std::string nan_keras_file() {
  return std::string(SDMHA_TEST_DATA_DIR) + "/keras/damaged/nan_query_kernel.weights.h5";
}

TEST(FiniteWeights, KerasFilesRefuseANaNInProcessAndIsolatedUnlessAllowed) {
  const std::string expected = "the query kernel holds NaN at (0, 1)";
  for (const bool isolated : {false, true}) {
    SCOPED_TRACE(isolated ? "isolated" : "in process");
    const auto load = [&](const sdmha::io::KerasReadOptions& options) {
      return isolated ? sdmha::io::load_keras_layer_isolated<float>(nan_keras_file(), "", options)
                      : sdmha::io::load_keras_layer<float>(nan_keras_file(), "", options);
    };
    try {
      load({});
      ADD_FAILURE() << "a NaN weight was loaded";
    } catch (const sdmha::FormatError& error) {
      EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << error.what();
      EXPECT_NE(std::string(error.what()).find("nan_query_kernel.weights.h5"), std::string::npos);
    }
    sdmha::io::KerasReadOptions allow;
    allow.allow_non_finite_weights = true;
    EXPECT_TRUE(std::isnan(load(allow).weights.query_kernel(0, 1)));
  }
}

#endif  // SDMHA_HAS_KERAS_IO

}  // namespace
