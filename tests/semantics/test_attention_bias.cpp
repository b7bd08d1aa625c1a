// The attention bias and the broadcast masks (AttentionOptions::attention_bias, attention_mask as
// views of (T, S), (B, T, S), (B, 1, T, S), (B, H, T, S) or (1, H, T, S) tensors), the bias
// gradient, DropoutGenerator and ProjectedContext::append: forward against the float64 reference
// for every shape and semantics option (both score strategies, the online softmax past kKeyTile
// keys), views that are read at call time and never copied, every gradient against central
// differences with a bias present, the bias gradient's sum over the broadcast axes bitwise the
// same for any thread count, shape errors, the dropout seeds' sequence and the appended context.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gradient_check.hpp"
#include "test_support.hpp"

namespace {

using namespace sdmha_test;

template <typename T>
using Tensor2 = Eigen::Tensor<T, 2, Eigen::RowMajor>;
template <typename T>
using Tensor4 = Eigen::Tensor<T, 4, Eigen::RowMajor>;

constexpr double kInfinity = std::numeric_limits<double>::infinity();
// Central differences of the bias: the same step and tolerances as every other gradient's.
constexpr double kStep = gradient_check::kStep;
constexpr double kAbsoluteTolerance = gradient_check::kAbsoluteTolerance;
constexpr double kRelativeTolerance = gradient_check::kRelativeTolerance;
// Two float64 sums of the same terms in different orders (the bias gradient over the broadcast
// axes, summed by us and by the library): a few ulps of the largest partial sum.
constexpr double kReorderedSumTolerance = 1e-12;

// A shape a mask or bias may have: rank 2 (T, S), 3 (B, T, S) or 4 (B', H', T, S).
struct BroadcastShape {
  const char* name;
  int rank;
  bool per_batch;  // B' = B (else 1)
  bool per_head;   // H' = H (else 1)
};

std::vector<BroadcastShape> broadcast_shapes() {
  return {{"T_S", 2, false, false},   {"B_T_S", 3, true, false},   {"B_1_T_S", 4, true, false},
          {"B_H_T_S", 4, true, true}, {"1_H_T_S", 4, false, true}, {"1_1_T_S", 4, false, false}};
}

// A mask or bias of one BroadcastShape, owned here (the options only view it), with its float64
// twin for the reference in (B', H', T, S) order (the same element order for every rank).
template <typename T>
struct Broadcast {
  BroadcastShape shape{};
  long batch = 1, heads = 1, steps = 0, key_steps = 0;  // B', H', T, S
  Tensor2<T> rank2;
  Tensor3<T> rank3;
  Tensor4<T> rank4;

  Broadcast(const BroadcastShape& s, long b, long h, long t, long k)
      : shape(s), batch(s.per_batch ? b : 1), heads(s.per_head ? h : 1), steps(t), key_steps(k) {
    if (s.rank == 2) rank2.resize(t, k);
    if (s.rank == 3) rank3.resize(batch, t, k);
    if (s.rank == 4) rank4.resize(batch, heads, t, k);
  }
  long size() const { return batch * heads * steps * key_steps; }
  T* data() {
    return shape.rank == 2 ? rank2.data() : shape.rank == 3 ? rank3.data() : rank4.data();
  }
  // The view, through the implicit conversion from each rank's tensor.
  sdmha::BroadcastRef<T> ref() const {
    if (shape.rank == 2) return rank2;
    if (shape.rank == 3) return rank3;
    return rank4;
  }
};

// Fills a mask: ~25% blocked, and ~20% of the (b', h', t) rows blocked entirely.
void fill_mask(Broadcast<bool>& mask, std::vector<char>& twin, std::mt19937_64& generator) {
  std::bernoulli_distribution blocked(0.25), whole_row(0.2);
  twin.resize(std::size_t(mask.size()));
  for (long row = 0; row * mask.key_steps < mask.size(); ++row) {
    const bool row_blocked = whole_row(generator);
    for (long s = 0; s < mask.key_steps; ++s) {
      const long i = row * mask.key_steps + s;
      mask.data()[i] = !row_blocked && !blocked(generator);
      twin[std::size_t(i)] = mask.data()[i];
    }
  }
}

// Fills a bias with values in [−2, 2] rounded to Scalar, a fraction of them −∞.
template <typename Scalar>
void fill_bias(Broadcast<Scalar>& bias, std::vector<double>& twin, std::mt19937_64& generator,
               double minus_infinity_fraction = 0.1) {
  std::uniform_real_distribution<double> value(-2.0, 2.0);
  std::bernoulli_distribution minus_infinity(minus_infinity_fraction);
  twin.resize(std::size_t(bias.size()));
  for (long i = 0; i < bias.size(); ++i) {
    bias.data()[i] = minus_infinity(generator) ? Scalar(-kInfinity) : Scalar(value(generator));
    twin[std::size_t(i)] = double(bias.data()[i]);
  }
}

// A case with an optional broadcast mask and bias of the given shapes (null: none), both owned
// by the caller and viewed by c.options and the reference's problem.
template <typename Scalar>
void attach(Case<Scalar>& c, Broadcast<bool>* mask, Broadcast<Scalar>* bias,
            std::mt19937_64& generator) {
  if (mask != nullptr) {
    fill_mask(*mask, c.problem.broadcast_mask, generator);
    c.problem.mask_batch = mask->batch;
    c.problem.mask_heads = mask->heads;
    c.options.attention_mask = mask->ref();
  }
  if (bias != nullptr) {
    fill_bias(*bias, c.problem.attention_bias, generator);
    c.problem.bias_batch = bias->batch;
    c.problem.bias_heads = bias->heads;
    c.options.attention_bias = bias->ref();
  }
}

// The semantics options, applied to both the options and the reference.
struct Semantics {
  bool causal = false;
  bool bottom_right = false;
  bool uniform = false;
  double scale = 0.0;  // 0: 1/√Dk
  sdmha::ScoreStrategy strategy = sdmha::ScoreStrategy::project_first;
};

template <typename Scalar>
void apply(const Semantics& m, Case<Scalar>& c) {
  c.options.use_causal_mask = c.problem.causal = m.causal;
  c.options.causal_alignment =
      m.bottom_right ? sdmha::CausalAlignment::bottom_right : sdmha::CausalAlignment::top_left;
  c.problem.causal_offset = m.bottom_right ? c.shape.key_steps - c.shape.steps : 0;
  c.options.fully_masked_rows =
      m.uniform ? sdmha::FullyMaskedRows::uniform : sdmha::FullyMaskedRows::zeros;
  c.problem.uniform_fully_masked = m.uniform;
  if (m.scale != 0.0) c.options.scale = m.scale;
  c.problem.scale = m.scale;
  c.options.score_strategy = m.strategy;
}

std::string describe(const Shape& shape, const Semantics& m) {
  return "B=" + std::to_string(shape.batch) + " H=" + std::to_string(shape.heads) +
         " T=" + std::to_string(shape.steps) + " S=" + std::to_string(shape.key_steps) +
         (m.causal ? (m.bottom_right ? " causal bottom_right" : " causal top_left") : "") +
         (m.uniform ? " uniform" : " zeros") + " scale=" + std::to_string(m.scale) + " " +
         sdmha::to_string(m.strategy);
}

// The layer's forward against the reference, probabilities too when `scores`, and bitwise the
// same output for 1 and 2 threads.
template <typename Scalar>
void expect_matches_reference(Case<Scalar>& c, bool scores = true) {
  const sdmha::SparseDenseMHA<Scalar> layer(c.config, c.weights);
  c.options.return_attention_scores = scores;
  c.options.num_threads = 2;
  const auto result = layer.forward(c.query(), {c.key, c.value}, c.options);
  const auto expected = sdmha_reference::forward(c.problem);
  EXPECT_TRUE(all_near(result.output.data(), expected.output, relative_tolerance<Scalar>()));
  if (scores) {
    EXPECT_TRUE(all_near(result.attention_scores.data(), expected.probabilities,
                         relative_tolerance<Scalar>()));
  }
  c.options.num_threads = 1;
  const auto single = layer.forward(c.query(), {c.key, c.value}, c.options);
  for (Index i = 0; i < result.output.size(); ++i)
    ASSERT_EQ(single.output.data()[i], result.output.data()[i]) << "thread counts differ at " << i;
}

// Odd sizes, T ≠ S both ways, B = 1 and H = 1.
std::vector<Shape> small_shapes() {
  std::vector<Shape> list;
  Shape s;
  s.batch = 2, s.heads = 3, s.steps = 5, s.key_steps = 7;
  list.push_back(s);
  s.batch = 1, s.heads = 1, s.steps = 4, s.key_steps = 9;
  list.push_back(s);
  s.batch = 1, s.heads = 2, s.steps = 6, s.key_steps = 3;
  list.push_back(s);
  s.batch = 3, s.heads = 1, s.steps = 3, s.key_steps = 3;
  list.push_back(s);
  return list;
}

SDMHA_SCALAR_TYPED_TEST_SUITE(AttentionBiasTest);

// Every mask shape (or none) with every bias shape (or none), on each small shape; the semantics
// options cycle through their combinations so that every pair meets each of them somewhere.
TYPED_TEST(AttentionBiasTest, EveryMaskAndBiasShapeMatchesReference) {
  using Scalar = TypeParam;
  const auto shapes = broadcast_shapes();
  std::uint64_t seed = 0;
  for (const Shape& shape : small_shapes())
    for (int mask_shape = -1; mask_shape < int(shapes.size()); ++mask_shape)
      for (int bias_shape = -1; bias_shape < int(shapes.size()); ++bias_shape) {
        auto c = make_case<Scalar>(shape, 1000 + seed);
        std::mt19937_64 generator(2000 + seed);
        Semantics m;
        m.causal = seed % 3 != 0;
        m.bottom_right = seed % 3 == 2;
        m.uniform = (seed / 3) % 2 == 1;
        m.scale = seed % 4 == 1 ? 0.37 : 0.0;
        m.strategy = seed % 2 == 0 ? sdmha::ScoreStrategy::project_first
                                   : sdmha::ScoreStrategy::sparse_regrouped;
        ++seed;
        apply(m, c);
        std::unique_ptr<Broadcast<bool>> mask;
        std::unique_ptr<Broadcast<Scalar>> bias;
        if (mask_shape >= 0)
          mask = std::make_unique<Broadcast<bool>>(shapes[std::size_t(mask_shape)], shape.batch,
                                                   shape.heads, shape.steps, shape.key_steps);
        if (bias_shape >= 0)
          bias = std::make_unique<Broadcast<Scalar>>(shapes[std::size_t(bias_shape)], shape.batch,
                                                     shape.heads, shape.steps, shape.key_steps);
        attach(c, mask.get(), bias.get(), generator);
        SCOPED_TRACE(describe(shape, m) + " mask " + (mask ? mask->shape.name : "none") + " bias " +
                     (bias ? bias->shape.name : "none"));
        expect_matches_reference(c);
      }
}

// A per-head mask and bias together with key padding and the (B, T, S) mask of make_case, under
// every causal alignment, both policies, both strategies and a custom scale.
TYPED_TEST(AttentionBiasTest, EverySemanticsOptionWithMaskAndBias) {
  using Scalar = TypeParam;
  const auto shapes = broadcast_shapes();
  std::uint64_t seed = 0;
  for (const Shape& base : small_shapes())
    for (int causal = 0; causal < 3; ++causal)
      for (bool uniform : {false, true})
        for (double scale : {0.0, -0.6})
          for (auto strategy :
               {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
            Shape shape = base;
            shape.key_mask = true;
            auto c = make_case<Scalar>(shape, 3000 + seed);
            std::mt19937_64 generator(4000 + seed++);
            const Semantics m{causal > 0, causal == 2, uniform, scale, strategy};
            apply(m, c);
            Broadcast<bool> mask(shapes[4], shape.batch, shape.heads, shape.steps, shape.key_steps);
            Broadcast<Scalar> bias(shapes[seed % shapes.size()], shape.batch, shape.heads,
                                   shape.steps, shape.key_steps);
            attach(c, &mask, &bias, generator);
            SCOPED_TRACE(describe(shape, m) + " bias " + bias.shape.name);
            expect_matches_reference(c);
          }
}

// Past kKeyTile keys the forward takes the online softmax over key tiles (project_first, zeros,
// no returned scores); the bias and the masks must apply per tile at the right key offsets.
TYPED_TEST(AttentionBiasTest, OnlineSoftmaxPathWithBiasAndMasks) {
  using Scalar = TypeParam;
  std::uint64_t seed = 0;
  for (const BroadcastShape& bias_shape : broadcast_shapes())
    for (int causal = 0; causal < 3; ++causal)
      for (bool uniform : {false, true}) {
        Shape shape = Shape{}.sized(2, 6, sdmha::detail::kKeyTile + 89);
        shape.query_dim = 12;
        auto c = make_case<Scalar>(shape, 5000 + seed);
        std::mt19937_64 generator(6000 + seed++);
        const Semantics m{causal > 0, causal == 2, uniform, 0.3,
                          sdmha::ScoreStrategy::project_first};
        apply(m, c);
        Broadcast<bool> mask(broadcast_shapes()[std::size_t(seed % 6)], shape.batch, shape.heads,
                             shape.steps, shape.key_steps);
        Broadcast<Scalar> bias(bias_shape, shape.batch, shape.heads, shape.steps, shape.key_steps);
        attach(c, &mask, &bias, generator);
        // Rows whose every key past the first tile is −∞: the running maximum of the online
        // softmax meets a tile that adds nothing.
        for (long t = 0; t < shape.steps; t += 2)
          for (long s = sdmha::detail::kKeyTile; s < shape.key_steps; ++s) {
            bias.data()[t * shape.key_steps + s] = Scalar(-kInfinity);
            c.problem.attention_bias[std::size_t(t * shape.key_steps + s)] = -kInfinity;
          }
        SCOPED_TRACE(describe(shape, m) + " bias " + bias_shape.name);
        expect_matches_reference(c, false);
      }
}

// A bias with every entry −∞ blocks every row: each is fully masked under either policy.
TYPED_TEST(AttentionBiasTest, AllMinusInfinityBiasBlocksEveryRow) {
  using Scalar = TypeParam;
  for (bool uniform : {false, true}) {
    auto c = make_case<Scalar>(Shape{}, 7000);
    Semantics m;
    m.uniform = uniform;
    apply(m, c);
    Tensor2<Scalar> bias(c.shape.steps, c.shape.key_steps);
    bias.setConstant(Scalar(-kInfinity));
    c.options.attention_bias = bias;
    c.problem.attention_bias.assign(std::size_t(bias.size()), -kInfinity);
    expect_matches_reference(c);
  }
}

// ---- views ------------------------------------------------------------------------------------

// The options hold views: writing into the caller's bias or mask between two calls changes the
// second call's output, to what the reference gives for the new values.
TYPED_TEST(AttentionBiasTest, ViewsAreReadAtCallTime) {
  using Scalar = TypeParam;
  auto c = make_case<Scalar>(Shape{}, 8000);
  std::mt19937_64 generator(8001);
  Broadcast<bool> mask(broadcast_shapes()[4], 2, 2, 5, 7);
  Broadcast<Scalar> bias(broadcast_shapes()[1], 2, 2, 5, 7);
  attach(c, &mask, &bias, generator);
  const sdmha::SparseDenseMHA<Scalar> layer(c.config, c.weights);
  const auto before = layer.forward(c.query(), {c.key, c.value}, c.options).output;
  // One finite entry per row moves (a constant over a whole row would leave the softmax as is).
  for (long row = 0; row * bias.key_steps < bias.size(); ++row) {
    const long i = row * bias.key_steps + row % bias.key_steps;
    if (std::isinf(c.problem.attention_bias[std::size_t(i)])) continue;
    bias.data()[i] += Scalar(1.5);
    c.problem.attention_bias[std::size_t(i)] = double(bias.data()[i]);
  }
  const auto after_bias = layer.forward(c.query(), {c.key, c.value}, c.options).output;
  EXPECT_TRUE(all_near(after_bias.data(), sdmha_reference::forward(c.problem).output,
                       relative_tolerance<Scalar>()));
  bool changed = false;
  for (Index i = 0; i < before.size(); ++i)
    changed = changed || before.data()[i] != after_bias.data()[i];
  EXPECT_TRUE(changed) << "the bias was copied, not viewed";
  for (long i = 0; i < mask.size(); ++i) {
    mask.data()[i] = !mask.data()[i];
    c.problem.broadcast_mask[std::size_t(i)] = mask.data()[i];
  }
  const auto after_mask = layer.forward(c.query(), {c.key, c.value}, c.options).output;
  EXPECT_TRUE(all_near(after_mask.data(), sdmha_reference::forward(c.problem).output,
                       relative_tolerance<Scalar>()));
}

// A (T, S) bias on B·H > 1 serves every (b, h) as the expanded (B, H, T, S) copy does: the same
// additions, so the same output bit for bit; likewise a (1, H, T, S) mask and its expansion.
TYPED_TEST(AttentionBiasTest, BroadcastEqualsExpanded) {
  using Scalar = TypeParam;
  auto c = make_case<Scalar>(Shape{}, 8100);
  std::mt19937_64 generator(8101);
  const long B = c.shape.batch, H = c.shape.heads, T = c.shape.steps, S = c.shape.key_steps;
  Broadcast<bool> mask(broadcast_shapes()[4], B, H, T, S);
  Broadcast<Scalar> bias(broadcast_shapes()[0], B, H, T, S);
  attach(c, &mask, &bias, generator);
  Tensor4<Scalar> bias_expanded(B, H, T, S);
  Tensor4<bool> mask_expanded(B, H, T, S);
  for (long b = 0; b < B; ++b)
    for (long h = 0; h < H; ++h)
      for (long t = 0; t < T; ++t)
        for (long s = 0; s < S; ++s) {
          bias_expanded(b, h, t, s) = bias.rank2(t, s);
          mask_expanded(b, h, t, s) = mask.rank4(0, h, t, s);
        }
  for (auto strategy :
       {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
    c.options.score_strategy = strategy;
    c.options.return_attention_scores = true;
    const sdmha::SparseDenseMHA<Scalar> layer(c.config, c.weights);
    const auto broadcast = layer.forward(c.query(), {c.key, c.value}, c.options);
    auto options = c.options;
    options.attention_bias = bias_expanded;
    options.attention_mask = mask_expanded;
    const auto expanded = layer.forward(c.query(), {c.key, c.value}, options);
    for (Index i = 0; i < broadcast.output.size(); ++i)
      ASSERT_EQ(broadcast.output.data()[i], expanded.output.data()[i]) << i;
    for (Index i = 0; i < broadcast.attention_scores.size(); ++i)
      ASSERT_EQ(broadcast.attention_scores.data()[i], expanded.attention_scores.data()[i]) << i;
  }
}

// A TensorMap over the caller's memory is a view as well.
TEST(AttentionBias, TensorMapViews) {
  auto c = make_case<double>(Shape{}, 8200);
  std::vector<double> bias(std::size_t(c.shape.steps * c.shape.key_steps));
  std::mt19937_64 generator(8201);
  std::uniform_real_distribution<double> value(-1.0, 1.0);
  for (double& entry : bias) entry = value(generator);
  const Eigen::TensorMap<const Tensor2<double>> map(bias.data(), c.shape.steps, c.shape.key_steps);
  c.options.attention_bias = map;
  c.problem.attention_bias = bias;
  expect_matches_reference(c);
}

// ---- backward ---------------------------------------------------------------------------------

using Layer = sdmha::SparseDenseMHA<double>;

// The bias gradient of `c` (whose options view `bias`) against central differences of the loss
// at `max_checked` random entries (−∞ and blocked ones among them); returns how many failed.
long check_bias_gradient(const Case<double>& c, Broadcast<double>& bias, std::uint64_t seed,
                         Index max_checked = 30) {
  const auto d_output = gradient_check::random_d_output(c, seed);
  auto options = c.options;
  options.compute_bias_gradient = true;
  const Layer layer(c.config, c.weights);
  const auto gradients = layer.backward(c.query(), {c.key, c.value}, d_output, options);
  EXPECT_EQ(gradients.attention_bias.dimension(0), bias.batch);
  EXPECT_EQ(gradients.attention_bias.dimension(1), bias.heads);
  EXPECT_EQ(gradients.attention_bias.dimension(2), bias.steps);
  EXPECT_EQ(gradients.attention_bias.dimension(3), bias.key_steps);
  if (gradients.attention_bias.size() != bias.size()) return 1;
  std::vector<Index> entries(std::size_t(bias.size()));
  std::iota(entries.begin(), entries.end(), 0);
  std::mt19937_64 generator(seed + 1);
  std::shuffle(entries.begin(), entries.end(), generator);
  entries.resize(std::min<std::size_t>(entries.size(), std::size_t(max_checked)));
  long failed = 0;
  for (Index entry : entries) {
    double& parameter = bias.data()[entry];
    const double saved = parameter;
    parameter = saved + kStep;
    const double above = gradient_check::loss<Layer>(c, d_output, c.options);
    parameter = saved - kStep;
    const double below = gradient_check::loss<Layer>(c, d_output, c.options);
    parameter = saved;
    const double numeric = (above - below) / (2 * kStep);
    const double analytic = gradients.attention_bias.data()[entry];
    if (!(std::abs(numeric - analytic) <=
          kAbsoluteTolerance + kRelativeTolerance * std::abs(analytic)) &&
        ++failed <= 10)
      ADD_FAILURE() << "attention_bias " << bias.shape.name << "[" << entry << "]: analytic "
                    << analytic << ", central difference " << numeric;
  }
  return failed;
}

// Every bias entry none of whose (b, h) may attend at its position (mask, causal or −∞ bias)
// has gradient exactly 0; returns how many are blocked.
long expect_zero_where_blocked(const Case<double>& c, const Broadcast<double>& bias,
                               const Tensor4<double>& gradient) {
  const auto& p = c.problem;
  long blocked = 0;
  for (long b = 0; b < p.batch; ++b)
    for (long h = 0; h < p.heads; ++h)
      for (long t = 0; t < p.steps; ++t)
        for (long s = 0; s < p.key_steps; ++s) {
          const long i = sdmha_reference::broadcast_index(bias.batch, bias.heads, p, b, h, t, s);
          bool open = false;  // some (b, h) it serves may attend there
          for (long b2 = 0; b2 < p.batch; ++b2)
            for (long h2 = 0; h2 < p.heads; ++h2)
              if (sdmha_reference::broadcast_index(bias.batch, bias.heads, p, b2, h2, t, s) == i)
                open = open || (sdmha_reference::allowed(p, b2, h2, t, s) &&
                                sdmha_reference::bias_at(p, b2, h2, t, s) != -kInfinity);
          if (open || b != (bias.batch == 1 ? 0 : b) || h != (bias.heads == 1 ? 0 : h)) continue;
          ++blocked;
          EXPECT_EQ(gradient.data()[i], 0.0) << bias.shape.name << " blocked entry " << i;
        }
  return blocked;
}

// Per bias shape, with causal alignments and a broadcast mask: the bias gradient by central
// differences, every other gradient still by central differences, 0 where blocked.
TEST(AttentionBiasGradient, MatchesCentralDifferences) {
  std::uint64_t seed = 0;
  for (const BroadcastShape& bias_shape : broadcast_shapes())
    for (int causal = 0; causal < 3; ++causal) {
      Shape shape;
      shape.batch = 2, shape.heads = 2, shape.steps = 4, shape.key_steps = 6;
      shape.key_mask = causal == 0;
      auto c = make_case<double>(shape, 9000 + seed);
      std::mt19937_64 generator(9100 + seed);
      Semantics m{causal > 0, causal == 2, seed % 2 == 1, seed % 3 == 0 ? 0.45 : 0.0,
                  seed % 2 == 0 ? sdmha::ScoreStrategy::project_first
                                : sdmha::ScoreStrategy::sparse_regrouped};
      ++seed;
      apply(m, c);
      Broadcast<bool> mask(broadcast_shapes()[std::size_t(seed % 6)], 2, 2, 4, 6);
      Broadcast<double> bias(bias_shape, 2, 2, 4, 6);
      attach(c, &mask, &bias, generator);
      SCOPED_TRACE(describe(shape, m) + " bias " + bias_shape.name + " mask " + mask.shape.name);
      EXPECT_EQ(check_bias_gradient(c, bias, 9200 + seed), 0);
      EXPECT_EQ(gradient_check::check(c, c.options, 9300 + seed, 10), 0);
      auto options = c.options;
      options.compute_bias_gradient = true;
      const auto gradients = Layer(c.config, c.weights)
                                 .backward(c.query(), {c.key, c.value},
                                           gradient_check::random_d_output(c, 1), options);
      expect_zero_where_blocked(c, bias, gradients.attention_bias);
    }
}

// Causal with T = S and a per-(b, h) mask leave, for every bias shape, positions blocked in every
// (b, h) an entry serves: there the bias gradient is exactly 0 (and such positions exist, so the
// check checks something).
TEST(AttentionBiasGradient, ZeroAtBlockedPositions) {
  Shape shape;
  shape.batch = 2, shape.heads = 3, shape.steps = 5, shape.key_steps = 5;
  auto c = make_case<double>(shape, 9400);
  std::mt19937_64 generator(9401);
  apply(Semantics{true, false, false, 0.0, sdmha::ScoreStrategy::project_first}, c);
  for (const BroadcastShape& bias_shape : broadcast_shapes()) {
    Broadcast<bool> mask(broadcast_shapes()[3], 2, 3, 5, 5);
    Broadcast<double> bias(bias_shape, 2, 3, 5, 5);
    attach(c, &mask, &bias, generator);
    auto options = c.options;
    options.compute_bias_gradient = true;
    const auto gradients =
        Layer(c.config, c.weights)
            .backward(c.query(), {c.key, c.value}, gradient_check::random_d_output(c, 2), options);
    EXPECT_GT(expect_zero_where_blocked(c, bias, gradients.attention_bias), 0) << bias_shape.name;
  }
}

// Every gradient as flat views, for bitwise comparisons.
std::vector<std::pair<const double*, Index>> all_gradients(const sdmha::MhaGradients<double>& g) {
  auto view = [](const auto& x) { return std::make_pair(x.data(), Index(x.size())); };
  return {view(g.query_kernel), view(g.query_bias), view(g.key_kernel),    view(g.key_bias),
          view(g.value_kernel), view(g.value_bias), view(g.output_kernel), view(g.output_bias),
          view(g.query_values), view(g.key),        view(g.value),         view(g.attention_bias)};
}

void expect_bitwise_equal(const sdmha::MhaGradients<double>& a,
                          const sdmha::MhaGradients<double>& b) {
  const auto first = all_gradients(a), second = all_gradients(b);
  for (std::size_t k = 0; k < first.size(); ++k) {
    ASSERT_EQ(first[k].second, second[k].second) << "gradient " << k;
    for (Index i = 0; i < first[k].second; ++i)
      ASSERT_EQ(first[k].first[i], second[k].first[i]) << "gradient " << k << " entry " << i;
  }
}

// B·H > kBiasGradientChunks (8) items: a broadcast bias's gradient is summed in fixed runs of
// several items. Every gradient is bitwise the same for 1 and 2 threads, the broadcast gradient
// equals the expanded bias's gradient summed over the broadcast axes, and central differences
// agree.
TEST(AttentionBiasGradient, FixedRunsAreThreadIndependentAndSumTheExpandedGradient) {
  std::uint64_t seed = 0;
  for (const auto& sizes :
       {std::array<long, 2>{3, 4}, std::array<long, 2>{5, 2}, std::array<long, 2>{1, 11}})
    for (const BroadcastShape& bias_shape : broadcast_shapes()) {
      Shape shape;
      shape.batch = sizes[0], shape.heads = sizes[1], shape.steps = 4, shape.key_steps = 5;
      shape.query_dim = 10, shape.key_dim = 3;
      auto c = make_case<double>(shape, 9500 + seed);
      std::mt19937_64 generator(9600 + seed++);
      apply(Semantics{true, true, false, 0.0, sdmha::ScoreStrategy::project_first}, c);
      Broadcast<bool> mask(broadcast_shapes()[2], shape.batch, shape.heads, 4, 5);
      Broadcast<double> bias(bias_shape, shape.batch, shape.heads, 4, 5);
      attach(c, &mask, &bias, generator);
      SCOPED_TRACE(std::string(bias_shape.name) + " B=" + std::to_string(shape.batch) +
                   " H=" + std::to_string(shape.heads));
      const auto d_output = gradient_check::random_d_output(c, seed);
      const Layer layer(c.config, c.weights);
      auto options = c.options;
      options.compute_bias_gradient = true;
      options.num_threads = 1;
      const auto single = layer.backward(c.query(), {c.key, c.value}, d_output, options);
      options.num_threads = 2;
      const auto two = layer.backward(c.query(), {c.key, c.value}, d_output, options);
      expect_bitwise_equal(single, two);
      // The same bias expanded to (B, H, T, S): its gradient is the per-(b, h) dS.
      Tensor4<double> expanded(shape.batch, shape.heads, 4, 5);
      for (long b = 0; b < shape.batch; ++b)
        for (long h = 0; h < shape.heads; ++h)
          for (long t = 0; t < 4; ++t)
            for (long s = 0; s < 5; ++s)
              expanded(b, h, t, s) = c.problem.attention_bias[std::size_t(
                  sdmha_reference::broadcast_index(bias.batch, bias.heads, c.problem, b, h, t, s))];
      options.attention_bias = expanded;
      const auto full = layer.backward(c.query(), {c.key, c.value}, d_output, options);
      std::vector<double> summed(std::size_t(bias.size()), 0.0);
      for (long b = 0; b < shape.batch; ++b)
        for (long h = 0; h < shape.heads; ++h)
          for (long t = 0; t < 4; ++t)
            for (long s = 0; s < 5; ++s)
              summed[std::size_t(sdmha_reference::broadcast_index(bias.batch, bias.heads, c.problem,
                                                                  b, h, t, s))] +=
                  full.attention_bias(b, h, t, s);
      EXPECT_TRUE(all_near(single.attention_bias.data(), summed, kReorderedSumTolerance));
      EXPECT_EQ(check_bias_gradient(c, bias, 9700 + seed, 12), 0);
    }
}

// The bias gradient is empty unless asked for and a bias is given; the other gradients do not
// depend on whether it was asked for.
TEST(AttentionBiasGradient, EmptyWhenNotAsked) {
  auto c = make_case<double>(Shape{}, 9800);
  std::mt19937_64 generator(9801);
  Broadcast<double> bias(broadcast_shapes()[3], 2, 2, 5, 7);
  attach(c, nullptr, &bias, generator);
  const Layer layer(c.config, c.weights);
  const auto d_output = gradient_check::random_d_output(c, 3);
  auto options = c.options;
  const auto without = layer.backward(c.query(), {c.key, c.value}, d_output, options);
  EXPECT_EQ(without.attention_bias.size(), 0);
  options.compute_bias_gradient = true;
  const auto with = layer.backward(c.query(), {c.key, c.value}, d_output, options);
  EXPECT_EQ(with.attention_bias.size(), bias.size());
  auto cleared = with;
  cleared.attention_bias = Tensor4<double>();
  expect_bitwise_equal(without, cleared);
  options.attention_bias = sdmha::BroadcastRef<double>();
  EXPECT_EQ(layer.backward(c.query(), {c.key, c.value}, d_output, options).attention_bias.size(),
            0);
  // A workspace and gradients kept from a call with the bias gradient: the next call without it
  // leaves it empty.
  sdmha::Workspace<double> workspace;
  sdmha::MhaGradients<double> kept;
  options.attention_bias = bias.ref();
  layer.backward(c.query(), {c.key, c.value}, d_output, options, workspace, kept);
  EXPECT_EQ(kept.attention_bias.size(), bias.size());
  options.compute_bias_gradient = false;
  layer.backward(c.query(), {c.key, c.value}, d_output, options, workspace, kept);
  EXPECT_EQ(kept.attention_bias.size(), 0);
}

// ---- shape errors -----------------------------------------------------------------------------

TEST(AttentionBiasErrors, BadShapesAreShapeErrors) {
  auto c = make_case<double>(Shape{}, 9900);  // B = 2, H = 2, T = 5, S = 7
  const Layer layer(c.config, c.weights);
  const auto d_output = gradient_check::random_d_output(c, 4);
  Tensor3<double> bias_wrong_s(2, 5, 6);
  Tensor4<double> bias_wrong_heads(2, 3, 5, 7), bias_wrong_batch(3, 1, 5, 7);
  Tensor2<double> bias_wrong_t(4, 7);
  Tensor3<bool> mask_wrong_batch(3, 5, 7);
  Tensor4<bool> mask_wrong_heads(1, 4, 5, 7);
  const std::string expected =
      "expected (B, T, S) = (2, 5, 7), (T, S) = (5, 7) or (B, H, T, S) = (2, 2, 5, 7) with B or H "
      "possibly 1";
  auto options = c.options;
  auto expect_error = [&](const sdmha::AttentionOptions<double>& o, const std::string& fragment) {
    SDMHA_EXPECT_THROW_WITH(layer.forward(c.query(), {c.key, c.value}, o), sdmha::ShapeError,
                            fragment);
    SDMHA_EXPECT_THROW_WITH(layer.backward(c.query(), {c.key, c.value}, d_output, o),
                            sdmha::ShapeError, fragment);
    SDMHA_EXPECT_THROW_WITH(layer.forward(c.query(), {c.key, c.value}, o), sdmha::ShapeError,
                            expected);
  };
  options.attention_bias = bias_wrong_s;
  expect_error(options, "attention_bias is (2, 5, 6); ");
  options.attention_bias = bias_wrong_heads;
  expect_error(options, "attention_bias is (2, 3, 5, 7); ");
  options.attention_bias = bias_wrong_batch;
  expect_error(options, "attention_bias is (3, 1, 5, 7); ");
  options.attention_bias = bias_wrong_t;
  expect_error(options, "attention_bias is (4, 7); ");
  options.attention_bias = sdmha::BroadcastRef<double>();
  options.attention_mask = mask_wrong_batch;
  expect_error(options, "attention_mask is (3, 5, 7); ");
  options.attention_mask = mask_wrong_heads;
  expect_error(options, "attention_mask is (1, 4, 5, 7); ");
  // A raw view with a size but no data.
  options.attention_mask = sdmha::BroadcastRef<bool>(nullptr, 2, 2, 5, 7);
  SDMHA_EXPECT_THROW_WITH(layer.forward(c.query(), {c.key, c.value}, options), sdmha::ShapeError,
                          "attention_mask has no data");
}

// ---- DropoutGenerator -------------------------------------------------------------------------

constexpr double kDropoutRate = 0.3;

sdmha::AttentionOptions<double> training_options(sdmha::DropoutGenerator* generator) {
  sdmha::AttentionOptions<double> options;
  options.training = true;
  options.dropout_rate = kDropoutRate;
  options.dropout_generator = generator;
  return options;
}

bool same(const Tensor3<double>& a, const Tensor3<double>& b) {
  if (a.size() != b.size()) return false;
  for (Index i = 0; i < a.size(); ++i)
    if (a.data()[i] != b.data()[i]) return false;
  return true;
}

// Each training forward draws a fresh seed (a fresh mask): consecutive outputs differ; the same
// starting seed gives the same sequence; the result reports the seed drawn.
TEST(DropoutGenerator, FreshSeedPerForwardReproducibleSequence) {
  auto c = make_case<double>(Shape{}, 10000);
  const Layer layer(c.config, c.weights);
  sdmha::DropoutGenerator first(42), second(42), other(43);
  std::vector<Tensor3<double>> outputs;
  for (int step = 0; step < 3; ++step) {
    const auto a = layer.forward(c.query(), {c.key, c.value}, training_options(&first));
    EXPECT_EQ(a.dropout_seed, first.last());
    EXPECT_EQ(first.draws(), std::uint64_t(step + 1));
    const auto b = layer.forward(c.query(), {c.key, c.value}, training_options(&second));
    EXPECT_EQ(a.dropout_seed, b.dropout_seed);
    EXPECT_TRUE(same(a.output, b.output)) << "step " << step;
    const auto o = layer.forward(c.query(), {c.key, c.value}, training_options(&other));
    EXPECT_NE(o.dropout_seed, a.dropout_seed);
    for (const auto& earlier : outputs) EXPECT_FALSE(same(earlier, a.output)) << "step " << step;
    outputs.push_back(a.output);
  }
  EXPECT_EQ(first.seed(), 42u);
  // Not training, or rate 0: no draw, no dropout, seed 0 reported.
  auto options = training_options(&first);
  options.training = false;
  EXPECT_EQ(layer.forward(c.query(), {c.key, c.value}, options).dropout_seed, 0u);
  options.training = true;
  options.dropout_rate = 0.0;
  EXPECT_EQ(layer.forward(c.query(), {c.key, c.value}, options).dropout_seed, 0u);
  EXPECT_EQ(first.draws(), 3u);
  // Without a generator, dropout_seed is used as it is.
  options = training_options(nullptr);
  options.dropout_seed = 77;
  EXPECT_EQ(layer.forward(c.query(), {c.key, c.value}, options).dropout_seed, 77u);
}

// Uniform probabilities (a zero key kernel and no biases) and identity value and output
// projections: output(b, t, s) is 1/(S·(1 − rate)) where (b, 0, t, s) is kept and 0 where
// dropped, so the output counts the dropped entries. Over n entries the count is Binomial(n,
// rate): within 5 standard deviations of n·rate (a false failure about once in 10⁶ runs).
TEST(DropoutGenerator, EmpiricalRateWithinBinomialBound) {
  Shape shape;
  shape.batch = 4, shape.steps = 50, shape.key_steps = 50, shape.heads = 1, shape.key_dim = 4;
  shape.value_in_dim = 50, shape.value_dim = 50, shape.output_dim = 50;
  shape.use_bias = false;
  auto c = make_case<double>(shape, 10100);
  c.weights.key_kernel.setZero();
  c.weights.value_kernel.setIdentity();
  c.weights.output_kernel.setIdentity();
  c.value.setZero();
  for (long b = 0; b < shape.batch; ++b)
    for (long s = 0; s < shape.key_steps; ++s) c.value(b, s, s) = 1.0;
  const Layer layer(c.config, c.weights);
  sdmha::DropoutGenerator generator(7);
  const double kept_value = 1.0 / (double(shape.key_steps) * (1.0 - kDropoutRate));
  long dropped = 0, entries = 0;
  for (int step = 0; step < 3; ++step) {
    const auto output = layer.forward(c.query(), {c.key, c.value}, training_options(&generator));
    for (Index i = 0; i < output.output.size(); ++i, ++entries) {
      const double value = output.output.data()[i];
      if (value == 0.0)
        ++dropped;
      else
        EXPECT_NEAR(value, kept_value, 1e-12) << i;
    }
  }
  const double n = double(entries), mean = n * kDropoutRate;
  const double deviation = std::sqrt(n * kDropoutRate * (1.0 - kDropoutRate));
  EXPECT_LE(std::abs(double(dropped) - mean), 5.0 * deviation)
      << dropped << " dropped of " << entries;
}

// Backward with the generator uses the mask of the latest forward: the same gradients as with
// dropout_seed = that forward's seed and no generator; backward draws nothing.
TEST(DropoutGenerator, BackwardReusesTheForwardsMask) {
  auto c = make_case<double>(Shape{}, 10200);
  const Layer layer(c.config, c.weights);
  const auto d_output = gradient_check::random_d_output(c, 5);
  sdmha::DropoutGenerator generator(11);
  auto with_generator = training_options(&generator);
  layer.forward(c.query(), {c.key, c.value}, with_generator);
  const auto result = layer.forward(c.query(), {c.key, c.value}, with_generator);
  ASSERT_EQ(generator.draws(), 2u);
  const auto g = layer.backward(c.query(), {c.key, c.value}, d_output, with_generator);
  EXPECT_EQ(generator.draws(), 2u);
  EXPECT_EQ(generator.last(), result.dropout_seed);
  auto by_seed = training_options(nullptr);
  by_seed.dropout_seed = result.dropout_seed;
  const auto expected = layer.backward(c.query(), {c.key, c.value}, d_output, by_seed);
  expect_bitwise_equal(g, expected);
  // And the mask matters: another seed's gradients differ.
  by_seed.dropout_seed = result.dropout_seed + 1;
  const auto other = layer.backward(c.query(), {c.key, c.value}, d_output, by_seed);
  bool differs = false;
  for (Index i = 0; i < g.value_kernel.size(); ++i)
    differs = differs || g.value_kernel.data()[i] != other.value_kernel.data()[i];
  EXPECT_TRUE(differs);
  // The forward by seed is the forward of the generator's step.
  EXPECT_TRUE(same(layer
                       .forward(c.query(), {c.key, c.value},
                                [&] {
                                  auto o = training_options(nullptr);
                                  o.dropout_seed = result.dropout_seed;
                                  return o;
                                }())
                       .output,
                   result.output));
}

TEST(DropoutGenerator, LastBeforeAnyDrawIsConfigError) {
  sdmha::DropoutGenerator generator(3);
  SDMHA_EXPECT_THROW_WITH(generator.last(), sdmha::ConfigError, "no seed drawn yet");
  auto c = make_case<double>(Shape{}, 10300);
  const Layer layer(c.config, c.weights);
  SDMHA_EXPECT_THROW_WITH(
      layer.backward(c.query(), {c.key, c.value}, gradient_check::random_d_output(c, 6),
                     training_options(&generator)),
      sdmha::ConfigError, "no seed drawn yet");
  EXPECT_EQ(generator.draws(), 0u);
  const std::uint64_t first = generator.next();
  EXPECT_EQ(generator.last(), first);
  EXPECT_EQ(generator.draws(), 1u);
  EXPECT_NE(generator.next(), first);
}

// ---- ProjectedContext::append -----------------------------------------------------------------

// Key steps [begin, end) of every batch entry.
template <typename Scalar>
Tensor3<Scalar> key_steps(const Tensor3<Scalar>& x, long begin, long end) {
  Tensor3<Scalar> part(x.dimension(0), end - begin, x.dimension(2));
  for (Index b = 0; b < x.dimension(0); ++b)
    for (long s = begin; s < end; ++s)
      for (Index e = 0; e < x.dimension(2); ++e) part(b, s - begin, e) = x(b, s, e);
  return part;
}

// Projecting in parts and appending equals projecting at once: each projected row is its own
// input row times the kernel. In float the GEMM engine sums each entry's Ek terms in one order
// whatever the row count, so exactly; in double (and in float without AVX-512 or under
// SDMHA_KERNELS=portable, where Eigen's product serves) Eigen picks its product kernel by shape
// (a coefficient-wise one for small products), which may reorder those terms, so within a few ulps.
template <typename Scalar>
::testing::AssertionResult same_projection(const Scalar* got, const Scalar* expected, Index size) {
  std::vector<double> twin(expected, expected + size);
  const bool one_order =
      std::is_same<Scalar, float>::value && sdmha::active_kernels().avx512_float_gemm;
  const double reordered =
      std::is_same<Scalar, float>::value ? relative_tolerance<float>() : kReorderedSumTolerance;
  return all_near(got, twin, one_order ? 0.0 : reordered);
}

TYPED_TEST(AttentionBiasTest, AppendedContextEqualsWholeProjection) {
  using Scalar = TypeParam;
  Shape shape;
  shape.batch = 3, shape.steps = 4, shape.key_steps = 13, shape.heads = 2;
  shape.value_dim = 5;
  auto c = make_case<Scalar>(shape, 10400);
  const sdmha::SparseDenseMHA<Scalar> layer(c.config, c.weights);
  const auto whole = layer.project_context(c.key, c.value);
  for (long split : {1L, 6L, 12L}) {
    sdmha::ProjectedContext<Scalar> context;  // empty: the first append takes `more` as it is
    const auto first_key = key_steps(c.key, 0, split), first_value = key_steps(c.value, 0, split);
    const auto rest_key = key_steps(c.key, split, 13), rest_value = key_steps(c.value, split, 13);
    context.append(layer.project_context(first_key, first_value));
    context.append(layer.project_context(rest_key, rest_value));
    ASSERT_EQ(context.batch, whole.batch);
    ASSERT_EQ(context.key_steps, whole.key_steps);
    ASSERT_EQ(context.keys.rows(), whole.keys.rows());
    ASSERT_EQ(context.values.rows(), whole.values.rows());
    EXPECT_TRUE(same_projection(context.keys.data(), whole.keys.data(), whole.keys.size()))
        << "split " << split;
    EXPECT_TRUE(same_projection(context.values.data(), whole.values.data(), whole.values.size()))
        << "split " << split;
    // Decoding: T new steps against all S, causal bottom-right, with a bias.
    auto options = c.options;
    options.use_causal_mask = true;
    options.causal_alignment = sdmha::CausalAlignment::bottom_right;
    Tensor2<Scalar> bias(4, 13);
    for (Index i = 0; i < bias.size(); ++i) bias.data()[i] = Scalar(0.1 * double(i % 7));
    options.attention_bias = bias;
    const auto appended = layer.forward(c.query(), context, options).output;
    const auto direct = layer.forward(c.query(), {c.key, c.value}, options).output;
    const auto on_whole = layer.forward(c.query(), whole, options).output;
    EXPECT_TRUE(same_projection(appended.data(), on_whole.data(), on_whole.size()))
        << "split " << split;
    EXPECT_TRUE(same_projection(appended.data(), direct.data(), direct.size()))
        << "split " << split;
  }
}

TEST(ProjectedContextAppend, MismatchedBatchOrWidthIsShapeError) {
  auto c = make_case<double>(Shape{}, 10500);  // B = 2
  const Layer layer(c.config, c.weights);
  auto context = layer.project_context(c.key, c.value);
  const Tensor3<double> one_key = key_steps(c.key, 0, 3), one_value = key_steps(c.value, 0, 3);
  Tensor3<double> short_key(1, 3, c.key.dimension(2)), short_value(1, 3, c.value.dimension(2));
  short_key.setConstant(0.5);
  short_value.setConstant(0.25);
  SDMHA_EXPECT_THROW_WITH(context.append(layer.project_context(short_key, short_value)),
                          sdmha::ShapeError, "more has batch 1; expected 2");
  Shape wider;
  wider.key_dim = 6;
  auto other = make_case<double>(wider, 10501);
  const Layer other_layer(other.config, other.weights);
  SDMHA_EXPECT_THROW_WITH(context.append(other_layer.project_context(one_key, one_value)),
                          sdmha::ShapeError, "more has key and value widths");
  EXPECT_EQ(context.key_steps, 7);  // a refused append changes nothing
  context.append(layer.project_context(one_key, one_value));
  EXPECT_EQ(context.key_steps, 10);
}

// ---- non-finite biases, raw views, edge cases of append -------------------------------------

// A NaN or +∞ bias makes its row NaN, as the softmax makes it, on the tiled path and on the
// online-softmax path alike (S > kKeyTile, no returned scores); the other rows stay finite. In
// float too, whose rows go through the vectorised maximum and exponentials.
template <typename Scalar>
void expect_non_finite_bias_makes_its_row_nan() {
  for (const long key_steps : {7L, long(sdmha::detail::kKeyTile) + 40}) {
    for (const Scalar poison :
         {std::numeric_limits<Scalar>::quiet_NaN(), std::numeric_limits<Scalar>::infinity()}) {
      for (const long poisoned_key : {3L, key_steps - 2}) {
        Shape shape;
        shape.key_steps = key_steps;
        auto c = make_case<Scalar>(shape, 11000);
        Tensor2<Scalar> bias(c.shape.steps, key_steps);
        bias.setZero();
        bias(1, poisoned_key) = poison;
        c.options.attention_bias = bias;
        c.options.score_strategy = sdmha::ScoreStrategy::project_first;
        const sdmha::SparseDenseMHA<Scalar> layer(c.config, c.weights);
        const auto result = layer.forward(c.query(), {c.key, c.value}, c.options);
        SCOPED_TRACE("S = " + std::to_string(key_steps) + ", bias " + std::to_string(poison) +
                     " at key " + std::to_string(poisoned_key));
        for (long b = 0; b < c.shape.batch; ++b)
          for (long t = 0; t < c.shape.steps; ++t)
            for (long o = 0; o < result.output.dimension(2); ++o)
              EXPECT_EQ(std::isnan(result.output(b, t, o)), t == 1) << b << ", " << t << ", " << o;
      }
    }
  }
}

TEST(AttentionBiasNonFinite, NanAndPlusInfinityPropagateOnEveryPath) {
  expect_non_finite_bias_makes_its_row_nan<double>();
  expect_non_finite_bias_makes_its_row_nan<float>();
}

// A −∞ bias blocks its position as a mask does, also for a key row that is not finite: a NaN or
// ±∞ key row whose every position has a −∞ bias changes neither the output nor any gradient
// (against the same call with that row zero), on the tiled and the online-softmax path, under
// both fully-masked policies (query row 0 is blocked entirely by its bias).
template <typename Scalar>
std::vector<double> entries_of(const Scalar* data, Index size) {
  return std::vector<double>(data, data + size);
}

template <typename Scalar>
void expect_minus_infinity_bias_blocks_non_finite_keys(sdmha::FullyMaskedRows policy) {
  const double tolerance = std::is_same<Scalar, float>::value ? 1e-5 : 1e-12;
  constexpr Scalar inf = std::numeric_limits<Scalar>::infinity();
  for (const long key_steps : {7L, long(sdmha::detail::kKeyTile) + 40}) {
    for (const Scalar poison : {std::numeric_limits<Scalar>::quiet_NaN(), inf, -inf}) {
      Shape shape;
      shape.key_steps = key_steps;
      auto c = make_case<Scalar>(shape, 11050);
      const long blocked_key = key_steps - 3;
      Tensor2<Scalar> bias(c.shape.steps, key_steps);
      bias.setConstant(Scalar(0.25));
      for (long t = 0; t < c.shape.steps; ++t) bias(t, blocked_key) = -inf;
      for (long s = 0; s < key_steps; ++s) bias(0, s) = -inf;
      c.options.attention_bias = bias;
      c.options.score_strategy = sdmha::ScoreStrategy::project_first;
      c.options.fully_masked_rows = policy;
      c.options.compute_bias_gradient = true;
      auto zeroed = c.key, poisoned = c.key;
      for (long e = 0; e < c.key.dimension(2); ++e) {
        zeroed(0, blocked_key, e) = Scalar(0);
        poisoned(0, blocked_key, e) = poison;
      }
      const sdmha::SparseDenseMHA<Scalar> layer(c.config, c.weights);
      SCOPED_TRACE("S = " + std::to_string(key_steps) + ", key row " + std::to_string(poison) +
                   ", " + sdmha::to_string(policy));
      const auto expected = layer.forward(c.query(), {zeroed, c.value}, c.options);
      const auto result = layer.forward(c.query(), {poisoned, c.value}, c.options);
      EXPECT_TRUE(all_near(result.output.data(),
                           entries_of(expected.output.data(), expected.output.size()), tolerance));
      const auto d_output = gradient_check::random_d_output(c, 3);
      const auto want = layer.backward(c.query(), {zeroed, c.value}, d_output, c.options);
      const auto got = layer.backward(c.query(), {poisoned, c.value}, d_output, c.options);
      auto expect_same = [&](const auto& got_part, const auto& want_part, const char* name) {
        EXPECT_TRUE(
            all_near(got_part.data(), entries_of(want_part.data(), want_part.size()), tolerance))
            << name;
      };
      expect_same(got.query_kernel, want.query_kernel, "query_kernel");
      expect_same(got.key_kernel, want.key_kernel, "key_kernel");
      expect_same(got.value_kernel, want.value_kernel, "value_kernel");
      expect_same(got.output_kernel, want.output_kernel, "output_kernel");
      expect_same(got.key_bias, want.key_bias, "key_bias");
      expect_same(got.query_values, want.query_values, "query_values");
      expect_same(got.key, want.key, "key");
      expect_same(got.attention_bias, want.attention_bias, "attention_bias");
    }
  }
}

TEST(AttentionBiasNonFinite, MinusInfinityBiasBlocksANonFiniteKeyRow) {
  for (const auto policy : {sdmha::FullyMaskedRows::zeros, sdmha::FullyMaskedRows::uniform}) {
    expect_minus_infinity_bias_blocks_non_finite_keys<double>(policy);
    expect_minus_infinity_bias_blocks_non_finite_keys<float>(policy);
  }
}

// A raw view's rank must agree with its dimensions: (T, S) with B' = 2 is a ShapeError.
TEST(AttentionBiasErrors, RawViewRankDisagreeingWithItsDimensions) {
  auto c = make_case<double>(Shape{}, 11100);  // B = 2, H = 2, T = 5, S = 7
  const Layer layer(c.config, c.weights);
  std::vector<double> data(std::size_t(2 * 2 * 5 * 7), 0.5);
  auto options = c.options;
  options.attention_bias = sdmha::BroadcastRef<double>(data.data(), 2, 1, 5, 7, /*rank=*/2);
  SDMHA_EXPECT_THROW_WITH(layer.forward(c.query(), {c.key, c.value}, options), sdmha::ShapeError,
                          "attention_bias is (5, 7); expected");
  options.attention_bias = sdmha::BroadcastRef<double>(data.data(), 2, 2, 5, 7, /*rank=*/3);
  SDMHA_EXPECT_THROW_WITH(layer.forward(c.query(), {c.key, c.value}, options), sdmha::ShapeError,
                          "attention_bias is (2, 5, 7); expected");
  options.attention_bias = sdmha::BroadcastRef<double>(data.data(), 2, 2, 5, 7, /*rank=*/4);
  EXPECT_NO_THROW(layer.forward(c.query(), {c.key, c.value}, options));
}

// Appending to an empty context takes the other one; appending no key steps changes nothing;
// a context whose rows disagree with batch × key_steps is refused.
TEST(ProjectedContextAppend, EmptyContextsAndInconsistentRows) {
  auto c = make_case<double>(Shape{}, 11200);  // B = 2, S = 7
  const Layer layer(c.config, c.weights);
  const auto whole = layer.project_context(c.key, c.value);
  sdmha::ProjectedContext<double> grown;
  grown.append(whole);
  EXPECT_EQ(grown.key_steps, 7);
  EXPECT_TRUE(grown.keys == whole.keys && grown.values == whole.values);
  const Tensor3<double> no_key = key_steps(c.key, 0, 0), no_value = key_steps(c.value, 0, 0);
  grown.append(layer.project_context(no_key, no_value));
  EXPECT_EQ(grown.key_steps, 7);
  EXPECT_TRUE(grown.keys == whole.keys);
  auto broken = whole;
  broken.key_steps = 6;
  SDMHA_EXPECT_THROW_WITH(grown.append(broken), sdmha::ShapeError,
                          "more has keys and values of 14 and 14 rows; expected batch * key_steps");
}

}  // namespace
