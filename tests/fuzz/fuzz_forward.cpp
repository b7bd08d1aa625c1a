// tests/fuzz/fuzz_forward.cpp — a small forward pass against the float64 reference.
//
// The bytes choose the dimensions (B, T, S ≤ 6, or T up to 70 to cross a query tile; Eq, Ek, Ev
// ≤ 12; H ≤ 3; Dk, Dv ≤ 5), the projection biases, the masks (an attention mask of any broadcast
// shape (T, S), (B, T, S), (B', H', T, S) with B' ∈ {1, B}, H' ∈ {1, H}; causal top-left or
// bottom-right; key padding), an attention bias of any of those shapes with −∞ entries, the scale,
// the policy for fully masked rows, the score strategy, the thread count and every value. Weights,
// inputs and bias values are multiples of 1/16, exact in float and double, optionally scaled so
// that logits reach ±1e4. Key and value rows that every query of their batch entry is blocked from
// (by any mask or a −∞ bias, for every head) are filled with NaN, ±Inf or huge values under the
// zeros policy: they must not reach the output. SparseDenseMHA<double> and <float>,
// DenseMHA<double> on the densified query, and a forward over a ProjectedContext must all agree
// with tests/reference/reference_mha.hpp; in double the backward's gradients, the bias gradient
// included, are bitwise the same for one thread and several, and the bias gradient is 0 wherever
// every (b, h) it serves is blocked.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <sdmha/sdmha.hpp>

#include "fuzz_support.hpp"
#include "reference/reference_mha.hpp"

namespace {

using sdmha::Index;

struct Setup {
  sdmha_reference::Problem problem;
  bool use_bias = true;
  int threads = 1;
  sdmha::ScoreStrategy strategy = sdmha::ScoreStrategy::automatic;
  bool has_key_padding = false;
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

// The attention mask, bias and key padding, drawn before the weights so that short inputs reach
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
  if (setup.has_key_padding) {
    p.key_padding_mask.resize(static_cast<std::size_t>(B * S));
    for (char& padded : p.key_padding_mask)
      padded = provider.ConsumeIntegralInRange<int>(0, 4) == 0;
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

Setup decode(FuzzedDataProvider& provider) {
  Setup setup;
  auto& p = setup.problem;
  // The mask and bias shapes and the semantics first: libFuzzer's inputs start short, and a draw
  // past their end gives the range's minimum (none, top-left, zeros, the default scale).
  const int mask_code = provider.ConsumeIntegralInRange<int>(0, 7);
  const int bias_code = provider.ConsumeIntegralInRange<int>(0, 7);
  const int semantics = provider.ConsumeIntegralInRange<int>(0, 127);
  setup.bottom_right = (semantics & 1) != 0;
  setup.uniform = (semantics & 2) != 0;
  constexpr double scales[] = {0.0, 0.5, -0.25, 1.5, 0.125, 0.0, 2.0, 0.0};  // 0: unset
  setup.scale = scales[(semantics >> 2) & 7];
  setup.minus_infinity_pattern = semantics >> 5;
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
  setup.has_key_padding = provider.ConsumeBool();
  setup.strategy = provider.PickValueInArray({sdmha::ScoreStrategy::automatic,
                                              sdmha::ScoreStrategy::project_first,
                                              sdmha::ScoreStrategy::sparse_regrouped});
  setup.threads = provider.ConsumeIntegralInRange<int>(1, 3);
  // ×16 on the query and key kernels takes logits from tens to about ±1e4.
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
template <typename Scalar>
Eigen::Tensor<Scalar, 3, Eigen::RowMajor> tensor(const std::vector<double>& data, long d0, long d1,
                                                 long d2) {
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> result(d0, d1, d2);
  // double → float of a poison value beyond float's range gives ±Inf (or NaN stays NaN); those
  // rows are blocked, so any value is fine there.
  for (long i = 0; i < d0 * d1 * d2; ++i) {
    const double x = data[std::size_t(i)];
    result.data()[i] =
        std::isfinite(x) && std::abs(x) > double(std::numeric_limits<Scalar>::max())
            ? std::copysign(std::numeric_limits<Scalar>::infinity(), Scalar(x > 0 ? 1 : -1))
            : Scalar(x);
  }
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
  const auto single = layer.backward(query, key, value, d_output, options);
  options.num_threads = setup.threads;
  const auto several = layer.backward(query, key, value, d_output, options);
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

template <typename Scalar>
void run(const Setup& setup, const sdmha_reference::Result& expected) {
  const auto& p = setup.problem;
  const long B = p.batch, T = p.steps, S = p.key_steps;
  sdmha::MhaConfig config;
  config.num_heads = p.heads;
  config.key_dim = p.key_dim;
  config.value_dim = p.value_dim;
  config.output_dim = p.output_dim;
  config.use_bias = setup.use_bias;
  const sdmha::MhaWeights<Scalar> weights = weights_of<Scalar>(p);

  const Index entries = Index(setup.coo_values.size());
  typename sdmha::SparseQuery<Scalar>::CooIndices indices(entries, 3);
  for (Index i = 0; i < entries * 3; ++i) indices.data()[i] = setup.coo[std::size_t(i)];
  const auto query = sdmha::SparseQuery<Scalar>::from_coo(B, T, p.query_dim, indices,
                                                          vector<Scalar>(setup.coo_values));
  const auto key = tensor<Scalar>(p.key, B, S, p.key_in_dim);
  const auto value = tensor<Scalar>(p.value, B, S, p.value_in_dim);

  sdmha::AttentionOptions<Scalar> options;
  options.use_causal_mask = p.causal;
  options.causal_alignment =
      setup.bottom_right ? sdmha::CausalAlignment::bottom_right : sdmha::CausalAlignment::top_left;
  options.fully_masked_rows =
      setup.uniform ? sdmha::FullyMaskedRows::uniform : sdmha::FullyMaskedRows::zeros;
  if (setup.scale != 0.0) options.scale = setup.scale;
  const Broadcast<bool> mask(setup.mask_rank, setup.mask_batch, setup.mask_heads, T, S,
                             p.attention_mask.empty() ? p.broadcast_mask : p.attention_mask);
  options.attention_mask = mask.ref();
  const Broadcast<Scalar> bias(setup.bias_rank, setup.bias_batch, setup.bias_heads, T, S,
                               p.attention_bias);
  options.attention_bias = bias.ref();
  if (setup.has_key_padding) {
    options.key_padding_mask.resize(B, S);
    for (Index i = 0; i < B * S; ++i)
      options.key_padding_mask.data()[i] = p.key_padding_mask[std::size_t(i)] != 0;
  }
  options.return_attention_scores = true;
  options.score_strategy = setup.strategy;
  options.num_threads = setup.threads;

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
  const auto result = layer.forward(query, key, value, options);
  SDMHA_FUZZ_CHECK(result.output.dimension(0) == B && result.output.dimension(1) == T &&
                   result.output.dimension(2) == p.output_dim);
  check_near(result.output.data(), expected.output, tolerance, output_scale);
  check_near(result.attention_scores.data(), expected.probabilities, tolerance, 1.0 + max_logit);

  // The same call on one thread, over a ProjectedContext, and through the other strategies: the
  // first two bitwise, the last within tolerance.
  auto single = options;
  single.num_threads = 1;
  const auto single_result = layer.forward(query, key, value, single);
  SDMHA_FUZZ_CHECK(
      bitwise_equal(single_result.output.data(), result.output.data(), result.output.size()));
  const auto context = layer.project_context(key, value, setup.threads);
  const auto cached = layer.forward(query, context, options);
  SDMHA_FUZZ_CHECK(bitwise_equal(cached.output.data(), result.output.data(), result.output.size()));
  for (auto strategy :
       {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
    auto other = options;
    other.score_strategy = strategy;
    check_near(layer.forward(query, key, value, other).output.data(), expected.output, tolerance,
               output_scale);
  }

  if constexpr (std::is_same<Scalar, double>::value) {
    const sdmha::DenseMHA<Scalar> dense(config, weights);
    const auto dense_query = tensor<Scalar>(p.query, B, T, p.query_dim);
    check_near(dense.forward(dense_query, key, value, options).output.data(), expected.output,
               tolerance, output_scale);
    check_backward(setup, layer, query, key, value, options);
  }
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
  } catch (const std::exception& error) {
    sdmha_fuzz::report_escape(error.what());
  }
  return 0;
}
