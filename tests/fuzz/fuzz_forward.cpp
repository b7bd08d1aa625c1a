// tests/fuzz/fuzz_forward.cpp — a small forward pass against the float64 reference.
//
// The bytes choose the dimensions (B, T, S ≤ 6, or T up to 70 to cross a query tile; Eq, Ek, Ev
// ≤ 12; H ≤ 3; Dk, Dv ≤ 5), the projection biases, the masks (an attention mask of any broadcast
// shape (T, S), (B, T, S), (B', H', T, S) with B' ∈ {1, B}, H' ∈ {1, H}; causal top-left or
// bottom-right; a key mask), an attention bias of any of those shapes with −∞ entries, the scale,
// the policy for fully masked rows, the score strategy, the thread count and every value. Weights,
// inputs and bias values are multiples of 1/16, exact in float and double, optionally scaled so
// that logits reach about ±1e4 (inputs of extreme values, such as the crafted bfloat16 seeds,
// take them to about ±1.5e6). Key and value rows that every query of their batch entry is blocked
// from (by any mask or a −∞ bias, for every head) are filled with NaN, ±Inf or huge values under
// the zeros policy: they must not reach the output. SparseDenseMHA<double> and <float>,
// DenseMHA<double> on the densified query, and a forward over a ProjectedContext must all agree
// with tests/reference/reference_mha.hpp; in double the backward's gradients, the bias gradient
// included, are bitwise the same for one thread and several, and the bias gradient is 0 wherever
// every (b, h) it serves is blocked.
//
// The bfloat16 mode: when the top bit of the semantics byte is set (half the inputs; its other
// bits decode as they did before the bit was used, so every input keeps its problem), the same
// problem also runs through SparseDenseMHA<float> after set_precision(Precision::bfloat16). Its
// output must lie within bounds around tests/reference's float64 model of the mode (Wq, Wk, Wv,
// Wo, the key, the value and the heads rounded to bfloat16 as their projections read them,
// scale·q and k in the scores, p and v in P·V), bounds that carry float32's own error through:
// zero where float32 is exact (as most of the fuzzer's sums of multiples of 1/16 are), one
// bfloat16 step where float32's error could reach across a rounding boundary, and float32-tight
// probabilities at any logit size (see "the bfloat16 mode" below). Value tiles holding NaN or
// ±Inf (the poison behind full blocking) must take the float32 product that skips zero
// probabilities instead; tiles whose entries may reach 2¹²⁷ (float32's sums may round either
// way there) are held to either product; the poison must never reach the output. Also: the
// returned probabilities within their float32 bounds, the same bits on one thread and over the
// mode's own ProjectedContext, and sparse_regrouped refused with a ConfigError. S ≤ 6, so the
// online softmax (S > 512) is not reached; tests/layer/test_bfloat16_layer.cpp covers it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <sdmha/sdmha.hpp>

#include "dense_mha.hpp"  // DenseMHA, the bench's dense baseline (bench/)

#include "fuzz_support.hpp"
#include "reference/reference_mha.hpp"

namespace {

using sdmha::Index;

struct Setup {
  sdmha_reference::Problem problem;
  bool use_bias = true;
  int threads = 1;
  sdmha::ScoreStrategy strategy = sdmha::ScoreStrategy::automatic;
  bool has_key_mask = false;
  // The attention mask's and bias's shapes: (B', H', rank) with rank 2 (T, S), 3 (B, T, S) or 4;
  // rank 0: none. The reference holds a rank-3 mask in attention_mask, the others in
  // broadcast_mask.
  int mask_rank = 0, bias_rank = 0;
  long mask_batch = 1, mask_heads = 1, bias_batch = 1, bias_heads = 1;
  bool bottom_right = false, uniform = false;
  double scale = 0.0;  // 0: unset (1/√Dk)
  // −∞ bias entries beside the drawn ones (a short input draws few): 0 none, 1 where
  // (t + s) % 3 = 0, 2 every entry of even rows t, 3 every entry.
  int minus_infinity_pattern = 0;
  std::vector<std::int64_t> coo;  // nnz × 3
  std::vector<double> coo_values;
  std::vector<char> blocked_everywhere;  // B·S: no query of batch b may attend to key step s
  bool bfloat16 = false;                 // also run SparseDenseMHA<float> in Precision::bfloat16
};

double consume_weight(FuzzedDataProvider& provider) {
  return double(provider.ConsumeIntegralInRange<int>(-8, 8)) / 16.0;
}
double consume_input(FuzzedDataProvider& provider) {
  return double(provider.ConsumeIntegralInRange<int>(-64, 64)) / 16.0;
}
double consume_poison(FuzzedDataProvider& provider) {
  constexpr double poisons[] = {std::numeric_limits<double>::quiet_NaN(),
                                std::numeric_limits<double>::infinity(),
                                -std::numeric_limits<double>::infinity(),
                                1e300,
                                -1e300,
                                3.0e38,
                                0.0};
  return provider.PickValueInArray(poisons);
}
// An attention bias entry: a multiple of 1/16 in [−4, 4], or −∞ (one in eight).
double consume_bias(FuzzedDataProvider& provider) {
  const int k = provider.ConsumeIntegralInRange<int>(-64, 72);
  return k > 64 ? -std::numeric_limits<double>::infinity() : double(k) / 16.0;
}

// A broadcast shape: 0 none, 1 (T, S), 2 (B, T, S), 3 (1, T, S), 4 (B, 1, T, S), 5 (B, H, T, S),
// 6 (1, H, T, S), 7 (1, 1, T, S), as the rank and (B', H') it is given with.
void broadcast_shape(int code, long batch, long heads, int& rank, long& shape_batch,
                     long& shape_heads) {
  constexpr int ranks[] = {0, 2, 3, 3, 4, 4, 4, 4};
  rank = ranks[code];
  shape_batch = code == 2 || code == 4 || code == 5 ? batch : 1;
  shape_heads = code == 5 || code == 6 ? heads : 1;
}

// The attention mask, bias and key mask, drawn before the weights so that short inputs reach
// them too.
void decode_masks(FuzzedDataProvider& provider, Setup& setup) {
  auto& p = setup.problem;
  const long B = p.batch, T = p.steps, S = p.key_steps;
  if (setup.mask_rank != 0) {
    auto& mask =
        setup.mask_rank == 3 && setup.mask_batch == B ? p.attention_mask : p.broadcast_mask;
    p.mask_batch = setup.mask_batch;
    p.mask_heads = setup.mask_heads;
    mask.resize(static_cast<std::size_t>(setup.mask_batch * setup.mask_heads * T * S));
    for (char& allowed : mask) allowed = provider.ConsumeIntegralInRange<int>(0, 3) != 0;
  }
  if (setup.bias_rank != 0) {
    p.bias_batch = setup.bias_batch;
    p.bias_heads = setup.bias_heads;
    p.attention_bias.resize(static_cast<std::size_t>(setup.bias_batch * setup.bias_heads * T * S));
    for (double& entry : p.attention_bias) entry = consume_bias(provider);
    const int pattern = setup.minus_infinity_pattern;
    for (std::size_t i = 0; i < p.attention_bias.size(); ++i) {
      const long t = long(i) / S % T, s = long(i) % S;
      if ((pattern == 1 && (t + s) % 3 == 0) || (pattern == 2 && t % 2 == 0) || pattern == 3)
        p.attention_bias[i] = -std::numeric_limits<double>::infinity();
    }
  }
  if (setup.has_key_mask) {  // one key step in five blocked (padding)
    p.key_mask.resize(static_cast<std::size_t>(B * S));
    for (char& allowed : p.key_mask) allowed = provider.ConsumeIntegralInRange<int>(0, 4) != 0;
  }
  setup.blocked_everywhere.assign(static_cast<std::size_t>(B * S), 1);
  for (long b = 0; b < B; ++b)
    for (long h = 0; h < p.heads; ++h)
      for (long s = 0; s < S; ++s)
        for (long t = 0; t < T; ++t)
          if (sdmha_reference::allowed(p, b, h, t, s) &&
              sdmha_reference::bias_at(p, b, h, t, s) != -std::numeric_limits<double>::infinity())
            setup.blocked_everywhere[std::size_t(b * S + s)] = 0;
}

// One byte: the causal alignment, the fully masked rows policy, the scale, the −∞ pattern and,
// in its top bit, the bfloat16 leg. The low seven bits decode as they did when the byte was drawn
// from 0 to 127 (one byte, taken modulo 128), so every input keeps the problem it had then.
void decode_semantics(int semantics, Setup& setup) {
  setup.bottom_right = (semantics & 1) != 0;
  setup.uniform = (semantics & 2) != 0;
  constexpr double scales[] = {0.0, 0.5, -0.25, 1.5, 0.125, 0.0, 2.0, 0.0};  // 0: unset
  setup.scale = scales[(semantics >> 2) & 7];
  setup.minus_infinity_pattern = (semantics >> 5) & 3;
  setup.bfloat16 = (semantics & 128) != 0;
}

Setup decode(FuzzedDataProvider& provider) {
  Setup setup;
  auto& p = setup.problem;
  // The mask and bias shapes and the semantics first: libFuzzer's inputs start short, and a draw
  // past their end gives the range's minimum (none, top-left, zeros, the default scale).
  const int mask_code = provider.ConsumeIntegralInRange<int>(0, 7);
  const int bias_code = provider.ConsumeIntegralInRange<int>(0, 7);
  decode_semantics(provider.ConsumeIntegralInRange<int>(0, 255), setup);
  const bool long_steps = provider.ConsumeIntegralInRange<int>(0, 15) == 0;
  p.batch = provider.ConsumeIntegralInRange<long>(0, long_steps ? 1 : 6);
  p.steps = long_steps ? provider.ConsumeIntegralInRange<long>(60, 70)
                       : provider.ConsumeIntegralInRange<long>(0, 6);
  p.key_steps = provider.ConsumeIntegralInRange<long>(0, 6);
  p.query_dim = provider.ConsumeIntegralInRange<long>(1, 12);
  p.key_in_dim = provider.ConsumeIntegralInRange<long>(1, 12);
  p.value_in_dim = provider.ConsumeIntegralInRange<long>(1, 12);
  p.heads = provider.ConsumeIntegralInRange<long>(1, long_steps ? 1 : 3);
  p.key_dim = provider.ConsumeIntegralInRange<long>(1, 5);
  p.value_dim = provider.ConsumeIntegralInRange<long>(1, 5);
  p.output_dim = provider.ConsumeIntegralInRange<long>(1, 12);
  setup.use_bias = provider.ConsumeBool();
  p.causal = provider.ConsumeBool();
  broadcast_shape(mask_code, p.batch, p.heads, setup.mask_rank, setup.mask_batch, setup.mask_heads);
  setup.has_key_mask = provider.ConsumeBool();
  setup.strategy = provider.PickValueInArray({sdmha::ScoreStrategy::automatic,
                                              sdmha::ScoreStrategy::project_first,
                                              sdmha::ScoreStrategy::sparse_regrouped});
  setup.threads = provider.ConsumeIntegralInRange<int>(1, 3);
  // ×16 on the query and key kernels takes logits from tens to about ±1e4 (±1.5e6 at extremes).
  const double logit_scale = provider.ConsumeBool() ? 16.0 : 1.0;
  broadcast_shape(bias_code, p.batch, p.heads, setup.bias_rank, setup.bias_batch, setup.bias_heads);
  p.causal_offset = setup.bottom_right ? p.key_steps - p.steps : 0;
  p.uniform_fully_masked = setup.uniform;
  p.scale = setup.scale;
  decode_masks(provider, setup);

  const long hk = p.heads * p.key_dim, hv = p.heads * p.value_dim;
  auto fill = [&](std::vector<double>& target, long count, double scale) {
    target.resize(static_cast<std::size_t>(count));
    for (double& x : target) x = consume_weight(provider) * scale;
  };
  fill(p.query_kernel, p.query_dim * hk, logit_scale);
  fill(p.key_kernel, p.key_in_dim * hk, logit_scale);
  fill(p.value_kernel, p.value_in_dim * hv, 1.0);
  fill(p.output_kernel, hv * p.output_dim, 1.0);
  if (setup.use_bias) {
    fill(p.query_bias, hk, logit_scale);
    fill(p.key_bias, hk, logit_scale);
    fill(p.value_bias, hv, 1.0);
    fill(p.output_bias, p.output_dim, 1.0);
  }

  const long B = p.batch, T = p.steps, S = p.key_steps;
  // The query: entries at valid coordinates, duplicates allowed, in any order.
  p.query.assign(static_cast<std::size_t>(B * T * p.query_dim), 0.0);
  const long rows = B * T;
  const long entries =
      rows == 0 ? 0 : provider.ConsumeIntegralInRange<long>(0, std::min(3 * rows, 96L));
  for (long k = 0; k < entries; ++k) {
    const long b = provider.ConsumeIntegralInRange<long>(0, B - 1);
    const long t = provider.ConsumeIntegralInRange<long>(0, T - 1);
    const long e = provider.ConsumeIntegralInRange<long>(0, p.query_dim - 1);
    const double v = consume_input(provider);
    setup.coo.insert(setup.coo.end(), {b, t, e});
    setup.coo_values.push_back(v);
    p.query[std::size_t((b * T + t) * p.query_dim + e)] += v;
  }

  // Key and value; rows that no query may see get poison (sometimes). Not under the uniform
  // policy: there a fully masked row averages every value row, blocked ones included.
  const bool poison = provider.ConsumeBool() && !setup.uniform;
  auto fill_context = [&](std::vector<double>& target, long width) {
    target.resize(static_cast<std::size_t>(B * S * width));
    for (long b = 0; b < B; ++b)
      for (long s = 0; s < S; ++s)
        for (long e = 0; e < width; ++e)
          target[std::size_t((b * S + s) * width + e)] =
              poison && setup.blocked_everywhere[std::size_t(b * S + s)] ? consume_poison(provider)
                                                                         : consume_input(provider);
  };
  fill_context(p.key, p.key_in_dim);
  fill_context(p.value, p.value_in_dim);
  return setup;
}

template <typename Scalar>
sdmha::RowMatrix<Scalar> matrix(const std::vector<double>& data, long rows, long cols) {
  sdmha::RowMatrix<Scalar> result(rows, cols);
  for (long i = 0; i < rows * cols; ++i) result.data()[i] = Scalar(data[std::size_t(i)]);
  return result;
}
template <typename Scalar>
sdmha::Vector<Scalar> vector(const std::vector<double>& data) {
  sdmha::Vector<Scalar> result(Index(data.size()));
  for (std::size_t i = 0; i < data.size(); ++i) result[Index(i)] = Scalar(data[i]);
  return result;
}
// double → float of a poison value beyond float's range gives ±Inf (or NaN stays NaN); those
// rows are blocked, so any value is fine there.
template <typename Scalar>
Scalar as_scalar(double x) {
  return std::isfinite(x) && std::abs(x) > double(std::numeric_limits<Scalar>::max())
             ? std::copysign(std::numeric_limits<Scalar>::infinity(), Scalar(x > 0 ? 1 : -1))
             : Scalar(x);
}
template <typename Scalar>
Eigen::Tensor<Scalar, 3, Eigen::RowMajor> tensor(const std::vector<double>& data, long d0, long d1,
                                                 long d2) {
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> result(d0, d1, d2);
  for (long i = 0; i < d0 * d1 * d2; ++i)
    result.data()[i] = as_scalar<Scalar>(data[std::size_t(i)]);
  return result;
}

template <typename Scalar>
sdmha::MhaWeights<Scalar> weights_of(const sdmha_reference::Problem& p) {
  sdmha::MhaWeights<Scalar> weights;
  const long hk = p.heads * p.key_dim, hv = p.heads * p.value_dim;
  weights.query_kernel = matrix<Scalar>(p.query_kernel, p.query_dim, hk);
  weights.key_kernel = matrix<Scalar>(p.key_kernel, p.key_in_dim, hk);
  weights.value_kernel = matrix<Scalar>(p.value_kernel, p.value_in_dim, hv);
  weights.output_kernel = matrix<Scalar>(p.output_kernel, hv, p.output_dim);
  weights.query_bias = vector<Scalar>(p.query_bias);
  weights.key_bias = vector<Scalar>(p.key_bias);
  weights.value_bias = vector<Scalar>(p.value_bias);
  weights.output_bias = vector<Scalar>(p.output_bias);
  return weights;
}

// A mask or bias as a tensor of the rank the bytes chose, owned here for the options' view.
template <typename T>
struct Broadcast {
  int rank = 0;
  Eigen::Tensor<T, 2, Eigen::RowMajor> rank2;
  Eigen::Tensor<T, 3, Eigen::RowMajor> rank3;
  Eigen::Tensor<T, 4, Eigen::RowMajor> rank4;

  template <typename Source>
  Broadcast(int r, long batch, long heads, long steps, long key_steps,
            const std::vector<Source>& values)
      : rank(r) {
    T* data = nullptr;
    if (rank == 2) data = (rank2.resize(steps, key_steps), rank2.data());
    if (rank == 3) data = (rank3.resize(batch, steps, key_steps), rank3.data());
    if (rank == 4) data = (rank4.resize(batch, heads, steps, key_steps), rank4.data());
    for (std::size_t i = 0; rank != 0 && i < values.size(); ++i) data[i] = T(values[i]);
  }
  sdmha::BroadcastRef<T> ref() const {
    if (rank == 2) return rank2;
    if (rank == 3) return rank3;
    if (rank == 4) return rank4;
    return {};
  }
};

template <typename Scalar>
bool bitwise_equal(const Scalar* a, const Scalar* b, Index n) {
  return n == 0 || std::memcmp(a, b, sizeof(Scalar) * std::size_t(n)) == 0;
}

// |got − expected| ≤ tolerance · (1 + scale) entry by entry; NaN or Inf in `got` always fails.
template <typename Scalar>
void check_near(const Scalar* got, const std::vector<double>& expected, double tolerance,
                double scale) {
  for (std::size_t i = 0; i < expected.size(); ++i) {
    SDMHA_FUZZ_CHECK(std::isfinite(double(got[i])));
    SDMHA_FUZZ_CHECK(std::abs(double(got[i]) - expected[i]) <= tolerance * (1.0 + scale));
  }
}

// Every gradient, the bias gradient included, bitwise the same for one thread and the setup's;
// the bias gradient 0 wherever every (b, h) that its entry serves is blocked.
template <typename Layer, typename Query, typename Tensor>
void check_backward(const Setup& setup, const Layer& layer, const Query& query, const Tensor& key,
                    const Tensor& value, sdmha::AttentionOptions<double> options) {
  const auto& p = setup.problem;
  Tensor d_output(p.batch, p.steps, p.output_dim);
  for (Index i = 0; i < d_output.size(); ++i) d_output.data()[i] = double(i % 7 - 3) / 8.0;
  options.compute_bias_gradient = setup.bias_rank != 0;
  options.num_threads = 1;
  const auto single = layer.backward(query, {key, value}, d_output, options);
  options.num_threads = setup.threads;
  const auto several = layer.backward(query, {key, value}, d_output, options);
  auto same = [](const auto& a, const auto& b) {
    return a.size() == b.size() && bitwise_equal(a.data(), b.data(), Index(a.size()));
  };
  SDMHA_FUZZ_CHECK(
      same(single.query_kernel, several.query_kernel) &&
      same(single.query_bias, several.query_bias) && same(single.key_kernel, several.key_kernel) &&
      same(single.key_bias, several.key_bias) && same(single.value_kernel, several.value_kernel) &&
      same(single.value_bias, several.value_bias) &&
      same(single.output_kernel, several.output_kernel) &&
      same(single.output_bias, several.output_bias) &&
      same(single.query_values, several.query_values) && same(single.key, several.key) &&
      same(single.value, several.value) && same(single.attention_bias, several.attention_bias));
  SDMHA_FUZZ_CHECK(single.attention_bias.size() ==
                   (setup.bias_rank == 0 ? 0 : Index(p.attention_bias.size())));
  std::vector<char> open(p.attention_bias.size(), 0);  // some (b, h) served may attend there
  for (long b = 0; b < p.batch && !open.empty(); ++b)
    for (long h = 0; h < p.heads; ++h)
      for (long t = 0; t < p.steps; ++t)
        for (long s = 0; s < p.key_steps; ++s)
          if (sdmha_reference::allowed(p, b, h, t, s) &&
              sdmha_reference::bias_at(p, b, h, t, s) != -std::numeric_limits<double>::infinity())
            open[std::size_t(
                sdmha_reference::broadcast_index(p.bias_batch, p.bias_heads, p, b, h, t, s))] = 1;
  for (std::size_t i = 0; i < open.size(); ++i)
    if (!open[i]) SDMHA_FUZZ_CHECK(single.attention_bias.data()[i] == 0.0);
}

sdmha::MhaConfig config_of(const Setup& setup) {
  const auto& p = setup.problem;
  sdmha::MhaConfig config;
  config.num_heads = p.heads;
  config.key_dim = p.key_dim;
  config.value_dim = p.value_dim;
  config.output_dim = p.output_dim;
  config.use_bias = setup.use_bias;
  return config;
}

// The query, key, value and options of a forward in Scalar, as the setup decoded them; the
// options view the masks and bias held here, so an Inputs stays where it was built.
template <typename Scalar>
struct Inputs {
  sdmha::SparseQuery<Scalar> query;
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> key, value;
  Broadcast<bool> mask;
  Broadcast<Scalar> bias;
  Eigen::Tensor<bool, 2, Eigen::RowMajor> key_mask;  // (B, S), true = may attend; empty = none
  sdmha::AttentionOptions<Scalar> options;

  explicit Inputs(const Setup& setup)
      : query(coo_query(setup)),
        key(tensor<Scalar>(setup.problem.key, setup.problem.batch, setup.problem.key_steps,
                           setup.problem.key_in_dim)),
        value(tensor<Scalar>(setup.problem.value, setup.problem.batch, setup.problem.key_steps,
                             setup.problem.value_in_dim)),
        mask(setup.mask_rank, setup.mask_batch, setup.mask_heads, setup.problem.steps,
             setup.problem.key_steps,
             setup.problem.attention_mask.empty() ? setup.problem.broadcast_mask
                                                  : setup.problem.attention_mask),
        bias(setup.bias_rank, setup.bias_batch, setup.bias_heads, setup.problem.steps,
             setup.problem.key_steps, setup.problem.attention_bias) {
    const auto& p = setup.problem;
    options.use_causal_mask = p.causal;
    options.causal_alignment = setup.bottom_right ? sdmha::CausalAlignment::bottom_right
                                                  : sdmha::CausalAlignment::top_left;
    options.fully_masked_rows =
        setup.uniform ? sdmha::FullyMaskedRows::uniform : sdmha::FullyMaskedRows::zeros;
    if (setup.scale != 0.0) options.scale = setup.scale;
    options.attention_mask = mask.ref();
    options.attention_bias = bias.ref();
    if (setup.has_key_mask) {
      key_mask.resize(p.batch, p.key_steps);
      for (Index i = 0; i < p.batch * p.key_steps; ++i)
        key_mask.data()[i] = p.key_mask[std::size_t(i)] != 0;
      options.key_mask = key_mask;
    }
    options.return_attention_scores = true;
    options.score_strategy = setup.strategy;
    options.num_threads = setup.threads;
  }
  Inputs(const Inputs&) = delete;
  Inputs& operator=(const Inputs&) = delete;

  static sdmha::SparseQuery<Scalar> coo_query(const Setup& setup) {
    const auto& p = setup.problem;
    const Index entries = Index(setup.coo_values.size());
    typename sdmha::SparseQuery<Scalar>::CooIndices indices(entries, 3);
    for (Index i = 0; i < entries * 3; ++i) indices.data()[i] = setup.coo[std::size_t(i)];
    return sdmha::SparseQuery<Scalar>::from_coo(p.batch, p.steps, p.query_dim, indices,
                                                vector<Scalar>(setup.coo_values));
  }
};

template <typename Scalar>
void run(const Setup& setup, const sdmha_reference::Result& expected) {
  const auto& p = setup.problem;
  const long B = p.batch, T = p.steps;
  const sdmha::MhaConfig config = config_of(setup);
  const sdmha::MhaWeights<Scalar> weights = weights_of<Scalar>(p);
  const Inputs<Scalar> inputs(setup);
  const auto& query = inputs.query;
  const auto& key = inputs.key;
  const auto& value = inputs.value;
  const auto& options = inputs.options;

  // Error scale: the largest logit (rounding in the scores grows with it) times the largest
  // possible output magnitude.
  double max_logit = 0.0;
  for (double score : expected.scores)
    if (std::isfinite(score)) max_logit = std::max(max_logit, std::abs(score));
  double max_head = 0.0, max_output = 0.0;
  for (double x : expected.heads) max_head = std::max(max_head, std::abs(x));
  for (double x : expected.output) max_output = std::max(max_output, std::abs(x));
  double kernel_sum = 0.0;
  for (double x : p.output_kernel) kernel_sum += std::abs(x);
  const double output_scale = (1.0 + max_logit) * (1.0 + max_output + max_head * kernel_sum);
  const double tolerance = std::is_same<Scalar, double>::value ? 1e-10 : 2e-5;

  const sdmha::SparseDenseMHA<Scalar> layer(config, weights);
  const auto result = layer.forward(query, {key, value}, options);
  SDMHA_FUZZ_CHECK(result.output.dimension(0) == B && result.output.dimension(1) == T &&
                   result.output.dimension(2) == p.output_dim);
  check_near(result.output.data(), expected.output, tolerance, output_scale);
  check_near(result.attention_scores.data(), expected.probabilities, tolerance, 1.0 + max_logit);

  // The same call on one thread, over a ProjectedContext, and through the other strategies: the
  // first two bitwise, the last within tolerance.
  auto single = options;
  single.num_threads = 1;
  const auto single_result = layer.forward(query, {key, value}, single);
  SDMHA_FUZZ_CHECK(
      bitwise_equal(single_result.output.data(), result.output.data(), result.output.size()));
  const auto context = layer.project_context(key, value, setup.threads);
  const auto cached = layer.forward(query, context, options);
  SDMHA_FUZZ_CHECK(bitwise_equal(cached.output.data(), result.output.data(), result.output.size()));
  for (auto strategy :
       {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
    auto other = options;
    other.score_strategy = strategy;
    check_near(layer.forward(query, {key, value}, other).output.data(), expected.output, tolerance,
               output_scale);
  }

  if constexpr (std::is_same<Scalar, double>::value) {
    const sdmha::DenseMHA<Scalar> dense(config, weights);
    const auto dense_query = tensor<Scalar>(p.query, B, T, p.query_dim);
    check_near(dense.forward(dense_query, {key, value}, options).output.data(), expected.output,
               tolerance, output_scale);
    check_backward(setup, layer, query, key, value, options);
  }
}

// ---- the bfloat16 mode ------------------------------------------------------------------------
//
// set_precision(Precision::bfloat16) computes tests/reference's float64 model of the mode
// (Problem::bfloat16_projections and bfloat16_attention: Wq, Wk, Wv, Wo, the key, the value and
// the heads as inputs of their projections, scale·q and k in the scores, p and v in P·V rounded
// to bfloat16) with float32 sums and a float32 softmax, except on a value tile holding a NaN, ±∞
// or an entry of magnitude 2¹²⁷ or more, which takes the float32 product that skips zero
// probabilities. A tile is one query tile's rows and the keys they may read (S ≤ 6 is one key
// tile, and no online softmax), which a causal tile cuts short of S: the model does not follow
// the layer's tiling, so where V_bh holds such an entry either product is allowed for its
// rows. The check is that model with float32's own error carried through as bounds,
// entry by entry, so that it is exact where float32 is and only as loose as float32 can be:
// - a float32 sum of terms that are exact (a product of two bfloat16 values is exact in float32)
//   and a bias, in any order, is within (n + 3)·2⁻²⁴ of the sum of their magnitudes (Higham's γ,
//   with room for a product rounded once), and exact when every term is a multiple of a power of
//   two q and their magnitudes sum to less than 2²⁴·q (every partial sum is then a float) — as
//   the fuzzer's multiples of 1/16 often are;
// - an operand computed within e of the model's x rounds to a bfloat16 value between
//   bf16(x − e) and bf16(x + e) (rounding is monotone): no spread unless e reaches across a
//   rounding boundary, one bfloat16 step where it does (a tie that float32 and float64 break
//   differently);
// - a probability p_s = 1/Σ_t exp(s_t − s_s): with each score within δ of the model's, it lies
//   within 1/Σ_t exp(s_t − s_s ± (δ_t + δ_s + the shifts' roundings + exp's error)), times the
//   sum's, the reciprocal's and the product's roundings — tight at any logit size;
// - blocked keys have probability exactly 0 and never enter the bounds: poison behind full
//   blocking must not reach the output, and a fully masked row's heads are 0 (1/S averages under
//   the uniform policy, where no poison is drawn).

constexpr double kUnit = 0x1p-24;   // float32's unit roundoff
constexpr double kTiny = 0x1p-120;  // room for float's subnormals, which the bfloat16 dot
                                    // products read and write as zero
constexpr double kHuge = 0x1p126;   // a float sum of magnitudes below it stays below 2¹²⁷

// x rounded to bfloat16 as the model rounds it; ±∞ beyond float's range.
double bfloat16(double x) {
  if (std::abs(x) > double(std::numeric_limits<float>::max()))
    return std::copysign(std::numeric_limits<double>::infinity(), x);
  return sdmha_reference::round_to_bfloat16(x);
}
// How far bfloat16 of any value within `error` of x can be from bfloat16(x) (0 when they are
// the same bfloat16 value, as float's subnormal range aside).
double rounding_spread(double x, double error) {
  const double rounded = bfloat16(x);
  double spread = std::max(bfloat16(x + error) - rounded, rounded - bfloat16(x - error));
  if (std::abs(x) - error < 0x1p-125) spread += 0x1p-126;  // may be read as 0
  return spread;
}
// The largest power of two that x is a multiple of; +∞ for 0, 0 for NaN and ±∞.
double quantum(double x) {
  if (x == 0.0) return std::numeric_limits<double>::infinity();
  if (!std::isfinite(x)) return 0.0;
  int exponent = 0;
  const double mantissa = std::frexp(std::abs(x), &exponent);  // in [1/2, 1)
  auto bits = static_cast<std::uint64_t>(std::ldexp(mantissa, 53));
  int zeros = 0;
  for (; (bits & 1u) == 0; bits >>= 1) ++zeros;
  return std::ldexp(1.0, exponent - 53 + zeros);
}

// A float32 sum of terms that float32 computes exactly (spread 0) or within `spread` of the
// model's, and its error bound.
struct FloatSum {
  long terms = 0;
  double magnitude = 0.0, grain = std::numeric_limits<double>::infinity(), spread = 0.0;
  void add(double term, double term_spread = 0.0) {
    ++terms;
    magnitude += std::abs(term) + term_spread;
    grain = std::min(grain, quantum(term));
    spread += term_spread;
  }
  // The spread of the terms plus the float32 sum's error.
  double error() const {
    const bool exact = spread == 0.0 && magnitude < 0x1p24 * grain && magnitude < 0x1p100;
    return spread + (exact ? 0.0 : double(terms + 3) * kUnit * magnitude);
  }
};

struct Projection {
  std::vector<double> error, magnitude;  // per entry
};
// The float32 error of input·kernel + bias with the operands the mode rounds (not the query's
// values, which from_coo sums exactly here: at most 96 multiples of 1/16 of magnitude 4 at most).
Projection projection_error(const std::vector<double>& input, long rows, long in,
                            const std::vector<double>& kernel, const std::vector<double>& bias,
                            long out, bool round_input) {
  Projection result;
  result.error.resize(static_cast<std::size_t>(rows * out));
  result.magnitude.resize(result.error.size());
  for (long r = 0; r < rows; ++r)
    for (long o = 0; o < out; ++o) {
      FloatSum sum;
      if (!bias.empty()) sum.add(bias[std::size_t(o)]);
      for (long i = 0; i < in; ++i) {
        const double x = input[std::size_t(r * in + i)];
        sum.add((round_input ? bfloat16(x) : x) * bfloat16(kernel[std::size_t(i * out + o)]));
      }
      result.error[std::size_t(r * out + o)] = sum.error();
      result.magnitude[std::size_t(r * out + o)] = sum.magnitude;
    }
  return result;
}

struct BFloat16Model {
  sdmha_reference::Problem problem;  // the mode's model, on the inputs as float holds them
  sdmha_reference::Result result;
  Projection query, key, value;  // the projections' float32 error
  // Per (b, h): whether P·V may also be the float32 product skipping zero probabilities (V_bh
  // holds a NaN or ±∞, which some tiles read and others may not; or entries near 2¹²⁷, which
  // float32 sums may reach), besides bf16(P)·bf16(V).
  std::vector<char> either_product;
  std::vector<double> probability_error;  // B·H·T·S
  std::vector<double> head, head_error;   // B·T·H·Dv: an interval holding the forward's heads
  std::vector<double> output, output_error;
};

void projection_errors(BFloat16Model& m) {
  const auto& p = m.problem;
  const long B = p.batch, T = p.steps, S = p.key_steps, H = p.heads, Dv = p.value_dim;
  m.query = projection_error(p.query, B * T, p.query_dim, p.query_kernel, p.query_bias,
                             H * p.key_dim, false);
  m.key =
      projection_error(p.key, B * S, p.key_in_dim, p.key_kernel, p.key_bias, H * p.key_dim, true);
  m.value =
      projection_error(p.value, B * S, p.value_in_dim, p.value_kernel, p.value_bias, H * Dv, true);
  m.either_product.assign(static_cast<std::size_t>(B * H), 0);
  for (long b = 0; b < B; ++b)
    for (long h = 0; h < H; ++h) {
      bool finite = true, small = true;
      for (long s = 0; s < S; ++s)
        for (long d = 0; d < Dv; ++d) {
          const std::size_t i = std::size_t((b * S + s) * H * Dv + h * Dv + d);
          finite = finite && std::isfinite(m.result.value[i]);
          small = small && m.value.magnitude[i] < kHuge;
        }
      m.either_product[std::size_t(b * H + h)] = !finite || !small;
    }
}

// The bound on score s of row (b, h, t), open in the model.
double score_error(const BFloat16Model& m, long b, long h, long t, long s) {
  const auto& p = m.problem;
  const long T = p.steps, S = p.key_steps, H = p.heads, Dk = p.key_dim;
  const double scale = p.scale != 0.0 ? p.scale : 1.0 / std::sqrt(double(Dk));
  const bool exact_scale = double(float(scale)) == scale;
  FloatSum sum;
  sum.add(sdmha_reference::bias_at(p, b, h, t, s));
  for (long d = 0; d < Dk; ++d) {
    const std::size_t qi = std::size_t((b * T + t) * H * Dk + h * Dk + d);
    const std::size_t ki = std::size_t((b * S + s) * H * Dk + h * Dk + d);
    const double a = m.result.query[qi] * scale, k = m.result.key[ki];
    // a = fl(float(scale)·q): the model's float(a) when scale and q are exact; else within two
    // roundings of a, and Q's own error times |scale|.
    const double query_error = m.query.error[qi];
    const double da = exact_scale && query_error == 0.0
                          ? 0.0
                          : rounding_spread(a, std::abs(scale) * query_error * (1 + 4 * kUnit) +
                                                   3 * kUnit * std::abs(a));
    const double dk = m.key.error[ki] == 0.0 ? 0.0 : rounding_spread(k, m.key.error[ki]);
    sum.add(bfloat16(a) * bfloat16(k),
            da * std::abs(bfloat16(k)) + std::abs(bfloat16(a)) * dk + da * dk);
  }
  return sum.error();
}

// The bound on each probability of row (b, h, t).
void probability_errors(BFloat16Model& m, long b, long h, long t) {
  const auto& p = m.problem;
  const long S = p.key_steps;
  const std::size_t row = std::size_t(((b * p.heads + h) * p.steps + t) * S);
  const double* score = m.result.scores.data() + row;
  const double* probability = m.result.probabilities.data() + row;
  double* error = m.probability_error.data() + row;
  constexpr double blocked = -std::numeric_limits<double>::infinity();
  std::vector<double> delta(static_cast<std::size_t>(S), 0.0);  // each score's bound
  double maximum = blocked, largest = 0.0;
  for (long s = 0; s < S; ++s)
    if (score[s] != blocked) {
      delta[std::size_t(s)] = score_error(m, b, h, t, s);
      maximum = std::max(maximum, score[s]);
      largest = std::max(largest, delta[std::size_t(s)]);
    }
  if (maximum == blocked) {  // fully masked: 0, or 1/S as float rounds it
    for (long s = 0; s < S; ++s) error[s] = kUnit * probability[s] + kTiny;
    return;
  }
  // Each exponent fl(ŝ − m̂) adds the subtraction's rounding (none when both are the model's
  // and their difference is a float) and exp's error (3ε = 6·2⁻²⁴ for Eigen's float exp).
  for (long s = 0; s < S; ++s) {
    if (score[s] == blocked) continue;
    const double difference = maximum - score[s];
    const bool exact =
        largest == 0.0 && difference < 0x1p24 * std::min(quantum(score[s]), quantum(maximum));
    delta[std::size_t(s)] += (exact ? 0.0 : kUnit * (difference + 2 * largest)) + 8 * kUnit;
  }
  const double rounding = double(S + 4) * kUnit + double(S) * kTiny;  // sum, 1/sum, product
  for (long s = 0; s < S; ++s) {
    if (score[s] == blocked) {
      error[s] = 0.0;  // exactly 0 in the forward
      continue;
    }
    double low = 1.0, high = 1.0;  // Σ_k exp(s_k − s_s ∓ …)
    for (long k = 0; k < S; ++k)
      if (k != s && score[k] != blocked) {
        const double g = delta[std::size_t(k)] + delta[std::size_t(s)];
        low += std::exp(score[k] - score[s] - g);
        high += std::exp(score[k] - score[s] + g);
      }
    error[s] =
        std::max((1 + rounding) / low - probability[s], probability[s] - (1 - rounding) / high) +
        kTiny;
  }
}

// Row (b, h, t)'s heads as an interval: around the rounded product bf16(P)·bf16(V), the float32
// product skipping zero probabilities too where either_product says.
void head_interval(BFloat16Model& m, long b, long h, long t) {
  const auto& p = m.problem;
  const long T = p.steps, S = p.key_steps, H = p.heads, Dv = p.value_dim;
  const std::size_t row = std::size_t(((b * H + h) * T + t) * S);
  const double* probability = m.result.probabilities.data() + row;
  const double* probability_error = m.probability_error.data() + row;
  const bool either = m.either_product[std::size_t(b * H + h)] != 0;
  for (long d = 0; d < Dv; ++d) {
    FloatSum rounded_sum, plain_sum;
    double plain = 0.0;
    for (long s = 0; s < S; ++s) {
      // Blocked (and its value maybe poison), or below double's range: 0 in the forward too.
      if (probability[s] == 0.0) continue;
      const std::size_t vi = std::size_t((b * S + s) * H * Dv + h * Dv + d);
      const double pr = probability[s], ep = probability_error[s];
      const double v = m.result.value[vi], ev = m.value.error[vi];
      const double dp = rounding_spread(pr, ep), dv = ev == 0.0 ? 0.0 : rounding_spread(v, ev);
      rounded_sum.add(bfloat16(pr) * bfloat16(v),
                      dp * std::abs(bfloat16(v)) + bfloat16(pr) * dv + dp * dv);
      plain_sum.add(pr * v, ep * std::abs(v) + pr * ev + ep * ev);
      plain += pr * v;
    }
    const std::size_t i = std::size_t((b * T + t) * H * Dv + h * Dv + d);
    const double rounded = m.result.heads[i], rounded_error = rounded_sum.error() + kTiny;
    const double plain_error = plain_sum.error() + kTiny;
    double low = rounded - rounded_error, high = rounded + rounded_error;
    if (either) {
      low = std::min(low, plain) - plain_error;
      high = std::max(high, plain) + plain_error;
    }
    m.head[i] = (low + high) / 2;
    m.head_error[i] = (high - low) / 2;
  }
}

// The output from the heads' intervals: the output projection of their centres, rounded as the
// mode rounds, and the spread their radii allow.
void output_interval(BFloat16Model& m) {
  const auto& p = m.problem;
  const long rows = p.batch * p.steps, width = p.heads * p.value_dim, O = p.output_dim;
  m.output =
      sdmha_reference::project(m.head, rows, width, p.output_kernel, p.output_bias, O, true, true);
  m.output_error.assign(m.output.size(), 0.0);
  for (long r = 0; r < rows; ++r)
    for (long o = 0; o < O; ++o) {
      FloatSum sum;
      if (!p.output_bias.empty()) sum.add(p.output_bias[std::size_t(o)]);
      for (long j = 0; j < width; ++j) {
        const std::size_t i = std::size_t(r * width + j);
        const double w = bfloat16(p.output_kernel[std::size_t(j * O + o)]);
        const double dh =
            m.head_error[i] == 0.0 ? 0.0 : rounding_spread(m.head[i], m.head_error[i]);
        sum.add(bfloat16(m.head[i]) * w, dh * std::abs(w));
      }
      m.output_error[std::size_t(r * O + o)] = sum.error() + kTiny;
    }
}

BFloat16Model bfloat16_model(const Setup& setup) {
  BFloat16Model m;
  auto& p = m.problem;
  p = setup.problem;
  p.bfloat16_projections = p.bfloat16_attention = true;
  p.online_key_tile = 0;  // S ≤ 6: one key tile, no online softmax
  for (double& x : p.key) x = double(as_scalar<float>(x));
  for (double& x : p.value) x = double(as_scalar<float>(x));
  const long B = p.batch, T = p.steps, S = p.key_steps, H = p.heads;
  if (S > 0)
    m.result = sdmha_reference::forward(p);
  else  // no keys (sdmha_reference::forward needs some): zero heads, the output is the bias
    m.result.heads.assign(static_cast<std::size_t>(B * T * H * p.value_dim), 0.0);
  projection_errors(m);
  m.probability_error.assign(m.result.probabilities.size(), 0.0);
  m.head.assign(m.result.heads.size(), 0.0);
  m.head_error.assign(m.result.heads.size(), 0.0);
  for (long b = 0; b < B; ++b)
    for (long h = 0; h < H; ++h)
      for (long t = 0; t < T; ++t) {
        probability_errors(m, b, h, t);
        head_interval(m, b, h, t);
      }
  output_interval(m);
  return m;
}

// |got − expected| ≤ error entry by entry; NaN or ±∞ in `got` always fails.
void check_within(const float* got, const std::vector<double>& expected,
                  const std::vector<double>& error) {
  for (std::size_t i = 0; i < expected.size(); ++i) {
    SDMHA_FUZZ_CHECK(std::isfinite(double(got[i])));
    SDMHA_FUZZ_CHECK(std::abs(double(got[i]) - expected[i]) <= error[i]);
  }
}

// SparseDenseMHA<float> with every kernel in bfloat16: the output within the model's interval,
// the returned probabilities (float32, before any rounding) within their bound, the same bits on
// one thread and over its own ProjectedContext; sparse_regrouped, which reads the float32 Wq, a
// ConfigError (then project_first, which automatic picks in this mode anyway). `engine` is the
// SDMHA_BFLOAT16_GEMMS value: the model is that of the bfloat16 GEMMs, which this CPU might not
// choose on its own, on the vdpbf16ps engine (on) or the AMX tiles' emulation (amx-emulated).
void run_bfloat16(const Setup& setup, const char* engine) {
  const auto& p = setup.problem;
  const BFloat16Model model = bfloat16_model(setup);
  const Inputs<float> inputs(setup);
  sdmha::SparseDenseMHA<float> rounding(config_of(setup), weights_of<float>(p));
  ::setenv("SDMHA_BFLOAT16_GEMMS", engine, 1);
  rounding.set_precision(sdmha::Precision::bfloat16);
  const auto& layer = rounding;  // const from here on: weights() would be a write access
  SDMHA_FUZZ_CHECK(layer.precision() == sdmha::Precision::bfloat16);
  auto options = inputs.options;
  if (options.score_strategy == sdmha::ScoreStrategy::sparse_regrouped) {
    bool refused = false;
    try {
      layer.forward(inputs.query, {inputs.key, inputs.value}, options);
    } catch (const sdmha::ConfigError&) {
      refused = true;
    }
    SDMHA_FUZZ_CHECK(refused);
    options.score_strategy = sdmha::ScoreStrategy::project_first;
  }
  const auto result = layer.forward(inputs.query, {inputs.key, inputs.value}, options);
  SDMHA_FUZZ_CHECK(result.output.dimension(0) == p.batch && result.output.dimension(1) == p.steps &&
                   result.output.dimension(2) == p.output_dim);
  SDMHA_FUZZ_CHECK(result.attention_scores.size() == Index(model.result.probabilities.size()));
  check_within(result.output.data(), model.output, model.output_error);
  check_within(result.attention_scores.data(), model.result.probabilities, model.probability_error);
  if (setup.threads > 1) {
    auto single = options;
    single.num_threads = 1;
    const auto single_result = layer.forward(inputs.query, {inputs.key, inputs.value}, single);
    SDMHA_FUZZ_CHECK(
        bitwise_equal(single_result.output.data(), result.output.data(), result.output.size()));
  }
  const auto context = layer.project_context(inputs.key, inputs.value, setup.threads);
  const auto cached = layer.forward(inputs.query, context, options);
  SDMHA_FUZZ_CHECK(bitwise_equal(cached.output.data(), result.output.data(), result.output.size()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider provider(data, size);
  const Setup setup = decode(provider);
  // With S = 0 (and B·T > 0) sdmha_reference::forward takes &scores[0] of an empty vector, which
  // UBSan reports; the expected result is then plain: no attention, the output is the bias.
  sdmha_reference::Result expected;
  const auto& p = setup.problem;
  if (p.key_steps == 0) {
    expected.heads.assign(static_cast<std::size_t>(p.batch * p.steps * p.heads * p.value_dim), 0.0);
    expected.output =
        sdmha_reference::project(expected.heads, p.batch * p.steps, p.heads * p.value_dim,
                                 p.output_kernel, p.output_bias, p.output_dim);
  } else {
    expected = sdmha_reference::forward(p);
  }
  // Valid input by construction: any exception at all is a finding.
  try {
    run<double>(setup, expected);
    run<float>(setup, expected);
    if (setup.bfloat16)
      for (const char* engine : {"on", "amx-emulated"}) run_bfloat16(setup, engine);
  } catch (const std::exception& error) {
    sdmha_fuzz::report_escape(error.what());
  }
  return 0;
}
