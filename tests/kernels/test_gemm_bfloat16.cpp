// Tests of sdmha/detail/gemm_bfloat16.hpp and of the kernel_bfloat16 path of DenseProjection and
// OutputProjection: BFloat16Kernel holds each weight rounded to the nearest bfloat16 (ties to
// even, NaN and infinities kept, the padding half of an odd depth zero); gemm_bfloat16 stays
// within (2⁻⁷ + 2⁻¹⁶ + (k + 1)·2⁻²⁴)·Σ|A·W| of a float64 product of the float inputs and within
// float32 summation error of a float64 product of the rounded ones, and differs from the float32
// engine (it really rounds); both the vdpbf16ps path and the portable loop take the sums of each
// depth block added to C, bit for bit; a row block of C is bitwise the same rows of a larger
// product, with or without scratch and on strided operands; the projections add the bias and read
// the bfloat16 kernel, and can_implement refuses a wrong one. With both operands rounded
// (gemm_bfloat16_operands, the scores and P·V of the bfloat16 mode), the pair packers agree with
// their portable forms and the kernel's layout, and the product is the kernel product of the
// rounded operands. On the AMX tiles (gemm_amx.hpp): the emulation takes the model's sums in
// TDPBF16PS's order bit for bit, the CPU's tiles (where usable) stay within the same bounds, and
// both keep the bias, row-block and stride invariants; kernels handed to them serve the
// projections, and the operands' form the scores and P·V. In a build with oneDNN, a kernel handed
// to it: the same bounds, on the calling thread alone, AMX where usable.
#include "test_support.hpp"

#include <cstring>
#include <filesystem>
#include <thread>

#include <sdmha/detail/attention_plan.hpp>
#include <sdmha/detail/gemm.hpp>
#include <sdmha/detail/gemm_amx.hpp>
#include <sdmha/detail/gemm_bfloat16.hpp>
#include <sdmha/detail/gemm_onednn.hpp>
#include <sdmha/detail/scratch.hpp>
#include <sdmha/stages/dense_projection.hpp>
#include <sdmha/stages/output_projection.hpp>

namespace sdmha_test {
namespace {

using sdmha::RowMatrix;
using sdmha::detail::BFloat16Kernel;
using sdmha::detail::gemm_bfloat16;
using sdmha::detail::gemm_bfloat16_portable;
using FloatMatrix = RowMatrix<float>;
using DoubleMatrix = RowMatrix<double>;

// Relative error of one product of two operands each rounded to bfloat16: 8 significant bits
// give a unit roundoff of 2⁻⁸ per operand (half the spacing 2⁻⁷ of [1, 2)), so under 2⁻⁷ for
// the product — e.g. 1 + 2⁻⁸ + ε rounds up to 1 + 2⁻⁷, a relative error of almost 2⁻⁸ alone.
constexpr double kProductRounding = 1.0 / 128.0;
// float32's unit roundoff; a sum of k terms onto C carries at most (k + 1) of it per term.
constexpr double kSumRounding = 1.0 / 16777216.0;

FloatMatrix normal_matrix(Index rows, Index cols, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  FloatMatrix matrix(rows, cols);
  for (Index i = 0; i < matrix.size(); ++i) matrix.data()[i] = normal(rng);
  return matrix;
}

FloatMatrix nan_matrix(Index rows, Index cols) {
  return FloatMatrix::Constant(rows, cols, std::numeric_limits<float>::quiet_NaN());
}

std::uint32_t bits_of(float x) { return Eigen::numext::bit_cast<std::uint32_t>(x); }
float from_bits(std::uint32_t bits) { return Eigen::numext::bit_cast<float>(bits); }
float to_bfloat16(float x) { return float(Eigen::bfloat16(x)); }
std::uint32_t bfloat16_pattern(float x) {
  return Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(x));
}

// Entries of two equally shaped matrices whose bit patterns differ.
Index differing_bits(const FloatMatrix& x, const FloatMatrix& y) {
  Index count = 0;
  for (Index i = 0; i < x.size(); ++i) count += bits_of(x.data()[i]) != bits_of(y.data()[i]);
  return count;
}

// C0 (or 0) + A·W in float64, and the magnitudes Σ_p |A(i, p)·W(p, j)| + |C0(i, j)|; with
// `round`, of the operands rounded to bfloat16. A product of two floats is exact in double.
struct Reference {
  DoubleMatrix value, magnitude;
};

Reference reference_product(const FloatMatrix& a, const FloatMatrix& w, const FloatMatrix* c0,
                            bool round) {
  const Index m = a.rows(), n = w.cols(), k = a.cols();
  Reference ref{DoubleMatrix::Zero(m, n), DoubleMatrix::Zero(m, n)};
  if (c0 != nullptr) {
    ref.value = c0->cast<double>();
    ref.magnitude = ref.value.cwiseAbs();
  }
  for (Index i = 0; i < m; ++i)
    for (Index p = 0; p < k; ++p) {
      const double x = round ? to_bfloat16(a(i, p)) : a(i, p);
      for (Index j = 0; j < n; ++j) {
        const double term = x * double(round ? to_bfloat16(w(p, j)) : w(p, j));
        ref.value(i, j) += term;
        ref.magnitude(i, j) += std::abs(term);
      }
    }
  return ref;
}

// Entries of C outside |C − value| ≤ relative · magnitude; `worst` gets the largest
// |C − value| / magnitude seen.
Index entries_outside(const FloatMatrix& c, const Reference& ref, double relative, double* worst) {
  Index count = 0;
  *worst = 0.0;
  for (Index i = 0; i < c.rows(); ++i)
    for (Index j = 0; j < c.cols(); ++j) {
      const double error = std::abs(double(c(i, j)) - ref.value(i, j));
      if (!(error <= relative * ref.magnitude(i, j))) ++count;
      if (ref.magnitude(i, j) > 0) *worst = std::max(*worst, error / ref.magnitude(i, j));
    }
  return count;
}

// gemm_bfloat16 onto a copy of `start`, with its planned scratch or none (it then allocates).
FloatMatrix run_gemm(const sdmha::ConstMatrixRef<float>& a, const BFloat16Kernel& w,
                     const FloatMatrix& start, bool accumulate, bool with_scratch = true) {
  FloatMatrix c = start;
  sdmha::detail::ScratchBuffer buffer;
  if (with_scratch)
    buffer.reserve(sdmha::detail::gemm_bfloat16_workspace_size(a.rows(), w.cols(), a.cols()));
  gemm_bfloat16(a, w, c, accumulate, with_scratch ? buffer.view() : sdmha::StageScratch{});
  return c;
}

FloatMatrix run_portable(const FloatMatrix& a, const BFloat16Kernel& w, const FloatMatrix& start,
                         bool accumulate) {
  FloatMatrix c = start;
  gemm_bfloat16_portable(a, w, c, accumulate);
  return c;
}

struct GemmCase {
  Index m, n, k;
  bool accumulate;
};

std::string describe(const GemmCase& c) {
  return std::to_string(c.m) + " x " + std::to_string(c.n) + " x " + std::to_string(c.k) +
         (c.accumulate ? " accumulate" : "");
}

// m, n, k = 1; odd k; k past one depth block (512) and an exact block; n off the 16 and 32
// lanes; m past one row block (256) and off the 14-row micro-tiles.
const std::vector<GemmCase>& gemm_cases() {
  static const std::vector<GemmCase> cases = {
      {1, 1, 1, false},     {1, 1, 1, true},       {1, 45, 77, false},   {14, 32, 1, false},
      {15, 33, 2, true},    {5, 17, 77, true},     {13, 16, 33, false},  {29, 45, 513, false},
      {3, 33, 513, true},   {40, 17, 1100, false}, {257, 64, 512, true}, {300, 17, 512, false},
      {600, 33, 77, false}, {600, 45, 1100, true}};
  return cases;
}

// A case's operands from a generator of its own, drawn in this order: A (m × k) and W (k × n)
// normal, and C's starting value normal where the case accumulates onto it, NaN (never read)
// where it does not.
struct Operands {
  FloatMatrix a, w, start;
};

Operands random_operands(const GemmCase& c, std::uint32_t seed) {
  std::mt19937 rng(seed);
  Operands operands;
  operands.a = normal_matrix(c.m, c.k, rng);
  operands.w = normal_matrix(c.k, c.n, rng);
  operands.start = c.accumulate ? normal_matrix(c.m, c.n, rng) : nan_matrix(c.m, c.n);
  return operands;
}

TEST(BFloat16GemmKernel, EntriesAreTheWeightsRoundedAndPackedInPairs) {
  std::mt19937 rng(7100);
  for (const Index k : {1, 2, 77, 512, 513}) {
    SCOPED_TRACE(::testing::Message() << "k = " << k);
    const FloatMatrix w = normal_matrix(k, 45, rng);
    const BFloat16Kernel kernel(w);
    ASSERT_EQ(kernel.rows(), k);
    ASSERT_EQ(kernel.cols(), 45);
    ASSERT_EQ(kernel.pairs().rows(), (k + 1) / 2);
    ASSERT_EQ(kernel.pairs().cols(), 45);
    Index wrong_entries = 0, wrong_pairs = 0;
    for (Index i = 0; i < k; ++i)
      for (Index j = 0; j < 45; ++j)
        wrong_entries += bits_of(kernel(i, j)) != bits_of(to_bfloat16(w(i, j)));
    for (Index p = 0; p < kernel.pairs().rows(); ++p)
      for (Index j = 0; j < 45; ++j) {
        const std::uint32_t high = 2 * p + 1 < k ? bfloat16_pattern(w(2 * p + 1, j)) : 0u;
        wrong_pairs += kernel.pairs()(p, j) != (bfloat16_pattern(w(2 * p, j)) | high << 16);
      }
    EXPECT_EQ(wrong_entries, 0);
    EXPECT_EQ(wrong_pairs, 0);
  }
}

TEST(BFloat16GemmKernel, TiesRoundToEvenAndSpecialValuesSurvive) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  // (input bits, expected bits of the rounded float): 1 + 2⁻⁸ lies halfway between 1 and
  // 1 + 2⁻⁷ and goes to the even 1; 1 + 3·2⁻⁸ halfway between 1 + 2⁻⁷ and 1 + 2⁻⁶ goes up
  // to the even 1 + 2⁻⁶; one ulp either side of a tie goes to the nearer; the largest float is
  // nearer 2¹²⁸ than the largest bfloat16 and overflows to infinity.
  const std::vector<std::pair<std::uint32_t, std::uint32_t>> cases = {
      {0x3F808000u, 0x3F800000u},   {0x3F818000u, 0x3F820000u},     {0xBF808000u, 0xBF800000u},
      {0x3F808001u, 0x3F810000u},   {0x3F807FFFu, 0x3F800000u},     {0x7F7FFFFFu, 0x7F800000u},
      {bits_of(inf), bits_of(inf)}, {bits_of(-inf), bits_of(-inf)}, {0x80000000u, 0x80000000u}};
  const Index k = Index(cases.size()) + 2;  // odd, with two NaNs last
  ASSERT_EQ(k % 2, 1);
  FloatMatrix w(k, 2);
  for (Index i = 0; i < Index(cases.size()); ++i) {
    w(i, 0) = from_bits(cases[std::size_t(i)].first);
    w(i, 1) = -w(i, 0);
  }
  w.row(k - 2).setConstant(std::numeric_limits<float>::quiet_NaN());
  w.row(k - 1).setConstant(-std::numeric_limits<float>::signaling_NaN());
  const BFloat16Kernel kernel(w);
  for (Index i = 0; i < Index(cases.size()); ++i) {
    EXPECT_EQ(bits_of(kernel(i, 0)), cases[std::size_t(i)].second) << "row " << i;
    EXPECT_EQ(bits_of(kernel(i, 1)), cases[std::size_t(i)].second ^ 0x80000000u) << "row " << i;
  }
  for (Index j = 0; j < 2; ++j) {
    EXPECT_TRUE(std::isnan(kernel(k - 2, j)));
    EXPECT_TRUE(std::isnan(kernel(k - 1, j)));
    EXPECT_EQ(kernel.pairs()(k / 2, j) >> 16, 0u) << "the padding half of the last pair";
  }
}

TEST(BFloat16Gemm, WithinTheBoundOfTheFloatProductAndRoundsReally) {
  std::uint32_t seed = 7200;
  for (const GemmCase& c : gemm_cases()) {
    SCOPED_TRACE(describe(c));
    const auto [a, w, start] = random_operands(c, seed++);
    const FloatMatrix* c0 = c.accumulate ? &start : nullptr;
    const FloatMatrix result = run_gemm(a, BFloat16Kernel(w), start, c.accumulate);
    const double summation = double(c.k + 1) * kSumRounding;
    double worst = 0.0;
    EXPECT_EQ(entries_outside(result, reference_product(a, w, c0, false),
                              kProductRounding + summation, &worst),
              0)
        << "worst |C - A.W| / sum |A.W| = " << worst;
    EXPECT_EQ(entries_outside(result, reference_product(a, w, c0, true), summation, &worst), 0)
        << "worst error against the rounded operands' product: " << worst;
    FloatMatrix float32 = c.accumulate ? start : FloatMatrix::Zero(c.m, c.n);
    sdmha::detail::gemm<float>(sdmha::detail::as_operand<float>(a),
                               sdmha::detail::as_operand<float>(w), float32, 1.0f, c.accumulate,
                               sdmha::StageScratch{});
    EXPECT_GT(differing_bits(result, float32), 0) << "the same bits as the float32 engine";
  }
}

TEST(BFloat16Gemm, EmptyDepthGivesZeroOrLeavesC) {
  std::mt19937 rng(7300);
  const FloatMatrix a(4, 0), w(0, 5);
  const BFloat16Kernel kernel(w);
  const FloatMatrix start = normal_matrix(4, 5, rng);
  EXPECT_EQ(differing_bits(run_gemm(a, kernel, start, false), FloatMatrix::Zero(4, 5)), 0);
  EXPECT_EQ(differing_bits(run_gemm(a, kernel, start, true), start), 0);
}

// A column bias is added in the first depth block's stores (both paths: the portable one sets C
// to it and accumulates): bitwise C = bias in every row with the product accumulated onto it, on
// the n edges, one and several depth blocks, and k = 0.
TEST(BFloat16Gemm, ColumnBiasIsBitwiseTheBiasAccumulatedOnto) {
  std::mt19937 rng(7350);
  for (const GemmCase& c : gemm_cases()) {
    SCOPED_TRACE(describe(c));
    const FloatMatrix a = normal_matrix(c.m, c.k, rng), w = normal_matrix(c.k, c.n, rng);
    const std::vector<float> bias = [&] {
      const FloatMatrix row = normal_matrix(1, c.n, rng);
      return std::vector<float>(row.data(), row.data() + c.n);  // exactly n entries
    }();
    const BFloat16Kernel kernel(w);
    FloatMatrix onto(c.m, c.n);
    for (Index i = 0; i < c.m; ++i) std::copy(bias.begin(), bias.end(), onto.row(i).data());
    FloatMatrix fused = nan_matrix(c.m, c.n);
    sdmha::detail::ScratchBuffer buffer;
    buffer.reserve(sdmha::detail::gemm_bfloat16_workspace_size(c.m, c.n, c.k));
    gemm_bfloat16(a, kernel, fused, false, buffer.view(), bias.data());
    EXPECT_EQ(differing_bits(fused, run_gemm(a, kernel, onto, true)), 0);
  }
  const FloatMatrix empty_a(3, 0), empty_w(0, 4);
  const std::vector<float> bias = {1.0f, -2.0f, 3.0f, 0.5f};
  FloatMatrix fused = nan_matrix(3, 4), expected(3, 4);
  for (Index i = 0; i < 3; ++i) std::copy(bias.begin(), bias.end(), expected.row(i).data());
  gemm_bfloat16(empty_a, BFloat16Kernel(empty_w), fused, false, {}, bias.data());
  EXPECT_EQ(differing_bits(fused, expected), 0) << "k = 0: C is the bias";
}

// The sums the vdpbf16ps path takes: k cut into depth blocks of `depth` (k alone decides it),
// each summed from zero pair by pair (the odd row's product first, then the even row's: the SDM's
// order within one vdpbf16ps lane; the even one first with `even_first`, TDPBF16PS's order) and
// then added to C, or stored for the first block without accumulation. Each product of two
// bfloat16 values is exact in float.
FloatMatrix blocked_sums(const FloatMatrix& a, const BFloat16Kernel& w, const FloatMatrix& start,
                         bool accumulate, Index depth, bool even_first = false) {
  const Index m = a.rows(), n = w.cols(), k = a.cols();
  FloatMatrix c = start;
  std::vector<float> acc(static_cast<std::size_t>(n));
  for (Index i = 0; i < m; ++i)
    for (Index p0 = 0; p0 < k; p0 += depth) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (Index p = p0 / 2; p < (std::min(p0 + depth, k) + 1) / 2; ++p) {
        const float odd = 2 * p + 1 < k ? to_bfloat16(a(i, 2 * p + 1)) : 0.0f;
        const float even = to_bfloat16(a(i, 2 * p));
        for (Index j = 0; j < n; ++j) {
          const float odd_term = odd * (2 * p + 1 < k ? w(2 * p + 1, j) : 0.0f);
          if (even_first) acc[std::size_t(j)] += even * w(2 * p, j);
          acc[std::size_t(j)] += odd_term;
          if (!even_first) acc[std::size_t(j)] += even * w(2 * p, j);
        }
      }
      for (Index j = 0; j < n; ++j)
        c(i, j) = p0 == 0 && !accumulate ? acc[std::size_t(j)] : c(i, j) + acc[std::size_t(j)];
    }
  return c;
}

// Both paths take the model's sums: the portable loop everywhere (it is the path of builds
// without AVX512_BF16), the vdpbf16ps path where the build has it — which shows this CPU adds a
// lane's odd-row product before its even-row one, the order Intel's manual gives.
TEST(BFloat16Gemm, BothPathsSumEachDepthBlockAndAddItToC) {
  std::uint32_t seed = 7450;
  for (const GemmCase& c : gemm_cases()) {
    SCOPED_TRACE(describe(c));
    const auto [a, w, start] = random_operands(c, seed++);
    const BFloat16Kernel kernel(w);
    const FloatMatrix expected =
        blocked_sums(a, kernel, start, c.accumulate, sdmha::detail::bf16_gemm::depth_block(c.k));
    EXPECT_EQ(differing_bits(run_portable(a, kernel, start, c.accumulate), expected), 0);
    if (sdmha::detail::kHaveBFloat16Gemm) {
      EXPECT_EQ(differing_bits(run_gemm(a, kernel, start, c.accumulate), expected), 0);
    }
  }
}

TEST(BFloat16Gemm, RowBlocksScratchAndStridesDoNotChangeTheBits) {
  std::mt19937 rng(7500);
  const Index m = 700, n = 45, k = 1100;
  const FloatMatrix a = normal_matrix(m, k, rng), w = normal_matrix(k, n, rng);
  const BFloat16Kernel kernel(w);
  const FloatMatrix whole = run_gemm(a, kernel, nan_matrix(m, n), false);
  EXPECT_EQ(differing_bits(run_gemm(a, kernel, nan_matrix(m, n), false, false), whole), 0)
      << "without scratch";
  EXPECT_EQ(differing_bits(run_gemm(a, kernel, nan_matrix(m, n), false), whole), 0) << "again";
  for (const auto& rows : std::vector<std::pair<Index, Index>>{{256, 256}, {0, 1}, {600, 100}}) {
    SCOPED_TRACE(::testing::Message() << "rows " << rows.first << " + " << rows.second);
    const FloatMatrix part =
        run_gemm(a.middleRows(rows.first, rows.second), kernel, nan_matrix(rows.second, n), false);
    EXPECT_EQ(differing_bits(part, whole.middleRows(rows.first, rows.second)), 0);
  }
  // A and C as blocks of wider matrices (outer stride ≠ columns); C's margin stays untouched.
  FloatMatrix wide_a = normal_matrix(m, k + 7, rng);
  wide_a.middleCols(3, k) = a;
  FloatMatrix wide_c = FloatMatrix::Constant(m, n + 5, -555.0f);
  sdmha::detail::ScratchBuffer buffer;
  buffer.reserve(sdmha::detail::gemm_bfloat16_workspace_size(m, n, k));
  gemm_bfloat16(wide_a.middleCols(3, k), kernel, wide_c.middleCols(2, n), false, buffer.view());
  EXPECT_EQ(differing_bits(wide_c.middleCols(2, n), whole), 0) << "strided";
  EXPECT_TRUE((wide_c.leftCols(2).array() == -555.0f).all());
  EXPECT_TRUE((wide_c.rightCols(3).array() == -555.0f).all());
}

// The projection stages: Y = bias (or 0) + gemm_bfloat16(X, kernel_bfloat16), bitwise.
template <typename Stage>
void check_projection_reads_the_bfloat16_kernel(std::uint32_t seed) {
  std::mt19937 rng(seed);
  const Index rows = 37, in = 77, out = 45;
  const FloatMatrix x = normal_matrix(rows, in, rng), w = normal_matrix(in, out, rng);
  const sdmha::Vector<float> bias = normal_matrix(out, 1, rng);
  const BFloat16Kernel kernel(w);
  sdmha::TileSizes sizes;
  sizes.rows = rows;
  sizes.input_width = in;
  sizes.output_width = out;
  sdmha::detail::ScratchBuffer buffer;
  buffer.reserve(Stage::workspace_size(sizes));
  for (const bool with_bias : {true, false}) {
    SCOPED_TRACE(with_bias ? "bias" : "no bias");
    const sdmha::Vector<float> b = with_bias ? bias : sdmha::Vector<float>();
    FloatMatrix y = nan_matrix(rows, out), float32 = nan_matrix(rows, out);
    typename Stage::Arguments args{x, w, b, y, buffer.view(), &kernel};
    Stage::can_implement(args);
    Stage{}(args);
    FloatMatrix expected = FloatMatrix::Zero(rows, out);
    if (with_bias) expected.rowwise() = bias.transpose();
    gemm_bfloat16(x, kernel, expected, with_bias, sdmha::StageScratch{});
    EXPECT_EQ(differing_bits(y, expected), 0);
    typename Stage::Arguments plain{x, w, b, float32, buffer.view()};
    Stage{}(plain);
    EXPECT_GT(differing_bits(y, float32), 0) << "kernel_bfloat16 not read";
  }
}

template <typename Stage>
void check_projection_refuses_a_wrong_bfloat16_kernel(const char* stage_name) {
  std::mt19937 rng(7600);
  const FloatMatrix x = normal_matrix(5, 6, rng), w = normal_matrix(6, 4, rng);
  const sdmha::Vector<float> bias = normal_matrix(4, 1, rng);
  FloatMatrix y(5, 4);
  const BFloat16Kernel short_kernel(normal_matrix(5, 4, rng)), narrow(normal_matrix(6, 3, rng));
  const typename Stage::Arguments too_short{x, w, bias, y, {}, &short_kernel};
  SDMHA_EXPECT_THROW_WITH(Stage::can_implement(too_short), sdmha::ShapeError,
                          "kernel_bfloat16 is 5 x 4; expected the kernel's 6 x 4");
  SDMHA_EXPECT_THROW_WITH(Stage::can_implement(too_short), sdmha::ShapeError, stage_name);
  const typename Stage::Arguments too_narrow{x, w, bias, y, {}, &narrow};
  SDMHA_EXPECT_THROW_WITH(Stage::can_implement(too_narrow), sdmha::ShapeError,
                          "kernel_bfloat16 is 6 x 3");
}

template <typename Stage>
void check_double_stage_refuses_a_bfloat16_kernel() {
  std::mt19937 rng(7700);
  const FloatMatrix w = normal_matrix(6, 4, rng);
  const BFloat16Kernel kernel(w);  // the right shape: only the scalar type is wrong
  const DoubleMatrix x = normal_matrix(5, 6, rng).cast<double>();
  const DoubleMatrix w64 = w.cast<double>();
  const sdmha::Vector<double> no_bias;
  DoubleMatrix y(5, 4);
  const typename Stage::Arguments args{x, w64, no_bias, y, {}, &kernel};
  SDMHA_EXPECT_THROW_WITH(Stage::can_implement(args), sdmha::ConfigError, "kernel_bfloat16");
}

// ---- both operands rounded: the scores and P·V of the bfloat16 mode --------------------------

// pack_row_pairs and pack_column_pairs (vcvtneps2bf16 where the build has it) give the portable
// forms' bits on normal-range values, on strided sources and odd sizes around the 16-row and
// 32-column steps; the row form is BFloat16Kernel's layout, and the column form packs Mᵀ as
// the row form does.
TEST(BFloat16Operands, PackersAreThePortableFormsAndTheKernelLayout) {
  using namespace sdmha::detail;
  std::mt19937 rng(7900);
  for (const auto& [rows, cols] : std::vector<std::pair<Index, Index>>{
           {1, 1}, {2, 3}, {7, 16}, {16, 32}, {17, 33}, {40, 64}, {33, 50}, {128, 5}}) {
    SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols));
    const FloatMatrix source = normal_matrix(rows, cols + 3, rng);
    const auto m = source.leftCols(cols);  // leading dimension cols + 3
    const Index row_pairs = (rows + 1) / 2, column_pairs = (cols + 1) / 2;
    std::vector<std::uint32_t> fast(std::size_t(row_pairs * (cols + 1)), 7u), portable = fast;
    pack_row_pairs(m.data(), m.outerStride(), rows, cols, fast.data(), cols + 1);
    pack_row_pairs_portable(m.data(), m.outerStride(), rows, cols, portable.data(), cols + 1);
    EXPECT_EQ(fast, portable);
    const BFloat16Kernel kernel{FloatMatrix(m)};
    for (Index p = 0; p < row_pairs; ++p)
      for (Index j = 0; j < cols; ++j)
        EXPECT_EQ(fast[std::size_t(p * (cols + 1) + j)], kernel.pairs()(p, j));
    EXPECT_EQ(fast[std::size_t(cols)], 7u);  // the stride's slack is not written

    std::vector<std::uint32_t> columns(std::size_t(column_pairs * (rows + 2)), 7u),
        columns_portable = columns;
    pack_column_pairs(m.data(), m.outerStride(), rows, cols, columns.data(), rows + 2);
    pack_column_pairs_portable(m.data(), m.outerStride(), rows, cols, columns_portable.data(),
                               rows + 2);
    EXPECT_EQ(columns, columns_portable);
    const BFloat16Kernel transposed_kernel{FloatMatrix(m.transpose())};
    for (Index p = 0; p < column_pairs; ++p)
      for (Index s = 0; s < rows; ++s)
        EXPECT_EQ(columns[std::size_t(p * (rows + 2) + s)], transposed_kernel.pairs()(p, s));
  }
}

// C (+)= bf16(scale·A)·bf16(op(B)) through gemm_bfloat16_operands on `engine`, over the edge
// cases and both forms of op(B): bitwise `product`(scale·A, op(B), start, accumulate) with the
// planned scratch or none; within float32's summation error of the float64 product of the
// rounded operands, and within the bfloat16 bound of the unrounded one.
template <typename Product>
void expect_the_operands_product(std::uint32_t seed, sdmha::BFloat16Operands engine,
                                 const Product& product) {
  using namespace sdmha::detail;
  std::mt19937 rng(seed);
  for (const GemmCase& c : gemm_cases()) {
    for (const bool transpose : {false, true}) {
      SCOPED_TRACE(describe(c) + (transpose ? " B transposed" : ""));
      const float scale = 0.37f;
      const FloatMatrix a = normal_matrix(c.m, c.k, rng), start = normal_matrix(c.m, c.n, rng);
      const FloatMatrix b = transpose ? normal_matrix(c.n, c.k, rng) : normal_matrix(c.k, c.n, rng);
      const FloatMatrix op_b = transpose ? FloatMatrix(b.transpose()) : b;
      FloatMatrix c_planned = start, c_unplanned = start;
      ScratchBuffer buffer;
      buffer.reserve(bfloat16_operands_workspace_size(c.m, c.n, c.k));
      gemm_bfloat16_operands(a, b, transpose, c_planned, c.accumulate, buffer.view(), scale,
                             engine);
      gemm_bfloat16_operands(a, b, transpose, c_unplanned, c.accumulate, {}, scale, engine);
      const FloatMatrix scaled_a = a * scale;
      const FloatMatrix expected = product(scaled_a, op_b, start, c.accumulate);
      EXPECT_EQ(differing_bits(c_planned, expected), 0);
      EXPECT_EQ(differing_bits(c_unplanned, expected), 0);
      double worst = 0.0;
      const FloatMatrix* c0 = c.accumulate ? &start : nullptr;
      EXPECT_EQ(entries_outside(c_planned, reference_product(scaled_a, op_b, c0, true),
                                (c.k + 1) * kSumRounding, &worst),
                0)
          << "worst " << worst;
      EXPECT_EQ(entries_outside(c_planned, reference_product(scaled_a, op_b, c0, false),
                                kProductRounding + 1.0 / 65536 + (c.k + 1) * kSumRounding, &worst),
                0)
          << "worst " << worst;
    }
  }
}

// On the pairs engine: gemm_bfloat16 of scale·A on BFloat16Kernel(op(B)).
TEST(BFloat16Operands, ProductIsTheKernelProductOfTheRoundedOperands) {
  expect_the_operands_product(
      7910, true,
      [](const FloatMatrix& a, const FloatMatrix& w, const FloatMatrix& start, bool accumulate) {
        return run_gemm(a, BFloat16Kernel(w), start, accumulate);
      });
}

TEST(DenseProjectionBFloat16, OutputIsBiasPlusTheBFloat16Product) {
  check_projection_reads_the_bfloat16_kernel<sdmha::DenseProjection<float>>(7800);
}
TEST(OutputProjectionBFloat16, OutputIsBiasPlusTheBFloat16Product) {
  check_projection_reads_the_bfloat16_kernel<sdmha::OutputProjection<float>>(7810);
}
TEST(DenseProjectionBFloat16, CanImplementRefusesAKernelOfAnotherShape) {
  check_projection_refuses_a_wrong_bfloat16_kernel<sdmha::DenseProjection<float>>(
      "DenseProjection");
}
TEST(OutputProjectionBFloat16, CanImplementRefusesAKernelOfAnotherShape) {
  check_projection_refuses_a_wrong_bfloat16_kernel<sdmha::OutputProjection<float>>(
      "OutputProjection");
}
TEST(DenseProjectionBFloat16, DoubleStageRefusesABFloat16Kernel) {
  check_double_stage_refuses_a_bfloat16_kernel<sdmha::DenseProjection<double>>();
}
TEST(OutputProjectionBFloat16, DoubleStageRefusesABFloat16Kernel) {
  check_double_stage_refuses_a_bfloat16_kernel<sdmha::OutputProjection<double>>();
}

// ---- the AMX tiles (detail/gemm_amx.hpp): their emulation on every machine, the CPU's own where
// AMX is usable ----------------------------------------------------------------------------------

using sdmha::detail::amx::EmulatedTiles;

// C (+)= bf16(A)·W̃ (+ bias) on Tiles, with W̃ = BFloat16Kernel(w) padded for the tiles and a
// panel of the planned size.
template <class Tiles>
FloatMatrix run_tiles(const sdmha::ConstMatrixRef<float>& a, const FloatMatrix& w,
                      const FloatMatrix& start, bool accumulate, const float* bias = nullptr) {
  using namespace sdmha::detail;
  const BFloat16Kernel kernel(w);
  BFloat16Kernel::Pairs padded = BFloat16Kernel::Pairs::Zero(amx::padded_pair_rows(kernel.rows()),
                                                             amx::padded_columns(kernel.cols()));
  padded.topLeftCorner(kernel.pairs().rows(), kernel.cols()) = kernel.pairs();
  std::vector<std::uint16_t> panel(rounded_block_bytes(a.rows(), a.cols()) / 2);
  FloatMatrix c = start;
  gemm_amx<Tiles>(a, BFloat16Pairs{padded.data(), w.rows(), w.cols(), padded.cols()}, c, accumulate,
                  bias, 1.f, panel.data());
  return c;
}

// The CPU's tiles where Linux grants them; the reason to skip elsewhere.
#define SDMHA_SKIP_WITHOUT_AMX()                                                         \
  if (!sdmha::detail::amx_bfloat16_usable())                                             \
  GTEST_SKIP() << "no AMX here (CPU AMX-BF16 " << sdmha::detail::cpu_features().amx_bf16 \
               << "): the emulated tiles' tests cover the code around the instructions"

// The emulated TDPBF16PS reads a subnormal bfloat16 as zero and flushes a subnormal sum to zero:
// (2⁻¹³⁰ · 1) contributes nothing, and 2⁻⁶⁴ · 2⁻⁶⁴ = 2⁻¹²⁸ (normal operands) is flushed.
TEST(AmxTiles, EmulationReadsAndWritesSubnormalsAsZero) {
  const float subnormal = std::ldexp(1.0f, -130), tiny = std::ldexp(1.0f, -64);
  for (const auto& [x, y] : {std::pair<float, float>{subnormal, 1.0f}, {tiny, tiny}}) {
    const FloatMatrix a = FloatMatrix::Constant(1, 1, x), w = FloatMatrix::Constant(1, 1, y);
    const FloatMatrix c = run_tiles<EmulatedTiles>(a, w, nan_matrix(1, 1), false);
    EXPECT_EQ(bits_of(c(0, 0)), 0u) << x << " x " << y;
  }
}

// On every edge case: the emulation's sums are the model's in the intrinsics guide's order (per
// depth block, pair by pair, the even row's product first), bit for bit; the CPU's tiles are
// within the bounds of the pairs engine (summation of the rounded operands' product; bfloat16's
// bound of the float one), with the bias added once where there is one. Never bit for bit
// against the emulation: the SDM sums even and odd products apart, so the hardware's last bits
// may differ.
template <class Tiles>
void expect_tiles_within_the_bounds(std::uint32_t seed, bool bitwise_model) {
  for (const GemmCase& c : gemm_cases()) {
    SCOPED_TRACE(describe(c));
    const auto [a, w, start] = random_operands(c, seed++);
    const FloatMatrix result = run_tiles<Tiles>(a, w, start, c.accumulate);
    if (bitwise_model) {
      const FloatMatrix expected = blocked_sums(a, BFloat16Kernel(w), start, c.accumulate,
                                                sdmha::detail::bf16_gemm::depth_block(c.k), true);
      EXPECT_EQ(differing_bits(result, expected), 0);
    }
    const FloatMatrix* c0 = c.accumulate ? &start : nullptr;
    const double summation = double(c.k + 1) * kSumRounding;
    double worst = 0.0;
    EXPECT_EQ(entries_outside(result, reference_product(a, w, c0, true), summation, &worst), 0)
        << "worst error against the rounded operands' product: " << worst;
    EXPECT_EQ(entries_outside(result, reference_product(a, w, c0, false),
                              kProductRounding + summation, &worst),
              0)
        << "worst |C - A.W| / sum |A.W| = " << worst;
  }
}
TEST(AmxGemm, EmulatedTilesTakeTheModelsSums) {
  expect_tiles_within_the_bounds<EmulatedTiles>(8100, true);
}
TEST(AmxGemm, HardwareTilesStayWithinTheBounds) {
  SDMHA_SKIP_WITHOUT_AMX();
  expect_tiles_within_the_bounds<sdmha::detail::amx::HardwareTiles>(8100, false);
}

// The exactness check the automatic choice puts the CPU's tiles through (amx_tiles_verified):
// the emulation passes it, tiles that lose products or put the sums in the wrong places fail it,
// and the CPU's tiles pass it where AMX is usable.
struct TilesLosingProducts : EmulatedTiles {
  void multiply(bool two_rows, bool) { EmulatedTiles::multiply(two_rows, false); }
};
struct TilesSwappingSums : EmulatedTiles {
  void store_sums(float* out, Index stride) {
    EmulatedTiles::store_sums(out, stride);
    const Index floats = stride / Index(sizeof(float));
    for (Index row = 0; row < 16; ++row)
      std::swap_ranges(out + row * floats + 16, out + row * floats + 32, out + (16 + row) * floats);
  }
};
TEST(AmxGemm, TheExactnessCheckPassesTheEmulationAndFailsBrokenTiles) {
  EXPECT_TRUE(sdmha::detail::tiles_multiply_exactly<EmulatedTiles>());
  EXPECT_FALSE(sdmha::detail::tiles_multiply_exactly<TilesLosingProducts>());
  EXPECT_FALSE(sdmha::detail::tiles_multiply_exactly<TilesSwappingSums>());
}
TEST(AmxGemm, HardwareTilesPassTheExactnessCheck) {
  SDMHA_SKIP_WITHOUT_AMX();
  EXPECT_TRUE(sdmha::detail::tiles_multiply_exactly<sdmha::detail::amx::HardwareTiles>());
  EXPECT_TRUE(sdmha::detail::amx_tiles_verified());
}

// The bias is added in the first depth block's stores, bitwise the bias with the product
// accumulated onto it; a row block of C is bitwise the same rows of the whole product; strided A
// and C give the same bits and leave C's margin alone.
template <class Tiles>
void expect_bias_row_blocks_and_strides_keep_the_bits(std::uint32_t seed) {
  std::mt19937 rng(seed);
  const Index m = 700, n = 45, k = 1100;
  const FloatMatrix a = normal_matrix(m, k, rng), w = normal_matrix(k, n, rng);
  const FloatMatrix bias = normal_matrix(1, n, rng);
  const FloatMatrix whole = run_tiles<Tiles>(a, w, nan_matrix(m, n), false);
  for (const auto& rows : std::vector<std::pair<Index, Index>>{{256, 256}, {0, 1}, {600, 100}}) {
    const FloatMatrix part = run_tiles<Tiles>(a.middleRows(rows.first, rows.second), w,
                                              nan_matrix(rows.second, n), false);
    EXPECT_EQ(differing_bits(part, whole.middleRows(rows.first, rows.second)), 0)
        << "rows " << rows.first << " + " << rows.second;
  }
  for (const Index depth : {Index(100), k}) {
    const FloatMatrix onto = bias.replicate(m, 1);
    EXPECT_EQ(differing_bits(run_tiles<Tiles>(a.leftCols(depth), w.topRows(depth), nan_matrix(m, n),
                                              false, bias.data()),
                             run_tiles<Tiles>(a.leftCols(depth), w.topRows(depth), onto, true)),
              0)
        << "bias, depth " << depth;
  }
  FloatMatrix wide_a = normal_matrix(m, k + 7, rng);
  wide_a.middleCols(3, k) = a;
  FloatMatrix wide_c = FloatMatrix::Constant(m, n + 5, -555.0f);
  wide_c.middleCols(2, n) = run_tiles<Tiles>(wide_a.middleCols(3, k), w, nan_matrix(m, n), false);
  EXPECT_EQ(differing_bits(wide_c.middleCols(2, n), whole), 0) << "strided";
}
TEST(AmxGemm, EmulatedBiasRowBlocksAndStridesKeepTheBits) {
  expect_bias_row_blocks_and_strides_keep_the_bits<EmulatedTiles>(8200);
}
TEST(AmxGemm, HardwareBiasRowBlocksAndStridesKeepTheBits) {
  SDMHA_SKIP_WITHOUT_AMX();
  expect_bias_row_blocks_and_strides_keep_the_bits<sdmha::detail::amx::HardwareTiles>(8200);
}

// A kernel handed to the tiles serves gemm_bfloat16 on it (the projections), bias included, with
// the planned scratch or none: bitwise the tiles' product; accumulated products stay with the
// pairs engine.
TEST(AmxGemm, KernelHandedToTheTilesServesTheProjections) {
  std::mt19937 rng(8300);
  for (const GemmCase& c : gemm_cases()) {
    SCOPED_TRACE(describe(c));
    const FloatMatrix a = normal_matrix(c.m, c.k, rng), w = normal_matrix(c.k, c.n, rng);
    const FloatMatrix bias = normal_matrix(1, c.n, rng);
    BFloat16Kernel kernel(w);
    sdmha::detail::hand_to_amx(kernel, true);
    ASSERT_NE(kernel.external(), nullptr);
    for (const bool planned : {true, false}) {
      FloatMatrix result = nan_matrix(c.m, c.n);
      sdmha::detail::ScratchBuffer buffer;
      if (planned) buffer.reserve(sdmha::detail::gemm_bfloat16_workspace_size(c.m, c.n, c.k));
      gemm_bfloat16(a, kernel, result, false, buffer.view(), bias.data());
      EXPECT_EQ(differing_bits(result, run_tiles<EmulatedTiles>(a, w, nan_matrix(c.m, c.n), false,
                                                                bias.data())),
                0)
          << (planned ? "planned scratch" : "no scratch");
    }
    const FloatMatrix start = normal_matrix(c.m, c.n, rng);
    EXPECT_EQ(differing_bits(run_gemm(a, kernel, start, true),
                             run_gemm(a, BFloat16Kernel(w), start, true)),
              0)
        << "accumulated: the pairs engine";
  }
}

// On the tiles (the scores and P·V): the tiles' product of scale·A on BFloat16Kernel(op(B)), and
// the emulation counts its tile products (the dispatch reached it).
TEST(AmxOperands, ProductIsTheTileProductOfTheRoundedOperands) {
  const auto before = EmulatedTiles::products().load();
  expect_the_operands_product(
      8400, sdmha::BFloat16Operands::Engine::amx_emulated,
      [](const FloatMatrix& a, const FloatMatrix& w, const FloatMatrix& start, bool accumulate) {
        return run_tiles<EmulatedTiles>(a, w, start, accumulate);
      });
  EXPECT_GT(EmulatedTiles::products().load(), before);
}

#if defined(SDMHA_WITH_ONEDNN)
// ---- a kernel handed to oneDNN (detail/gemm_onednn.hpp): its AMX brgemm where usable, its
// AVX512_BF16 one on the machines without AMX that run these tests ----------------------------

using sdmha::detail::OneDnnBFloat16Gemm;

BFloat16Kernel onednn_kernel(const FloatMatrix& w) {
  BFloat16Kernel kernel(w);
  sdmha::detail::hand_to_onednn(kernel, sdmha::detail::kProjectionRowBlock);
  return kernel;
}
const OneDnnBFloat16Gemm& onednn_of(const BFloat16Kernel& kernel) {
  return dynamic_cast<const OneDnnBFloat16Gemm&>(*kernel.external());
}

// oneDNN serves every shape here that is not accumulated (its brgemm, no fallback), within the
// same bounds as the pairs engine: float32's summation error of the rounded operands' float64
// product, the bfloat16 bound of the float one; the bias is added once (checked by the same
// bounds with C0 = the bias). Accumulated products go to the pairs engine, bit for bit.
TEST(OneDnnBFloat16Gemm, ServesTheProjectionsWithinTheBFloat16Bounds) {
  std::uint32_t seed = 7600;
  for (const GemmCase& c : gemm_cases()) {
    SCOPED_TRACE(describe(c));
    const auto [a, w, start] = random_operands(c, seed++);
    const BFloat16Kernel kernel = onednn_kernel(w);
    if (c.accumulate) {
      EXPECT_EQ(differing_bits(run_gemm(a, kernel, start, true),
                               run_gemm(a, BFloat16Kernel(w), start, true)),
                0);
      continue;
    }
    std::mt19937 rng(seed);
    const FloatMatrix bias = normal_matrix(1, c.n, rng);
    const FloatMatrix c0 = bias.replicate(c.m, 1);
    FloatMatrix result = nan_matrix(c.m, c.n);
    EXPECT_TRUE(onednn_of(kernel).run(a, result, bias.data(), sdmha::StageScratch{}));
    const double summation = double(c.k + 2) * kSumRounding;  // the bias is one more term
    double worst = 0.0;
    EXPECT_EQ(entries_outside(result, reference_product(a, w, &c0, true), summation, &worst), 0)
        << "worst error against the rounded operands' product: " << worst;
    EXPECT_EQ(entries_outside(result, reference_product(a, w, &c0, false),
                              kProductRounding + summation, &worst),
              0)
        << "worst |C - A.W - b| / (sum |A.W| + |b|) = " << worst;
    FloatMatrix through_gemm = nan_matrix(c.m, c.n);
    gemm_bfloat16(a, kernel, through_gemm, false, sdmha::StageScratch{}, bias.data());
    EXPECT_EQ(differing_bits(through_gemm, result), 0) << "gemm_bfloat16 did not go to oneDNN";
  }
}

// A strided A and C (C's leading dimension past n, a layout oneDNN's brgemm may not take): the
// same bounds whichever engine serves it.
TEST(OneDnnBFloat16Gemm, StridedOperandsStayWithinTheBounds) {
  std::mt19937 rng(7700);
  const Index m = 70, n = 40, k = 90;
  const FloatMatrix wide_a = normal_matrix(m, k + 9, rng), w = normal_matrix(k, n, rng);
  const BFloat16Kernel kernel = onednn_kernel(w);
  FloatMatrix wide_c = nan_matrix(m, n + 5);
  gemm_bfloat16(wide_a.middleCols(3, k), kernel, wide_c.middleCols(2, n), false,
                sdmha::StageScratch{});
  const FloatMatrix a = wide_a.middleCols(3, k), result = wide_c.middleCols(2, n);
  double worst = 0.0;
  EXPECT_EQ(entries_outside(result, reference_product(a, w, nullptr, true),
                            double(k + 1) * kSumRounding, &worst),
            0)
      << worst;
}

// Products run on the calling thread: none of oneDNN's OpenMP threads start, even where its
// runtime would take two, and the calling thread's OpenMP thread count is restored.
TEST(OneDnnBFloat16Gemm, RunsOnTheCallingThread) {
  std::mt19937 rng(7800);
  const FloatMatrix a = normal_matrix(200, 96, rng), w = normal_matrix(96, 80, rng);
  const BFloat16Kernel kernel = onednn_kernel(w);
#if DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP
  const auto& omp = sdmha::detail::onednn::openmp_threads();
  ASSERT_NE(omp.set_threads, nullptr);
  const int before = omp.max_threads();
  omp.set_threads(2);
#endif
  const auto threads_now = [] {
    return std::distance(std::filesystem::directory_iterator("/proc/self/task"),
                         std::filesystem::directory_iterator{});
  };
  const auto threads_before = threads_now();
  FloatMatrix c = nan_matrix(200, 80);
  gemm_bfloat16(a, kernel, c, false, sdmha::StageScratch{});
  EXPECT_EQ(threads_now(), threads_before) << "oneDNN started threads of its own";
#if DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP
  EXPECT_EQ(omp.max_threads(), 2);
  omp.set_threads(before);
#endif
}

// Several threads call one kernel at once, as the layer's workers do (row blocks of 64 taken in
// turn, a shorter last one; the primitives made by whichever thread comes first, or by another
// thread before), and get the bits of one thread alone, round after round. With oneDNN's own
// scratchpad this failed from the second round on.
TEST(OneDnnBFloat16Gemm, WorkersShareAKernel) {
  std::mt19937 rng(7850);
  const Index m = 16 * 64 + 37, k = 256, n = 256;
  const FloatMatrix a = normal_matrix(m, k, rng), w = normal_matrix(k, n, rng);
  const FloatMatrix bias = normal_matrix(1, n, rng);
  const BFloat16Kernel kernel = onednn_kernel(w);
  const auto by_blocks = [&](FloatMatrix& c, int thread, int threads) {
    for (Index row = 64 * thread; row < m; row += 64 * threads) {
      const Index rows = std::min<Index>(64, m - row);
      gemm_bfloat16(a.middleRows(row, rows), kernel, c.middleRows(row, rows), false, {},
                    bias.data());
    }
  };
  FloatMatrix alone = nan_matrix(m, n);
  by_blocks(alone, 0, 1);
  for (int round = 0; round < 4; ++round) {
    FloatMatrix shared = nan_matrix(m, n);
    std::vector<std::thread> workers;
    for (int t = 0; t < 3; ++t) workers.emplace_back([&, t] { by_blocks(shared, t, 3); });
    for (std::thread& worker : workers) worker.join();
    EXPECT_EQ(differing_bits(shared, alone), 0) << "round " << round;
  }
}

// Where the CPU has AMX and Linux grants the tile data, oneDNN runs the projections on its AMX
// brgemm; elsewhere on its AVX512_BF16 one (or none, where the CPU lacks AVX512_BF16: the pairs
// engine then serves).
TEST(OneDnnBFloat16Gemm, TakesAmxWhereUsable) {
  std::mt19937 rng(7900);
  const BFloat16Kernel kernel = onednn_kernel(normal_matrix(256, 256, rng));
  const std::string implementation =
      onednn_of(kernel).implementation(sdmha::detail::kProjectionRowBlock);
  std::cout << "[          ] oneDNN " << dnnl_version()->major << "." << dnnl_version()->minor
            << "." << dnnl_version()->patch << ": " << implementation << "\n";
  if (sdmha::detail::amx_bfloat16_usable()) {
    EXPECT_EQ(implementation, "brg:avx512_core_amx_bf16");
  } else if (sdmha::detail::cpu_features().avx512_bf16) {
    EXPECT_EQ(implementation, "brg:avx512_core_bf16");
  } else {
    EXPECT_EQ(implementation.find("amx"), std::string::npos);
  }
}
#endif  // SDMHA_WITH_ONEDNN

}  // namespace
}  // namespace sdmha_test
