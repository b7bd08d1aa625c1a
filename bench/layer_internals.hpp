// bench/layer_internals.hpp — what the bench reaches of a layer to time its stages one by one
// over the same plan as forward: the plan of a call, and the query projection pass.
//
// Through the library's one door to a layer's private state (sdmha::detail::InternalAccess,
// declared in sdmha/detail/attention_core.hpp and defined only by its users), on a tag of the
// bench's own.
#pragma once

#include "sdmha/sparse_dense_mha.hpp"

namespace sdmha_bench {
struct LayerInternalsTag;
}  // namespace sdmha_bench

template <>
struct sdmha::detail::InternalAccess<sdmha_bench::LayerInternalsTag> {
  // The plan forward would make for this call: the same validation, strategy, tiles and scratch.
  template <typename Layer>
  static AttentionPlan plan(const Layer& layer, const typename Layer::Query& query, Index key_steps,
                            const AttentionOptions<typename Layer::ScalarType>& options, Pass pass,
                            CallBuffers<typename Layer::ScalarType>& buffers) {
    const LayerDims dims = layer.checked_query("plan", query);
    return layer.plan_call("plan", dims, query, key_steps, options, pass, buffers);
  }
  // Q = X·Wq + bq by the layer's own query projection pass (its items, its stage, its scratch).
  template <typename Layer>
  static void project_query(const Layer& layer, const AttentionPlan& plan,
                            const typename Layer::Query& query,
                            CallBuffers<typename Layer::ScalarType>& buffers,
                            RowMatrix<typename Layer::ScalarType>& projected_query) {
    layer.project_query(plan, query, buffers, projected_query);
  }
};

namespace sdmha_bench {
using LayerInternals = sdmha::detail::InternalAccess<LayerInternalsTag>;
}  // namespace sdmha_bench
