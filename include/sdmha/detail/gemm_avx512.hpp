// sdmha/detail/gemm_avx512.hpp — a packed, register-blocked AVX-512 GEMM for float, in the
// caller's scratch: the engine behind detail::gemm<float> on CPUs with AVX-512F.
//
//   math:  C = α·op(A)·op(B) (+ C when accumulating), op = identity or transpose of a row-major view
//   pre:   shapes agree; C (m × n, row-major, outer stride ≥ n) aliases neither A nor B; scratch of
//          gemm_avx512_workspace_size(m, n, k) bytes, 64-byte aligned (less: it allocates its own)
//   cost:  2·m·n·k flops in 14×32 micro-tiles (28 zmm accumulators) + one packing copy of each
//          operand per pass: A once per (row block, depth block), B once per row block
//
// The same function as detail::gemm for Scalar = float (same arguments, same result up to rounding),
// compiled only with AVX-512F (-march=native on such a CPU, or -mavx512f): kHaveAvx512Gemm says
// whether it is here. It is templated on the operand type only so that this header does not
// include gemm.hpp (which dispatches to it); pass detail::GemmOperand<float>.
//
// Blocking (one core: 48 KB 12-way L1d, 1 MB L2; two 512-bit FMA pipes of 4-cycle latency):
//   - micro-tile MR × NR = 14 × 32: 28 independent accumulator chains (≥ 8 keep both FMA pipes
//     busy), 2 loads of packed B and 14 broadcasts of packed A per 28 FMAs, which leaves two
//     registers for B. NR = 32 divides every width the library runs (64, 128, 512, 2048) and a
//     row of C is two full vectors; the 64-row blocks split 14+14+14+14+8 (the 8×32 tile still has
//     16 chains and runs at the same rate in L1).
//   - kc ≤ 256 (the depth is split into equal blocks, from k alone): a packed B micro-panel of
//     kc × 32 floats (≤ 32 KB) stays in L1 while the row loop streams A micro-panels past it.
//   - mc ≤ 224 rows: the packed A block (mc × kc ≤ 224 KB) stays in L2 across the column loop.
//   - nc ≤ 256 columns: the B block (kc × nc ≤ 256 KB) is packed just before its columns are
//     computed, so it is still in L2 when they are; for m ≤ mc every B element is packed once.
//   Transposed operands (B = Kᵀ for scores, A = Xᵀ for weight gradients) are transposed in
//   registers, 16 × 16 at a time, while packing; the micro-kernel only ever sees packed panels.
//   Every entry of C is the same sequence of FMAs over p (split at the kc boundaries, which depend
//   on k only), whatever its position, m and n: results are deterministic and a row block of C
//   equals the same rows computed as part of a larger product, bit for bit.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <utility>

#include "sdmha/config.hpp"
#include "sdmha/detail/scratch.hpp"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace sdmha::detail {

#if defined(__AVX512F__)

inline constexpr bool kHaveAvx512Gemm = true;

namespace avx512_gemm {

inline constexpr int kMr = 14;          // rows of a micro-tile
inline constexpr int kNv = 2;           // 16-float vectors across a micro-tile
inline constexpr int kNr = 16 * kNv;    // columns of a micro-tile
inline constexpr Index kMaxKc = 256;    // depth of a packed block
inline constexpr Index kMaxMc = 16 * kMr;  // rows of a packed A block (224)

inline Index round_up(Index value, Index step) { return (value + step - 1) / step * step; }

// The depth blocks: k split into equal blocks of at most kMaxKc (a function of k alone).
inline Index depth_block(Index k) {
  const Index blocks = (k + kMaxKc - 1) / kMaxKc;
  return (k + blocks - 1) / blocks;
}
inline Index row_block(Index m) { return m < kMaxMc ? m : kMaxMc; }
inline Index panel_width(Index n) { return n < kNr ? round_up(n, 16) : kNr; }

// Lanes [0, count) of a 16-lane mask, count ∈ [0, 16].
inline __mmask16 lanes(Index count) {
  return count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << unsigned(count)) - 1u);
}

// The shuffles of transpose16, through their zero-masking forms under a full mask (the same
// instructions): GCC 12 warns about the plain forms' internal _mm512_undefined_ps once inlined.
inline __m512 unpack_lo(__m512 x, __m512 y) { return _mm512_maskz_unpacklo_ps(0xFFFF, x, y); }
inline __m512 unpack_hi(__m512 x, __m512 y) { return _mm512_maskz_unpackhi_ps(0xFFFF, x, y); }
inline __m512 unpack_lo64(__m512 x, __m512 y) {
  return _mm512_castpd_ps(_mm512_maskz_unpacklo_pd(0xFF, _mm512_castps_pd(x), _mm512_castps_pd(y)));
}
inline __m512 unpack_hi64(__m512 x, __m512 y) {
  return _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(0xFF, _mm512_castps_pd(x), _mm512_castps_pd(y)));
}
template <int kLanes>
__m512 shuffle_lanes(__m512 x, __m512 y) {
  return _mm512_maskz_shuffle_f32x4(0xFFFF, x, y, kLanes);
}

// r[q][i] ← r[i][q]: the 16 × 16 transpose, in four rounds of 16 shuffles.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = unpack_lo(r[i], r[i + 1]);      // per 128-bit lane: a0 b0 a1 b1
    t[i + 1] = unpack_hi(r[i], r[i + 1]);  // a2 b2 a3 b3
  }
  __m512 u[16];  // u[4g + c], lane L: column 4L + c of rows 4g … 4g + 3
  for (int g = 0; g < 4; ++g) {
    u[4 * g + 0] = unpack_lo64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = unpack_hi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = unpack_lo64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = unpack_hi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 v0 = shuffle_lanes<0x88>(u[c], u[4 + c]);  // lanes 0, 2 of rows 0-7
    const __m512 v1 = shuffle_lanes<0xDD>(u[c], u[4 + c]);  // lanes 1, 3
    const __m512 w0 = shuffle_lanes<0x88>(u[8 + c], u[12 + c]);
    const __m512 w1 = shuffle_lanes<0xDD>(u[8 + c], u[12 + c]);
    r[c] = shuffle_lanes<0x88>(v0, w0);       // lane 0 of every row group
    r[8 + c] = shuffle_lanes<0xDD>(v0, w0);   // lane 2
    r[4 + c] = shuffle_lanes<0x88>(v1, w1);   // lane 1
    r[12 + c] = shuffle_lanes<0xDD>(v1, w1);  // lane 3
  }
}

// One operand as the engine reads it: element (i, j) of op(X) at data[i·row_step + j·col_step],
// one of the two steps being 1.
struct View {
  const float* data;
  Index row_step, col_step;
  const float* at(Index i, Index j) const { return data + i * row_step + j * col_step; }
};

// Packs rows [i0, i0 + rows) × depth [p0, p0 + depth) of op(A) into micro-panels of kMr rows
// (the last one `rows mod kMr`), each laid out depth-major: panel[p·h + i], h the panel's rows.
inline void pack_a(const View& a, Index i0, Index rows, Index p0, Index depth, float* out) {
  for (Index ir = 0; ir < rows; ir += kMr) {
    const Index h = rows - ir < kMr ? rows - ir : kMr;
    const __mmask16 h_mask = lanes(h);
    if (a.row_step == 1) {  // op(A) column-major: the h entries of a depth step are contiguous
      for (Index p = 0; p < depth; ++p)
        _mm512_mask_storeu_ps(out + p * h, h_mask, _mm512_maskz_loadu_ps(h_mask, a.at(i0 + ir, p0 + p)));
    } else {  // op(A) row-major: transpose 16 depth steps of the h rows at a time
      for (Index p = 0; p < depth; p += 16) {
        const Index d = depth - p < 16 ? depth - p : 16;
        const __mmask16 d_mask = lanes(d);
        __m512 r[16];
        for (Index i = 0; i < 16; ++i)
          r[i] = i < h ? _mm512_maskz_loadu_ps(d_mask, a.at(i0 + ir + i, p0 + p)) : _mm512_setzero_ps();
        transpose16(r);
        for (Index q = 0; q < d; ++q) _mm512_mask_storeu_ps(out + (p + q) * h, h_mask, r[q]);
      }
    }
    out += h * depth;
  }
}

// Packs depth [p0, p0 + depth) × columns [j0, j0 + cols) of op(B) into micro-panels of kNr
// columns, the last one of `cols mod kNr` rounded up to 16 with zeros; each depth-major:
// panel[p·w + j], w its padded width.
inline void pack_b(const View& b, Index p0, Index depth, Index j0, Index cols, float* out) {
  for (Index jr = 0; jr < cols; jr += kNr) {
    const Index w = cols - jr < kNr ? cols - jr : kNr;
    const Index wpad = round_up(w, 16);
    if (b.col_step == 1 && w == kNr) {  // op(B) row-major, a full panel: kNr floats per depth step
      const float* src = b.at(p0, j0 + jr);
      for (Index p = 0; p < depth; ++p, src += b.row_step)
        for (int v = 0; v < kNv; ++v) _mm512_storeu_ps(out + p * kNr + 16 * v, _mm512_loadu_ps(src + 16 * v));
    } else if (b.col_step == 1) {  // the last, narrower panel: masked, zero-filled to wpad
      for (Index p = 0; p < depth; ++p) {
        const float* src = b.at(p0 + p, j0 + jr);
        for (Index v = 0; v < wpad; v += 16)
          _mm512_storeu_ps(out + p * wpad + v, _mm512_maskz_loadu_ps(lanes(w - v), src + v));
      }
    } else {  // op(B) column-major (e.g. Kᵀ): transpose 16 columns × 16 depth steps at a time
      for (Index v = 0; v < wpad; v += 16) {
        const Index cw = w - v < 16 ? w - v : 16;
        for (Index p = 0; p < depth; p += 16) {
          const Index d = depth - p < 16 ? depth - p : 16;
          const __mmask16 d_mask = lanes(d);
          __m512 r[16];
          for (Index j = 0; j < 16; ++j)
            r[j] = j < cw ? _mm512_maskz_loadu_ps(d_mask, b.at(p0 + p, j0 + jr + v + j)) : _mm512_setzero_ps();
          transpose16(r);
          for (Index q = 0; q < d; ++q) _mm512_storeu_ps(out + (p + q) * wpad + v, r[q]);
        }
      }
    }
    out += wpad * depth;
  }
}

// Cache lines of an operand's source to bring into L2 while the micro-kernels run, one per depth
// step: `rows` rows `stride` floats apart, `lines` lines from the start of each.
struct PrefetchWalk {
  const float* row = nullptr;
  Index stride = 0, lines = 0, line = 0, rows = 0;
};

// The micro-kernel: C[0:MR, 0:16·NV] = α·Ã·B̃ (+ C when `add`), Ã packed [p·MR + i], B̃ packed
// [p·16·NV + j]; the last vector of each row of C is stored under `last` (the n edge). Each
// depth step also prefetches the next line of `walk` (the source of the next panel of B).
template <int MR, int NV>
void micro_kernel(Index depth, const float* a, const float* b, float* c, Index ldc, float alpha, bool add,
                  __mmask16 last, PrefetchWalk& walk) {
  __m512 acc[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  const float* pf_row = walk.row;
  Index pf_line = walk.line, pf_rows = walk.rows;
  const Index pf_stride = walk.stride, pf_lines = walk.lines;
  for (Index p = 0; p < depth; ++p) {
    if (pf_rows > 0) {
      _mm_prefetch(reinterpret_cast<const char*>(pf_row + 16 * pf_line), _MM_HINT_T1);
      if (++pf_line == pf_lines) {
        pf_line = 0;
        pf_row += pf_stride;
        --pf_rows;
      }
    }
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_ps(b + 16 * v);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512 ai = _mm512_set1_ps(a[i]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(ai, bv[v], acc[i][v]);
    }
    a += MR;
    b += 16 * NV;
  }
  walk.row = pf_row;
  walk.line = pf_line;
  walk.rows = pf_rows;
  const __m512 scale = _mm512_set1_ps(alpha);
  if (add) {
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        float* row = c + i * ldc + 16 * v;
        const __mmask16 mask = v == NV - 1 ? last : __mmask16(0xFFFF);
        _mm512_mask_storeu_ps(row, mask, _mm512_fmadd_ps(acc[i][v], scale, _mm512_maskz_loadu_ps(mask, row)));
      }
  } else {
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const __mmask16 mask = v == NV - 1 ? last : __mmask16(0xFFFF);
        _mm512_mask_storeu_ps(c + i * ldc + 16 * v, mask, _mm512_mul_ps(acc[i][v], scale));
      }
  }
}

using MicroKernel = void (*)(Index, const float*, const float*, float*, Index, float, bool, __mmask16,
                             PrefetchWalk&);

template <int NV, int... Rows>
constexpr std::array<MicroKernel, sizeof...(Rows)> kernel_row(std::integer_sequence<int, Rows...>) {
  return {&micro_kernel<Rows + 1, NV>...};
}
template <int... Vectors>
constexpr std::array<std::array<MicroKernel, kMr>, sizeof...(Vectors)> kernel_table(
    std::integer_sequence<int, Vectors...>) {
  return {kernel_row<Vectors + 1>(std::make_integer_sequence<int, kMr>())...};
}
// kKernels[NV − 1][MR − 1]: every edge tile has its own fully unrolled kernel.
inline constexpr std::array<std::array<MicroKernel, kMr>, kNv> kKernels =
    kernel_table(std::make_integer_sequence<int, kNv>());

template <typename Operand>
View view_of(const Operand& x) {
  return x.row_major ? View{x.data, x.stride, 1} : View{x.data, 1, x.stride};
}

// Bytes of packing scratch for one (m × n, depth k) product.
inline std::size_t workspace_bytes(Index m, Index n, Index k) {
  if (m <= 0 || n <= 0 || k <= 0) return 0;
  const Index kc = depth_block(k);
  return array_bytes<float>(row_block(m) * kc) + array_bytes<float>(panel_width(n) * kc);
}

// The lines of op(B) that the panel of depth [p0, p0 + depth) × columns [j0, j0 + cols) reads.
inline PrefetchWalk source_of_panel(const View& b, Index p0, Index depth, Index j0, Index cols) {
  const float* first = b.at(p0, j0);
  const Index misaligned = (reinterpret_cast<std::uintptr_t>(first) % 64) != 0 ? 1 : 0;
  if (b.col_step == 1) return {first, b.row_step, (cols + 15) / 16 + misaligned, 0, depth};
  return {first, b.col_step, (depth + 15) / 16 + misaligned, 0, cols};
}

inline void run(const View& a, const View& b, float* c, Index ldc, Index m, Index n, Index k, float alpha,
                bool accumulate, float* block_a, float* block_b) {
  const Index kc = depth_block(k), mc = row_block(m);
  for (Index ic = 0; ic < m; ic += mc) {
    const Index mb = m - ic < mc ? m - ic : mc;
    for (Index pc = 0; pc < k; pc += kc) {
      const Index kb = k - pc < kc ? k - pc : kc;
      const bool add = accumulate || pc > 0;
      pack_a(a, ic, mb, pc, kb, block_a);
      for (Index jr = 0; jr < n; jr += kNr) {
        const Index w = n - jr < kNr ? n - jr : kNr;
        const Index vectors = (w + 15) / 16;
        const __mmask16 last = lanes(w - 16 * (vectors - 1));
        pack_b(b, pc, kb, jr, w, block_b);
        // While this panel runs, bring the next one's source into L2: the next columns, else the
        // first columns of the next depth block, else those of the next row block.
        PrefetchWalk walk;
        if (jr + kNr < n) {
          walk = source_of_panel(b, pc, kb, jr + kNr, n - jr - kNr < kNr ? n - jr - kNr : kNr);
        } else if (pc + kb < k || ic + mb < m) {
          const Index next_pc = pc + kb < k ? pc + kb : 0;
          const Index next_kb = k - next_pc < kc ? k - next_pc : kc;
          walk = source_of_panel(b, next_pc, next_kb, 0, n < kNr ? n : kNr);
        }
        for (Index ir = 0; ir < mb; ir += kMr) {
          const Index h = mb - ir < kMr ? mb - ir : kMr;
          kKernels[vectors - 1][h - 1](kb, block_a + ir * kb, block_b, c + (ic + ir) * ldc + jr, ldc, alpha, add,
                                       last, walk);
        }
      }
    }
  }
}

}  // namespace avx512_gemm

// Bytes of packing scratch that gemm_avx512() needs for an (m × n) result of inner dimension k.
inline std::size_t gemm_avx512_workspace_size(Index m, Index n, Index k) {
  return avx512_gemm::workspace_bytes(m, n, k);
}

// C (m × n, row-major, any outer stride) = α·op(A)·op(B), or += when `accumulate`, packing in
// `scratch` (at least gemm_avx512_workspace_size(m, n, k) bytes). With less, it packs into memory
// of its own: the same result, with an allocation. Operand is detail::GemmOperand<float>.
template <typename Operand>
void gemm_avx512(const Operand& a, const Operand& b, MatrixRef<float> c, float alpha, bool accumulate,
                 StageScratch scratch) {
  SDMHA_ASSERT(a.rows == c.rows() && b.cols == c.cols() && a.cols == b.rows);
  const Index m = c.rows(), n = c.cols(), k = a.cols;
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate) c.setZero();
    return;
  }
  const Index kc = avx512_gemm::depth_block(k);
  ScratchCarver carver(scratch);
  float* block_a = carver.take<float>(avx512_gemm::row_block(m) * kc);
  float* block_b = carver.take<float>(avx512_gemm::panel_width(n) * kc);
  struct Free {
    void operator()(float* p) const { ::operator delete(p, std::align_val_t(kScratchAlignment)); }
  };
  std::unique_ptr<float, Free> own;  // only when the caller's scratch is too small
  if (block_a == nullptr || block_b == nullptr) {
    const std::size_t bytes = avx512_gemm::workspace_bytes(m, n, k);
    own.reset(static_cast<float*>(::operator new(bytes, std::align_val_t(kScratchAlignment))));
    block_a = own.get();
    block_b = own.get() + array_bytes<float>(avx512_gemm::row_block(m) * kc) / sizeof(float);
  }
  avx512_gemm::run(avx512_gemm::view_of(a), avx512_gemm::view_of(b), c.data(), c.outerStride(), m, n, k, alpha,
                   accumulate, block_a, block_b);
}

#else

inline constexpr bool kHaveAvx512Gemm = false;

#endif  // __AVX512F__

}  // namespace sdmha::detail
