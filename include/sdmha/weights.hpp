// sdmha/weights.hpp — MhaConfig and MhaWeights<Scalar>, in Keras' layout.
//
// Keras stores its projection kernels as (E, H, D) arrays; flattened row-major they are the
// (E × H·D) matrices kept here, head h owning columns [h·D, (h+1)·D). The output kernel (H, Dv, O)
// flattens to (H·Dv × O). Biases are vectors; they are empty when use_bias is false.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>

#include "sdmha/config.hpp"
#include "sdmha/errors.hpp"

namespace sdmha {

struct MhaConfig {
  Index num_heads = 0;   // H, > 0
  Index key_dim = 0;     // Dk, the width of one head's query and key, > 0
  Index value_dim = 0;   // Dv, the width of one head's value; 0 means key_dim
  Index output_dim = 0;  // O; 0 means the query's feature width Eq (Keras' default output_shape)
  bool use_bias = true;

  Index resolved_value_dim() const { return value_dim == 0 ? key_dim : value_dim; }
  Index resolved_output_dim(Index query_dim) const {
    return output_dim == 0 ? query_dim : output_dim;
  }

  void validate() const {
    constexpr const char* where = "MhaConfig";
    if (num_heads <= 0)
      detail::fail<ConfigError>(where, "num_heads = ", num_heads, "; expected > 0");
    if (key_dim <= 0) detail::fail<ConfigError>(where, "key_dim = ", key_dim, "; expected > 0");
    if (value_dim < 0)
      detail::fail<ConfigError>(where, "value_dim = ", value_dim,
                                "; expected >= 0 (0 means key_dim)");
    if (output_dim < 0)
      detail::fail<ConfigError>(where, "output_dim = ", output_dim,
                                "; expected >= 0 (0 means the query's feature width)");
  }
};

// Every width of the layer, resolved from a configuration and the weights' shapes.
struct LayerDims {
  Index num_heads = 0;     // H
  Index key_dim = 0;       // Dk
  Index value_dim = 0;     // Dv
  Index query_dim = 0;     // Eq
  Index key_in_dim = 0;    // Ek
  Index value_in_dim = 0;  // Ev
  Index output_dim = 0;    // O
  Index projected_key_width() const { return num_heads * key_dim; }
  Index projected_value_width() const { return num_heads * value_dim; }
};

template <typename Scalar>
struct MhaWeights {
  RowMatrix<Scalar> query_kernel;   // Eq × H·Dk
  Vector<Scalar> query_bias;        // H·Dk
  RowMatrix<Scalar> key_kernel;     // Ek × H·Dk
  Vector<Scalar> key_bias;          // H·Dk
  RowMatrix<Scalar> value_kernel;   // Ev × H·Dv
  Vector<Scalar> value_bias;        // H·Dv
  RowMatrix<Scalar> output_kernel;  // H·Dv × O
  Vector<Scalar> output_bias;       // O

  // Keras' default initialisation: kernels drawn from GlorotUniform, biases zero. The limit is
  // sqrt(6 / (fan_in + fan_out)) with Keras' fans for an (E, H, D) kernel: the receptive field
  // is E, so fan_in = E·H and fan_out = E·D (output kernel (H, Dv, O): H·Dv and H·O). The random
  // stream is sdmha's own (mt19937_64 from `seed`), reproducible across platforms, not Keras'.
  static MhaWeights glorot_uniform(const MhaConfig& config, Index query_dim, Index key_in_dim,
                                   Index value_in_dim, std::uint64_t seed) {
    config.validate();
    constexpr const char* where = "MhaWeights::glorot_uniform";
    if (query_dim <= 0)
      detail::fail<ShapeError>(where, "query_dim = ", query_dim, "; expected > 0");
    if (key_in_dim <= 0)
      detail::fail<ShapeError>(where, "key_in_dim = ", key_in_dim, "; expected > 0");
    if (value_in_dim <= 0)
      detail::fail<ShapeError>(where, "value_in_dim = ", value_in_dim, "; expected > 0");
    const Index heads = config.num_heads, key_dim = config.key_dim;
    const Index value_dim = config.resolved_value_dim();
    const Index output_dim = config.resolved_output_dim(query_dim);
    std::mt19937_64 generator(seed);
    MhaWeights weights;
    weights.query_kernel =
        glorot(generator, query_dim, heads * key_dim, query_dim * heads, query_dim * key_dim);
    weights.key_kernel =
        glorot(generator, key_in_dim, heads * key_dim, key_in_dim * heads, key_in_dim * key_dim);
    weights.value_kernel = glorot(generator, value_in_dim, heads * value_dim, value_in_dim * heads,
                                  value_in_dim * value_dim);
    weights.output_kernel =
        glorot(generator, heads * value_dim, output_dim, heads * value_dim, heads * output_dim);
    if (config.use_bias) {
      weights.query_bias = Vector<Scalar>::Zero(heads * key_dim);
      weights.key_bias = Vector<Scalar>::Zero(heads * key_dim);
      weights.value_bias = Vector<Scalar>::Zero(heads * value_dim);
      weights.output_bias = Vector<Scalar>::Zero(output_dim);
    }
    return weights;
  }

  // Checks every shape against the configuration and returns the resolved widths. Eq, Ek and Ev
  // are read off the kernels' row counts.
  LayerDims validate(const MhaConfig& config) const {
    config.validate();
    constexpr const char* where = "MhaWeights";
    LayerDims dims;
    dims.num_heads = config.num_heads;
    dims.key_dim = config.key_dim;
    dims.value_dim = config.resolved_value_dim();
    dims.query_dim = query_kernel.rows();
    dims.key_in_dim = key_kernel.rows();
    dims.value_in_dim = value_kernel.rows();
    dims.output_dim = config.resolved_output_dim(dims.query_dim);
    const Index hk = dims.projected_key_width(), hv = dims.projected_value_width();
    auto expect_kernel = [&](const char* name, const RowMatrix<Scalar>& kernel, Index columns) {
      if (kernel.rows() <= 0 || kernel.cols() != columns)
        detail::fail<ShapeError>(where, name, " is ", kernel.rows(), " x ", kernel.cols(),
                                 "; expected (input width > 0) x ", columns);
    };
    expect_kernel("query_kernel", query_kernel, hk);
    expect_kernel("key_kernel", key_kernel, hk);
    expect_kernel("value_kernel", value_kernel, hv);
    if (output_kernel.rows() != hv || output_kernel.cols() != dims.output_dim)
      detail::fail<ShapeError>(
          where, "output_kernel is ", output_kernel.rows(), " x ", output_kernel.cols(),
          "; expected num_heads * value_dim x output_dim = ", hv, " x ", dims.output_dim);
    auto expect_bias = [&](const char* name, const Vector<Scalar>& bias, Index size) {
      const Index expected = config.use_bias ? size : 0;
      if (bias.size() != expected)
        detail::fail<ShapeError>(where, name, " has ", bias.size(), " entries; expected ", expected,
                                 config.use_bias ? "" : " (use_bias is false)");
    };
    expect_bias("query_bias", query_bias, hk);
    expect_bias("key_bias", key_bias, hk);
    expect_bias("value_bias", value_bias, hv);
    expect_bias("output_bias", output_bias, dims.output_dim);
    return dims;
  }

 private:
  static RowMatrix<Scalar> glorot(std::mt19937_64& generator, Index rows, Index cols, Index fan_in,
                                  Index fan_out) {
    const double limit = std::sqrt(6.0 / double(fan_in + fan_out));
    RowMatrix<Scalar> kernel(rows, cols);
    for (Index i = 0; i < kernel.size(); ++i) {
      // 53 random bits to a double in [0, 1), then to [-limit, limit).
      const double unit = double(generator() >> 11) * 0x1.0p-53;
      kernel.data()[i] = Scalar((2.0 * unit - 1.0) * limit);
    }
    return kernel;
  }
};

}  // namespace sdmha
