// sdmha/detail/gemm.hpp — C (+)= α·A·B through Eigen's own GEMM, with packing buffers that stay
// with the calling thread instead of being allocated by every product.
//
//   math:  C = α·op(A)·op(B) (+ C when accumulating), op = identity or transpose of a row-major view
//   pre:   shapes agree (checked by the calling stage's can_implement); C does not alias A or B
//   cost:  2·m·n·k flops in Eigen 3.4's blocked GEMM (gebp), the same kernel `C.noalias() = A*B` runs
//
// Why not `C.noalias() = A * B`: for every product larger than a few dozen entries Eigen packs
// A and B into blocks of kc×mc and kc×nc scalars, and places them on the heap whenever they exceed
// EIGEN_STACK_ALLOCATION_LIMIT (128 KB) — a K-tile of 64 × 2048 keys already does. A layer that
// runs thousands of such products per call would allocate thousands of times. Eigen's GEMM driver
// (internal::general_matrix_matrix_product) takes its blocking object from the caller and uses the
// blocks the object points at, so here the blocks live in a thread_local buffer that grows to the
// largest product the thread has run and is then reused: the steady state allocates nothing.
// The block sizes come from Eigen's own heuristic, so the arithmetic is that of Eigen's product.
// This leans on Eigen 3.4's internal API (pinned below); a new Eigen must be checked here first.
#pragma once

#include <algorithm>
#include <cstddef>

#include <Eigen/Core>

#include "sdmha/config.hpp"

static_assert(EIGEN_WORLD_VERSION == 3 && EIGEN_MAJOR_VERSION == 4,
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

// Eigen's blocking object over this thread's packing buffer.
template <typename Scalar>
class ThreadGemmBlocking : public Eigen::internal::level3_blocking<Scalar, Scalar> {
 public:
  // Block sizes for a row-major (rows × cols) result with inner dimension depth, as Eigen's
  // product computes them (Eigen transposes a row-major product: its m is our cols).
  ThreadGemmBlocking(Index rows, Index cols, Index depth) {
    this->m_mc = cols;
    this->m_nc = rows;
    this->m_kc = depth;
    Eigen::internal::computeProductBlockingSizes<Scalar, Scalar, 1, Index>(this->m_kc, this->m_mc, this->m_nc, 1);
    const Index size_a = round_up(this->m_mc * this->m_kc);
    const Index size_b = this->m_kc * this->m_nc;
    auto& buffer = thread_buffer();
    if (buffer.size() < size_a + size_b) buffer.resize(size_a + size_b);
    this->m_blockA = buffer.data();
    this->m_blockB = buffer.data() + size_a;
  }

  // What the calling thread holds for packing, in bytes (grows, never shrinks, freed at thread exit).
  static std::size_t bytes_held() { return std::size_t(thread_buffer().size()) * sizeof(Scalar); }

 private:
  // Keeps block B on Eigen's default alignment (buffer.data() itself is aligned by Eigen).
  static Index round_up(Index size) {
    constexpr Index per_alignment = Index(EIGEN_DEFAULT_ALIGN_BYTES / sizeof(Scalar)) > 0
                                        ? Index(EIGEN_DEFAULT_ALIGN_BYTES / sizeof(Scalar)) : 1;
    return (size + per_alignment - 1) / per_alignment * per_alignment;
  }
  static Vector<Scalar>& thread_buffer() {
    thread_local Vector<Scalar> buffer;
    return buffer;
  }
};

// C (m × n, row-major, any outer stride) = α·A·B, or += when `accumulate`.
template <typename Scalar>
void gemm(const GemmOperand<Scalar>& a, const GemmOperand<Scalar>& b, MatrixRef<Scalar> c, Scalar alpha,
          bool accumulate) {
  SDMHA_ASSERT(a.rows == c.rows() && b.cols == c.cols() && a.cols == b.rows);
  const Index m = c.rows(), n = c.cols(), k = a.cols;
  if (m == 0 || n == 0) return;
  if (!accumulate) c.setZero();
  if (k == 0) return;
  ThreadGemmBlocking<Scalar> blocking(m, n, k);
  using Eigen::ColMajor;
  using Eigen::RowMajor;
  using Eigen::internal::general_matrix_matrix_product;
  if (a.row_major && b.row_major)
    general_matrix_matrix_product<Index, Scalar, RowMajor, false, Scalar, RowMajor, false, RowMajor, 1>::run(
        m, n, k, a.data, a.stride, b.data, b.stride, c.data(), 1, c.outerStride(), alpha, blocking);
  else if (a.row_major)
    general_matrix_matrix_product<Index, Scalar, RowMajor, false, Scalar, ColMajor, false, RowMajor, 1>::run(
        m, n, k, a.data, a.stride, b.data, b.stride, c.data(), 1, c.outerStride(), alpha, blocking);
  else if (b.row_major)
    general_matrix_matrix_product<Index, Scalar, ColMajor, false, Scalar, RowMajor, false, RowMajor, 1>::run(
        m, n, k, a.data, a.stride, b.data, b.stride, c.data(), 1, c.outerStride(), alpha, blocking);
  else
    general_matrix_matrix_product<Index, Scalar, ColMajor, false, Scalar, ColMajor, false, RowMajor, 1>::run(
        m, n, k, a.data, a.stride, b.data, b.stride, c.data(), 1, c.outerStride(), alpha, blocking);
}

}  // namespace sdmha::detail
