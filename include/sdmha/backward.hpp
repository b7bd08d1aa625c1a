// sdmha/backward.hpp — SparseDenseMHA::backward: every gradient of the forward, as the forward's
// stages in reverse, each through its own backward (stages/*.hpp, beside its forward).
//
// With scale = 1/√Dk, P = softmax(S) and P' = P after dropout, the forward is
//   Q = X·Wq + bq,  K = key·Wk + bk,  V = value·Wv + bv,
//   S_bh = scale·Q_bh·K_bhᵀ + bias_bh (blocked → −∞),  A_bh = P'_bh·V_bh,  Y = A·Wo + bo,
// and from dY the backward walks the plan:
//   1. OutputProjection:  dA = dY·Woᵀ                                       (row blocks)
//   2. per (b, h), tile by tile, recomputing the forward's scores, P and P' (nothing is saved):
//      AttendValues:      dP' = dA_bh·V_bhᵀ, dV_bh += P'ᵀ·dA_bh
//      dropout:           dP = dP' ⊙ keep/(1 − rate)
//      MaskedSoftmax:     dS = P ⊙ (dP − rowsum(P ⊙ dP));  dbias += dS (when asked)
//      ScoreKernel:       dQ_bh = scale·dS·K_bh, dK_bh += scale·dSᵀ·Q_bh
//   3. OutputProjection:  dWo = Aᵀ·dY, dbo = 1ᵀ·dY                          (weight tiles)
//   4. QueryProjection:   dWq = Xᵀ·dQ, dbq = 1ᵀ·dQ, dX = dQ·Wqᵀ at X's stored positions
//   5. ContextProjection: dWk = keyᵀ·dK, dbk, dkey = dK·Wkᵀ; likewise V.
// One (b, h, group of query tiles) item owns its rows of A and dQ and adds its terms of dK_bh,
// dV_bh in group order (a broadcast bias's gradient: one task per fixed group of (b, h), tiles in
// order);
// weight and bias gradients go in fixed tiles and panels: no sum depends on the thread count.
#pragma once

#include <algorithm>
#include <limits>
#include <vector>

#include "sdmha/detail/attention_plan.hpp"
#include "sdmha/detail/dropout.hpp"
#include "sdmha/detail/finite.hpp"
#include "sdmha/gradients.hpp"
#include "sdmha/sparse_dense_mha.hpp"

namespace sdmha::detail {

template <typename Layer>
struct Backward {
  using Scalar = typename Layer::ScalarType;
  using Query = typename Layer::Query;
  using QueryProjection = typename Layer::QueryProjection;
  using Buffers = CallBuffers<Scalar>;

  // Where a tile's dS goes for the bias gradient: the gradient itself, or the partial sum of the
  // item's run (see add_bias_gradient).
  struct BiasGradientTarget {
    Scalar* data = nullptr;  // null: no bias gradient asked for
    bool accumulate = false;
  };

  static void check_stages() {
    static_assert(IsDifferentiable<typename Layer::QueryProjection>::value,
                  "backward: the query projection stage has no backward of its own (declare "
                  "`using differentiates = YourStage;` and backward(...) beside its operator())");
    static_assert(IsDifferentiable<typename Layer::ScoreKernel>::value,
                  "backward: the score kernel stage has no backward of its own (declare "
                  "`using differentiates = YourStage;` and backward(const BackwardArguments&))");
    static_assert(IsDifferentiable<typename Layer::Softmax>::value,
                  "backward: the softmax stage has no backward of its own (declare "
                  "`using differentiates = YourStage;` and backward(const BackwardArguments&))");
    static_assert(IsDifferentiable<typename Layer::AttendValues>::value,
                  "backward: the attend-values stage has no backward of its own (declare "
                  "`using differentiates = YourStage;` and backward(const BackwardArguments&))");
    static_assert(
        IsDifferentiable<typename Layer::OutputProjection>::value,
        "backward: the output projection stage has no backward of its own (declare "
        "`using differentiates = YourStage;` and backward(...) for both gradient Arguments)");
    static_assert(
        IsDifferentiable<typename Layer::ContextProjection>::value,
        "backward: the key/value projection stage has no backward of its own (declare "
        "`using differentiates = YourStage;` and backward(...) for both gradient Arguments)");
  }

  // Everything the backward checks before any work: the forward's checks with the same
  // messages, then d_output against (B, T, O), and the plan.
  static AttentionPlan check_and_plan(const char* where, const Layer& layer, const Query& query,
                                      const TensorRef3<Scalar>& key,
                                      const TensorRef3<Scalar>& value,
                                      const TensorRef3<Scalar>& d_output,
                                      const AttentionOptions<Scalar>& options, Buffers& buffers) {
    const LayerDims dims = layer.checked_query(where, query);
    check_context<Scalar>(where, dims, query.batch(), key, value);
    const Index B = query.batch(), T = query.steps(), O = dims.output_dim;
    if (d_output.dimension(0) != B || d_output.dimension(1) != T || d_output.dimension(2) != O)
      fail<ShapeError>(where, "d_output is (", d_output.dimension(0), ", ", d_output.dimension(1),
                       ", ", d_output.dimension(2), "); expected (B, T, O) = (", B, ", ", T, ", ",
                       O, ")");
    if (d_output.data() == nullptr && B * T * O > 0)
      fail<ShapeError>(where, "d_output has no data; expected ", B, " x ", T, " x ", O, " values");
    return layer.plan_call(where, dims, query, value.dimension(1), options, Pass::backward,
                           buffers);
  }

  // A saved context must be project_context(key, value)'s for these key and value.
  static void check_saved_context(const char* where, const AttentionPlan& plan,
                                  const ProjectedContext<Scalar>& context) {
    const Index rows = plan.batch * plan.key_steps;
    const LayerDims& dims = plan.dims;
    if (context.batch != plan.batch || context.key_steps != plan.key_steps ||
        context.keys.rows() != rows || context.keys.cols() != dims.projected_key_width() ||
        context.values.rows() != rows || context.values.cols() != dims.projected_value_width())
      fail<ShapeError>(
          where, "context has batch ", context.batch, ", key_steps ", context.key_steps, ", keys ",
          context.keys.rows(), " x ", context.keys.cols(), ", values ", context.values.rows(),
          " x ", context.values.cols(), "; expected those of project_context(key, value): batch ",
          plan.batch, ", key_steps ", plan.key_steps, ", keys ", rows, " x ",
          dims.projected_key_width(), ", values ", rows, " x ", dims.projected_value_width());
  }

  // The backward on a validated call, K and V being `context`'s.
  static void run(const Layer& layer, const AttentionPlan& plan, const Query& query,
                  const TensorRef3<Scalar>& key, const TensorRef3<Scalar>& value,
                  const ProjectedContext<Scalar>& context, const TensorRef3<Scalar>& d_output,
                  const AttentionOptions<Scalar>& options, Buffers& buffers,
                  MhaGradients<Scalar>& gradients) {
    const MhaWeights<Scalar>& weights = layer.weights();
    const bool use_bias = layer.config().use_bias;
    const auto d_output_matrix = d_output.as_matrix();
    BackwardBuffers<Scalar>& scratch = buffers.backward;
    layer.project_query(plan, query, buffers,
                        buffers.projected_query);  // dK needs Q whatever the strategy
    scratch.d_heads.resize(plan.batch * plan.steps, plan.dims.projected_value_width());
    input_gradient(plan, layer.output_projection(), d_output_matrix, weights.output_kernel,
                   scratch.d_heads, buffers);
    attention(layer, plan, query, context, options, buffers, gradients);
    kernel_gradient(plan, layer.output_projection(), buffers.heads, d_output_matrix, buffers,
                    gradients.output_kernel);
    bias_gradient(plan, use_bias, d_output_matrix, gradients.output_bias, buffers);
    query_gradients(layer, plan, query, buffers, gradients);
    bias_gradient(plan, use_bias, scratch.d_queries, gradients.query_bias, buffers);
    context_gradients(plan, layer.context_projection(), key.as_matrix(), weights.key_kernel,
                      scratch.d_keys, use_bias, buffers, gradients.key_kernel, gradients.key_bias,
                      gradients.key);
    context_gradients(plan, layer.context_projection(), value.as_matrix(), weights.value_kernel,
                      scratch.d_values, use_bias, buffers, gradients.value_kernel,
                      gradients.value_bias, gradients.value);
  }

  // ---- the attention, per (b, h) -----------------------------------------------------------

  // Flags of one (b, h): whether K_bh, V_bh and dA_bh are finite, found once for all its tiles.
  struct HeadFlags {
    bool keys_finite, values_finite, d_probabilities_finite;
  };

  static void attention(const Layer& layer, const AttentionPlan& plan, const Query& query,
                        const ProjectedContext<Scalar>& context,
                        const AttentionOptions<Scalar>& options, Buffers& buffers,
                        MhaGradients<Scalar>& gradients) {
    const Index B = plan.batch, T = plan.steps, S = plan.key_steps;
    BackwardBuffers<Scalar>& scratch = buffers.backward;
    buffers.heads.resize(B * T, plan.dims.projected_value_width());
    scratch.d_queries.resize(B * T, plan.dims.projected_key_width());
    // Zeroed per (b, h) by the item that sums into it first (zeroed_head_sums): in parallel.
    scratch.d_keys.resize(B * S, plan.dims.projected_key_width());
    scratch.d_values.resize(B * S, plan.dims.projected_value_width());
    start_bias_gradient(plan, options, buffers, gradients);
    // Without key or query steps there is no (b, h) item: A and dQ are 0 (or empty), dK = dV = 0.
    if (plan.attention_items() == 0) {
      buffers.heads.setZero();
      scratch.d_queries.setZero();
      scratch.d_keys.setZero();
      scratch.d_values.setZero();
      return;
    }
    const BiasGradientTasks tasks = bias_gradient_tasks(plan, options);
    if (tasks.grouping == BiasGradientTasks::Grouping::per_item)
      attention_by_tiles(layer, plan, query, context, options, buffers, gradients);
    else
      attention_by_tasks(layer, plan, query, context, options, buffers, gradients);
    finish_bias_gradient(plan, options, buffers, gradients);
  }

  // Items (b, h, group of query tiles), group-major (every (b, h)'s group g before any group
  // g + 1), with groups fixed by the problem (backward_tile_groups). Each item recomputes its
  // tiles in order, writing its rows of A, dQ and the bias gradient, and sums its terms of dK_bh
  // and dV_bh: group 0 straight into them, a later group into the worker's partial sums, added
  // to dK_bh, dV_bh in group order once its (b, h)'s turn comes (the group before hands it on).
  // Each sum is thus one order whatever the thread count. A turn is awaited only after the
  // item's own work, and the group it waits for was claimed before it: no item waits on one
  // that has not started. One group per (b, h) (B·H alone makes enough items) is the plain
  // per-(b, h) loop, with no partial sums and no waits.
  static void attention_by_tiles(const Layer& layer, const AttentionPlan& plan, const Query& query,
                                 const ProjectedContext<Scalar>& context,
                                 const AttentionOptions<Scalar>& options, Buffers& buffers,
                                 MhaGradients<Scalar>& gradients) {
    const Index heads_total = plan.batch * plan.heads();
    const TileGroups groups = backward_tile_groups(plan);
    buffers.prepare_workers(
        plan.workers(groups.count * heads_total), plan.worker_scratch_bytes, plan.tile_entries,
        3 + int(groups.count > 1 ? partial_sum_tiles(plan) : 0), plan.query_tile);
    OrderedTurns& turns = buffers.backward.tile_turns;
    turns.reset(heads_total);
    const BiasGradientTarget target{
        bias_gradient_wanted(options) ? gradients.attention_bias.data() : nullptr, false};
    parallel_for(
        groups.count * heads_total, plan.threads,
        [&](Index index, int worker) {
          const Index group = index / heads_total, bh = index % heads_total;
          const Index b = bh / plan.heads(), h = bh % plan.heads();
          const Index first = group * groups.tiles,
                      last = std::min(first + groups.tiles, plan.query_tiles);
          WorkerBuffers<Scalar>& own = buffers.workers[std::size_t(worker)];
          // Key ranges start at key 0 and grow with the tile: the group's last is the widest.
          const Index keys = plan.tile_of(b, h, last - 1).key_steps;
          GradientSums sums = group == 0 ? zeroed_head_sums(plan, b, h, buffers.backward)
                                         : partial_sums(plan, keys, own);
          try {
            const HeadFlags flags = head_flags(plan, context, buffers.backward.d_heads, b, h);
            for (Index tile = first; tile < last; ++tile) {
              const AttentionItem item = plan.tile_of(b, h, tile);
              attention_tile(layer, plan, item, query, context, options, flags, target, own,
                             buffers, sums.keys.topRows(item.key_steps),
                             sums.values.topRows(item.key_steps));
            }
          } catch (...) {
            turns.abandon();
            throw;
          }
          if (group > 0) {
            if (!turns.await(bh, group)) return;  // an earlier item failed; the call rethrows it
            GradientSums whole = head_sums(plan, b, h, keys, buffers.backward);
            whole.keys += sums.keys;
            whole.values += sums.values;
          }
          turns.pass(bh, group + 1);
        },
        &buffers.pool, "backward attention");
  }

  // Query tiles per group and groups per (b, h): at least kBackwardItemsWanted items where the
  // tiles allow (`long`, B·H = 16 and 32 tiles: 4 groups of 8), one group when B·H alone gives
  // that many. More groups would cost more partial sums (S × (Dk + Dv) written and added per
  // group) for balance that 16 workers do not need.
  static constexpr Index kBackwardItemsWanted = 64;
  struct TileGroups {
    Index tiles = 1, count = 1;
  };
  static TileGroups backward_tile_groups(const AttentionPlan& plan) {
    const Index heads_total = std::max<Index>(plan.batch * plan.heads(), 1);
    const Index wanted = std::clamp<Index>((kBackwardItemsWanted + heads_total - 1) / heads_total,
                                           1, std::max<Index>(plan.query_tiles, 1));
    TileGroups groups;
    groups.tiles = (plan.query_tiles + wanted - 1) / wanted;
    groups.count = plan.query_tiles > 0 ? (plan.query_tiles + groups.tiles - 1) / groups.tiles : 0;
    return groups;
  }

  // Where a group's terms of dK_bh and dV_bh (its first `keys` key rows) are summed: dK_bh, dV_bh
  // themselves, or the worker's partial sums (in its tiles after the three of the tile itself,
  // zeroed for the stages to add into).
  struct GradientSums {
    MatrixRef<Scalar> keys, values;
  };
  static GradientSums head_sums(const AttentionPlan& plan, Index b, Index h, Index keys,
                                BackwardBuffers<Scalar>& scratch) {
    const Index row = b * plan.key_steps, Dk = plan.dims.key_dim, Dv = plan.dims.value_dim;
    return GradientSums{scratch.d_keys.block(row, h * Dk, keys, Dk),
                        scratch.d_values.block(row, h * Dv, keys, Dv)};
  }
  // dK_bh and dV_bh whole (all S keys), zeroed: the first sums into them.
  static GradientSums zeroed_head_sums(const AttentionPlan& plan, Index b, Index h,
                                       BackwardBuffers<Scalar>& scratch) {
    GradientSums sums = head_sums(plan, b, h, plan.key_steps, scratch);
    sums.keys.setZero();
    sums.values.setZero();
    return sums;
  }
  static Index partial_sum_tiles(const AttentionPlan& plan) {
    const Index entries =
        plan.key_steps * (plan.dims.key_dim + plan.dims.value_dim) + plan.tile_entries - 1;
    return std::max<Index>(entries / std::max<Index>(plan.tile_entries, 1), 1);
  }
  static GradientSums partial_sums(const AttentionPlan& plan, Index keys,
                                   WorkerBuffers<Scalar>& worker) {
    const Index Dk = plan.dims.key_dim, Dv = plan.dims.value_dim;
    Scalar* first = worker.tile(3, 0, 0, plan.tile_entries).data();
    Eigen::Map<RowMatrix<Scalar>> key_sums(first, keys, Dk),
        value_sums(first + keys * Dk, keys, Dv);
    key_sums.setZero();
    value_sums.setZero();
    return GradientSums{key_sums, value_sums};
  }

  // One task per (b, h) item, or per group of items sharing a broadcast bias's gradient: a
  // task's items and tiles in order, dK_bh and dV_bh summed in place.
  static void attention_by_tasks(const Layer& layer, const AttentionPlan& plan, const Query& query,
                                 const ProjectedContext<Scalar>& context,
                                 const AttentionOptions<Scalar>& options, Buffers& buffers,
                                 MhaGradients<Scalar>& gradients) {
    const BiasGradientTasks tasks = bias_gradient_tasks(plan, options);
    const Index H = plan.heads();
    BackwardBuffers<Scalar>& scratch = buffers.backward;
    buffers.prepare_workers(plan.workers(tasks.count), plan.worker_scratch_bytes, plan.tile_entries,
                            3, plan.query_tile);
    parallel_for(
        tasks.count, plan.threads,
        [&](Index task, int worker) {
          BiasGradientTarget target;
          if (tasks.partial_sums)
            target = BiasGradientTarget{scratch.bias_partials.row(task).data(), true};
          else if (bias_gradient_wanted(options))
            target = BiasGradientTarget{gradients.attention_bias.data(), tasks.items > 1};
          for (Index k = 0; k < tasks.items_of(task); ++k) {
            const Index head_item = tasks.item(task, k), b = head_item / H, h = head_item % H;
            const HeadFlags flags = head_flags(plan, context, scratch.d_heads, b, h);
            GradientSums sums = zeroed_head_sums(plan, b, h, scratch);
            for (Index tile = 0; tile < plan.query_tiles; ++tile) {
              const AttentionItem item = plan.tile_of(b, h, tile);
              attention_tile(layer, plan, item, query, context, options, flags, target,
                             buffers.workers[std::size_t(worker)], buffers,
                             sums.keys.topRows(item.key_steps),
                             sums.values.topRows(item.key_steps));
            }
          }
        },
        &buffers.pool, "backward attention");
  }

  static HeadFlags head_flags(const AttentionPlan& plan, const ProjectedContext<Scalar>& context,
                              const RowMatrix<Scalar>& d_heads, Index b, Index h) {
    const Index S = plan.key_steps, T = plan.steps, Dk = plan.dims.key_dim,
                Dv = plan.dims.value_dim;
    HeadFlags flags;
    flags.keys_finite = all_finite<Scalar>(context.keys.block(b * S, h * Dk, S, Dk));
    flags.values_finite = all_finite<Scalar>(context.values.block(b * S, h * Dv, S, Dv));
    flags.d_probabilities_finite =
        flags.values_finite && all_finite<Scalar>(d_heads.block(b * T, h * Dv, T, Dv));
    return flags;
  }

  // One tile: the forward again (scores, P, P', A), then each stage's backward in reverse.
  static void attention_tile(const Layer& layer, const AttentionPlan& plan,
                             const AttentionItem& item, const Query& query,
                             const ProjectedContext<Scalar>& context,
                             const AttentionOptions<Scalar>& options, const HeadFlags& flags,
                             const BiasGradientTarget& bias_gradient, WorkerBuffers<Scalar>& worker,
                             Buffers& buffers, MatrixRef<Scalar> d_keys,
                             MatrixRef<Scalar> d_values) {
    const Index T = plan.steps, S = plan.key_steps, Dk = plan.dims.key_dim,
                Dv = plan.dims.value_dim;
    const Index b = item.batch, h = item.head, rows = item.query_rows, keys = item.key_steps;
    const Index query_row = b * T + item.query_begin, key_row = b * S + item.key_begin;
    BackwardBuffers<Scalar>& scratch = buffers.backward;
    auto d_queries = scratch.d_queries.block(query_row, h * Dk, rows, Dk);
    if (keys == 0) {  // every row fully blocked: A = 0, dQ = 0
      buffers.heads.block(query_row, h * Dv, rows, Dv).setZero();
      d_queries.setZero();
      return;
    }
    const TilePosition position = item.position();
    const StageScratch stage = worker.stage.view();
    const auto key_bh = context.keys.block(key_row, h * Dk, keys, Dk);
    const auto value_bh = context.values.block(key_row, h * Dv, keys, Dv);
    const auto query_bh = buffers.projected_query.block(query_row, h * Dk, rows, Dk);
    const auto d_heads = scratch.d_heads.block(query_row, h * Dv, rows, Dv);
    auto probabilities = worker.tile(0, rows, keys, plan.tile_entries);
    auto d_scores = worker.tile(2, rows, keys, plan.tile_entries);
    scores(layer, plan, item, query, key_bh, options, stage, buffers, probabilities);
    const char* fully_masked = mark_fully_masked_rows(plan, probabilities, worker);
    typename Layer::Softmax::Arguments softmax_args{position, probabilities, stage,
                                                    plan.fully_masked_rows};
    Layer::Softmax::can_implement(softmax_args);
    layer.softmax()(softmax_args);
    const DropoutMask dropout = plan.dropout();
    auto dropped = dropout.active() ? worker.tile(1, rows, keys, plan.tile_entries) : probabilities;
    if (dropout.active()) {
      dropped = probabilities;
      dropout.apply(dropped, b, h, item.query_begin, item.key_begin);
    }
    typename Layer::AttendValues::Arguments values_args{
        position,
        dropped,
        value_bh,
        buffers.heads.block(query_row, h * Dv, rows, Dv),
        flags.values_finite,
        stage};
    Layer::AttendValues::can_implement(values_args);
    layer.attend_values()(values_args);

    typename Layer::AttendValues::BackwardArguments d_values_args{
        position, dropped, value_bh, d_heads, d_scores, d_values, stage};
    Layer::AttendValues::can_implement(d_values_args);
    layer.attend_values().backward(d_values_args);
    dropout.apply(d_scores, b, h, item.query_begin, item.key_begin);
    typename Layer::Softmax::BackwardArguments d_softmax_args{
        position, probabilities, d_scores, flags.d_probabilities_finite, stage, fully_masked};
    Layer::Softmax::can_implement(d_softmax_args);
    layer.softmax().backward(d_softmax_args);
    add_bias_gradient(plan, item, options, d_scores, bias_gradient);
    typename Layer::ScoreKernel::BackwardArguments d_score_args{
        position, query_bh,          key_bh, Scalar(plan.scale), d_scores, d_queries,
        d_keys,   flags.keys_finite, stage};
    Layer::ScoreKernel::can_implement(d_score_args);
    layer.score_kernel().backward(d_score_args);
  }

  // Under FullyMaskedRows::uniform, which rows of the tile's scores are −∞ throughout: their
  // probabilities are the constant 1/S and pass no gradient to the scores. (A row with a NaN
  // is not one: its probabilities and gradients are NaN.) Null otherwise.
  template <typename Tile>
  static const char* mark_fully_masked_rows(const AttentionPlan& plan, const Tile& scores,
                                            WorkerBuffers<Scalar>& worker) {
    if (plan.fully_masked_rows != FullyMaskedRows::uniform) return nullptr;
    constexpr Scalar minus_infinity = -std::numeric_limits<Scalar>::infinity();
    for (Index t = 0; t < scores.rows(); ++t)
      worker.row_flags[std::size_t(t)] = (scores.row(t).array() == minus_infinity).all();
    return worker.row_flags.data();
  }

  // The forward's scores of one tile, by the plan's strategy, with the attention bias.
  static void scores(const Layer& layer, const AttentionPlan& plan, const AttentionItem& item,
                     const Query& query, const ConstMatrixRef<Scalar>& key,
                     const AttentionOptions<Scalar>& options, StageScratch stage, Buffers& buffers,
                     MatrixRef<Scalar> out) {
    layer.tile_scores(plan, item, query, buffers.projected_query,
                      item_mask(item, options, plan.steps, plan.key_steps), key, false, stage,
                      out);  // the backward differentiates float32
    add_attention_bias(item, options, out);
  }

  // ---- the attention bias's gradient -------------------------------------------------------
  //
  // ∂loss/∂bias[b', h', t, s] = Σ dS_bh[t, s] over the (b, h) that slice (b', h') serves, each
  // sum in a fixed order: a bias of the scores' own shape takes each tile's dS as it is; one
  // broadcast over the heads, (B, 1, T, S), is summed by one task per batch entry over its heads
  // in order, and (1, H, T, S) by one task per head over the batch in order; a (T, S) bias is
  // summed in kBiasGradientRuns fixed runs of items, each into a partial sum of its own, then
  // the partial sums in run order. None of it depends on the thread count.

  static constexpr Index kBiasGradientRuns = 16;

  // Which (b, h) items task `task` runs, in order: item(task, k) for k < items_of(task).
  struct BiasGradientTasks {
    enum class Grouping { per_item, per_batch, per_head, runs };
    Grouping grouping = Grouping::per_item;
    Index count = 0;  // tasks
    Index items = 1;  // items per task (the last run may have fewer)
    Index heads = 1;  // H
    Index total = 0;  // B·H
    bool partial_sums = false;

    Index items_of(Index task) const {
      return grouping == Grouping::runs ? std::min(items, total - task * items) : items;
    }
    Index item(Index task, Index k) const {
      switch (grouping) {
        case Grouping::per_batch:
          return task * heads + k;
        case Grouping::per_head:
          return k * heads + task;
        case Grouping::runs:
          return task * items + k;
        default:
          return task;
      }
    }
  };

  static bool bias_gradient_wanted(const AttentionOptions<Scalar>& options) {
    return options.compute_bias_gradient && !options.attention_bias.empty();
  }

  static BiasGradientTasks bias_gradient_tasks(const AttentionPlan& plan,
                                               const AttentionOptions<Scalar>& options) {
    using Grouping = typename BiasGradientTasks::Grouping;
    const Index B = plan.batch, H = plan.heads();
    BiasGradientTasks tasks;
    tasks.heads = H;
    tasks.total = B * H;
    tasks.count = B * H;
    const BroadcastRef<Scalar>& bias = options.attention_bias;
    if (!bias_gradient_wanted(options) || !bias.broadcasts(B, H) || B * H == 0) return tasks;
    if (bias.batch() == B && bias.batch() > 1) {
      tasks.grouping = Grouping::per_batch;
      tasks.count = B;
      tasks.items = H;
    } else if (bias.heads() == H && bias.heads() > 1) {
      tasks.grouping = Grouping::per_head;
      tasks.count = H;
      tasks.items = B;
    } else {
      tasks.grouping = Grouping::runs;
      tasks.items = AttentionPlan::block_count(B * H, kBiasGradientRuns);
      tasks.count = AttentionPlan::block_count(B * H, tasks.items);
      tasks.partial_sums = tasks.count > 1;
      if (!tasks.partial_sums) tasks.items = B * H;
    }
    return tasks;
  }

  template <typename Tile>
  static void add_bias_gradient(const AttentionPlan& plan, const AttentionItem& item,
                                const AttentionOptions<Scalar>& options, const Tile& d_scores,
                                const BiasGradientTarget& target) {
    if (target.data == nullptr) return;
    const BroadcastRef<Scalar>& bias = options.attention_bias;
    const Index S = plan.key_steps;
    const Index first =
        bias.at(item.batch, item.head, item.query_begin, item.key_begin) - bias.data();
    for (Index t = 0; t < d_scores.rows(); ++t) {
      Scalar* row = target.data + first + t * S;
      for (Index s = 0; s < d_scores.cols(); ++s)
        row[s] = target.accumulate ? row[s] + d_scores(t, s) : d_scores(t, s);
    }
  }

  // The gradient tensor in the bias's shape, zero (positions no tile reaches stay 0), and the
  // runs' partial sums.
  static void start_bias_gradient(const AttentionPlan& plan,
                                  const AttentionOptions<Scalar>& options, Buffers& buffers,
                                  MhaGradients<Scalar>& gradients) {
    const BroadcastRef<Scalar>& bias = options.attention_bias;
    if (!bias_gradient_wanted(options)) {
      gradients.attention_bias = Eigen::Tensor<Scalar, 4, Eigen::RowMajor>();
      return;
    }
    gradients.attention_bias.resize(bias.batch(), bias.heads(), bias.steps(), bias.key_steps());
    gradients.attention_bias.setZero();
    const BiasGradientTasks tasks = bias_gradient_tasks(plan, options);
    buffers.backward.bias_partials.setZero(tasks.partial_sums ? tasks.count : 0, bias.size());
  }

  // Σ over runs, in run order, of the partial sums.
  static void finish_bias_gradient(const AttentionPlan& plan,
                                   const AttentionOptions<Scalar>& options, Buffers& buffers,
                                   MhaGradients<Scalar>& gradients) {
    const BiasGradientTasks tasks = bias_gradient_tasks(plan, options);
    if (!tasks.partial_sums) return;
    const RowMatrix<Scalar>& partials = buffers.backward.bias_partials;
    Eigen::Map<Vector<Scalar>> gradient(gradients.attention_bias.data(), partials.cols());
    for (Index run = 0; run < tasks.count; ++run) gradient += partials.row(run).transpose();
  }

  // ---- dense projections -------------------------------------------------------------------

  // d_input (rows × E) = d_output · kernelᵀ, in the forward's row blocks.
  template <typename Projection>
  static void input_gradient(const AttentionPlan& plan, const Projection& projection,
                             const ConstMatrixRef<Scalar>& d_output,
                             const RowMatrix<Scalar>& kernel, MatrixRef<Scalar> d_input,
                             Buffers& buffers) {
    const Index rows = d_output.rows();
    const Index blocks = AttentionPlan::block_count(rows, kProjectionRowBlock);
    buffers.prepare_workers(plan.workers(blocks), plan.worker_scratch_bytes, plan.tile_entries, 3);
    parallel_for(
        blocks, plan.threads,
        [&](Index index, int worker) {
          const RowBlock block = AttentionPlan::block(index, rows, kProjectionRowBlock);
          typename Projection::InputGradientArguments args{
              d_output.middleRows(block.begin, block.rows), kernel,
              d_input.middleRows(block.begin, block.rows),
              buffers.workers[std::size_t(worker)].stage.view()};
          Projection::can_implement(args);
          projection.backward(args);
        },
        &buffers.pool, "input gradient");
  }

  // dW = inputᵀ·dY over all rows, one fixed tile of dW per work item.
  template <typename Projection>
  static void kernel_gradient_tiles(const AttentionPlan& plan, const Projection& projection,
                                    const ConstMatrixRef<Scalar>& input,
                                    const ConstMatrixRef<Scalar>& d_output,
                                    RowMatrix<Scalar>& d_weight, Buffers& buffers) {
    const Index row_tiles = AttentionPlan::block_count(d_weight.rows(), kWeightTile);
    const Index column_tiles = AttentionPlan::block_count(d_weight.cols(), kWeightTile);
    buffers.prepare_workers(plan.workers(row_tiles * column_tiles), plan.worker_scratch_bytes,
                            plan.tile_entries, 3);
    parallel_for(
        row_tiles * column_tiles, plan.threads,
        [&](Index item, int worker) {
          const RowBlock rows =
              AttentionPlan::block(item / column_tiles, d_weight.rows(), kWeightTile);
          const RowBlock columns =
              AttentionPlan::block(item % column_tiles, d_weight.cols(), kWeightTile);
          typename Projection::KernelGradientArguments args{
              input.middleCols(rows.begin, rows.rows),
              d_output.middleCols(columns.begin, columns.rows),
              d_weight.block(rows.begin, columns.begin, rows.rows, columns.rows),
              buffers.workers[std::size_t(worker)].stage.view()};
          Projection::can_implement(args);
          projection.backward(args);
        },
        &buffers.pool, "weight gradient");
  }

  // all_finite(matrix), one item per block of kFiniteRowBlock rows (a flag each), then their AND.
  static constexpr Index kFiniteRowBlock = 256;
  static bool all_finite_in_blocks(const AttentionPlan& plan, const ConstMatrixRef<Scalar>& matrix,
                                   Buffers& buffers) {
    const Index blocks = AttentionPlan::block_count(matrix.rows(), kFiniteRowBlock);
    std::vector<char>& flags = buffers.backward.block_flags;
    flags.assign(std::size_t(blocks), 0);
    parallel_for(
        blocks, plan.threads,
        [&](Index index, int) {
          const RowBlock block = AttentionPlan::block(index, matrix.rows(), kFiniteRowBlock);
          flags[std::size_t(index)] =
              all_finite<Scalar>(matrix.middleRows(block.begin, block.rows));
        },
        &buffers.pool, "finiteness");
    return std::all_of(flags.begin(), flags.end(), [](char flag) { return flag != 0; });
  }

  // The gradient of a dense projection's kernel. A row of the input that no query attends (a
  // blocked key step) has dY's row exactly 0 and may hold NaN or Inf; a GEMM would turn 0·NaN
  // into NaN, so when the input is not finite only the rows with a gradient take part. Without
  // rows (B, T or S = 0) dW is 0 and no tile is taken of the null data.
  template <typename Projection>
  static void kernel_gradient(const AttentionPlan& plan, const Projection& projection,
                              const ConstMatrixRef<Scalar>& input,
                              const ConstMatrixRef<Scalar>& d_output, Buffers& buffers,
                              RowMatrix<Scalar>& d_weight) {
    d_weight.resize(input.cols(), d_output.cols());
    if (input.rows() == 0) {
      d_weight.setZero();
      return;
    }
    if (all_finite_in_blocks(plan, input, buffers)) {
      kernel_gradient_tiles(plan, projection, input, d_output, d_weight, buffers);
      return;
    }
    BackwardBuffers<Scalar>& scratch = buffers.backward;
    std::vector<Index>& rows = scratch.gathered_rows;
    rows.clear();
    for (Index row = 0; row < input.rows(); ++row)
      if ((d_output.row(row).array() != Scalar(0)).any()) rows.push_back(row);
    if (rows.empty()) {
      d_weight.setZero();
      return;
    }
    // Sized for every row, so that a blocking pattern changing between steps does not reallocate.
    scratch.gathered_input.resize(input.rows(), input.cols());
    scratch.gathered_output.resize(input.rows(), d_output.cols());
    const Index count = Index(rows.size());
    for (Index i = 0; i < count; ++i) {
      scratch.gathered_input.row(i) = input.row(rows[std::size_t(i)]);
      scratch.gathered_output.row(i) = d_output.row(rows[std::size_t(i)]);
    }
    kernel_gradient_tiles(plan, projection, scratch.gathered_input.topRows(count),
                          scratch.gathered_output.topRows(count), d_weight, buffers);
  }

  // dbias = 1ᵀ·dY, one item per fixed panel of kBiasPanel columns (each column one sum over the
  // rows in one order, whatever the thread count); 0 without rows, where column sums would take
  // blocks of dY's null data.
  static constexpr Index kBiasPanel = 64;
  template <typename Matrix>
  static void bias_gradient(const AttentionPlan& plan, bool use_bias, const Matrix& d_output,
                            Vector<Scalar>& d_bias, Buffers& buffers) {
    if (!use_bias) {
      d_bias.resize(0);
      return;
    }
    if (d_output.rows() == 0) {
      d_bias.setZero(d_output.cols());
      return;
    }
    d_bias.resize(d_output.cols());
    parallel_for(
        AttentionPlan::block_count(d_output.cols(), kBiasPanel), plan.threads,
        [&](Index index, int) {
          const RowBlock panel = AttentionPlan::block(index, d_output.cols(), kBiasPanel);
          d_bias.segment(panel.begin, panel.rows).noalias() =
              d_output.middleCols(panel.begin, panel.rows).colwise().sum().transpose();
        },
        &buffers.pool, "bias gradient");
  }

  // dW, db and d_input of the key or the value projection.
  template <typename Projection>
  static void context_gradients(const AttentionPlan& plan, const Projection& projection,
                                const ConstMatrixRef<Scalar>& input,
                                const RowMatrix<Scalar>& kernel,
                                const RowMatrix<Scalar>& d_projected, bool use_bias,
                                Buffers& buffers, RowMatrix<Scalar>& d_kernel,
                                Vector<Scalar>& d_bias,
                                Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& d_input) {
    kernel_gradient(plan, projection, input, d_projected, buffers, d_kernel);
    bias_gradient(plan, use_bias, d_projected, d_bias, buffers);
    d_input.resize(plan.batch, plan.key_steps, kernel.rows());
    input_gradient(
        plan, projection, d_projected, kernel,
        Eigen::Map<RowMatrix<Scalar>>(d_input.data(), plan.batch * plan.key_steps, kernel.rows()),
        buffers);
  }

  // ---- the sparse query projection ---------------------------------------------------------

  // dWq and dX, by feature over X's CSC when Wq is beyond L2 (bow), else by rows; then dX in
  // from_coo's entry order when the query came from COO.
  static constexpr Index kEntryBlock = Index(1) << 14;  // COO entries per item of the reorder
  static void query_gradients(const Layer& layer, const AttentionPlan& plan, const Query& query,
                              Buffers& buffers, MhaGradients<Scalar>& gradients) {
    BackwardBuffers<Scalar>& scratch = buffers.backward;
    const auto& coo_to_stored = query.coo_to_stored();
    Vector<Scalar>& d_stored = coo_to_stored.empty() ? gradients.query_values : scratch.d_stored;
    d_stored.resize(query.csr().nonzeros());
    gradients.query_kernel.resize(plan.dims.query_dim, plan.dims.projected_key_width());
    if (query_gradients_by_feature(query.csr(), plan.dims.projected_key_width()))
      query_gradients_by_features(layer, plan, query, buffers, d_stored, gradients.query_kernel);
    else
      query_gradients_by_rows(layer, plan, query, buffers, d_stored, gradients.query_kernel);
    if (!coo_to_stored.empty()) {
      const Index entries = Index(coo_to_stored.size());
      gradients.query_values.resize(entries);
      parallel_for(
          AttentionPlan::block_count(entries, kEntryBlock), plan.threads,
          [&](Index index, int) {
            const RowBlock block = AttentionPlan::block(index, entries, kEntryBlock);
            for (Index entry = block.begin; entry < block.begin + block.rows; ++entry)
              gradients.query_values[entry] = d_stored[Index(coo_to_stored[std::size_t(entry)])];
          },
          &buffers.pool, "query values in COO order");
    }
  }

  static void query_gradients_by_features(const Layer& layer, const AttentionPlan& plan,
                                          const Query& query, Buffers& buffers,
                                          Vector<Scalar>& d_stored, RowMatrix<Scalar>& d_kernel) {
    using Groups = typename QueryProjection::FeatureGroups;
    const auto& csr = query.csr();
    ScratchBuffer& memory = buffers.backward.feature_groups;
    memory.reserve(Groups::bytes(csr.cols, csr.nonzeros(), true));
    ScratchCarver carver(memory.view());
    Groups groups = Groups::carve(carver, csr.cols, csr.nonzeros(), true);
    build_feature_groups(csr, groups, true);
    const Index features = plan.dims.query_dim;
    const RowMatrix<Scalar>& d_queries = buffers.backward.d_queries;
    parallel_for(
        AttentionPlan::block_count(features, kFeatureBlock), plan.threads,
        [&](Index index, int) {
          const RowBlock block = AttentionPlan::block(index, features, kFeatureBlock);
          typename QueryProjection::KernelGradientArguments kernel_args{
              csr, d_queries, d_kernel.middleRows(block.begin, block.rows), &groups, block.begin};
          QueryProjection::can_implement(kernel_args);
          layer.query_projection().backward(kernel_args);
          typename QueryProjection::ValuesGradientArguments values_args{
              csr,       layer.weights().query_kernel, d_queries, d_stored, &groups, block.begin,
              block.rows};
          QueryProjection::can_implement(values_args);
          layer.query_projection().backward(values_args);
        },
        &buffers.pool, "query gradients by feature");
  }

  // By rows: dWq in fixed column panels of kQueryKernelPanel (each reads all of X's CSR, so
  // narrow panels cost only its rereading), dX in the projection's row blocks. Without query
  // rows (B·T = 0) dWq is 0; the panels would be offsets on dQ's null data.
  static constexpr Index kQueryKernelPanel = 64;
  static void query_gradients_by_rows(const Layer& layer, const AttentionPlan& plan,
                                      const Query& query, Buffers& buffers,
                                      Vector<Scalar>& d_stored, RowMatrix<Scalar>& d_kernel) {
    const auto& csr = query.csr();
    const RowMatrix<Scalar>& d_queries = buffers.backward.d_queries;
    const Index width = plan.dims.projected_key_width();
    if (csr.rows == 0) d_kernel.setZero();
    const Index panels = csr.rows > 0 ? AttentionPlan::block_count(width, kQueryKernelPanel) : 0;
    parallel_for(
        panels, plan.threads,
        [&](Index index, int) {
          const RowBlock panel = AttentionPlan::block(index, width, kQueryKernelPanel);
          typename QueryProjection::KernelGradientArguments args{
              csr, d_queries.middleCols(panel.begin, panel.rows),
              d_kernel.middleCols(panel.begin, panel.rows)};
          QueryProjection::can_implement(args);
          layer.query_projection().backward(args);
        },
        &buffers.pool, "query kernel gradient");
    constexpr Index block_rows = kQueryProjectionRowBlock;
    const Index blocks = AttentionPlan::block_count(csr.rows, block_rows);
    std::vector<Index>& block_start = buffers.backward.block_start;
    block_start.assign(std::size_t(blocks) + 1, 0);
    for (Index index = 0; index < blocks; ++index) {
      const RowBlock block = AttentionPlan::block(index, csr.rows, block_rows);
      block_start[std::size_t(index) + 1] =
          block_start[std::size_t(index)] + csr.middle_rows(block.begin, block.rows).nonzeros();
    }
    parallel_for(
        blocks, plan.threads,
        [&](Index index, int) {
          const RowBlock block = AttentionPlan::block(index, csr.rows, block_rows);
          const Index start = block_start[std::size_t(index)];
          typename QueryProjection::ValuesGradientArguments args{
              csr.middle_rows(block.begin, block.rows), layer.weights().query_kernel,
              d_queries.middleRows(block.begin, block.rows),
              d_stored.segment(start, block_start[std::size_t(index) + 1] - start)};
          QueryProjection::can_implement(args);
          layer.query_projection().backward(args);
        },
        &buffers.pool, "query values gradient");
  }
};

}  // namespace sdmha::detail

namespace sdmha {

// The layer's backward entry points, declared in sparse_dense_mha.hpp.
template <typename Scalar, typename QP, typename SK, typename SM, typename AV, typename OP,
          typename CP>
void SparseDenseMHA<Scalar, QP, SK, SM, AV, OP, CP>::backward(
    const Query& query, const TensorRef3<Scalar>& key, const TensorRef3<Scalar>& value,
    const TensorRef3<Scalar>& d_output, const AttentionOptions<Scalar>& options,
    Workspace<Scalar>& workspace, MhaGradients<Scalar>& gradients) const {
  using Backward = detail::Backward<SparseDenseMHA>;
  Backward::check_stages();
  constexpr const char* where = "SparseDenseMHA::backward";
  const typename Workspace<Scalar>::Lease lease(workspace, where);
  auto& buffers = lease.buffers();
  const auto plan =
      Backward::check_and_plan(where, *this, query, key, value, d_output, options, buffers);
  this->project_context_into(plan, key, value, buffers, buffers.context);
  Backward::run(*this, plan, query, key, value, buffers.context, d_output, options, buffers,
                gradients);
}

template <typename Scalar, typename QP, typename SK, typename SM, typename AV, typename OP,
          typename CP>
void SparseDenseMHA<Scalar, QP, SK, SM, AV, OP, CP>::backward(
    const Query& query, const TensorRef3<Scalar>& key, const TensorRef3<Scalar>& value,
    const ProjectedContext<Scalar>& context, const TensorRef3<Scalar>& d_output,
    const AttentionOptions<Scalar>& options, Workspace<Scalar>& workspace,
    MhaGradients<Scalar>& gradients) const {
  using Backward = detail::Backward<SparseDenseMHA>;
  Backward::check_stages();
  constexpr const char* where = "SparseDenseMHA::backward";
  const typename Workspace<Scalar>::Lease lease(workspace, where);
  auto& buffers = lease.buffers();
  const auto plan =
      Backward::check_and_plan(where, *this, query, key, value, d_output, options, buffers);
  Backward::check_saved_context(where, plan, context);
  Backward::run(*this, plan, query, key, value, context, d_output, options, buffers, gradients);
}

template <typename Scalar, typename QP, typename SK, typename SM, typename AV, typename OP,
          typename CP>
MhaGradients<Scalar> SparseDenseMHA<Scalar, QP, SK, SM, AV, OP, CP>::backward(
    const Query& query, const TensorRef3<Scalar>& key, const TensorRef3<Scalar>& value,
    const TensorRef3<Scalar>& d_output, const AttentionOptions<Scalar>& options) const {
  const auto borrowed = this->borrow_workspace();
  MhaGradients<Scalar> gradients;
  backward(query, key, value, d_output, options, borrowed.workspace(), gradients);
  return gradients;
}

template <typename Scalar, typename QP, typename SK, typename SM, typename AV, typename OP,
          typename CP>
MhaGradients<Scalar> SparseDenseMHA<Scalar, QP, SK, SM, AV, OP, CP>::backward(
    const Query& query, const TensorRef3<Scalar>& key, const TensorRef3<Scalar>& value,
    const ProjectedContext<Scalar>& context, const TensorRef3<Scalar>& d_output,
    const AttentionOptions<Scalar>& options) const {
  const auto borrowed = this->borrow_workspace();
  MhaGradients<Scalar> gradients;
  backward(query, key, value, context, d_output, options, borrowed.workspace(), gradients);
  return gradients;
}

}  // namespace sdmha
