// A consumer of sdmha::onednn: the bfloat16 mode with its projections on oneDNN's matmul (forced
// by SDMHA_BFLOAT16_GEMMS=onednn, which the test sets), within bfloat16's tolerance of the
// float32 layer. Exits non-zero when the engine was not taken or the output is off.
#include <sdmha/sdmha.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <utility>

int main() {
  const Eigen::Index batch = 2, steps = 8, key_steps = 24, features = 1000, per_row = 5;
  sdmha::MhaConfig config;
  config.num_heads = 4;
  config.key_dim = 16;
  auto weights = sdmha::MhaWeights<float>::glorot_uniform(config, features, 64, 64, 11);
  sdmha::SparseDenseMHA<float> layer(config, std::move(weights));

  Eigen::Matrix<std::int64_t, Eigen::Dynamic, 3, Eigen::RowMajor> indices(batch * steps * per_row,
                                                                          3);
  Eigen::VectorXf values(indices.rows());
  for (Eigen::Index i = 0; i < indices.rows(); ++i) {
    indices.row(i) << i / (steps * per_row), (i / per_row) % steps, (i * 37) % features;
    values[i] = float(i % 7) - 3.f;
  }
  const auto query = sdmha::SparseQuery<float>::from_coo(batch, steps, features, indices, values);
  Eigen::Tensor<float, 3, Eigen::RowMajor> key(batch, key_steps, 64), value(batch, key_steps, 64);
  key.setRandom();
  value.setRandom();

  const auto float32 = layer.forward(query, {key, value}).output;
  layer.set_precision(sdmha::Precision::bfloat16);
  const auto bfloat16 = layer.forward(query, {key, value}).output;
  const Eigen::Tensor<float, 0, Eigen::RowMajor> difference = (bfloat16 - float32).abs().maximum();
  const Eigen::Tensor<float, 0, Eigen::RowMajor> largest = float32.abs().maximum();
  std::printf("engine %s, max |bfloat16 - float32| = %.3g (max |float32| %.3g)\n",
              layer.bfloat16_gemm_engine(), double(difference()), double(largest()));
  const bool on_onednn = std::strcmp(layer.bfloat16_gemm_engine(), "onednn") == 0;
  return on_onednn && std::isfinite(difference()) && difference() < 0.05f * largest() ? 0 : 1;
}
