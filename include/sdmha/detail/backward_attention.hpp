// sdmha/detail/backward_attention.hpp — the backward's attention: per (b, h, group of query
// tiles) item, each tile's forward recomputed (scores, P, P', A), then the tile stages' backward
// in reverse; and the attention bias's gradient.
//
//   math:  dP' = dA·Vᵀ, dV += P'ᵀ·dA;  dP = dP' ⊙ keep/(1 − rate);  dS = P ⊙ (dP − rowsum(P ⊙ dP));
//          dbias += dS;  dQ = scale·dS·K, dK += scale·dSᵀ·Q                    (per (b, h), tile)
//   pre:   a validated, planned call; K, V in `context`, Q in buffers.projected_query, dA in
//          buffers.backward.d_heads
//   cost:  per tile, the forward's two products again and four more: O(T·S·(Dk + Dv)) per (b, h)
//
// A tile's masked scores, before the attention bias, come from the caller, as
//   tile_scores(item, mask, keys, stage, out)      out = the forward's scores of `item`
// (the layer's tile_scores is private; detail::Backward, the layer's friend, hands it in). An
// item's rows of A and dQ are its own, its terms of dK_bh and dV_bh are added in a fixed order
// (attention_by_tiles): no sum depends on the thread count.
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>

#include "sdmha/config.hpp"
#include "sdmha/detail/attention_plan.hpp"
#include "sdmha/detail/attention_tile.hpp"
#include "sdmha/detail/dropout.hpp"
#include "sdmha/detail/finite.hpp"
#include "sdmha/detail/parallel.hpp"
#include "sdmha/gradients.hpp"
#include "sdmha/options.hpp"
#include "sdmha/projected_context.hpp"
#include "sdmha/stage.hpp"
#include "sdmha/workspace.hpp"

namespace sdmha::detail {

// The attention's part of detail::Backward<Layer>: static functions over the layer's tile stages
// (Softmax, AttendValues, ScoreKernel), the plan and the call's buffers.
template <typename Layer>
struct BackwardAttention {
  using Scalar = typename Layer::ScalarType;
  using Buffers = CallBuffers<Scalar>;

  // Where a tile's dS goes for the bias gradient: the gradient itself, or the partial sum of the
  // item's run (see add_bias_gradient).
  struct BiasGradientTarget {
    Scalar* data = nullptr;  // null: no bias gradient asked for
    bool accumulate = false;
  };

  // ---- the attention, per (b, h) -----------------------------------------------------------

  // Flags of one (b, h): whether K_bh, V_bh and dA_bh are finite, found once for all its tiles.
  struct HeadFlags {
    bool keys_finite, values_finite, d_probabilities_finite;
  };

  template <typename TileScores>
  static void attention(const Layer& layer, const AttentionPlan& plan,
                        const TileScores& tile_scores, const ProjectedContext<Scalar>& context,
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
      attention_by_tiles(layer, plan, tile_scores, context, options, buffers, gradients);
    else
      attention_by_tasks(layer, plan, tile_scores, context, options, buffers, gradients);
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
  template <typename TileScores>
  static void attention_by_tiles(const Layer& layer, const AttentionPlan& plan,
                                 const TileScores& tile_scores,
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
              const AttentionTile item = plan.tile_of(b, h, tile);
              attention_tile(layer, plan, item, tile_scores, context, options, flags, target, own,
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
  template <typename TileScores>
  static void attention_by_tasks(const Layer& layer, const AttentionPlan& plan,
                                 const TileScores& tile_scores,
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
              const AttentionTile item = plan.tile_of(b, h, tile);
              attention_tile(layer, plan, item, tile_scores, context, options, flags, target,
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
  template <typename TileScores>
  static void attention_tile(const Layer& layer, const AttentionPlan& plan,
                             const AttentionTile& item, const TileScores& tile_scores,
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
    auto d_scores = worker.tile(2, rows, keys, plan.tile_entries);
    // The forward again through the forward's own tile functions: P (kept for the softmax's
    // backward), P' and the tile's rows of A (for dWo).
    TileMap<Scalar> probabilities = as_tile(worker.tile(0, rows, keys, plan.tile_entries));
    TileMap<Scalar> dropped_tile = as_tile(worker.tile(1, rows, keys, plan.tile_entries));
    const TileOperands<Scalar> operands{key_bh, value_bh, false};
    const auto compute_scores = [&](const AttentionTile& tile, const BatchMask& mask,
                                    const ConstMatrixRef<Scalar>& tile_keys, BFloat16Operands,
                                    StageScratch tile_scratch, MatrixRef<Scalar> out) {
      tile_scores(tile, mask, tile_keys, tile_scratch, out);
    };
    const char* fully_masked = nullptr;
    const DropoutMask dropout = plan.dropout();
    const TileMap<Scalar> dropped = tile_probabilities(
        layer.stages(), plan, item, operands, options, compute_scores, stage, probabilities,
        dropout.active() ? &dropped_tile : nullptr, [&](const TileMap<Scalar>& masked) {
          fully_masked = mark_fully_masked_rows(plan, masked, worker);
        });
    auto heads = buffers.heads.block(query_row, h * Dv, rows, Dv);
    attend_values(layer.stages(), item, operands, dropped, heads, stage, false);

    typename Layer::AttendValues::BackwardArguments d_values_args{
        position, dropped, value_bh, d_heads, d_scores, d_values, stage};
    Layer::AttendValues::can_implement(d_values_args);
    layer.stages().attend_values.backward(d_values_args);
    dropout.apply(d_scores, b, h, item.query_begin, item.key_begin);
    typename Layer::Softmax::BackwardArguments d_softmax_args{
        position, probabilities, d_scores, flags.d_probabilities_finite, stage, fully_masked};
    Layer::Softmax::can_implement(d_softmax_args);
    layer.stages().softmax.backward(d_softmax_args);
    add_bias_gradient(plan, item, options, d_scores, bias_gradient);
    typename Layer::ScoreKernel::BackwardArguments d_score_args{
        position, query_bh,          key_bh, Scalar(plan.scale), d_scores, d_queries,
        d_keys,   flags.keys_finite, stage};
    Layer::ScoreKernel::can_implement(d_score_args);
    layer.stages().score_kernel.backward(d_score_args);
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
  static void add_bias_gradient(const AttentionPlan& plan, const AttentionTile& item,
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
};

}  // namespace sdmha::detail
