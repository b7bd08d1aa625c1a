// sdmha/tensor_ref.hpp — TensorRef<T, Rank>: the read-only view through which dense inputs come
// in (TensorRef3 for the (B, S, E) key and value, TensorRef<bool, 2> for the (B, S) key mask).
//
// Binds to Eigen::Tensor and Eigen::TensorMap (of const or mutable data, row-major) without
// copying; the caller's memory must outlive the call. A default view (no data, every dimension
// 0) means none where an option allows that.
#pragma once

#include <type_traits>

#include <unsupported/Eigen/CXX11/Tensor>

#include "sdmha/config.hpp"

namespace sdmha {

template <typename T, int Rank>
class TensorRef {
  static_assert(Rank >= 1, "TensorRef: expected a rank of at least 1");

 public:
  TensorRef() = default;

  TensorRef(const Eigen::Tensor<T, Rank, Eigen::RowMajor>& tensor)  // NOLINT: implicit by design
      : data_(tensor.data()) {
    for (int axis = 0; axis < Rank; ++axis) dims_[axis] = tensor.dimension(axis);
  }

  template <typename PlainTensor, int MapOptions, template <class> class MakePointer>
  TensorRef(const Eigen::TensorMap<PlainTensor, MapOptions, MakePointer>& map)  // NOLINT
      : data_(map.data()) {
    using Plain = std::remove_const_t<PlainTensor>;
    static_assert(std::is_same<std::remove_const_t<typename Plain::Scalar>, T>::value,
                  "TensorRef: the tensor's scalar type must match the view's");
    static_assert(Plain::NumIndices == Rank, "TensorRef: the tensor's rank must be the view's");
    static_assert(int(Plain::Layout) == int(Eigen::RowMajor),
                  "TensorRef: expected a RowMajor tensor");
    for (int axis = 0; axis < Rank; ++axis) dims_[axis] = map.dimension(axis);
  }

  // Raw row-major data of the given dimensions, one per axis.
  template <typename... Dims, typename = std::enable_if_t<sizeof...(Dims) == Rank>>
  TensorRef(const T* data, Dims... dims) : data_(data), dims_{Index(dims)...} {}

  const T* data() const { return data_; }
  Index dimension(int axis) const { return dims_[axis]; }
  Index size() const {
    Index count = 1;
    for (int axis = 0; axis < Rank; ++axis) count *= dims_[axis];
    return count;
  }
  // No data and every dimension 0: the default view.
  bool empty() const {
    bool all_zero = true;
    for (int axis = 0; axis < Rank; ++axis) all_zero = all_zero && dims_[axis] == 0;
    return data_ == nullptr && all_zero;
  }
  // The view as a row-major matrix: the leading axes flattened into rows, the last axis the
  // columns ((B·S × E) for a (B, S, E) view).
  Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> as_matrix()
      const {
    Index rows = 1;
    for (int axis = 0; axis + 1 < Rank; ++axis) rows *= dims_[axis];
    return {data_, rows, dims_[Rank - 1]};
  }

 private:
  const T* data_ = nullptr;
  Index dims_[Rank] = {};
};

// The (B, S, E) key and value of a call.
template <typename Scalar>
using TensorRef3 = TensorRef<Scalar, 3>;

}  // namespace sdmha
