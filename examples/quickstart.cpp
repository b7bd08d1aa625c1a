// quickstart.cpp — a sparse multi-hot query over a dense context, through SparseDenseMHA, checked
// against the dense baseline, then one training step: backward and an in-place update of the
// layer's weights. The calls are the README's quickstart. Copy it into your project and replace
// the random inputs; the check against DenseMHA, the bench's dense baseline, needs bench/ on the
// include path (-I bench; DenseMHA is not part of the library's API).
#include <sdmha/sdmha.hpp>

#include "dense_mha.hpp"  // DenseMHA, the dense baseline: bench/dense_mha.hpp, not part of the API

#include <cstdint>
#include <cstdio>
#include <random>
#include <utility>

int main() {
  const Eigen::Index batch = 2, steps = 16, key_steps = 32, features = 32768, per_row = 40;

  sdmha::MhaConfig config;
  config.num_heads = 8;
  config.key_dim = 64;
  config.output_dim = 512;  // 0 (the default) is Keras' output_shape=None: the query's width
  auto weights = sdmha::MhaWeights<float>::glorot_uniform(config, /*query_dim=*/32768,
                                                          /*key_in_dim=*/512, /*value_in_dim=*/512,
                                                          /*seed=*/42);
  sdmha::SparseDenseMHA<float> layer(config, std::move(weights));  // the layer owns its weights

  // The query in TensorFlow's SparseTensor convention: (batch, step, feature) and a value each.
  std::mt19937 random(7);
  std::uniform_int_distribution<std::int64_t> feature(0, features - 1);
  std::normal_distribution<float> normal;
  Eigen::Matrix<std::int64_t, Eigen::Dynamic, 3, Eigen::RowMajor> indices(batch * steps * per_row,
                                                                          3);
  Eigen::VectorXf values(indices.rows());
  for (Eigen::Index i = 0; i < indices.rows(); ++i) {
    indices.row(i) << i / (steps * per_row), (i / per_row) % steps, feature(random);
    values[i] = normal(random);  // a repeated (batch, step, feature) is summed
  }
  auto query = sdmha::SparseQuery<float>::from_coo(batch, steps, 32768, indices, values);

  Eigen::Tensor<float, 3, Eigen::RowMajor> key(batch, key_steps, 512), value(batch, key_steps, 512);
  key.setRandom();
  value.setRandom();
  sdmha::AttentionOptions<float>
      options;  // attention_mask, use_causal_mask, return_attention_scores, num_threads
  options.use_causal_mask = true;
  sdmha::AttentionResult<float> result = layer.forward(query, {key, value}, options);
  // result.output: Eigen::Tensor<float, 3, RowMajor> (B, T, O)
  // result.attention_scores: Eigen::Tensor<float, 4, RowMajor> (B, H, T, S), empty unless asked for

  // The dense baseline on the same weights, shared with the layer (no copy):
  // forward(dense_query (B, T, Eq), {key, value}, options).
  sdmha::DenseMHA<float> baseline(config, layer.shared_weights());
  const sdmha::RowMatrix<float> dense = query.to_dense();
  Eigen::TensorMap<const Eigen::Tensor<const float, 3, Eigen::RowMajor>> dense_query(
      dense.data(), batch, steps, features);
  const auto reference = baseline.forward(dense_query, {key, value}, options);

  const Eigen::Tensor<float, 0, Eigen::RowMajor> difference =
      (result.output - reference.output).abs().maximum();
  std::printf("output (%ld, %ld, %ld), %ld stored query values (%.2f%% dense)\n",
              long(result.output.dimension(0)), long(result.output.dimension(1)),
              long(result.output.dimension(2)), long(query.nonzeros()),
              100.0 * double(query.nonzeros()) / double(batch * steps * features));
  std::printf("output[0, 0, 0:4] = %.6f %.6f %.6f %.6f\n", result.output(0, 0, 0),
              result.output(0, 0, 1), result.output(0, 0, 2), result.output(0, 0, 3));
  std::printf("max |sparse - dense| = %.3g\n", double(difference()));

  // Training: d_output = ∂loss/∂output, (B, T, O); here the loss is ½·Σ output², so d_output is
  // the output itself. Gradients have the weights' names and shapes.
  auto loss = [](const Eigen::Tensor<float, 3, Eigen::RowMajor>& output) {
    const Eigen::Tensor<double, 0, Eigen::RowMajor> sum = output.cast<double>().square().sum();
    return 0.5 * sum();
  };
  const Eigen::Tensor<float, 3, Eigen::RowMajor> d_output = result.output;
  const double loss_before = loss(result.output);
  sdmha::MhaGradients<float> g = layer.backward(query, {key, value}, d_output, options);
  layer.weights().query_kernel -= 0.01f * g.query_kernel;  // in place: the next call sees it
  const double loss_after = loss(layer.forward(query, {key, value}, options).output);
  // To first order the step lowers the loss by 0.01·‖dWq‖².
  const double predicted = 0.01 * g.query_kernel.cast<double>().squaredNorm();
  const double lowered = loss_before - loss_after;
  std::printf("one step on the query kernel: loss %.9f -> %.9f (lowered %.3g, first order %.3g)\n",
              loss_before, loss_after, lowered, predicted);
  const bool stepped = lowered > 0.5 * predicted && lowered < 1.5 * predicted;
  return difference() < 1e-4f && stepped ? 0 : 1;
}
