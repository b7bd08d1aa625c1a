// sdmha/dense_mha.hpp — DenseMHA: the dense baseline, the same layer on a dense query.
//
// Same weights, options and stages as SparseDenseMHA (score kernel in its project-first form);
// the query (B, T, Eq) is projected by a dense GEMM. It is what a user would run after
// densifying a sparse query, and what the bench compares against. The query projection goes in
// blocks of kQueryProjectionRowBlock rows: a wide Wq (Eq = 32768) is then packed once per 512
// rows, not once per 64.
#pragma once

#include <memory>
#include <utility>

#include "sdmha/detail/attention_core.hpp"
#include "sdmha/stages/attend_values.hpp"
#include "sdmha/stages/dense_projection.hpp"
#include "sdmha/stages/masked_softmax.hpp"
#include "sdmha/stages/output_projection.hpp"
#include "sdmha/stages/score_kernel.hpp"

namespace sdmha {

template <typename Scalar, typename QueryProjectionT = DenseProjection<Scalar>,
          typename ScoreKernelT = ScoreKernel<Scalar>, typename SoftmaxT = MaskedSoftmax<Scalar>,
          typename AttendValuesT = AttendValues<Scalar>,
          typename OutputProjectionT = OutputProjection<Scalar>,
          typename ContextProjectionT = DenseProjection<Scalar>>
class DenseMHA : public detail::AttentionCore<Scalar, ScoreKernelT, SoftmaxT, AttendValuesT,
                                              OutputProjectionT, ContextProjectionT> {
  using Core = detail::AttentionCore<Scalar, ScoreKernelT, SoftmaxT, AttendValuesT,
                                     OutputProjectionT, ContextProjectionT>;
  static_assert(std::is_same<typename QueryProjectionT::ScalarType, Scalar>::value,
                "the query projection's ScalarType must be the layer's Scalar");

 public:
  using QueryProjection = QueryProjectionT;

  DenseMHA(const MhaConfig& config, MhaWeights<Scalar> weights)
      : Core(config, std::make_shared<MhaWeights<Scalar>>(std::move(weights))) {}
  DenseMHA(const MhaConfig& config, std::shared_ptr<MhaWeights<Scalar>> weights)
      : Core(config, std::move(weights)) {}

  QueryProjection& query_projection() { return query_projection_; }
  const QueryProjection& query_projection() const { return query_projection_; }

  // query (B, T, Eq) dense; key (B, S, Ek); value (B, S, Ev) → output (B, T, O). Thread-safe
  // (a DropoutGenerator in the options is not: it belongs to one caller).
  // options.score_strategy is ignored: a dense query has only the project-first form.
  AttentionResult<Scalar> forward(const TensorRef3<Scalar>& query, const TensorRef3<Scalar>& key,
                                  const TensorRef3<Scalar>& value,
                                  const AttentionOptions<Scalar>& options = {}) const {
    const auto borrowed = this->borrow_workspace();
    AttentionResult<Scalar> result;
    forward(query, key, value, options, borrowed.workspace(), result);
    return result;
  }

  // The same into `result`, working in `workspace` (see SparseDenseMHA).
  void forward(const TensorRef3<Scalar>& query, const TensorRef3<Scalar>& key,
               const TensorRef3<Scalar>& value, const AttentionOptions<Scalar>& options,
               Workspace<Scalar>& workspace, AttentionResult<Scalar>& result) const {
    constexpr const char* where = "DenseMHA::forward";
    const LayerDims dims = this->dims();
    const Index B = query.dimension(0), T = query.dimension(1);
    if (query.dimension(2) != dims.query_dim)
      detail::fail<ShapeError>(where, "query has width ", query.dimension(2),
                               "; expected the query kernel's input width ", dims.query_dim);
    if (query.data() == nullptr && B * T * dims.query_dim > 0)
      detail::fail<ShapeError>(where, "query has no data; expected ", B, " x ", T, " x ",
                               dims.query_dim, " values");
    Core::check_context(where, dims, B, key, value);
    // The lease first: planning draws the call's dropout seed, which a refused call must not use.
    const typename Workspace<Scalar>::Lease lease(workspace, where);
    auto& buffers = lease.buffers();
    auto plan =
        Core::check_options(where, dims, B, T, value.dimension(1), options, detail::Pass::forward);
    TileSizes block;
    block.rows = detail::kQueryProjectionRowBlock;
    block.input_width = dims.query_dim;
    block.output_width = dims.projected_key_width();
    this->finish_plan(plan, detail::stage_workspace_size<QueryProjection>(block));
    this->plan_context_streaming(plan);
    buffers.prepare_workers(plan.workers(B * T), plan.worker_scratch_bytes, plan.tile_entries, 2);
    // Streamed (plan.context_chunk > 0), K and V are projected chunk by chunk inside the attention.
    if (plan.context_chunk == 0)
      this->project_context_into(plan, key, value, buffers, buffers.context);
    RowMatrix<Scalar>& projected_query = buffers.projected_query;
    projected_query.resize(B * T, dims.projected_key_width());
    const auto& weights = this->weights();
    Core::project_rows(plan, query_projection_, detail::kQueryProjectionRowBlock, query.as_matrix(),
                       weights.query_kernel, weights.query_bias, projected_query, buffers);
    auto scores = [&](const detail::AttentionItem& item, const BatchMask& mask,
                      const ConstMatrixRef<Scalar>& key_tile, bool bfloat16_operands,
                      StageScratch scratch, MatrixRef<Scalar> tile) {
      this->project_first_scores(plan, item, projected_query, mask, key_tile, bfloat16_operands,
                                 scratch, tile);
    };
    if (plan.context_chunk > 0)
      this->attend_streamed(plan, key, value, options, scores, buffers, result);
    else
      this->attend(plan, buffers.context, options, scores, buffers, result);
  }

  AttentionResult<Scalar> forward(const TensorRef3<Scalar>& query, const TensorRef3<Scalar>& value,
                                  const AttentionOptions<Scalar>& options = {}) const {
    return forward(query, value, value, options);
  }

 private:
  QueryProjection query_projection_;
};

}  // namespace sdmha
