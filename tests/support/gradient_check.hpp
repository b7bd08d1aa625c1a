// tests/support/gradient_check.hpp — every gradient of a layer's backward against central finite
// differences of its forward, in double: the check that the backward tests, the custom-stage
// tests and the semantics tests share.
#pragma once

#include <algorithm>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace sdmha_test::gradient_check {

constexpr double kStep = 1e-6;
constexpr double kAbsoluteTolerance = 1e-7;
constexpr double kRelativeTolerance = 1e-5;

// A gradient with the parameter or input it belongs to.
template <typename Scalar = double>
struct GradientView {
  std::string name;
  Scalar* parameter;
  const Scalar* gradient;
  Index parameter_size;
  Index gradient_size;
};

// Every gradient of `g` beside the entry of `weights` (the layer's) or of the inputs in `c` it
// belongs to.
template <typename Scalar>
std::vector<GradientView<Scalar>> views(sdmha::MhaWeights<Scalar>& weights, Case<Scalar>& c,
                                        const sdmha::MhaGradients<Scalar>& g) {
  auto view = [](const char* name, auto& parameter, const auto& gradient) {
    return GradientView<Scalar>{name, parameter.data(), gradient.data(), Index(parameter.size()),
                                Index(gradient.size())};
  };
  auto& w = weights;
  return {view("query_kernel", w.query_kernel, g.query_kernel),
          view("query_bias", w.query_bias, g.query_bias),
          view("key_kernel", w.key_kernel, g.key_kernel),
          view("key_bias", w.key_bias, g.key_bias),
          view("value_kernel", w.value_kernel, g.value_kernel),
          view("value_bias", w.value_bias, g.value_bias),
          view("output_kernel", w.output_kernel, g.output_kernel),
          view("output_bias", w.output_bias, g.output_bias),
          view("query_values", c.values, g.query_values),
          view("key", c.key, g.key),
          view("value", c.value, g.value)};
}

template <typename Scalar>
std::vector<GradientView<Scalar>> views(Case<Scalar>& c, const sdmha::MhaGradients<Scalar>& g) {
  return views(c.weights, c, g);
}

template <typename Scalar>
Tensor3<Scalar> random_d_output(const Case<Scalar>& c, std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  Tensor3<Scalar> d_output(c.problem.batch, c.problem.steps, c.problem.output_dim);
  for (Index i = 0; i < d_output.size(); ++i) d_output.data()[i] = Scalar(uniform(generator));
  return d_output;
}

// Σ dY ⊙ Y, accumulated in long double so that its rounding stays far below what the finite
// differences resolve.
inline double weighted_sum(const Tensor3<double>& d_output, const Tensor3<double>& output) {
  long double total = 0;
  for (Index i = 0; i < output.size(); ++i)
    total += (long double)d_output.data()[i] * output.data()[i];
  return double(total);
}

// Σ dY ⊙ Y through `Layer`'s forward.
template <typename Layer>
double loss(const Case<double>& c, const Tensor3<double>& d_output,
            const sdmha::AttentionOptions<double>& options) {
  const Layer layer(c.config, c.weights);
  return weighted_sum(d_output, layer.forward(c.query(), {c.key, c.value}, options).output);
}

// What a check saw.
struct Summary {
  long checked = 0;
  long failed = 0;
  double worst = 0;  // the largest |numeric − analytic| / (absolute + relative·|analytic|)

  Summary& operator+=(const Summary& other) {
    checked += other.checked;
    failed += other.failed;
    worst = std::max(worst, other.worst);
    return *this;
  }
};

// `max_checked` distinct entries of [0, size) drawn by `generator` (all of them when fewer).
inline std::vector<Index> sample(Index size, Index max_checked, std::mt19937_64& generator) {
  std::vector<Index> entries(static_cast<std::size_t>(size));
  std::iota(entries.begin(), entries.end(), 0);
  std::shuffle(entries.begin(), entries.end(), generator);
  entries.resize(std::min<std::size_t>(entries.size(), std::size_t(max_checked)));
  return entries;
}

// Checks `max_checked` random entries of every gradient (all of a smaller one) against
// (L(θ + h) − L(θ − h)) / 2h, L = Σ dY ⊙ forward(…) through `layer`. `weights` are the layer's
// own (it shares them), perturbed in place like the inputs in `c`. `report` false: count the
// failures without adding test failures (for negative controls).
template <typename Layer>
Summary check_layer(const Layer& layer, sdmha::MhaWeights<double>& weights, Case<double>& c,
                    const sdmha::AttentionOptions<double>& options, std::uint64_t seed,
                    Index max_checked, bool report = true) {
  const auto d_output = random_d_output(c, seed);
  const auto gradients = layer.backward(c.query(), {c.key, c.value}, d_output, options);
  auto loss_now = [&] {
    return weighted_sum(d_output, layer.forward(c.query(), {c.key, c.value}, options).output);
  };
  std::mt19937_64 generator(seed + 1);
  Summary summary;
  for (const auto& view : views(weights, c, gradients)) {
    if (report) {
      EXPECT_EQ(view.gradient_size, view.parameter_size) << view.name;
    }
    if (view.gradient_size != view.parameter_size) {
      ++summary.failed;
      continue;
    }
    for (Index entry : sample(view.parameter_size, max_checked, generator)) {
      double& parameter = view.parameter[entry];
      const double saved = parameter;
      parameter = saved + kStep;
      const double above = loss_now();
      parameter = saved - kStep;
      const double below = loss_now();
      parameter = saved;
      const double numeric = (above - below) / (2 * kStep), analytic = view.gradient[entry];
      const double error = std::abs(numeric - analytic);
      const double tolerance = kAbsoluteTolerance + kRelativeTolerance * std::abs(analytic);
      ++summary.checked;
      summary.worst = std::max(summary.worst, error / tolerance);
      if (!(error <= tolerance) && ++summary.failed <= 10 && report)
        ADD_FAILURE() << view.name << "[" << entry << "]: analytic " << analytic
                      << ", central difference " << numeric;
    }
  }
  return summary;
}

// check_layer through a `Layer` made from c's configuration and (a copy of) its weights.
template <typename Layer = sdmha::SparseDenseMHA<double>>
Summary summarize(Case<double> c, const sdmha::AttentionOptions<double>& options,
                  std::uint64_t seed, Index max_checked = 40, bool report = true) {
  auto weights = std::make_shared<sdmha::MhaWeights<double>>(c.weights);
  const Layer layer(c.config, weights);
  return check_layer(layer, *weights, c, options, seed, max_checked, report);
}

// How many entries failed.
template <typename Layer = sdmha::SparseDenseMHA<double>>
long check(Case<double> c, const sdmha::AttentionOptions<double>& options, std::uint64_t seed,
           Index max_checked = 40) {
  return summarize<Layer>(std::move(c), options, seed, max_checked).failed;
}

}  // namespace sdmha_test::gradient_check
