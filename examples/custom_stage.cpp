// custom_stage.cpp — two stages of your own in the layer, forward and backward, the other stages
// untouched:
//
//   AlibiScores         the default scores minus slope[h]·|t − s|, t and s absolute query and
//                       key steps (an ALiBi-style relative-position bias), in both score strategies
//   TemperatureSoftmax  softmax(S / temperature[h])
//
// Each derives from the default stage, calls it, and declares a backward(...) of its own, which
// is what makes SparseDenseMHA::backward accept it (docs/pipeline.md, "Writing a custom stage").
// The program checks them: with slope 0 and temperature 1 the layer is bitwise the standard one;
// with real slopes and temperatures its forward matches a float64 loop reference written below
// (T = 130, S = 150: several query tiles, so a bias counted from the tile's start would show),
// one gradient matches a central difference, and a few training steps lower a loss.
#include <sdmha/sdmha.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

// ---- the stages --------------------------------------------------------------------------------

// S[t, s] − slope[h]·|(query_begin + t) − (key_begin + s)| on the scores of one tile. A tile's
// row t is query step query_begin + t and its column s key step key_begin + s: the bias is by
// absolute step, never by the position inside the tile.
template <typename Scalar>
struct AlibiScores : sdmha::ScoreKernel<Scalar> {
  using Base = sdmha::ScoreKernel<Scalar>;
  std::vector<Scalar> slope;  // one per head; empty: no bias

  // Base::Arguments (project-first) or Base::SparseArguments (regrouped): both carry the tile's
  // position (sdmha::TilePosition) and its scores.
  template <typename Args>
  void operator()(const Args& args) const {
    Base::operator()(args);  // the scores, blocked entries −∞
    if (slope.empty()) return;
    const Scalar head_slope = slope[std::size_t(args.head)];
    for (Eigen::Index t = 0; t < args.scores.rows(); ++t) {
      const Eigen::Index query_step = args.query_begin + t;
      for (Eigen::Index s = 0; s < args.scores.cols(); ++s) {
        Scalar& score = args.scores(t, s);
        if (std::isfinite(score))  // a blocked entry stays −∞
          score -= head_slope * Scalar(std::abs(query_step - (args.key_begin + s)));
      }
    }
  }

  // S' = S − bias with a bias that depends on no input and no weight: ∂S'/∂S is the identity,
  // so ∂loss/∂S = ∂loss/∂S' = args.d_scores as it comes, and the base's backward (dQ, dK from
  // dS) is the whole chain rule. Declaring it here is what says so.
  void backward(const typename Base::BackwardArguments& args) const { Base::backward(args); }
};

// P = softmax(S / τ_h): a temperature above 1 flattens the attention, below 1 sharpens it.
template <typename Scalar>
struct TemperatureSoftmax : sdmha::MaskedSoftmax<Scalar> {
  using Base = sdmha::MaskedSoftmax<Scalar>;
  std::vector<Scalar> temperature;  // one per head, > 0; empty: τ = 1

  void operator()(const typename Base::Arguments& args) const {
    if (!temperature.empty()) args.scores /= temperature[std::size_t(args.head)];  // −∞ stays −∞
    Base::operator()(args);
  }

  // The base turns dP into ∂loss/∂(S/τ) (args.probabilities is this stage's P); then the chain
  // rule through S/τ divides by τ.
  void backward(const typename Base::BackwardArguments& args) const {
    Base::backward(args);
    if (!temperature.empty()) args.d_scores /= temperature[std::size_t(args.head)];
  }
};

template <typename Scalar>
using CustomLayer = sdmha::SparseDenseMHA<Scalar, sdmha::SparseQueryProjection<Scalar>,
                                          AlibiScores<Scalar>, TemperatureSoftmax<Scalar>>;

// ---- the problem, in plain arrays ---------------------------------------------------------------

using Index = Eigen::Index;

struct Entry {
  Index batch, step, feature;
  double value;
};

// Everything the layer and the reference read, generated once in double.
struct Problem {
  Index B = 2, T = 130, S = 150, H = 2, Dk = 8, Eq = 300, Ek = 16, O = 8;  // Dv = Dk, Ev = Ek
  std::vector<Entry> entries;  // the sparse query, COO: 4 features per step (a repeat is summed)
  std::vector<double> key, value;                      // B·S·Ek each
  std::vector<double> wq, bq, wk, bk, wv, bv, wo, bo;  // Keras' layout, row-major
  bool causal = true;
  std::vector<char> padded;  // B·S: key steps no query may attend
};

// The projections' weights, drawn from `seed`.
void draw_weights(Problem& p, std::uint64_t seed) {
  std::mt19937_64 random(seed);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  auto fill = [&](std::vector<double>& v, Index size, double scale) {
    v.resize(std::size_t(size));
    for (double& x : v) x = scale * uniform(random);
  };
  fill(p.wq, p.Eq * p.H * p.Dk, 1.0);
  fill(p.bq, p.H * p.Dk, 0.1);
  fill(p.wk, p.Ek * p.H * p.Dk, 0.5);
  fill(p.bk, p.H * p.Dk, 0.1);
  fill(p.wv, p.Ek * p.H * p.Dk, 0.5);
  fill(p.bv, p.H * p.Dk, 0.1);
  fill(p.wo, p.H * p.Dk * p.O, 0.3);
  fill(p.bo, p.O, 0.1);
}

Problem make_problem() {
  Problem p;
  std::mt19937_64 random(5);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  std::uniform_int_distribution<Index> feature(0, p.Eq - 1);
  for (Index b = 0; b < p.B; ++b)
    for (Index t = 0; t < p.T; ++t)
      for (int k = 0; k < 4; ++k) p.entries.push_back({b, t, feature(random), uniform(random)});
  for (auto* tensor : {&p.key, &p.value}) {
    tensor->resize(std::size_t(p.B * p.S * p.Ek));
    for (double& x : *tensor) x = uniform(random);
  }
  draw_weights(p, 6);
  p.padded.assign(std::size_t(p.B * p.S), 0);
  for (Index s = p.S - 20; s < p.S; ++s) p.padded[std::size_t(1 * p.S + s)] = 1;  // batch entry 1
  return p;
}

// Keras' attention with the custom stages, from plain loops in double: Q = X·Wq + bq, K, V,
// S = (Q_h/√Dk)·K_hᵀ − slope[h]·|t − s| where allowed, P = softmax(S / τ_h) (0 for a row with
// nothing allowed), A_h = P·V_h, Y = A·Wo + bo. Returns Y, B·T·O.
std::vector<double> reference(const Problem& p, const std::vector<double>& slope,
                              const std::vector<double>& temperature) {
  using std::size_t;
  const size_t B = size_t(p.B), T = size_t(p.T), S = size_t(p.S), H = size_t(p.H), D = size_t(p.Dk);
  const size_t E = size_t(p.Ek), O = size_t(p.O), W = H * D;
  std::vector<double> q(B * T * W), k(B * S * W), v(B * S * W);
  for (size_t r = 0; r < B * T; ++r)
    for (size_t j = 0; j < W; ++j) q[r * W + j] = p.bq[j];
  for (const Entry& e : p.entries) {
    const size_t r = size_t(e.batch) * T + size_t(e.step), f = size_t(e.feature);
    for (size_t j = 0; j < W; ++j) q[r * W + j] += e.value * p.wq[f * W + j];
  }
  for (size_t r = 0; r < B * S; ++r)
    for (size_t j = 0; j < W; ++j) {
      k[r * W + j] = p.bk[j];
      v[r * W + j] = p.bv[j];
      for (size_t i = 0; i < E; ++i) {
        k[r * W + j] += p.key[r * E + i] * p.wk[i * W + j];
        v[r * W + j] += p.value[r * E + i] * p.wv[i * W + j];
      }
    }
  std::vector<double> heads(B * T * W, 0.0), scores(S);
  std::vector<bool> allowed(S);
  for (size_t b = 0; b < B; ++b)
    for (size_t h = 0; h < H; ++h)
      for (size_t t = 0; t < T; ++t) {
        const double* query = &q[(b * T + t) * W + h * D];
        double largest = -std::numeric_limits<double>::infinity();
        for (size_t s = 0; s < S; ++s) {
          allowed[s] = !p.padded[b * S + s] && (!p.causal || s <= t);
          if (!allowed[s]) continue;
          double dot = 0.0;
          for (size_t d = 0; d < D; ++d) dot += query[d] * k[(b * S + s) * W + h * D + d];
          const double distance = std::abs(double(t) - double(s));
          scores[s] = (dot / std::sqrt(double(D)) - slope[h] * distance) / temperature[h];
          largest = std::max(largest, scores[s]);
        }
        double sum = 0.0;
        for (size_t s = 0; s < S; ++s)
          if (allowed[s]) sum += scores[s] = std::exp(scores[s] - largest);
        for (size_t s = 0; s < S; ++s)
          if (allowed[s])
            for (size_t d = 0; d < D; ++d)
              heads[(b * T + t) * W + h * D + d] +=
                  scores[s] / sum * v[(b * S + s) * W + h * D + d];
      }
  std::vector<double> output(B * T * O);
  for (size_t r = 0; r < B * T; ++r)
    for (size_t o = 0; o < O; ++o) {
      output[r * O + o] = p.bo[o];
      for (size_t j = 0; j < W; ++j) output[r * O + o] += heads[r * W + j] * p.wo[j * O + o];
    }
  return output;
}

// ---- the same problem as sdmha's types
// ------------------------------------------------------------

template <typename Scalar>
struct Inputs {
  sdmha::SparseQuery<Scalar> query;
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> key, value;
  // (B, S), true = may attend: options.key_mask is a view of it (a move keeps its data in place).
  Eigen::Tensor<bool, 2, Eigen::RowMajor> key_mask;
  sdmha::AttentionOptions<Scalar> options;
};

template <typename Scalar>
Inputs<Scalar> inputs_of(const Problem& p, sdmha::ScoreStrategy strategy) {
  Eigen::Matrix<std::int64_t, Eigen::Dynamic, 3, Eigen::RowMajor> indices(Index(p.entries.size()),
                                                                          3);
  sdmha::Vector<Scalar> values(indices.rows());
  for (Index i = 0; i < indices.rows(); ++i) {
    const Entry& e = p.entries[std::size_t(i)];
    indices.row(i) << e.batch, e.step, e.feature;
    values[i] = Scalar(e.value);
  }
  Inputs<Scalar> in{
      sdmha::SparseQuery<Scalar>::from_coo(p.B, p.T, p.Eq, indices, values), {}, {}, {}, {}};
  in.key.resize(p.B, p.S, p.Ek);
  in.value.resize(p.B, p.S, p.Ek);
  for (std::size_t i = 0; i < p.key.size(); ++i) {
    in.key.data()[i] = Scalar(p.key[i]);
    in.value.data()[i] = Scalar(p.value[i]);
  }
  in.options.use_causal_mask = p.causal;
  in.key_mask.resize(p.B, p.S);
  for (std::size_t i = 0; i < p.padded.size(); ++i) in.key_mask.data()[i] = p.padded[i] == 0;
  in.options.key_mask = in.key_mask;
  in.options.score_strategy = strategy;
  in.options.num_threads = 2;
  return in;
}

template <typename Scalar>
std::shared_ptr<sdmha::MhaWeights<Scalar>> weights_of(const Problem& p) {
  auto matrix = [](const std::vector<double>& v, Index rows, Index cols) {
    return sdmha::RowMatrix<Scalar>(
        Eigen::Map<const sdmha::RowMatrix<double>>(v.data(), rows, cols).cast<Scalar>());
  };
  auto vector = [](const std::vector<double>& v) {
    return sdmha::Vector<Scalar>(
        Eigen::Map<const Eigen::VectorXd>(v.data(), Index(v.size())).cast<Scalar>());
  };
  const Index W = p.H * p.Dk;
  auto w = std::make_shared<sdmha::MhaWeights<Scalar>>();
  w->query_kernel = matrix(p.wq, p.Eq, W);
  w->key_kernel = matrix(p.wk, p.Ek, W);
  w->value_kernel = matrix(p.wv, p.Ek, W);
  w->output_kernel = matrix(p.wo, W, p.O);
  w->query_bias = vector(p.bq);
  w->key_bias = vector(p.bk);
  w->value_bias = vector(p.bv);
  w->output_bias = vector(p.bo);
  return w;
}

sdmha::MhaConfig config_of(const Problem& p) {
  sdmha::MhaConfig config;
  config.num_heads = p.H;
  config.key_dim = p.Dk;
  config.output_dim = p.O;
  return config;
}

// ---- checks
// ----------------------------------------------------------------------------------------

template <typename A>
bool same_bits(const A& a, const A& b) {
  return a.size() == b.size() &&
         (a.size() == 0 ||
          std::memcmp(a.data(), b.data(), std::size_t(a.size()) * sizeof(*a.data())) == 0);
}

template <typename Scalar>
bool same_gradients(const sdmha::MhaGradients<Scalar>& a, const sdmha::MhaGradients<Scalar>& b) {
  return same_bits(a.query_kernel, b.query_kernel) && same_bits(a.key_kernel, b.key_kernel) &&
         same_bits(a.value_kernel, b.value_kernel) && same_bits(a.output_kernel, b.output_kernel) &&
         same_bits(a.query_bias, b.query_bias) && same_bits(a.key_bias, b.key_bias) &&
         same_bits(a.value_bias, b.value_bias) && same_bits(a.output_bias, b.output_bias) &&
         same_bits(a.query_values, b.query_values) && same_bits(a.key, b.key) &&
         same_bits(a.value, b.value);
}

const char* name(sdmha::ScoreStrategy strategy) {
  return strategy == sdmha::ScoreStrategy::sparse_regrouped ? "sparse_regrouped" : "project_first";
}

// A fixed random d_output (B, T, O): the loss is Σ output ⊙ d_output.
template <typename Scalar>
Eigen::Tensor<Scalar, 3, Eigen::RowMajor> loss_weights(const Problem& p) {
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> r(p.B, p.T, p.O);
  std::mt19937_64 random(17);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  for (Index i = 0; i < r.size(); ++i) r.data()[i] = Scalar(uniform(random));
  return r;
}

// The custom stages' parameters: one slope and one temperature per head.
struct Settings {
  std::vector<double> slope, temperature;
};

template <typename Scalar>
void configure(CustomLayer<Scalar>& layer, const Settings& settings) {
  layer.stages().score_kernel.slope.assign(settings.slope.begin(), settings.slope.end());
  layer.stages().softmax.temperature.assign(settings.temperature.begin(),
                                            settings.temperature.end());
}

const sdmha::ScoreStrategy kStrategies[] = {sdmha::ScoreStrategy::project_first,
                                            sdmha::ScoreStrategy::sparse_regrouped};

// 1. Slope 0 and temperature 1: the standard layer, bit for bit, forward and backward.
bool matches_standard_layer(const Problem& p) {
  const auto weights = weights_of<float>(p);
  const sdmha::SparseDenseMHA<float> standard(config_of(p), weights);
  CustomLayer<float> custom(config_of(p), weights);  // the same weights, shared
  configure(custom, Settings{{0.0, 0.0}, {1.0, 1.0}});
  const auto d_output = loss_weights<float>(p);
  bool ok = true;
  for (const auto strategy : kStrategies) {
    const auto in = inputs_of<float>(p, strategy);
    const bool forward_same =
        same_bits(custom.forward(in.query, {in.key, in.value}, in.options).output,
                  standard.forward(in.query, {in.key, in.value}, in.options).output);
    const bool backward_same =
        same_gradients(custom.backward(in.query, {in.key, in.value}, d_output, in.options),
                       standard.backward(in.query, {in.key, in.value}, d_output, in.options));
    std::printf("slope 0, temperature 1, %-16s: forward %s, backward %s the standard layer's\n",
                name(strategy), forward_same ? "bitwise" : "NOT",
                backward_same ? "bitwise" : "NOT");
    ok = ok && forward_same && backward_same;
  }
  return ok;
}

// 2. The forward against the float64 reference.
bool matches_reference(const Problem& p, const Settings& settings) {
  const std::vector<double> expected = reference(p, settings.slope, settings.temperature);
  CustomLayer<float> custom(config_of(p), weights_of<float>(p));
  configure(custom, settings);
  bool ok = true;
  for (const auto strategy : kStrategies) {
    const auto in = inputs_of<float>(p, strategy);
    const auto output = custom.forward(in.query, {in.key, in.value}, in.options).output;
    double worst = 0.0;
    for (std::size_t i = 0; i < expected.size(); ++i)
      worst = std::max(
          worst, std::abs(double(output.data()[i]) - expected[i]) / (1.0 + std::abs(expected[i])));
    std::printf(
        "slopes %.2f %.2f, temperatures %.1f %.1f, %-16s: max relative |custom - float64 "
        "loops| = %.2g\n",
        settings.slope[0], settings.slope[1], settings.temperature[0], settings.temperature[1],
        name(strategy), worst);
    ok = ok && worst <= 1e-5;
  }
  return ok;
}

// 3. The backward in double: d loss/d Wq at its largest entry against a central difference of
//    loss = Σ output ⊙ d_output.
bool matches_central_difference(const Problem& p, const Settings& settings) {
  bool ok = true;
  for (const auto strategy : kStrategies) {
    CustomLayer<double> custom(config_of(p), weights_of<double>(p));
    configure(custom, settings);
    const auto in = inputs_of<double>(p, strategy);
    const auto d_output = loss_weights<double>(p);
    const auto gradients = custom.backward(in.query, {in.key, in.value}, d_output, in.options);
    Index row = 0, column = 0;
    gradients.query_kernel.cwiseAbs().maxCoeff(&row, &column);
    auto loss = [&] {
      const auto output = custom.forward(in.query, {in.key, in.value}, in.options).output;
      const Eigen::Tensor<double, 0, Eigen::RowMajor> sum = (output * d_output).sum();
      return sum();
    };
    double& weight = custom.weights().query_kernel(row, column);  // edited in place
    const double step = 1e-5, original = weight;
    weight = original + step;
    const double above = loss();
    weight = original - step;
    const double below = loss();
    weight = original;
    const double difference = (above - below) / (2 * step);
    const double analytic = gradients.query_kernel(row, column);
    const double error = std::abs(difference - analytic) / std::max(std::abs(analytic), 1e-12);
    std::printf(
        "d loss/d Wq[%ld, %ld], %-16s: backward %.9f, central difference %.9f (relative %.1e)\n",
        long(row), long(column), name(strategy), analytic, difference, error);
    ok = ok && error <= 1e-6;
  }
  return ok;
}

// 4. Training through both stages: fit the output of a teacher, the same layer with other
//    weights (its output computed by the reference). The layer is made once; its shared weights
//    are updated in place.
bool trains(const Problem& p, const Settings& settings) {
  Problem teacher = p;
  draw_weights(teacher, 7);
  const std::vector<double> taught = reference(teacher, settings.slope, settings.temperature);
  Eigen::Tensor<float, 3, Eigen::RowMajor> target(p.B, p.T, p.O);
  for (std::size_t i = 0; i < taught.size(); ++i) target.data()[i] = float(taught[i]);
  const auto weights = weights_of<float>(p);
  CustomLayer<float> custom(config_of(p), weights);
  configure(custom, settings);
  const auto in = inputs_of<float>(p, sdmha::ScoreStrategy::automatic);
  sdmha::Workspace<float> workspace;
  sdmha::AttentionResult<float> result;
  sdmha::MhaGradients<float> g;
  // loss = Σ (output − target)² / (B·T), so d_output = 2·(output − target) / (B·T).
  const float rate = 0.3f, rows = float(p.B * p.T);
  double first = 0.0, last = 0.0;
  for (int step = 0; step < 30; ++step) {
    custom.forward(in.query, {in.key, in.value}, in.options, workspace, result);
    const Eigen::Tensor<float, 0, Eigen::RowMajor> loss =
        (result.output - target).square().sum() / rows;
    (step == 0 ? first : last) = double(loss());
    const Eigen::Tensor<float, 3, Eigen::RowMajor> d_output =
        (result.output - target) * (2.0f / rows);
    custom.backward(in.query, {in.key, in.value}, d_output, in.options, workspace, g);
    weights->query_kernel -= rate * g.query_kernel;
    weights->query_bias -= rate * g.query_bias;
    weights->key_kernel -= rate * g.key_kernel;
    weights->key_bias -= rate * g.key_bias;
    weights->value_kernel -= rate * g.value_kernel;
    weights->value_bias -= rate * g.value_bias;
    weights->output_kernel -= rate * g.output_kernel;
    weights->output_bias -= rate * g.output_bias;
  }
  std::printf("training to a teacher, 30 steps of gradient descent: loss %.4f -> %.4f\n", first,
              last);
  return last < 0.5 * first;
}

int main() {
  const Problem p = make_problem();
  const Settings settings{{0.25, 0.05}, {0.7, 1.6}};
  std::printf("custom stages: B=%ld T=%ld S=%ld H=%ld, causal, batch 1's last 20 keys padded\n",
              long(p.B), long(p.T), long(p.S), long(p.H));
  bool ok = matches_standard_layer(p);
  ok = matches_reference(p, settings) && ok;
  ok = matches_central_difference(p, settings) && ok;
  ok = trains(p, settings) && ok;
  std::printf("%s\n", ok ? "custom stages ok" : "custom stages FAILED");
  return ok ? 0 : 1;
}
