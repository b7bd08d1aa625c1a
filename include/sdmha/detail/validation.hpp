// sdmha/detail/validation.hpp — the checks every call makes on entry, before any work: key and
// value (or a projected context) against the weights, the options against (B, T, S); and the
// start of the call's plan from the options once they are checked.
#pragma once

#include <cmath>
#include <sstream>
#include <string>

#include "sdmha/config.hpp"
#include "sdmha/context.hpp"
#include "sdmha/detail/attention_plan.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/options.hpp"
#include "sdmha/projected_context.hpp"

namespace sdmha::detail {

// (d0, d1, …) of a mask or bias as the caller gave it, for messages.
template <typename T>
std::string shape_text(const BroadcastRef<T>& ref) {
  std::ostringstream text;
  const int first = ref.rank() == 2 ? 2 : 0;
  text << '(';
  for (int axis = first; axis < 4; ++axis) {
    if (ref.rank() == 3 && axis == 1) continue;
    text << ref.dimension(axis) << (axis < 3 ? ", " : ")");
  }
  return text.str();
}

// A mask or bias must broadcast to (B, H, T, S): (T, S), or B' ∈ {1, B}, H' ∈ {1, H}.
template <typename T>
void check_broadcast(const char* where, const char* name, const BroadcastRef<T>& ref, Index batch,
                     Index heads, Index steps, Index key_steps) {
  if (ref.empty()) return;
  // A raw view's rank must agree with its dimensions: (T, S) has B' = H' = 1, (B, T, S) H' = 1.
  const bool rank_agrees = (ref.rank() == 4) || (ref.rank() == 3 && ref.heads() == 1) ||
                           (ref.rank() == 2 && ref.batch() == 1 && ref.heads() == 1);
  const bool fits = (ref.batch() == batch || ref.batch() == 1) &&
                    (ref.heads() == heads || ref.heads() == 1) && ref.steps() == steps &&
                    ref.key_steps() == key_steps && rank_agrees;
  if (!fits)
    fail<ShapeError>(where, name, " is ", shape_text(ref), "; expected (B, T, S) = (", batch, ", ",
                     steps, ", ", key_steps, "), (T, S) = (", steps, ", ", key_steps,
                     ") or (B, H, T, S) = (", batch, ", ", heads, ", ", steps, ", ", key_steps,
                     ") with B or H possibly 1");
  if (ref.data() == nullptr && ref.size() > 0)
    fail<ShapeError>(where, name, " has no data; expected ", ref.size(), " values");
}

// Checks key (B, S, Ek) and value (B, S, Ev) against the weights and the query's batch.
template <typename Scalar>
void check_context(const char* where, const LayerDims& dims, Index batch,
                   const TensorRef3<Scalar>& key, const TensorRef3<Scalar>& value) {
  auto check_tensor = [&](const char* name, const TensorRef3<Scalar>& tensor, Index width) {
    if (tensor.dimension(0) != batch)
      fail<ShapeError>(where, name, " has batch ", tensor.dimension(0),
                       "; expected the query's batch ", batch);
    if (tensor.dimension(2) != width)
      fail<ShapeError>(where, name, " has width ", tensor.dimension(2),
                       "; expected the kernel's input width ", width);
    if (tensor.data() == nullptr && tensor.dimension(0) * tensor.dimension(1) * width > 0)
      fail<ShapeError>(where, name, " has no data; expected ", batch, " x ", tensor.dimension(1),
                       " x ", width, " values");
  };
  check_tensor("key", key, dims.key_in_dim);
  check_tensor("value", value, dims.value_in_dim);
  if (key.dimension(1) != value.dimension(1))
    fail<ShapeError>(where, "key has ", key.dimension(1), " steps but value has ",
                     value.dimension(1), "; expected equal");
}

// Checks a ProjectedContext against the weights and the query's batch.
template <typename Scalar>
void check_context(const char* where, const LayerDims& dims, Index batch,
                   const ProjectedContext<Scalar>& context) {
  if (context.batch != batch)
    fail<ShapeError>(where, "context has batch ", context.batch, "; expected the query's batch ",
                     batch);
  if (context.key_steps < 0 || context.keys.rows() != context.batch * context.key_steps ||
      context.keys.cols() != dims.projected_key_width())
    fail<ShapeError>(where, "context.keys is ", context.keys.rows(), " x ", context.keys.cols(),
                     "; expected batch * key_steps x num_heads * key_dim = ",
                     context.batch * context.key_steps, " x ", dims.projected_key_width());
  if (context.values.rows() != context.keys.rows() ||
      context.values.cols() != dims.projected_value_width())
    fail<ShapeError>(where, "context.values is ", context.values.rows(), " x ",
                     context.values.cols(),
                     "; expected batch * key_steps x num_heads * value_dim = ", context.keys.rows(),
                     " x ", dims.projected_value_width());
}

// Checks a call's context: the key and value where given, the projected keys and values where
// given, and that both describe the same S. `needs_key_value`: the backward's (dWk = keyᵀ·dK).
template <typename Scalar>
void check_context(const char* where, const LayerDims& dims, Index batch,
                   const Context<Scalar>& context, bool needs_key_value) {
  if (needs_key_value && !context.has_key_value())
    fail<ShapeError>(where,
                     "context holds projected keys and values only; expected {key, value} or "
                     "{key, value, projected}: the backward needs the key and value (dWk = "
                     "keyᵀ·dK, dWv = valueᵀ·dV)");
  if (context.has_key_value()) check_context(where, dims, batch, context.key(), context.value());
  const ProjectedContext<Scalar>* projected = context.projected();
  if (projected == nullptr) return;
  check_context(where, dims, batch, *projected);
  if (context.has_key_value() && projected->key_steps != context.value().dimension(1))
    fail<ShapeError>(where, "context's projected keys and values have ", projected->key_steps,
                     " key steps but value has ", context.value().dimension(1),
                     "; expected project_context(key, value) of this key and value");
}

// Checks the options against (B, T, S): masks, bias, dropout rate, threads, scale, sizes.
template <typename Scalar>
void check_options(const char* where, const LayerDims& dims, Index batch, Index steps,
                   Index key_steps, const AttentionOptions<Scalar>& options) {
  const auto& key_mask = options.key_mask;
  if (!key_mask.empty()) {
    if (key_mask.dimension(0) != batch || key_mask.dimension(1) != key_steps)
      fail<ShapeError>(where, "key_mask is (", key_mask.dimension(0), ", ", key_mask.dimension(1),
                       "); expected (B, S) = (", batch, ", ", key_steps, ")");
    if (key_mask.data() == nullptr && key_mask.size() > 0)
      fail<ShapeError>(where, "key_mask has no data; expected ", batch, " x ", key_steps,
                       " booleans");
  }
  if (!(options.dropout_rate >= 0.0 && options.dropout_rate < 1.0))
    fail<ConfigError>(where, "dropout_rate = ", options.dropout_rate,
                      "; expected 0 <= dropout_rate < 1");
  if (options.num_threads < 0)
    fail<ConfigError>(where, "num_threads = ", options.num_threads,
                      "; expected >= 0 (0 means the physical cores)");
  // Every count the plan forms (up to B·H·T·S scores) must be an Index: larger sizes, possible
  // without data when a width is 0, are refused rather than wrapped.
  const double scores = double(std::max<Index>(batch, 1)) * double(dims.num_heads) *
                        double(std::max<Index>(steps, 1)) * double(std::max<Index>(key_steps, 1));
  if (scores > double(Index(1) << 59))
    fail<ShapeError>(where, "B x H x T x S = ", batch, " x ", dims.num_heads, " x ", steps, " x ",
                     key_steps, " scores; expected at most 2^59");
  // After the bound above, so that a view's B'·H'·T·S cannot overflow.
  check_broadcast(where, "attention_mask", options.attention_mask, batch, dims.num_heads, steps,
                  key_steps);
  check_broadcast(where, "attention_bias", options.attention_bias, batch, dims.num_heads, steps,
                  key_steps);
  if (options.scale.has_value() && !std::isfinite(*options.scale))
    fail<ConfigError>(where, "scale = ", *options.scale,
                      "; expected a finite number (or none: 1/sqrt(key_dim))");
}

// The call's plan as the options set it: sizes, threads, causal alignment, scale, returned
// scores and dropout. Draws the call's dropout seed from options.dropout_generator (the next one
// in a forward, the last one in a backward), so it comes after every check: a refused call draws
// none.
template <typename Scalar>
AttentionPlan start_plan(const LayerDims& dims, Index batch, Index steps, Index key_steps,
                         const AttentionOptions<Scalar>& options, Pass pass) {
  AttentionPlan plan;
  plan.pass = pass;
  plan.batch = batch;
  plan.steps = steps;
  plan.key_steps = key_steps;
  plan.dims = dims;
  plan.threads = resolve_thread_count(options.num_threads);
  plan.causal = options.use_causal_mask;
  plan.causal_offset =
      options.causal_alignment == CausalAlignment::bottom_right ? key_steps - steps : 0;
  plan.scale = options.scale.value_or(1.0 / std::sqrt(double(dims.key_dim)));
  plan.fully_masked_rows = options.fully_masked_rows;
  plan.return_scores = options.return_attention_scores;
  if (options.training && options.dropout_rate > 0.0) {
    plan.dropout_rate = options.dropout_rate;
    plan.dropout_seed = options.dropout_generator == nullptr ? options.dropout_seed
                        : pass == Pass::forward              ? options.dropout_generator->next()
                                                             : options.dropout_generator->last();
  }
  return plan;
}

}  // namespace sdmha::detail
