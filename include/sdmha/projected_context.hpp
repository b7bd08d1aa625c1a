// sdmha/projected_context.hpp — ProjectedContext: keys and values projected once (a layer's
// project_context), for forward and backward calls against many query batches.
#pragma once

#include "sdmha/config.hpp"
#include "sdmha/errors.hpp"

namespace sdmha {

// Keys and values already projected (K = key·Wk + bk, V = value·Wv + bv): made once by a layer's
// project_context and reused by forward against many query batches over the same context.
template <typename Scalar>
struct ProjectedContext {
  Index batch = 0;           // B
  Index key_steps = 0;       // S
  RowMatrix<Scalar> keys;    // B·S × H·Dk, row b·S + s
  RowMatrix<Scalar> values;  // B·S × H·Dv

  // Appends the key steps of `more` (the same layer's project_context of the new key and value
  // steps, same batch) after each batch entry's own: the result equals projecting the whole
  // key and value at once (bitwise where the GEMM's sums do not depend on the row count, as in
  // the float AVX-512 engine; up to rounding otherwise). Cost O(B·(S + S')·(H·Dk + H·Dv)) copies.
  void append(const ProjectedContext& more) {
    constexpr const char* where = "ProjectedContext::append";
    check_rows(where, "more", more);
    if (more.key_steps == 0 && more.batch == batch) return;
    if (key_steps == 0 && keys.size() == 0 && values.size() == 0) {
      *this = more;  // nothing held yet (a default context, or one of no key steps)
      return;
    }
    check_rows(where, "this context", *this);
    if (more.batch != batch)
      detail::fail<ShapeError>(where, "more has batch ", more.batch, "; expected ", batch);
    if (more.keys.cols() != keys.cols() || more.values.cols() != values.cols())
      detail::fail<ShapeError>(where, "more has key and value widths ", more.keys.cols(), " and ",
                               more.values.cols(), "; expected this context's ", keys.cols(),
                               " and ", values.cols(), " (the same layer)");
    keys = interleave(keys, key_steps, more.keys, more.key_steps);
    values = interleave(values, key_steps, more.values, more.key_steps);
    key_steps += more.key_steps;
  }

 private:
  static void check_rows(const char* where, const char* name, const ProjectedContext& context) {
    if (context.batch < 0 || context.key_steps < 0 ||
        context.keys.rows() != context.batch * context.key_steps ||
        context.values.rows() != context.keys.rows())
      detail::fail<ShapeError>(where, name, " has keys and values of ", context.keys.rows(),
                               " and ", context.values.rows(),
                               " rows; expected batch * key_steps = ", context.batch, " x ",
                               context.key_steps);
  }

  RowMatrix<Scalar> interleave(const RowMatrix<Scalar>& first, Index first_steps,
                               const RowMatrix<Scalar>& second, Index second_steps) const {
    RowMatrix<Scalar> joined(batch * (first_steps + second_steps), first.cols());
    for (Index b = 0; b < batch; ++b) {
      joined.middleRows(b * (first_steps + second_steps), first_steps) =
          first.middleRows(b * first_steps, first_steps);
      joined.middleRows(b * (first_steps + second_steps) + first_steps, second_steps) =
          second.middleRows(b * second_steps, second_steps);
    }
    return joined;
  }
};

}  // namespace sdmha
