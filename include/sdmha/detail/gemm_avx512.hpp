// sdmha/detail/gemm_avx512.hpp — a register-blocked AVX-512 GEMM for float, packing into the
// caller's scratch: the engine for detail::gemm<float> on CPUs with AVX-512F.
//
//   math:  C = α·op(A)·op(B) (+ C when accumulating, + 1·bᵀ given a column bias b), op(X) = X or
//          Xᵀ of a row-major view
//   pre:   shapes agree; C (m × n, row-major, stride ≥ n) aliases neither A nor B; scratch of
//          gemm_avx512_workspace_size(m, n, k) bytes (less: same result, in memory of its own)
//   cost:  2·m·n·k flops in 14×32 or 6×64 micro-tiles, + one copy of A per depth block (none
//          when n ≤ 64) and one transpose of B per row block (only when op(B) is column-major)
//
// The same function as detail::gemm for Scalar = float (same arguments, same result up to
// rounding), compiled only with AVX-512F (-march=native on such a CPU, or -mavx512f): check
// kHaveAvx512Gemm. It is templated on the operand type only so that this header needs nothing of
// gemm.hpp (which is to dispatch to it): pass detail::GemmOperand<float>.
//
// Blocking, for one core with a 48 KB L1d, 1 MB of L2 and two 512-bit FMA pipes of 4-cycle latency
// (≥ 8 independent accumulators keep both busy):
//   - Micro-tiles of up to 14 × 32 (28 zmm accumulators; per depth step 2 loads of B and 14
//     broadcasts of A for 28 FMAs). 32 divides every width the layer runs (64 … 2048) and makes a
//     row of C two full vectors; the rows of a block are split into tiles of near-equal heights
//     (64 = 13+13+13+13+12), so no thin tile runs with few chains.
//   - B row-major (X·W, P·V, Xᵀ·dY) is read in place: the micro-kernel loads its rows where they
//     are (from L2, where a prefetch walk has brought them); no copy of W per 64-row block. B
//     column-major (Q·Kᵀ, dY·Wᵀ) is transposed 16 × 16 in registers into a 32-wide panel (≤ 32 KB).
//   - A is packed per (row block, depth block) without transposing: a row-major op(A) in 16-deep
//     chunks (each row's 16 floats one cache line), a column-major one depth step by depth step —
//     a contiguous copy either way, whose rows no longer collide in cache sets whatever the
//     source's stride. When one panel covers n (n ≤ 64: P·V, dV = Pᵀ·dO) A would be read once
//     anyway: it is read in place by 6 × 64 tiles (24 accumulators; ≤ 6 rows at a time, so that
//     rows a multiple of 4 KB apart still fit the 12 ways of an L1 set) and nothing is packed.
//   - kc ≤ 256, k split into equal depth blocks: an A micro-panel (≤ 14 KB) and the rows of B a
//     tile streams stay in L1/L2; C is revisited once per depth block.
//   - mc ≤ 256 rows, m split into equal row blocks: the packed A block (≤ 256 KB) stays in L2 while
//     every panel of B passes it.
//   - While a panel runs, its micro-kernels prefetch (one line per depth step) the next panel's B
//     and, over the block's last panels only, the next block's A into L2; each tile prefetches
//     its C for writing. Without this the copies of A and the transposes of B wait on L3.
//   Every entry of C is one fixed sequence of FMAs over p (split at the depth blocks, which
//   depend on k alone) whatever m, n, its position and the path: results are deterministic and a
//   row block of C is, bit for bit, the same rows of a larger product.
//
// The blocking sizes and the packing routines: detail/gemm_avx512_pack.hpp.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "sdmha/config.hpp"
#include "sdmha/detail/gemm_avx512_pack.hpp"
#include "sdmha/detail/scratch.hpp"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace sdmha::detail {

// Every row of C set to `row` (c.cols() scalars): where a column bias goes when a GEMM's own
// stores cannot add it (an empty depth, or a path that accumulates onto C).
template <typename Scalar>
void fill_rows_with(MatrixRef<Scalar> c, const Scalar* row) {
  c.rowwise() = Eigen::Map<const Eigen::Matrix<Scalar, 1, Eigen::Dynamic>>(row, c.cols());
}

#if defined(__AVX512F__)

inline constexpr bool kHaveAvx512Gemm = true;

namespace avx512_gemm {

// Cache lines of an operand's source to bring into L2 while the micro-kernels run, one per depth
// step: `rows` rows `stride` floats apart, `lines` lines from the start of each.
struct PrefetchWalk {
  const float* row = nullptr;
  Index stride = 0, lines = 0, line = 0, rows = 0;

  void step() {
    if (rows <= 0) return;
    _mm_prefetch(reinterpret_cast<const char*>(row + 16 * line), _MM_HINT_T1);
    if (++line == lines) {
      line = 0;
      row += stride;
      --rows;
    }
  }
};

// How a micro-kernel reads A: packed by pack_a (column-major op(A): [p·h + i]; row-major op(A):
// 16-deep chunks [c·16·h + i·16 + q]), or in place: A(i, p) at a[i·lda + p] (row-major op(A)) or
// a[p·lda + i] (column-major op(A)).
enum class ALayout { kPackedColumns, kPackedChunks, kRows, kColumns };

template <int MR, int NV>
struct Accumulators {
  __m512 acc[MR][NV];

  // acc += A(:, p)·B(p, :), A(i, p) being a_at(i), and the row of B the 16·NV floats at b, the
  // last vector's under `last`.
  template <typename AAt>
  void update(const AAt& a_at, const float* b, __mmask16 last) {
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      bv[v] = v == NV - 1 ? _mm512_maskz_loadu_ps(last, b + 16 * v) : _mm512_loadu_ps(b + 16 * v);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512 ai = _mm512_set1_ps(a_at(i));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(ai, bv[v], acc[i][v]);
    }
  }
};

// The micro-kernel: C[0:MR, 0:16·NV] = α·A·B (+ C when `add`, else + the row `bias` when it is
// not null, the tile's 16·NV columns of it) over `depth` steps, A as `L` says
// (lda: in-place rows only), the rows of B 16·NV floats at b + p·ldb (packed or in place); the
// last vector of each row of B and C goes under `last` (the n edge). Each depth step also
// prefetches a line of each walk (the sources of the next panel of B and next block of A) to L2.
template <int MR, int NV, ALayout L>
void micro_kernel(Index depth, const float* a, Index lda, const float* b, Index ldb, float* c,
                  Index ldc, float alpha, bool add, const float* bias, __mmask16 last,
                  PrefetchWalk& next_b, PrefetchWalk& next_a) {
  // The tile of C is needed after the depth loop: start bringing it in now (for writing).
  const float* c_row = c;
#pragma GCC unroll 1
  for (int i = 0; i < MR; ++i, c_row += ldc) {
    __builtin_prefetch(c_row, 1, 3);
    __builtin_prefetch(c_row + 16 * NV - 1, 1, 3);
    if (NV > 2) __builtin_prefetch(c_row + 16, 1, 3);
    if (NV > 3) __builtin_prefetch(c_row + 32, 1, 3);
  }
  Accumulators<MR, NV> t;
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) t.acc[i][v] = _mm512_setzero_ps();
  PrefetchWalk walk_b = next_b, walk_a = next_a;  // in registers for the loop
  if constexpr (L == ALayout::kPackedChunks) {
    for (Index p0 = 0; p0 < depth; p0 += 16, a += 16 * MR) {
      const Index steps = depth - p0 < 16 ? depth - p0 : 16;
      for (Index q = 0; q < steps; ++q, b += ldb) {
        walk_b.step();
        walk_a.step();
        t.update([&](int i) { return a[16 * i + q]; }, b, last);
      }
    }
  } else if constexpr (L == ALayout::kPackedColumns) {
    for (Index p = 0; p < depth; ++p, a += MR, b += ldb) {
      walk_b.step();
      walk_a.step();
      t.update([&](int i) { return a[i]; }, b, last);
    }
  } else if constexpr (L == ALayout::kColumns) {
    for (Index p = 0; p < depth; ++p, a += lda, b += ldb) {
      walk_b.step();
      walk_a.step();
      t.update([&](int i) { return a[i]; }, b, last);
    }
  } else {
    const float* rows[MR];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) rows[i] = a + i * lda;
    for (Index p = 0; p < depth; ++p, b += ldb) {
      walk_b.step();
      walk_a.step();
      t.update([&](int i) { return rows[i][p]; }, b, last);
    }
  }
  next_b = walk_b;
  next_a = walk_a;
  const __m512 scale = _mm512_set1_ps(alpha);
  if (add) {
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        float* row = c + i * ldc + 16 * v;
        const __mmask16 mask = v == NV - 1 ? last : __mmask16(0xFFFF);
        _mm512_mask_storeu_ps(
            row, mask, _mm512_fmadd_ps(t.acc[i][v], scale, _mm512_maskz_loadu_ps(mask, row)));
      }
  } else if (bias != nullptr) {  // the same FMA as onto a C that holds the bias in every row
    __m512 bias_vector[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      bias_vector[v] = _mm512_maskz_loadu_ps(v == NV - 1 ? last : __mmask16(0xFFFF), bias + 16 * v);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const __mmask16 mask = v == NV - 1 ? last : __mmask16(0xFFFF);
        _mm512_mask_storeu_ps(c + i * ldc + 16 * v, mask,
                              _mm512_fmadd_ps(t.acc[i][v], scale, bias_vector[v]));
      }
  } else {
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const __mmask16 mask = v == NV - 1 ? last : __mmask16(0xFFFF);
        _mm512_mask_storeu_ps(c + i * ldc + 16 * v, mask, _mm512_mul_ps(t.acc[i][v], scale));
      }
  }
}

using MicroKernel = void (*)(Index, const float*, Index, const float*, Index, float*, Index, float,
                             bool, const float*, __mmask16, PrefetchWalk&, PrefetchWalk&);

template <ALayout L, int NV, int... Rows>
constexpr std::array<MicroKernel, sizeof...(Rows)> kernel_row(std::integer_sequence<int, Rows...>) {
  return {&micro_kernel<Rows + 1, NV, L>...};
}
template <ALayout L, int kMaxRows, int... Vectors>
constexpr std::array<std::array<MicroKernel, kMaxRows>, sizeof...(Vectors)> kernel_table(
    std::integer_sequence<int, Vectors...>) {
  return {kernel_row<L, Vectors + 1>(std::make_integer_sequence<int, kMaxRows>())...};
}
// [NV − 1][MR − 1]: every edge tile has its own fully unrolled kernel. Packed A: tiles of up to
// kMr × 32; A in place: up to kDirectMr × 64 (a row-major A is read kDirectMr cache lines at a
// time, all in one L1 set when its stride is a multiple of 4 KB: 6 of the set's 12 ways).
template <ALayout L>
inline constexpr auto kKernels = kernel_table<L, kMr>(std::make_integer_sequence<int, kNv>());
template <ALayout L>
inline constexpr auto kDirectKernels =
    kernel_table<L, kDirectMr>(std::make_integer_sequence<int, kDirectNv>());

template <typename Operand>
View view_of(const Operand& x) {
  return x.row_major ? View{x.data, x.stride, 1} : View{x.data, 1, x.stride};
}

// Bytes of packing scratch for one (m × n, depth k) product, and for every smaller one: the
// blocks run are at most min(m, kMaxMc) rows and min(k, kMaxKc) deep, and the bound is taken on
// those caps, not on row_block(m) and depth_block(k) themselves, which are not monotone (m = 320
// runs blocks of 160 rows, m = 256 one of 256). A caller that plans for the largest shape of a
// pass so covers all its smaller tiles.
inline std::size_t workspace_bytes(Index m, Index n, Index k) {
  if (m <= 0 || n <= 0 || k <= 0) return 0;
  const Index kc = std::min(k, kMaxKc);
  return array_bytes<float>(block_a_floats(std::min(m, kMaxMc), kc)) +
         array_bytes<float>(panel_b_floats(n, kc));
}

// The lines of op(B) that the panel of depth [p0, p0 + depth) × columns [j0, j0 + cols) reads.
inline PrefetchWalk source_of_panel(const View& b, Index p0, Index depth, Index j0, Index cols) {
  const float* first = b.at(p0, j0);
  const Index misaligned = (reinterpret_cast<std::uintptr_t>(first) % 64) != 0 ? 1 : 0;
  if (b.col_step == 1) return {first, b.row_step, (cols + 15) / 16 + misaligned, 0, depth};
  return {first, b.col_step, (depth + 15) / 16 + misaligned, 0, cols};
}
// The lines of op(A) that the block of rows [i0, i0 + rows) × depth [p0, p0 + depth) reads.
inline PrefetchWalk source_of_block(const View& a, Index i0, Index rows, Index p0, Index depth) {
  const float* first = a.at(i0, p0);
  const Index misaligned = (reinterpret_cast<std::uintptr_t>(first) % 64) != 0 ? 1 : 0;
  if (a.col_step == 1) return {first, a.row_step, (depth + 15) / 16 + misaligned, 0, rows};
  return {first, a.col_step, (rows + 15) / 16 + misaligned, 0, depth};
}

// Whether a product reads A in place (tiles of kDirectMr × 64) rather than packing it: when one
// panel of B covers n, so that A is read once per depth block anyway (P·V, dV = Pᵀ·dO), and B is
// row-major (read in place too). Otherwise a packed A block is shared by n/32 panels, and packing
// it (a copy) keeps its rows from competing for cache sets whatever the source's stride.
inline bool reads_a_in_place(const View& b, Index n) { return b.col_step == 1 && n <= kDirectNr; }

inline void run(const View& a, const View& b, float* c, Index ldc, Index m, Index n, Index k,
                float alpha, bool accumulate, const float* column_bias, float* block_a,
                float* block_b) {
  const Index kc = depth_block(k), mc = row_block(m);
  const bool direct = reads_a_in_place(b, n), chunked_a = a.row_step != 1;
  const Index nr = direct ? kDirectNr : kNr, max_rows = direct ? kDirectMr : kMr;
  for (Index ic = 0; ic < m; ic += mc) {
    const Index mb = m - ic < mc ? m - ic : mc;
    for (Index pc = 0; pc < k; pc += kc) {
      const Index kb = k - pc < kc ? k - pc : kc;
      const Index panel_a = chunked_a ? round_up(kb, 16) : kb;  // floats per row of a packed panel
      const bool add = accumulate || pc > 0;
      const RowSplit split(mb, max_rows);
      if (!direct) pack_a(a, ic, mb, pc, kb, block_a);
      // The block after this one: the next depth block of these rows, else the next rows.
      const bool last_depth = pc + kb >= k, last_block = last_depth && ic + mb >= m;
      const Index next_ic = last_depth ? ic + mb : ic, next_pc = last_depth ? 0 : pc + kb;
      const Index next_kb = k - next_pc < kc ? k - next_pc : kc;
      const Index next_mb = m - next_ic < mc ? m - next_ic : mc;
      // While a panel of B runs, its micro-kernels bring the next panel's B into L2, and over the
      // last panels of the block, the next block's A (one line per depth step of their tiles):
      // fetched earlier, it would be evicted from L2 before its turn.
      const PrefetchWalk block_walk =
          last_block ? PrefetchWalk{} : source_of_block(a, next_ic, next_mb, next_pc, next_kb);
      const Index steps_per_panel = split.tiles * kb, panels = (n + nr - 1) / nr;
      const Index walk_panels =
          (block_walk.rows * block_walk.lines + steps_per_panel - 1) / steps_per_panel;
      const Index walk_start = (panels > walk_panels ? panels - walk_panels : 0) * nr;
      PrefetchWalk next_a;
      for (Index jr = 0; jr < n; jr += nr) {
        if (jr == walk_start) next_a = block_walk;
        const Index w = n - jr < nr ? n - jr : nr;
        const Index vectors = (w + 15) / 16;
        const __mmask16 last = lanes(w - 16 * (vectors - 1));
        // A row-major op(B) is read where it is; a column-major one is packed (transposed).
        const float* panel_b = b.at(pc, jr);
        Index ldb = b.row_step;
        if (b.col_step != 1) {
          pack_b(b, pc, kb, jr, w, block_b);
          panel_b = block_b;
          ldb = 16 * vectors;
        }
        const float* bias = add || column_bias == nullptr ? nullptr : column_bias + jr;
        PrefetchWalk next_b;
        if (jr + nr < n)
          next_b = source_of_panel(b, pc, kb, jr + nr, n - jr - nr < nr ? n - jr - nr : nr);
        else if (!last_block)
          next_b = source_of_panel(b, next_pc, next_kb, 0, n < nr ? n : nr);
        for (Index t = 0, ir = 0; t < split.tiles; ++t) {
          const Index h = split.height(t);
          float* tile_c = c + (ic + ir) * ldc + jr;
          if (direct && chunked_a)
            kDirectKernels<ALayout::kRows>[vectors - 1][h - 1](kb, a.at(ic + ir, pc), a.row_step,
                                                               panel_b, ldb, tile_c, ldc, alpha,
                                                               add, bias, last, next_b, next_a);
          else if (direct)
            kDirectKernels<ALayout::kColumns>[vectors - 1][h - 1](kb, a.at(ic + ir, pc), a.col_step,
                                                                  panel_b, ldb, tile_c, ldc, alpha,
                                                                  add, bias, last, next_b, next_a);
          else if (chunked_a)
            kKernels<ALayout::kPackedChunks>[vectors - 1][h - 1](kb, block_a + ir * panel_a, 0,
                                                                 panel_b, ldb, tile_c, ldc, alpha,
                                                                 add, bias, last, next_b, next_a);
          else
            kKernels<ALayout::kPackedColumns>[vectors - 1][h - 1](kb, block_a + ir * panel_a, 0,
                                                                  panel_b, ldb, tile_c, ldc, alpha,
                                                                  add, bias, last, next_b, next_a);
          ir += h;
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
// `column_bias` (n floats, only when not accumulating) is added to every row of C, bitwise as if
// C held it in every row and the product were accumulated onto it — in the first depth block's
// stores, without a pass of its own over C.
template <typename Operand>
void gemm_avx512(const Operand& a, const Operand& b, MatrixRef<float> c, float alpha,
                 bool accumulate, StageScratch scratch, const float* column_bias = nullptr) {
  SDMHA_ASSERT(a.rows == c.rows() && b.cols == c.cols() && a.cols == b.rows);
  SDMHA_ASSERT(column_bias == nullptr || !accumulate);
  const Index m = c.rows(), n = c.cols(), k = a.cols;
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (column_bias != nullptr)
      fill_rows_with<float>(c, column_bias);
    else if (!accumulate)
      c.setZero();
    return;
  }
  const Index kc = avx512_gemm::depth_block(k);
  const Index a_floats = avx512_gemm::block_a_floats(avx512_gemm::row_block(m), kc);
  const Index b_floats = avx512_gemm::panel_b_floats(n, kc);
  const ScratchOrOwn memory(scratch, array_bytes<float>(a_floats) + array_bytes<float>(b_floats));
  ScratchCarver carver(memory.view());
  float* block_a = carver.take<float>(a_floats);
  float* block_b = carver.take<float>(b_floats);
  avx512_gemm::run(avx512_gemm::view_of(a), avx512_gemm::view_of(b), c.data(), c.outerStride(), m,
                   n, k, alpha, accumulate, column_bias, block_a, block_b);
}

#else

inline constexpr bool kHaveAvx512Gemm = false;

#endif  // __AVX512F__

}  // namespace sdmha::detail
