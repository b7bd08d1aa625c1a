// sdmha/backward.hpp — mha_backward: every gradient of SparseDenseMHA's forward in one call.
//
// With scale = 1/√Dk, P = softmax(S) and P' = P after dropout, the forward is
//   Q = X·Wq + bq,  K = key·Wk + bk,  V = value·Wv + bv,
//   S_bh = scale·Q_bh·K_bhᵀ (blocked → −∞),  A_bh = P'_bh·V_bh,  Y = A·Wo + bo,
// and from dY the backward is
//   dWo = Aᵀ·dY, dbo = 1ᵀ·dY, dA = dY·Woᵀ;
//   per (b, h): dP' = dA_bh·V_bhᵀ, dV_bh = P'ᵀ·dA_bh, dP = dP' ⊙ (dropout's keep/(1 − rate)),
//               dS = P ⊙ (dP − rowsum(P ⊙ dP)), dQ_bh = scale·dS·K_bh, dK_bh = scale·dSᵀ·Q_bh;
//   dWq = Xᵀ·dQ (QueryKernelGradient), dbq = 1ᵀ·dQ, dX = dQ·Wqᵀ sampled at X's stored
//   positions (QueryValuesGradient); dWk = keyᵀ·dK, dbk = 1ᵀ·dK, dkey = dK·Wkᵀ; likewise V.
//
// Nothing is saved from the forward: the backward recomputes Q, K and V (or takes K and V from
// the ProjectedContext the forward ran against) and, tile by tile, the probabilities, with the
// forward's stages and dropout mask (a function of the coordinates, so of no tiling). The (b, h)
// loop keeps one tile of scores per worker, never the whole (B, H, T, S) tensor; its tiles are
// the forward's under a causal mask or the regrouped kernel, and otherwise as many query rows as
// keep three tile × S matrices in L2 (backward_query_tile). Every product is a detail::gemm, on
// one ThreadPool for the whole call. dWq and dX go by rows of X, or by feature over X's CSC when
// Wq is beyond L2 and larger than dQ and each feature is used twice on average
// (detail::query_gradients_by_feature; `bow` 1 %), the same sums either way.
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "sdmha/config.hpp"
#include "sdmha/detail/dropout.hpp"
#include "sdmha/detail/finite.hpp"
#include "sdmha/detail/gemm.hpp"
#include "sdmha/detail/parallel.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/gradients.hpp"
#include "sdmha/mask.hpp"
#include "sdmha/options.hpp"
#include "sdmha/sparse_query.hpp"
#include "sdmha/stages/attend_values.hpp"
#include "sdmha/stages/dense_projection.hpp"
#include "sdmha/stages/masked_softmax.hpp"
#include "sdmha/stages/output_projection.hpp"
#include "sdmha/stages/query_kernel_gradient.hpp"
#include "sdmha/stages/query_projection.hpp"
#include "sdmha/stages/query_values_gradient.hpp"
#include "sdmha/stages/score_kernel.hpp"
#include "sdmha/weights.hpp"
#include "sdmha/workspace.hpp"

namespace sdmha {
namespace detail::gradient {

// Tiles of a weight gradient (rows × columns of dW); fixed, so that every entry of dW is one
// GEMM over the same rows for any thread count.
constexpr Index kWeightTile = 256;

// Features per work item of the query gradients by feature: 1024 rows of dWq (2 MB at N = 512)
// per item, 32 items on `bow`.
constexpr Index kFeatureBlock = 1024;

// Scores held per worker and tile: three tile × S matrices (P, P' and dS) of this many entries
// each stay in L2 together.
constexpr Index kBackwardTileEntries = Index(1) << 15;

// Query rows per tile. The regrouped kernel shares M_bh across all of a batch entry's rows, so it
// takes them all; a causal mask keeps the forward's tile, whose key range it shortens; otherwise
// as many rows as kBackwardTileEntries allows, since every tile runs six small GEMMs and larger
// ones waste less on packing (on `seed`, S = 128: all T = 128 rows in one tile).
inline Index backward_query_tile(bool regrouped, bool causal, Index steps, Index key_steps) {
  if (regrouped) return steps;
  if (causal || key_steps == 0) return kQueryTile;
  return std::max(kQueryTile, std::min(steps, kBackwardTileEntries / key_steps));
}

template <typename Scalar>
struct Inputs {
  Index batch, steps, key_steps;
  Eigen::Map<const RowMatrix<Scalar>> key, value;
  int threads;
};

// d_input (rows × E) = d_output · kernelᵀ, in fixed row blocks.
template <typename Scalar>
void input_gradient(const RowMatrix<Scalar>& d_output, const RowMatrix<Scalar>& kernel,
                    Eigen::Map<RowMatrix<Scalar>> d_input, int threads, ThreadPool& pool) {
  const Index rows = d_output.rows();
  parallel_for(row_block_count(rows), threads, [&](Index block, int) {
    const Index first = block * kProjectionRowBlock;
    const Index count = std::min(kProjectionRowBlock, rows - first);
    gemm<Scalar>(as_operand<Scalar>(d_output.middleRows(first, count)), transposed<Scalar>(kernel),
                 d_input.middleRows(first, count), Scalar(1), false);
  }, &pool);
}

// d_weight (E × N) = inputᵀ · d_output over all rows, one GEMM per fixed tile of d_weight.
template <typename Scalar>
void transposed_product_tiles(const ConstMatrixRef<Scalar>& input,
                              const ConstMatrixRef<Scalar>& d_output, RowMatrix<Scalar>& d_weight,
                              int threads, ThreadPool& pool) {
  const Index row_tiles = (d_weight.rows() + kWeightTile - 1) / kWeightTile;
  const Index column_tiles = (d_weight.cols() + kWeightTile - 1) / kWeightTile;
  parallel_for(row_tiles * column_tiles, threads, [&](Index item, int) {
    const Index first_row = (item / column_tiles) * kWeightTile;
    const Index first_column = (item % column_tiles) * kWeightTile;
    const Index rows = std::min(kWeightTile, d_weight.rows() - first_row);
    const Index columns = std::min(kWeightTile, d_weight.cols() - first_column);
    gemm<Scalar>(transposed<Scalar>(input.middleCols(first_row, rows)),
                 as_operand<Scalar>(d_output.middleCols(first_column, columns)),
                 d_weight.block(first_row, first_column, rows, columns), Scalar(1), false);
  }, &pool);
}

// The gradient of a dense projection's kernel, dW = inputᵀ·dY. A row of the input that no query
// attends (a blocked key step) has dY's row exactly 0 and may hold NaN or Inf; a GEMM would turn
// 0·NaN into NaN, so when the input is not finite only the rows with a gradient take part.
// Without rows (B = 0, T = 0 or S = 0) dW is 0, and no tile is taken: the input's data is null
// then, and a column block at a non-zero offset would be arithmetic on a null pointer.
template <typename Scalar>
void kernel_gradient(const ConstMatrixRef<Scalar>& input, const ConstMatrixRef<Scalar>& d_output,
                     int threads, ThreadPool& pool, BackwardBuffers<Scalar>& scratch,
                     RowMatrix<Scalar>& d_weight) {
  d_weight.resize(input.cols(), d_output.cols());
  if (input.rows() == 0) {
    d_weight.setZero();
    return;
  }
  if (all_finite<Scalar>(input)) {
    transposed_product_tiles<Scalar>(input, d_output, d_weight, threads, pool);
    return;
  }
  std::vector<Index>& rows = scratch.gathered_rows;
  rows.clear();
  for (Index row = 0; row < input.rows(); ++row)
    if ((d_output.row(row).array() != Scalar(0)).any()) rows.push_back(row);
  // No row with a gradient (every key step blocked, or dY = 0): dW = 0, and the empty gathered
  // matrices have null data that a tile at a non-zero offset must not be taken of.
  if (rows.empty()) {
    d_weight.setZero();
    return;
  }
  // Sized for every row, not for this call's count, so that a blocking pattern changing from one
  // training step to the next does not reallocate.
  scratch.gathered_input.resize(input.rows(), input.cols());
  scratch.gathered_output.resize(input.rows(), d_output.cols());
  const Index count = Index(rows.size());
  for (Index i = 0; i < count; ++i) {
    scratch.gathered_input.row(i) = input.row(rows[std::size_t(i)]);
    scratch.gathered_output.row(i) = d_output.row(rows[std::size_t(i)]);
  }
  transposed_product_tiles<Scalar>(scratch.gathered_input.topRows(count),
                                   scratch.gathered_output.topRows(count), d_weight, threads, pool);
}

// dbias = 1ᵀ·dY; 0 without rows, where Eigen's column sums would take blocks at non-zero offsets
// of dY's null data.
template <typename Scalar, typename Matrix>
void bias_gradient(bool use_bias, const Matrix& d_output, Vector<Scalar>& d_bias) {
  if (!use_bias) {
    d_bias.resize(0);
  } else if (d_output.rows() == 0) {
    d_bias.setZero(d_output.cols());
  } else {
    d_bias.resize(d_output.cols());
    d_bias.noalias() = d_output.colwise().sum().transpose();
  }
}

// out = alpha · weights · rows, where a zero weight never meets its row: a row of K that every
// query is blocked from may be NaN, and its weights (dS's column) are exactly 0. `rows_are_finite`
// is known once per (b, h); then the product is one GEMM.
template <typename Scalar>
void product_skipping_zero_weights(Scalar alpha, const ConstMatrixRef<Scalar>& weights,
                                   const ConstMatrixRef<Scalar>& rows, bool rows_are_finite,
                                   MatrixRef<Scalar> out) {
  if (rows_are_finite) {
    gemm<Scalar>(as_operand<Scalar>(weights), as_operand<Scalar>(rows), out, alpha, false);
    return;
  }
  out.setZero();
  for (Index t = 0; t < weights.rows(); ++t)
    for (Index s = 0; s < weights.cols(); ++s)
      if (weights(t, s) != Scalar(0)) out.row(t).noalias() += (alpha * weights(t, s)) * rows.row(s);
}

// The layer's stages must be the ones differentiated here: the derivatives below are those of
// the default stages, and a stage of one's own (a temperature softmax, a biased score) has a
// different gradient.
template <typename Layer>
struct HasDefaultStages {
  using Scalar = typename Layer::ScalarType;
  using StorageIndex = typename Layer::StorageIndex;
  static constexpr bool projections =
      std::is_same<typename Layer::QueryProjection,
                   SparseQueryProjection<Scalar, StorageIndex>>::value &&
      std::is_same<typename Layer::ContextProjection, DenseProjection<Scalar>>::value &&
      std::is_same<typename Layer::OutputProjection, OutputProjection<Scalar>>::value;
  static constexpr bool attention =
      std::is_same<typename Layer::ScoreKernel, ScoreKernel<Scalar, StorageIndex>>::value &&
      std::is_same<typename Layer::Softmax, MaskedSoftmax<Scalar>>::value &&
      std::is_same<typename Layer::AttendValues, AttendValues<Scalar>>::value;
};

// Everything that the backward checks before any work: the forward's checks with the same
// messages, then d_output against (B, T, O).
template <typename Layer, typename Scalar = typename Layer::ScalarType>
Inputs<Scalar> check_backward(const char* where, const Layer& layer,
                              const typename Layer::Query& query, const TensorRef3<Scalar>& key,
                              const TensorRef3<Scalar>& value, const TensorRef3<Scalar>& d_output,
                              const AttentionOptions<Scalar>& options) {
  static_assert(HasDefaultStages<Layer>::projections,
                "mha_backward: differentiates the default projection stages only");
  static_assert(
      HasDefaultStages<Layer>::attention,
      "mha_backward: differentiates the default ScoreKernel, MaskedSoftmax and AttendValues only");
  const LayerDims& dims = layer.dims();
  layer.check_query(where, query);
  layer.check_context(where, query.batch(), key, value);
  const auto sizes = layer.check_options(where, query.batch(), query.steps(), value.dimension(1), options);
  const Inputs<Scalar> inputs{sizes.batch, sizes.steps, sizes.key_steps, key.as_matrix(),
                              value.as_matrix(), sizes.threads};
  const Index B = inputs.batch, T = inputs.steps, O = dims.output_dim;
  if (d_output.dimension(0) != B || d_output.dimension(1) != T || d_output.dimension(2) != O)
    fail<ShapeError>(where, "d_output is (", d_output.dimension(0), ", ", d_output.dimension(1),
                     ", ", d_output.dimension(2), "); expected (B, T, O) = (", B, ", ", T, ", ", O,
                     ")");
  if (d_output.data() == nullptr && B * T * O > 0)
    fail<ShapeError>(where, "d_output has no data; expected ", B, " x ", T, " x ", O, " values");
  return inputs;
}

// The backward on validated inputs into `gradients`, K = `keys` and V = `values` being the key
// and value projected, working in `buffers` (a Workspace's) and on its pool.
template <typename Layer, typename Scalar = typename Layer::ScalarType>
void backward(const Layer& layer, const typename Layer::Query& query, const Inputs<Scalar>& inputs,
              const RowMatrix<Scalar>& keys, const RowMatrix<Scalar>& values,
              const TensorRef3<Scalar>& d_output, const AttentionOptions<Scalar>& options,
              CallBuffers<Scalar>& buffers, MhaGradients<Scalar>& gradients) {
  using StorageIndex = typename Layer::StorageIndex;
  const MhaConfig& config = layer.config();
  const MhaWeights<Scalar>& weights = layer.weights();
  const LayerDims& dims = layer.dims();
  const Index B = inputs.batch, T = inputs.steps, S = inputs.key_steps;
  const Index H = dims.num_heads, Dk = dims.key_dim, Dv = dims.value_dim;
  const int threads = inputs.threads;
  const Scalar scale = Scalar(1.0 / std::sqrt(double(Dk)));
  const auto& csr = query.csr();

  // The workspace's workers run every parallel step below: their thread-local GEMM packing
  // buffers stay warm from one step, and one call, to the next.
  ThreadPool& pool = buffers.pool;
  BackwardBuffers<Scalar>& scratch = buffers.backward;

  // The forward's query projection, recomputed whatever the score strategy: dK needs Q.
  RowMatrix<Scalar>& queries = scratch.queries;
  layer.project_query(query, threads, &pool, queries);

  // dA = dY·Woᵀ does not depend on the attention, so it is ready before the (b, h) loop.
  const auto d_output_matrix = d_output.as_matrix();
  RowMatrix<Scalar>& d_heads = scratch.d_heads;
  d_heads.resize(B * T, H * Dv);
  parallel_for(row_block_count(B * T), threads, [&](Index block, int) {
    const Index first = block * kProjectionRowBlock;
    const Index count = std::min(kProjectionRowBlock, B * T - first);
    gemm<Scalar>(as_operand<Scalar>(d_output_matrix.middleRows(first, count)),
                 transposed<Scalar>(weights.output_kernel), d_heads.middleRows(first, count), Scalar(1),
                 false);
  }, &pool);

  // One work item per (b, h): it owns the (b, h) blocks of A, dQ, dK and dV, and sums dK_bh and
  // dV_bh over its query tiles in tile order, so no sum depends on the thread count.
  RowMatrix<Scalar>& heads = scratch.heads;
  RowMatrix<Scalar>& d_queries = scratch.d_queries;
  RowMatrix<Scalar>& d_keys = scratch.d_keys;
  RowMatrix<Scalar>& d_values = scratch.d_values;
  heads.resize(B * T, H * Dv);
  d_queries.resize(B * T, H * Dk);
  d_keys.setZero(B * S, H * Dk);
  d_values.setZero(B * S, H * Dv);
  // The forward's choice of score strategy, with the largest U_b behind it: the regrouped
  // kernel's per-thread scratch is sized for every batch entry at once, as in the forward.
  const auto strategy = layer.choose_strategy(options.score_strategy, query, S,
                                              options.use_causal_mask, buffers.feature_batch);
  const bool regrouped = strategy.strategy == ScoreStrategy::sparse_regrouped;
  const Index query_tile = backward_query_tile(regrouped, options.use_causal_mask, T, S);
  const Index tiles = query_tile > 0 ? (T + query_tile - 1) / query_tile : 0;
  const DropoutMask dropout =
      options.training ? DropoutMask(options.dropout_rate, options.dropout_seed) : DropoutMask();
  const Vector<Scalar> no_bias;
  const int workers = worker_count(B * H, threads);
  // Per worker: P, P' (when dropout is on) and dP → dS of the tile in flight.
  auto& probabilities_scratch = scratch.tile_probabilities;
  auto& dropped_scratch = scratch.tile_dropped;
  auto& d_scores_scratch = scratch.tile_d_scores;
  CallBuffers<Scalar>::ensure_workers(probabilities_scratch, workers);
  CallBuffers<Scalar>::ensure_workers(dropped_scratch, workers);
  CallBuffers<Scalar>::ensure_workers(d_scores_scratch, workers);
  const ScoreKernel<Scalar, StorageIndex> score_kernel;
  const MaskedSoftmax<Scalar> softmax;
  const AttendValues<Scalar> attend_values;

  // Without key steps every query row is fully blocked: A = 0 and dQ = 0, dK and dV are empty.
  // Without query steps A and dQ are empty and dK = dV = 0. Either way there is no (b, h) item:
  // its blocks of the empty K and V, or of the empty dA, would be offsets on null data.
  if (S == 0 || T == 0) {
    heads.setZero();
    d_queries.setZero();
  }
  const Index attention_items = S > 0 && T > 0 ? B * H : 0;
  parallel_for(attention_items, threads, [&](Index item, int worker) {
    const Index b = item / H, h = item % H;
    using ScratchMap = Eigen::Map<RowMatrix<Scalar>>;
    auto tile_scratch = [&](std::vector<RowMatrix<Scalar>>& per_worker, Index rows, Index columns) {
      RowMatrix<Scalar>& buffer = per_worker[std::size_t(worker)];
      if (buffer.size() < rows * columns) buffer.resize(std::min(query_tile, T), S);
      return ScratchMap(buffer.data(), rows, columns);
    };
    // Whether K_bh and V_bh are finite, once for all tiles: then every product below is a GEMM.
    const bool keys_are_finite = all_finite<Scalar>(keys.block(b * S, h * Dk, S, Dk));
    const bool values_are_finite = all_finite<Scalar>(values.block(b * S, h * Dv, S, Dv));
    const bool d_scores_are_finite =
        values_are_finite && all_finite<Scalar>(d_heads.block(b * T, h * Dv, T, Dv));
    for (Index tile = 0; tile < tiles; ++tile) {
      const Index first_step = tile * query_tile, rows = std::min(query_tile, T - first_step);
      const Index key_end = options.use_causal_mask ? std::min(S, first_step + rows) : S;
      const auto key_bh = keys.block(b * S, h * Dk, key_end, Dk);
      const auto value_bh = values.block(b * S, h * Dv, key_end, Dv);
      const auto query_tile_bh = queries.block(b * T + first_step, h * Dk, rows, Dk);
      const auto d_heads_tile = d_heads.block(b * T + first_step, h * Dv, rows, Dv);

      BatchMask mask;
      mask.steps = rows;
      mask.key_steps = key_end;
      mask.first_step = first_step;
      mask.causal = options.use_causal_mask;
      if (options.attention_mask.size() != 0) {
        mask.attention = options.attention_mask.data() + (b * T + first_step) * S;
        mask.attention_stride = S;
      }
      if (options.key_padding_mask.size() != 0)
        mask.key_padding = options.key_padding_mask.data() + b * S;

      ScratchMap probabilities = tile_scratch(probabilities_scratch, rows, key_end);
      if (regrouped) {
        const ConstVectorRef<Scalar> query_bias_h =
            weights.query_bias.size() != 0
                ? ConstVectorRef<Scalar>(weights.query_bias.segment(h * Dk, Dk))
                : ConstVectorRef<Scalar>(no_bias);
        typename ScoreKernel<Scalar, StorageIndex>::SparseArguments args{
            query.batch_rows(b), weights.query_kernel.middleCols(h * Dk, Dk), query_bias_h, key_bh,
            scale, mask, probabilities};
        args.feature_capacity = strategy.features.largest;
        score_kernel.can_implement(args);
        score_kernel(args);
      } else {
        typename ScoreKernel<Scalar, StorageIndex>::Arguments args{query_tile_bh, key_bh, scale,
                                                                   mask, probabilities};
        score_kernel.can_implement(args);
        score_kernel(args);
      }
      typename MaskedSoftmax<Scalar>::Arguments softmax_args{probabilities};
      softmax.can_implement(softmax_args);
      softmax(softmax_args);

      ScratchMap dropped =
          dropout.active() ? tile_scratch(dropped_scratch, rows, key_end) : probabilities;
      if (dropout.active()) {
        dropped = probabilities;
        dropout.apply(dropped, b, h, first_step, 0);
      }
      typename AttendValues<Scalar>::Arguments values_args{
          dropped, value_bh, heads.block(b * T + first_step, h * Dv, rows, Dv), values_are_finite};
      attend_values.can_implement(values_args);
      attend_values(values_args);

      // dP' = dA·Vᵀ, then dP = dP' ⊙ dropout's scale mask (dropped entries set to 0, not scaled).
      ScratchMap d_scores = tile_scratch(d_scores_scratch, rows, key_end);
      gemm<Scalar>(as_operand<Scalar>(d_heads_tile), transposed<Scalar>(value_bh), d_scores, Scalar(1),
                   false);
      dropout.apply(d_scores, b, h, first_step, 0);
      // dS = P ⊙ (dP − Σ_s P·dP). Entries with P = 0 (blocked, or a fully blocked row) must come
      // out 0. When V_bh and dA_bh are finite so is dP, and P·(…) is 0 there by itself (a packet
      // loop); otherwise dP may be NaN where P = 0, and those entries are set, not multiplied.
      for (Index t = 0; t < rows; ++t) {
        auto p = probabilities.row(t).array();
        auto d = d_scores.row(t).array();
        if (d_scores_are_finite) {
          const Scalar weighted = (p * d).sum();
          d = p * (d - weighted);
        } else {
          const Scalar weighted = (p != Scalar(0)).select(p * d, Scalar(0)).sum();
          d = (p != Scalar(0)).select(p * (d - weighted), Scalar(0));
        }
      }
      product_skipping_zero_weights<Scalar>(scale, d_scores, key_bh, keys_are_finite,
                                            d_queries.block(b * T + first_step, h * Dk, rows, Dk));
      gemm<Scalar>(transposed<Scalar>(d_scores), as_operand<Scalar>(query_tile_bh),
                   d_keys.block(b * S, h * Dk, key_end, Dk), scale, true);
      gemm<Scalar>(transposed<Scalar>(dropped), as_operand<Scalar>(d_heads_tile),
                   d_values.block(b * S, h * Dv, key_end, Dv), Scalar(1), true);
    }
  }, &pool);

  const bool use_bias = config.use_bias;

  // Output projection.
  kernel_gradient<Scalar>(heads, d_output_matrix, threads, pool, scratch, gradients.output_kernel);
  bias_gradient<Scalar>(use_bias, d_output_matrix, gradients.output_bias);

  // Query projection: dWq = Xᵀ·dQ, dbq = 1ᵀ·dQ, and dX = dQ·Wqᵀ sampled at X's pattern, in CSR
  // order: straight into the result, or into scratch when from_coo's entries map onto the stored
  // values.
  const auto& coo_to_stored = query.coo_to_stored();
  Vector<Scalar>& d_stored = coo_to_stored.empty() ? gradients.query_values : scratch.d_stored;
  d_stored.resize(csr.nonzeros());
  gradients.query_kernel.resize(dims.query_dim, H * Dk);
  bias_gradient<Scalar>(use_bias, d_queries, gradients.query_bias);
  using KernelGradient = QueryKernelGradient<Scalar, StorageIndex>;
  using ValuesGradient = QueryValuesGradient<Scalar, StorageIndex>;
  if (query_gradients_by_feature(csr, H * Dk)) {
    // Wq and dWq beyond L2 (`bow`): both stages by feature over X's CSC, built once here and
    // read by every worker, in fixed blocks of features. Thread-local like the forward's
    // by-feature scratch: a repeated call on this thread allocates nothing.
    // The workers reach it through this pointer: inside their lambda the thread_local's name
    // would be each worker's own, empty, instance.
    thread_local typename KernelGradient::FeatureGroups calling_thread_features;
    const auto* query_features = &calling_thread_features;
    build_feature_groups(csr, calling_thread_features, true);
    const Index features = dims.query_dim;
    parallel_for((features + kFeatureBlock - 1) / kFeatureBlock, threads, [&](Index block, int) {
      const Index first = block * kFeatureBlock, count = std::min(kFeatureBlock, features - first);
      typename KernelGradient::Arguments kernel_args{
          csr, d_queries, gradients.query_kernel.middleRows(first, count), query_features, first};
      KernelGradient::can_implement(kernel_args);
      KernelGradient()(kernel_args);
      typename ValuesGradient::Arguments values_args{
          csr, weights.query_kernel, d_queries, d_stored, query_features, first, count};
      ValuesGradient::can_implement(values_args);
      ValuesGradient()(values_args);
    }, &pool);
  } else {
    // By rows: dWq in fixed column panels, dX in the projection's row blocks. Without query rows
    // (B·T = 0) dWq is 0; the panels would be offsets on d_queries' null data.
    if (csr.rows == 0) gradients.query_kernel.setZero();
    const Index panels = csr.rows > 0 ? (H * Dk + kWeightTile - 1) / kWeightTile : 0;
    parallel_for(panels, threads, [&](Index panel, int) {
      const Index first = panel * kWeightTile, count = std::min(kWeightTile, H * Dk - first);
      typename KernelGradient::Arguments args{csr, d_queries.middleCols(first, count),
                                              gradients.query_kernel.middleCols(first, count)};
      KernelGradient::can_implement(args);
      KernelGradient()(args);
    }, &pool);
    const Index blocks = row_block_count(csr.rows);
    std::vector<Index>& block_start = scratch.block_start;
    block_start.assign(std::size_t(blocks) + 1, 0);
    for (Index block = 0; block < blocks; ++block) {
      const Index first = block * kProjectionRowBlock;
      block_start[std::size_t(block) + 1] =
          block_start[std::size_t(block)] +
          csr.middle_rows(first, std::min(kProjectionRowBlock, csr.rows - first)).nonzeros();
    }
    parallel_for(blocks, threads, [&](Index block, int) {
      const Index first = block * kProjectionRowBlock;
      const Index count = std::min(kProjectionRowBlock, csr.rows - first);
      const Index start = block_start[std::size_t(block)];
      typename ValuesGradient::Arguments args{
          csr.middle_rows(first, count), weights.query_kernel, d_queries.middleRows(first, count),
          d_stored.segment(start, block_start[std::size_t(block) + 1] - start)};
      ValuesGradient::can_implement(args);
      ValuesGradient()(args);
    }, &pool);
  }
  if (!coo_to_stored.empty()) {
    gradients.query_values.resize(Index(coo_to_stored.size()));
    for (std::size_t entry = 0; entry < coo_to_stored.size(); ++entry)
      gradients.query_values[Index(entry)] = d_stored[Index(coo_to_stored[entry])];
  }

  // Key and value projections.
  kernel_gradient<Scalar>(inputs.key, d_keys, threads, pool, scratch, gradients.key_kernel);
  bias_gradient<Scalar>(use_bias, d_keys, gradients.key_bias);
  gradients.key.resize(B, S, dims.key_in_dim);
  input_gradient(d_keys, weights.key_kernel,
                 Eigen::Map<RowMatrix<Scalar>>(gradients.key.data(), B * S, dims.key_in_dim),
                 threads, pool);
  kernel_gradient<Scalar>(inputs.value, d_values, threads, pool, scratch, gradients.value_kernel);
  bias_gradient<Scalar>(use_bias, d_values, gradients.value_bias);
  gradients.value.resize(B, S, dims.value_in_dim);
  input_gradient(d_values, weights.value_kernel,
                 Eigen::Map<RowMatrix<Scalar>>(gradients.value.data(), B * S, dims.value_in_dim),
                 threads, pool);
}

// A saved context must be project_context(key, value)'s for these key and value.
template <typename Layer, typename Scalar = typename Layer::ScalarType>
void check_saved_context(const char* where, const Layer& layer, const Inputs<Scalar>& inputs,
                         const ProjectedContext<Scalar>& context) {
  const LayerDims& dims = layer.dims();
  const Index rows = inputs.batch * inputs.key_steps;
  if (context.batch != inputs.batch || context.key_steps != inputs.key_steps ||
      context.keys.rows() != rows || context.keys.cols() != dims.projected_key_width() ||
      context.values.rows() != rows || context.values.cols() != dims.projected_value_width())
    fail<ShapeError>(
        where, "context has batch ", context.batch, ", key_steps ", context.key_steps, ", keys ",
        context.keys.rows(), " x ", context.keys.cols(), ", values ", context.values.rows(), " x ",
        context.values.cols(), "; expected those of project_context(key, value): batch ",
        inputs.batch, ", key_steps ", inputs.key_steps, ", keys ", rows, " x ",
        dims.projected_key_width(), ", values ", rows, " x ", dims.projected_value_width());
}

}  // namespace detail::gradient

// The gradients of loss(Y) for Y = layer.forward(query, key, value, options), given d_output =
// ∂loss/∂Y (B, T, O), into `gradients` (resized; reallocated only when a gradient's size
// changes), working in `workspace`: called again with the same shapes, it allocates nothing and
// starts no threads. Honours every mask, the score strategy, dropout (training, dropout_rate,
// dropout_seed: the forward's mask for the same seed) and num_threads; the result is bitwise the
// same for any thread count. Blocked (t, s) pairs pass no gradient, fully blocked query rows get
// exactly zero, and NaN or Inf in key or value rows that no query attends never reach a
// gradient. Throws what forward throws for bad input (a workspace in use included), and
// ShapeError when d_output is not (B, T, O); `gradients` is untouched then.
// Cost: the flops of about 2.7 forwards on `seed` (2.1 with a context, below): the attention is
// recomputed and each of its products and projections has two gradient products.
template <typename Layer>
void mha_backward(const Layer& layer, const typename Layer::Query& query,
                  const TensorRef3<typename Layer::ScalarType>& key,
                  const TensorRef3<typename Layer::ScalarType>& value,
                  const TensorRef3<typename Layer::ScalarType>& d_output,
                  const AttentionOptions<typename Layer::ScalarType>& options,
                  Workspace<typename Layer::ScalarType>& workspace,
                  MhaGradients<typename Layer::ScalarType>& gradients) {
  namespace grad = detail::gradient;
  constexpr const char* where = "mha_backward";
  const auto inputs = grad::check_backward(where, layer, query, key, value, d_output, options);
  const typename Workspace<typename Layer::ScalarType>::Lease lease(workspace, where);
  auto& buffers = lease.buffers();
  layer.project_checked(key, value, inputs.threads, &buffers.pool, buffers.context);
  grad::backward(layer, query, inputs, buffers.context.keys, buffers.context.values, d_output,
                 options, buffers, gradients);
}

// The same, returning the gradients, with a workspace of its own (allocates and starts its
// threads on every call).
template <typename Layer>
MhaGradients<typename Layer::ScalarType> mha_backward(
    const Layer& layer, const typename Layer::Query& query,
    const TensorRef3<typename Layer::ScalarType>& key,
    const TensorRef3<typename Layer::ScalarType>& value,
    const TensorRef3<typename Layer::ScalarType>& d_output,
    const AttentionOptions<typename Layer::ScalarType>& options = {}) {
  Workspace<typename Layer::ScalarType> workspace;
  MhaGradients<typename Layer::ScalarType> gradients;
  mha_backward(layer, query, key, value, d_output, options, workspace, gradients);
  return gradients;
}

// The same, reusing K and V from `context = layer.project_context(key, value)` (the context the
// forward ran against) instead of projecting key and value again. key and value are still needed:
// the kernels' gradients are keyᵀ·dK and valueᵀ·dV. ShapeError when the context's sizes are not
// those of key and value.
template <typename Layer>
void mha_backward(const Layer& layer, const typename Layer::Query& query,
                  const TensorRef3<typename Layer::ScalarType>& key,
                  const TensorRef3<typename Layer::ScalarType>& value,
                  const ProjectedContext<typename Layer::ScalarType>& context,
                  const TensorRef3<typename Layer::ScalarType>& d_output,
                  const AttentionOptions<typename Layer::ScalarType>& options,
                  Workspace<typename Layer::ScalarType>& workspace,
                  MhaGradients<typename Layer::ScalarType>& gradients) {
  namespace grad = detail::gradient;
  constexpr const char* where = "mha_backward";
  const auto inputs = grad::check_backward(where, layer, query, key, value, d_output, options);
  grad::check_saved_context(where, layer, inputs, context);
  const typename Workspace<typename Layer::ScalarType>::Lease lease(workspace, where);
  grad::backward(layer, query, inputs, context.keys, context.values, d_output, options,
                 lease.buffers(), gradients);
}

template <typename Layer>
MhaGradients<typename Layer::ScalarType> mha_backward(
    const Layer& layer, const typename Layer::Query& query,
    const TensorRef3<typename Layer::ScalarType>& key,
    const TensorRef3<typename Layer::ScalarType>& value,
    const ProjectedContext<typename Layer::ScalarType>& context,
    const TensorRef3<typename Layer::ScalarType>& d_output,
    const AttentionOptions<typename Layer::ScalarType>& options = {}) {
  Workspace<typename Layer::ScalarType> workspace;
  MhaGradients<typename Layer::ScalarType> gradients;
  mha_backward(layer, query, key, value, context, d_output, options, workspace, gradients);
  return gradients;
}

}  // namespace sdmha
