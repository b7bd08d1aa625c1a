// sdmha/stages/query_projection.hpp — SparseQueryProjection: the query projection from CSR, and
// its backward (the query kernel's gradient and the stored values' gradient).
//
//   math:  Q = X·Wq + bq, X sparse (rows × Eq, CSR), Wq dense row-major (Eq × N), bq (N) or none
//   pre:   X validated (columns in [0, Eq)); Wq has Eq rows; Q is rows × N
//   cost:  2·nnz(X)·N flops, reading one row of Wq per stored value; X is never densified
//
// With `kernel_bfloat16` given (float only), the products read that copy of Wq instead: each
// entry rounded to bfloat16 and widened exactly, products and sums in float32, so Q is bitwise
// the float kernel's result on the rounded Wq, for half of Wq's memory traffic. The copy is
// stored by column panels (detail/bfloat16_panels.hpp); beyond L2 and with sorted rows it is read
// by feature blocks, each row's output panel held in registers across a block.
//
// Backward, given dQ:
//   dWq = Xᵀ·dQ                               (KernelGradientArguments; 2·nnz·N flops)
//   dX[r, c] = dQ[r, :]·Wq[c, :] at X's stored (r, c) only, in CSR order (ValuesGradientArguments)
//   (dbq = 1ᵀ·dQ is a column sum, left to the caller.)
// Both go by rows of X, or by feature over X's CSC (detail::build_feature_groups with positions)
// when Wq is beyond L2 (detail::query_gradients_by_feature): then each row of Wq and dWq is
// touched once, in order, and the random accesses go to dQ, the smaller. The CSC keeps CSR order
// within a feature, so every sum has the terms, and the order, of the by-rows loop; a caller may
// split N into column panels (by rows) or the features into blocks (by feature) for any thread
// count and get the same bits.
#pragma once

#include <type_traits>

#include "sdmha/config.hpp"
#include "sdmha/detail/bfloat16_panels.hpp"
#include "sdmha/detail/csr_dense_product.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/sparse_query.hpp"
#include "sdmha/stage.hpp"

namespace sdmha {

template <typename Scalar, typename StorageIndex = int>
struct SparseQueryProjection {
  using ScalarType = Scalar;
  using StorageIndexType = StorageIndex;
  using differentiates = SparseQueryProjection;
  using FeatureGroups = detail::FeatureGroups<Scalar, StorageIndex>;
  using RoundedKernel = detail::BFloat16Panels;  // Wq rounded to bfloat16, by column panels

  // A call projects all of Wq's columns, or a window of them: kernel = Wq.middleCols(c0, w),
  // bias and output the window's columns of bq and Q, first_column = c0, kernel_columns = N. The
  // kernel is chosen (by rows or by feature, streaming stores, prefetches) on the whole Wq, and
  // every entry of Q is then the same sequence of FMAs as in one call on all of Wq, so that a
  // row block may be split into windows (column_window_width()) for any number of workers, with
  // the same bits. The windows of one row block can share its CSC by feature, built once
  // (build_query_groups) and read by each.
  struct Arguments {
    CsrView<Scalar, StorageIndex> query;  // rows × Eq
    ConstMatrixRef<Scalar> kernel;     // Eq × w, row-major (Wq or a window of it): a stored value
                                       // reads one contiguous row
    ConstVectorRef<Scalar> bias;       // w, or empty for no bias
    mutable MatrixRef<Scalar> output;  // rows × w
    StageScratch workspace = {};       // workspace_size() bytes for this call's sizes
    // Wq rounded to bfloat16 (all of it, Eq × N), or null: the float kernel is read.
    const RoundedKernel* kernel_bfloat16 = nullptr;
    // Where the window starts in Wq: a multiple of window_alignment(), as is its end unless that
    // is N.
    Index first_column = 0;
    // Wq's width N, or 0 when the window is all of Wq (kernel.cols()).
    Index kernel_columns = 0;
    // The query's CSC by feature (build_query_groups of these rows), or null: then a call that
    // goes by feature over a CSC builds its own in the workspace.
    const FeatureGroups* feature_groups = nullptr;
  };

  // Two register-blocked kernels (detail/csr_dense_product.hpp, csr_by_feature.hpp give the
  // reasons). By rows: a panel of output columns stays in vector registers across a row's stored
  // values. By features: for a kernel larger than L2 that the rows use at least twice per feature
  // on average, X is regrouped by feature so that Wq streams through once, in order, instead of
  // one random row per stored value. Both add each row's values in ascending feature order with
  // one FMA each, so sorted rows give the same bits whichever is taken.
  static bool kernel_beyond_cache(Index features, Index columns) {
    return double(features) * double(columns) * sizeof(Scalar) > detail::kCoreCacheBytes;
  }
  static Index kernel_columns(const Arguments& args) {
    return args.kernel_columns > 0 ? args.kernel_columns : args.kernel.cols();
  }
  static bool by_feature(const Arguments& args) {
    return kernel_beyond_cache(args.kernel.rows(), kernel_columns(args)) &&
           args.query.nonzeros() >= 2 * args.query.cols && detail::by_feature_fits(args.query);
  }
  // Whether the call reads a CSC by feature (args.feature_groups, or its own): by feature, except
  // for the bfloat16 kernel on rows known to be sorted, which goes by feature blocks instead.
  static bool reads_feature_groups(const Arguments& args) {
    if constexpr (std::is_same<Scalar, float>::value)
      if (args.kernel_bfloat16 != nullptr && args.query.sorted_columns) return false;
    return by_feature(args);
  }

  // Windows start (and end, but for the last) at multiples of this many columns: a cache line of
  // Scalar, a multiple of every SIMD packet, so that a window's columns fall in the same packets
  // (and the same scalar tail) as in a whole call; with a bfloat16 kernel, half of its panel
  // (detail::kHalfPanelColumns), which the feature-blocks kernel reads as one.
  static constexpr Index window_alignment(bool bfloat16) {
    return bfloat16 ? detail::kHalfPanelColumns : Index(64 / sizeof(Scalar));
  }
  // The width of the windows a caller should cut Wq into: the narrowest whose windows together
  // cost about what one whole call costs (measured on `bow` and `seed`, 512-row blocks).
  static constexpr Index column_window_width(bool bfloat16) {
    return bfloat16 ? kBFloat16WindowWidth : kWindowWidth;
  }
  static constexpr Index kWindowWidth = 64, kBFloat16WindowWidth = 64;

  // The by-feature kernel's CSC of one block, or the feature-block kernel's row cursors:
  // sizes.features (Eq), sizes.output_width (N, Wq's whole width even for a window),
  // sizes.nonzeros (the fullest block's stored values), sizes.rows (its rows). With a prebuilt
  // CSC (feature_groups), window_workspace_size() suffices.
  static std::size_t workspace_size(const TileSizes& sizes) {
    if (!kernel_beyond_cache(sizes.features, sizes.output_width)) return 0;
    return std::max(query_groups_bytes(sizes.features, sizes.nonzeros),
                    detail::array_bytes<StorageIndex>(sizes.rows));
  }
  static std::size_t window_workspace_size(const TileSizes& sizes) {
    if (!kernel_beyond_cache(sizes.features, sizes.output_width)) return 0;
    return detail::array_bytes<StorageIndex>(sizes.rows);
  }

  // The query's CSC by feature, for feature_groups: `memory` must hold
  // query_groups_bytes(query.cols, query.nonzeros()) bytes, which the result points into. Build
  // it once for a row block and hand it to each of the block's windows (read only).
  static std::size_t query_groups_bytes(Index features, Index nonzeros) {
    return FeatureGroups::bytes(features, nonzeros, false);
  }
  static FeatureGroups build_query_groups(const CsrView<Scalar, StorageIndex>& query,
                                          StageScratch memory) {
    constexpr const char* where = "SparseQueryProjection::build_query_groups";
    if (!detail::by_feature_fits(query))
      detail::fail<ShapeError>(where, "the query has ", query.rows, " rows and ", query.cols,
                               " features; expected fewer than StorageIndex's maximum");
    const Index nonzeros = query.nonzeros();
    const std::size_t bytes = query_groups_bytes(query.cols, nonzeros);
    if (memory.data == nullptr || memory.bytes < bytes)
      detail::fail<ShapeError>(where, "memory holds ", memory.bytes,
                               " bytes; expected query_groups_bytes(", query.cols, ", ", nonzeros,
                               ") = ", bytes);
    detail::ScratchCarver carver(memory);
    FeatureGroups groups = FeatureGroups::carve(carver, query.cols, nonzeros, false);
    detail::build_feature_groups(query, groups);
    return groups;
  }

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
    check_window(where, args);
    const WholeKernelShape whole{args.kernel.rows(), kernel_columns(args)};
    detail::check_kernel_bfloat16<Scalar>(where, args.kernel_bfloat16, whole);
    if (args.feature_groups != nullptr)
      detail::check_feature_groups(where, args.query, *args.feature_groups, false);
  }

  // The by-row kernel writes Q with streaming stores when Wq fits in L2 (so that reading Wq does
  // not bound it) and the output is too large to be wanted in cache (detail::kStreamOutputBytes):
  // the output of a whole call, rows × N, also for a window of it.
  static bool stream_output(const Arguments& args) {
    const double output_bytes =
        double(args.output.rows()) * double(kernel_columns(args)) * sizeof(Scalar);
    return !kernel_beyond_cache(args.kernel.rows(), kernel_columns(args)) &&
           output_bytes >= detail::kStreamOutputBytes;
  }

  void operator()(const Arguments& args) const {
    if constexpr (std::is_same<Scalar, float>::value) {
      if (args.kernel_bfloat16 != nullptr) {
        project_bfloat16(args, *args.kernel_bfloat16);
        return;
      }
    }
    project(args);
  }

  // ---- backward -------------------------------------------------------------------------------

  // dWq = Xᵀ·dQ. By rows: d_kernel is Eq × (a column panel of N), overwritten. By feature (X's
  // CSC given): d_kernel holds rows [first_feature, first_feature + d_kernel.rows()) of dWq.
  struct KernelGradientArguments {
    CsrView<Scalar, StorageIndex> query;  // rows × Eq
    ConstMatrixRef<Scalar> d_query;       // rows × N (or a column panel)
    mutable MatrixRef<Scalar> d_kernel;   // see above
    const FeatureGroups* feature_groups = nullptr;
    Index first_feature = 0;
  };

  // dX at X's stored positions, in CSR order. By feature (X's CSC with positions given): only
  // the entries of features [first_feature, first_feature + feature_count) are written.
  struct ValuesGradientArguments {
    CsrView<Scalar, StorageIndex> query;          // rows × Eq: only its pattern is read
    ConstMatrixRef<Scalar> kernel;                // Eq × N
    ConstMatrixRef<Scalar> d_query;               // rows × N
    mutable Eigen::Ref<Vector<Scalar>> d_values;  // nnz(X), one per stored value in CSR order
    const FeatureGroups* feature_groups = nullptr;
    Index first_feature = 0, feature_count = 0;
  };

  static void can_implement(const KernelGradientArguments& args) {
    constexpr const char* where = "SparseQueryProjection (kernel gradient)";
    if (args.d_query.rows() != args.query.rows)
      detail::fail<ShapeError>(where, "d_query has ", args.d_query.rows(), " rows; expected ",
                               args.query.rows, " (one per query row)");
    if (args.feature_groups == nullptr) {
      if (args.d_kernel.rows() != args.query.cols || args.d_kernel.cols() != args.d_query.cols())
        detail::fail<ShapeError>(where, "d_kernel is ", args.d_kernel.rows(), " x ",
                                 args.d_kernel.cols(), "; expected ", args.query.cols, " x ",
                                 args.d_query.cols());
      return;
    }
    if (args.d_kernel.cols() != args.d_query.cols())
      detail::fail<ShapeError>(where, "d_kernel has ", args.d_kernel.cols(),
                               " columns; expected d_query's ", args.d_query.cols());
    detail::check_feature_groups(where, args.query, *args.feature_groups, false);
    check_feature_range(where, args.query.cols, args.first_feature, args.d_kernel.rows());
  }

  static void can_implement(const ValuesGradientArguments& args) {
    constexpr const char* where = "SparseQueryProjection (values gradient)";
    if (args.kernel.rows() != args.query.cols)
      detail::fail<ShapeError>(where, "kernel has ", args.kernel.rows(),
                               " rows; expected the query's feature width ", args.query.cols);
    if (args.d_query.rows() != args.query.rows || args.d_query.cols() != args.kernel.cols())
      detail::fail<ShapeError>(where, "d_query is ", args.d_query.rows(), " x ",
                               args.d_query.cols(), "; expected ", args.query.rows, " x ",
                               args.kernel.cols());
    if (args.d_values.size() != args.query.nonzeros())
      detail::fail<ShapeError>(where, "d_values has ", args.d_values.size(),
                               " entries; expected one per stored value, ", args.query.nonzeros());
    if (args.feature_groups == nullptr) return;
    detail::check_feature_groups(where, args.query, *args.feature_groups, true);
    check_feature_range(where, args.query.cols, args.first_feature, args.feature_count);
  }

  void backward(const KernelGradientArguments& args) const {
    if (args.feature_groups != nullptr) {
      kernel_gradient_by_feature(args);
      return;
    }
    const auto& query = args.query;
    args.d_kernel.setZero();
    for (Index row = 0; row < query.rows; ++row) {
      const auto d_query_row = args.d_query.row(row);
      for (Index k = query.row_begin(row); k < query.row_end(row); ++k)
        args.d_kernel.row(query.column_indices[k]).noalias() += query.values[k] * d_query_row;
    }
  }

  void backward(const ValuesGradientArguments& args) const {
    if (args.feature_groups != nullptr) {
      values_gradient_by_feature(args);
      return;
    }
    const auto& query = args.query;
    Index position = 0;
    for (Index row = 0; row < query.rows; ++row) {
      const auto d_query_row = args.d_query.row(row);
      for (Index k = query.row_begin(row); k < query.row_end(row); ++k)
        args.d_values[position++] = d_query_row.dot(args.kernel.row(query.column_indices[k]));
    }
  }

 private:
  static const Scalar* bias_of(const Arguments& args) {
    return args.bias.size() != 0 ? args.bias.data() : nullptr;
  }

  struct WholeKernelShape {
    Index rows_, cols_;
    Index rows() const { return rows_; }
    Index cols() const { return cols_; }
  };

  // The window [first_column, first_column + w) lies in Wq's N columns, on window_alignment().
  static void check_window(const char* where, const Arguments& args) {
    const Index columns = kernel_columns(args), first = args.first_column;
    const Index end = first + args.kernel.cols();
    if (args.kernel_columns < 0 || first < 0 || end > columns)
      detail::fail<ShapeError>(where, "the kernel's columns [first_column, first_column + ",
                               args.kernel.cols(), ") = [", first, ", ", end,
                               ") are not within kernel_columns ", columns);
    const bool bfloat16 = args.kernel_bfloat16 != nullptr;
    const Index alignment = window_alignment(bfloat16);
    if (first % alignment == 0 && (end == columns || end % alignment == 0)) return;
    if (bfloat16)
      detail::fail<ShapeError>(
          where, "first_column is ", first, " and the window ends at ", end,
          "; expected multiples of ", alignment, " (half of kernel_bfloat16's panel width ",
          detail::kBFloat16PanelColumns, ") or, for the end, kernel_columns ", columns);
    detail::fail<ShapeError>(where, "first_column is ", first, " and the window ends at ", end,
                             "; expected multiples of ", alignment,
                             " (a cache line of Scalar) or, for the end, kernel_columns ", columns);
  }

  // Q = X·Wq + b, by features when by_feature(args) and the CSC is given or the workspace holds
  // it, by rows otherwise: the same sums in the same order either way.
  static void project(const Arguments& args) {
    const Scalar* bias = bias_of(args);
    const Scalar* kernel = args.kernel.data();
    const Index kernel_stride = args.kernel.outerStride(), width = args.kernel.cols();
    Scalar* output = args.output.data();
    const Index stride = args.output.outerStride();
    if (by_feature(args)) {
      if (args.feature_groups != nullptr) {
        detail::csr_dense_product_over_groups(*args.feature_groups, kernel, kernel_stride, bias,
                                              output, stride, width);
        return;
      }
      detail::ScratchCarver carver(args.workspace);
      FeatureGroups groups =
          FeatureGroups::carve(carver, args.query.cols, args.query.nonzeros(), false);
      if (groups.fits(args.query.cols, args.query.nonzeros(), false)) {
        detail::csr_dense_product_by_feature(args.query, kernel, kernel_stride, bias, output,
                                             stride, width, groups);
        return;
      }
    }
    detail::csr_dense_product(args.query, kernel, kernel_stride, bias, output, stride, width,
                              stream_output(args));
  }

  // The same over the rounded Wq (its window's columns): by feature blocks when by_feature(args)
  // and the rows are known to be sorted (cursors in the workspace), by feature over the CSC when
  // they are not, else by rows. The same sums in the same order for sorted rows.
  static void project_bfloat16(const Arguments& args, const RoundedKernel& kernel) {
    const Scalar* bias = bias_of(args);
    Scalar* output = args.output.data();
    const Index stride = args.output.outerStride();
    const Index first = args.first_column, width = args.kernel.cols();
    if (by_feature(args)) {
      detail::ScratchCarver carver(args.workspace);
      if (args.query.sorted_columns) {
        StorageIndex* cursors = carver.take<StorageIndex>(args.query.rows);
        if (cursors != nullptr) {
          detail::bfloat16_window_by_feature_blocks(args.query, kernel, first, width, bias, output,
                                                    stride, cursors);
          return;
        }
      }
      if (args.feature_groups != nullptr) {
        detail::bfloat16_window_over_groups(*args.feature_groups, kernel, first, width, bias,
                                            output, stride);
        return;
      }
      FeatureGroups groups =
          FeatureGroups::carve(carver, args.query.cols, args.query.nonzeros(), false);
      if (groups.fits(args.query.cols, args.query.nonzeros(), false) && args.query.rows > 0) {
        detail::build_feature_groups(args.query, groups);
        detail::bfloat16_window_over_groups(groups, kernel, first, width, bias, output, stride);
        return;
      }
    }
    detail::bfloat16_window_product(args.query, kernel, first, width, bias, output, stride);
  }

  static void check_feature_range(const char* where, Index features, Index first, Index count) {
    if (first < 0 || count < 0 || first + count > features)
      detail::fail<ShapeError>(where, "features [", first, ", ", first + count,
                               ") asked for; expected a range in [0, ", features, ")");
  }

  // Row c of dWq = Σ x_rc·dQ[r, :] over the feature's entries, accumulated and written once.
  static void kernel_gradient_by_feature(const KernelGradientArguments& args) {
    const auto* offsets = args.feature_groups->feature_offsets;
    const auto* entries = args.feature_groups->entries;
    for (Index i = 0; i < args.d_kernel.rows(); ++i) {
      const Index feature = args.first_feature + i;
      auto d_kernel_row = args.d_kernel.row(i);
      d_kernel_row.setZero();
      for (Index k = offsets[feature]; k < offsets[feature + 1]; ++k)
        d_kernel_row.noalias() += entries[k].value * args.d_query.row(Index(entries[k].row));
    }
  }

  // Each used row of Wq read once, against the dQ rows of its entries; results to CSR positions.
  static void values_gradient_by_feature(const ValuesGradientArguments& args) {
    const auto* offsets = args.feature_groups->feature_offsets;
    const auto* entries = args.feature_groups->entries;
    const auto* positions = args.feature_groups->positions;
    const Index last = args.first_feature + args.feature_count;
    for (Index feature = args.first_feature; feature < last; ++feature) {
      const auto kernel_row = args.kernel.row(feature);
      for (Index k = offsets[feature]; k < offsets[feature + 1]; ++k)
        args.d_values[Index(positions[k])] =
            args.d_query.row(Index(entries[k].row)).dot(kernel_row);
    }
  }
};

}  // namespace sdmha
