// tests/gradient_check.hpp — every gradient of a layer's backward against central finite
// differences of its forward, in double: the check that the backward tests, the custom-stage
// tests and the semantics tests share.
#pragma once

#include <algorithm>
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
struct GradientView {
  std::string name;
  double* parameter;
  const double* gradient;
  Index parameter_size;
  Index gradient_size;
};

inline std::vector<GradientView> views(Case<double>& c, const sdmha::MhaGradients<double>& g) {
  auto view = [](const char* name, auto& parameter, const auto& gradient) {
    return GradientView{name, parameter.data(), gradient.data(), Index(parameter.size()),
                        Index(gradient.size())};
  };
  auto& w = c.weights;
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

inline Tensor3<double> random_d_output(const Case<double>& c, std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  Tensor3<double> d_output(c.problem.batch, c.problem.steps, c.problem.output_dim);
  for (Index i = 0; i < d_output.size(); ++i) d_output.data()[i] = uniform(generator);
  return d_output;
}

// Σ dY ⊙ Y through `Layer`'s forward, accumulated in long double so that its rounding stays far
// below what the finite differences resolve.
template <typename Layer>
double loss(const Case<double>& c, const Tensor3<double>& d_output,
            const sdmha::AttentionOptions<double>& options) {
  const Layer layer(c.config, c.weights);
  const auto output = layer.forward(c.query(), c.key, c.value, options).output;
  long double total = 0;
  for (Index i = 0; i < output.size(); ++i)
    total += (long double)d_output.data()[i] * output.data()[i];
  return double(total);
}

// Checks `max_checked` random entries of every gradient (all of a smaller one) against
// (L(θ + h) − L(θ − h)) / 2h; returns how many failed.
template <typename Layer = sdmha::SparseDenseMHA<double>>
long check(Case<double> c, const sdmha::AttentionOptions<double>& options, std::uint64_t seed,
           Index max_checked = 40) {
  const auto d_output = random_d_output(c, seed);
  const Layer layer(c.config, c.weights);
  const auto gradients = layer.backward(c.query(), c.key, c.value, d_output, options);
  std::mt19937_64 generator(seed + 1);
  long failed = 0;
  for (const auto& view : views(c, gradients)) {
    EXPECT_EQ(view.gradient_size, view.parameter_size) << view.name;
    if (view.gradient_size != view.parameter_size) return failed + 1;
    std::vector<Index> entries(static_cast<std::size_t>(view.parameter_size));
    std::iota(entries.begin(), entries.end(), 0);
    std::shuffle(entries.begin(), entries.end(), generator);
    entries.resize(std::min<std::size_t>(entries.size(), std::size_t(max_checked)));
    for (Index entry : entries) {
      double& parameter = view.parameter[entry];
      const double saved = parameter;
      parameter = saved + kStep;
      const double above = loss<Layer>(c, d_output, options);
      parameter = saved - kStep;
      const double below = loss<Layer>(c, d_output, options);
      parameter = saved;
      const double numeric = (above - below) / (2 * kStep), analytic = view.gradient[entry];
      if (!(std::abs(numeric - analytic) <=
            kAbsoluteTolerance + kRelativeTolerance * std::abs(analytic)) &&
          ++failed <= 10)
        ADD_FAILURE() << view.name << "[" << entry << "]: analytic " << analytic
                      << ", central difference " << numeric;
    }
  }
  return failed;
}

}  // namespace sdmha_test::gradient_check
