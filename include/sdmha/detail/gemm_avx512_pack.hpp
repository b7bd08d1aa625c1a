// sdmha/detail/gemm_avx512_pack.hpp — the AVX-512 float GEMM's blocking and packing: its tile and
// block sizes, the split of a block's rows into micro-tiles, and the copies of op(A) and the
// 16 × 16 register transposes of a column-major op(B) that its micro-kernels read.
//
//   pack_a: rows × depth of op(A) → micro-panels of RowSplit's heights, copied in source order
//   pack_b: depth × cols (≤ kNr) of a column-major op(B) → one depth-major panel, cols rounded
//           up to 16 with zeros
//   cost:   one read of the source and one write of the copy; no arithmetic
//
// Compiled only with AVX-512F, as detail/gemm_avx512.hpp (the engine, which includes it and gives
// the reasons for the blocking) is; without it this header declares nothing.
#pragma once

#include "sdmha/config.hpp"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace sdmha::detail::avx512_gemm {

inline constexpr int kMr = 14;  // rows of a micro-tile on packed A
inline constexpr int kNv = 2;   // its 16-float vectors across
inline constexpr Index kNr = 16 * kNv;
inline constexpr int kDirectMr = 6;  // rows of a micro-tile reading A in place
inline constexpr int kDirectNv = 4;  // its 16-float vectors across
inline constexpr Index kDirectNr = 16 * kDirectNv;
inline constexpr Index kMaxKc = 256;  // depth of a block
inline constexpr Index kMaxMc = 256;  // rows of a block

inline Index round_up(Index value, Index step) { return (value + step - 1) / step * step; }

// The depth blocks: k split into equal blocks of at most kMaxKc (a function of k alone).
inline Index depth_block(Index k) {
  const Index blocks = (k + kMaxKc - 1) / kMaxKc;
  return (k + blocks - 1) / blocks;
}
// The row blocks: m split into equal blocks of at most kMaxMc rows.
inline Index row_block(Index m) {
  const Index blocks = (m + kMaxMc - 1) / kMaxMc;
  return blocks > 0 ? (m + blocks - 1) / blocks : 0;
}
// Rows of micro-tile t when `rows` rows are split into as few tiles of at most kMr rows as
// possible, of near-equal heights (64 rows: 13, 13, 13, 13, 12 — no thin tile with few chains).
struct RowSplit {
  Index tiles, base, extra;
  explicit RowSplit(Index rows, Index max_rows = kMr)
      : tiles((rows + max_rows - 1) / max_rows),
        base(tiles > 0 ? rows / tiles : 0),
        extra(tiles > 0 ? rows % tiles : 0) {}
  Index height(Index t) const { return base + (t < extra ? 1 : 0); }
};

// Floats of a packed B panel of depth `depth`, and of a packed A block of rows × depth (the
// chunks of a row-major op(A) are 16 deep, zero-filled past the depth).
inline Index panel_b_floats(Index n, Index depth) {
  return (n < kNr ? round_up(n, 16) : kNr) * depth;
}
inline Index block_a_floats(Index rows, Index depth) { return rows * round_up(depth, 16); }

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

// Packs rows [i0, i0 + rows) × depth [p0, p0 + depth) of op(A) into micro-panels of h ≤ kMr rows
// (RowSplit's heights), copying the source in its own order, no transposes:
//   op(A) column-major (Xᵀ): depth-major, panel[p·h + i] — a depth step is h contiguous floats;
//   op(A) row-major: in chunks of 16 depth steps, panel[c·16·h + i·16 + q] for p = 16c + q — a
//   row's 16 floats stay a cache line (zero-filled past the depth).
// The micro-kernel broadcasts from either at offsets it knows at compile time.
inline void pack_a(const View& a, Index i0, Index rows, Index p0, Index depth, float* out) {
  const RowSplit split(rows);
  if (a.row_step == 1) {  // op(A) column-major: read each depth step's row of the source once
    // The tiles are split.extra of height base + 1, then the rest of height base.
    const Index tall = split.base + 1, tall_rows = split.extra * tall;
    const __mmask16 tall_mask = lanes(tall), base_mask = lanes(split.base);
    for (Index p = 0; p < depth; ++p) {
      const float* src = a.at(i0, p0 + p);
      float* dst = out + p * tall;
      for (Index t = 0; t < split.extra; ++t, src += tall, dst += tall * depth)
        _mm512_mask_storeu_ps(dst, tall_mask, _mm512_maskz_loadu_ps(tall_mask, src));
      dst = out + tall_rows * depth + p * split.base;
      for (Index t = split.extra; t < split.tiles;
           ++t, src += split.base, dst += split.base * depth)
        _mm512_mask_storeu_ps(dst, base_mask, _mm512_maskz_loadu_ps(base_mask, src));
    }
    return;
  }
  const Index chunks = (depth + 15) / 16;
  for (Index t = 0, ir = 0; t < split.tiles; ++t) {  // op(A) row-major
    const Index h = split.height(t);
    for (Index ch = 0; ch < chunks; ++ch) {
      const __mmask16 d_mask = lanes(depth - 16 * ch);
      float* dst = out + ch * 16 * h;
      for (Index i = 0; i < h; ++i)
        _mm512_storeu_ps(dst + 16 * i,
                         _mm512_maskz_loadu_ps(d_mask, a.at(i0 + ir + i, p0 + 16 * ch)));
    }
    out += h * 16 * chunks;
    ir += h;
  }
}

// Packs depth [p0, p0 + depth) × columns [j0, j0 + cols) (cols ≤ kNr) of a column-major op(B)
// (a row-major one is read in place) into one depth-major panel, out[p·w + j], w = cols rounded up
// to 16 with zeros: 16 × 16 squares of the source, each row of which is 16 contiguous floats of
// one column, transposed in registers.
inline void pack_b(const View& b, Index p0, Index depth, Index j0, Index cols, float* out) {
  const Index w = round_up(cols, 16);
  for (Index v = 0; v < w; v += 16) {
    const Index cw = cols - v < 16 ? cols - v : 16;
    const float* column = b.at(p0, j0 + v);  // column j of the square at column + j·stride
    for (Index p = 0; p < depth; p += 16, column += 16) {
      const Index d = depth - p < 16 ? depth - p : 16;
      __m512 r[16];
      if (cw == 16 && d == 16) {  // a full square, branch-free
        for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(column + j * b.col_step);
        transpose16(r);
        for (int q = 0; q < 16; ++q) _mm512_storeu_ps(out + (p + q) * w + v, r[q]);
      } else {  // an edge: masked, zero-filled
        for (Index j = 0; j < 16; ++j)
          r[j] = j < cw ? _mm512_maskz_loadu_ps(lanes(d), column + j * b.col_step)
                        : _mm512_setzero_ps();
        transpose16(r);
        for (Index q = 0; q < d; ++q) _mm512_storeu_ps(out + (p + q) * w + v, r[q]);
      }
    }
  }
}

}  // namespace sdmha::detail::avx512_gemm

#endif  // __AVX512F__
