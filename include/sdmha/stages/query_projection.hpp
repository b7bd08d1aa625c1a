// sdmha/stages/query_projection.hpp — SparseQueryProjection: the query projection from CSR.
//
//   math:  Q = X·Wq + bq, X sparse (rows × Eq, CSR), Wq dense row-major (Eq × N), bq (N) or none
//   pre:   X validated (columns in [0, Eq)); Wq has Eq rows; Q is rows × N
//   cost:  2·nnz(X)·N flops, reading one row of Wq per stored value; X is never densified
#pragma once

#include "sdmha/config.hpp"
#include "sdmha/detail/csr_dense_product.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/sparse_query.hpp"

namespace sdmha {

template <typename Scalar, typename StorageIndex = int>
struct SparseQueryProjection {
  using ScalarType = Scalar;
  using StorageIndexType = StorageIndex;

  struct Arguments {
    CsrView<Scalar, StorageIndex> query;  // rows × Eq
    ConstMatrixRef<Scalar> kernel;        // Eq × N, row-major: a stored value reads one contiguous row
    ConstVectorRef<Scalar> bias;          // N, or empty for no bias
    mutable MatrixRef<Scalar> output;             // rows × N
    // Optional working memory for the by-feature kernel, reused across calls so that they do not
    // allocate; one per thread. When null, a thread-local one is used.
    detail::CsrProductScratch<Scalar, StorageIndex>* scratch = nullptr;
    // An upper bound on the stored values of any call this scratch serves in one pass (the
    // layer passes its largest row block's): the scratch is sized for it at once, so that a
    // repeated pass allocates nothing whichever thread gets which block. 0: unknown.
    Index nonzero_capacity = 0;
  };

  static void can_implement(const Arguments& args) {
    constexpr const char* where = "SparseQueryProjection";
    if (args.kernel.rows() != args.query.cols)
      detail::fail<ShapeError>(where, "kernel has ", args.kernel.rows(),
                               " rows; expected the query's feature width ", args.query.cols);
    if (args.bias.size() != 0 && args.bias.size() != args.kernel.cols())
      detail::fail<ShapeError>(where, "bias has ", args.bias.size(), " entries; expected 0 or ",
                               args.kernel.cols());
    if (args.output.rows() != args.query.rows || args.output.cols() != args.kernel.cols())
      detail::fail<ShapeError>(where, "output is ", args.output.rows(), " x ", args.output.cols(),
                               "; expected ", args.query.rows, " x ", args.kernel.cols());
  }

  // Two register-blocked kernels (detail/csr_dense_product.hpp gives the reasons). By rows: a
  // panel of output columns stays in vector registers across a row's stored values. By features:
  // for a kernel larger than L2 that the rows use at least twice per feature on average, X is
  // regrouped by feature so that Wq streams through once, in order, instead of one random row
  // per stored value. On `bow` in the layer's 256-row blocks, by features measured ~1.3× faster
  // than by rows at 1 % (2.6 rows per feature), as fast at 0.4 % (1.0) and ~1.6× slower at 0.1 %
  // (0.26). Both add each row's values in ascending feature order with one FMA each, so sorted
  // rows give the same bits whichever is taken.
  static constexpr double kCacheBytes = detail::kCoreCacheBytes;

  static bool by_feature(const Arguments& args) {
    const double kernel_bytes = double(args.kernel.rows()) * double(args.kernel.cols()) * sizeof(Scalar);
    return kernel_bytes > kCacheBytes && args.query.nonzeros() >= 2 * args.query.cols &&
           detail::by_feature_fits(args.query);
  }

  // Whether the by-row kernel writes Q with streaming stores: when Wq fits in L2 (so that
  // reading Wq does not bound the kernel) and this call's output is too large to be wanted in
  // cache (detail::kStreamOutputBytes gives the measurement).
  static bool stream_output(const Arguments& args) {
    const double kernel_bytes = double(args.kernel.rows()) * double(args.kernel.cols()) * sizeof(Scalar);
    const double output_bytes = double(args.output.rows()) * double(args.output.cols()) * sizeof(Scalar);
    return kernel_bytes <= kCacheBytes && output_bytes >= detail::kStreamOutputBytes;
  }

  void operator()(const Arguments& args) const {
    const Scalar* bias = args.bias.size() != 0 ? args.bias.data() : nullptr;
    if (by_feature(args)) {
      thread_local detail::CsrProductScratch<Scalar, StorageIndex> local_scratch;
      auto& scratch = args.scratch != nullptr ? *args.scratch : local_scratch;
      if (scratch.entries.capacity() < static_cast<std::size_t>(args.nonzero_capacity))
        scratch.entries.reserve(static_cast<std::size_t>(args.nonzero_capacity));
      detail::csr_dense_product_by_feature(args.query, args.kernel.data(), args.kernel.outerStride(), bias,
                                           args.output.data(), args.output.outerStride(), args.kernel.cols(),
                                           scratch);
    } else {
      detail::csr_dense_product(args.query, args.kernel.data(), args.kernel.outerStride(), bias,
                                args.output.data(), args.output.outerStride(), args.kernel.cols(),
                                stream_output(args));
    }
  }
};

}  // namespace sdmha
