// Tests of user-written stages, as someone outside sdmha would write them: a position-dependent
// score kernel (a relative-position bias with a per-row scale) and a softmax with a temperature
// per head, each derived from the default stage with a backward of its own. Their forward against
// a float64 reference written here from plain loops (tests/reference/'s projections, never
// sdmha), across query tiles (256 rows, 64 when causal) and key tiles (512 keys, online softmax),
// both score strategies, 1 and 2 threads, masks, padding, scale, causal alignment and fully masked
// rows; their backward against central differences of the forward; a short training run through
// them; and the layer's shared weights (updated in place, reshaped, null).
#include "test_support.hpp"

#include "gradient_check.hpp"

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

namespace sdmha_test {
namespace {

// ---- the custom stages ---------------------------------------------------------------------

// The per-row scale of RelativeBias: a nonlinear function of the absolute query step.
template <typename Scalar>
Scalar row_factor(Index step) {
  return Scalar(1) + Scalar(0.01) * Scalar(step % 7);
}

// scores[t, s] ← scores[t, s] · (1 + 0.01·(t mod 7)) − slope[h]·|t − s|, t and s absolute steps,
// blocked entries left at −∞. The bias does not depend on the inputs, so the backward only
// scales dS by the row factor before the base kernel's backward.
template <typename Scalar>
struct RelativeBias : sdmha::ScoreKernel<Scalar> {
  using Base = sdmha::ScoreKernel<Scalar>;
  std::vector<Scalar> slope;  // one per head

  template <typename Args>
  void operator()(const Args& args) const {
    sdmha::ScoreKernel<Scalar>::operator()(args);
    const Scalar head_slope = slope.at(std::size_t(args.head));
    for (Index t = 0; t < args.scores.rows(); ++t) {
      const Index query_step = args.query_begin + t;
      const Scalar factor = row_factor<Scalar>(query_step);
      for (Index s = 0; s < args.scores.cols(); ++s) {
        Scalar& score = args.scores(t, s);
        if (!std::isfinite(score)) continue;
        const Index distance = std::abs(query_step - (args.key_begin + s));
        score = score * factor - head_slope * Scalar(distance);
      }
    }
  }

  void backward(const typename Base::BackwardArguments& args) const {
    for (Index t = 0; t < args.d_scores.rows(); ++t)
      args.d_scores.row(t) *= row_factor<Scalar>(args.query_begin + t);
    Base::backward(args);
  }
};

// The same stage written with tile-local steps (t instead of query_begin + t): the mistake the
// tests must catch. Used only to show that they do.
template <typename Scalar>
struct TileLocalBias : sdmha::ScoreKernel<Scalar> {
  using Base = sdmha::ScoreKernel<Scalar>;
  std::vector<Scalar> slope;

  template <typename Args>
  void operator()(const Args& args) const {
    Base::operator()(args);
    for (Index t = 0; t < args.scores.rows(); ++t)
      for (Index s = 0; s < args.scores.cols(); ++s) {
        Scalar& score = args.scores(t, s);
        if (std::isfinite(score))
          score = score * row_factor<Scalar>(t) -
                  slope.at(std::size_t(args.head)) * Scalar(std::abs(t - s));
      }
  }
  void backward(const typename Base::BackwardArguments& args) const {
    for (Index t = 0; t < args.d_scores.rows(); ++t) args.d_scores.row(t) *= row_factor<Scalar>(t);
    Base::backward(args);
  }
};

// RelativeBias whose backward forgets the row factor: the finite differences must catch it.
template <typename Scalar>
struct RelativeBiasWithoutFactorGradient : RelativeBias<Scalar> {
  using Base = sdmha::ScoreKernel<Scalar>;
  void backward(const typename Base::BackwardArguments& args) const { Base::backward(args); }
};

// P = softmax(S / τ_h): the scores divided by the head's temperature (−∞ stays −∞), then the
// default softmax; backward: the default's dS, divided by τ_h.
template <typename Scalar>
struct TemperatureSoftmax : sdmha::MaskedSoftmax<Scalar> {
  using Base = sdmha::MaskedSoftmax<Scalar>;
  std::vector<Scalar> temperature;  // one per head, > 0

  void operator()(const typename Base::Arguments& args) const {
    args.scores *= Scalar(1) / temperature.at(std::size_t(args.head));
    Base::operator()(args);
  }
  void backward(const typename Base::BackwardArguments& args) const {
    Base::backward(args);
    args.d_scores *= Scalar(1) / temperature.at(std::size_t(args.head));
  }
};

using BiasLayer =
    sdmha::SparseDenseMHA<double, sdmha::SparseQueryProjection<double>, RelativeBias<double>>;
using TemperatureLayer =
    sdmha::SparseDenseMHA<double, sdmha::SparseQueryProjection<double>, sdmha::ScoreKernel<double>,
                          TemperatureSoftmax<double>>;
using BothLayer = sdmha::SparseDenseMHA<double, sdmha::SparseQueryProjection<double>,
                                        RelativeBias<double>, TemperatureSoftmax<double>>;

const std::vector<double> kSlopes = {0.15, 0.4, 0.07};
const std::vector<double> kTemperatures = {0.7, 1.9, 1.3};

// Sets the custom stages' parameters of whichever stages a layer has.
template <typename Layer>
void configure(Layer& layer) {
  if constexpr (!std::is_same<typename Layer::ScoreKernel, sdmha::ScoreKernel<double>>::value)
    layer.stages().score_kernel.slope = kSlopes;
  if constexpr (std::is_same<typename Layer::Softmax, TemperatureSoftmax<double>>::value)
    layer.stages().softmax.temperature = kTemperatures;
}

// ---- the float64 reference -----------------------------------------------------------------

// What the custom stages do to one allowed score, and the options that change the attention's
// semantics, in the reference's own words (apply_semantics() copies the latter into options).
struct Hooks {
  std::vector<double> slope;        // empty: no relative bias
  std::vector<double> temperature;  // empty: τ = 1
  double scale = 0.0;               // 0: 1/√Dk
  bool bottom_right = false;        // causal: s <= t + S − T instead of s <= t
  bool uniform = false;             // a row with every key blocked averages all S values
};

void apply_semantics(const Hooks& hooks, sdmha::AttentionOptions<double>& options) {
  if (hooks.scale != 0.0) options.scale = hooks.scale;
  options.causal_alignment =
      hooks.bottom_right ? sdmha::CausalAlignment::bottom_right : sdmha::CausalAlignment::top_left;
  options.fully_masked_rows =
      hooks.uniform ? sdmha::FullyMaskedRows::uniform : sdmha::FullyMaskedRows::zeros;
}

struct ReferenceResult {
  std::vector<double> probabilities;  // B·H·T·S
  std::vector<double> output;         // B·T·O
};

bool allowed(const sdmha_reference::Problem& p, const Hooks& hooks, long b, long t, long s) {
  const long offset = hooks.bottom_right ? p.key_steps - p.steps : 0;
  if (p.causal && s > t + offset) return false;
  if (!p.key_mask.empty() && !p.key_mask[b * p.key_steps + s]) return false;
  if (!p.attention_mask.empty() && !p.attention_mask[(b * p.steps + t) * p.key_steps + s])
    return false;
  return true;
}

// Keras' attention with the scores edited by `hooks`, from plain loops over the problem of
// tests/reference/ (whose projections it uses; neither calls sdmha).
ReferenceResult reference(const sdmha_reference::Problem& p, const Hooks& hooks) {
  using sdmha_reference::project;
  const long B = p.batch, T = p.steps, S = p.key_steps, H = p.heads, Dk = p.key_dim,
             Dv = p.value_dim;
  const auto query = project(p.query, B * T, p.query_dim, p.query_kernel, p.query_bias, H * Dk);
  const auto key = project(p.key, B * S, p.key_in_dim, p.key_kernel, p.key_bias, H * Dk);
  const auto value = project(p.value, B * S, p.value_in_dim, p.value_kernel, p.value_bias, H * Dv);
  const double scale = hooks.scale != 0.0 ? hooks.scale : 1.0 / std::sqrt(double(Dk));
  const double minus_infinity = -std::numeric_limits<double>::infinity();
  ReferenceResult r;
  r.probabilities.assign(std::size_t(B * H * T * S), 0.0);
  std::vector<double> heads(std::size_t(B * T * H * Dv), 0.0);
  std::vector<double> score(static_cast<std::size_t>(S), 0.0);
  for (long b = 0; b < B; ++b)
    for (long h = 0; h < H; ++h)
      for (long t = 0; t < T; ++t) {
        double* probability = r.probabilities.data() + ((b * H + h) * T + t) * S;
        double row_max = minus_infinity;
        for (long s = 0; s < S; ++s) {
          score[s] = minus_infinity;
          if (!allowed(p, hooks, b, t, s)) continue;
          double dot = 0.0;
          for (long d = 0; d < Dk; ++d)
            dot += (query[(b * T + t) * H * Dk + h * Dk + d] * scale) *
                   key[(b * S + s) * H * Dk + h * Dk + d];
          if (!hooks.slope.empty()) {
            const double factor = 1.0 + 0.01 * double(t % 7);
            dot = dot * factor - hooks.slope[h] * double(std::labs(t - s));
          }
          if (!hooks.temperature.empty()) dot /= hooks.temperature[h];
          score[s] = dot;
          row_max = std::max(row_max, dot);
        }
        if (row_max == minus_infinity && !hooks.uniform)
          continue;  // every key blocked: P = 0, head = 0
        if (row_max == minus_infinity) {
          for (long s = 0; s < S; ++s) probability[s] = 1.0 / double(S);
        } else {
          double total = 0.0;
          for (long s = 0; s < S; ++s) {
            probability[s] = score[s] == minus_infinity ? 0.0 : std::exp(score[s] - row_max);
            total += probability[s];
          }
          for (long s = 0; s < S; ++s) probability[s] /= total;
        }
        for (long d = 0; d < Dv; ++d) {
          double sum = 0.0;
          for (long s = 0; s < S; ++s)
            sum += probability[s] * value[(b * S + s) * H * Dv + h * Dv + d];
          heads[(b * T + t) * H * Dv + h * Dv + d] = sum;
        }
      }
  r.output = project(heads, B * T, H * Dv, p.output_kernel, p.output_bias, p.output_dim);
  return r;
}

constexpr double kForwardTolerance = 1e-10;

// A problem with small widths and two heads, or three (kSlopes and kTemperatures cover three).
Shape small_shape(long steps, long key_steps, bool causal, bool padding) {
  Shape s = Shape{}.sized(2, steps, key_steps).widths(12, 6, 5).with_heads(2, 3, 4, 5);
  s.density = 0.3;
  s.causal = causal;
  s.key_mask = padding;
  return s;
}

template <typename Tensor>
bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.size() == b.size() &&
         (a.size() == 0 ||
          std::memcmp(a.data(), b.data(), sizeof(double) * std::size_t(a.size())) == 0);
}

std::string describe(const Shape& s, sdmha::ScoreStrategy strategy, int threads) {
  return "B=" + std::to_string(s.batch) + " T=" + std::to_string(s.steps) +
         " S=" + std::to_string(s.key_steps) + " H=" + std::to_string(s.heads) +
         (s.causal ? " causal" : "") + (s.key_mask ? " padding" : "") + " " +
         sdmha::to_string(strategy) + " threads=" + std::to_string(threads);
}

const sdmha::ScoreStrategy kStrategies[] = {sdmha::ScoreStrategy::project_first,
                                            sdmha::ScoreStrategy::sparse_regrouped};

// Forward of `Layer` (configured) against the reference with `hooks`, over both strategies, 1
// and 2 threads, with and without the probabilities returned (without them and with S > 512 keys,
// project-first runs an online softmax over key tiles of 512); 1 and 2 threads bitwise equal.
template <typename Layer>
void check_forward(const Case<double>& c, const Hooks& hooks) {
  Layer layer(c.config, c.weights);
  configure(layer);
  const ReferenceResult expected = reference(c.problem, hooks);
  const auto query = c.query();
  for (const auto strategy : kStrategies)
    for (const bool return_scores : {true, false}) {
      sdmha::AttentionResult<double> by_threads[2];
      for (int threads = 1; threads <= 2; ++threads) {
        SCOPED_TRACE(describe(c.shape, strategy, threads) +
                     (return_scores ? " returning scores" : ""));
        auto options = c.options;
        apply_semantics(hooks, options);
        options.num_threads = threads;
        options.score_strategy = strategy;
        options.return_attention_scores = return_scores;
        auto& result = by_threads[threads - 1];
        result = layer.forward(query, {c.key, c.value}, options);
        ASSERT_EQ(result.output.size(), Index(expected.output.size()));
        EXPECT_TRUE(all_near(result.output.data(), expected.output, kForwardTolerance)) << "output";
        if (!return_scores) continue;
        ASSERT_EQ(result.attention_scores.size(), Index(expected.probabilities.size()));
        EXPECT_TRUE(
            all_near(result.attention_scores.data(), expected.probabilities, kForwardTolerance))
            << "attention_scores";
      }
      SCOPED_TRACE(describe(c.shape, strategy, 2) + (return_scores ? " returning scores" : ""));
      EXPECT_TRUE(bitwise_equal(by_threads[0].output, by_threads[1].output))
          << "output, 1 vs 2 threads";
      EXPECT_TRUE(bitwise_equal(by_threads[0].attention_scores, by_threads[1].attention_scores))
          << "attention_scores, 1 vs 2 threads";
    }
}

// ---- 1. the position-dependent score stage, forward ----------------------------------------

TEST(CustomScoreStage, RelativeBiasMatchesReferenceAcrossTilesStrategiesThreadsAndMasks) {
  // Up to 300 query steps (query tiles of 256, 64 when causal) and 1100 key steps (key tiles of 512
  // in the online softmax); masks: none, causal, padding, causal + padding.
  const std::pair<long, long> sizes[] = {{1, 1},    {63, 65},   {64, 64},   {65, 130},
                                         {130, 70}, {300, 300}, {64, 1100}, {130, 1030}};
  std::uint64_t seed = 100;
  for (const auto& [steps, key_steps] : sizes)
    for (int masks = 0; masks < 4; ++masks) {
      const Shape s = small_shape(steps, key_steps, masks & 1, masks & 2);
      const auto c = make_case<double>(s, ++seed);
      check_forward<BiasLayer>(c, Hooks{kSlopes, {}});
    }
}

// The options that move the attention's tiles and scores under a custom stage: a scale
// override, a causal mask aligned bottom-right (with S > 512, key tiles of 512 under it), and
// fully blocked rows averaging every value (FullyMaskedRows::uniform), with both custom stages.
TEST(CustomScoreStage, CustomStagesUnderScaleAlignmentAndFullyMaskedRowOptions) {
  std::uint64_t seed = 150;
  for (const auto& [steps, key_steps] :
       {std::pair<long, long>(130, 70), std::pair<long, long>(70, 1100)})
    for (int variant = 0; variant < 3; ++variant) {
      Shape s = small_shape(steps, key_steps, variant != 0, variant == 2);
      s.heads = 3;
      s.fully_blocked_rows = variant == 2;
      const auto c = make_case<double>(s, ++seed);
      Hooks hooks{kSlopes, {}};
      hooks.scale = variant == 0 ? 0.3 : 0.0;
      hooks.bottom_right = variant == 1;
      hooks.uniform = variant == 2;
      SCOPED_TRACE("variant " + std::to_string(variant));
      check_forward<BiasLayer>(c, hooks);
      hooks.temperature = kTemperatures;
      check_forward<BothLayer>(c, hooks);
    }
}

// The reference must see a stage that used tile-local steps: its output differs as soon as the
// project-first forward splits the rows into query tiles (T beyond the plan's tile) or the keys
// into key tiles (S > 512, online softmax), and not before.
TEST(CustomScoreStage, TileLocalStepsAreCaughtBeyondTheFirstTile) {
  const std::pair<long, long> sizes[] = {{256, 70}, {260, 70}, {64, 1100}};
  for (const auto& [steps, key_steps] : sizes) {
    const auto c = make_case<double>(small_shape(steps, key_steps, false, false), 7);
    sdmha::SparseDenseMHA<double, sdmha::SparseQueryProjection<double>, TileLocalBias<double>>
        layer(c.config, c.weights);
    layer.stages().score_kernel.slope = kSlopes;
    auto options = c.options;
    options.score_strategy = sdmha::ScoreStrategy::project_first;
    options.num_threads = 1;
    const auto output = layer.forward(c.query(), {c.key, c.value}, options).output;
    const bool matches =
        all_near(output.data(), reference(c.problem, Hooks{kSlopes, {}}).output, kForwardTolerance);
    // The plan's forward tile: 256 rows, halved (to 64 at least) while B·H·⌈T/tile⌉ < 256.
    const Index tile = sdmha::detail::plan_query_tile(
        sdmha::detail::Pass::forward, false, false, c.problem.batch * c.problem.heads, steps,
        key_steps, std::min<Index>(key_steps, sdmha::detail::kKeyTile));
    EXPECT_EQ(matches, steps <= tile && key_steps <= 512)
        << "T = " << steps << ", S = " << key_steps << ", tile = " << tile;
  }
}

// The stage's parameters are read on every call: changing them changes the output, and a layer
// with slopes 0 is the default layer up to the row factor.
TEST(CustomScoreStage, StageParametersAreReadOnEveryCall) {
  const auto c = make_case<double>(small_shape(70, 40, true, false), 11);
  BiasLayer layer(c.config, c.weights);
  layer.stages().score_kernel.slope = {0.0, 0.0};
  auto options = c.options;
  options.num_threads = 1;
  const auto query = c.query();
  const auto flat = layer.forward(query, {c.key, c.value}, options).output;
  EXPECT_TRUE(
      all_near(flat.data(), reference(c.problem, Hooks{{0.0, 0.0}, {}}).output, kForwardTolerance));
  layer.stages().score_kernel.slope = {0.3, 0.05};
  const auto sloped = layer.forward(query, {c.key, c.value}, options).output;
  EXPECT_TRUE(all_near(sloped.data(), reference(c.problem, Hooks{{0.3, 0.05}, {}}).output,
                       kForwardTolerance));
  EXPECT_FALSE(bitwise_equal(flat, sloped));
}

// ---- 2./3. gradients by central differences ----------------------------------------------

using gradient_check::random_d_output;
using GradientCheck = gradient_check::Summary;

// Central differences of Σ d_output ⊙ forward(...) against layer.backward for `per_group` random
// entries of every weight, of key, value and the query's values (gradient_check.hpp). The layer
// shares its weights with the check, which perturbs them in place through the shared_ptr.
// `report` false: count the failures without adding test failures (for the negative control).
template <typename Layer>
GradientCheck check_gradients(Case<double> c, const sdmha::AttentionOptions<double>& options,
                              std::uint64_t seed, int per_group, bool report = true) {
  auto weights = std::make_shared<sdmha::MhaWeights<double>>(c.weights);
  Layer layer(c.config, weights);
  configure(layer);
  return gradient_check::check_layer(layer, *weights, c, options, seed, per_group, report);
}

// The configurations of the gradient checks: T = 130 rows over three forward tiles (one or
// three backward tiles), S = 70, both strategies, without masks and with causal + padding.
template <typename Layer>
void check_gradients_over_configurations(const char* name, std::uint64_t seed) {
  GradientCheck total;
  for (int masks = 0; masks < 2; ++masks)
    for (const auto strategy : kStrategies) {
      Shape s = small_shape(130, 70, masks == 1, masks == 1);
      s.heads = 3;
      const auto c = make_case<double>(s, seed + masks);
      auto options = c.options;
      options.num_threads = 2;
      options.score_strategy = strategy;
      SCOPED_TRACE(describe(s, strategy, 2));
      total += check_gradients<Layer>(c, options, seed + 10 * masks, 6);
    }
  EXPECT_EQ(total.failed, 0) << "of " << total.checked;
  // 6 distinct entries of each of the 11 gradients, all 5 of the output bias (O = 5).
  EXPECT_GE(total.checked, 4 * (10 * 6 + 5));
  std::printf("%s: %ld entries checked, worst error / tolerance %.3g\n", name, total.checked,
              total.worst);
}

TEST(CustomScoreStage, RelativeBiasGradientsMatchCentralDifferences) {
  check_gradients_over_configurations<BiasLayer>("RelativeBias", 300);
}

// Without a causal mask the backward takes as many rows per tile as fit 2^15 scores: with
// S = 400 that is 81, so its tiles start at rows 0, 81 and 162 where the forward's start at 0, 64,
// 128 and 192. The stage must see the same absolute steps in both.
TEST(CustomScoreStage, RelativeBiasGradientsWithBackwardTilesUnlikeTheForwards) {
  Shape s = small_shape(200, 400, false, true);
  s.batch = 1;
  const auto c = make_case<double>(s, 310);
  auto options = c.options;
  options.num_threads = 2;
  options.score_strategy = sdmha::ScoreStrategy::project_first;
  const GradientCheck check = check_gradients<BiasLayer>(c, options, 311, 5);
  EXPECT_EQ(check.failed, 0) << "of " << check.checked;
  std::printf("RelativeBias, T = 200, S = 400: %ld entries checked, worst error / tolerance %.3g\n",
              check.checked, check.worst);
}

// Dropout (a fixed seed, so forward and backward drop the same entries) between the custom
// softmax and the values, through both custom stages.
TEST(CustomScoreStage, GradientsThroughCustomStagesWithDropout) {
  for (const auto strategy : kStrategies) {
    Shape s = small_shape(130, 70, true, false);
    s.heads = 3;
    const auto c = make_case<double>(s, 320);
    auto options = c.options;
    options.num_threads = 2;
    options.score_strategy = strategy;
    options.training = true;
    options.dropout_rate = 0.25;
    options.dropout_seed = 321;
    SCOPED_TRACE(sdmha::to_string(strategy));
    const GradientCheck check = check_gradients<BothLayer>(c, options, 322, 4);
    EXPECT_EQ(check.failed, 0) << "of " << check.checked;
  }
}

// A workspace kept across calls: the second call allocates into the first's buffers and gives
// bitwise the same output and gradients as a fresh call.
TEST(CustomScoreStage, WorkspaceReuseGivesTheSameResults) {
  const auto c = make_case<double>(small_shape(130, 70, true, true), 330);
  BothLayer layer(c.config, c.weights);
  configure(layer);
  const auto query = c.query();
  const auto d_output = random_d_output(c, 331);
  for (const auto strategy : kStrategies) {
    SCOPED_TRACE(sdmha::to_string(strategy));
    auto options = c.options;
    options.num_threads = 2;
    options.score_strategy = strategy;
    sdmha::Workspace<double> workspace;
    sdmha::AttentionResult<double> result;
    sdmha::MhaGradients<double> gradients;
    const auto fresh = layer.forward(query, {c.key, c.value}, options).output;
    const auto fresh_gradients = layer.backward(query, {c.key, c.value}, d_output, options);
    for (int call = 0; call < 2; ++call) {
      layer.forward(query, {c.key, c.value}, options, workspace, result);
      EXPECT_TRUE(bitwise_equal(fresh, result.output)) << "call " << call;
      layer.backward(query, {c.key, c.value}, d_output, options, workspace, gradients);
      EXPECT_TRUE(bitwise_equal(fresh_gradients.query_kernel, gradients.query_kernel))
          << "call " << call;
      EXPECT_TRUE(bitwise_equal(fresh_gradients.key, gradients.key)) << "call " << call;
    }
  }
}

// Gradients through the custom stages where the forward takes other paths than the backward:
// with S = 1100 the forward runs an online softmax over key tiles of 512 (absolute key_begin
// 0, 512, 1024) while the backward sees all keys at once; and under the options of
// CustomStagesUnderScaleAlignmentAndFullyMaskedRowOptions.
TEST(CustomScoreStage, GradientsThroughOnlineSoftmaxAndAttentionOptions) {
  GradientCheck total;
  for (int variant = 0; variant < 4; ++variant) {
    Shape s =
        small_shape(variant == 0 ? 70 : 130, variant == 0 ? 1100 : 70, variant >= 2, variant == 3);
    s.heads = 3;
    s.fully_blocked_rows = variant == 3;
    const auto c = make_case<double>(s, 340 + variant);
    Hooks hooks;
    hooks.scale = variant == 1 ? 0.3 : 0.0;
    hooks.bottom_right = variant == 2;
    hooks.uniform = variant == 3;
    auto options = c.options;
    apply_semantics(hooks, options);
    options.num_threads = 2;
    options.score_strategy =
        variant == 1 ? sdmha::ScoreStrategy::sparse_regrouped : sdmha::ScoreStrategy::project_first;
    SCOPED_TRACE("variant " + std::to_string(variant) + ": " +
                 describe(s, options.score_strategy, 2));
    const GradientCheck bias = check_gradients<BiasLayer>(c, options, 350 + variant, 4);
    const GradientCheck both = check_gradients<BothLayer>(c, options, 360 + variant, 4);
    total += bias;
    total += both;
  }
  EXPECT_EQ(total.failed, 0) << "of " << total.checked;
  std::printf("online softmax and options: %ld entries checked, worst error / tolerance %.3g\n",
              total.checked, total.worst);
}

// The check is sensitive to the stage's backward: one that forgets the row factor fails it.
TEST(CustomScoreStage, ABackwardWithoutTheRowFactorFailsTheCheck) {
  using Layer = sdmha::SparseDenseMHA<double, sdmha::SparseQueryProjection<double>,
                                      RelativeBiasWithoutFactorGradient<double>>;
  const auto c = make_case<double>(small_shape(130, 70, false, false), 301);
  auto options = c.options;
  options.num_threads = 1;
  options.score_strategy = sdmha::ScoreStrategy::project_first;
  const GradientCheck check = check_gradients<Layer>(c, options, 302, 4, /*report=*/false);
  EXPECT_GT(check.failed, check.checked / 4) << "of " << check.checked;
}

// 1 and 2 threads give bitwise the same gradients through the custom stages.
TEST(CustomScoreStage, BackwardIsBitwiseTheSameForOneAndTwoThreads) {
  for (const auto strategy : kStrategies) {
    const auto c = make_case<double>(small_shape(130, 70, true, true), 303);
    BothLayer layer(c.config, c.weights);
    configure(layer);
    const auto d_output = random_d_output(c, 304);
    sdmha::MhaGradients<double> by_threads[2];
    for (int threads = 1; threads <= 2; ++threads) {
      auto options = c.options;
      options.num_threads = threads;
      options.score_strategy = strategy;
      by_threads[threads - 1] = layer.backward(c.query(), {c.key, c.value}, d_output, options);
    }
    SCOPED_TRACE(sdmha::to_string(strategy));
    const auto &one = by_threads[0], &two = by_threads[1];
    auto same = [](const auto& a, const auto& b) {
      return a.size() == b.size() &&
             std::memcmp(a.data(), b.data(), sizeof(double) * std::size_t(a.size())) == 0;
    };
    EXPECT_TRUE(same(one.query_kernel, two.query_kernel));
    EXPECT_TRUE(same(one.key_kernel, two.key_kernel));
    EXPECT_TRUE(same(one.value_kernel, two.value_kernel));
    EXPECT_TRUE(same(one.output_kernel, two.output_kernel));
    EXPECT_TRUE(same(one.query_bias, two.query_bias));
    EXPECT_TRUE(same(one.query_values, two.query_values));
    EXPECT_TRUE(same(one.key, two.key));
    EXPECT_TRUE(same(one.value, two.value));
  }
}

// ---- 3. a custom softmax stage -------------------------------------------------------------

TEST(CustomSoftmaxStage, TemperatureSoftmaxMatchesReference) {
  const std::pair<long, long> sizes[] = {{1, 1}, {65, 130}, {130, 70}};
  std::uint64_t seed = 400;
  for (const auto& [steps, key_steps] : sizes)
    for (int masks = 0; masks < 4; ++masks) {
      Shape s = small_shape(steps, key_steps, masks & 1, masks & 2);
      s.heads = 3;
      const auto c = make_case<double>(s, ++seed);
      check_forward<TemperatureLayer>(c, Hooks{{}, kTemperatures});
      check_forward<BothLayer>(c, Hooks{kSlopes, kTemperatures});
    }
}

TEST(CustomSoftmaxStage, TemperatureSoftmaxGradientsMatchCentralDifferences) {
  check_gradients_over_configurations<TemperatureLayer>("TemperatureSoftmax", 500);
}

TEST(CustomSoftmaxStage, BothCustomStagesTogetherMatchCentralDifferences) {
  check_gradients_over_configurations<BothLayer>("RelativeBias + TemperatureSoftmax", 600);
}

// Training through both custom stages: gradient descent on the mean of ½(Y − Y*)² with the
// weights shared with the layer and updated in place between calls. Y* is the output of other
// weights, so the loss can go to 0; thirty steps must take off most of it, every one lowering it.
TEST(CustomSoftmaxStage, GradientDescentThroughCustomStagesLowersTheLoss) {
  const Shape s = small_shape(40, 30, true, false);
  const auto c = make_case<double>(s, 700);
  const auto target_case = make_case<double>(s, 701);
  auto options = c.options;
  options.num_threads = 2;
  options.score_strategy = sdmha::ScoreStrategy::automatic;
  BothLayer target_layer(c.config, target_case.weights);
  configure(target_layer);
  const auto query = c.query();
  const auto target = target_layer.forward(query, {c.key, c.value}, options).output;

  auto weights = std::make_shared<sdmha::MhaWeights<double>>(c.weights);
  BothLayer layer(c.config, weights);
  configure(layer);
  // The loss, and its gradient with respect to the output into d_output.
  Tensor3<double> d_output;
  auto step_loss = [&] {
    d_output = layer.forward(query, {c.key, c.value}, options).output - target;
    const double count = double(d_output.size());
    double total = 0;
    for (Index i = 0; i < d_output.size(); ++i) {
      total += 0.5 * d_output.data()[i] * d_output.data()[i] / count;
      d_output.data()[i] /= count;
    }
    return total;
  };
  const double first = step_loss();
  double previous = first;
  constexpr double rate = 1.0;
  for (int step = 0; step < 30; ++step) {
    const auto g = layer.backward(query, {c.key, c.value}, d_output, options);
    weights->query_kernel -= rate * g.query_kernel;
    weights->query_bias -= rate * g.query_bias;
    weights->key_kernel -= rate * g.key_kernel;
    weights->key_bias -= rate * g.key_bias;
    weights->value_kernel -= rate * g.value_kernel;
    weights->value_bias -= rate * g.value_bias;
    weights->output_kernel -= rate * g.output_kernel;
    weights->output_bias -= rate * g.output_bias;
    const double current = step_loss();
    EXPECT_LT(current, previous) << "step " << step;
    previous = current;
  }
  std::printf("training through custom stages: loss %.6g -> %.6g\n", first, previous);
  EXPECT_LT(previous, 0.1 * first);  // 0.114 -> 0.005 on this problem
}

// ---- 4. shared weights ---------------------------------------------------------------------

TEST(SharedWeights, InPlaceUpdatesAreSeenByTheNextCall) {
  const auto c = make_case<double>(small_shape(70, 40, false, true), 800);
  auto weights = std::make_shared<sdmha::MhaWeights<double>>(c.weights);
  BiasLayer layer(c.config, weights);
  configure(layer);
  EXPECT_EQ(layer.shared_weights().get(), weights.get());
  auto options = c.options;
  options.num_threads = 2;
  const auto query = c.query();
  const auto before = layer.forward(query, {c.key, c.value}, options).output;

  weights->query_kernel(0, 0) += 1.0;
  weights->key_kernel(1, 2) -= 0.5;
  weights->value_kernel *= 1.5;
  weights->output_bias.array() += 0.25;
  const auto after = layer.forward(query, {c.key, c.value}, options).output;
  EXPECT_FALSE(bitwise_equal(before, after));

  // A fresh layer from a copy of the updated weights computes the same, bitwise.
  BiasLayer fresh(c.config, sdmha::MhaWeights<double>(*weights));
  configure(fresh);
  EXPECT_TRUE(bitwise_equal(after, fresh.forward(query, {c.key, c.value}, options).output));
  // And the reference agrees with the updated weights.
  auto problem = c.problem;
  problem.query_kernel.assign(weights->query_kernel.data(),
                              weights->query_kernel.data() + weights->query_kernel.size());
  problem.key_kernel.assign(weights->key_kernel.data(),
                            weights->key_kernel.data() + weights->key_kernel.size());
  problem.value_kernel.assign(weights->value_kernel.data(),
                              weights->value_kernel.data() + weights->value_kernel.size());
  problem.output_bias.assign(weights->output_bias.data(),
                             weights->output_bias.data() + weights->output_bias.size());
  EXPECT_TRUE(
      all_near(after.data(), reference(problem, Hooks{kSlopes, {}}).output, kForwardTolerance));

  // Two layers over one set of weights see the same updates; the backward reads them too.
  BiasLayer second(c.config, weights);
  configure(second);
  weights->output_kernel(0, 0) += 2.0;
  EXPECT_TRUE(bitwise_equal(layer.forward(query, {c.key, c.value}, options).output,
                            second.forward(query, {c.key, c.value}, options).output));
  const auto d_output = random_d_output(c, 801);
  const auto gradients = layer.backward(query, {c.key, c.value}, d_output, options);
  BiasLayer copy(c.config, sdmha::MhaWeights<double>(*weights));
  configure(copy);
  const auto expected = copy.backward(query, {c.key, c.value}, d_output, options);
  EXPECT_TRUE(bitwise_equal(gradients.key, expected.key));
  EXPECT_TRUE(bitwise_equal(gradients.output_kernel, expected.output_kernel));

  // A layer built from weights by value keeps its own copy.
  sdmha::MhaWeights<double> owned = c.weights;
  BiasLayer by_value(c.config, owned);
  configure(by_value);
  const auto owned_before = by_value.forward(query, {c.key, c.value}, options).output;
  owned.query_kernel.setZero();
  EXPECT_TRUE(
      bitwise_equal(owned_before, by_value.forward(query, {c.key, c.value}, options).output));
}

TEST(SharedWeights, ReshapingThroughTheHandleIsAShapeErrorOnTheNextCall) {
  const auto c = make_case<double>(small_shape(20, 10, false, false), 810);
  auto weights = std::make_shared<sdmha::MhaWeights<double>>(c.weights);
  BiasLayer layer(c.config, weights);
  configure(layer);
  const auto query = c.query();
  const auto d_output = random_d_output(c, 811);
  auto options = c.options;
  options.num_threads = 1;
  const auto expected = layer.forward(query, {c.key, c.value}, options).output;

  const sdmha::RowMatrix<double> key_kernel = weights->key_kernel;
  weights->key_kernel.conservativeResize(key_kernel.rows(), key_kernel.cols() + 1);
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, {c.key, c.value}, options), sdmha::ShapeError,
                          "key_kernel");
  SDMHA_EXPECT_THROW_WITH(layer.backward(query, {c.key, c.value}, d_output, options),
                          sdmha::ShapeError, "key_kernel");
  weights->key_kernel = key_kernel;
  EXPECT_TRUE(bitwise_equal(expected, layer.forward(query, {c.key, c.value}, options).output));

  // More rows in the query kernel: the query's features no longer match.
  const sdmha::RowMatrix<double> query_kernel = weights->query_kernel;
  weights->query_kernel.conservativeResize(query_kernel.rows() + 1, query_kernel.cols());
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, {c.key, c.value}, options), sdmha::ShapeError,
                          "features");
  weights->query_kernel = query_kernel;

  // A bias of the wrong length, and an output kernel of the wrong height.
  weights->value_bias.conservativeResize(weights->value_bias.size() - 1);
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, {c.key, c.value}, options), sdmha::ShapeError,
                          "value_bias");
  weights->value_bias = c.weights.value_bias;
  weights->output_kernel.resize(weights->output_kernel.rows() + 2, weights->output_kernel.cols());
  SDMHA_EXPECT_THROW_WITH(layer.backward(query, {c.key, c.value}, d_output, options),
                          sdmha::ShapeError, "output_kernel");
  weights->output_kernel = c.weights.output_kernel;
  EXPECT_TRUE(bitwise_equal(expected, layer.forward(query, {c.key, c.value}, options).output));
}

TEST(SharedWeights, NullSharedPointerIsAConfigError) {
  const auto c = make_case<double>(small_shape(4, 4, false, false), 820);
  const std::shared_ptr<sdmha::MhaWeights<double>> none;
  SDMHA_EXPECT_THROW_WITH(BiasLayer(c.config, none), sdmha::ConfigError, "null");
  SDMHA_EXPECT_THROW_WITH(sdmha::SparseDenseMHA<double>(c.config, none), sdmha::ConfigError,
                          "null");
}

}  // namespace
}  // namespace sdmha_test
