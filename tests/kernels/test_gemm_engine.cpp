// Tests of sdmha/detail/gemm_avx512.hpp: the AVX-512 float GEMM against a float64 triple loop on
// odd shapes (0, 1, the edges of its 14 × 32 and 6 × 64 tiles, of its 256-deep and 256-row
// blocks), all four transpose combinations (so every path: A packed by rows or by columns or read
// in place, B read in place or transposed), outer strides wider than the rows, α ≠ 1, with and
// without accumulation; entries of C outside the product and bytes past the scratch stay
// untouched; results are deterministic and a row block of C is bit for bit the same rows of the
// whole product; a column bias is bitwise the bias accumulated onto. Without AVX-512F the engine is
// not compiled and its tests skip; the column bias on Eigen's path (double) runs everywhere.
#include "test_support.hpp"

#include <cstring>

#include <sdmha/detail/gemm.hpp>
#include <sdmha/detail/gemm_avx512.hpp>

namespace sdmha_test {
namespace {

#if defined(__AVX512F__)

using sdmha::detail::gemm_avx512;
using sdmha::detail::gemm_avx512_workspace_size;
using sdmha::detail::GemmOperand;

// A matrix stored row-major with an outer stride of at least its columns; the padding holds a
// marker that a GEMM must neither read into C nor overwrite.
struct Stored {
  Index rows = 0, cols = 0, stride = 0;
  std::vector<float> values;
  float& at(Index i, Index j) { return values[std::size_t(i * stride + j)]; }
  float at(Index i, Index j) const { return values[std::size_t(i * stride + j)]; }
};

constexpr float kPadding = 1.0e30f;

Stored random_stored(Index rows, Index cols, Index extra, std::mt19937& rng) {
  Stored s{rows, cols, cols + extra, {}};
  s.values.assign(std::size_t(std::max<Index>(rows * s.stride, 1)), kPadding);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j) s.at(i, j) = value(rng);
  return s;
}

// op(X) of a stored X: X itself (row-major view) or its transpose.
GemmOperand<float> operand(const Stored& s, bool transpose) {
  if (transpose) return {s.values.data(), s.cols, s.rows, s.stride, false};
  return {s.values.data(), s.rows, s.cols, s.stride, true};
}
double op_at(const Stored& s, bool transpose, Index i, Index j) {
  return transpose ? s.at(j, i) : s.at(i, j);
}

struct Case {
  Index m, n, k;
  bool transpose_a, transpose_b, accumulate;
  float alpha;
  Index extra_a, extra_b, extra_c;  // outer stride − columns
};

std::string describe(const Case& c) {
  return std::to_string(c.m) + "x" + std::to_string(c.n) + "x" + std::to_string(c.k) +
         (c.transpose_a ? " At" : " A") + (c.transpose_b ? " Bt" : " B") +
         (c.accumulate ? " +=" : " =") + " alpha=" + std::to_string(c.alpha) + " extra " +
         std::to_string(c.extra_a) + "," + std::to_string(c.extra_b) + "," +
         std::to_string(c.extra_c);
}

// Runs one case through gemm_avx512 with exactly gemm_avx512_workspace_size bytes of scratch
// (inside a guarded buffer) and checks every stored float of C against float64:
//   |got − expected| ≤ (k + 2)·ε·(|α|·Σ_p |a_ip||b_pj| + |c_ij|) in the product, untouched outside.
void check_case(const Case& c, std::mt19937& rng) {
  SCOPED_TRACE(describe(c));
  const Stored a = c.transpose_a ? random_stored(c.k, c.m, c.extra_a, rng)
                                 : random_stored(c.m, c.k, c.extra_a, rng);
  const Stored b = c.transpose_b ? random_stored(c.n, c.k, c.extra_b, rng)
                                 : random_stored(c.k, c.n, c.extra_b, rng);
  Stored out = random_stored(c.m, c.n, c.extra_c, rng);
  if (!c.accumulate)  // C is write-only then: NaN there must not reach the result
    for (Index i = 0; i < c.m; ++i)
      for (Index j = 0; j < c.n; ++j) out.at(i, j) = std::numeric_limits<float>::quiet_NaN();
  const Stored before = out;

  const std::size_t bytes = gemm_avx512_workspace_size(c.m, c.n, c.k);
  constexpr std::size_t kGuard = 256;
  std::vector<std::byte> memory(bytes + kGuard + 64, std::byte{0x5A});
  std::byte* base =
      memory.data() + (64 - reinterpret_cast<std::uintptr_t>(memory.data()) % 64) % 64;
  sdmha::MatrixRef<float> c_view(Eigen::Map<sdmha::RowMatrix<float>, 0, Eigen::OuterStride<>>(
      out.values.data(), c.m, c.n, Eigen::OuterStride<>(out.stride)));
  gemm_avx512(operand(a, c.transpose_a), operand(b, c.transpose_b), c_view, c.alpha, c.accumulate,
              sdmha::StageScratch{base, bytes});

  for (std::size_t g = 0; g < kGuard; ++g)
    ASSERT_EQ(base[bytes + g], std::byte{0x5A}) << "scratch overrun";
  const double eps = double(std::numeric_limits<float>::epsilon());
  std::vector<double> exact(std::size_t(c.n)), magnitude(std::size_t(c.n));
  for (Index i = 0; i < c.m; ++i) {
    std::fill(exact.begin(), exact.end(), 0.0);
    std::fill(magnitude.begin(), magnitude.end(), 0.0);
    for (Index p = 0; p < c.k; ++p) {
      const double x = op_at(a, c.transpose_a, i, p);
      for (Index j = 0; j < c.n; ++j) {
        const double y = op_at(b, c.transpose_b, p, j);
        exact[j] += x * y;
        magnitude[j] += std::abs(x * y);
      }
    }
    for (Index j = 0; j < c.n; ++j) {
      const double old = c.accumulate ? double(before.at(i, j)) : 0.0;
      const double expected = old + double(c.alpha) * exact[j];
      const double tolerance =
          double(c.k + 2) * eps * (std::abs(double(c.alpha)) * magnitude[j] + std::abs(old)) +
          1e-30;
      const double got = out.at(i, j);
      if (!(std::abs(got - expected) <= tolerance))
        FAIL() << "C(" << i << ", " << j << ") = " << got << ", expected " << expected << " ± "
               << tolerance;
    }
    for (Index j = c.n; j < out.stride; ++j) {
      if (i * out.stride + j >= Index(out.values.size())) break;
      ASSERT_EQ(out.at(i, j), kPadding) << "padding of C written at (" << i << ", " << j << ")";
    }
  }
}

const Index kSizes[] = {0,  1,  2,  3,  7,  13, 14,  15,  16,  17,
                        31, 32, 33, 63, 64, 65, 127, 128, 129, 300};

// Every (m, n, k) of kSizes³; the transposes, accumulation, α and strides cycle through their
// combinations from one shape to the next, so each combination meets shapes of every kind.
TEST(GemmEngine, MatchesFloat64OnEveryShapeOfTheGrid) {
  std::mt19937 rng(20240611);
  const float alphas[] = {1.0f, -0.75f, 2.5f};
  long index = 0;
  for (Index m : kSizes)
    for (Index n : kSizes)
      for (Index k : kSizes) {
        const long s = index++;
        const Case c{m,
                     n,
                     k,
                     (s & 1) != 0,
                     (s & 2) != 0,
                     (s & 4) != 0,
                     alphas[s % 3],
                     (s / 3) % 4 == 0 ? 0 : 1 + s % 19,
                     (s / 5) % 3 == 0 ? 0 : 3 + s % 17,
                     (s / 7) % 2 == 0 ? 0 : 1 + s % 13};
        check_case(c, rng);
        if (HasFatalFailure() || HasFailure()) return;
      }
}

// All four transpose combinations with and without accumulation on the shapes that exercise every
// edge tile of the engine and its depth blocks (k > 256 splits, 300 into 2 × 150).
TEST(GemmEngine, EveryTransposeCombinationOnEdgeShapes) {
  std::mt19937 rng(7);
  const Index sizes[] = {1, 13, 14, 15, 17, 33, 65, 129};
  for (int combination = 0; combination < 8; ++combination)
    for (Index m : sizes)
      for (Index n : sizes)
        for (Index k : {Index(1), Index(16), Index(17), Index(257), Index(300)}) {
          const Case c{m,
                       n,
                       k,
                       (combination & 1) != 0,
                       (combination & 2) != 0,
                       (combination & 4) != 0,
                       0.5f,
                       5,
                       19,
                       3};
          check_case(c, rng);
          if (HasFailure()) return;
        }
}

// The layer's shapes, once each: projections, attention tiles (Kᵀ as B), weight gradients (Aᵀ),
// dV = Pᵀ·dO (Aᵀ read in place), and a product of two transposes.
TEST(GemmEngine, MatchesFloat64OnTheLayerShapes) {
  std::mt19937 rng(11);
  const Case cases[] = {{64, 512, 512, false, false, false, 1.0f, 0, 0, 0},
                        {64, 128, 64, false, true, false, 0.125f, 0, 0, 0},
                        {64, 2048, 64, false, true, false, 0.125f, 448, 192, 0},
                        {64, 64, 128, false, false, true, 1.0f, 0, 0, 0},
                        {64, 64, 2048, false, false, false, 1.0f, 0, 448, 448},
                        {256, 256, 1024, true, false, false, 1.0f, 0, 0, 0},
                        {600, 64, 64, true, false, false, 1.0f, 0, 0, 0},
                        {70, 300, 530, true, true, true, 0.5f, 3, 5, 7},
                        {64, 512, 512, false, true, true, -1.0f, 0, 0, 0}};
  for (const Case& c : cases) check_case(c, rng);
}

sdmha::RowMatrix<float> random_matrix(Index rows, Index cols, std::mt19937& rng) {
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  sdmha::RowMatrix<float> x(rows, cols);
  for (Index i = 0; i < x.size(); ++i) x.data()[i] = value(rng);
  return x;
}

// Row blocks of 64 (the layer's work items) give the rows of the whole product bit for bit, and a
// second run gives the same bits: each entry is one fixed sequence of FMAs.
TEST(GemmEngine, RowBlocksAndRepeatedRunsAreBitwiseEqual) {
  std::mt19937 rng(3);
  const Index m = 300, n = 200, k = 530;
  const sdmha::RowMatrix<float> a = random_matrix(m, k, rng), b = random_matrix(n, k, rng);
  sdmha::RowMatrix<float> whole(m, n), again(m, n), blocks(m, n);
  std::vector<std::byte> scratch(gemm_avx512_workspace_size(m, n, k) + 64);
  const sdmha::StageScratch view{scratch.data(), scratch.size()};
  const GemmOperand<float> a_op{a.data(), m, k, k, true}, b_op{b.data(), k, n, k, false};
  gemm_avx512(a_op, b_op, sdmha::MatrixRef<float>(whole), 1.0f, false, view);
  gemm_avx512(a_op, b_op, sdmha::MatrixRef<float>(again), 1.0f, false, view);
  for (Index i0 = 0; i0 < m; i0 += 64) {
    const Index rows = std::min<Index>(64, m - i0);
    const GemmOperand<float> block{a.data() + i0 * k, rows, k, k, true};
    gemm_avx512(block, b_op, sdmha::MatrixRef<float>(blocks.middleRows(i0, rows)), 1.0f, false,
                view);
  }
  EXPECT_EQ(std::memcmp(whole.data(), again.data(), sizeof(float) * std::size_t(m * n)), 0);
  EXPECT_EQ(std::memcmp(whole.data(), blocks.data(), sizeof(float) * std::size_t(m * n)), 0);
}

// The paths agree bit for bit too: the left 64 columns of a 64 × 130 product (A packed) are those
// of the 64 × 64 product on them (A read in place by 6 × 64 tiles), for both layouts of A.
TEST(GemmEngine, PathsAreBitwiseEqual) {
  std::mt19937 rng(4);
  const Index m = 64, n = 130, k = 300;
  const sdmha::RowMatrix<float> a = random_matrix(m, k, rng), at = a.transpose(),
                                b = random_matrix(k, n, rng);
  std::vector<std::byte> scratch(gemm_avx512_workspace_size(m, n, k) + 64);
  const sdmha::StageScratch view{scratch.data(), scratch.size()};
  for (bool transposed : {false, true}) {
    const GemmOperand<float> a_op = transposed ? GemmOperand<float>{at.data(), m, k, m, false}
                                               : GemmOperand<float>{a.data(), m, k, k, true};
    sdmha::RowMatrix<float> wide(m, n), narrow(m, 64);
    gemm_avx512(a_op, GemmOperand<float>{b.data(), k, n, n, true}, sdmha::MatrixRef<float>(wide),
                0.5f, false, view);
    gemm_avx512(a_op, GemmOperand<float>{b.data(), k, 64, n, true}, sdmha::MatrixRef<float>(narrow),
                0.5f, false, view);
    const sdmha::RowMatrix<float> left = wide.leftCols(64);
    EXPECT_EQ(std::memcmp(left.data(), narrow.data(), sizeof(float) * std::size_t(m * 64)), 0)
        << (transposed ? "Aᵀ" : "A");
  }
}

// A column bias b is added in the first depth block's stores: bitwise C = b in every row and the
// product accumulated onto it (what the projections did before, with a pass of its own over C),
// on every path (A packed by rows or columns or read in place, B in place or transposed), the n
// edges, one and two depth blocks, k = 0; columns past n untouched, the bias read only to n.
TEST(GemmEngine, ColumnBiasIsBitwiseTheBiasAccumulatedOnto) {
  std::mt19937 rng(12);
  for (int combination = 0; combination < 4; ++combination)
    for (Index m : {Index(1), Index(13), Index(70)})
      for (Index n : {Index(1), Index(17), Index(64), Index(100)})
        for (Index k : {Index(0), Index(5), Index(300)}) {
          const bool transpose_a = (combination & 1) != 0, transpose_b = (combination & 2) != 0;
          SCOPED_TRACE(std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) +
                       (transpose_a ? " At" : " A") + (transpose_b ? " Bt" : " B"));
          const Stored a = transpose_a ? random_stored(k, m, 3, rng) : random_stored(m, k, 3, rng);
          const Stored b = transpose_b ? random_stored(n, k, 5, rng) : random_stored(k, n, 5, rng);
          const std::vector<float> bias = [&] {
            std::vector<float> values(
                static_cast<std::size_t>(n));  // exactly n: ASan sees a read past it
            std::uniform_real_distribution<float> value(-1.0f, 1.0f);
            for (float& v : values) v = value(rng);
            return values;
          }();
          sdmha::RowMatrix<float> fused(m, n + 2), onto(m, n);
          fused.setConstant(kPadding);
          for (Index i = 0; i < m; ++i) std::copy(bias.begin(), bias.end(), onto.row(i).data());
          std::vector<std::byte> scratch(gemm_avx512_workspace_size(m, n, k) + 64);
          const sdmha::StageScratch view{scratch.data(), scratch.size()};
          gemm_avx512(operand(a, transpose_a), operand(b, transpose_b),
                      sdmha::MatrixRef<float>(fused.leftCols(n)), 0.75f, false, view, bias.data());
          gemm_avx512(operand(a, transpose_a), operand(b, transpose_b),
                      sdmha::MatrixRef<float>(onto), 0.75f, true, view);
          const sdmha::RowMatrix<float> got = fused.leftCols(n);
          EXPECT_EQ(std::memcmp(got.data(), onto.data(), sizeof(float) * std::size_t(m * n)), 0);
          EXPECT_TRUE((fused.rightCols(2).array() == kPadding).all());
          if (HasFailure()) return;
        }
}

// Without enough scratch (none, or one byte short) it packs into memory of its own: same bits. A
// scratch that is not 64-byte aligned works too (the engine only uses unaligned loads and stores).
TEST(GemmEngine, TooLittleOrMisalignedScratchGivesTheSameResult) {
  std::mt19937 rng(5);
  const Index m = 70, n = 90, k = 300;
  const sdmha::RowMatrix<float> a = random_matrix(k, m, rng), b = random_matrix(k, n, rng);
  const GemmOperand<float> a_op{a.data(), m, k, m, false}, b_op{b.data(), k, n, n, true};
  const std::size_t bytes = gemm_avx512_workspace_size(m, n, k);
  std::vector<std::byte> scratch(bytes + 64);
  sdmha::RowMatrix<float> planned(m, n), none(m, n), short_by_one(m, n), misaligned(m, n);
  gemm_avx512(a_op, b_op, sdmha::MatrixRef<float>(planned), 1.5f, false, {scratch.data(), bytes});
  gemm_avx512(a_op, b_op, sdmha::MatrixRef<float>(none), 1.5f, false, {});
  gemm_avx512(a_op, b_op, sdmha::MatrixRef<float>(short_by_one), 1.5f, false,
              {scratch.data(), bytes - 1});
  gemm_avx512(a_op, b_op, sdmha::MatrixRef<float>(misaligned), 1.5f, false,
              {scratch.data() + 4, bytes});
  EXPECT_TRUE(planned == none);
  EXPECT_TRUE(planned == short_by_one);
  EXPECT_TRUE(planned == misaligned);
}

// The scratch is what it packs into (a planned call has no other memory to use): the packed
// operands overwrite it, and the workspace is zero exactly when there is nothing to multiply.
TEST(GemmEngine, PacksIntoTheGivenScratch) {
  EXPECT_EQ(gemm_avx512_workspace_size(0, 5, 5), 0u);
  EXPECT_EQ(gemm_avx512_workspace_size(5, 0, 5), 0u);
  EXPECT_EQ(gemm_avx512_workspace_size(5, 5, 0), 0u);
  EXPECT_GT(gemm_avx512_workspace_size(1, 1, 1), 0u);
  std::mt19937 rng(9);
  const Index m = 64, n = 512, k = 512;
  const sdmha::RowMatrix<float> a = random_matrix(m, k, rng), b = random_matrix(k, n, rng);
  std::vector<std::byte> scratch(gemm_avx512_workspace_size(m, n, k), std::byte{0});
  sdmha::RowMatrix<float> out(m, n);
  gemm_avx512(GemmOperand<float>{a.data(), m, k, k, true},
              GemmOperand<float>{b.data(), k, n, n, true}, sdmha::MatrixRef<float>(out), 1.0f,
              false, {scratch.data(), scratch.size()});
  const auto zero = std::count(scratch.begin(), scratch.end(), std::byte{0});
  EXPECT_LT(zero, Index(scratch.size()) / 2);
}

#endif

// Eigen's path (double; and float without AVX-512) takes a column bias too: C = bias in every
// row, then the product accumulated onto it.
TEST(GemmEngine, ColumnBiasOnEigensPath) {
  std::mt19937 rng(13);
  std::uniform_real_distribution<double> value(-1.0, 1.0);
  const Index m = 37, n = 21, k = 300;
  sdmha::RowMatrix<double> a(m, k), b(k, n), c(m, n);
  Eigen::RowVectorXd bias(n);
  const auto fill = [&](auto& x) {
    for (Index i = 0; i < x.size(); ++i) x.data()[i] = value(rng);
  };
  fill(a);
  fill(b);
  fill(bias);
  c.setConstant(std::numeric_limits<double>::quiet_NaN());  // write-only
  sdmha::detail::gemm<double>(sdmha::detail::as_operand<double>(a),
                              sdmha::detail::as_operand<double>(b), sdmha::MatrixRef<double>(c),
                              0.5, false, {}, bias.data());
  const sdmha::RowMatrix<double> expected = (0.5 * a * b).rowwise() + bias;
  EXPECT_LE((c - expected).cwiseAbs().maxCoeff(), 1e-12);
}

#if !defined(__AVX512F__)

TEST(GemmEngine, NeedsAvx512) {
  GTEST_SKIP() << "sdmha/detail/gemm_avx512.hpp is compiled only with AVX-512F (e.g. -march=native "
                  "on a CPU that has it); this build has no __AVX512F__";
}

#endif

}  // namespace
}  // namespace sdmha_test
