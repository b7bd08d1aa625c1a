// sdmha/detail/forward_pass.hpp — the forward of one validated, planned call, as free functions
// over the layer's state (detail::AttentionCore: weights, stages, bfloat16 copies) and a query
// source (the sparse query, or a dense one): the layer classes hold state, these walk the plan.
//
//   run_forward:  [query projection ∥ K, V projections]   one region, the costliest items first
//                 attention items (b, h, query tile)       one region; each tile through
//                                                          detail/attention_tile.hpp
//                 output projection Y = A·Wo + bo          one region
// With K and V streamed (plan.context_chunk > 0) the K and V of each chunk of key steps are
// projected just before the attention items that read them (attend_streamed).
//
// A query source provides, for a plan:
//   void prepare(plan, buffers)                   serial set-up: sizes Q and what its items need
//   Index preparation_items(plan)                 items to run before any projection item (0: none)
//   void prepare_item(plan, index, buffers, worker)
//   Index projection_items(plan)                  items of its projection (0: none, e.g. regrouped)
//   void project_item(plan, index, buffers, worker)
//   void project_items(plan, begin, end, buffers, worker)   optional: items [begin, end) at once,
//                                                 the same bits as one by one (see ItemQueue),
//   with Index projection_rows(plan) and project_windows(plan, row, first, end, buffers, worker):
//                                                 items window · rows + row, a row's windows at
//                                                 once (see RowQueue)
//   operator()(tile, mask, keys, bfloat16_operands, scratch, scores)   a tile's masked scores
//
// The dense projections (K, V, the output, the dense query) in fixed items, and the region that
// runs them: detail/row_projection.hpp.
#pragma once

#include <algorithm>
#include <limits>
#include <type_traits>
#include <utility>

#include "sdmha/attention_result.hpp"
#include "sdmha/config.hpp"
#include "sdmha/context.hpp"
#include "sdmha/detail/attention_plan.hpp"
#include "sdmha/detail/attention_tile.hpp"
#include "sdmha/detail/parallel.hpp"
#include "sdmha/detail/row_projection.hpp"
#include "sdmha/detail/stage_traits.hpp"
#include "sdmha/options.hpp"
#include "sdmha/projected_context.hpp"
#include "sdmha/weights.hpp"
#include "sdmha/workspace.hpp"

namespace sdmha::detail {

// The masked scores of one tile from its block of the projected query Q (B·T × H·Dk), by the
// score stage's project-first Arguments: the sparse query's project_first strategy and the dense
// query.
template <typename Core>
void project_first_scores(const Core& core, const AttentionPlan& plan, const AttentionTile& item,
                          const RowMatrix<typename Core::ScalarType>& projected_query,
                          const BatchMask& mask,
                          const ConstMatrixRef<typename Core::ScalarType>& key,
                          BFloat16Operands bfloat16_operands, StageScratch scratch,
                          MatrixRef<typename Core::ScalarType> scores) {
  using Scalar = typename Core::ScalarType;
  using ScoreKernel = typename Core::ScoreKernel;
  const Index Dk = plan.dims.key_dim;
  typename ScoreKernel::Arguments args{
      item.position(),
      projected_query.block(item.batch * plan.steps + item.query_begin, item.head * Dk,
                            item.query_rows, Dk),
      key,
      Scalar(plan.scale),
      mask,
      scores,
      scratch};
  if constexpr (reads_bfloat16_operands<ScoreKernel>::value)
    args.bfloat16_operands = bfloat16_operands;
  ScoreKernel::can_implement(args);
  core.stages().score_kernel(args);
}
// Where K and V of key step s of batch entry b are: row b·S + s − first_row of `keys` and
// `values` (first_row 0 for a whole projected context).
template <typename Scalar>
struct ContextRows {
  ConstMatrixRef<Scalar> keys, values;
  Index first_row;

  TileOperands<Scalar> operands(const AttentionPlan& plan, const AttentionTile& tile,
                                BFloat16Operands bfloat16_operands) const {
    const Index row = tile.batch * plan.key_steps + tile.key_begin - first_row;
    const Index Dk = plan.dims.key_dim, Dv = plan.dims.value_dim;
    return TileOperands<Scalar>{keys.block(row, tile.head * Dk, tile.key_steps, Dk),
                                values.block(row, tile.head * Dv, tile.key_steps, Dv),
                                bfloat16_operands};
  }
};

// The keys [key_begin, key_end) of one pass over an item; the first pass starts each row's
// online-softmax state, the last normalises the row.
struct KeyChunk {
  Index key_begin, key_end;
  bool first, last;
};

// Rows of the online softmax's statistics (m_t, l_t) of item `item`: one block per head,
// B·T rows each, so that the items of different heads never share a cache line.
template <typename Scalar>
auto online_statistics(const AttentionPlan& plan, const AttentionTile& item,
                       CallBuffers<Scalar>& buffers) {
  const Index row = (item.head * plan.batch + item.batch) * plan.steps + item.query_begin;
  return buffers.online_statistics.block(row, 0, item.query_rows, 2);
}

// A row's output after its last key tile: A[t] / l_t; 0 for a row that saw no key it may see
// (l_t = 0); NaN for a NaN or +∞ score (l_t NaN), as MaskedSoftmax does.
template <typename Statistics, typename Heads>
void normalise_online_rows(const Statistics& statistics, Heads& heads) {
  using Scalar = typename std::decay_t<Heads>::Scalar;
  for (Index t = 0; t < heads.rows(); ++t) {
    const Scalar sum = statistics(t, 1);
    if (sum > Scalar(0))
      heads.row(t) *= Scalar(1) / sum;
    else if (sum == Scalar(0))
      heads.row(t).setZero();
    else
      heads.row(t).setConstant(std::numeric_limits<Scalar>::quiet_NaN());
  }
}

// The item with an online softmax over its key tiles that start in `chunk`. Per row t, with m_t
// the largest score so far and l_t the sum of exp(score − m_t) so far, each key tile j does
//   m' = max(m_t, max_s S_j[t, s]),  P_j[t, s] = exp(S_j[t, s] − m'),
//   l_t ← l_t·exp(m_t − m') + Σ_s P_j[t, s],  A[t] ← A[t]·exp(m_t − m') + dropout(P_j)[t]·V_j,
// and after the last chunk A[t] /= l_t: the softmax's probabilities, normalised after the
// product instead of before it. (m_t, l_t) live in buffers.online_statistics between chunks.
template <typename Core, typename Source>
void attend_item_online(const Core& core, const AttentionPlan& plan, const AttentionTile& item,
                        const ContextRows<typename Core::ScalarType>& context,
                        const KeyChunk& chunk,
                        const AttentionOptions<typename Core::ScalarType>& options, Source& source,
                        WorkerBuffers<typename Core::ScalarType>& worker,
                        CallBuffers<typename Core::ScalarType>& buffers) {
  using Scalar = typename Core::ScalarType;
  const Index Dv = plan.dims.value_dim;
  auto heads = buffers.heads.block(item.batch * plan.steps + item.query_begin, item.head * Dv,
                                   item.query_rows, Dv);
  auto statistics = online_statistics(plan, item, buffers);
  if (chunk.first) {
    heads.setZero();
    statistics.col(0).setConstant(-std::numeric_limits<Scalar>::infinity());
    statistics.col(1).setZero();
  }
  for (Index index = 0; index < plan.key_tiles(item); ++index) {
    const AttentionTile tile = plan.key_tile_of(item, index);
    if (tile.key_begin < chunk.key_begin) continue;
    if (tile.key_begin >= chunk.key_end) break;
    attend_key_tile(core.stages(), plan, tile,
                    context.operands(plan, tile, core.attends_in_bfloat16()), options, source,
                    worker, statistics, heads);
  }
  if (chunk.last) normalise_online_rows(statistics, heads);
}

// One item of the tiled forward: every key it may see in one tile, through attend_tile.
template <typename Core, typename Source>
void attend_item(const Core& core, const AttentionPlan& plan, const AttentionTile& item,
                 const ContextRows<typename Core::ScalarType>& context,
                 const AttentionOptions<typename Core::ScalarType>& options, Source& source,
                 WorkerBuffers<typename Core::ScalarType>& worker,
                 CallBuffers<typename Core::ScalarType>& buffers,
                 AttentionResult<typename Core::ScalarType>& result) {
  const Index Dv = plan.dims.value_dim;
  auto heads = buffers.heads.block(item.batch * plan.steps + item.query_begin, item.head * Dv,
                                   item.query_rows, Dv);
  if (item.key_steps == 0) {  // every row fully blocked: zero probabilities, zero heads
    heads.setZero();
    if (options.return_attention_scores) scores_in_result(plan, item, result).setZero();
    return;
  }
  auto scores = options.return_attention_scores
                    ? scores_in_result(plan, item, result)
                    : as_tile(worker.tile(0, item.query_rows, item.key_steps, plan.tile_entries));
  attend_tile(core.stages(), plan, item, context.operands(plan, item, core.attends_in_bfloat16()),
              options, source, worker, scores, heads);
}

// What both forms of the attention do first: the result's seed and returned scores sized, the
// heads and the online-softmax state sized.
template <typename Scalar>
void begin_attention(const AttentionPlan& plan, const AttentionOptions<Scalar>& options,
                     CallBuffers<Scalar>& buffers, AttentionResult<Scalar>& result) {
  const Index B = plan.batch, T = plan.steps, S = plan.key_steps, H = plan.heads();
  result.dropout_seed = plan.dropout_rate > 0.0 ? plan.dropout_seed : 0;
  if (options.return_attention_scores)
    result.attention_scores.resize(B, H, T, S);
  else if (result.attention_scores.size() != 0)
    result.attention_scores = Eigen::Tensor<Scalar, 4, Eigen::RowMajor>();
  buffers.heads.resize(B * T, plan.dims.projected_value_width());
  // Rows no item writes (no key steps: every row fully blocked) are 0, as are their heads.
  if (plan.attention_items() == 0) buffers.heads.setZero();
  if (plan.online_softmax) buffers.online_statistics.resize(H * B * T, 2);
}

// Y = A·Wo + bo from the heads, into result.output.
template <typename Core>
void project_output(const Core& core, const AttentionPlan& plan,
                    CallBuffers<typename Core::ScalarType>& buffers,
                    AttentionResult<typename Core::ScalarType>& result) {
  using Scalar = typename Core::ScalarType;
  const Index B = plan.batch, T = plan.steps;
  result.output.resize(B, T, plan.dims.output_dim);
  const auto& weights = core.weights();
  run_projections(
      plan, buffers, "output projection", 0, [](Index, int) {},
      row_projection<Scalar>(
          core.stages().output_projection, ConstMatrixRef<Scalar>(buffers.heads),
          weights.output_kernel, weights.output_bias,
          Eigen::Map<RowMatrix<Scalar>>(result.output.data(), B * T, plan.dims.output_dim),
          core.dense_kernel_bfloat16(&Core::DenseKernelsBFloat16::output), B * T));
}

// Every attention item of the plan against a whole K and V (`context`), then the output
// projection.
template <typename Core, typename Source>
void attend(const Core& core, const AttentionPlan& plan,
            const ProjectedContext<typename Core::ScalarType>& context,
            const AttentionOptions<typename Core::ScalarType>& options, Source& source,
            CallBuffers<typename Core::ScalarType>& buffers,
            AttentionResult<typename Core::ScalarType>& result) {
  using Scalar = typename Core::ScalarType;
  begin_attention(plan, options, buffers, result);
  const ContextRows<Scalar> whole{context.keys, context.values, 0};
  buffers.prepare_workers(plan.workers(plan.attention_items()), plan.worker_scratch_bytes,
                          plan.tile_entries, 2);
  const KeyChunk all_keys{0, plan.key_steps, true, true};
  parallel_for(
      plan.attention_items(), plan.threads,
      [&](Index index, int worker) {
        auto& worker_buffers = buffers.workers[std::size_t(worker)];
        const AttentionTile item = plan.item_tile(index);
        if (plan.online_softmax)
          attend_item_online(core, plan, item, whole, all_keys, options, source, worker_buffers,
                             buffers);
        else
          attend_item(core, plan, item, whole, options, source, worker_buffers, buffers, result);
      },
      &buffers.pool, "attention");
  project_output(core, plan, buffers, result);
}

// K and V of batch entry b's key steps in `chunk`, into buffers.context_chunk. The rows
// projected are the whole row blocks of kProjectionRowBlock (counted from row 0 of all B·S)
// that hold the chunk: the blocks, and so the bits, of project_context_into.
template <typename Core>
ContextRows<typename Core::ScalarType> project_context_chunk(
    const Core& core, const AttentionPlan& plan, const TensorRef3<typename Core::ScalarType>& key,
    const TensorRef3<typename Core::ScalarType>& value, Index b, const KeyChunk& chunk,
    CallBuffers<typename Core::ScalarType>& buffers) {
  const Index S = plan.key_steps, block = kProjectionRowBlock;
  const Index first = (b * S + chunk.key_begin) / block * block;
  const Index end = std::min(plan.batch * S, (b * S + chunk.key_end + block - 1) / block * block);
  auto keys = buffers.context_chunk.keys.topRows(end - first);
  auto values = buffers.context_chunk.values.topRows(end - first);
  run_projections(
      plan, buffers, "context projection", 0, [](Index, int) {},
      context_projection_rows(core, plan, ContextSide::key,
                              key.as_matrix().middleRows(first, end - first), keys),
      context_projection_rows(core, plan, ContextSide::value,
                              value.as_matrix().middleRows(first, end - first), values));
  return ContextRows<typename Core::ScalarType>{keys, values, first};
}

// The attention with K and V streamed (plan.context_chunk > 0, so the online softmax runs): per
// batch entry b and chunk of key steps, that chunk's K and V are projected, then every item of
// b runs over its key tiles in the chunk, the rows' online-softmax state kept between chunks.
// Each row meets the same key tiles in the same order as in `attend`, so the bits are the same.
template <typename Core, typename Source>
void attend_streamed(const Core& core, const AttentionPlan& plan,
                     const TensorRef3<typename Core::ScalarType>& key,
                     const TensorRef3<typename Core::ScalarType>& value,
                     const AttentionOptions<typename Core::ScalarType>& options, Source& source,
                     CallBuffers<typename Core::ScalarType>& buffers,
                     AttentionResult<typename Core::ScalarType>& result) {
  SDMHA_ASSERT(plan.online_softmax && plan.context_chunk % plan.key_tile == 0);
  begin_attention(plan, options, buffers, result);
  const Index S = plan.key_steps, items = plan.heads() * plan.query_tiles;
  // The chunk's rows widened to whole projection row blocks: at most 2 blocks more.
  const Index chunk_rows = std::min(plan.context_chunk + 2 * kProjectionRowBlock, plan.batch * S);
  buffers.context_chunk.keys.resize(chunk_rows, plan.dims.projected_key_width());
  buffers.context_chunk.values.resize(chunk_rows, plan.dims.projected_value_width());
  for (Index b = 0; b < plan.batch; ++b)
    for (Index key_begin = 0; key_begin < S; key_begin += plan.context_chunk) {
      const KeyChunk chunk{key_begin, std::min(S, key_begin + plan.context_chunk), key_begin == 0,
                           key_begin + plan.context_chunk >= S};
      const auto rows = project_context_chunk(core, plan, key, value, b, chunk, buffers);
      buffers.prepare_workers(plan.workers(items), plan.worker_scratch_bytes, plan.tile_entries, 2);
      parallel_for(
          items, plan.threads,
          [&](Index index, int worker) {
            attend_item_online(core, plan, plan.item_tile(b * items + index), rows, chunk, options,
                               source, buffers.workers[std::size_t(worker)], buffers);
          },
          &buffers.pool, "attention");
    }
  project_output(core, plan, buffers, result);
}

// Whether a query source runs ranges of its projection items at once (project_items).
template <typename Source, typename Scalar, typename = void>
struct projects_ranges : std::false_type {};
template <typename Source, typename Scalar>
struct projects_ranges<Source, Scalar,
                       std::void_t<decltype(std::declval<const Source&>().project_items(
                           std::declval<const AttentionPlan&>(), Index(0), Index(0),
                           std::declval<CallBuffers<Scalar>&>(), 0))>> : std::true_type {};

// The region body of a source's projection items, handed ranges when the source runs them.
template <typename Source, typename Scalar>
struct QueryProjectionItems {
  const AttentionPlan& plan;
  const Source& source;
  CallBuffers<Scalar>& buffers;
  void operator()(Index index, int worker) const {
    source.project_item(plan, index, buffers, worker);
  }
};
template <typename Source, typename Scalar>
struct QueryProjectionRanges : QueryProjectionItems<Source, Scalar> {
  void run_range(Index begin, Index end, int worker) const {
    this->source.project_items(this->plan, begin, end, this->buffers, worker);
  }
};
// The same claimed by rows (RowQueue) where the source runs a row block's windows at once:
// worker w starts on row block w % blocks, so that with no more workers than blocks each walks
// its block once and the workers read Wq's columns in step.
template <typename Source, typename Scalar>
struct QueryProjectionRows : QueryProjectionRanges<Source, Scalar> {
  Index claim_rows() const { return this->source.projection_rows(this->plan); }
  void run_row_range(Index row, Index first_column, Index end_column, int worker) const {
    this->source.project_windows(this->plan, row, first_column, end_column, this->buffers, worker);
  }
};

// The region body of a source's projection items: ranges when the source runs them.
template <typename Scalar, typename Source>
auto query_projection_body(const AttentionPlan& plan, const Source& source,
                           CallBuffers<Scalar>& buffers) {
  const QueryProjectionItems<Source, Scalar> by_item{plan, source, buffers};
  if constexpr (projects_ranges<Source, Scalar>::value)
    return QueryProjectionRanges<Source, Scalar>{by_item};
  else
    return by_item;
}

// The query source's projection items alone, as one region (after its preparation items).
template <typename Scalar, typename Source>
void run_query_projection(const AttentionPlan& plan, Source& source, CallBuffers<Scalar>& buffers) {
  const Index items = source.projection_items(plan);
  buffers.prepare_workers(plan.workers(items), plan.worker_scratch_bytes, plan.tile_entries, 2);
  if constexpr (projects_ranges<Source, Scalar>::value) {
    const QueryProjectionItems<Source, Scalar> by_item{plan, source, buffers};
    parallel_for(items, plan.threads, QueryProjectionRows<Source, Scalar>{{by_item}}, &buffers.pool,
                 "query projection");
  } else {
    parallel_for(items, plan.threads, QueryProjectionItems<Source, Scalar>{plan, source, buffers},
                 &buffers.pool, "query projection");
  }
}

// The query source's projection (if any) and K and V, in as few regions as its dependencies
// allow: one region of the query's items (the costliest, on a wide sparse query, first) and K's
// and V's; or, when the query's items read something built per row block first (the sparse
// query's CSC by feature), one region of those preparations with K and V, then the query's.
template <typename Core, typename Source>
void project_inputs(const Core& core, const AttentionPlan& plan, Source& source,
                    const TensorRef3<typename Core::ScalarType>& key,
                    const TensorRef3<typename Core::ScalarType>& value,
                    CallBuffers<typename Core::ScalarType>& buffers) {
  auto& context = buffers.context;
  context.batch = value.dimension(0);
  context.key_steps = value.dimension(1);
  const Index rows = context.batch * context.key_steps;
  context.keys.resize(rows, plan.dims.projected_key_width());
  context.values.resize(rows, plan.dims.projected_value_width());
  source.prepare(plan, buffers);
  const auto keys =
      context_projection_rows(core, plan, ContextSide::key, key.as_matrix(), context.keys);
  const auto values =
      context_projection_rows(core, plan, ContextSide::value, value.as_matrix(), context.values);
  const Index preparations = source.preparation_items(plan);
  if (preparations == 0) {
    run_projections(plan, buffers, "projections", source.projection_items(plan),
                    query_projection_body(plan, source, buffers), keys, values);
    return;
  }
  run_projections(
      plan, buffers, "query preparation and context projection", preparations,
      [&](Index index, int worker) { source.prepare_item(plan, index, buffers, worker); }, keys,
      values);
  run_query_projection(plan, source, buffers);
}

// The query source's projection alone (K and V given, or streamed).
template <typename Scalar, typename Source>
void project_query_source(const AttentionPlan& plan, Source& source, CallBuffers<Scalar>& buffers) {
  source.prepare(plan, buffers);
  if (source.preparation_items(plan) > 0)
    run_projections(
        plan, buffers, "query preparation", source.preparation_items(plan),
        [&](Index index, int worker) { source.prepare_item(plan, index, buffers, worker); });
  run_query_projection(plan, source, buffers);
}

// The forward of a validated call: against the context's projected keys and values where it
// holds them; else K and V projected whole with the query, or streamed in chunks inside the
// attention (plan.context_chunk > 0).
template <typename Core, typename Source>
void run_forward(const Core& core, const AttentionPlan& plan, Source& source,
                 const Context<typename Core::ScalarType>& context,
                 const AttentionOptions<typename Core::ScalarType>& options,
                 CallBuffers<typename Core::ScalarType>& buffers,
                 AttentionResult<typename Core::ScalarType>& result) {
  if (context.projected() != nullptr) {
    project_query_source(plan, source, buffers);
    attend(core, plan, *context.projected(), options, source, buffers, result);
  } else if (plan.context_chunk > 0) {
    project_query_source(plan, source, buffers);
    attend_streamed(core, plan, context.key(), context.value(), options, source, buffers, result);
  } else {
    project_inputs(core, plan, source, context.key(), context.value(), buffers);
    attend(core, plan, buffers.context, options, source, buffers, result);
  }
}

}  // namespace sdmha::detail
