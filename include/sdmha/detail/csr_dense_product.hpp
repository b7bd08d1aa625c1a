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

}  // namespace sdmha::detail
