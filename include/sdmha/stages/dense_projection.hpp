// sdmha/stages/dense_projection.hpp — DenseProjection: a dense input through a kernel, and its
// backward. The key and value projections use it, and so does the dense baseline for its query.
//
//   math:  Y = X·W + b, X dense row-major (rows × E), W (E × N), b (N) or none
//   pre:   X has E columns; Y is rows × N
//   cost:  2·rows·E·N flops in one GEMM, packing in the worker's scratch
//
// With `kernel_bfloat16` (Scalar = float): Y = bf16(X)·bf16(W) + b, W rounded once by the caller
// and X as it is packed, products exact and sums in float32 (detail/gemm_bfloat16.hpp gives the
// bound) — vdpbf16ps at twice the float32 rate where the CPU has AVX512_BF16, or oneDNN's matmul
// (AMX) for a kernel handed to it (detail/gemm_onednn.hpp).
//
// Backward, given dY:
//   dW = Xᵀ·dY over all rows, one fixed tile of dW per call (KernelGradientArguments)
//   dX = dY·Wᵀ, one block of rows per call (InputGradientArguments)
//   (db = 1ᵀ·dY is a column sum, left to the caller.)
#pragma once

#include <algorithm>
#include <type_traits>

#include "sdmha/config.hpp"
#include "sdmha/detail/gemm.hpp"
#include "sdmha/detail/gemm_bfloat16.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/stage.hpp"

namespace sdmha {

template <typename Scalar>
struct DenseProjection {
  using ScalarType = Scalar;
  using differentiates = DenseProjection;

  struct Arguments {
    ConstMatrixRef<Scalar> input;      // rows × E
    ConstMatrixRef<Scalar> kernel;     // E × N
    ConstVectorRef<Scalar> bias;       // N, or empty for no bias
    mutable MatrixRef<Scalar> output;  // rows × N
    StageScratch workspace = {};
    // W rounded to bfloat16 (Scalar = float only), read instead of `kernel` when set.
    const detail::BFloat16Kernel* kernel_bfloat16 = nullptr;
  };

  // dW's tile = input's columns ᵀ · d_output's columns, summed over every row (a fixed tile, so
  // that each entry of dW is one GEMM over the same rows for any thread count).
  struct KernelGradientArguments {
    ConstMatrixRef<Scalar> input;        // rows × (the tile's rows of W)
    ConstMatrixRef<Scalar> d_output;     // rows × (the tile's columns of W)
    mutable MatrixRef<Scalar> d_kernel;  // the tile, overwritten
    StageScratch workspace = {};
  };

  // A block of dX = dY·Wᵀ.
  struct InputGradientArguments {
    ConstMatrixRef<Scalar> d_output;    // rows × N
    ConstMatrixRef<Scalar> kernel;      // E × N
    mutable MatrixRef<Scalar> d_input;  // rows × E, overwritten
    StageScratch workspace = {};
  };

  // Whether every entry of Y gets the same bits from one call over any block of rows and columns
  // that holds it: the float32 AVX-512 engine's entries are each one sequence of FMAs fixed by
  // the depth alone (detail/gemm_avx512.hpp); Eigen's blocking, and so its order of additions,
  // depends on the block's shape (and serves under SDMHA_KERNELS=portable, sdmha/kernels.hpp).
  // A caller may then fuse fixed blocks into one call.
  static bool same_bits_in_any_block(bool bfloat16_kernel) {
#if defined(__AVX512F__)
    return std::is_same<Scalar, float>::value && !bfloat16_kernel &&
           detail::avx512_kernels_allowed();
#else
    (void)bfloat16_kernel;
    return false;
#endif
  }

  // GEMM packing for the largest block: sizes.rows × sizes.output_width, depth sizes.input_width
  // (forward and input gradient), and a weight tile of sizes.input_width × sizes.output_width
  // over sizes.rows rows (kernel gradient).
  static std::size_t workspace_size(const TileSizes& sizes) {
    return std::max(
        {detail::gemm_workspace_size<Scalar>(sizes.rows, sizes.output_width, sizes.input_width),
         detail::gemm_workspace_size<Scalar>(sizes.rows, sizes.input_width, sizes.output_width),
         detail::gemm_workspace_size<Scalar>(sizes.input_width, sizes.output_width, sizes.rows),
         detail::gemm_bfloat16_workspace_size(sizes.rows, sizes.output_width, sizes.input_width)});
  }

  static void can_implement(const Arguments& args) { check("DenseProjection", args); }
  static void can_implement(const KernelGradientArguments& args) {
    constexpr const char* where = "DenseProjection (kernel gradient)";
    if (args.input.rows() != args.d_output.rows())
      detail::fail<ShapeError>(where, "input has ", args.input.rows(),
                               " rows; expected d_output's ", args.d_output.rows());
    if (args.d_kernel.rows() != args.input.cols() || args.d_kernel.cols() != args.d_output.cols())
      detail::fail<ShapeError>(where, "d_kernel is ", args.d_kernel.rows(), " x ",
                               args.d_kernel.cols(), "; expected ", args.input.cols(), " x ",
                               args.d_output.cols());
  }
  static void can_implement(const InputGradientArguments& args) {
    constexpr const char* where = "DenseProjection (input gradient)";
    if (args.kernel.cols() != args.d_output.cols())
      detail::fail<ShapeError>(where, "kernel has ", args.kernel.cols(),
                               " columns; expected d_output's ", args.d_output.cols());
    if (args.d_input.rows() != args.d_output.rows() || args.d_input.cols() != args.kernel.rows())
      detail::fail<ShapeError>(where, "d_input is ", args.d_input.rows(), " x ",
                               args.d_input.cols(), "; expected ", args.d_output.rows(), " x ",
                               args.kernel.rows());
  }

  // The GEMM adds the bias: the AVX-512 engines in their first stores to Y (no pass of their own
  // over it), Eigen's path by filling Y with it and accumulating onto it.
  void operator()(const Arguments& args) const {
    const Scalar* bias = args.bias.size() != 0 ? args.bias.data() : nullptr;
    if constexpr (std::is_same<Scalar, float>::value)
      if (args.kernel_bfloat16 != nullptr) {
        detail::gemm_bfloat16(args.input, *args.kernel_bfloat16, args.output, false, args.workspace,
                              bias);
        return;
      }
    detail::gemm<Scalar>(detail::as_operand<Scalar>(args.input),
                         detail::as_operand<Scalar>(args.kernel), args.output, Scalar(1), false,
                         args.workspace, bias);
  }

  void backward(const KernelGradientArguments& args) const {
    detail::gemm<Scalar>(detail::transposed<Scalar>(args.input),
                         detail::as_operand<Scalar>(args.d_output), args.d_kernel, Scalar(1), false,
                         args.workspace);
  }

  void backward(const InputGradientArguments& args) const {
    detail::gemm<Scalar>(detail::as_operand<Scalar>(args.d_output),
                         detail::transposed<Scalar>(args.kernel), args.d_input, Scalar(1), false,
                         args.workspace);
  }

 protected:
  static void check(const char* where, const Arguments& args) {
    if (args.kernel.rows() != args.input.cols())
      detail::fail<ShapeError>(where, "kernel has ", args.kernel.rows(),
                               " rows; expected the input width ", args.input.cols());
    if (args.bias.size() != 0 && args.bias.size() != args.kernel.cols())
      detail::fail<ShapeError>(where, "bias has ", args.bias.size(), " entries; expected 0 or ",
                               args.kernel.cols());
    if (args.output.rows() != args.input.rows() || args.output.cols() != args.kernel.cols())
      detail::fail<ShapeError>(where, "output is ", args.output.rows(), " x ", args.output.cols(),
                               "; expected ", args.input.rows(), " x ", args.kernel.cols());
    detail::check_kernel_bfloat16<Scalar>(where, args.kernel_bfloat16, args.kernel);
  }
};

// DenseProjection's computation under a stage name of its own (ContextProjection,
// OutputProjection): a layer can swap one without the other, and the errors name the stage.
// `differentiates` is the named stage, so a stage derived from it needs a backward of its own.
template <typename Scalar, typename Stage>
struct NamedDenseProjection : DenseProjection<Scalar> {
  using differentiates = Stage;
  using typename DenseProjection<Scalar>::Arguments;
  using DenseProjection<Scalar>::can_implement;
  static void can_implement(const Arguments& args) {
    DenseProjection<Scalar>::check(Stage::kName, args);
  }
};

}  // namespace sdmha
