// sdmha/detail/gemm.hpp — C (+)= α·A·B through Eigen's own GEMM, packing into the caller's scratch.
//
//   math:  C = α·op(A)·op(B) (+ C when accumulating, + 1·bᵀ given a column bias b), op =
//          identity or transpose of a row-major view
//   pre:   shapes agree (checked by the calling stage's can_implement); C aliases neither A nor B
//   cost:  2·m·n·k flops in Eigen 3.4's blocked GEMM (gebp), the kernel `C.noalias() = A*B` runs
//          (float with AVX-512: our own engine, gemm_avx512.hpp)
//
// Why not `C.noalias() = A * B`: for every product larger than a few dozen entries Eigen packs
// A and B into blocks of kc×mc and kc×nc scalars, and places them on the heap whenever they exceed
// EIGEN_STACK_ALLOCATION_LIMIT (128 KB) — a K-tile of 64 × 2048 keys already does. A layer that
// runs thousands of such products per call would allocate thousands of times. Eigen's GEMM driver
// (internal::general_matrix_matrix_product) takes its blocking object from the caller and uses the
// blocks the object points at, so here the blocks live in the worker's scratch, sized by
// gemm_workspace_size() when the call is planned. The block sizes come from Eigen's own
// heuristic, so the arithmetic is that of Eigen's product. This leans on Eigen 3.4's internal API
// (pinned below); a new Eigen must be checked here first.
#pragma once

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include <Eigen/Core>

#include "sdmha/config.hpp"
#include "sdmha/detail/gemm_avx512.hpp"
#include "sdmha/detail/scratch.hpp"
#include "sdmha/kernels.hpp"

static_assert(
    EIGEN_WORLD_VERSION == 3 && EIGEN_MAJOR_VERSION == 4,
    "sdmha/detail/gemm.hpp calls Eigen 3.4's internal GEMM driver; check it before moving Eigen");

namespace sdmha::detail {

// A read-only operand: a row-major view, or the transpose of one (which is column-major).
template <typename Scalar>
struct GemmOperand {
  const Scalar* data;
  Index rows, cols, stride;  // of op(A); stride between rows (row_major) or columns
  bool row_major;
};

template <typename Scalar>
GemmOperand<Scalar> as_operand(const ConstMatrixRef<Scalar>& matrix) {
  return {matrix.data(), matrix.rows(), matrix.cols(), matrix.outerStride(), true};
}
template <typename Scalar>
GemmOperand<Scalar> transposed(const ConstMatrixRef<Scalar>& matrix) {
  return {matrix.data(), matrix.cols(), matrix.rows(), matrix.outerStride(), false};
}

// Eigen's block sizes for a row-major (rows × cols) result with inner dimension depth, as its
// product computes them (Eigen transposes a row-major product: its m is our cols).
struct GemmBlockSizes {
  Index kc, mc, nc;
};

template <typename Scalar>
GemmBlockSizes gemm_block_sizes(Index rows, Index cols, Index depth) {
  GemmBlockSizes sizes{depth, cols, rows};
  Eigen::internal::computeProductBlockingSizes<Scalar, Scalar, 1, Index>(sizes.kc, sizes.mc,
                                                                         sizes.nc, 1);
  return sizes;
}

// Bytes of packing scratch that gemm() needs for a (rows × cols) result of inner dimension depth.
template <typename Scalar>
std::size_t gemm_workspace_size(Index rows, Index cols, Index depth) {
  if (rows <= 0 || cols <= 0 || depth <= 0) return 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same<Scalar, float>::value)
    if (avx512_kernels_allowed()) return gemm_avx512_workspace_size(rows, cols, depth);
#endif
  // Eigen's block sizes are not monotone in the shape (a deeper product may get a shorter kc and
  // a wider nc), but each is at most the shape's own extent and the largest (cache-bound) blocks
  // are those of a very large product: the smaller of the two bounds every product up to this
  // shape, so a pass planned for its largest tile never runs short on a smaller one.
  const GemmBlockSizes sizes = gemm_block_sizes<Scalar>(rows, cols, depth);
  const std::size_t own =
      array_bytes<Scalar>(sizes.mc * sizes.kc) + array_bytes<Scalar>(sizes.kc * sizes.nc);
  const std::size_t unblocked =
      array_bytes<Scalar>(cols * depth) + array_bytes<Scalar>(depth * rows);
  constexpr Index kLarge = Index(1) << 20;
  const GemmBlockSizes largest = gemm_block_sizes<Scalar>(kLarge, kLarge, kLarge);
  const std::size_t cache_bound =
      array_bytes<Scalar>(largest.mc * largest.kc) + array_bytes<Scalar>(largest.kc * largest.nc);
  return std::max(own, std::min(unblocked, cache_bound));
}

// Eigen's blocking object over packing blocks that the caller owns.
template <typename Scalar>
class ScratchGemmBlocking : public Eigen::internal::level3_blocking<Scalar, Scalar> {
 public:
  ScratchGemmBlocking(const GemmBlockSizes& sizes, Scalar* block_a, Scalar* block_b) {
    this->m_kc = sizes.kc;
    this->m_mc = sizes.mc;
    this->m_nc = sizes.nc;
    this->m_blockA = block_a;
    this->m_blockB = block_b;
  }
};

template <typename Scalar>
void gemm_with_blocking(const GemmOperand<Scalar>& a, const GemmOperand<Scalar>& b,
                        MatrixRef<Scalar> c, Scalar alpha,
                        Eigen::internal::level3_blocking<Scalar, Scalar>& blocking) {
  const Index m = c.rows(), n = c.cols(), k = a.cols;
  using Eigen::ColMajor;
  using Eigen::RowMajor;
  using Eigen::internal::general_matrix_matrix_product;
  if (a.row_major && b.row_major)
    general_matrix_matrix_product<Index, Scalar, RowMajor, false, Scalar, RowMajor, false, RowMajor,
                                  1>::run(m, n, k, a.data, a.stride, b.data, b.stride, c.data(), 1,
                                          c.outerStride(), alpha, blocking);
  else if (a.row_major)
    general_matrix_matrix_product<Index, Scalar, RowMajor, false, Scalar, ColMajor, false, RowMajor,
                                  1>::run(m, n, k, a.data, a.stride, b.data, b.stride, c.data(), 1,
                                          c.outerStride(), alpha, blocking);
  else if (b.row_major)
    general_matrix_matrix_product<Index, Scalar, ColMajor, false, Scalar, RowMajor, false, RowMajor,
                                  1>::run(m, n, k, a.data, a.stride, b.data, b.stride, c.data(), 1,
                                          c.outerStride(), alpha, blocking);
  else
    general_matrix_matrix_product<Index, Scalar, ColMajor, false, Scalar, ColMajor, false, RowMajor,
                                  1>::run(m, n, k, a.data, a.stride, b.data, b.stride, c.data(), 1,
                                          c.outerStride(), alpha, blocking);
}

// C (m × n, row-major, any outer stride) = α·A·B, or += when `accumulate`, packing in `scratch`
// (at least gemm_workspace_size(m, n, k) bytes). With less (a stage called without a planned
// workspace), it packs into memory of its own: the same result, with an allocation.
// On a CPU built for with AVX-512F, float products go to our own engine (gemm_avx512.hpp: 88–93 %
// of one core's FMA peak on the layer's shapes where Eigen's reaches about 60 %); double products,
// and every product elsewhere, to Eigen's; so do float products under SDMHA_KERNELS=portable
// (sdmha/kernels.hpp).
// `column_bias` (n scalars, only when not accumulating) is added to every row of C: C = α·A·B +
// 1·biasᵀ, bitwise as if C held the bias and the product were accumulated onto it (which is what
// Eigen's path does; the AVX-512 engine adds it in its first stores instead of a pass over C).
template <typename Scalar>
void gemm(const GemmOperand<Scalar>& a, const GemmOperand<Scalar>& b, MatrixRef<Scalar> c,
          Scalar alpha, bool accumulate, StageScratch scratch,
          const Scalar* column_bias = nullptr) {
  SDMHA_ASSERT(a.rows == c.rows() && b.cols == c.cols() && a.cols == b.rows);
  SDMHA_ASSERT(column_bias == nullptr || !accumulate);
#if defined(__AVX512F__)
  if constexpr (std::is_same<Scalar, float>::value) {
    if (avx512_kernels_allowed()) {
      gemm_avx512(a, b, c, alpha, accumulate, scratch, column_bias);
      return;
    }
  }
#endif
  const Index m = c.rows(), n = c.cols(), k = a.cols;
  if (m == 0 || n == 0) return;
  if (column_bias != nullptr)
    fill_rows_with<Scalar>(c, column_bias);
  else if (!accumulate)
    c.setZero();
  if (k == 0) return;
  const GemmBlockSizes sizes = gemm_block_sizes<Scalar>(m, n, k);
  const ScratchOrOwn memory(
      scratch, array_bytes<Scalar>(sizes.mc * sizes.kc) + array_bytes<Scalar>(sizes.kc * sizes.nc));
  ScratchCarver carver(memory.view());
  Scalar* block_a = carver.take<Scalar>(sizes.mc * sizes.kc);
  Scalar* block_b = carver.take<Scalar>(sizes.kc * sizes.nc);
  ScratchGemmBlocking<Scalar> blocking(sizes, block_a, block_b);
  gemm_with_blocking<Scalar>(a, b, c, alpha, blocking);
}

}  // namespace sdmha::detail
