// bench/dense_mha.hpp — DenseMHA: the bench's dense baseline, the same layer on a dense query.
//
// Same weights, options and stages as SparseDenseMHA (score kernel in its project-first form);
// the query (B, T, Eq) is projected by a dense GEMM. It is what a user would run after
// densifying a sparse query, and what the bench compares against; it has no backward, and it is
// not part of the library's API (it is built on the library's internals, detail/). The query
// projection goes in blocks of kQueryProjectionRowBlock rows: a wide Wq (Eq = 32768) is then packed
// once per 512 rows, not once per 64.
#pragma once

#include <memory>
#include <utility>

#include "sdmha/context.hpp"
#include "sdmha/detail/attention_core.hpp"
#include "sdmha/stages/attend_values.hpp"
#include "sdmha/stages/context_projection.hpp"
#include "sdmha/stages/masked_softmax.hpp"
#include "sdmha/stages/output_projection.hpp"
#include "sdmha/stages/score_kernel.hpp"

namespace sdmha {

// The library's default stages on a dense query (DenseProjection for Q). Bench code on the
// library's internals: it inherits the layer state publicly (weights, stages, project_context)
// rather than repeating SparseDenseMHA's list of what it exposes.
template <typename Scalar>
using DenseLayerCore = detail::AttentionCore<Scalar, DenseProjection<Scalar>, ScoreKernel<Scalar>,
                                             MaskedSoftmax<Scalar>, AttendValues<Scalar>,
                                             OutputProjection<Scalar>, ContextProjection<Scalar>>;

template <typename Scalar>
class DenseMHA : public DenseLayerCore<Scalar> {
  using Core = DenseLayerCore<Scalar>;

 public:
  using typename Core::QueryProjection;
  DenseMHA(const MhaConfig& layer_config, MhaWeights<Scalar> layer_weights)
      : Core(layer_config, std::make_shared<MhaWeights<Scalar>>(std::move(layer_weights))) {}
  DenseMHA(const MhaConfig& layer_config, std::shared_ptr<MhaWeights<Scalar>> layer_weights)
      : Core(layer_config, std::move(layer_weights)) {}

  // query (B, T, Eq) dense, attending to `context` (sdmha/context.hpp, as SparseDenseMHA's) →
  // output (B, T, O). Thread-safe (a DropoutGenerator in the options is not: it belongs to one
  // caller). options.score_strategy is ignored: a dense query has only the project-first form.
  AttentionResult<Scalar> forward(const TensorRef3<Scalar>& query, const Context<Scalar>& context,
                                  const AttentionOptions<Scalar>& options = {}) const {
    const auto borrowed = this->borrow_workspace();
    AttentionResult<Scalar> result;
    forward(query, context, options, borrowed.workspace(), result);
    return result;
  }

  // The same into `result`, working in `workspace` (see SparseDenseMHA).
  void forward(const TensorRef3<Scalar>& query, const Context<Scalar>& context,
               const AttentionOptions<Scalar>& options, Workspace<Scalar>& workspace,
               AttentionResult<Scalar>& result) const {
    constexpr const char* where = "DenseMHA::forward";
    const LayerDims shape = this->dims();
    const Index B = query.dimension(0), T = query.dimension(1);
    if (query.dimension(2) != shape.query_dim)
      detail::fail<ShapeError>(where, "query has width ", query.dimension(2),
                               "; expected the query kernel's input width ", shape.query_dim);
    if (query.data() == nullptr && B * T * shape.query_dim > 0)
      detail::fail<ShapeError>(where, "query has no data; expected ", B, " x ", T, " x ",
                               shape.query_dim, " values");
    detail::check_context<Scalar>(where, shape, B, context, false);
    // The lease first: planning draws the call's dropout seed, which a refused call must not use.
    const typename Workspace<Scalar>::Lease lease(workspace, where);
    auto& buffers = lease.buffers();
    const Index S = context.key_steps();
    detail::check_options(where, shape, B, T, S, options);
    auto plan = detail::start_plan(shape, B, T, S, options, detail::Pass::forward);
    TileSizes block;
    block.rows = detail::kQueryProjectionRowBlock;
    block.input_width = shape.query_dim;
    block.output_width = shape.projected_key_width();
    detail::finish_plan(core(), plan, detail::stage_workspace_size<QueryProjection>(block));
    QuerySource source{*this, plan, query, buffers.projected_query};
    detail::run_forward(core(), plan, source, context, options, buffers, result);
  }

 private:
  template <typename Tag>
  friend struct detail::InternalAccess;
  const Core& core() const { return *this; }
  Core& core() { return *this; }

  // The dense query as the forward pass's query source (detail/forward_pass.hpp): Q = query·Wq
  // + bq in blocks of kQueryProjectionRowBlock rows (a wide Wq is packed once per 512 rows, not
  // per 64), and a tile's scores from Q.
  struct QuerySource {
    const DenseMHA& layer;
    const detail::AttentionPlan& plan;
    const TensorRef3<Scalar>& query;
    RowMatrix<Scalar>& projected_query;

    // One panel: the dense query's A block (512 × Eq) is the costly operand, read once.
    auto projection() const {
      const auto& weights = layer.weights();
      detail::RowProjection<Scalar, QueryProjection> rows{
          layer.stages().query_projection, query.as_matrix(), weights.query_kernel,
          weights.query_bias, MatrixRef<Scalar>(projected_query)};
      rows.block_rows = detail::kQueryProjectionRowBlock;
      return rows;
    }
    Index projection_items(const detail::AttentionPlan&) const { return projection().items(); }
    Index preparation_items(const detail::AttentionPlan&) const { return 0; }
    void prepare_item(const detail::AttentionPlan&, Index, detail::CallBuffers<Scalar>&,
                      int) const {}
    void prepare(const detail::AttentionPlan&, detail::CallBuffers<Scalar>&) {
      projected_query.resize(query.dimension(0) * query.dimension(1),
                             plan.dims.projected_key_width());
    }
    void project_item(const detail::AttentionPlan&, Index index,
                      detail::CallBuffers<Scalar>& buffers, int worker) const {
      projection().run_item(index, buffers.workers[std::size_t(worker)].stage.view());
    }
    void operator()(const detail::AttentionTile& item, const BatchMask& mask,
                    const ConstMatrixRef<Scalar>& key, BFloat16Operands bfloat16_operands,
                    StageScratch scratch, MatrixRef<Scalar> scores) const {
      detail::project_first_scores(layer.core(), plan, item, projected_query, mask, key,
                                   bfloat16_operands, scratch, scores);
    }
  };
};

}  // namespace sdmha
