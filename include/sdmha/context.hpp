// sdmha/context.hpp — Context: what the query attends to, the one argument through which forward
// and backward take the key and value, as given or projected once.
//
//   layer.forward(query, {key, value})        K = key·Wk + bk and V = value·Wv + bv in the call
//   layer.forward(query, projected)           projected = layer.project_context(key, value),
//                                             made once and reused against many query batches
//   layer.backward(query, {key, value}, d_output)             K and V recomputed
//   layer.backward(query, {key, value, projected}, d_output)  K and V reused; the backward still
//                                             needs key and value (dWk = keyᵀ·dK, dWv = valueᵀ·dV)
#pragma once

#include "sdmha/config.hpp"
#include "sdmha/projected_context.hpp"
#include "sdmha/tensor_ref.hpp"

namespace sdmha {

// Views only, like TensorRef: the key, the value and the projected context must outlive the call.
// Which of them a call needs, and their shapes, the call checks (ShapeError), before any work.
template <typename Scalar>
class Context {
 public:
  // key (B, S, Ek) and value (B, S, Ev): the call projects them.
  Context(const TensorRef3<Scalar>& key, const TensorRef3<Scalar>& value)
      : key_(key), value_(value), has_key_value_(true) {}

  // Keys and values projected once by the same layer's project_context (a forward's context; a
  // backward also needs the key and value they were projected from: the three-view form).
  Context(const ProjectedContext<Scalar>& projected)  // NOLINT: implicit by design
      : projected_(&projected) {}

  // The key and value together with their projection by the same layer: the call reuses K and V.
  Context(const TensorRef3<Scalar>& key, const TensorRef3<Scalar>& value,
          const ProjectedContext<Scalar>& projected)
      : key_(key), value_(value), projected_(&projected), has_key_value_(true) {}

  // Whether the key and value tensors were given (the first and third forms).
  bool has_key_value() const { return has_key_value_; }
  const TensorRef3<Scalar>& key() const { return key_; }
  const TensorRef3<Scalar>& value() const { return value_; }
  // The projected keys and values given, or nullptr (the first form).
  const ProjectedContext<Scalar>* projected() const { return projected_; }

  // S: the value's steps where it was given, else the projected context's.
  Index key_steps() const { return has_key_value_ ? value_.dimension(1) : projected_->key_steps; }

 private:
  TensorRef3<Scalar> key_;
  TensorRef3<Scalar> value_;
  const ProjectedContext<Scalar>* projected_ = nullptr;
  bool has_key_value_ = false;
};

}  // namespace sdmha
