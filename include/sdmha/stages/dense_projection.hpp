// sdmha/stages/dense_projection.hpp — DenseProjection: a dense input through a kernel.
// The key and value projections use it, and so does the dense baseline for its query.
//
//   math:  Y = X·W + b, X dense row-major (rows × E), W (E × N), b (N) or none
//   pre:   X has E columns; Y is rows × N
//   cost:  2·rows·E·N flops in one Eigen GEMM (packing blocks reused per thread: no allocation)
#pragma once

#include "sdmha/config.hpp"
#include "sdmha/detail/gemm.hpp"
#include "sdmha/errors.hpp"

namespace sdmha {

template <typename Scalar>
struct DenseProjection {
  using ScalarType = Scalar;

  struct Arguments {
    ConstMatrixRef<Scalar> input;   // rows × E
    ConstMatrixRef<Scalar> kernel;  // E × N
    ConstVectorRef<Scalar> bias;    // N, or empty for no bias
    mutable MatrixRef<Scalar> output;       // rows × N
  };

  static void can_implement(const Arguments& args) { check("DenseProjection", args); }

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
  }


 public:
  // The bias goes in first and the GEMM accumulates onto it: one pass over Y instead of two.
  void operator()(const Arguments& args) const {
    const bool has_bias = args.bias.size() != 0;
    if (has_bias) args.output.rowwise() = args.bias.transpose();
    detail::gemm<Scalar>(detail::as_operand<Scalar>(args.input), detail::as_operand<Scalar>(args.kernel),
                         args.output, Scalar(1), has_bias);
  }
};

}  // namespace sdmha
