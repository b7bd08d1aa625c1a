// sdmha/detail/csr_dense_product.hpp — Y = X·W + b for X in CSR and W dense row-major: the
// register-blocked kernel behind SparseQueryProjection.
//
// Y's columns are cut into panels of `kPanelPackets` SIMD packets. For one row and one panel, the
// panel's accumulators stay in vector registers across all of the row's stored values (each
// stored value costs one broadcast and kPanelPackets loads + FMAs from W's row) and are stored
// once. Eigen's own sparse × dense product instead reads and writes the output row for every
// stored value. Panels go in the outer loop so that a panel of W (Eq × panel columns) is reused
// by all rows of a row block while it is in cache. SIMD comes from Eigen's packet primitives,
// so the kernel follows whatever -m flags Eigen vectorises for (SSE2 to AVX-512), with a scalar
// tail for the columns that do not fill a packet.
#pragma once

#include <vector>

#include <Eigen/Core>

#include "sdmha/config.hpp"
#include "sdmha/sparse_query.hpp"

namespace sdmha::detail {

template <typename Scalar>
struct PacketOf {
  using Packet = typename Eigen::internal::packet_traits<Scalar>::type;
  static constexpr int size = Eigen::internal::unpacket_traits<Packet>::size;
  static constexpr bool vectorized = Eigen::internal::packet_traits<Scalar>::Vectorizable && size > 1;
};

// One panel of `Packets` packets starting at column `first_column`, for every row of `x`.
template <int Packets, typename Scalar, typename StorageIndex>
void csr_dense_panel(const CsrView<Scalar, StorageIndex>& x, const Scalar* weight, Index weight_stride,
                     const Scalar* bias, Scalar* output, Index output_stride, Index first_column) {
  using namespace Eigen::internal;
  using Packet = typename PacketOf<Scalar>::Packet;
  constexpr int packet_size = PacketOf<Scalar>::size;
  const StorageIndex* columns = x.column_indices;
  const Scalar* values = x.values;
  for (Index row = 0; row < x.rows; ++row) {
    Packet accumulator[Packets];
    for (int p = 0; p < Packets; ++p)
      accumulator[p] = bias != nullptr ? ploadu<Packet>(bias + first_column + p * packet_size)
                                       : pset1<Packet>(Scalar(0));
    const Index end = x.row_end(row);
    for (Index k = x.row_begin(row); k < end; ++k) {
      const Scalar* weight_row = weight + Index(columns[k]) * weight_stride + first_column;
      const Packet value = pset1<Packet>(values[k]);
      for (int p = 0; p < Packets; ++p)
        accumulator[p] = pmadd(value, ploadu<Packet>(weight_row + p * packet_size), accumulator[p]);
    }
    Scalar* output_row = output + row * output_stride + first_column;
    for (int p = 0; p < Packets; ++p) pstoreu(output_row + p * packet_size, accumulator[p]);
  }
}

// Columns [first_column, first_column + count) with plain scalar arithmetic.
template <typename Scalar, typename StorageIndex>
void csr_dense_columns_scalar(const CsrView<Scalar, StorageIndex>& x, const Scalar* weight,
                              Index weight_stride, const Scalar* bias, Scalar* output,
                              Index output_stride, Index first_column, Index count) {
  for (Index row = 0; row < x.rows; ++row) {
    Scalar* output_row = output + row * output_stride + first_column;
    for (Index j = 0; j < count; ++j) output_row[j] = bias != nullptr ? bias[first_column + j] : Scalar(0);
    for (Index k = x.row_begin(row); k < x.row_end(row); ++k) {
      const Scalar* weight_row = weight + Index(x.column_indices[k]) * weight_stride + first_column;
      const Scalar value = x.values[k];
      for (Index j = 0; j < count; ++j) output_row[j] += value * weight_row[j];
    }
  }
}

// Y (x.rows × columns, row stride output_stride) = X·W + b, W (x.cols × columns, row stride
// weight_stride), b of `columns` entries or nullptr. X must be validated.
template <typename Scalar, typename StorageIndex>
void csr_dense_product(const CsrView<Scalar, StorageIndex>& x, const Scalar* weight, Index weight_stride,
                       const Scalar* bias, Scalar* output, Index output_stride, Index columns) {
  // 16 packets of accumulators (256 floats with AVX-512) leave registers for the broadcast
  // value and the loads, and give each FMA chain enough independent work to hide its latency.
  constexpr int kPanelPackets = 16;
  Index column = 0;
  if constexpr (PacketOf<Scalar>::vectorized) {
    constexpr Index packet_size = PacketOf<Scalar>::size;
    for (; column + kPanelPackets * packet_size <= columns; column += kPanelPackets * packet_size)
      csr_dense_panel<kPanelPackets>(x, weight, weight_stride, bias, output, output_stride, column);
    for (; column + 4 * packet_size <= columns; column += 4 * packet_size)
      csr_dense_panel<4>(x, weight, weight_stride, bias, output, output_stride, column);
    for (; column + packet_size <= columns; column += packet_size)
      csr_dense_panel<1>(x, weight, weight_stride, bias, output, output_stride, column);
  }
  if (column < columns)
    csr_dense_columns_scalar(x, weight, weight_stride, bias, output, output_stride, column, columns - column);
}

// Y = X·W + b by features, for a W too large for cache that many rows share: X's rows are
// regrouped by feature (CSC), and for each feature the panel of W's row is loaded into registers
// once and added into every row that holds the feature, whose output panel stays in L1/L2.
// W then streams from memory once per panel instead of once per stored value. Each output entry
// still accumulates its row's values in ascending feature order with one FMA each, so for rows
// with sorted columns the result is bitwise that of csr_dense_product.
template <int Packets, typename Scalar>
void scatter_feature_panel(const std::vector<Index>& feature_offsets, const std::vector<Index>& used_features,
                           const std::vector<Index>& entry_rows, const std::vector<Scalar>& entry_values,
                           const Scalar* weight, Index weight_stride, Scalar* output,
                           Index output_stride, Index first_column) {
  using namespace Eigen::internal;
  using Packet = typename PacketOf<Scalar>::Packet;
  constexpr int packet_size = PacketOf<Scalar>::size;
  for (const Index feature : used_features) {
    const Scalar* weight_row = weight + feature * weight_stride + first_column;
    Packet panel[Packets];
    for (int p = 0; p < Packets; ++p) panel[p] = ploadu<Packet>(weight_row + p * packet_size);
    for (Index k = feature_offsets[feature]; k < feature_offsets[feature + 1]; ++k) {
      Scalar* out = output + entry_rows[k] * output_stride + first_column;
      const Packet value = pset1<Packet>(entry_values[k]);
      for (int p = 0; p < Packets; ++p)
        pstoreu(out + p * packet_size, pmadd(value, panel[p], ploadu<Packet>(out + p * packet_size)));
    }
  }
}

template <typename Scalar, typename StorageIndex>
void csr_dense_product_by_feature(const CsrView<Scalar, StorageIndex>& x, const Scalar* weight,
                                  Index weight_stride, const Scalar* bias, Scalar* output,
                                  Index output_stride, Index columns) {
  // CSC of x by counting sort: feature_offsets[f] … feature_offsets[f + 1] hold (row, value).
  std::vector<Index> feature_offsets(static_cast<std::size_t>(x.cols) + 1, 0);
  for (Index row = 0; row < x.rows; ++row)
    for (Index k = x.row_begin(row); k < x.row_end(row); ++k) ++feature_offsets[std::size_t(x.column_indices[k]) + 1];
  std::vector<Index> used_features;
  for (Index feature = 0; feature < x.cols; ++feature) {
    if (feature_offsets[feature + 1] != 0) used_features.push_back(feature);
    feature_offsets[feature + 1] += feature_offsets[feature];
  }
  std::vector<Index> entry_rows(static_cast<std::size_t>(feature_offsets[x.cols]));
  std::vector<Scalar> entry_values(entry_rows.size());
  {
    std::vector<Index> cursor(feature_offsets.begin(), feature_offsets.end() - 1);
    for (Index row = 0; row < x.rows; ++row)
      for (Index k = x.row_begin(row); k < x.row_end(row); ++k) {
        const Index position = cursor[std::size_t(x.column_indices[k])]++;
        entry_rows[position] = row;
        entry_values[position] = x.values[k];
      }
  }
  for (Index row = 0; row < x.rows; ++row) {
    Scalar* output_row = output + row * output_stride;
    for (Index j = 0; j < columns; ++j) output_row[j] = bias != nullptr ? bias[j] : Scalar(0);
  }
  constexpr int kPanelPackets = 16;
  Index column = 0;
  if constexpr (PacketOf<Scalar>::vectorized) {
    constexpr Index packet_size = PacketOf<Scalar>::size;
    for (; column + kPanelPackets * packet_size <= columns; column += kPanelPackets * packet_size)
      scatter_feature_panel<kPanelPackets>(feature_offsets, used_features, entry_rows, entry_values,
                                           weight, weight_stride, output, output_stride, column);
    for (; column + packet_size <= columns; column += packet_size)
      scatter_feature_panel<1>(feature_offsets, used_features, entry_rows, entry_values, weight,
                               weight_stride, output, output_stride, column);
  }
  for (const Index feature : used_features)
    for (Index k = feature_offsets[feature]; k < feature_offsets[feature + 1]; ++k) {
      Scalar* out = output + entry_rows[k] * output_stride;
      const Scalar* weight_row = weight + feature * weight_stride;
      for (Index j = column; j < columns; ++j) out[j] += entry_values[k] * weight_row[j];
    }
}

}  // namespace sdmha::detail
