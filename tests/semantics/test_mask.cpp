// Tests of sdmha/mask.hpp: BatchMask::allowed and apply_mask against the reference's rule
// (sdmha_reference::allowed) for causal masks with T ≠ S, key masks (true = may attend), attention
// masks and all of them combined; an empty mask changes nothing, and blocked entries become exactly
// −∞.
#include "test_support.hpp"

#include "stage_test.hpp"

#include <cstring>

namespace sdmha_test {
namespace {

SDMHA_SCALAR_TYPED_TEST_SUITE(MaskTest);

struct MaskVariant {
  const char* name;
  long steps, key_steps;
  bool causal, attention, key_mask;
};

const MaskVariant kMaskVariants[] = {
    {"causal_t_gt_s", 7, 4, true, false, false}, {"causal_t_lt_s", 3, 8, true, false, false},
    {"causal_square", 5, 5, true, false, false}, {"key_mask", 5, 7, false, false, true},
    {"attention", 5, 7, false, true, false},     {"attention_key_mask", 6, 3, false, true, true},
    {"all_combined", 6, 9, true, true, true},    {"all_combined_t_gt_s", 9, 4, true, true, true},
};

template <typename Scalar>
Case<Scalar> mask_case(const MaskVariant& variant, std::uint64_t seed) {
  Shape s = Shape{}.sized(3, variant.steps, variant.key_steps);
  s.causal = variant.causal;
  s.random_mask = variant.attention;
  s.key_mask = variant.key_mask;
  return make_case<Scalar>(s, seed);
}

// Batch b's mask, pointed into the case's option tensors as the layer does.
template <typename Scalar>
sdmha::BatchMask batch_mask(const Case<Scalar>& c, long b) {
  sdmha::BatchMask mask;
  mask.steps = c.shape.steps;
  mask.key_steps = c.shape.key_steps;
  mask.causal = c.shape.causal;
  if (c.options.attention_mask.size() != 0)
    mask.attention = c.options.attention_mask.data() + b * c.shape.steps * c.shape.key_steps;
  if (!c.options.key_mask.empty())
    mask.key_mask = c.options.key_mask.data() + b * c.shape.key_steps;
  return mask;
}

bool same_bits(const void* a, const void* b, std::size_t bytes) {
  return std::memcmp(a, b, bytes) == 0;
}

TEST(BatchMaskTest, IsEmptyOnlyWithoutAnyMask) {
  const bool attention[1] = {true};
  const bool key_mask[1] = {true};
  sdmha::BatchMask mask;
  EXPECT_TRUE(mask.empty());
  mask.steps = 4;
  mask.key_steps = 4;
  EXPECT_TRUE(mask.empty());
  mask.causal = true;
  EXPECT_FALSE(mask.empty());
  mask = sdmha::BatchMask{};
  mask.attention = attention;
  EXPECT_FALSE(mask.empty());
  mask = sdmha::BatchMask{};
  mask.key_mask = key_mask;
  EXPECT_FALSE(mask.empty());
  // With no mask every position is allowed.
  EXPECT_TRUE(sdmha::BatchMask{}.allowed(0, 5));
}

// key_mask has attention_mask's polarity: true = the key step may be attended, false blocks it
// for every query step (in allowed and in apply_mask alike).
TEST(BatchMaskTest, KeyMaskTrueAllowsAndFalseBlocks) {
  const bool key_mask[3] = {true, false, true};
  sdmha::BatchMask mask;
  mask.steps = 2;
  mask.key_steps = 3;
  mask.key_mask = key_mask;
  sdmha::RowMatrix<double> scores = sdmha::RowMatrix<double>::Constant(2, 3, 1.5);
  sdmha::apply_mask<double>(mask, scores);
  for (Index t = 0; t < 2; ++t)
    for (Index s = 0; s < 3; ++s) {
      EXPECT_EQ(mask.allowed(t, s), key_mask[s]) << "t " << t << ", s " << s;
      EXPECT_EQ(scores(t, s), key_mask[s] ? 1.5 : -std::numeric_limits<double>::infinity())
          << "t " << t << ", s " << s;
    }
}

TYPED_TEST(MaskTest, AllowedFollowsTheReferenceRule) {
  std::uint64_t seed = 300;
  for (const auto& variant : kMaskVariants) {
    SCOPED_TRACE(variant.name);
    const auto c = mask_case<TypeParam>(variant, seed++);
    Index blocked = 0;
    for (long b = 0; b < c.shape.batch; ++b) {
      const auto mask = batch_mask(c, b);
      EXPECT_FALSE(mask.empty());
      for (long t = 0; t < variant.steps; ++t)
        for (long s = 0; s < variant.key_steps; ++s) {
          const bool expected = sdmha_reference::allowed(c.problem, b, t, s);
          ASSERT_EQ(mask.allowed(t, s), expected) << "b " << b << ", t " << t << ", s " << s;
          blocked += !expected;
        }
    }
    EXPECT_GT(blocked, 0);
  }
}

TYPED_TEST(MaskTest, ApplyMaskBlocksExactlyTheDisallowedEntries) {
  constexpr TypeParam minus_infinity = -std::numeric_limits<TypeParam>::infinity();
  std::uint64_t seed = 310;
  for (const auto& variant : kMaskVariants) {
    SCOPED_TRACE(variant.name);
    const auto c = mask_case<TypeParam>(variant, seed++);
    for (long b = 0; b < c.shape.batch; ++b) {
      const auto original =
          uniform_matrix<TypeParam>(variant.steps, variant.key_steps, 3.0, seed + b);
      sdmha::RowMatrix<TypeParam> scores = original;
      sdmha::apply_mask<TypeParam>(batch_mask(c, b), scores);
      for (long t = 0; t < variant.steps; ++t)
        for (long s = 0; s < variant.key_steps; ++s) {
          if (sdmha_reference::allowed(c.problem, b, t, s))
            ASSERT_EQ(scores(t, s), original(t, s)) << "b " << b << ", t " << t << ", s " << s;
          else
            ASSERT_EQ(scores(t, s), minus_infinity) << "b " << b << ", t " << t << ", s " << s;
        }
    }
  }
}

TYPED_TEST(MaskTest, ApplyMaskWorksOnABlockOfALargerMatrix) {
  constexpr TypeParam minus_infinity = -std::numeric_limits<TypeParam>::infinity();
  const MaskVariant variant{"all_combined", 5, 6, true, true, true};
  const auto c = mask_case<TypeParam>(variant, 320);
  const auto original = uniform_matrix<TypeParam>(9, 11, 3.0, 321);
  sdmha::RowMatrix<TypeParam> big = original;
  const Index row0 = 2, col0 = 3;
  sdmha::apply_mask<TypeParam>(batch_mask(c, 1), big.block(row0, col0, 5, 6));
  for (Index r = 0; r < big.rows(); ++r)
    for (Index k = 0; k < big.cols(); ++k) {
      const bool inside = r >= row0 && r < row0 + 5 && k >= col0 && k < col0 + 6;
      if (inside && !sdmha_reference::allowed(c.problem, 1, r - row0, k - col0))
        ASSERT_EQ(big(r, k), minus_infinity) << r << ", " << k;
      else
        ASSERT_EQ(big(r, k), original(r, k)) << r << ", " << k;
    }
}

// A tile of the (T × S) mask of batch b: rows first_step …, columns first_key_step …, pointing
// into the full mask tensors with the full row stride, as a layer working in tiles does.
TYPED_TEST(MaskTest, TilesOfAMaskFollowTheReferenceAtTheirOffsets) {
  constexpr TypeParam minus_infinity = -std::numeric_limits<TypeParam>::infinity();
  std::uint64_t seed = 340;
  for (const auto& variant : kMaskVariants) {
    SCOPED_TRACE(variant.name);
    const auto c = mask_case<TypeParam>(variant, seed++);
    const long T = variant.steps, S = variant.key_steps;
    for (long b = 0; b < c.shape.batch; ++b)
      for (long first_step = 0; first_step < T; first_step += 2)
        for (long first_key_step = 0; first_key_step < S; first_key_step += 3) {
          const long rows = std::min(3L, T - first_step), cols = std::min(4L, S - first_key_step);
          sdmha::BatchMask mask;
          mask.steps = rows;
          mask.key_steps = cols;
          mask.first_step = first_step;
          mask.first_key_step = first_key_step;
          mask.causal = c.shape.causal;
          if (c.options.attention_mask.size() != 0) {
            mask.attention =
                c.options.attention_mask.data() + (b * T + first_step) * S + first_key_step;
            mask.attention_stride = S;
          }
          if (!c.options.key_mask.empty())
            mask.key_mask = c.options.key_mask.data() + b * S + first_key_step;
          const auto original = uniform_matrix<TypeParam>(rows, cols, 3.0, seed + b);
          sdmha::RowMatrix<TypeParam> scores = original;
          sdmha::apply_mask<TypeParam>(mask, scores);
          for (long t = 0; t < rows; ++t)
            for (long s = 0; s < cols; ++s) {
              const bool expected =
                  sdmha_reference::allowed(c.problem, b, first_step + t, first_key_step + s);
              SCOPED_TRACE(::testing::Message() << "b " << b << ", step " << first_step + t
                                                << ", key step " << first_key_step + s);
              ASSERT_EQ(mask.allowed(t, s), expected);
              ASSERT_EQ(scores(t, s), expected ? original(t, s) : minus_infinity);
            }
        }
  }
}

TYPED_TEST(MaskTest, AnEmptyMaskLeavesScoresUntouched) {
  auto scores = uniform_matrix<TypeParam>(4, 6, 3.0, 330);
  scores(1, 2) = std::numeric_limits<TypeParam>::quiet_NaN();
  scores(3, 5) = std::numeric_limits<TypeParam>::infinity();
  scores(0, 0) = -std::numeric_limits<TypeParam>::infinity();
  const sdmha::RowMatrix<TypeParam> original = scores;
  // An empty mask is not checked against the shape: it has nothing to apply.
  sdmha::apply_mask<TypeParam>(sdmha::BatchMask{}, scores);
  EXPECT_TRUE(
      same_bits(scores.data(), original.data(), sizeof(TypeParam) * std::size_t(scores.size())));
}

TYPED_TEST(MaskTest, NonFiniteScoresAtBlockedPositionsBecomeMinusInfinity) {
  constexpr TypeParam minus_infinity = -std::numeric_limits<TypeParam>::infinity();
  const TypeParam poison[] = {std::numeric_limits<TypeParam>::quiet_NaN(),
                              std::numeric_limits<TypeParam>::infinity(),
                              -std::numeric_limits<TypeParam>::quiet_NaN()};
  for (const TypeParam value : poison) {
    sdmha::RowMatrix<TypeParam> scores = sdmha::RowMatrix<TypeParam>::Constant(5, 3, value);
    sdmha::BatchMask mask;
    mask.causal = true;
    mask.steps = 5;
    mask.key_steps = 3;
    sdmha::apply_mask<TypeParam>(mask, scores);
    for (Index t = 0; t < 5; ++t)
      for (Index s = 0; s < 3; ++s) {
        if (s > t)
          EXPECT_EQ(scores(t, s), minus_infinity) << t << ", " << s;
        else
          EXPECT_TRUE(same_bits(&scores(t, s), &value, sizeof(TypeParam))) << t << ", " << s;
      }
  }
}

TYPED_TEST(MaskTest, ApplyMaskAssertsThatTheShapesAgree) {
  sdmha::RowMatrix<TypeParam> scores = sdmha::RowMatrix<TypeParam>::Zero(4, 5);
  sdmha::BatchMask mask;
  mask.causal = true;
  mask.steps = 4;
  mask.key_steps = 6;
  EXPECT_THROW(sdmha::apply_mask<TypeParam>(mask, scores), std::logic_error);
}

}  // namespace
}  // namespace sdmha_test
