// The forward's online softmax over key tiles (detail/forward_pass.hpp, attend_item_online):
// taken when an item sees more than detail::kKeyTile keys, the softmax and attend-values stages
// declare it (detail::online_softmax_allowed), and no scores are returned. Checked against the
// float64 reference, against the stored-probabilities path of the same layer
// (return_attention_scores forces it), across thread counts, and with a position-dependent score
// stage whose key tiles start past key 0.
#include <cmath>
#include <limits>

#include "test_support.hpp"

namespace {

using namespace sdmha_test;

SDMHA_SCALAR_TYPED_TEST_SUITE(OnlineSoftmaxTest);

// Long enough that the items have several key tiles (and, causal, a partial last one).
Shape long_shape() {
  Shape s =
      Shape{}.sized(2, 70, sdmha::detail::kKeyTile * 2 + 37).widths(24, 10, 10).with_heads(2, 4);
  s.density = 0.2;
  return s;
}

TYPED_TEST(OnlineSoftmaxTest, AgreesWithReferenceOverEveryMask) {
  using Scalar = TypeParam;
  for (int variant = 0; variant < 4; ++variant) {
    Shape shape = long_shape();
    shape.random_mask = variant == 1;
    shape.key_mask = variant == 2;
    shape.fully_blocked_rows = variant == 3;
    if (variant == 3)
      shape.steps = sdmha::detail::kKeyTile + 90;  // causal: rows beyond one key tile
    shape.causal = variant >= 2;
    const auto c = make_case<Scalar>(shape, 40 + variant);
    const sdmha::SparseDenseMHA<Scalar> layer(c.config, c.weights);
    auto options = c.options;
    options.score_strategy = sdmha::ScoreStrategy::project_first;
    options.num_threads = 2;
    const auto result = layer.forward(c.query(), {c.key, c.value}, options);
    const auto expected = sdmha_reference::forward(c.problem);
    EXPECT_TRUE(all_near(result.output.data(), expected.output, relative_tolerance<Scalar>()))
        << "variant " << variant;
  }
}

TYPED_TEST(OnlineSoftmaxTest, MatchesStoredProbabilitiesAndThreadCounts) {
  using Scalar = TypeParam;
  Shape shape = long_shape();
  shape.key_mask = true;
  shape.causal = true;
  shape.steps = sdmha::detail::kKeyTile + 3;
  const auto c = make_case<Scalar>(shape, 7);
  const sdmha::SparseDenseMHA<Scalar> layer(c.config, c.weights);
  auto options = c.options;
  options.score_strategy = sdmha::ScoreStrategy::project_first;
  options.training = true;
  options.dropout_rate = 0.25;
  options.dropout_seed = 11;
  options.num_threads = 1;
  const auto online = layer.forward(c.query(), {c.key, c.value}, options);
  options.num_threads = 3;
  const auto online_threads = layer.forward(c.query(), {c.key, c.value}, options);
  options.return_attention_scores = true;
  const auto stored = layer.forward(c.query(), {c.key, c.value}, options);
  for (Index i = 0; i < online.output.size(); ++i) {
    ASSERT_EQ(online.output.data()[i], online_threads.output.data()[i]) << "entry " << i;
    const double scale = 1.0 + std::abs(double(stored.output.data()[i]));
    ASSERT_NEAR(double(online.output.data()[i]), double(stored.output.data()[i]),
                64 * std::numeric_limits<Scalar>::epsilon() * scale)
        << "entry " << i;
  }
}

// A blocked value row that is not finite never reaches an output, in any key tile.
TYPED_TEST(OnlineSoftmaxTest, BlockedNonFiniteValuesStayOut) {
  using Scalar = TypeParam;
  Shape shape = long_shape();
  shape.key_mask = true;
  auto c = make_case<Scalar>(shape, 3);
  // Padded key steps are blocked for every query: poison their values, in every key tile.
  Index poisoned = 0;
  for (Index b = 0; b < shape.batch; ++b)
    for (Index s = 0; s < shape.key_steps; ++s)
      if (!c.key_mask()(b, s)) {
        ++poisoned;
        for (Index e = 0; e < shape.value_in_dim; ++e) {
          c.value(b, s, e) = std::numeric_limits<Scalar>::quiet_NaN();
          c.problem.value[std::size_t((b * shape.key_steps + s) * shape.value_in_dim + e)] = 0.0;
        }
      }
  ASSERT_GT(poisoned, sdmha::detail::kKeyTile / 10);
  const sdmha::SparseDenseMHA<Scalar> layer(c.config, c.weights);
  auto options = c.options;
  options.score_strategy = sdmha::ScoreStrategy::project_first;
  const auto result = layer.forward(c.query(), {c.key, c.value}, options);
  const auto expected = sdmha_reference::forward(c.problem);
  EXPECT_TRUE(all_near(result.output.data(), expected.output, relative_tolerance<Scalar>()));
}

// A score stage that depends on absolute key positions sees each key tile's own key_begin.
template <typename Scalar>
struct KeyPositionBias : sdmha::ScoreKernel<Scalar> {
  using Base = sdmha::ScoreKernel<Scalar>;
  template <typename Args>
  void operator()(const Args& args) const {
    Base::operator()(args);
    for (Index t = 0; t < args.scores.rows(); ++t)
      for (Index s = 0; s < args.scores.cols(); ++s)
        args.scores(t, s) +=
            Scalar(0.01) * Scalar((args.key_begin + s) % 97) - Scalar(0.02) * Scalar(args.head);
  }
};

TYPED_TEST(OnlineSoftmaxTest, PositionDependentScoreStageSeesAbsoluteKeys) {
  using Scalar = TypeParam;
  const auto c = make_case<Scalar>(long_shape(), 5);
  using Layer =
      sdmha::SparseDenseMHA<Scalar, sdmha::SparseQueryProjection<Scalar>, KeyPositionBias<Scalar>>;
  const Layer layer(c.config, c.weights);
  auto options = c.options;
  options.score_strategy = sdmha::ScoreStrategy::project_first;
  const auto online = layer.forward(c.query(), {c.key, c.value}, options);
  // The same stage over whole rows (the stored-probabilities path) and under the regrouped form.
  options.return_attention_scores = true;
  const auto stored = layer.forward(c.query(), {c.key, c.value}, options);
  options.return_attention_scores = false;
  options.score_strategy = sdmha::ScoreStrategy::sparse_regrouped;
  const auto regrouped = layer.forward(c.query(), {c.key, c.value}, options);
  // And against the reference with the bias written into an additive float64 mask of its own.
  double worst = 0, worst_regrouped = 0, scale = 0;
  for (Index i = 0; i < online.output.size(); ++i) {
    worst = std::max(worst,
                     std::abs(double(online.output.data()[i]) - double(stored.output.data()[i])));
    worst_regrouped = std::max(worst_regrouped, std::abs(double(online.output.data()[i]) -
                                                         double(regrouped.output.data()[i])));
    scale = std::max(scale, std::abs(double(stored.output.data()[i])));
  }
  EXPECT_LE(worst, 1e3 * std::numeric_limits<Scalar>::epsilon() * (1 + scale));
  EXPECT_LE(worst_regrouped, 1e3 * std::numeric_limits<Scalar>::epsilon() * (1 + scale));
  // The bias matters: without it the output differs.
  const sdmha::SparseDenseMHA<Scalar> plain(c.config, c.weights);
  options.score_strategy = sdmha::ScoreStrategy::project_first;
  const auto unbiased = plain.forward(c.query(), {c.key, c.value}, options);
  double difference = 0;
  for (Index i = 0; i < online.output.size(); ++i)
    difference = std::max(
        difference, std::abs(double(online.output.data()[i]) - double(unbiased.output.data()[i])));
  EXPECT_GT(difference, 1e-3);
}

}  // namespace

// A softmax stage derived from MaskedSoftmax inherits its math but not its declaration that the
// forward may compute it online (`computes_online` names MaskedSoftmax, not the derived stage):
// the layer then runs whole rows of S, the documented cost being a worker's tile of query rows
// × S scores, so its workspace grows with S where the default layer's stays flat.
template <typename Scalar>
struct RenamedSoftmax : sdmha::MaskedSoftmax<Scalar> {};

template <typename Scalar>
struct OnlineSoftmaxOf : RenamedSoftmax<Scalar> {
  using computes_online = OnlineSoftmaxOf;
};

TYPED_TEST(OnlineSoftmaxTest, CustomSoftmaxGetsWholeRowsUnlessItDeclaresOnline) {
  using Scalar = TypeParam;
  static_assert(sdmha::detail::online_softmax_allowed<sdmha::MaskedSoftmax<Scalar>,
                                                      sdmha::AttendValues<Scalar>>());
  static_assert(!sdmha::detail::online_softmax_allowed<RenamedSoftmax<Scalar>,
                                                       sdmha::AttendValues<Scalar>>());
  static_assert(sdmha::detail::online_softmax_allowed<OnlineSoftmaxOf<Scalar>,
                                                      sdmha::AttendValues<Scalar>>());
  using Custom = sdmha::SparseDenseMHA<Scalar, sdmha::SparseQueryProjection<Scalar>,
                                       sdmha::ScoreKernel<Scalar>, RenamedSoftmax<Scalar>>;
  using Declared = sdmha::SparseDenseMHA<Scalar, sdmha::SparseQueryProjection<Scalar>,
                                         sdmha::ScoreKernel<Scalar>, OnlineSoftmaxOf<Scalar>>;
  auto workspace_bytes = [](const auto& layer, const auto& c) {
    sdmha::Workspace<Scalar> workspace;
    sdmha::AttentionResult<Scalar> result;
    auto options = c.options;
    options.score_strategy = sdmha::ScoreStrategy::project_first;
    options.num_threads = 1;
    layer.forward(c.query(), {c.key, c.value}, options, workspace, result);
    return std::pair<std::size_t, sdmha::AttentionResult<Scalar>>(workspace.bytes(), result);
  };
  Shape shape = long_shape();
  shape.batch = 1;
  const auto short_case = make_case<Scalar>(shape, 9);
  shape.key_steps *= 4;
  const auto long_case = make_case<Scalar>(shape, 9);
  const Custom custom_short(short_case.config, short_case.weights);
  const Custom custom_long(long_case.config, long_case.weights);
  const Declared declared_short(short_case.config, short_case.weights);
  const Declared declared_long(long_case.config, long_case.weights);
  const auto [custom_small, custom_result] = workspace_bytes(custom_short, short_case);
  const std::size_t custom_large = workspace_bytes(custom_long, long_case).first;
  const auto [declared_small, declared_result] = workspace_bytes(declared_short, short_case);
  const std::size_t declared_large = workspace_bytes(declared_long, long_case).first;
  // Both grow with K and V (B·S rows); only the whole-row path grows by a tile of rows × S too.
  const std::size_t tile_growth =
      std::size_t(shape.steps) *
      std::size_t(long_case.problem.key_steps - short_case.problem.key_steps) * sizeof(Scalar);
  EXPECT_GE(custom_large - custom_small, declared_large - declared_small + tile_growth);
  // The same math either way.
  const auto expected = sdmha_reference::forward(short_case.problem);
  EXPECT_TRUE(all_near(custom_result.output.data(), expected.output, relative_tolerance<Scalar>()));
  EXPECT_TRUE(
      all_near(declared_result.output.data(), expected.output, relative_tolerance<Scalar>()));
}
