// sdmha/detail/csr_product_packets.hpp — the SIMD packets that the CSR × dense kernels load and
// store: by rows (detail/csr_dense_product.hpp) and by features (detail/csr_by_feature.hpp).
//
// SIMD comes from Eigen's packet primitives, so the kernels follow whatever -m flags Eigen
// vectorises for (SSE2 to AVX-512), with a scalar tail for the columns that do not fill a packet
// (all columns when Eigen does not vectorise). Intrinsics only where Eigen has no primitive, each
// with a portable fallback: streaming stores (AVX, AVX-512; else pstoreu), the widening of a
// bfloat16 W (AVX2, AVX-512; else through a small buffer) and prefetches (__builtin_prefetch).
#pragma once

#include <cstdint>

#include <Eigen/Core>

namespace sdmha::detail {

template <typename Scalar>
struct PacketOf {
  using Packet = typename Eigen::internal::packet_traits<Scalar>::type;
  static constexpr int size = Eigen::internal::unpacket_traits<Packet>::size;
  static constexpr bool vectorized =
      Eigen::internal::packet_traits<Scalar>::Vectorizable && size > 1;
};

// Streaming (non-temporal) stores of a whole packet to a packet-aligned address: the line is
// written without first being read for ownership and without displacing cached data. Eigen has
// no such primitive, so these are intrinsics, for the packet types of AVX-512 and AVX; every
// other packet type (and an unaligned address) falls back to pstoreu. Streaming stores are
// weakly ordered: the caller fences them with stream_fence() before returning.
template <typename Scalar, typename Packet>
EIGEN_ALWAYS_INLINE bool stream_packet(Scalar*, const Packet&) {
  return false;
}
#if defined(EIGEN_VECTORIZE_AVX512)
EIGEN_ALWAYS_INLINE bool stream_packet(float* address, const __m512& value) {
  _mm512_stream_ps(address, value);
  return true;
}
EIGEN_ALWAYS_INLINE bool stream_packet(double* address, const __m512d& value) {
  _mm512_stream_pd(address, value);
  return true;
}
#endif
#if defined(EIGEN_VECTORIZE_AVX)
EIGEN_ALWAYS_INLINE bool stream_packet(float* address, const __m256& value) {
  _mm256_stream_ps(address, value);
  return true;
}
EIGEN_ALWAYS_INLINE bool stream_packet(double* address, const __m256d& value) {
  _mm256_stream_pd(address, value);
  return true;
}
#endif

template <typename Scalar, typename Packet>
EIGEN_ALWAYS_INLINE void store_packet(Scalar* address, const Packet& value, bool stream) {
  if (stream && (reinterpret_cast<std::uintptr_t>(address) % sizeof(Packet)) == 0 &&
      stream_packet(address, value))
    return;
  Eigen::internal::pstoreu(address, value);
}

inline void stream_fence() {
#if defined(EIGEN_VECTORIZE_AVX)
  _mm_sfence();
#endif
}

// The L2 of one core: a dense operand beyond it is read from memory (or L3) on every pass.
constexpr double kCoreCacheBytes = 2.0 * 1024 * 1024;

// A packet of floats from `Packet`'s number of bfloat16 values (widened: shifted into the upper
// half of each float). AVX-512 and AVX2 have one-instruction widenings; other packet types go
// through a small buffer.
template <typename Packet>
EIGEN_ALWAYS_INLINE Packet load_widened(const Eigen::bfloat16* source) {
  using namespace Eigen::internal;
  constexpr int size = unpacket_traits<Packet>::size;
  alignas(64) float buffer[size];
  for (int i = 0; i < size; ++i) buffer[i] = static_cast<float>(source[i]);
  return pload<Packet>(buffer);
}
#if defined(EIGEN_VECTORIZE_AVX512)
template <>
EIGEN_ALWAYS_INLINE __m512 load_widened<__m512>(const Eigen::bfloat16* source) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(source));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
#endif
#if defined(EIGEN_VECTORIZE_AVX2)
template <>
EIGEN_ALWAYS_INLINE __m256 load_widened<__m256>(const Eigen::bfloat16* source) {
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}
#endif

// W's entries as a packet of Scalar: loaded as they are, or widened from bfloat16.
template <typename Packet, typename Scalar>
EIGEN_ALWAYS_INLINE Packet load_weight_packet(const Scalar* source) {
  return Eigen::internal::ploadu<Packet>(source);
}
template <typename Packet>
EIGEN_ALWAYS_INLINE Packet load_weight_packet(const Eigen::bfloat16* source) {
  return load_widened<Packet>(source);
}

}  // namespace sdmha::detail
