// from_keras.cpp — load a MultiHeadAttention layer exported from Keras (tools/cli/sdmha_export.py)
// and its inputs from a safetensors file, run it, and compare with the output Keras' math gave.
//
//   from_keras [layer.safetensors]   (default: data/keras_layer.safetensors, shipped beside it)
#include <sdmha/io/layer_files.hpp>
#include <sdmha/sdmha.hpp>

#include <cmath>
#include <cstdio>
#include <string>

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : "data/keras_layer.safetensors";
  try {
    const auto source = sdmha::io::TensorSource::open(path);
    // Weights in Keras' names (query/kernel (Eq, H, Dk), ...); num_heads, key_dim and the causal
    // flag come from the file's metadata. PyTorch's names load the same way.
    const auto layer_file = sdmha::io::load_layer<double>(source);
    const auto inputs = sdmha::io::load_inputs<double>(source);
    const sdmha::SparseDenseMHA<double> layer(layer_file.config, layer_file.weights);

    // The file's attention settings (causal mask, its alignment, scale, the policy for fully
    // masked rows), then views of its mask and bias (any of their broadcast shapes; `inputs`
    // outlives the call).
    auto options = layer_file.attention_options();
    options.attention_mask = inputs.attention_mask;
    options.attention_bias = inputs.attention_bias;
    const auto result = layer.forward(inputs.query, {inputs.key, inputs.value}, options);

    std::printf("layer: %ld heads, key_dim %ld, query (%ld, %ld, %ld) with %ld stored values\n",
                long(layer_file.config.num_heads), long(layer_file.config.key_dim),
                long(inputs.query.batch()), long(inputs.query.steps()),
                long(inputs.query.features()), long(inputs.query.nonzeros()));
    std::printf("output[0, 0, 0:4] = %.8f %.8f %.8f %.8f\n", result.output(0, 0, 0),
                result.output(0, 0, 1), result.output(0, 0, 2), result.output(0, 0, 3));
    if (source.contains("expected/output")) {
      const auto expected = source.read<double>("expected/output");
      double worst = 0;
      for (std::size_t i = 0; i < expected.size(); ++i)
        worst = std::max(
            worst, std::abs(result.output.data()[i] - expected[i]) / (1 + std::abs(expected[i])));
      std::printf("max relative difference from Keras: %.3g\n", worst);
      return worst <= 1e-10 ? 0 : 1;
    }
    return 0;
  } catch (const sdmha::Error& error) {
    std::fprintf(stderr, "from_keras: %s\n", error.what());
    return 1;
  }
}
