// The attention's semantics options (sdmha/options.hpp): the scale override, the causal
// alignment (top_left, bottom_right) and the policy for fully blocked rows (zeros, uniform),
// forward against the float64 reference under both score strategies, through the online softmax
// and the stored-probabilities paths and across thread counts, and backward against central
// differences; bad values are rejected before any work.
#include <cmath>
#include <limits>

#include "gradient_check.hpp"
#include "test_support.hpp"

namespace {

using namespace sdmha_test;

SDMHA_SCALAR_TYPED_TEST_SUITE(AttentionSemanticsTest);

// One semantics setting, applied to both the options and the reference's problem.
struct Semantics {
  const char* name;
  double scale = 0.0;  // 0: the default
  bool bottom_right = false;
  bool uniform = false;
};

template <typename Scalar>
void apply(const Semantics& semantics, Case<Scalar>& c) {
  if (semantics.scale != 0.0) c.options.scale = semantics.scale;
  c.problem.scale = semantics.scale;
  if (semantics.bottom_right) {
    c.options.causal_alignment = sdmha::CausalAlignment::bottom_right;
    c.problem.causal_offset = c.shape.key_steps - c.shape.steps;
  }
  c.options.fully_masked_rows =
      semantics.uniform ? sdmha::FullyMaskedRows::uniform : sdmha::FullyMaskedRows::zeros;
  c.problem.uniform_fully_masked = semantics.uniform;
}

std::vector<Semantics> settings() {
  return {{"scale", 0.37},
          {"negative_scale", -0.8},
          {"bottom_right", 0.0, true},
          {"uniform", 0.0, false, true},
          {"bottom_right_uniform_scale", 0.5, true, true}};
}

std::vector<Shape> shapes() {
  std::vector<Shape> list;
  Shape s;
  s.causal = true;
  s.steps = 9;
  s.key_steps = 5;  // T > S: bottom-right blocks the first rows entirely
  s.key_mask = true;
  list.push_back(s);
  s = Shape{};
  s.causal = true;
  s.steps = 4;
  s.key_steps = 11;
  s.fully_blocked_rows = true;
  list.push_back(s);
  s = Shape{};
  s.causal = true;
  s.batch = 1;
  s.steps = 70;
  s.key_steps =
      sdmha::detail::kKeyTile + 45;  // several key tiles: the online softmax when it applies
  s.query_dim = 20;
  s.random_mask = true;
  list.push_back(s);
  return list;
}

TYPED_TEST(AttentionSemanticsTest, ForwardMatchesReference) {
  using Scalar = TypeParam;
  int seed = 0;
  for (const Shape& shape : shapes())
    for (const Semantics& semantics : settings())
      for (auto strategy :
           {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped})
        for (bool return_scores : {false, true}) {
          auto c = make_case<Scalar>(shape, 300 + seed++);
          apply(semantics, c);
          c.options.score_strategy = strategy;
          c.options.return_attention_scores = return_scores;
          c.options.num_threads = 2;
          const sdmha::SparseDenseMHA<Scalar> layer(c.config, c.weights);
          const auto result = layer.forward(c.query(), {c.key, c.value}, c.options);
          const auto expected = sdmha_reference::forward(c.problem);
          SCOPED_TRACE(std::string(semantics.name) + " " + sdmha::to_string(strategy) + " T=" +
                       std::to_string(shape.steps) + " S=" + std::to_string(shape.key_steps));
          EXPECT_TRUE(
              all_near(result.output.data(), expected.output, relative_tolerance<Scalar>()));
          if (return_scores) {
            EXPECT_TRUE(all_near(result.attention_scores.data(), expected.probabilities,
                                 relative_tolerance<Scalar>()));
          }
          c.options.num_threads = 1;
          const auto single = layer.forward(c.query(), {c.key, c.value}, c.options);
          for (Index i = 0; i < result.output.size(); ++i)
            ASSERT_EQ(single.output.data()[i], result.output.data()[i])
                << "thread counts differ at " << i;
        }
}

// The reference's own check that uniform rows exist in these shapes: otherwise the uniform
// setting would test nothing.
TEST(AttentionSemantics, ShapesHoldFullyBlockedRows) {
  for (const Shape& shape : {shapes()[0], shapes()[1]}) {
    auto c = make_case<double>(shape, 300);
    c.problem.causal_offset = shape.key_steps - shape.steps;
    c.problem.uniform_fully_masked = true;
    const auto expected = sdmha_reference::forward(c.problem);
    long uniform_rows = 0;
    const long S = shape.key_steps;
    for (std::size_t row = 0; row * S < expected.probabilities.size(); ++row)
      uniform_rows += expected.probabilities[row * S] == 1.0 / double(S) &&
                      expected.probabilities[row * S + S - 1] == 1.0 / double(S);
    EXPECT_GT(uniform_rows, 0);
  }
}

TEST(AttentionSemantics, GradientsMatchCentralDifferences) {
  int seed = 0;
  for (const Shape& base : {shapes()[0], shapes()[1]})
    for (const Semantics& semantics : settings())
      for (auto strategy :
           {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
        auto c = make_case<double>(base, 500 + seed++);
        apply(semantics, c);
        c.options.score_strategy = strategy;
        SCOPED_TRACE(std::string(semantics.name) + " " + sdmha::to_string(strategy));
        EXPECT_EQ(gradient_check::check(c, c.options, 700 + seed, 12), 0);
      }
}

TEST(AttentionSemantics, BadScaleIsRejected) {
  auto c = make_case<double>(Shape{}, 1);
  const sdmha::SparseDenseMHA<double> layer(c.config, c.weights);
  for (double scale :
       {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    c.options.scale = scale;
    SDMHA_EXPECT_THROW_WITH(layer.forward(c.query(), {c.key, c.value}, c.options),
                            sdmha::ConfigError, "expected a finite number");
  }
}

}  // namespace
