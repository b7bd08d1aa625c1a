// sdmha/detail/csr_dense_product.hpp — Y = X·W + b for X in CSR and W dense row-major: the
// register-blocked kernels behind SparseQueryProjection.
//
//   Y(r, :) = b + Σ_{k in row r} x_k · W(col_k, :)
//
// By rows (csr_dense_product; csr_bfloat16_product, the same loop over a bfloat16 W). Y's columns
// are cut into panels of `kPanelPackets` SIMD packets (then 8, 4 and 1 for what is left).
// For one row and one panel, the panel's accumulators stay in vector registers across all of the
// row's stored values (each stored value costs one broadcast and one load + FMA per packet of
// W's row) and are stored once. Eigen's own sparse × dense product instead reads and writes the
// output row for every stored value: one store per packet and stored value against one per
// packet and row here. Rows go in the outer loop and a row's panels follow one another, so each
// output row is written once, whole and in order, and the row's indices and values are in L1
// for its second panel. What bounds it then is reading 4·N bytes of W from L2 per stored value
// and writing the output, whose lines are first read for ownership; for outputs too large to be
// wanted in cache the caller can ask for streaming stores (`stream`), which write whole lines
// without reading them. Not when W is beyond L2: W's misses dominate there.
//
// By features (csr_dense_product_by_feature, in detail/csr_by_feature.hpp, included here): when
// W is far beyond L2 and the rows share features, X regrouped by feature so that W streams past
// in order, once per call. The packets both kernels load and store, and the SIMD behind them:
// detail/csr_product_packets.hpp.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include <Eigen/Core>

#include "sdmha/config.hpp"
#include "sdmha/detail/csr_by_feature.hpp"
#include "sdmha/detail/csr_product_packets.hpp"
#include "sdmha/detail/scratch.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/sparse_query.hpp"

namespace sdmha::detail {

// 16 packets of accumulators (256 floats with AVX-512) leave registers for the broadcast value
// and the loads, and give each of the 16 independent FMA chains work to hide its latency.
constexpr int kPanelPackets = 16;

// Below this many bytes of output a call's result is left to the cache (the caller may read it
// right away); above it, when W fits in L2, the stage asks by-row for streaming stores, so that
// the output's lines are written without first being read for ownership.
constexpr double kStreamOutputBytes = 256.0 * 1024;

// ---- by rows, with W in Scalar or in bfloat16 -----------------------------------------------
//
// W may also be stored in bfloat16 (Eigen::bfloat16: float's upper 16 bits, rounded to nearest
// even; Scalar = float). Each W entry is then widened exactly to float before its FMA, which is
// the float kernel's, so the result is bitwise the float kernel's on W widened to float: the only
// rounding is W's own. What it saves is memory traffic: a stored value reads 2·N bytes of W
// instead of 4·N. When such a W is beyond L2, the rows of W of the stored values
// `kBFloat16PrefetchAhead` places ahead in the row are prefetched whole, since each one is a
// random row of W that would otherwise be a demand miss to memory.
constexpr Index kBFloat16PrefetchAhead = 16;

// One row, one panel of `Packets` packets from column `first_column`: the stored values
// [begin, end) with their feature columns. With `Prefetch` and `prefetch_lines` > 0, also that
// many cache lines of each row of W that the stored value kBFloat16PrefetchAhead places ahead in
// the row reads (a compile-time switch, so that the float loop carries no test for it).
template <int Packets, bool Prefetch, typename Scalar, typename StorageIndex, typename Weight>
EIGEN_ALWAYS_INLINE void csr_dense_row_panel(const StorageIndex* columns, const Scalar* values,
                                             Index begin, Index end, const Weight* weight,
                                             Index weight_stride, const Scalar* bias,
                                             Scalar* output_row, Index first_column, bool stream,
                                             Index prefetch_lines) {
  using namespace Eigen::internal;
  using Packet = typename PacketOf<Scalar>::Packet;
  constexpr int packet_size = PacketOf<Scalar>::size;
  Packet accumulator[Packets];
  for (int p = 0; p < Packets; ++p)
    accumulator[p] = bias != nullptr ? ploadu<Packet>(bias + first_column + p * packet_size)
                                     : pset1<Packet>(Scalar(0));
  for (Index k = begin; k < end; ++k) {
    if constexpr (Prefetch) {
      if (prefetch_lines > 0 && k + kBFloat16PrefetchAhead < end) {
        const char* ahead = reinterpret_cast<const char*>(
            weight + Index(columns[k + kBFloat16PrefetchAhead]) * weight_stride);
        for (Index line = 0; line < prefetch_lines; ++line)
          __builtin_prefetch(ahead + 64 * line, 0, 3);
      }
    }
    const Weight* weight_row = weight + Index(columns[k]) * weight_stride + first_column;
    const Packet value = pset1<Packet>(values[k]);
    for (int p = 0; p < Packets; ++p)
      accumulator[p] =
          pmadd(value, load_weight_packet<Packet>(weight_row + p * packet_size), accumulator[p]);
  }
  Scalar* out = output_row + first_column;
  for (int p = 0; p < Packets; ++p) store_packet(out + p * packet_size, accumulator[p], stream);
}

// A run of one row's panels of `Packets` packets from `column` on, while they fit in `columns`;
// returns the first column left. Only the row's first panel prefetches (it brings whole rows).
template <int Packets, bool Prefetch, typename Scalar, typename StorageIndex, typename Weight>
EIGEN_ALWAYS_INLINE Index csr_dense_row_panel_run(const StorageIndex* columns, const Scalar* values,
                                                  Index begin, Index end, const Weight* weight,
                                                  Index weight_stride, const Scalar* bias,
                                                  Scalar* output_row, Index column,
                                                  Index width_left, bool stream,
                                                  Index& prefetch_lines) {
  constexpr Index width = Packets * PacketOf<Scalar>::size;
  for (; column + width <= width_left; column += width, prefetch_lines = 0)
    csr_dense_row_panel<Packets, Prefetch>(columns, values, begin, end, weight, weight_stride, bias,
                                           output_row, column, stream, prefetch_lines);
  return column;
}

// Y (x.rows × columns, row stride output_stride) = X·W + b, W (x.cols × columns, row stride
// weight_stride; Weight = Scalar, or bfloat16 widened exactly for Scalar = float), b of
// `columns` entries or nullptr; with `Prefetch`, W's rows of the stored values ahead are
// prefetched. X must be validated. A `FixedStride` other than 0 is W's row stride, known to the
// compiler (the bfloat16 panels'), which then addresses W's rows with a shift.
template <bool Prefetch, Index FixedStride = 0, typename Scalar, typename StorageIndex,
          typename Weight>
void csr_dense_product_by_rows(const CsrView<Scalar, StorageIndex>& x, const Weight* weight,
                               Index given_stride, const Scalar* bias, Scalar* output,
                               Index output_stride, Index columns, bool stream) {
  SDMHA_ASSERT(FixedStride == 0 || given_stride == FixedStride);
  const Index weight_stride = FixedStride != 0 ? FixedStride : given_stride;
  const Index row_lines = Prefetch ? (columns * Index(sizeof(Weight)) + 63) / 64 : 0;
  const StorageIndex* indices = x.column_indices;
  const Scalar* values = x.values;
  for (Index row = 0; row < x.rows; ++row) {
    const Index begin = x.row_begin(row), end = x.row_end(row);
    Scalar* output_row = output + row * output_stride;
    Index column = 0, prefetch_lines = row_lines;
    if constexpr (PacketOf<Scalar>::vectorized) {
      column = csr_dense_row_panel_run<kPanelPackets, Prefetch>(
          indices, values, begin, end, weight, weight_stride, bias, output_row, column, columns,
          stream, prefetch_lines);
      column = csr_dense_row_panel_run<8, Prefetch>(indices, values, begin, end, weight,
                                                    weight_stride, bias, output_row, column,
                                                    columns, stream, prefetch_lines);
      column = csr_dense_row_panel_run<4, Prefetch>(indices, values, begin, end, weight,
                                                    weight_stride, bias, output_row, column,
                                                    columns, stream, prefetch_lines);
      column = csr_dense_row_panel_run<1, Prefetch>(indices, values, begin, end, weight,
                                                    weight_stride, bias, output_row, column,
                                                    columns, stream, prefetch_lines);
    }
    if (column == columns) continue;
    // The scalar tail: the columns that do not fill a packet (all of them without SIMD), stored
    // value by stored value so that W's rows are read in order.
    for (Index j = column; j < columns; ++j) output_row[j] = bias != nullptr ? bias[j] : Scalar(0);
    for (Index k = begin; k < end; ++k) {
      const Weight* weight_row = weight + Index(indices[k]) * weight_stride;
      const Scalar value = values[k];
      for (Index j = column; j < columns; ++j)
        output_row[j] += value * static_cast<Scalar>(weight_row[j]);
    }
  }
  if (stream) stream_fence();
}

// By rows, W in Scalar (see the top of the file).
template <typename Scalar, typename StorageIndex>
void csr_dense_product(const CsrView<Scalar, StorageIndex>& x, const Scalar* weight,
                       Index weight_stride, const Scalar* bias, Scalar* output, Index output_stride,
                       Index columns, bool stream = false) {
  csr_dense_product_by_rows</*Prefetch=*/false>(x, weight, weight_stride, bias, output,
                                                output_stride, columns, stream);
}

// By rows, W (x.cols × columns, row stride weight_stride) in bfloat16; float X, b and Y. X must
// be validated. Its stores are plain: the stage asks for streaming ones on the float path only.
template <typename StorageIndex>
void csr_bfloat16_product(const CsrView<float, StorageIndex>& x, const Eigen::bfloat16* weight,
                          Index weight_stride, const float* bias, float* output,
                          Index output_stride, Index columns) {
  const bool beyond_cache =
      double(x.cols) * double(columns) * sizeof(Eigen::bfloat16) > kCoreCacheBytes;
  if (beyond_cache) {
    csr_dense_product_by_rows</*Prefetch=*/true>(x, weight, weight_stride, bias, output,
                                                 output_stride, columns, /*stream=*/false);
  } else {
    csr_dense_product_by_rows</*Prefetch=*/false>(x, weight, weight_stride, bias, output,
                                                  output_stride, columns, /*stream=*/false);
  }
}

}  // namespace sdmha::detail
