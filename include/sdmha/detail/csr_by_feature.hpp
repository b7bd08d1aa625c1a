// sdmha/detail/csr_by_feature.hpp — Y = X·W + b for X in CSR and W dense row-major, by features:
// X regrouped into its CSC (FeatureGroups), then each used feature's row of W added into its rows.
//
//   Y(r, :) = b + Σ_{k in row r} x_k · W(col_k, :), as Y(r, panel) += x · W(f, panel) per entry
//   pre:   X validated, by_feature_fits(X); the CSC in scratch carved for X's sizes
//   cost:  O(cols + nnz(X)) to regroup, nnz(X) · N FMAs; each used row of W read once per call
//
// By features (csr_dense_product_by_feature). When W is far beyond L2 and the rows given share
// features, X's rows are regrouped by feature (a CSC copy in caller-provided scratch) and, for
// each used feature, the panels of its W row are loaded into registers one after the other and
// added into every row that holds the feature: Y(r, panel) += x · W(f, panel). The panels go in
// the outer loop (kFeaturePanelPackets packets each), so that one panel of the output block stays
// in L2 while that panel of W streams past, once per call, row after row, instead of one random
// row of W per stored value; a whole output row per stored value would not stay in a 1 MB L2
// beside that stream. Each output entry still accumulates its row's values in ascending feature
// order with one FMA each, so for rows with sorted columns the result is bitwise that of the
// by-row kernel (detail/csr_dense_product.hpp, which includes this header).
//
// The packets it loads: detail/csr_product_packets.hpp.
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>

#include <Eigen/Core>

#include "sdmha/config.hpp"
#include "sdmha/detail/csr_product_packets.hpp"
#include "sdmha/detail/scratch.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/sparse_query.hpp"

namespace sdmha::detail {

// X's stored values regrouped by feature (its CSC), over memory carved from a stage's scratch:
// what the by-feature kernels read. 32-bit-or-narrower StorageIndex keeps it small (the
// forward's 512-row blocks stay in L2).
template <typename Scalar, typename StorageIndex = int>
struct FeatureGroups {
  // A stored value of X: its row and value side by side, so that regrouping writes one place.
  struct Entry {
    StorageIndex row;
    Scalar value;
  };
  StorageIndex* feature_offsets =
      nullptr;  // cols + 1: feature f's entries are [offsets[f], offsets[f + 1])
  StorageIndex* used_features =
      nullptr;  // the first used_count: the features with entries, ascending
  Index used_count = 0;
  Entry* entries = nullptr;  // by feature, then in CSR order
  // With positions: for each entry, its place among X's stored values in CSR order (0 for the
  // first stored value of row 0, without the slack between the rows of an uncompressed matrix).
  // The backward writes dX, which is in CSR order, through them.
  StorageIndex* positions = nullptr;
  Index rows = 0, cols = 0, nonzeros = 0;  // of the X it was built from

  // The scratch bytes for X of `cols` features and `nonzeros` stored values.
  static std::size_t bytes(Index cols, Index nonzeros, bool with_positions) {
    return array_bytes<StorageIndex>(cols + 1) + array_bytes<StorageIndex>(cols) +
           array_bytes<Entry>(nonzeros) +
           (with_positions ? array_bytes<StorageIndex>(nonzeros) : 0);
  }
  // Arrays for X of at most these sizes, taken from `carver`; null arrays when it is too small.
  static FeatureGroups carve(ScratchCarver& carver, Index cols, Index nonzeros,
                             bool with_positions) {
    FeatureGroups groups;
    groups.feature_offsets = carver.take<StorageIndex>(cols + 1);
    groups.used_features = carver.take<StorageIndex>(cols);
    groups.entries = carver.take<Entry>(nonzeros);
    if (with_positions) groups.positions = carver.take<StorageIndex>(nonzeros);
    groups.capacity_ = nonzeros;
    groups.feature_capacity_ = cols;
    return groups;
  }
  bool fits(Index cols_needed, Index nonzeros_needed, bool with_positions) const {
    return feature_offsets != nullptr && used_features != nullptr && entries != nullptr &&
           (!with_positions || positions != nullptr) && cols_needed <= feature_capacity_ &&
           nonzeros_needed <= capacity_;
  }

 private:
  Index capacity_ = 0, feature_capacity_ = 0;
};

// Whether the by-feature kernel can take `x`: its rows must be numbered in StorageIndex (the
// entries are, since the CSR offsets are StorageIndex).
template <typename Scalar, typename StorageIndex>
bool by_feature_fits(const CsrView<Scalar, StorageIndex>& x) {
  return x.rows <= Index(std::numeric_limits<StorageIndex>::max()) &&
         x.cols < Index(std::numeric_limits<StorageIndex>::max());
}

// Whether the query's gradients, dWq = Xᵀ·dQ and dX = dQ·Wqᵀ at X's pattern, go by feature
// (X's CSC) rather than by rows: when Wq and dWq (Eq × N) are beyond L2 and larger than dQ
// (rows × N), and the rows use each feature at least twice on average. By rows, every stored
// value touches a random row of dWq or Wq; by features, each row of dWq and Wq is touched once,
// in order, and the random accesses go to dQ, the smaller. With fewer stored values than that,
// each row is touched about once either way and building the CSC does not pay.
template <typename Scalar, typename StorageIndex>
bool query_gradients_by_feature(const CsrView<Scalar, StorageIndex>& x, Index columns) {
  const double kernel_bytes = double(x.cols) * double(columns) * sizeof(Scalar);
  const double d_query_bytes = double(x.rows) * double(columns) * sizeof(Scalar);
  return kernel_bytes > kCoreCacheBytes && kernel_bytes > d_query_bytes &&
         x.nonzeros() >= 2 * x.cols && by_feature_fits(x);
}

// The sizes that build_feature_groups(x, groups, with_positions) gives, checked by the stages
// that take a CSC (O(1), O(rows) for an uncompressed X; its content, being X's, is the caller's
// precondition).
template <typename Scalar, typename StorageIndex>
void check_feature_groups(const char* where, const CsrView<Scalar, StorageIndex>& x,
                          const FeatureGroups<Scalar, StorageIndex>& groups, bool with_positions) {
  const Index nonzeros = x.nonzeros();
  if (groups.rows != x.rows || groups.cols != x.cols || groups.nonzeros != nonzeros ||
      groups.feature_offsets == nullptr || (with_positions && groups.positions == nullptr))
    fail<ShapeError>(
        where, "feature_groups has ", groups.rows, " rows, ", groups.cols, " features and ",
        groups.nonzeros, " entries", groups.positions == nullptr ? " without" : " with",
        " positions; expected build_feature_groups of the query: ", x.rows, " rows, ", x.cols,
        " features, ", nonzeros, " entries", with_positions ? " and positions" : "");
}

// Fills `groups` (carved for at least X's sizes) with X's CSC: a counting sort by feature that
// keeps CSR order within a feature; with `with_positions`, also each entry's place in CSR order.
template <typename Scalar, typename StorageIndex>
void build_feature_groups(const CsrView<Scalar, StorageIndex>& x,
                          FeatureGroups<Scalar, StorageIndex>& groups,
                          bool with_positions = false) {
  SDMHA_ASSERT(groups.fits(x.cols, x.nonzeros(), with_positions));
  StorageIndex* offsets = groups.feature_offsets;
  const std::size_t features = static_cast<std::size_t>(x.cols);
  std::fill(offsets, offsets + features + 1, StorageIndex(0));
  for (Index row = 0; row < x.rows; ++row) {
    const Index end = x.row_end(row);
    for (Index k = x.row_begin(row); k < end; ++k) ++offsets[std::size_t(x.column_indices[k]) + 1];
  }
  // Prefix sums, and the used features without a branch (about 90 % of them are used on `bow`
  // at 1 %, too many for the branch to be predictable).
  StorageIndex* used = groups.used_features;
  std::size_t used_count = 0;
  for (std::size_t feature = 0; feature < features; ++feature) {
    used[used_count] = StorageIndex(feature);
    used_count += offsets[feature + 1] != 0 ? 1 : 0;
    offsets[feature + 1] += offsets[feature];
  }
  groups.used_count = Index(used_count);
  // offsets[f] serves as feature f's cursor; afterwards it holds feature f's end, which is
  // feature f + 1's begin, so shifting by one place restores the begins.
  auto* entries = groups.entries;
  StorageIndex* positions = with_positions ? groups.positions : nullptr;
  Index in_csr_order = 0;  // Index: one past the last entry may not fit StorageIndex
  for (Index row = 0; row < x.rows; ++row) {
    const Index end = x.row_end(row);
    for (Index k = x.row_begin(row); k < end; ++k, ++in_csr_order) {
      const std::size_t position =
          static_cast<std::size_t>(offsets[std::size_t(x.column_indices[k])]++);
      entries[position].row = StorageIndex(row);
      entries[position].value = x.values[k];
      if (positions != nullptr) positions[position] = StorageIndex(in_csr_order);
    }
  }
  groups.rows = x.rows;
  groups.cols = x.cols;
  groups.nonzeros = in_csr_order;
  if (!with_positions) groups.positions = nullptr;
  for (std::size_t feature = features; feature > 0; --feature)
    offsets[feature] = offsets[feature - 1];
  offsets[0] = 0;
}

// One feature's entries [begin, end), one panel of `Packets` packets from column `first_column`:
// the panel of the feature's W row is loaded into registers once for all of its entries.
template <int Packets, typename Entry, typename Scalar, typename Weight>
EIGEN_ALWAYS_INLINE void scatter_feature_panel(const Entry* entries, Index begin, Index end,
                                               const Weight* weight_row, Scalar* output,
                                               Index output_stride, Index first_column) {
  using namespace Eigen::internal;
  using Packet = typename PacketOf<Scalar>::Packet;
  constexpr int packet_size = PacketOf<Scalar>::size;
  Packet panel[Packets];
  for (int p = 0; p < Packets; ++p)
    panel[p] = load_weight_packet<Packet>(weight_row + first_column + p * packet_size);
  for (Index k = begin; k < end; ++k) {
    Scalar* out = output + Index(entries[k].row) * output_stride + first_column;
    const Packet value = pset1<Packet>(entries[k].value);
    for (int p = 0; p < Packets; ++p)
      pstoreu(out + p * packet_size, pmadd(value, panel[p], ploadu<Packet>(out + p * packet_size)));
  }
}

// Columns of the output per pass of the by-feature kernel: 8 packets (128 floats with AVX-512,
// 512 bytes of each output row), so that a pass's panel of a 512-row block (256 KB) stays in L2
// beside the stream of W, where a whole 2 KB output row per stored value would not.
constexpr int kFeaturePanelPackets = 8;
// The W panel of the used feature this many places ahead is prefetched while the current one is
// added. The used features' rows of W are 4·N bytes or more apart, irregularly (skipping unused
// features), a new 4 KB page every row or two: hardware prefetchers follow that only as well as
// their tables happen to track these particular loads, which varies with where the code lands.
constexpr Index kFeaturePrefetchAhead = 8;

// One pass of the by-feature kernel: Y(:, panel) += x · W(f, panel) for every used feature, the
// panel being `Packets` packets from column `first_column`.
template <int Packets, typename Scalar, typename StorageIndex, typename Weight>
void scatter_panel_by_feature(const FeatureGroups<Scalar, StorageIndex>& groups,
                              const Weight* weight, Index weight_stride, Scalar* output,
                              Index output_stride, Index first_column) {
  const StorageIndex* offsets = groups.feature_offsets;
  constexpr Index kLines = (Packets * PacketOf<Scalar>::size * Index(sizeof(Weight)) + 63) / 64;
  for (Index i = 0; i < groups.used_count; ++i) {
    const Index feature = groups.used_features[i];
    if (i + kFeaturePrefetchAhead < groups.used_count) {
      const char* ahead = reinterpret_cast<const char*>(
          weight + Index(groups.used_features[i + kFeaturePrefetchAhead]) * weight_stride +
          first_column);
      for (Index line = 0; line < kLines; ++line) __builtin_prefetch(ahead + 64 * line, 0, 3);
    }
    scatter_feature_panel<Packets>(groups.entries, offsets[feature], offsets[feature + 1],
                                   weight + feature * weight_stride, output, output_stride,
                                   first_column);
  }
}

// Y's rows [0, rows) × columns [0, columns) set to b (or zero when `bias` is null).
template <typename Scalar>
void fill_rows_with_bias(Index rows, const Scalar* bias, Scalar* output, Index output_stride,
                         Index columns) {
  for (Index row = 0; row < rows; ++row) {
    Scalar* output_row = output + row * output_stride;
    for (Index j = 0; j < columns; ++j) output_row[j] = bias != nullptr ? bias[j] : Scalar(0);
  }
}

// Y(:, 0:columns) += X·W(:, 0:columns) over X's CSC `groups`: the by-feature passes, one per
// column panel (of kFeaturePanelPackets packets, then 4 and 1), then the scalar tail. Which pass
// an entry falls in changes nothing in its sum: every pass adds x · W(f, j) with one FMA, in the
// same order of features.
template <typename Scalar, typename StorageIndex, typename Weight>
void scatter_columns_by_feature(const FeatureGroups<Scalar, StorageIndex>& groups,
                                const Weight* weight, Index weight_stride, Scalar* output,
                                Index output_stride, Index columns) {
  Index column = 0;
  if constexpr (PacketOf<Scalar>::vectorized) {
    constexpr Index packet_size = PacketOf<Scalar>::size;
    constexpr Index panel = kFeaturePanelPackets * packet_size;
    for (; column + panel <= columns; column += panel)
      scatter_panel_by_feature<kFeaturePanelPackets>(groups, weight, weight_stride, output,
                                                     output_stride, column);
    for (; column + 4 * packet_size <= columns; column += 4 * packet_size)
      scatter_panel_by_feature<4>(groups, weight, weight_stride, output, output_stride, column);
    for (; column + packet_size <= columns; column += packet_size)
      scatter_panel_by_feature<1>(groups, weight, weight_stride, output, output_stride, column);
  }
  if (column == columns) return;
  const StorageIndex* offsets = groups.feature_offsets;
  const auto* entries = groups.entries;
  for (Index i = 0; i < groups.used_count; ++i) {
    const Index feature = groups.used_features[i];
    const Weight* weight_row = weight + feature * weight_stride;
    for (Index k = offsets[feature]; k < offsets[feature + 1]; ++k) {
      Scalar* out = output + Index(entries[k].row) * output_stride;
      const Scalar value = entries[k].value;
      for (Index j = column; j < columns; ++j) out[j] += value * static_cast<Scalar>(weight_row[j]);
    }
  }
}

// Y = X·W + b by features over X's CSC `groups`, built by build_feature_groups (groups.rows rows
// of Y). W and Y may be a window of columns of larger matrices (pointers at the window's first
// column): each entry of Y is then the same sum, in the same order, as in a call on the whole.
template <typename Scalar, typename StorageIndex, typename Weight>
void csr_dense_product_over_groups(const FeatureGroups<Scalar, StorageIndex>& groups,
                                   const Weight* weight, Index weight_stride, const Scalar* bias,
                                   Scalar* output, Index output_stride, Index columns) {
  fill_rows_with_bias(groups.rows, bias, output, output_stride, columns);
  scatter_columns_by_feature(groups, weight, weight_stride, output, output_stride, columns);
}

// Y = X·W + b by features (see the top of the file), with the caller's scratch. Requires
// by_feature_fits(x). W (Weight) is Scalar, or bfloat16 widened exactly (Scalar = float): then
// the result is bitwise that of W widened to float, for half of W's stream. Column panels go in the
// outer loop and features in the inner one, so that each pass reads its panel of W once, row after
// row, in order, while its panel of Y stays in L2; every entry of Y still takes its row's values in
// ascending feature order.
template <typename Scalar, typename StorageIndex, typename Weight>
void csr_dense_product_by_feature(const CsrView<Scalar, StorageIndex>& x, const Weight* weight,
                                  Index weight_stride, const Scalar* bias, Scalar* output,
                                  Index output_stride, Index columns,
                                  FeatureGroups<Scalar, StorageIndex>& scratch) {
  SDMHA_ASSERT(by_feature_fits(x));
  build_feature_groups(x, scratch);
  csr_dense_product_over_groups(scratch, weight, weight_stride, bias, output, output_stride,
                                columns);
}

}  // namespace sdmha::detail
