// bench/workloads.hpp — the canonical workloads (bench/workloads.md): shapes, random inputs
// and the floating-point work of one forward pass.
//
// Generation, fixed seeds, float32: every query row holds max(1, round(density·Eq)) values at
// distinct feature columns drawn uniformly at random, values ~ N(0, 1); key and value are
// separate dense (B, S, E) tensors ~ N(0, 1); weights are MhaWeights::glorot_uniform (biases
// zero). The random streams are mt19937_64 turned into numbers by hand (no std::*_distribution,
// whose output differs between standard libraries), so inputs are the same everywhere.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <sdmha/sdmha.hpp>
#include <string>
#include <utility>
#include <vector>

namespace sdmha_bench {

using Eigen::Index;
using Tensor3 = Eigen::Tensor<float, 3, Eigen::RowMajor>;

// One seed per input, shared by every workload and density.
constexpr std::uint64_t kWeightSeed = 1;
constexpr std::uint64_t kQuerySeed = 2;
constexpr std::uint64_t kKeySeed = 3;
constexpr std::uint64_t kValueSeed = 4;
constexpr std::uint64_t kOutputGradientSeed = 5;

struct WorkloadShape {
  std::string name;
  Index batch;        // B
  Index steps;        // T
  Index query_dim;    // Eq
  Index key_steps;    // S
  Index context_dim;  // Ek = Ev
  Index heads;        // H
  Index head_dim;     // Dk = Dv
  Index output_dim;   // O
  std::vector<double> densities;

  // {num_heads, key_dim, value_dim, output_dim, use_bias}
  sdmha::MhaConfig config() const {
    return sdmha::MhaConfig{heads, head_dim, head_dim, output_dim, true};
  }
  Index nonzeros_per_row(double density) const {
    return std::max<Index>(1, Index(std::llround(density * double(query_dim))));
  }
};

// The table of bench/workloads.md.
inline std::vector<WorkloadShape> canonical_workloads() {
  return {
      {"seed", 32, 128, 512, 128, 512, 8, 64, 512, {0.01, 0.05, 0.10}},
      {"bow", 8, 128, 32768, 256, 512, 8, 64, 512, {0.001, 0.01}},
      {"long", 2, 2048, 512, 2048, 512, 8, 64, 512, {0.05}},
  };
}

// Workloads measured for memory only (`--summary --workload NAME`): one forward from a fresh
// workspace, its peak heap, checked against the dense layer. Not in the canonical list: their
// dense references (B·H·T × S scores) would take gigabytes. long16k is long with S = 16384, where
// K and V projected whole would take 128 MB.
inline std::vector<WorkloadShape> memory_workloads() {
  return {{"long16k", 2, 2048, 512, 16384, 512, 8, 64, 512, {0.05}}};
}

// The same workloads with batch and sequence lengths cut down (widths and densities unchanged),
// for smoke runs: `--quick`.
inline std::vector<WorkloadShape> quick_workloads() {
  std::vector<WorkloadShape> shapes = canonical_workloads();
  shapes[0].batch = 4;  // seed: B 32 → 4
  shapes[1].batch = 1;  // bow:  B 8 → 1
  shapes[2].batch = 1;  // long: B 2 → 1, T = S 2048 → 512
  shapes[2].steps = shapes[2].key_steps = 512;
  return shapes;
}

// The floating-point work of one forward pass, 2 per multiply-add, as bench/workloads.md counts it.
struct FlopCounts {
  double query_projection_dense = 0;   // 2·B·T·Eq·H·Dk
  double query_projection_sparse = 0;  // 2·nnz·H·Dk
  double key_value_projection = 0;     // 2·B·S·Ek·H·Dk + 2·B·S·Ev·H·Dv
  double scores = 0;                   // 2·B·H·T·S·Dk
  double attend_values = 0;            // 2·B·H·T·S·Dv
  double output_projection = 0;        // 2·B·T·H·Dv·O

  double shared() const {
    return key_value_projection + scores + attend_values + output_projection;
  }
  double dense_total() const { return query_projection_dense + shared(); }
  double sparse_total() const { return query_projection_sparse + shared(); }
  // At equal efficiency, how much faster the sparse layer can be.
  double ideal_speedup() const { return dense_total() / sparse_total(); }
};

inline FlopCounts flop_counts(const WorkloadShape& w, Index nonzeros) {
  const double B = double(w.batch), T = double(w.steps), S = double(w.key_steps);
  const double H = double(w.heads), D = double(w.head_dim);
  FlopCounts flops;
  flops.query_projection_dense = 2 * B * T * double(w.query_dim) * H * D;
  flops.query_projection_sparse = 2 * double(nonzeros) * H * D;
  flops.key_value_projection = 2 * (2 * B * S * double(w.context_dim) * H * D);
  flops.scores = 2 * B * H * T * S * D;
  flops.attend_values = 2 * B * H * T * S * D;
  flops.output_projection = 2 * B * T * H * D * double(w.output_dim);
  return flops;
}

// The regrouped score kernel (ScoreStrategy::sparse_regrouped) works per (b, h) on the U_b
// distinct features that batch b's rows use: 2·U_b·Dk·S + 2·nnz_b·S. With k distinct random
// columns per row, E[U_b] = Eq·(1 − (1 − k/Eq)^T). It pays off only when U_b is well below T.
inline double regrouped_score_flops(const WorkloadShape& w, double density) {
  const double k = double(w.nonzeros_per_row(density)), Eq = double(w.query_dim);
  const double T = double(w.steps), S = double(w.key_steps), D = double(w.head_dim);
  const double used_features = Eq * (1.0 - std::pow(1.0 - k / Eq, T));
  return double(w.batch) * double(w.heads) * (2 * used_features * D * S + 2 * T * k * S);
}

// The bench times the regrouped path where it costs fewer FLOPs than the dense layer; beyond
// that (bow at density 0.01: ~50 GFLOP) it is known to lose and would take most of the run.
inline bool regrouped_is_timed(const WorkloadShape& w, double density) {
  const Index nonzeros = w.batch * w.steps * w.nonzeros_per_row(density);
  return regrouped_score_flops(w, density) <= flop_counts(w, nonzeros).dense_total();
}

// Uniform and normal numbers from mt19937_64, computed the same way on every platform.
class RandomStream {
 public:
  explicit RandomStream(std::uint64_t seed) : generator_(seed) {}

  double unit() { return double(generator_() >> 11) * 0x1.0p-53; }  // [0, 1)
  Index below(Index bound) { return std::min(bound - 1, Index(unit() * double(bound))); }
  // Box–Muller; 1 − unit() is in (0, 1], so the logarithm is finite.
  float normal() {
    const double radius = std::sqrt(-2.0 * std::log(1.0 - unit()));
    return float(radius * std::cos(2.0 * 3.14159265358979323846 * unit()));
  }

 private:
  std::mt19937_64 generator_;
};

// The (B, T, Eq) sparse query, built through SparseQuery::from_coo as a user would.
inline sdmha::SparseQuery<float> make_sparse_query(const WorkloadShape& w, double density,
                                                   std::uint64_t seed) {
  using Query = sdmha::SparseQuery<float>;
  const Index rows = w.batch * w.steps, per_row = w.nonzeros_per_row(density);
  Query::CooIndices indices(rows * per_row, 3);
  sdmha::Vector<float> values(rows * per_row);
  RandomStream random(seed);
  // A partial Fisher–Yates shuffle per row: its first per_row entries are a uniformly random
  // set of distinct columns, whatever order earlier rows left the permutation in.
  std::vector<std::int64_t> columns(static_cast<std::size_t>(w.query_dim));
  std::iota(columns.begin(), columns.end(), std::int64_t(0));
  Index entry = 0;
  for (Index row = 0; row < rows; ++row) {
    for (Index k = 0; k < per_row; ++k) {
      std::swap(columns[k], columns[k + random.below(w.query_dim - k)]);
      indices(entry, 0) = row / w.steps;
      indices(entry, 1) = row % w.steps;
      indices(entry, 2) = columns[k];
      values[entry] = random.normal();
      ++entry;
    }
  }
  return Query::from_coo(w.batch, w.steps, w.query_dim, indices, values);
}

inline Tensor3 make_dense_input(Index batch, Index steps, Index width, std::uint64_t seed) {
  Tensor3 tensor(batch, steps, width);
  RandomStream random(seed);
  for (Index i = 0; i < tensor.size(); ++i) tensor.data()[i] = random.normal();
  return tensor;
}

// One workload's inputs at one density, as bench/workloads.md builds them: the sparse query, key,
// value, ∂loss/∂output, and the layer's weights (glorot_uniform, kWeightSeed).
struct WorkloadInputs {
  WorkloadInputs(const WorkloadShape& workload, double query_density)
      : shape(workload),
        density(query_density),
        query(make_sparse_query(workload, query_density, kQuerySeed)),
        key(make_dense_input(workload.batch, workload.key_steps, workload.context_dim, kKeySeed)),
        value(
            make_dense_input(workload.batch, workload.key_steps, workload.context_dim, kValueSeed)),
        d_output(make_dense_input(workload.batch, workload.steps, workload.output_dim,
                                  kOutputGradientSeed)) {}

  sdmha::MhaWeights<float> make_weights() const {
    return sdmha::MhaWeights<float>::glorot_uniform(
        shape.config(), shape.query_dim, shape.context_dim, shape.context_dim, kWeightSeed);
  }

  const WorkloadShape shape;
  const double density;
  const sdmha::SparseQuery<float> query;
  const Tensor3 key, value;
  const Tensor3 d_output;  // ∂loss/∂output for the backward
};

// The query's own bytes in each form.
inline double csr_bytes(const sdmha::SparseQuery<float>& query) {
  return double(query.nonzeros()) * double(sizeof(float) + sizeof(int)) +
         double(query.rows() + 1) * double(sizeof(int));
}
inline double dense_query_bytes(const WorkloadShape& w) {
  return double(w.batch) * double(w.steps) * double(w.query_dim) * double(sizeof(float));
}

}  // namespace sdmha_bench
