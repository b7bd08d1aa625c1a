// bag_of_words.cpp — multi-hot bag-of-words queries (32768-word vocabulary, 1 % of it per step)
// attending over a dense context: the sparse layer against densify-then-dense, time and memory of
// one call each. (sdmha_bench measures this properly: medians, every stage, both thread counts.)
#include <sdmha/sdmha.hpp>

#include "dense_mha.hpp"  // DenseMHA, the dense baseline: bench/dense_mha.hpp, not part of the API

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

int main() {
  // The `bow` workload of the bench, smaller in batch so that it runs in a second or two.
  const Eigen::Index batch = 2, steps = 128, key_steps = 256, vocabulary = 32768, width = 512;
  const Eigen::Index words_per_step = vocabulary / 100;
  sdmha::MhaConfig config;
  config.num_heads = 8;
  config.key_dim = 64;
  config.output_dim = width;
  // One set of weights (Wq alone is 32768 × 512), shared by both layers: no copy.
  const auto weights = std::make_shared<sdmha::MhaWeights<float>>(
      sdmha::MhaWeights<float>::glorot_uniform(config, vocabulary, width, width, 3));
  const sdmha::SparseDenseMHA<float> layer(config, weights);
  const sdmha::DenseMHA<float> baseline(config, weights);

  // Each step holds `words_per_step` distinct words, with counts as values.
  std::mt19937 random(11);
  std::vector<std::int64_t> words(static_cast<std::size_t>(vocabulary));
  std::iota(words.begin(), words.end(), 0);
  Eigen::Matrix<std::int64_t, Eigen::Dynamic, 3, Eigen::RowMajor> indices(
      batch * steps * words_per_step, 3);
  Eigen::VectorXf counts(indices.rows());
  std::uniform_int_distribution<int> count(1, 3);
  for (Eigen::Index row = 0; row < batch * steps; ++row) {
    std::shuffle(words.begin(), words.end(), random);
    for (Eigen::Index k = 0; k < words_per_step; ++k) {
      indices.row(row * words_per_step + k) << row / steps, row % steps, words[k];
      counts[row * words_per_step + k] = float(count(random));
    }
  }
  const auto query = sdmha::SparseQuery<float>::from_coo(batch, steps, vocabulary, indices, counts);
  Eigen::Tensor<float, 3, Eigen::RowMajor> context(batch, key_steps, width);
  context.setRandom();
  sdmha::AttentionOptions<float> options;
  options.num_threads = 1;

  using Clock = std::chrono::steady_clock;
  auto milliseconds = [](Clock::duration d) {
    return std::chrono::duration<double, std::milli>(d).count();
  };
  const auto sparse_start = Clock::now();
  const auto sparse = layer.forward(query, {context, context}, options);  // key = value
  const double sparse_ms = milliseconds(Clock::now() - sparse_start);

  const auto dense_start = Clock::now();
  const sdmha::RowMatrix<float> dense = query.to_dense();
  Eigen::TensorMap<const Eigen::Tensor<const float, 3, Eigen::RowMajor>> dense_query(
      dense.data(), batch, steps, vocabulary);
  const auto reference = baseline.forward(dense_query, {context, context}, options);
  const double dense_ms = milliseconds(Clock::now() - dense_start);

  const double csr_bytes = double(query.nonzeros()) * (sizeof(float) + sizeof(int)) +
                           double(batch * steps + 1) * sizeof(int);
  const double dense_bytes = double(batch * steps * vocabulary) * sizeof(float);
  const Eigen::Tensor<float, 0, Eigen::RowMajor> difference =
      (sparse.output - reference.output).abs().maximum();
  std::printf("bag of words: B=%ld T=%ld vocabulary=%ld, %ld words per step, S=%ld, one thread\n",
              long(batch), long(steps), long(vocabulary), long(words_per_step), long(key_steps));
  std::printf("sparse layer:       %8.2f ms   query %8.2f MB (CSR)\n", sparse_ms, csr_bytes / 1e6);
  std::printf("densify + dense:    %8.2f ms   query %8.2f MB (dense)\n", dense_ms,
              dense_bytes / 1e6);
  std::printf("speedup %.1fx, query memory %.0fx smaller, max |sparse - dense| = %.3g\n",
              dense_ms / sparse_ms, dense_bytes / csr_bytes, double(difference()));
  return difference() < 1e-3f ? 0 : 1;
}
