// Tests of sdmha/stages/score_kernel.hpp: ScoreKernel's two forms against the reference's scaled,
// masked scores of every (batch, head): project-first on the projected query block, and the
// regrouped form from batch b's CSR rows, the head's kernel columns and its bias slice. Blocked
// entries must be exactly −∞, even when the key row there is not finite. With bfloat16_operands,
// the project-first scores are the float64 products of the rounded operands.
#include "test_support.hpp"

namespace sdmha_test {
namespace {

SDMHA_SCALAR_TYPED_TEST_SUITE(ScoreKernelTest);

template <typename Scalar>
using Kernel = sdmha::ScoreKernel<Scalar>;

template <typename Scalar>
sdmha::RowMatrix<Scalar> to_matrix(const std::vector<double>& twin, Index rows, Index cols) {
  sdmha::RowMatrix<Scalar> matrix(rows, cols);
  for (Index i = 0; i < matrix.size(); ++i) matrix.data()[i] = Scalar(twin[i]);
  return matrix;
}

// A case with everything the two forms take: the reference's projected query and key rounded to
// Scalar (the project-first inputs), the sparse query and the weights (the regrouped inputs).
template <typename Scalar>
struct ScoreProblem {
  Case<Scalar> c;
  sdmha_reference::Result expected;
  sdmha::SparseQuery<Scalar> query;
  sdmha::RowMatrix<Scalar> projected_query;  // B·T × H·Dk
  sdmha::RowMatrix<Scalar> projected_key;    // B·S × H·Dk
  sdmha::Vector<Scalar> no_bias;

  ScoreProblem(const Shape& shape, std::uint64_t seed)
      : c(make_case<Scalar>(shape, seed)),
        expected(sdmha_reference::forward(c.problem)),
        query(c.query()) {
    const auto& p = c.problem;
    projected_query = to_matrix<Scalar>(expected.query, p.batch * p.steps, p.heads * p.key_dim);
    projected_key = to_matrix<Scalar>(expected.key, p.batch * p.key_steps, p.heads * p.key_dim);
  }

  Index T() const { return c.problem.steps; }
  Index S() const { return c.problem.key_steps; }
  Index Dk() const { return c.problem.key_dim; }
  Scalar scale() const { return Scalar(1.0 / std::sqrt(double(Dk()))); }

  sdmha::BatchMask mask(Index b) const {
    sdmha::BatchMask mask;
    mask.steps = T();
    mask.key_steps = S();
    mask.causal = c.options.use_causal_mask;
    if (c.options.attention_mask.size() != 0)
      mask.attention = c.options.attention_mask.data() + b * T() * S();
    if (!c.options.key_mask.empty()) mask.key_mask = c.options.key_mask.data() + b * S();
    return mask;
  }

  // The (b, h) block of a projected matrix. An empty block is taken at (0, 0): Eigen's block()
  // adds the offset to data(), which is null in an empty matrix (T = 0 or S = 0), and an offset
  // on a null pointer is undefined behaviour (UBSan: "applying non-zero offset to null pointer").
  static auto head_block(const sdmha::RowMatrix<Scalar>& matrix, Index row, Index column,
                         Index rows, Index columns) {
    const bool empty = rows == 0 || columns == 0;
    return matrix.block(empty ? 0 : row, empty ? 0 : column, rows, columns);
  }

  sdmha::RowMatrix<Scalar> project_first(Index b, Index h, bool bfloat16_operands = false) const {
    sdmha::RowMatrix<Scalar> scores(T(), S());
    typename Kernel<Scalar>::Arguments args{
        sdmha::TilePosition{b, h, 0, 0},
        head_block(projected_query, b * T(), h * Dk(), T(), Dk()),
        head_block(projected_key, b * S(), h * Dk(), S(), Dk()),
        scale(),
        mask(b),
        scores};
    args.bfloat16_operands = bfloat16_operands;
    Kernel<Scalar>::can_implement(args);
    Kernel<Scalar>{}(args);
    return scores;
  }

  sdmha::RowMatrix<Scalar> regrouped(Index b, Index h) const {
    const auto& weights = c.weights;
    sdmha::RowMatrix<Scalar> scores(T(), S());
    typename Kernel<Scalar>::SparseArguments args{
        sdmha::TilePosition{b, h, 0, 0},
        query.batch_rows(b),
        weights.query_kernel.middleCols(h * Dk(), Dk()),
        weights.query_bias.size() != 0
            ? sdmha::ConstVectorRef<Scalar>(weights.query_bias.segment(h * Dk(), Dk()))
            : sdmha::ConstVectorRef<Scalar>(no_bias),
        head_block(projected_key, b * S(), h * Dk(), S(), Dk()),
        scale(),
        mask(b),
        scores};
    Kernel<Scalar>::can_implement(args);
    Kernel<Scalar>{}(args);
    return scores;
  }

  // The reference's T × S scores of (b, h).
  const double* expected_scores(Index b, Index h) const {
    return expected.scores.data() + (b * c.problem.heads + h) * T() * S();
  }
};

// Blocked (−∞) entries must be exactly −∞; the others within `tolerance` of the reference,
// relative to 1 + |expected|.
template <typename Scalar>
::testing::AssertionResult scores_match(const sdmha::RowMatrix<Scalar>& got, const double* expected,
                                        double tolerance) {
  const double minus_infinity = -std::numeric_limits<double>::infinity();
  for (Index t = 0; t < got.rows(); ++t)
    for (Index s = 0; s < got.cols(); ++s) {
      const double want = expected[t * got.cols() + s];
      const double have = double(got(t, s));
      if (want == minus_infinity) {
        if (have != minus_infinity)
          return ::testing::AssertionFailure()
                 << "(" << t << ", " << s << ") is " << have << "; expected -inf";
        continue;
      }
      const double error = std::abs(have - want) / (1.0 + std::abs(want));
      if (!(error <= tolerance))
        return ::testing::AssertionFailure()
               << "(" << t << ", " << s << ") is " << have << "; expected " << want
               << " (relative error " << error << " > " << tolerance << ")";
    }
  return ::testing::AssertionSuccess();
}

std::vector<std::pair<const char*, Shape>> score_shapes() {
  std::vector<std::pair<const char*, Shape>> shapes;
  Shape s;
  shapes.push_back({"basic", s});
  s = Shape{};
  s.batch = 1;
  s.heads = 1;
  shapes.push_back({"batch1_head1", s});
  s = Shape{};
  s.steps = 3;
  s.key_steps = 11;
  s.query_dim = 23;
  s.heads = 3;
  s.key_dim = 5;
  s.value_dim = 2;
  shapes.push_back({"odd_sizes", s});
  s = Shape{};
  s.random_mask = true;
  shapes.push_back({"random_mask", s});
  s = Shape{};
  s.causal = true;
  s.steps = 8;
  s.key_steps = 5;
  shapes.push_back({"causal_t_gt_s", s});
  s = Shape{};
  s.causal = true;
  s.steps = 4;
  s.key_steps = 9;
  s.random_mask = true;
  shapes.push_back({"causal_t_lt_s_mask", s});
  s = Shape{};
  s.key_mask = true;
  s.random_mask = true;
  shapes.push_back({"key_mask", s});
  s = Shape{};
  s.fully_blocked_rows = true;
  s.steps = 8;
  shapes.push_back({"fully_blocked_rows", s});
  s = Shape{};
  s.empty_rows = true;
  s.steps = 10;
  shapes.push_back({"empty_rows", s});
  s = Shape{};
  s.duplicates = true;
  s.density = 0.5;
  shapes.push_back({"duplicates", s});
  s = Shape{};
  s.use_bias = false;
  s.empty_rows = true;
  s.causal = true;
  shapes.push_back({"no_bias", s});
  s = Shape{}.sized(2, 20, 30).with_heads(3, 8).with_masks();
  s.query_dim = 60;
  s.density = 0.05;
  shapes.push_back({"larger_all_masks", s});
  return shapes;
}

TYPED_TEST(ScoreKernelTest, BothFormsMatchTheReferenceScores) {
  std::uint64_t seed = 700;
  for (const auto& [name, shape] : score_shapes()) {
    SCOPED_TRACE(name);
    const ScoreProblem<TypeParam> problem(shape, seed++);
    for (Index b = 0; b < shape.batch; ++b)
      for (Index h = 0; h < shape.heads; ++h) {
        SCOPED_TRACE(::testing::Message() << "b " << b << ", h " << h);
        EXPECT_TRUE(scores_match(problem.project_first(b, h), problem.expected_scores(b, h),
                                 relative_tolerance<TypeParam>()))
            << "project-first";
        EXPECT_TRUE(scores_match(problem.regrouped(b, h), problem.expected_scores(b, h),
                                 relative_tolerance<TypeParam>()))
            << "regrouped";
      }
  }
}

TYPED_TEST(ScoreKernelTest, TheTwoFormsAgreeWithEachOther) {
  std::mt19937_64 generator(710);
  auto pick = [&](long low, long high) {
    return std::uniform_int_distribution<long>(low, high)(generator);
  };
  for (int round = 0; round < 10; ++round) {
    Shape s = Shape{}.sized(pick(1, 3), pick(1, 9), pick(1, 9)).with_heads(pick(1, 3), pick(1, 6));
    s.query_dim = pick(1, 30);
    s.density = 0.2;
    s.use_bias = round % 3 != 0;
    s.random_mask = round % 2 == 0;
    s.causal = round % 3 == 1;
    s.empty_rows = round % 4 == 0;
    s.duplicates = round % 5 == 0;
    SCOPED_TRACE(::testing::Message() << "round " << round);
    const ScoreProblem<TypeParam> problem(s, 720 + round);
    for (Index b = 0; b < s.batch; ++b)
      for (Index h = 0; h < s.heads; ++h) {
        const auto regrouped = problem.regrouped(b, h);
        // The regrouped scores, in float64, as the expectation for the project-first ones.
        std::vector<double> twin(regrouped.data(), regrouped.data() + regrouped.size());
        EXPECT_TRUE(
            scores_match(problem.project_first(b, h), twin.data(), relative_tolerance<TypeParam>()))
            << "b " << b << ", h " << h;
      }
  }
}

TYPED_TEST(ScoreKernelTest, BlockedEntriesAreMinusInfinityEvenOverNonFiniteKeys) {
  Shape s = Shape{}.sized(2, 6, 8);
  s.key_mask = true;
  s.random_mask = true;
  s.causal = true;
  ScoreProblem<TypeParam> problem(s, 730);
  // Poison the projected key at every padded step, for every head.
  Index poisoned = 0;
  for (Index b = 0; b < s.batch; ++b)
    for (Index key_step = 0; key_step < s.key_steps; ++key_step)
      if (!problem.c.key_mask()(b, key_step)) {
        problem.projected_key.row(b * s.key_steps + key_step)
            .setConstant(key_step % 2 ? std::numeric_limits<TypeParam>::infinity()
                                      : std::numeric_limits<TypeParam>::quiet_NaN());
        ++poisoned;
      }
  ASSERT_GT(poisoned, 0);
  for (Index b = 0; b < s.batch; ++b)
    for (Index h = 0; h < s.heads; ++h) {
      SCOPED_TRACE(::testing::Message() << "b " << b << ", h " << h);
      EXPECT_TRUE(scores_match(problem.project_first(b, h), problem.expected_scores(b, h),
                               relative_tolerance<TypeParam>()));
      EXPECT_TRUE(scores_match(problem.regrouped(b, h), problem.expected_scores(b, h),
                               relative_tolerance<TypeParam>()));
    }
}

// With bfloat16_operands, S = bf16(scale·Q)·bf16(K)ᵀ: each score within float32's summation
// error of the float64 sum of the rounded operands' products (scale·q formed in float, as the
// stage does), blocked entries exactly −∞ even over NaN keys; a double stage refuses it.
TEST(ScoreKernelBFloat16, ScoresAreTheRoundedOperandsProducts) {
  std::uint64_t seed = 780;
  for (const auto& [name, shape] : score_shapes()) {
    SCOPED_TRACE(name);
    ScoreProblem<float> problem(shape, seed++);
    const Index T = problem.T(), S = problem.S(), Dk = problem.Dk();
    if (T > 0 && S > 0) problem.projected_key.row(0).setConstant(NAN);  // key step 0 of b = 0
    for (Index b = 0; b < shape.batch; ++b)
      for (Index h = 0; h < shape.heads; ++h) {
        SCOPED_TRACE(::testing::Message() << "b " << b << ", h " << h);
        const auto scores = problem.project_first(b, h, true);
        const double* reference = problem.expected_scores(b, h);
        for (Index t = 0; t < T; ++t)
          for (Index s = 0; s < S; ++s) {
            if (reference[t * S + s] == -std::numeric_limits<double>::infinity()) {
              EXPECT_EQ(scores(t, s), -std::numeric_limits<float>::infinity());
              continue;
            }
            double sum = 0.0, magnitude = 0.0;
            for (Index d = 0; d < Dk; ++d) {
              const float q = problem.scale() * problem.projected_query(b * T + t, h * Dk + d);
              const double term =
                  double(float(Eigen::bfloat16(q))) *
                  double(float(Eigen::bfloat16(problem.projected_key(b * S + s, h * Dk + d))));
              sum += term;
              magnitude += std::abs(term);
            }
            if (std::isnan(sum)) {
              EXPECT_TRUE(std::isnan(scores(t, s))) << t << ", " << s;
              continue;
            }
            EXPECT_LE(std::abs(double(scores(t, s)) - sum), (Dk + 1) * 0x1p-24 * magnitude)
                << t << ", " << s;
          }
      }
  }
  ScoreProblem<double> problem(Shape{}, 790);
  SDMHA_EXPECT_THROW_WITH(problem.project_first(0, 0, true), sdmha::ConfigError,
                          "bfloat16_operands is set for a double stage");
}

TYPED_TEST(ScoreKernelTest, TheScaleIsTheCallersArgument) {
  const ScoreProblem<TypeParam> problem(Shape{}, 740);
  const TypeParam scale = TypeParam(0.3);
  const Index T = problem.T(), S = problem.S(), Dk = problem.Dk();
  sdmha::RowMatrix<TypeParam> scores(T, S);
  const auto query = problem.projected_query.block(T, Dk, T, Dk);  // b = 1, h = 1
  const auto key = problem.projected_key.block(S, Dk, S, Dk);
  typename Kernel<TypeParam>::Arguments args{
      sdmha::TilePosition{1, 1, 0, 0}, query, key, scale, sdmha::BatchMask{}, scores};
  Kernel<TypeParam>::can_implement(args);
  Kernel<TypeParam>{}(args);
  std::vector<double> expected;
  for (Index t = 0; t < T; ++t)
    for (Index s = 0; s < S; ++s) {
      double dot = 0.0;
      for (Index d = 0; d < Dk; ++d) dot += double(query(t, d)) * double(key(s, d));
      expected.push_back(double(scale) * dot);
    }
  EXPECT_TRUE(all_near(scores.data(), expected, relative_tolerance<TypeParam>()));
}

TYPED_TEST(ScoreKernelTest, ZeroStepsOrKeysGiveEmptyScores) {
  for (auto dims : std::vector<std::array<long, 2>>{{0, 7}, {5, 0}, {0, 0}}) {
    Shape s = Shape{}.sized(2, dims[0], dims[1]);
    s.causal = true;
    const ScoreProblem<TypeParam> problem(s, 750);
    for (Index b = 0; b < s.batch; ++b) {
      EXPECT_EQ(problem.project_first(b, 1).size(), 0);
      EXPECT_EQ(problem.regrouped(b, 1).size(), 0);
    }
  }
}

TYPED_TEST(ScoreKernelTest, CanImplementRejectsEachMismatch) {
  using Scalar = TypeParam;
  const ScoreProblem<Scalar> problem(Shape{}, 760);  // T = 5, S = 7, Eq = 16, Dk = 4
  const auto& weights = problem.c.weights;
  const sdmha::RowMatrix<Scalar> query = sdmha::RowMatrix<Scalar>::Zero(5, 4);
  const sdmha::RowMatrix<Scalar> key = sdmha::RowMatrix<Scalar>::Zero(7, 4);
  const sdmha::RowMatrix<Scalar> narrow_key = sdmha::RowMatrix<Scalar>::Zero(7, 3);
  sdmha::RowMatrix<Scalar> scores(5, 7), wrong_scores(5, 6), tall_scores(6, 7);
  sdmha::BatchMask wrong_mask;
  wrong_mask.causal = true;
  wrong_mask.steps = 5;
  wrong_mask.key_steps = 8;
  sdmha::BatchMask unused_mask;  // empty: its sizes are not looked at
  unused_mask.steps = 99;

  using Arguments = typename Kernel<Scalar>::Arguments;
  const Scalar scale = Scalar(0.5);
  EXPECT_NO_THROW(
      Kernel<Scalar>::can_implement(Arguments{{}, query, key, scale, problem.mask(0), scores}));
  EXPECT_NO_THROW(
      Kernel<Scalar>::can_implement(Arguments{{}, query, key, scale, unused_mask, scores}));
  SDMHA_EXPECT_THROW_WITH(
      Kernel<Scalar>::can_implement(Arguments{{}, query, narrow_key, scale, {}, scores}),
      sdmha::ShapeError,
      "ScoreKernel: query has width 4 but key has width 3; expected equal key_dim");
  SDMHA_EXPECT_THROW_WITH(
      Kernel<Scalar>::can_implement(Arguments{{}, query, key, scale, {}, wrong_scores}),
      sdmha::ShapeError, "scores is 5 x 6; expected 5 x 7");
  SDMHA_EXPECT_THROW_WITH(
      Kernel<Scalar>::can_implement(Arguments{{}, query, key, scale, {}, tall_scores}),
      sdmha::ShapeError, "scores is 6 x 7; expected 5 x 7");
  SDMHA_EXPECT_THROW_WITH(
      Kernel<Scalar>::can_implement(Arguments{{}, query, key, scale, wrong_mask, scores}),
      sdmha::ShapeError, "mask is for 5 x 8; expected 5 x 7");

  using SparseArguments = typename Kernel<Scalar>::SparseArguments;
  const auto rows = problem.query.batch_rows(0);
  const auto kernel = weights.query_kernel.middleCols(0, 4);
  const sdmha::RowMatrix<Scalar> short_kernel = sdmha::RowMatrix<Scalar>::Zero(15, 4);
  const sdmha::Vector<Scalar> bias = weights.query_bias.segment(0, 4),
                              long_bias = sdmha::Vector<Scalar>::Zero(5);
  EXPECT_NO_THROW(Kernel<Scalar>::can_implement(
      SparseArguments{{}, rows, kernel, bias, key, scale, problem.mask(0), scores}));
  EXPECT_NO_THROW(Kernel<Scalar>::can_implement(
      SparseArguments{{}, rows, kernel, problem.no_bias, key, scale, {}, scores}));
  SDMHA_EXPECT_THROW_WITH(
      Kernel<Scalar>::can_implement(
          SparseArguments{{}, rows, short_kernel, bias, key, scale, {}, scores}),
      sdmha::ShapeError,
      "ScoreKernel (sparse): query_kernel has 15 rows; expected the query's feature width 16");
  SDMHA_EXPECT_THROW_WITH(Kernel<Scalar>::can_implement(SparseArguments{
                              {}, rows, kernel, bias, narrow_key, scale, {}, scores}),
                          sdmha::ShapeError,
                          "query_kernel has 4 columns but key has width 3; expected equal");
  SDMHA_EXPECT_THROW_WITH(Kernel<Scalar>::can_implement(
                              SparseArguments{{}, rows, kernel, long_bias, key, scale, {}, scores}),
                          sdmha::ShapeError, "query_bias has 5 entries; expected 0 or 4");
  SDMHA_EXPECT_THROW_WITH(Kernel<Scalar>::can_implement(SparseArguments{
                              {}, rows, kernel, bias, key, scale, {}, wrong_scores}),
                          sdmha::ShapeError, "scores is 5 x 6; expected 5 x 7");
  SDMHA_EXPECT_THROW_WITH(Kernel<Scalar>::can_implement(SparseArguments{
                              {}, problem.query.csr(), kernel, bias, key, scale, {}, scores}),
                          sdmha::ShapeError, "scores is 5 x 7; expected 10 x 7");
  SDMHA_EXPECT_THROW_WITH(Kernel<Scalar>::can_implement(SparseArguments{
                              {}, rows, kernel, bias, key, scale, wrong_mask, scores}),
                          sdmha::ShapeError, "mask is for 5 x 8; expected 5 x 7");
}

}  // namespace
}  // namespace sdmha_test
