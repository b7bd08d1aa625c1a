// sdmha/detail/gemm_amx.hpp — C (+)= bf16(a_scale·A)·W on AMX tiles: the bfloat16 mode's GEMM
// stages (the key, value and output projections, the scores and P·V) where the CPU has AMX.
//
//   math:  C = bf16(A)·bf16(W) (+ C, or + 1·bᵀ), each product exact, the sums in float32
//          (gemm_bfloat16.hpp's bound; the order of the sums is the hardware's)
//   pre:   W in pairs of rows (gemm_bfloat16.hpp's layout) padded for the tiles (zeros up to a
//          multiple of 16 pair rows and 16 columns); A (m × k) and C row-major;
//          AMX usable (cpu_features.hpp) for HardwareTiles, nothing for EmulatedTiles
//   cost:  m·n·k multiply-adds, 16·16·32 a TDPBF16PS; A rounded into tiles once per row block
//          and depth block; C's tiles stored to the stack and added to C once per depth block
//
// A tile register holds 16 rows of 64 bytes. TDPBF16PS C, A, B adds to each float C(i, j) of a
// 16 × 16 tile the products of row i of A (32 bfloat16: depth entries 2p, 2p + 1 for p < 16) and
// column j of B, whose row p holds the pairs (W(2p, j), W(2p + 1, j)) of 16 columns: the layout
// of BFloat16Kernel's pairs, so W's tiles load in place, 16 pair rows at the row stride. A is
// rounded into 16-row × 32-deep tiles (zeros past m and k). A block of C is 2 × 2 tiles (32 × 32):
// per step along the depth two tiles of A and two of W feed four products, in registers tmm0–3
// (C), tmm4–5 (A), tmm6–7 (W).
//
// The depth is split into gemm_bfloat16.hpp's depth blocks (a function of k alone, multiples of
// 32 but the last): every entry of C is one fixed sequence of tile products per block, whatever
// its row's place, so a row block of C is bitwise the same rows of a larger product and results
// do not depend on how the rows are split between workers.
//
// Two ways to run the tiles: HardwareTiles (the instructions, by inline assembly, so no compiler
// flag is needed and the choice is made at run time) and EmulatedTiles (the instructions'
// arithmetic in C++, on the product's own tile state, in the order of Intel's intrinsics guide:
// per pair of depth entries the even product, then the odd one, added to C; subnormal inputs
// read as zero and subnormal results flushed): the same code around them, tested on every machine
// through the emulation. The SDM's pseudocode sums even and odd products apart from zero before
// adding them to C, so the hardware may differ from the emulation in the last bits: the hardware
// is tested against the error bounds, never bit for bit against the emulation.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "sdmha/config.hpp"
#include "sdmha/detail/cpu_features.hpp"
#include "sdmha/detail/gemm_bfloat16.hpp"
#include "sdmha/detail/scratch.hpp"
#include "sdmha/stage.hpp"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace sdmha::detail {

// The instructions by inline assembly in AT&T syntax: x86-64 with GCC or Clang, whose
// assemblers know AMX since binutils 2.36 and LLVM 12. SDMHA_NO_AMX_TILES leaves them out (the
// CMake target defines it where its probe finds an assembler without AMX, or -masm=intel).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(SDMHA_NO_AMX_TILES)
#define SDMHA_HAVE_AMX_TILES 1
inline constexpr bool kHaveAmxTiles = true;
#else
inline constexpr bool kHaveAmxTiles = false;
#endif

namespace amx {

inline constexpr Index kTileRows = 16;   // rows of A and C per tile
inline constexpr Index kTileDepth = 32;  // bfloat16 entries of depth per tile of A
inline constexpr Index kTileBytes = 64;  // bytes per tile row
inline constexpr Index kBlock = 32;      // rows and columns of C per block (2 × 2 tiles)
inline constexpr Index kMaxRows = bf16_gemm::kMaxBlockRows;  // rows of A rounded at once

// W's pair rows and columns as the tiles read them.
inline Index padded_pair_rows(Index k) { return bf16_gemm::round_up(k, kTileDepth) / 2; }
inline Index padded_columns(Index n) { return bf16_gemm::round_up(n, kTileRows); }

// A's tiles for one row block and depth block take rounded_block_bytes (gemm_bfloat16.hpp).
static_assert(kMaxRows % kBlock == 0 && kTileRows == 16 && kTileDepth == bf16_gemm::kChunk,
              "rounded_block_bytes counts A's tiles with these sizes");

// The tile configuration (palette 1): the eight tiles 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  std::uint8_t palette = 1, start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  std::uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

#ifdef SDMHA_HAVE_AMX_TILES
// The instructions (AT&T operand order: sources first). Only for a CPU where amx_bfloat16_usable().
struct HardwareTiles {
  void configure() {
    static const TileConfig config;
    asm volatile("ldtilecfg %0" ::"m"(config) : "memory");
  }
  void release() { asm volatile("tilerelease" ::: "memory"); }
  // Every statement clobbers "memory", as the loads and stores do: volatile asm statements are
  // not reordered among themselves by GCC or Clang, and the clobber makes the order with the
  // loads and stores explicit rather than a property of the compiler.
  void zero_sums() {
    asm volatile("tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2\n\ttilezero %%tmm3" ::
                     : "memory");
  }
  void load_a(int which, const void* base, Index stride) {
    if (which == 0)
      asm volatile("tileloadd (%0,%1,1), %%tmm4" ::"r"(base), "r"(stride) : "memory");
    else
      asm volatile("tileloadd (%0,%1,1), %%tmm5" ::"r"(base), "r"(stride) : "memory");
  }
  void load_w(int which, const void* base, Index stride) {
    if (which == 0)
      asm volatile("tileloadd (%0,%1,1), %%tmm6" ::"r"(base), "r"(stride) : "memory");
    else
      asm volatile("tileloadd (%0,%1,1), %%tmm7" ::"r"(base), "r"(stride) : "memory");
  }
  void multiply(bool two_rows, bool two_columns) {
    asm volatile("tdpbf16ps %%tmm6, %%tmm4, %%tmm0" ::: "memory");
    if (two_columns) asm volatile("tdpbf16ps %%tmm7, %%tmm4, %%tmm1" ::: "memory");
    if (two_rows) asm volatile("tdpbf16ps %%tmm6, %%tmm5, %%tmm2" ::: "memory");
    if (two_rows && two_columns) asm volatile("tdpbf16ps %%tmm7, %%tmm5, %%tmm3" ::: "memory");
  }
  // The four sums to out (32 × 32 floats, row stride `stride` bytes).
  void store_sums(float* out, Index stride) {
    float* right = out + 16;
    float* below = out + 16 * (stride / Index(sizeof(float)));
    asm volatile("tilestored %%tmm0, (%0,%1,1)" ::"r"(out), "r"(stride) : "memory");
    asm volatile("tilestored %%tmm1, (%0,%1,1)" ::"r"(right), "r"(stride) : "memory");
    asm volatile("tilestored %%tmm2, (%0,%1,1)" ::"r"(below), "r"(stride) : "memory");
    asm volatile("tilestored %%tmm3, (%0,%1,1)" ::"r"(below + 16), "r"(stride) : "memory");
  }
};
#endif

// The same operations on tile state of its own (one object per product), by the instructions'
// definitions.
class EmulatedTiles {
 public:
  // Tile products run so far in this process (tests check that a stage reached the tiles).
  static std::atomic<std::uint64_t>& products() {
    static std::atomic<std::uint64_t> count{0};
    return count;
  }
  void configure() { configured_ = true; }
  void release() { configured_ = false; }
  void zero_sums() {
    for (int t = 0; t < 4; ++t) std::memset(tile_[t], 0, sizeof(tile_[t]));
  }
  void load(int tile, const void* base, Index stride) {
    SDMHA_ASSERT(configured_);
    for (Index row = 0; row < kTileRows; ++row)
      std::memcpy(tile_[tile] + row * kTileBytes,
                  static_cast<const std::uint8_t*>(base) + row * stride, kTileBytes);
  }
  void load_a(int which, const void* base, Index stride) { load(4 + which, base, stride); }
  void load_w(int which, const void* base, Index stride) { load(6 + which, base, stride); }
  static float input(std::uint16_t bits) {  // subnormals read as zero
    return (bits & 0x7F80u) == 0 ? widen_bfloat16(bits & 0x8000u) : widen_bfloat16(bits);
  }
  static float flushed(float x) {
    return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.f, x) : x;
  }
  void dot(int c, int a, int w) {
    float sums[kTileRows][kTileRows];
    std::uint16_t left[kTileRows][kTileDepth], right[kTileRows][kTileDepth];
    std::memcpy(sums, tile_[c], sizeof(sums));
    std::memcpy(left, tile_[a], sizeof(left));
    std::memcpy(right, tile_[w], sizeof(right));
    for (Index i = 0; i < kTileRows; ++i) {
      for (Index p = 0; p < kTileRows; ++p)
        for (Index j = 0; j < kTileRows; ++j) {
          sums[i][j] += input(left[i][2 * p]) * input(right[p][2 * j]);
          sums[i][j] += input(left[i][2 * p + 1]) * input(right[p][2 * j + 1]);
        }
      for (Index j = 0; j < kTileRows; ++j) sums[i][j] = flushed(sums[i][j]);
    }
    std::memcpy(tile_[c], sums, sizeof(sums));
    products().fetch_add(1, std::memory_order_relaxed);
  }
  void multiply(bool two_rows, bool two_columns) {
    dot(0, 4, 6);
    if (two_columns) dot(1, 4, 7);
    if (two_rows) dot(2, 5, 6);
    if (two_rows && two_columns) dot(3, 5, 7);
  }
  void store_sums(float* out, Index stride) {
    const Index floats = stride / Index(sizeof(float));
    for (int t = 0; t < 4; ++t)
      for (Index row = 0; row < kTileRows; ++row)
        std::memcpy(out + (t / 2 * kTileRows + row) * floats + t % 2 * kTileRows,
                    tile_[t] + row * kTileBytes, kTileBytes);
  }

 private:
  std::uint8_t tile_[8][kTileRows * kTileBytes] = {};
  bool configured_ = false;
};

// A's rows [i0, i0 + rows) × depth [p0, p0 + depth), times `scale`, rounded to bfloat16 into
// tiles: out[(g·chunks + c)·512 + i·32 + q] = A(i0 + 16g + i, p0 + 32c + q), zero past the rows
// and the depth (vcvtne2ps2bf16 where the build has it, Eigen's rounding elsewhere: both to
// nearest even; they differ only on subnormals, which the tiles read as zero).
inline void pack_tiles(const float* a, Index lda, Index i0, Index rows, Index p0, Index depth,
                       float scale, std::uint16_t* out) {
  const Index chunks = (depth + kTileDepth - 1) / kTileDepth;
  const Index padded_rows = bf16_gemm::round_up(rows, kTileRows);
  for (Index i = 0; i < padded_rows; ++i)
    for (Index c = 0; c < chunks; ++c) {
      std::uint16_t* dst = out + ((i / kTileRows) * chunks + c) * (kTileRows * kTileDepth) +
                           (i % kTileRows) * kTileDepth;
      const Index left = i < rows ? std::min(kTileDepth, depth - c * kTileDepth) : 0;
      const float* src = a + (i0 + i) * lda + p0 + c * kTileDepth;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
      const __mmask16 low = avx512_gemm::lanes(left),
                      high = avx512_gemm::lanes(left > 16 ? left - 16 : 0);
      const __m512 factor = _mm512_set1_ps(scale);
      const __m512 first = _mm512_maskz_mul_ps(low, _mm512_maskz_loadu_ps(low, src), factor);
      const __m512 second =
          _mm512_maskz_mul_ps(high, _mm512_maskz_loadu_ps(high, src + 16), factor);
      _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(second, first));
#else
      for (Index q = 0; q < kTileDepth; ++q)
        dst[q] = q < left ? std::uint16_t(bfloat16_bits(scale * src[q])) : std::uint16_t(0);
#endif
    }
}

// C's block [i, i + rows) × [j, j + columns) = sums (+ C where `add`, else + the bias's columns
// where there is one): the bias first, as if C held it and the sums were added to it.
inline void add_block(const float* sums, Index rows, Index columns, float* c, Index ldc, bool add,
                      const float* bias) {
  for (Index i = 0; i < rows; ++i) {
    float* out = c + i * ldc;
    const float* row = sums + i * kBlock;
    if (add)
      for (Index j = 0; j < columns; ++j) out[j] += row[j];
    else if (bias != nullptr)
      for (Index j = 0; j < columns; ++j) out[j] = bias[j] + row[j];
    else
      std::copy(row, row + columns, out);
  }
}

// One row block × depth block of A (rounded in `tiles`) times W's pair rows from `w_rows` on.
template <class Tiles>
void multiply_panel(Tiles& tile_unit, const std::uint16_t* tiles, Index rows, Index chunks,
                    const BFloat16Pairs& w, const std::uint32_t* w_rows, Index n, float* c,
                    Index ldc, bool add, const float* bias) {
  alignas(64) float sums[kBlock * kBlock];
  const Index tile_elements = kTileRows * kTileDepth, w_stride = w.stride * 4;
  for (Index jr = 0; jr < n; jr += kBlock) {
    const Index columns = std::min(kBlock, n - jr);
    for (Index ir = 0; ir < rows; ir += kBlock) {
      const Index height = std::min(kBlock, rows - ir);
      const bool two_rows = height > kTileRows, two_columns = columns > kTileRows;
      const std::uint16_t* a = tiles + (ir / kTileRows) * chunks * tile_elements;
      tile_unit.zero_sums();
      for (Index ch = 0; ch < chunks; ++ch) {
        tile_unit.load_a(0, a + ch * tile_elements, kTileBytes);
        if (two_rows) tile_unit.load_a(1, a + (chunks + ch) * tile_elements, kTileBytes);
        const std::uint32_t* w_tile = w_rows + ch * kTileRows * w.stride + jr;
        tile_unit.load_w(0, w_tile, w_stride);
        if (two_columns) tile_unit.load_w(1, w_tile + kTileRows, w_stride);
        tile_unit.multiply(two_rows, two_columns);
      }
      float* out = c + ir * ldc + jr;
      if (!add && bias == nullptr && height == kBlock && columns == kBlock) {
        tile_unit.store_sums(out, ldc * Index(sizeof(float)));  // C = the sums: straight to C
        continue;
      }
      tile_unit.store_sums(sums, kBlock * Index(sizeof(float)));
      add_block(sums, height, columns, out, ldc, add, bias == nullptr ? nullptr : bias + jr);
    }
  }
}

}  // namespace amx

// C (m × n) = bf16(a_scale·A)·W (+ 1·bᵀ given a column bias, only when not accumulating), or +=
// when `accumulate`, on Tiles. W is padded for the tiles: zeros up to padded_pair_rows(k) pair
// rows and padded_columns(n) columns (its stride). `panel` holds rounded_block_bytes(m, k) bytes.
template <class Tiles>
void gemm_amx(const ConstMatrixRef<float>& a, const BFloat16Pairs& w, MatrixRef<float> c,
              bool accumulate, const float* column_bias, float a_scale, std::uint16_t* panel) {
  const Index m = c.rows(), n = c.cols(), k = a.cols();
  SDMHA_ASSERT(w.rows == k && w.cols == n && w.stride >= amx::padded_columns(n));
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (accumulate) return;
    if (column_bias != nullptr)
      fill_rows_with<float>(c, column_bias);
    else
      c.setZero();
    return;
  }
  const Index kc = bf16_gemm::depth_block(k);
  Tiles tile_unit;
  tile_unit.configure();
  for (Index ic = 0; ic < m; ic += amx::kMaxRows) {
    const Index rows = std::min(amx::kMaxRows, m - ic);
    for (Index pc = 0; pc < k; pc += kc) {
      const Index depth = std::min(kc, k - pc);
      const bool add = accumulate || pc > 0;
      amx::pack_tiles(a.data(), a.outerStride(), ic, rows, pc, depth, a_scale, panel);
      amx::multiply_panel<Tiles>(tile_unit, panel, rows,
                                 (depth + amx::kTileDepth - 1) / amx::kTileDepth, w,
                                 w.data + (pc / 2) * w.stride, n, c.data() + ic * c.outerStride(),
                                 c.outerStride(), add, add ? nullptr : column_bias);
    }
  }
  tile_unit.release();
}

// The bfloat16 mode's engines for products of two float operands (the scores, P·V).
inline std::size_t gemm_amx_operands_workspace_size(Index m, Index n, Index k) {
  return array_bytes<std::uint32_t>(amx::padded_pair_rows(k) * amx::padded_columns(n)) +
         rounded_block_bytes(m, k);
}

// C (m × n) = bf16(a_scale·A)·bf16(op(B)) (+= when `accumulate`) on Tiles, op(B) = B (k × n) or
// Bᵀ (`transpose_b`, B n × k): B rounded into padded pairs in `scratch` first (at least
// gemm_amx_operands_workspace_size(m, n, k) bytes; with less, memory of its own).
template <class Tiles>
void gemm_amx_operands(const ConstMatrixRef<float>& a, const ConstMatrixRef<float>& b,
                       bool transpose_b, MatrixRef<float> c, bool accumulate, StageScratch scratch,
                       float a_scale) {
  const Index m = c.rows(), n = c.cols(), k = a.cols();
  const Index pair_rows = amx::padded_pair_rows(k), stride = amx::padded_columns(n);
  const ScratchOrOwn memory(scratch, gemm_amx_operands_workspace_size(m, n, k));
  ScratchCarver carver(memory.view());
  std::uint32_t* pairs = carver.take<std::uint32_t>(pair_rows * stride);
  std::uint16_t* panel = carver.take<std::uint16_t>(Index(rounded_block_bytes(m, k) / 2));
  if (transpose_b)
    pack_column_pairs(b.data(), b.outerStride(), n, k, pairs, stride);
  else
    pack_row_pairs(b.data(), b.outerStride(), k, n, pairs, stride);
  const Index filled = (k + 1) / 2;
  for (Index p = 0; p < filled; ++p)
    std::fill(pairs + p * stride + n, pairs + (p + 1) * stride, 0u);
  std::fill(pairs + filled * stride, pairs + pair_rows * stride, 0u);
  gemm_amx<Tiles>(a, BFloat16Pairs{pairs, k, n, stride}, c, accumulate, nullptr, a_scale, panel);
}

// The scratch of gemm_bfloat16_operands on any engine.
inline std::size_t bfloat16_operands_workspace_size(Index m, Index n, Index k) {
  return std::max(gemm_bfloat16_operands_workspace_size(m, n, k),
                  gemm_amx_operands_workspace_size(m, n, k));
}

// The same product on the engine `operands` names (a stage's bfloat16_operands, set).
inline void gemm_bfloat16_operands(const ConstMatrixRef<float>& a, const ConstMatrixRef<float>& b,
                                   bool transpose_b, MatrixRef<float> c, bool accumulate,
                                   StageScratch scratch, float a_scale, BFloat16Operands operands) {
  using Engine = BFloat16Operands::Engine;
  SDMHA_ASSERT(operands.engine() != Engine::none);
  if (operands.engine() == Engine::amx_emulated)
    return gemm_amx_operands<amx::EmulatedTiles>(a, b, transpose_b, c, accumulate, scratch,
                                                 a_scale);
#ifdef SDMHA_HAVE_AMX_TILES
  if (operands.engine() == Engine::amx)
    return gemm_amx_operands<amx::HardwareTiles>(a, b, transpose_b, c, accumulate, scratch,
                                                 a_scale);
#endif
  SDMHA_ASSERT(operands.engine() == Engine::pairs);  // amx only where the CPU has it (x86-64)
  gemm_bfloat16_operands(a, b, transpose_b, c, accumulate, scratch, a_scale);
}

// A BFloat16Kernel's W̃ padded for the tiles: the projections' engine where AMX is the choice.
template <class Tiles>
class AmxBFloat16Gemm final : public ExternalBFloat16Gemm {
 public:
  explicit AmxBFloat16Gemm(const BFloat16Kernel& kernel)
      : k_(kernel.rows()),
        n_(kernel.cols()),
        pairs_(BFloat16Kernel::Pairs::Zero(amx::padded_pair_rows(k_), amx::padded_columns(n_))) {
    pairs_.topLeftCorner(kernel.pairs().rows(), n_) = kernel.pairs();
  }

  bool run(const ConstMatrixRef<float>& a, MatrixRef<float> c, const float* column_bias,
           StageScratch scratch) const override {
    const std::size_t panel_bytes = rounded_block_bytes(c.rows(), k_);
    const ScratchOrOwn memory(scratch, panel_bytes);
    std::uint16_t* panel = ScratchCarver(memory.view()).take<std::uint16_t>(Index(panel_bytes / 2));
    gemm_amx<Tiles>(a, BFloat16Pairs{pairs_.data(), k_, n_, pairs_.cols()}, c, false, column_bias,
                    1.f, panel);
    return true;
  }

 private:
  Index k_ = 0, n_ = 0;
  BFloat16Kernel::Pairs pairs_;
};

// Hands `kernel` to the tiles (emulated or not): gemm_bfloat16 on it then runs on them.
inline void hand_to_amx(BFloat16Kernel& kernel, bool emulated) {
  if (kernel.rows() == 0 || kernel.cols() == 0) return;  // empty products never reach it
#ifdef SDMHA_HAVE_AMX_TILES
  if (!emulated) {
    kernel.set_external(std::make_shared<const AmxBFloat16Gemm<amx::HardwareTiles>>(kernel));
    return;
  }
#endif
  SDMHA_ASSERT(emulated);  // the CPU's tiles are chosen only where they are built
  (void)emulated;
  kernel.set_external(std::make_shared<const AmxBFloat16Gemm<amx::EmulatedTiles>>(kernel));
}

// Whether Tiles multiply as they should, checked on two products of small integers (entries in
// [-3, 3], exact in bfloat16; every product and every partial sum exact in float32, whatever the
// order of the sums), so that a correct engine gives exactly the integer result: A (300 × 600)
// times a kernel W (600 × 45) plus a bias (the projections' path: two row blocks, two depth
// blocks, partial tiles on every side), and A times Bᵀ (B 45 × 600, the scores' path; full 32 × 32
// blocks go straight to C). The automatic choice takes the CPU's tiles only once they pass it, so
// a fault in the tiles' layout or operand order costs speed there, not results.
template <class Tiles>
bool tiles_multiply_exactly() {
  constexpr Index m = 300, k = 600, n = 45;
  RowMatrix<float> a(m, k), w(k, n), b(n, k), bias(1, n);
  const auto small = [](Index i, Index j, Index f, Index g) {
    return float((i * f + j * g) % 7 - 3);
  };
  for (Index i = 0; i < m; ++i)
    for (Index p = 0; p < k; ++p) a(i, p) = small(i, p, 5, 3);
  for (Index p = 0; p < k; ++p)
    for (Index j = 0; j < n; ++j) w(p, j) = b(j, p) = small(p, j, 2, 11);
  for (Index j = 0; j < n; ++j) bias(0, j) = float(j % 5 - 2);
  const Eigen::MatrixXd exact = a.cast<double>() * w.cast<double>();
  RowMatrix<float> with_bias(m, n), scores(m, n);
  AmxBFloat16Gemm<Tiles>(BFloat16Kernel(w)).run(a, with_bias, bias.data(), StageScratch{});
  gemm_amx_operands<Tiles>(a, b, true, scores, false, StageScratch{}, 1.f);
  const Eigen::MatrixXd expected_with_bias = exact.rowwise() + bias.cast<double>().row(0);
  return with_bias.cast<double>() == expected_with_bias && scores.cast<double>() == exact;
}

// Whether the bfloat16 mode may choose the CPU's tiles: AMX usable (cpu_features.hpp) and the
// tiles passing tiles_multiply_exactly, both asked once a process, on a CPU with AMX-BF16 only.
inline bool amx_tiles_verified() {
#ifdef SDMHA_HAVE_AMX_TILES
  static const bool verified =
      amx_bfloat16_usable() && tiles_multiply_exactly<amx::HardwareTiles>();
  return verified;
#else
  return false;
#endif
}

}  // namespace sdmha::detail
