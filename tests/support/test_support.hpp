// tests/support/test_support.hpp — what every test file shares (and the precompiled header of the
// suite): SDMHA_ASSERT turned into an exception, tolerances, and random problems built twice, once
// for sdmha and once for the float64 reference in tests/reference/.
#pragma once

#include <stdexcept>
#include <string>

// Before any sdmha header: a failed internal assertion throws, so a test sees it in any build.
#define SDMHA_ASSERT(condition) \
  ((condition) ? static_cast<void>(0) : throw std::logic_error("SDMHA_ASSERT failed: " #condition))

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <numeric>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include <sdmha/sdmha.hpp>

#include "reference/reference_mha.hpp"

namespace sdmha_test {

using sdmha::Index;
using CooIndices = Eigen::Matrix<std::int64_t, Eigen::Dynamic, 3, Eigen::RowMajor>;
template <typename Scalar>
using Tensor3 = Eigen::Tensor<Scalar, 3, Eigen::RowMajor>;
using KeyMask = Eigen::Tensor<bool, 2, Eigen::RowMajor>;  // (B, S), true = may attend

// |got − expected| ≤ tolerance · (1 + |expected|), elementwise. Against the float64 reference a
// float64 result keeps about 12 digits through sums of a few hundred terms, a float result about 4.
template <typename Scalar>
constexpr double relative_tolerance() {
  return 2000.0 * double(std::numeric_limits<Scalar>::epsilon());
}

using ScalarTypes = ::testing::Types<float, double>;

// Declares `Suite`, a test suite typed over ScalarTypes (float and double) whose fixture holds
// nothing: each test takes its scalar type as TypeParam.
#define SDMHA_SCALAR_TYPED_TEST_SUITE(Suite) \
  template <typename Scalar>                 \
  class Suite : public ::testing::Test {};   \
  TYPED_TEST_SUITE(Suite, ::sdmha_test::ScalarTypes, )

// The sizes of one random problem. Density is the fraction of stored values per query row.
struct Shape {
  long batch = 2, steps = 5, key_steps = 7;
  long query_dim = 16, key_in_dim = 12, value_in_dim = 12;
  long heads = 2, key_dim = 4, value_dim = 0, output_dim = 0;
  double density = 0.2;
  bool use_bias = true;
  bool random_mask = false;  // attention_mask with ~30% blocked
  bool causal = false;
  bool key_mask = false;            // key_mask with ~20% of key steps blocked (padding)
  bool empty_rows = false;          // ~30% of query rows hold nothing
  bool fully_blocked_rows = false;  // some rows of the attention mask entirely false
  bool duplicates = false;          // repeat some COO coordinates (they sum)
  bool shuffle = true;              // COO entries in random order

  // Setters that chain, so that a test states a shape in a line or two:
  // Shape{}.sized(3, 80, 70).widths(40, 12, 9).with_heads(3, 9, 5).with_masks().
  Shape& sized(long batch_size, long query_steps, long key_step_count) {
    batch = batch_size;
    steps = query_steps;
    key_steps = key_step_count;
    return *this;
  }
  Shape& widths(long query_width, long key_width, long value_width) {
    query_dim = query_width;
    key_in_dim = key_width;
    value_in_dim = value_width;
    return *this;
  }
  // value_dim and output_dim 0: Keras' defaults (key_dim, and the query's width).
  Shape& with_heads(long head_count, long key_size, long value_size = 0, long output_size = 0) {
    heads = head_count;
    key_dim = key_size;
    value_dim = value_size;
    output_dim = output_size;
    return *this;
  }
  // Every mask at once: a random attention mask, causal, key padding and empty query rows.
  Shape& with_masks(bool on = true) {
    random_mask = causal = key_mask = empty_rows = on;
    return *this;
  }
};

template <typename Scalar>
struct Case {
  Shape shape;
  sdmha_reference::Problem problem;
  sdmha::MhaConfig config;
  sdmha::MhaWeights<Scalar> weights;
  CooIndices indices;
  sdmha::Vector<Scalar> values;
  Tensor3<Scalar> key, value;
  sdmha::AttentionOptions<Scalar> options;
  // The (B, T, S) tensor options.attention_mask views (a view owns nothing). Copies of a Case
  // share it, so a copy's view never dangles; mutable_mask() copies it first when it is shared,
  // so writing through one Case never changes another's mask.
  std::shared_ptr<Tensor3<bool>> mask_storage;

  const Tensor3<bool>& mask() const { return *mask_storage; }
  Tensor3<bool>& mutable_mask() {
    if (mask_storage.use_count() > 1) use_mask(std::make_shared<Tensor3<bool>>(*mask_storage));
    return *mask_storage;
  }
  // Points options.attention_mask at `storage` (none when null).
  void use_mask(std::shared_ptr<Tensor3<bool>> storage) {
    mask_storage = std::move(storage);
    options.attention_mask =
        mask_storage ? sdmha::BroadcastRef<bool>(*mask_storage) : sdmha::BroadcastRef<bool>();
  }
  // The (B, S) tensor options.key_mask views, shared by copies like mask_storage.
  std::shared_ptr<KeyMask> key_mask_storage;

  const KeyMask& key_mask() const { return *key_mask_storage; }
  KeyMask& mutable_key_mask() {
    if (key_mask_storage.use_count() > 1)
      use_key_mask(std::make_shared<KeyMask>(*key_mask_storage));
    return *key_mask_storage;
  }
  // Points options.key_mask at `storage` (none when null).
  void use_key_mask(std::shared_ptr<KeyMask> storage) {
    key_mask_storage = std::move(storage);
    options.key_mask = key_mask_storage ? sdmha::TensorRef<bool, 2>(*key_mask_storage)
                                        : sdmha::TensorRef<bool, 2>();
  }
  // A (B, S) key mask of `allowed` everywhere, in options.key_mask and the reference's problem.
  KeyMask& set_key_mask(bool allowed) {
    use_key_mask(std::make_shared<KeyMask>(problem.batch, problem.key_steps));
    key_mask_storage->setConstant(allowed);
    problem.key_mask.assign(static_cast<std::size_t>(problem.batch * problem.key_steps),
                            char(allowed));
    return *key_mask_storage;
  }

  sdmha::SparseQuery<Scalar> query() const {
    return sdmha::SparseQuery<Scalar>::from_coo(shape.batch, shape.steps, shape.query_dim, indices,
                                                values);
  }
  Tensor3<Scalar> dense_query() const {
    Tensor3<Scalar> dense(shape.batch, shape.steps, shape.query_dim);
    for (Index i = 0; i < dense.size(); ++i) dense.data()[i] = Scalar(problem.query[i]);
    return dense;
  }
};

// Draws a value, rounds it to Scalar, and records the rounded value for the reference too, so
// that the two differ only by the arithmetic.
template <typename Scalar>
struct Filler {
  std::mt19937_64& generator;
  Scalar operator()(double low, double high) {
    std::uniform_real_distribution<double> distribution(low, high);
    return Scalar(distribution(generator));
  }
  void fill(Scalar* data, std::vector<double>& twin, long count, double low, double high) {
    twin.resize(static_cast<std::size_t>(count));
    for (long i = 0; i < count; ++i) {
      data[i] = (*this)(low, high);
      twin[i] = double(data[i]);
    }
  }
};

// The sizes of the layers' random-shape sweeps, drawn in a fixed order: B and H in [1, 3], T and
// S in [1, 9], Eq in [1, 40], Ek and Ev in [1, 10], Dk in [1, 6], Dv in [0, 5] and O in [0, 7]
// (0: the layer's default). Everything else is Shape's default, for the caller to set.
inline Shape random_small_shape(std::mt19937_64& generator) {
  auto pick = [&](long low, long high) {
    return std::uniform_int_distribution<long>(low, high)(generator);
  };
  Shape s;
  s.batch = pick(1, 3);
  s.steps = pick(1, 9);
  s.key_steps = pick(1, 9);
  s.query_dim = pick(1, 40);
  s.key_in_dim = pick(1, 10);
  s.value_in_dim = pick(1, 10);
  s.heads = pick(1, 3);
  s.key_dim = pick(1, 6);
  s.value_dim = pick(0, 5);
  s.output_dim = pick(0, 7);
  return s;
}

// The case's sparse query, as COO (c.indices, c.values) and densely in float64 (p.query):
// distinct columns per row, then optional duplicates and shuffling.
template <typename Scalar>
void fill_sparse_query(Case<Scalar>& c, const Shape& shape, Filler<Scalar>& fill,
                       std::mt19937_64& generator) {
  auto& p = c.problem;
  std::vector<std::array<std::int64_t, 3>> coordinates;
  std::vector<Scalar> values;
  p.query.assign(static_cast<std::size_t>(p.batch * p.steps * p.query_dim), 0.0);
  std::bernoulli_distribution empty_row(0.3), duplicate(0.25);
  const long per_row = std::max(1L, std::lround(shape.density * double(p.query_dim)));
  std::vector<std::int64_t> columns(static_cast<std::size_t>(p.query_dim));
  for (long b = 0; b < p.batch; ++b)
    for (long t = 0; t < p.steps; ++t) {
      if (shape.empty_rows && empty_row(generator)) continue;
      std::iota(columns.begin(), columns.end(), 0);
      std::shuffle(columns.begin(), columns.end(), generator);
      for (long k = 0; k < std::min(per_row, p.query_dim); ++k) {
        const Scalar v = fill(-2.0, 2.0);
        coordinates.push_back({b, t, columns[k]});
        values.push_back(v);
        p.query[(b * p.steps + t) * p.query_dim + columns[k]] += double(v);
        if (shape.duplicates && duplicate(generator)) {
          const Scalar extra = fill(-1.0, 1.0);
          coordinates.push_back({b, t, columns[k]});
          values.push_back(extra);
          p.query[(b * p.steps + t) * p.query_dim + columns[k]] += double(extra);
        }
      }
    }
  std::vector<std::size_t> order(coordinates.size());
  std::iota(order.begin(), order.end(), 0);
  if (shape.shuffle) std::shuffle(order.begin(), order.end(), generator);
  c.indices.resize(static_cast<Index>(order.size()), 3);
  c.values.resize(static_cast<Index>(order.size()));
  for (std::size_t i = 0; i < order.size(); ++i) {
    for (int axis = 0; axis < 3; ++axis) c.indices(Index(i), axis) = coordinates[order[i]][axis];
    c.values[Index(i)] = values[order[i]];
  }
}

template <typename Scalar>
Case<Scalar> make_case(const Shape& shape, std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  Filler<Scalar> fill{generator};
  Case<Scalar> c;
  c.shape = shape;
  auto& p = c.problem;
  p.batch = shape.batch;
  p.steps = shape.steps;
  p.key_steps = shape.key_steps;
  p.query_dim = shape.query_dim;
  p.key_in_dim = shape.key_in_dim;
  p.value_in_dim = shape.value_in_dim;
  p.heads = shape.heads;
  p.key_dim = shape.key_dim;
  p.value_dim = shape.value_dim == 0 ? shape.key_dim : shape.value_dim;
  p.output_dim = shape.output_dim == 0 ? shape.query_dim : shape.output_dim;
  p.causal = shape.causal;

  c.config.num_heads = shape.heads;
  c.config.key_dim = shape.key_dim;
  c.config.value_dim = shape.value_dim;
  c.config.output_dim = shape.output_dim;
  c.config.use_bias = shape.use_bias;

  const long hk = p.heads * p.key_dim, hv = p.heads * p.value_dim;
  auto& w = c.weights;
  auto make_kernel = [&](sdmha::RowMatrix<Scalar>& kernel, std::vector<double>& twin, long rows,
                         long cols) {
    kernel.resize(rows, cols);
    fill.fill(kernel.data(), twin, rows * cols, -0.5, 0.5);
  };
  auto make_bias = [&](sdmha::Vector<Scalar>& bias, std::vector<double>& twin, long size) {
    if (!shape.use_bias) return;
    bias.resize(size);
    fill.fill(bias.data(), twin, size, -0.5, 0.5);
  };
  make_kernel(w.query_kernel, p.query_kernel, p.query_dim, hk);
  make_bias(w.query_bias, p.query_bias, hk);
  make_kernel(w.key_kernel, p.key_kernel, p.key_in_dim, hk);
  make_bias(w.key_bias, p.key_bias, hk);
  make_kernel(w.value_kernel, p.value_kernel, p.value_in_dim, hv);
  make_bias(w.value_bias, p.value_bias, hv);
  make_kernel(w.output_kernel, p.output_kernel, hv, p.output_dim);
  make_bias(w.output_bias, p.output_bias, p.output_dim);

  c.key.resize(p.batch, p.key_steps, p.key_in_dim);
  fill.fill(c.key.data(), p.key, long(c.key.size()), -1.0, 1.0);
  c.value.resize(p.batch, p.key_steps, p.value_in_dim);
  fill.fill(c.value.data(), p.value, long(c.value.size()), -1.0, 1.0);

  fill_sparse_query(c, shape, fill, generator);
  if (shape.random_mask || shape.fully_blocked_rows) {
    c.use_mask(std::make_shared<Tensor3<bool>>(p.batch, p.steps, p.key_steps));
    std::bernoulli_distribution blocked(shape.random_mask ? 0.3 : 0.0), whole_row(0.25);
    p.attention_mask.resize(static_cast<std::size_t>(p.batch * p.steps * p.key_steps));
    for (long b = 0; b < p.batch; ++b)
      for (long t = 0; t < p.steps; ++t) {
        const bool row_blocked = shape.fully_blocked_rows && whole_row(generator);
        for (long s = 0; s < p.key_steps; ++s) {
          const bool allowed = !row_blocked && !blocked(generator);
          c.mutable_mask()(b, t, s) = allowed;
          p.attention_mask[(b * p.steps + t) * p.key_steps + s] = allowed;
        }
      }
  }
  if (shape.key_mask) {
    KeyMask& key_mask = c.set_key_mask(true);
    std::bernoulli_distribution padded(0.2);
    for (long b = 0; b < p.batch; ++b)
      for (long s = 0; s < p.key_steps; ++s) {
        const bool allowed = !padded(generator);
        key_mask(b, s) = allowed;
        p.key_mask[b * p.key_steps + s] = allowed;
      }
  }
  c.options.use_causal_mask = shape.causal;
  return c;
}

struct Variant {
  const char* name;
  Shape shape;
};

// The named shapes that both layers are checked over: odd sizes, batch 1 and head 1, T ≠ S,
// Dv ≠ Dk, O ≠ Eq, every mask, empty and fully blocked rows, duplicates, no bias, a dense query.
inline std::vector<Variant> variants() {
  std::vector<Variant> list;
  list.push_back({"basic", Shape{}});
  Shape s;
  s = Shape{};
  s.batch = 1;
  s.heads = 1;
  list.push_back({"batch1_head1", s});
  s = Shape{};
  s.steps = 3;
  s.key_steps = 11;
  s.query_dim = 23;
  s.key_in_dim = 9;
  s.value_in_dim = 13;
  s.heads = 3;
  s.key_dim = 5;
  s.value_dim = 7;
  s.output_dim = 6;
  list.push_back({"odd_sizes_dv_o", s});
  s = Shape{};
  s.random_mask = true;
  list.push_back({"random_mask", s});
  s = Shape{};
  s.causal = true;
  s.steps = 6;
  s.key_steps = 4;
  list.push_back({"causal_t_gt_s", s});
  s = Shape{};
  s.causal = true;
  s.steps = 3;
  s.key_steps = 8;
  s.random_mask = true;
  list.push_back({"causal_t_lt_s_mask", s});
  s = Shape{};
  s.empty_rows = true;
  s.steps = 9;
  list.push_back({"empty_rows", s});
  s = Shape{};
  s.fully_blocked_rows = true;
  s.steps = 8;
  list.push_back({"fully_blocked_rows", s});
  s = Shape{};
  s.key_mask = true;
  s.random_mask = true;
  list.push_back({"key_mask", s});
  s = Shape{};
  s.duplicates = true;
  s.density = 0.4;
  list.push_back({"duplicates", s});
  s = Shape{};
  s.use_bias = false;
  s.empty_rows = true;
  list.push_back({"no_bias", s});
  s = Shape{};
  s.density = 1.0;
  s.query_dim = 9;
  list.push_back({"dense_query", s});
  s = Shape{};
  s.batch = 3;
  s.steps = 17;
  s.key_steps = 33;
  s.query_dim = 64;
  s.heads = 4;
  s.key_dim = 8;
  s.density = 0.05;
  s.random_mask = true;
  s.causal = true;
  list.push_back({"larger", s});
  return list;
}

// Elementwise check of `count` values against the reference, reporting the worst entry.
template <typename Scalar>
::testing::AssertionResult all_near(const Scalar* got, const std::vector<double>& expected,
                                    double tolerance) {
  if (expected.size() == 0) return ::testing::AssertionSuccess();
  double worst = 0.0;
  std::size_t worst_index = 0;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const double error = std::abs(double(got[i]) - expected[i]) / (1.0 + std::abs(expected[i]));
    if (!(error <= worst) || std::isnan(double(got[i]))) {
      worst = std::isnan(double(got[i])) ? std::numeric_limits<double>::infinity() : error;
      worst_index = i;
      if (std::isnan(double(got[i]))) break;
    }
  }
  if (worst <= tolerance) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "entry " << worst_index << ": got " << double(got[worst_index]) << ", expected "
         << expected[worst_index] << " (relative error " << worst << " > " << tolerance << ")";
}

// Runs `statement`, expects an exception of type E whose message contains `fragment`.
#define SDMHA_EXPECT_THROW_WITH(statement, ExceptionType, fragment)                            \
  do {                                                                                         \
    try {                                                                                      \
      statement;                                                                               \
      ADD_FAILURE() << "expected " #ExceptionType " from: " #statement;                        \
    } catch (const ExceptionType& error) {                                                     \
      EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos)                   \
          << "message \"" << error.what() << "\" lacks \"" << fragment << "\"";                \
    } catch (const std::exception& error) {                                                    \
      ADD_FAILURE() << "expected " #ExceptionType ", got another exception: " << error.what(); \
    }                                                                                          \
  } while (false)

}  // namespace sdmha_test
