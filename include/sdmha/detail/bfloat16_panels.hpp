// sdmha/detail/bfloat16_panels.hpp — the query kernel rounded to bfloat16 and stored by column
// panels, and Y = X·W̃ + b over it for X in CSR.
//
//   math:  Y(r, :) = b + Σ_{k in row r} x_k · W̃(col_k, :),  W̃ = W rounded to nearest bfloat16
//   pre:   X validated (columns in [0, Eq)); W̃ has Eq rows and N columns; Y is rows × N
//   cost:  2·nnz(X)·N flops, reading 2·N bytes of W̃ per stored value (from L2 by feature blocks)
//
// Layout (BFloat16Panels): panel p holds columns [p·C, p·C + C) of every row of W, row after row
// (C = kBFloat16PanelColumns; the last panel padded with zeros, so the copy holds
// Eq·C·⌈N/C⌉ entries). One panel of a block of consecutive features is then one contiguous run
// of memory, which the by-feature-blocks kernel reads as a stream; a row's panel is still
// contiguous for the other two kernels.
//
// Three kernels, each adding one term per entry and output column, as csr_dense_product does on
// W̃ (an FMA per packet, the columns past the last full packet with the same scalar loop). By
// rows and by feature blocks take a row's values in CSR order, by feature in ascending feature
// order: all three give csr_dense_product's bits on W̃ for rows with sorted columns.
// - by rows (bfloat16_panels_product): csr_bfloat16_product's loop on each panel (the panel's
//   row stride fixed at compile time), prefetching W̃'s rows ahead when the panel is beyond L2.
// - by feature (bfloat16_panels_by_feature): X's CSC, each feature's panel row held in registers
//   and added into the rows that use it (the output panel read and written per stored value).
// - by feature blocks (bfloat16_panels_by_feature_blocks; rows with sorted columns): for each
//   panel and each block of kFeatureBlockBytes of it, each row's stored values inside the block
//   are added into the row's panel held in registers, so that the output is read and written
//   once per row and block instead of once per stored value, and the block is read from L2 per
//   stored value. While the rows go through one block, the next one is prefetched a slice per
//   row: fetched on demand, its lines would come from memory in the random order of the rows'
//   features. Each row keeps a cursor into its stored values (caller's scratch, one index a row).
//   The cursor only moves forward and the last block's bound is Eq, so every entry is added once,
//   in CSR order, whatever the order of a row's columns; sorted rows are what make each block's
//   entries a row's next ones (locality) and the order the by-feature kernel's (bits).
//
// Each kernel also takes a window of W̃'s columns (the *_window_* functions; the whole-W̃ ones
// call them with the window [0, N)): the panels it crosses, each over the segment of it inside
// the window. A column of Y gets the same terms in the same order, and falls in a SIMD packet or
// in the scalar tail alike, whatever window it is computed in, as long as windows start at
// multiples of the packet size (the stage asks for half panels): the bits do not depend on how
// the columns are split. The feature-block kernel holds a whole panel in registers, or half of
// one for a segment that starts mid-panel or is no wider than half a panel.
#pragma once

#include <algorithm>

#include "sdmha/config.hpp"
#include "sdmha/detail/csr_dense_product.hpp"

namespace sdmha::detail {

// Columns of one panel: 128 floats of output are 8 AVX-512 packets, held in registers by the
// by-feature-blocks kernel with room left for the broadcast value and the loads.
constexpr Index kBFloat16PanelColumns = 128;
// Bytes of one block of one panel (1024 features): the block being read, the next one being
// prefetched and the 256 KB output panel of a 512-row block fit in a 1 MB L2 together.
constexpr Index kFeatureBlockBytes = 256 * 1024;

// W (rows × cols, float) rounded to nearest bfloat16, stored by column panels (see the top).
class BFloat16Panels {
 public:
  BFloat16Panels() = default;
  explicit BFloat16Panels(ConstMatrixRef<float> kernel)
      : rows_(kernel.rows()), cols_(kernel.cols()) {
    const Index panels = panel_count();
    data_.setZero(panels * rows_ * kBFloat16PanelColumns);
    for (Index p = 0; p < panels; ++p) {
      const Index first = p * kBFloat16PanelColumns, width = panel_width(p);
      for (Index row = 0; row < rows_; ++row) {
        Eigen::bfloat16* out = data_.data() + (p * rows_ + row) * kBFloat16PanelColumns;
        for (Index j = 0; j < width; ++j) out[j] = Eigen::bfloat16(kernel(row, first + j));
      }
    }
  }

  Index rows() const { return rows_; }
  Index cols() const { return cols_; }
  Index panel_count() const { return (cols_ + kBFloat16PanelColumns - 1) / kBFloat16PanelColumns; }
  // The columns of panel p that are W's (the rest of a last panel is padding).
  Index panel_width(Index p) const {
    return std::min(kBFloat16PanelColumns, cols_ - p * kBFloat16PanelColumns);
  }
  // Panel p: rows() rows of kBFloat16PanelColumns entries, row-major.
  const Eigen::bfloat16* panel(Index p) const {
    return data_.data() + p * rows_ * kBFloat16PanelColumns;
  }
  // W̃(row, col), widened.
  float operator()(Index row, Index col) const {
    const Index p = col / kBFloat16PanelColumns;
    return float(panel(p)[row * kBFloat16PanelColumns + col - p * kBFloat16PanelColumns]);
  }

 private:
  Index rows_ = 0, cols_ = 0;
  Eigen::Matrix<Eigen::bfloat16, Eigen::Dynamic, 1> data_;  // aligned as Eigen aligns packets
};

// A window of W̃'s columns, [first_column, first_column + columns), meets the panels it crosses
// in segments: `width` columns of panel `panel` from `offset` in it, which are the window's
// columns from `window_offset`. The whole of W̃ is the window (0, cols()).
struct PanelSegment {
  Index panel = 0, offset = 0, width = 0, window_offset = 0;
};
inline Index panel_segment_count(Index first_column, Index columns) {
  if (columns <= 0) return 0;
  return (first_column + columns - 1) / kBFloat16PanelColumns -
         first_column / kBFloat16PanelColumns + 1;
}
inline PanelSegment panel_segment(const BFloat16Panels& weight, Index first_column, Index columns,
                                  Index segment) {
  const Index panel = first_column / kBFloat16PanelColumns + segment;
  const Index panel_first = panel * kBFloat16PanelColumns;
  const Index begin = std::max(first_column, panel_first);
  const Index end = std::min(first_column + columns, panel_first + weight.panel_width(panel));
  return {panel, begin - panel_first, end - begin, begin - first_column};
}

// By rows: Y = X·W̃(:, window) + b, segment after segment; Y and b are the window's (pointers at
// its first column). X must be validated. Whether W̃'s rows are prefetched is decided by the
// whole panel's width, so a window reads them as a whole call does.
template <typename StorageIndex>
void bfloat16_window_product(const CsrView<float, StorageIndex>& x, const BFloat16Panels& weight,
                             Index first_column, Index columns, const float* bias, float* output,
                             Index output_stride) {
  if (x.rows == 0) return;  // the output may be empty (null): no offsets into it
  for (Index i = 0; i < panel_segment_count(first_column, columns); ++i) {
    const PanelSegment s = panel_segment(weight, first_column, columns, i);
    const bool beyond_cache =
        double(x.cols) * double(weight.panel_width(s.panel)) * sizeof(Eigen::bfloat16) >
        kCoreCacheBytes;
    const Eigen::bfloat16* panel = weight.panel(s.panel) + s.offset;
    const float* segment_bias = bias != nullptr ? bias + s.window_offset : nullptr;
    float* out = output + s.window_offset;
    if (beyond_cache) {
      csr_dense_product_by_rows<true, kBFloat16PanelColumns>(x, panel, kBFloat16PanelColumns,
                                                             segment_bias, out, output_stride,
                                                             s.width, /*stream=*/false);
    } else {
      csr_dense_product_by_rows<false, kBFloat16PanelColumns>(x, panel, kBFloat16PanelColumns,
                                                              segment_bias, out, output_stride,
                                                              s.width, /*stream=*/false);
    }
  }
}

// By rows over the whole of W̃.
template <typename StorageIndex>
void bfloat16_panels_product(const CsrView<float, StorageIndex>& x, const BFloat16Panels& weight,
                             const float* bias, float* output, Index output_stride) {
  bfloat16_window_product(x, weight, 0, weight.cols(), bias, output, output_stride);
}

// By feature: Y = X·W̃(:, window) + b over X's CSC `groups` (build_feature_groups; groups.rows
// rows of Y), Y and b the window's.
template <typename StorageIndex>
void bfloat16_window_over_groups(const FeatureGroups<float, StorageIndex>& groups,
                                 const BFloat16Panels& weight, Index first_column, Index columns,
                                 const float* bias, float* output, Index output_stride) {
  if (groups.rows == 0) return;
  fill_rows_with_bias(groups.rows, bias, output, output_stride, columns);
  for (Index i = 0; i < panel_segment_count(first_column, columns); ++i) {
    const PanelSegment s = panel_segment(weight, first_column, columns, i);
    scatter_columns_by_feature(groups, weight.panel(s.panel) + s.offset, kBFloat16PanelColumns,
                               output + s.window_offset, output_stride, s.width);
  }
}

// By feature over the whole of W̃, X's CSC built once into `scratch` (carved for X's sizes).
// Requires by_feature_fits(x).
template <typename StorageIndex>
void bfloat16_panels_by_feature(const CsrView<float, StorageIndex>& x, const BFloat16Panels& weight,
                                const float* bias, float* output, Index output_stride,
                                FeatureGroups<float, StorageIndex>& scratch) {
  SDMHA_ASSERT(by_feature_fits(x));
  if (x.rows == 0) return;
  build_feature_groups(x, scratch);
  bfloat16_window_over_groups(scratch, weight, 0, weight.cols(), bias, output, output_stride);
}

// The stored values in [begin, end) of a row with sorted columns whose column is below `bound`:
// how many, from `begin`. A row holds about ten per block on `bow`, at random: compared sixteen at
// a time where AVX-512 allows, so that the loop ends on a count rather than a branch per entry.
template <typename StorageIndex>
EIGEN_ALWAYS_INLINE Index entries_below(const StorageIndex* columns, Index begin, Index end,
                                        Index bound) {
  Index count = 0;
#if defined(EIGEN_VECTORIZE_AVX512)
  if constexpr (sizeof(StorageIndex) == 4) {
    const __m512i limit = _mm512_set1_epi32(int(bound));
    while (begin + count < end) {
      const Index left = end - begin - count;
      const __mmask16 valid = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
      const __m512i indices = _mm512_maskz_loadu_epi32(valid, columns + begin + count);
      const int below = __builtin_popcount(_mm512_mask_cmplt_epi32_mask(valid, indices, limit));
      count += below;
      if (below < 16) return count;
    }
    return count;
  }
#endif
  while (begin + count < end && Index(columns[begin + count]) < bound) ++count;
  return count;
}

// One row's stored values [begin, end) added into `Columns` floats of its output at `out`, from
// the rows of W̃'s panel at `panel` (the segment's first column; rows kBFloat16PanelColumns apart).
template <Index Columns, typename StorageIndex>
EIGEN_ALWAYS_INLINE void add_row_to_panel(const StorageIndex* columns, const float* values,
                                          Index begin, Index end, const Eigen::bfloat16* panel,
                                          float* out) {
  if constexpr (PacketOf<float>::vectorized) {
    using namespace Eigen::internal;
    using Packet = typename PacketOf<float>::Packet;
    constexpr int packet_size = PacketOf<float>::size;
    constexpr int packets = int(Columns) / packet_size;
    Packet accumulator[packets];
    for (int q = 0; q < packets; ++q) accumulator[q] = ploadu<Packet>(out + q * packet_size);
    for (Index k = begin; k < end; ++k) {
      const Eigen::bfloat16* row = panel + Index(columns[k]) * kBFloat16PanelColumns;
      const Packet value = pset1<Packet>(values[k]);
      for (int q = 0; q < packets; ++q)
        accumulator[q] = pmadd(value, load_widened<Packet>(row + q * packet_size), accumulator[q]);
    }
    for (int q = 0; q < packets; ++q) pstoreu(out + q * packet_size, accumulator[q]);
  } else {
    for (Index k = begin; k < end; ++k) {
      const Eigen::bfloat16* row = panel + Index(columns[k]) * kBFloat16PanelColumns;
      for (Index j = 0; j < Columns; ++j) out[j] += values[k] * static_cast<float>(row[j]);
    }
  }
}

// The same for a segment `width` < Columns wide: its full packets through a copy `Columns` wide
// (the columns past the segment are read from the panel's row, which holds them or zero
// padding), the columns past them with the scalar loop of the other kernels' tails (whether the
// compiler fuses it is then the same for all).
template <Index Columns, typename StorageIndex>
void add_row_to_narrow_panel(const StorageIndex* columns, const float* values, Index begin,
                             Index end, const Eigen::bfloat16* panel, Index width, float* out) {
  constexpr Index packet_size = PacketOf<float>::vectorized ? PacketOf<float>::size : 1;
  const Index packed = width / packet_size * packet_size;
  alignas(64) float row_panel[Columns] = {};
  std::copy(out, out + packed, row_panel);
  add_row_to_panel<Columns>(columns, values, begin, end, panel, row_panel);
  std::copy(row_panel, row_panel + packed, out);
  for (Index k = begin; k < end; ++k) {
    const Eigen::bfloat16* row = panel + Index(columns[k]) * kBFloat16PanelColumns;
    const float value = values[k];
    for (Index j = packed; j < width; ++j) out[j] += value * static_cast<float>(row[j]);
  }
}

// The lines the feature-blocks kernel prefetches while it adds a block: `lines` cache lines of
// each of `features` consecutive panel rows from `first` (rows kBFloat16PanelColumns entries
// apart); for a whole panel, one contiguous run.
struct BlockLines {
  const char* first = nullptr;
  Index features = 0, lines = 0;
};

// One segment's block of features (those below `block_end` not yet passed) over every row: Y's
// segment at `output` (`width` columns, added `Columns` at a time), the cursors advanced past the
// row's stored values inside the block; meanwhile the lines of `next` are prefetched, a slice
// per row.
template <Index Columns, typename StorageIndex>
void add_feature_block(const CsrView<float, StorageIndex>& x, const Eigen::bfloat16* panel,
                       Index width, Index block_end, const BlockLines& next, float* output,
                       Index output_stride, StorageIndex* cursors) {
  constexpr Index row_bytes = kBFloat16PanelColumns * Index(sizeof(Eigen::bfloat16));
  const Index next_lines = next.features * next.lines;
  const Index lines_per_row = x.rows > 0 ? (next_lines + x.rows - 1) / x.rows : 0;
  const char* next_row = next.first;
  Index prefetched = 0, line_in_row = 0;
  for (Index row = 0; row < x.rows; ++row) {
    for (Index line = 0; line < lines_per_row && prefetched < next_lines; ++line, ++prefetched) {
      __builtin_prefetch(next_row + 64 * line_in_row, 0, 3);
      if (++line_in_row == next.lines) line_in_row = 0, next_row += row_bytes;
    }
    const Index begin = cursors[row];
    const Index count = entries_below(x.column_indices, begin, x.row_end(row), block_end);
    if (count == 0) continue;
    cursors[row] = StorageIndex(begin + count);
    float* out = output + row * output_stride;
    if (width == Columns) {
      add_row_to_panel<Columns>(x.column_indices, x.values, begin, begin + count, panel, out);
    } else {
      add_row_to_narrow_panel<Columns>(x.column_indices, x.values, begin, begin + count, panel,
                                       width, out);
    }
  }
}

// A segment is added a whole panel (kBFloat16PanelColumns) at a time when it starts the panel
// and is wider than half of it, else half a panel at a time: a segment starting mid-panel (a
// window's) is at most half a panel wide, so that no read passes its panel's row.
constexpr Index kHalfPanelColumns = kBFloat16PanelColumns / 2;
inline bool whole_panel_segment(const PanelSegment& s) {
  return s.offset == 0 && s.width > kHalfPanelColumns;
}
inline BlockLines segment_lines(const BFloat16Panels& weight, const PanelSegment& s, Index first,
                                Index features) {
  const Index columns = whole_panel_segment(s) ? kBFloat16PanelColumns : kHalfPanelColumns;
  return {reinterpret_cast<const char*>(weight.panel(s.panel) + first * kBFloat16PanelColumns +
                                        s.offset),
          features, columns * Index(sizeof(Eigen::bfloat16)) / 64};
}

// By feature blocks: Y = X·W̃(:, window) + b for X whose rows have sorted (non-decreasing)
// columns, with `cursors` (x.rows entries of scratch); Y and b the window's. Segments in the
// outer loop, then blocks of kFeatureBlockBytes of a panel, then rows. The window must start at
// a multiple of kHalfPanelColumns.
template <typename StorageIndex>
void bfloat16_window_by_feature_blocks(const CsrView<float, StorageIndex>& x,
                                       const BFloat16Panels& weight, Index first_column,
                                       Index columns, const float* bias, float* output,
                                       Index output_stride, StorageIndex* cursors) {
  SDMHA_ASSERT(first_column % kHalfPanelColumns == 0);
  if (x.rows == 0) return;
  fill_rows_with_bias(x.rows, bias, output, output_stride, columns);
  constexpr Index block_features =
      kFeatureBlockBytes / (kBFloat16PanelColumns * Index(sizeof(Eigen::bfloat16)));
  const Index features = weight.rows(), segments = panel_segment_count(first_column, columns);
  for (Index i = 0; i < segments; ++i) {
    const PanelSegment s = panel_segment(weight, first_column, columns, i);
    const Eigen::bfloat16* panel = weight.panel(s.panel) + s.offset;
    float* out = output + s.window_offset;
    for (Index row = 0; row < x.rows; ++row) cursors[row] = StorageIndex(x.row_begin(row));
    for (Index first = 0; first < features; first += block_features) {
      const Index end = std::min(features, first + block_features);
      // The block after this one: the next of this segment, else the first of the next segment.
      BlockLines next;
      if (end < features) {
        next = segment_lines(weight, s, end, std::min(features, end + block_features) - end);
      } else if (i + 1 < segments) {
        next = segment_lines(weight, panel_segment(weight, first_column, columns, i + 1), 0,
                             std::min(features, block_features));
      }
      if (whole_panel_segment(s)) {
        add_feature_block<kBFloat16PanelColumns>(x, panel, s.width, end, next, out, output_stride,
                                                 cursors);
      } else {
        add_feature_block<kHalfPanelColumns>(x, panel, s.width, end, next, out, output_stride,
                                             cursors);
      }
    }
  }
}

// By feature blocks over the whole of W̃.
template <typename StorageIndex>
void bfloat16_panels_by_feature_blocks(const CsrView<float, StorageIndex>& x,
                                       const BFloat16Panels& weight, const float* bias,
                                       float* output, Index output_stride, StorageIndex* cursors) {
  bfloat16_window_by_feature_blocks(x, weight, 0, weight.cols(), bias, output, output_stride,
                                    cursors);
}

}  // namespace sdmha::detail
