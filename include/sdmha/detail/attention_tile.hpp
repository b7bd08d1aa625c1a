// sdmha/detail/attention_tile.hpp — the per-tile pipeline, written once: the tiled forward, the
// online-softmax forward and the backward's recompute all run one tile through these functions.
//
//   tile_probabilities:  S = ScoreKernel(Q_tile, K_tile) + bias (blocked → −∞), P = Softmax(S),
//                        P' = dropout(P)                  (the tiled forward; the backward's
//                        recompute)
//   attend_tile:         the above, then A_tile = AttendValues(P', V_tile), written over its rows
//   attend_key_tile:     S as above, then the online update of (m, l) and of the partial A, and
//                        A_tile += AttendValues(dropout(exp(S − m')), V_tile)   (the online
//                        forward)
//
// A tile is one AttentionTile (batch, head, query rows, key range); the stages receive its absolute
// position. The scores come from the query source (`compute_scores`: project-first from Q, or
// regrouped from X's rows) so that the sparse and the dense query share every other step.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "sdmha/attention_result.hpp"
#include "sdmha/config.hpp"
#include "sdmha/detail/attention_plan.hpp"
#include "sdmha/detail/dropout.hpp"
#include "sdmha/detail/finite.hpp"
#include "sdmha/detail/softmax_exp.hpp"
#include "sdmha/detail/stage_traits.hpp"
#include "sdmha/mask.hpp"
#include "sdmha/options.hpp"
#include "sdmha/stage.hpp"
#include "sdmha/workspace.hpp"

namespace sdmha::detail {

template <typename Scalar>
using TileMap = Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;

// The mask of one attention item: its rows and keys of the masks of `options`.
template <typename Scalar>
BatchMask item_mask(const AttentionTile& item, const AttentionOptions<Scalar>& options, Index steps,
                    Index key_steps) {
  BatchMask mask;
  mask.steps = item.query_rows;
  mask.key_steps = item.key_steps;
  mask.first_step = item.query_begin;
  mask.first_key_step = item.key_begin;
  mask.causal = options.use_causal_mask;
  mask.causal_offset =
      options.causal_alignment == CausalAlignment::bottom_right ? key_steps - steps : 0;
  if (!options.attention_mask.empty()) {
    mask.attention =
        options.attention_mask.at(item.batch, item.head, item.query_begin, item.key_begin);
    mask.attention_stride = key_steps;
  }
  if (!options.key_mask.empty())
    mask.key_mask = options.key_mask.data() + item.batch * key_steps + item.key_begin;
  return mask;
}

// scores += the item's block of attention_bias, where neither is −∞; −∞ where either is: a
// blocked score stays blocked, and a −∞ bias blocks its position as a mask does, whatever the
// score (a NaN or ±∞ score from a non-finite key row included, which the sum would make NaN).
// Cost O(rows·keys) when there is a bias.
template <typename Scalar, typename Tile>
void add_attention_bias(const AttentionTile& item, const AttentionOptions<Scalar>& options,
                        Tile&& scores) {
  const BroadcastRef<Scalar>& bias = options.attention_bias;
  if (bias.empty()) return;
  constexpr Scalar blocked = -std::numeric_limits<Scalar>::infinity();
  for (Index t = 0; t < scores.rows(); ++t) {
    const Scalar* bias_row = bias.at(item.batch, item.head, item.query_begin + t, item.key_begin);
    for (Index s = 0; s < scores.cols(); ++s) {
      Scalar& score = scores(t, s);
      score = score == blocked || bias_row[s] == blocked ? blocked : score + bias_row[s];
    }
  }
}

// The item's block of the returned (B, H, T, S) probabilities; keys beyond the item's are 0.
template <typename Scalar>
TileMap<Scalar> scores_in_result(const AttentionPlan& plan, const AttentionTile& item,
                                 AttentionResult<Scalar>& result) {
  const Index S = plan.key_steps;
  Scalar* first = result.attention_scores.data() +
                  ((item.batch * plan.heads() + item.head) * plan.steps + item.query_begin) * S;
  TileMap<Scalar> whole(first, item.query_rows, S, Eigen::OuterStride<>(S));
  whole.rightCols(S - item.key_begin - item.key_steps).setZero();
  whole.leftCols(item.key_begin).setZero();
  return TileMap<Scalar>(first + item.key_begin, item.query_rows, item.key_steps,
                         Eigen::OuterStride<>(S));
}

template <typename Scalar>
TileMap<Scalar> as_tile(Eigen::Map<RowMatrix<Scalar>> map) {
  return TileMap<Scalar>(map.data(), map.rows(), map.cols(), Eigen::OuterStride<>(map.cols()));
}

// What one tile reads besides its scores: its head's rows of K and V, and whether the scores
// and P·V round their operands to bfloat16 (the bfloat16 mode).
template <typename Scalar>
struct TileOperands {
  ConstMatrixRef<Scalar> keys;    // tile.key_steps × Dk
  ConstMatrixRef<Scalar> values;  // tile.key_steps × Dv
  BFloat16Operands bfloat16_operands = false;
};

// Whether V_tile is finite (as read: rounded to bfloat16 too, all_finite_doubled, in that mode),
// which lets AttendValues take one GEMM instead of the product that skips zero probabilities.
// Found per tile, from the rows the tile reads: no pass of its own over V.
template <typename Scalar>
bool tile_values_finite(const TileOperands<Scalar>& operands) {
  return operands.bfloat16_operands ? all_finite_doubled<Scalar>(operands.values)
                                    : all_finite<Scalar>(operands.values);
}

// The masked, biased scores of one tile, into `scores` (tile.query_rows × tile.key_steps).
template <typename Scalar, typename ComputeScores, typename Scores>
void biased_scores(const AttentionPlan& plan, const AttentionTile& tile,
                   const TileOperands<Scalar>& operands, const AttentionOptions<Scalar>& options,
                   ComputeScores& compute_scores, StageScratch scratch, Scores& scores) {
  compute_scores(tile, item_mask(tile, options, plan.steps, plan.key_steps), operands.keys,
                 operands.bfloat16_operands, scratch, MatrixRef<Scalar>(scores));
  add_attention_bias(tile, options, scores);
}

// What the forward does between the scores and the softmax: nothing.
struct NoScoresHook {
  template <typename Tile>
  void operator()(const Tile&) const {}
};

// S → P = Softmax(S) in place in `scores`, then P' = dropout(P): in place too, unless
// `dropped` is given (the returned scores and the backward keep P apart from P'). Returns the
// probabilities that meet V. `before_softmax` sees the masked, biased scores (the backward's
// recompute marks the fully blocked rows there).
template <typename Stages, typename Scalar, typename ComputeScores,
          typename BeforeSoftmax = NoScoresHook>
TileMap<Scalar> tile_probabilities(const Stages& stages, const AttentionPlan& plan,
                                   const AttentionTile& tile, const TileOperands<Scalar>& operands,
                                   const AttentionOptions<Scalar>& options,
                                   ComputeScores& compute_scores, StageScratch scratch,
                                   TileMap<Scalar> scores, TileMap<Scalar>* dropped,
                                   BeforeSoftmax&& before_softmax = {}) {
  using Softmax = typename Stages::Softmax;
  biased_scores(plan, tile, operands, options, compute_scores, scratch, scores);
  before_softmax(scores);
  typename Softmax::Arguments softmax_args{tile.position(), scores, scratch,
                                           plan.fully_masked_rows};
  Softmax::can_implement(softmax_args);
  stages.softmax(softmax_args);
  const DropoutMask dropout = plan.dropout();
  if (!dropout.active()) return scores;
  TileMap<Scalar> probabilities = dropped != nullptr ? *dropped : scores;
  if (dropped != nullptr) probabilities = scores;
  dropout.apply(probabilities, tile.batch, tile.head, tile.query_begin, tile.key_begin);
  return probabilities;
}

// heads (+)= AttendValues(P', V_tile): `accumulate` under the online softmax.
template <typename Stages, typename Scalar, typename Heads>
void attend_values(const Stages& stages, const AttentionTile& tile,
                   const TileOperands<Scalar>& operands, const TileMap<Scalar>& probabilities,
                   Heads& heads, StageScratch scratch, bool accumulate) {
  using AttendValues = typename Stages::AttendValues;
  typename AttendValues::Arguments args{
      tile.position(), probabilities, operands.values, heads, tile_values_finite(operands),
      scratch};
  if constexpr (reads_bfloat16_operands<AttendValues>::value)
    args.bfloat16_operands = operands.bfloat16_operands;
  if constexpr (accumulates_values<AttendValues>::value) args.accumulate = accumulate;
  SDMHA_ASSERT(!accumulate || accumulates_values<AttendValues>::value);
  AttendValues::can_implement(args);
  stages.attend_values(args);
}

// One key tile of the online softmax: scores → unnormalised probabilities exp(S − m'), with
// the running maximum and sum of each row updated and its partial output rescaled to m'.
// Probabilities below the smallest normal number are flushed to 0, as MaskedSoftmax does, so
// a blocked key (−∞) contributes exactly 0.
template <typename Tile, typename Statistics, typename Heads>
void online_softmax_update(Tile& scores, Statistics& statistics, Heads& heads) {
  using Scalar = typename std::decay_t<Tile>::Scalar;
  constexpr Scalar minus_infinity = -std::numeric_limits<Scalar>::infinity();
  for (Index t = 0; t < scores.rows(); ++t) {
    auto row = scores.row(t).array();
    const Scalar previous = statistics(t, 0);
    const Scalar maximum = std::max(previous, row_maximum(scores.row(t).data(), scores.cols()));
    if (maximum == minus_infinity) {  // nothing seen yet in this row (or a NaN max ignores)
      if (row.isNaN().any()) statistics(t, 1) = std::numeric_limits<Scalar>::quiet_NaN();
      row.setZero();
      continue;
    }
    const Scalar sum = exponentiate_shifted(scores.row(t).data(), scores.cols(), maximum);
    const Scalar correction = previous == minus_infinity ? Scalar(0) : std::exp(previous - maximum);
    statistics(t, 1) = statistics(t, 1) * correction + sum;
    statistics(t, 0) = maximum;
    if (correction != Scalar(1)) heads.row(t) *= correction;
  }
}

// One tile of the tiled forward: P' from tile_probabilities, then its rows of the heads
// A_tile = P'·V_tile. `scores` is the worker's tile or the tile's block of the returned scores
// (then P' goes to the worker's second tile, so that the returned P stays before dropout).
template <typename Stages, typename Scalar, typename ComputeScores, typename Heads>
void attend_tile(const Stages& stages, const AttentionPlan& plan, const AttentionTile& tile,
                 const TileOperands<Scalar>& operands, const AttentionOptions<Scalar>& options,
                 ComputeScores& compute_scores, WorkerBuffers<Scalar>& worker,
                 TileMap<Scalar> scores, Heads heads) {
  const StageScratch scratch = worker.stage.view();
  TileMap<Scalar> dropped =
      as_tile(worker.tile(1, tile.query_rows, tile.key_steps, plan.tile_entries));
  const TileMap<Scalar> probabilities =
      tile_probabilities(stages, plan, tile, operands, options, compute_scores, scratch, scores,
                         options.return_attention_scores ? &dropped : nullptr);
  attend_values(stages, tile, operands, probabilities, heads, scratch, false);
}

// One key tile of the online-softmax forward: its scores, the update of the rows' (m, l) and
// partial heads, dropout, and heads += P_j·V_j.
template <typename Stages, typename Scalar, typename ComputeScores, typename Statistics,
          typename Heads>
void attend_key_tile(const Stages& stages, const AttentionPlan& plan, const AttentionTile& tile,
                     const TileOperands<Scalar>& operands, const AttentionOptions<Scalar>& options,
                     ComputeScores& compute_scores, WorkerBuffers<Scalar>& worker,
                     Statistics& statistics, Heads& heads) {
  const StageScratch scratch = worker.stage.view();
  TileMap<Scalar> scores =
      as_tile(worker.tile(0, tile.query_rows, tile.key_steps, plan.tile_entries));
  biased_scores(plan, tile, operands, options, compute_scores, scratch, scores);
  online_softmax_update(scores, statistics, heads);
  plan.dropout().apply(scores, tile.batch, tile.head, tile.query_begin, tile.key_begin);
  attend_values(stages, tile, operands, scores, heads, scratch, true);
}

}  // namespace sdmha::detail
