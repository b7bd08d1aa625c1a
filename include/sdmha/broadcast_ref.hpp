// sdmha/broadcast_ref.hpp — BroadcastRef<T>: a read-only view of a mask or a bias over the
// scores' (B, H, T, S) index space, broadcast over the batch and the heads where its size is 1.
//
// Math: element (b, h, t, s) of the view is data[((b'·H' + h')·T + t)·S + s] with b' = 0 when
// the view's batch is 1 (else b) and h' likewise, so a (T, S) bias serves every batch entry and
// head without being copied. Shapes: (T, S), (B, T, S), (B, 1, T, S), (B, H, T, S), (1, H, T, S)
// and every other (B' ∈ {1, B}, H' ∈ {1, H}, T, S). The caller's memory must outlive the call.
#pragma once

#include <type_traits>

#include <unsupported/Eigen/CXX11/Tensor>

#include "sdmha/config.hpp"

namespace sdmha {

template <typename T>
class BroadcastRef {
 public:
  // No tensor.
  BroadcastRef() = default;

  // A row-major tensor of rank 2 (T, S), 3 (B, T, S) or 4 (B, H, T, S). A tensor whose every
  // dimension is 0 (a default-constructed one) means none. Rank 3 is always (B, T, S).
  template <int Rank>
  BroadcastRef(const Eigen::Tensor<T, Rank, Eigen::RowMajor>& tensor)  // NOLINT: implicit
      : BroadcastRef(tensor.data(), Rank, tensor.dimensions().data()) {
    static_assert(Rank >= 2 && Rank <= 4,
                  "BroadcastRef: expected (T, S), (B, T, S) or (B, H, T, S)");
  }
  // A temporary would be gone before the call reads it.
  template <int Rank>
  BroadcastRef(Eigen::Tensor<T, Rank, Eigen::RowMajor>&&) = delete;
  template <int Rank>
  BroadcastRef(const Eigen::Tensor<T, Rank, Eigen::RowMajor>&&) = delete;

  template <typename PlainTensor, int MapOptions, template <class> class MakePointer>
  BroadcastRef(const Eigen::TensorMap<PlainTensor, MapOptions, MakePointer>& map)  // NOLINT
      : BroadcastRef(map.data(), int(PlainTensor::NumIndices), map.dimensions().data()) {
    using Plain = std::remove_const_t<PlainTensor>;
    static_assert(std::is_same<std::remove_const_t<typename Plain::Scalar>, T>::value,
                  "BroadcastRef: the tensor's scalar type must be the view's");
    static_assert(int(Plain::Layout) == int(Eigen::RowMajor),
                  "BroadcastRef: expected a RowMajor tensor");
    static_assert(Plain::NumIndices >= 2 && Plain::NumIndices <= 4,
                  "BroadcastRef: expected (T, S), (B, T, S) or (B, H, T, S)");
  }

  // Raw data of shape (batch, heads, steps, key_steps), row-major; rank is the rank the caller
  // knows it by (2, 3 or 4), for messages.
  BroadcastRef(const T* data, Index batch, Index heads, Index steps, Index key_steps, int rank = 4)
      : data_(data), dims_{batch, heads, steps, key_steps}, rank_(rank) {}

  bool empty() const {
    return data_ == nullptr && dims_[0] == 0 && dims_[1] == 0 && dims_[2] == 0 && dims_[3] == 0;
  }
  const T* data() const { return data_; }
  // The shape as (B', H', T, S), whatever rank the tensor came with.
  Index dimension(int axis) const { return dims_[axis]; }
  Index batch() const { return dims_[0]; }
  Index heads() const { return dims_[1]; }
  Index steps() const { return dims_[2]; }
  Index key_steps() const { return dims_[3]; }
  Index size() const { return dims_[0] * dims_[1] * dims_[2] * dims_[3]; }
  int rank() const { return rank_; }
  bool broadcasts(Index batch, Index heads) const { return dims_[0] != batch || dims_[1] != heads; }

  // Which (b', h') slice serves scores (b, h).
  Index slice(Index b, Index h) const {
    return (dims_[0] == 1 ? 0 : b) * dims_[1] + (dims_[1] == 1 ? 0 : h);
  }
  // The element serving score (b, h, t, s); rows of S follow it.
  const T* at(Index b, Index h, Index t, Index s) const {
    return data_ + (slice(b, h) * dims_[2] + t) * dims_[3] + s;
  }

 private:
  BroadcastRef(const T* data, int rank, const Eigen::Index* dims)
      : data_(data), dims_{1, 1, 0, 0}, rank_(rank) {
    static_assert(sizeof(Eigen::Index) == sizeof(Index), "Index is Eigen::Index");
    if (rank == 2) {
      dims_[2] = dims[0];
      dims_[3] = dims[1];
    } else if (rank == 3) {
      dims_[0] = dims[0];
      dims_[2] = dims[1];
      dims_[3] = dims[2];
    } else {
      for (int axis = 0; axis < 4 && axis < rank; ++axis) dims_[axis] = dims[axis];
    }
    bool all_zero = true;
    for (int axis = 0; axis < rank; ++axis) all_zero = all_zero && dims[axis] == 0;
    if (all_zero) *this = BroadcastRef();
  }

  const T* data_ = nullptr;
  Index dims_[4] = {0, 0, 0, 0};
  int rank_ = 0;
};

}  // namespace sdmha
