// sdmha/detail/gemm_bfloat16.hpp — C (+)= A·W with A rounded to bfloat16 on the fly and W a
// bfloat16 kernel packed once in pairs of rows: the dense projections of the bfloat16 mode; and
// C (+)= A·op(B) with both rounded as they are packed (gemm_bfloat16_operands): its scores and P·V.
//
//   math:  C = bf16(A)·bf16(W) (+ C, or + 1·bᵀ given a column bias b), each product exact, the
//          sums in float32
//   pre:   A (m × k) float, row-major; W a BFloat16Kernel of a k × n float matrix; C (m × n,
//          row-major) aliases neither; scratch of gemm_bfloat16_workspace_size(m, n, k) bytes
//   cost:  m·n·k multiply-adds, 32 per vdpbf16ps (AVX512_BF16: twice float32's FMA rate), one
//          rounding copy of A per (row block, depth block); a portable loop elsewhere
//
// Rounding is to nearest, ties to even: bfloat16 has 8 significant bits, so each operand moves
// by at most 2⁻⁸ of itself and each term a·w of a float32 result by at most 2⁻⁷ + 2⁻¹⁶, on top of
// float32's own summation error: |C − A·W| ≤ (2⁻⁷ + 2⁻¹⁶ + (k + 1)·2⁻²⁴)·Σ_p |A(i, p)·W(p, j)| for
// operands and products in float's normal range (the AVX512_BF16 instructions read and write
// subnormals as zero). W's 2-byte entries halve its memory traffic; A is float in memory and
// rounded as it is packed, so callers keep their float inputs.
//
// Layout: vdpbf16ps multiplies the bfloat16 pairs (2p, 2p + 1) of two registers lane by lane and
// adds both products to a float lane. BFloat16Kernel therefore stores W as ⌈k/2⌉ rows of n
// 32-bit pairs, pair (p, j) = W(2p, j) in the low half, W(2p + 1, j) in the high half (0 past k),
// and a row of A packs the same way as it is (its entries 2p and 2p + 1 are adjacent): one
// broadcast 32-bit pair of A times 16 columns' pairs of W is 32 multiply-adds.
//
// Blocking as in gemm_avx512.hpp (which gives the reasons, and whose helpers it uses): micro-tiles
// of up to 14 × 32 (28 zmm accumulators), W read in place (its pair rows are contiguous), A packed
// per (row block of ≤ 256 rows, depth block of ≤ 512) in chunks of 16 pairs — one cache line per
// row and chunk. Every entry of C is one fixed sequence of vdpbf16ps over p, split at depth blocks
// that depend on k alone: deterministic, and a row block of C is bitwise the same rows of a larger
// product.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>

#include <Eigen/Core>

#include "sdmha/config.hpp"
#include "sdmha/detail/gemm_avx512.hpp"
#include "sdmha/detail/scratch.hpp"
#include "sdmha/kernels.hpp"
#include "sdmha/stage.hpp"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace sdmha::detail {

// The bit pattern of x rounded to the nearest bfloat16, ties to even (Eigen's conversion).
inline std::uint32_t bfloat16_bits(float x) {
  return Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(x));
}
// The float that a bfloat16 bit pattern (in the low 16 bits) stands for, exactly.
inline float widen_bfloat16(std::uint32_t bits) {
  return Eigen::numext::bit_cast<float>(std::uint32_t(bits << 16));
}

// A k × n matrix rounded to bfloat16 and packed in pairs of rows, seen where it is: pair (p, j) =
// (M(2p, j), M(2p + 1, j)) at data[p·stride + j], the high half 0 past k.
struct BFloat16Pairs {
  const std::uint32_t* data = nullptr;
  Index rows = 0, cols = 0;  // k, n
  Index stride = 0;          // pairs from one pair row to the next, ≥ n
};

// out[p·out_stride + j] = the pair (M(2p, j), M(2p + 1, j)) of M (rows × cols, row-major,
// leading dimension ld) rounded to nearest bfloat16, for p < ⌈rows/2⌉ and j < cols: M packed as
// BFloat16Kernel stores it (the portable conversion: subnormals kept).
inline void pack_row_pairs_portable(const float* m, Index ld, Index rows, Index cols,
                                    std::uint32_t* out, Index out_stride) {
  for (Index p = 0; p < (rows + 1) / 2; ++p)
    for (Index j = 0; j < cols; ++j) {
      const std::uint32_t low = bfloat16_bits(m[2 * p * ld + j]);
      const std::uint32_t high = 2 * p + 1 < rows ? bfloat16_bits(m[(2 * p + 1) * ld + j]) : 0u;
      out[p * out_stride + j] = low | (high << 16);
    }
}
// The same for Mᵀ (cols × rows): out[p·out_stride + s] = (M(s, 2p), M(s, 2p + 1)) for
// p < ⌈cols/2⌉ and s < rows — a row of M rounded to bfloat16 is already its sequence of pairs.
inline void pack_column_pairs_portable(const float* m, Index ld, Index rows, Index cols,
                                       std::uint32_t* out, Index out_stride) {
  for (Index s = 0; s < rows; ++s)
    for (Index p = 0; p < (cols + 1) / 2; ++p) {
      const std::uint32_t low = bfloat16_bits(m[s * ld + 2 * p]);
      const std::uint32_t high = 2 * p + 1 < cols ? bfloat16_bits(m[s * ld + 2 * p + 1]) : 0u;
      out[p * out_stride + s] = low | (high << 16);
    }
}

// Another engine a BFloat16Kernel may be handed to (gemm_onednn.hpp's): C = bf16(A)·W̃ (+ 1·bᵀ),
// within this file's bound (exact products, float32 sums in an order of its own); `run` returns
// false for a shape it does not serve, which this file's engine then runs.
class ExternalBFloat16Gemm {
 public:
  virtual ~ExternalBFloat16Gemm() = default;
  virtual bool run(const ConstMatrixRef<float>& a, MatrixRef<float> c, const float* column_bias,
                   StageScratch scratch) const = 0;
};

// A k × n float kernel rounded to bfloat16 and packed in pairs of rows (see the top of the file).
class BFloat16Kernel {
 public:
  using Pairs = Eigen::Matrix<std::uint32_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  BFloat16Kernel() = default;
  explicit BFloat16Kernel(const ConstMatrixRef<float>& kernel)
      : rows_(kernel.rows()), pairs_((kernel.rows() + 1) / 2, kernel.cols()) {
    pack_row_pairs_portable(kernel.data(), kernel.outerStride(), rows_, pairs_.cols(),
                            pairs_.data(), pairs_.cols());
  }

  Index rows() const { return rows_; }          // k
  Index cols() const { return pairs_.cols(); }  // n
  const Pairs& pairs() const { return pairs_; }
  BFloat16Pairs view() const { return BFloat16Pairs{pairs_.data(), rows_, cols(), cols()}; }
  // W(i, j) as rounded, widened to float.
  float operator()(Index i, Index j) const {
    return widen_bfloat16(pairs_(i / 2, j) >> (i % 2 == 0 ? 0 : 16) & 0xFFFFu);
  }
  // The engine the products with this kernel go to first (null: this file's).
  const ExternalBFloat16Gemm* external() const { return external_.get(); }
  void set_external(std::shared_ptr<const ExternalBFloat16Gemm> e) { external_ = std::move(e); }

 private:
  Index rows_ = 0;
  Pairs pairs_;
  std::shared_ptr<const ExternalBFloat16Gemm> external_;  // shared by the kernel's copies
};

namespace bf16_gemm {

inline constexpr Index kChunk = 32;   // depth of a packed chunk of A: 16 pairs, one cache line
inline constexpr Index kMaxKc = 512;  // depth of a block (a multiple of kChunk)
inline constexpr Index kMaxBlockRows = 256;  // rows of A rounded at once, either engine

inline Index round_up(Index value, Index step) { return (value + step - 1) / step * step; }

// k split into equal depth blocks of at most kMaxKc, each a multiple of kChunk but the last: a
// function of k alone, shared by both paths.
inline Index depth_block(Index k) {
  const Index blocks = (k + kMaxKc - 1) / kMaxKc;
  return round_up((k + blocks - 1) / blocks, kChunk);
}

}  // namespace bf16_gemm

// The portable product, in the order of the vdpbf16ps path: per depth block, a sum from zero
// over the block's pairs, each pair adding its odd-row term and then its even-row term (the
// order the SDM gives for vdpbf16ps; each product of two bfloat16 values is exact in float),
// then added to C (or stored, for the first block without `accumulate`). So both paths take the
// same sums; they can differ only where the hardware treats subnormals as zero. A's entries are
// multiplied by `a_scale` before they are rounded. A row's block sums live on the stack, a
// column chunk at a time (each entry's sum is its own): the product allocates nothing.
inline void gemm_bfloat16_portable(const ConstMatrixRef<float>& a, const BFloat16Pairs& w,
                                   MatrixRef<float> c, bool accumulate, float a_scale = 1.f) {
  const Index m = c.rows(), n = c.cols(), k = a.cols();
  if (k == 0) {
    if (!accumulate) c.setZero();
    return;
  }
  const Index kc = bf16_gemm::depth_block(k);
  constexpr Index kColumnChunk = 256;
  float sum[kColumnChunk];
  for (Index i = 0; i < m; ++i) {
    float* row = c.data() + i * c.outerStride();
    for (Index j0 = 0; j0 < n; j0 += kColumnChunk) {
      const Index width = std::min(kColumnChunk, n - j0);
      for (Index pc = 0; pc < k; pc += kc) {  // pc is even: kc is a multiple of kChunk
        const Index end = std::min(pc + kc, k);
        std::fill(sum, sum + width, 0.f);
        for (Index p = pc / 2; p < (end + 1) / 2; ++p) {
          const float even = widen_bfloat16(bfloat16_bits(a_scale * a(i, 2 * p)));
          const float odd =
              2 * p + 1 < k ? widen_bfloat16(bfloat16_bits(a_scale * a(i, 2 * p + 1))) : 0.f;
          const std::uint32_t* pair = w.data + p * w.stride + j0;
          for (Index j = 0; j < width; ++j) {
            sum[j] += odd * widen_bfloat16(pair[j] >> 16);
            sum[j] += even * widen_bfloat16(pair[j] & 0xFFFFu);
          }
        }
        float* out = row + j0;
        for (Index j = 0; j < width; ++j) out[j] = accumulate || pc > 0 ? out[j] + sum[j] : sum[j];
      }
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)

inline constexpr bool kHaveBFloat16Gemm = true;

namespace bf16_gemm {

// The float32 engine's blocking: micro-tiles of up to its kMr rows (RowSplit's near-equal
// heights), row blocks of up to its kMaxMc rows (row_block), its 16-lane masks.
using avx512_gemm::kMaxMc;
using avx512_gemm::kMr;
using avx512_gemm::lanes;
using avx512_gemm::row_block;
using avx512_gemm::RowSplit;
static_assert(kMaxMc == kMaxBlockRows, "rounded_block_bytes counts the pairs engine's A blocks");
inline constexpr int kNv = 2;  // 16-float vectors across a micro-tile
inline constexpr Index kNr = 16 * kNv;

// 32-bit pairs per packed row of a depth block of `depth`, and of a packed block.
inline Index packed_row_pairs(Index depth) { return round_up(depth, kChunk) / 2; }
inline Index block_a_pairs(Index rows, Index depth) { return rows * packed_row_pairs(depth); }

// Packs rows [i0, i0 + rows) × depth [p0, p0 + depth) of A, times `scale`, rounded, into
// micro-panels of the RowSplit's heights: out[c·16·h + i·16 + q] = pair q of chunk c of the
// panel's row i (zero past the depth), one 64-byte line per row and chunk.
inline void pack_a(const float* a, Index lda, Index i0, Index rows, Index p0, Index depth,
                   float scale, std::uint32_t* out) {
  const __m512 factor = _mm512_set1_ps(scale);
  const RowSplit split(rows);
  const Index chunks = (depth + kChunk - 1) / kChunk;
  for (Index t = 0, ir = 0; t < split.tiles; ++t) {
    const Index h = split.height(t);
    for (Index ch = 0; ch < chunks; ++ch) {
      const Index left = depth - kChunk * ch;
      const __mmask16 low_mask = lanes(left), high_mask = lanes(left > 16 ? left - 16 : 0);
      std::uint32_t* dst = out + ch * 16 * h;
      for (Index i = 0; i < h; ++i) {
        const float* src = a + (i0 + ir + i) * lda + p0 + kChunk * ch;
        // Zero-masked: the padding past the depth stays 0 whatever the scale.
        const __m512 low =
            _mm512_maskz_mul_ps(low_mask, _mm512_maskz_loadu_ps(low_mask, src), factor);
        const __m512 high =
            _mm512_maskz_mul_ps(high_mask, _mm512_maskz_loadu_ps(high_mask, src + 16), factor);
        _mm512_storeu_si512(dst + 16 * i, (__m512i)_mm512_cvtne2ps_pbh(high, low));
      }
    }
    out += h * 16 * chunks;
    ir += h;
  }
}

// C[0:MR, 0:16·NV] = (C +) Σ over `pairs` pair steps of A's packed panel times the pair rows of W
// at w + p·ldw, + the row `bias` (the tile's columns of it) when not `add` and it is not null;
// the last vector of each row of W, C and the bias goes under `last` (the n edge).
template <int MR, int NV>
void micro_kernel(Index pairs, const std::uint32_t* a, const std::uint32_t* w, Index ldw, float* c,
                  Index ldc, bool add, const float* bias, __mmask16 last) {
  const float* c_row = c;
#pragma GCC unroll 1
  for (int i = 0; i < MR; ++i, c_row += ldc) {
    __builtin_prefetch(c_row, 1, 3);
    __builtin_prefetch(c_row + 16 * NV - 1, 1, 3);
  }
  __m512 acc[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (Index p0 = 0; p0 < pairs; p0 += 16, a += 16 * MR) {
    const Index steps = pairs - p0 < 16 ? pairs - p0 : 16;
    for (Index q = 0; q < steps; ++q, w += ldw) {
      __m512i wv[NV];
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v)
        wv[v] = v == NV - 1 ? _mm512_maskz_loadu_epi32(last, w + 16 * v)
                            : _mm512_loadu_si512(w + 16 * v);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const __m512i ai = _mm512_set1_epi32(int(a[16 * i + q]));
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v)
          acc[i][v] = _mm512_dpbf16_ps(acc[i][v], (__m512bh)ai, (__m512bh)wv[v]);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      float* out = c + i * ldc + 16 * v;
      const __mmask16 mask = v == NV - 1 ? last : __mmask16(0xFFFF);
      const __m512 sum = add ? _mm512_add_ps(acc[i][v], _mm512_maskz_loadu_ps(mask, out))
                         : bias != nullptr
                             ? _mm512_add_ps(acc[i][v], _mm512_maskz_loadu_ps(mask, bias + 16 * v))
                             : acc[i][v];
      _mm512_mask_storeu_ps(out, mask, sum);
    }
}

using MicroKernel = void (*)(Index, const std::uint32_t*, const std::uint32_t*, Index, float*,
                             Index, bool, const float*, __mmask16);

template <int NV, int... Rows>
constexpr std::array<MicroKernel, sizeof...(Rows)> kernel_row(std::integer_sequence<int, Rows...>) {
  return {&micro_kernel<Rows + 1, NV>...};
}
template <int... Vectors>
constexpr std::array<std::array<MicroKernel, kMr>, sizeof...(Vectors)> kernel_table(
    std::integer_sequence<int, Vectors...>) {
  return {kernel_row<Vectors + 1>(std::make_integer_sequence<int, kMr>())...};
}
// [NV − 1][MR − 1]: every edge tile has its own fully unrolled kernel.
inline constexpr auto kKernels = kernel_table(std::make_integer_sequence<int, kNv>());

// pack_row_pairs_portable and pack_column_pairs_portable by vcvtneps2bf16, which flushes
// subnormals to zero (as vdpbf16ps reads them anyway): 16 pairs per step.
inline void pack_row_pairs_avx512(const float* m, Index ld, Index rows, Index cols,
                                  std::uint32_t* out, Index out_stride) {
  for (Index p = 0; p < (rows + 1) / 2; ++p) {
    const float* even = m + 2 * p * ld;
    const bool has_odd = 2 * p + 1 < rows;
    for (Index j = 0; j < cols; j += 16) {
      const __mmask16 mask = lanes(cols - j);
      const __m512 low = _mm512_maskz_loadu_ps(mask, even + j);
      const __m512 high =
          has_odd ? _mm512_maskz_loadu_ps(mask, even + ld + j) : _mm512_setzero_ps();
      const __m512i low_bits = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(low));
      const __m512i high_bits = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(high));
      _mm512_mask_storeu_epi32(out + p * out_stride + j, mask,
                               _mm512_or_si512(low_bits, _mm512_slli_epi32(high_bits, 16)));
    }
  }
}
// Blocks of 16 rows × 32 columns: each row's 16 pairs in one register (vcvtne2ps2bf16 keeps the
// columns in order), then the 16 × 16 transpose, so that each pair row is stored 16 wide.
inline void pack_column_pairs_avx512(const float* m, Index ld, Index rows, Index cols,
                                     std::uint32_t* out, Index out_stride) {
  const Index pairs = (cols + 1) / 2;
  for (Index s0 = 0; s0 < rows; s0 += 16) {
    const Index block = rows - s0 < 16 ? rows - s0 : 16;
    for (Index c = 0; c < cols; c += kChunk) {
      const __mmask16 low_mask = lanes(cols - c),
                      high_mask = lanes(cols - c > 16 ? cols - c - 16 : 0);
      __m512 r[16];
      for (Index i = 0; i < 16; ++i) {
        r[i] = _mm512_setzero_ps();
        if (i >= block) continue;
        const float* src = m + (s0 + i) * ld + c;
        r[i] = (__m512)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high_mask, src + 16),
                                           _mm512_maskz_loadu_ps(low_mask, src));
      }
      avx512_gemm::transpose16(r);
      const Index chunk_pairs = pairs - c / 2 < 16 ? pairs - c / 2 : 16;
      for (Index q = 0; q < chunk_pairs; ++q)
        _mm512_mask_storeu_ps(out + (c / 2 + q) * out_stride + s0, lanes(block), r[q]);
    }
  }
}

inline void run(const float* a, Index lda, const std::uint32_t* w, Index ldw, float* c, Index ldc,
                Index m, Index n, Index k, bool accumulate, const float* column_bias, float a_scale,
                std::uint32_t* block_a) {
  const Index kc = depth_block(k), mc = row_block(m);
  for (Index ic = 0; ic < m; ic += mc) {
    const Index mb = m - ic < mc ? m - ic : mc;
    const RowSplit split(mb);
    for (Index pc = 0; pc < k; pc += kc) {
      const Index kb = k - pc < kc ? k - pc : kc;
      const Index row_pairs = packed_row_pairs(kb);
      const bool add = accumulate || pc > 0;
      pack_a(a, lda, ic, mb, pc, kb, a_scale, block_a);
      const std::uint32_t* w_block = w + (pc / 2) * ldw;
      for (Index jr = 0; jr < n; jr += kNr) {
        const Index width = n - jr < kNr ? n - jr : kNr;
        const Index vectors = (width + 15) / 16;
        const __mmask16 last = lanes(width - 16 * (vectors - 1));
        const float* bias = add || column_bias == nullptr ? nullptr : column_bias + jr;
        for (Index t = 0, ir = 0; t < split.tiles; ++t) {
          const Index h = split.height(t);
          kKernels[vectors - 1][h - 1]((kb + 1) / 2, block_a + ir * row_pairs, w_block + jr, ldw,
                                       c + (ic + ir) * ldc + jr, ldc, add, bias, last);
          ir += h;
        }
      }
    }
  }
}

}  // namespace bf16_gemm

#else

inline constexpr bool kHaveBFloat16Gemm = false;

#endif  // __AVX512BF16__

// Bytes of A rounded to bfloat16 for one block of ≤ kMaxBlockRows rows, padded to 16
// (gemm_amx.hpp's tiles; the pairs engine's blocks are no larger), by one depth block.
inline std::size_t rounded_block_bytes(Index m, Index k) {
  if (m <= 0 || k <= 0) return 0;
  return array_bytes<std::uint16_t>(
      bf16_gemm::round_up(std::min(m, bf16_gemm::kMaxBlockRows), 16) *
      bf16_gemm::round_up(std::min(k, bf16_gemm::kMaxKc), bf16_gemm::kChunk));
}
// gemm_bfloat16's scratch for m × n × k, whichever engine serves it (oneDNN's: all of A).
inline std::size_t gemm_bfloat16_workspace_size(Index m, Index /*n*/, Index k) {
#if defined(SDMHA_WITH_ONEDNN)
  return std::max(rounded_block_bytes(m, k), array_bytes<std::uint16_t>(m * k));
#endif
  return rounded_block_bytes(m, k);
}

// M (rows × cols, leading dimension ld) rounded and packed in pairs of rows, and Mᵀ packed the
// same way (see the portable forms): the vdpbf16ps form where the build has AVX512_BF16 and
// SDMHA_KERNELS allows it (sdmha/kernels.hpp; it flushes subnormals, the portable form does not,
// so packing and product always take the same side).
inline void pack_row_pairs(const float* m, Index ld, Index rows, Index cols, std::uint32_t* out,
                           Index out_stride) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (avx512_kernels_allowed())
    return bf16_gemm::pack_row_pairs_avx512(m, ld, rows, cols, out, out_stride);
#endif
  pack_row_pairs_portable(m, ld, rows, cols, out, out_stride);
}
inline void pack_column_pairs(const float* m, Index ld, Index rows, Index cols, std::uint32_t* out,
                              Index out_stride) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (avx512_kernels_allowed())
    return bf16_gemm::pack_column_pairs_avx512(m, ld, rows, cols, out, out_stride);
#endif
  pack_column_pairs_portable(m, ld, rows, cols, out, out_stride);
}

// C (m × n) = bf16(a_scale·A)·W, or += when `accumulate`: vdpbf16ps where the build has
// AVX512_BF16 (and SDMHA_KERNELS allows it), the portable loop elsewhere. Packs A in `scratch` (at
// least gemm_bfloat16_workspace_size(m, n, k) bytes; with less, in memory of its own: the same
// result, with an allocation). `column_bias` (n floats, only when not accumulating) is added to
// every row of C, bitwise as if C held it and the product were accumulated onto it, in the first
// depth block's stores.
inline void gemm_bfloat16(const ConstMatrixRef<float>& a, const BFloat16Pairs& w,
                          MatrixRef<float> c, bool accumulate, StageScratch scratch,
                          const float* column_bias = nullptr, float a_scale = 1.f) {
  SDMHA_ASSERT(a.rows() == c.rows() && a.cols() == w.rows && w.cols == c.cols());
  SDMHA_ASSERT(column_bias == nullptr || !accumulate);
  const Index m = c.rows(), n = c.cols(), k = a.cols();
  if (m == 0 || n == 0) return;
  const bool engine = kHaveBFloat16Gemm && avx512_kernels_allowed();
  if (column_bias != nullptr && (k == 0 || !engine)) {  // accumulate onto it
    fill_rows_with<float>(c, column_bias);
    accumulate = true;
    column_bias = nullptr;
  }
  if (k == 0) {
    if (!accumulate) c.setZero();
    return;
  }
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (engine) {
    const Index pairs =
        bf16_gemm::block_a_pairs(bf16_gemm::row_block(m), bf16_gemm::depth_block(k));
    const ScratchOrOwn memory(scratch, array_bytes<std::uint32_t>(pairs));
    std::uint32_t* block_a = ScratchCarver(memory.view()).take<std::uint32_t>(pairs);
    bf16_gemm::run(a.data(), a.outerStride(), w.data, w.stride, c.data(), c.outerStride(), m, n, k,
                   accumulate, column_bias, a_scale, block_a);
    return;
  }
#endif
  (void)scratch;
  gemm_bfloat16_portable(a, w, c, accumulate, a_scale);
}
// C (m × n) = bf16(a_scale·A)·bf16(op(B)), or += when `accumulate`, for a float B: op(B) = B
// (k × n) or, `transpose_b`, Bᵀ (B n × k). B is rounded and packed in pairs into `scratch` first
// (at least gemm_bfloat16_operands_workspace_size(m, n, k) bytes; with less, memory of its own).
inline std::size_t gemm_bfloat16_operands_workspace_size(Index m, Index n, Index k) {
  return array_bytes<std::uint32_t>((k + 1) / 2 * n) + rounded_block_bytes(m, k);
}
inline void gemm_bfloat16_operands(const ConstMatrixRef<float>& a, const ConstMatrixRef<float>& b,
                                   bool transpose_b, MatrixRef<float> c, bool accumulate,
                                   StageScratch scratch, float a_scale = 1.f) {
  const Index n = c.cols(), k = a.cols();
  SDMHA_ASSERT(transpose_b ? b.rows() == n && b.cols() == k : b.rows() == k && b.cols() == n);
  // Both the pairs and the GEMM's packing of A: one allocation at most.
  const ScratchOrOwn memory(scratch, gemm_bfloat16_operands_workspace_size(c.rows(), n, k));
  ScratchCarver carver(memory.view());
  std::uint32_t* pairs = carver.take<std::uint32_t>((k + 1) / 2 * n);
  if (transpose_b)
    pack_column_pairs(b.data(), b.outerStride(), n, k, pairs, n);
  else
    pack_row_pairs(b.data(), b.outerStride(), k, n, pairs, n);
  gemm_bfloat16(a, BFloat16Pairs{pairs, k, n, n}, c, accumulate, carver.rest(), nullptr, a_scale);
}

// The same on a kernel, through its external engine first (a product not accumulated, not empty).
inline void gemm_bfloat16(const ConstMatrixRef<float>& a, const BFloat16Kernel& w,
                          MatrixRef<float> c, bool accumulate, StageScratch scratch,
                          const float* column_bias = nullptr) {
  const bool external = w.external() != nullptr && !accumulate && c.size() != 0 && a.cols() != 0;
  if (external && w.external()->run(a, c, column_bias, scratch)) return;
  gemm_bfloat16(a, w.view(), c, accumulate, scratch, column_bias);
}
inline void gemm_bfloat16_portable(const ConstMatrixRef<float>& a, const BFloat16Kernel& w,
                                   MatrixRef<float> c, bool accumulate) {
  gemm_bfloat16_portable(a, w.view(), c, accumulate);
}

}  // namespace sdmha::detail
