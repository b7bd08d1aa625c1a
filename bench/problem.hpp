// bench/problem.hpp — one workload at one density: its inputs, the sparse and dense layers, the
// dense path's intermediates (the references every case is checked against), and the stages walked
// over the whole problem by the layer's own plan of a forward call (layer_internals.hpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dense_mha.hpp"
#include "layer_internals.hpp"
#include "workloads.hpp"

namespace sdmha_bench {

using Matrix = sdmha::RowMatrix<float>;
using ConstMatrixMap = Eigen::Map<const Matrix>;

// A result agrees with its reference when max |result − reference| ≤ kRelativeTolerance ·
// max |reference|: float32 sums of a few hundred to a few thousand terms, taken in different
// orders by the sparse and dense kernels, differ by ~1e-6 of that scale.
constexpr double kRelativeTolerance = 1e-3;
// With every kernel and every projection's input rounded to bfloat16 (8 significant bits) each
// term x·w of a projection moves by up to 2⁻⁷ of itself; through the attention and the output
// projection the output moves by a few 1e-3 of its scale on these workloads.
constexpr double kBFloat16RelativeTolerance = 1e-2;

inline ConstMatrixMap as_matrix(const Tensor3& tensor) {
  return ConstMatrixMap(tensor.data(), tensor.dimension(0) * tensor.dimension(1),
                        tensor.dimension(2));
}

// Empty when `actual` agrees with `expected`, else what differs and by how much.
inline std::string compare(const char* what, const sdmha::ConstMatrixRef<float>& actual,
                           const sdmha::ConstMatrixRef<float>& expected,
                           double tolerance = kRelativeTolerance) {
  std::ostringstream message;
  if (actual.rows() != expected.rows() || actual.cols() != expected.cols()) {
    message << what << " is " << actual.rows() << " x " << actual.cols() << "; expected "
            << expected.rows() << " x " << expected.cols();
    return message.str();
  }
  const double scale = expected.size() == 0 ? 0.0 : double(expected.cwiseAbs().maxCoeff());
  const double difference =
      expected.size() == 0 ? 0.0 : double((actual - expected).cwiseAbs().maxCoeff());
  if (difference <= tolerance * scale) return {};  // false for NaN, which then fails
  message << what << " disagrees with the dense path: max |difference| = " << difference << " > "
          << tolerance << " * max |reference| = " << tolerance * scale;
  return message.str();
}

using Layer = sdmha::SparseDenseMHA<float>;
using Internals = LayerInternals;
using sdmha::detail::AttentionPlan;
using sdmha::detail::AttentionTile;
using sdmha::detail::RowBlock;

// ---- The layer's own plan of a forward call, walked stage by stage ----
//
// A LayerPlan asks the layer for the plan of one forward call (LayerInternals::plan: the same
// validation, strategy, tiles and worker scratch as forward's) and keeps the Workspace it was
// made in, whose workers and threads every stage case then runs on. Planned once per problem,
// thread count and strategy, outside timing; a timed call only takes the workspace's lease,
// grows nothing (sized by the checked call) and walks the plan's items:
//  - attention items (b, h, query tile, key tile) for the score, softmax and attend stages;
//  - row blocks of kProjectionRowBlock (key, value, output projections) or
//    kQueryProjectionRowBlock (query projection) rows;
// each stage call getting its worker's planned scratch, as the layer gives it.
//
// Timing the stages one by one needs the probabilities stored between them, so the plan asked
// for is the one forward makes when it returns the scores: one key tile of all the keys an item
// may see. Without returned scores, forward runs an online softmax over key tiles of kKeyTile
// instead where S > kKeyTile (long: S = 2048), fusing softmax and attend values; that path has
// no stage-by-stage counterpart here, and the forward/sparse row is the one that times it.
class LayerPlan {
 public:
  LayerPlan(const Layer& layer, const sdmha::SparseQuery<float>& query, Index key_steps,
            int threads, sdmha::ScoreStrategy strategy) {
    options_.num_threads = threads;
    options_.score_strategy = strategy;
    options_.return_attention_scores = true;  // the stored-probabilities plan (see above)
    const Lease lease(workspace_, "bench");
    plan_ = Internals::plan(layer, query, key_steps, options_, sdmha::detail::Pass::forward,
                            lease.buffers());
    if (plan_.strategy != strategy)
      throw std::logic_error(std::string("the layer planned ") + sdmha::to_string(plan_.strategy) +
                             " for " + sdmha::to_string(strategy));
    if (plan_.online_softmax || plan_.key_tile != plan_.key_steps)
      throw std::logic_error(
          "the layer planned key tiles; the stage cases need one key tile per item");
  }
  LayerPlan(const LayerPlan&) = delete;
  LayerPlan& operator=(const LayerPlan&) = delete;

  const AttentionPlan& plan() const { return plan_; }
  const sdmha::AttentionOptions<float>& options() const { return options_; }

  // The mask of an item, as the layer's forward makes it from the call's options.
  sdmha::BatchMask mask(const AttentionTile& item) const {
    return sdmha::detail::item_mask(item, options_, plan_.steps, plan_.key_steps);
  }

  // body(item, scratch) for every attention item of the plan, on the plan's threads.
  template <typename Body>
  void for_attention_items(Body&& body) {
    const Lease lease(workspace_, "bench");
    auto& buffers = lease.buffers();
    const Index items = plan_.attention_items();
    buffers.prepare_workers(plan_.workers(items), plan_.worker_scratch_bytes, plan_.tile_entries,
                            2);
    sdmha::detail::parallel_for(
        items, plan_.threads,
        [&](Index index, int worker) {
          body(plan_.item_tile(index), buffers.workers[std::size_t(worker)].stage.view());
        },
        &buffers.pool);
  }

  // body(block, scratch) for every block of `block_rows` of `rows` rows, on the plan's threads.
  // `stage_bytes`: each worker's scratch, the plan's unless a stage outside the layer needs more.
  template <typename Body>
  void for_row_blocks(Index rows, Index block_rows, Body&& body, std::size_t stage_bytes = 0) {
    const Lease lease(workspace_, "bench");
    auto& buffers = lease.buffers();
    const Index blocks = AttentionPlan::block_count(rows, block_rows);
    buffers.prepare_workers(plan_.workers(blocks),
                            std::max(stage_bytes, plan_.worker_scratch_bytes), 0, 0);
    sdmha::detail::parallel_for(
        blocks, plan_.threads,
        [&](Index index, int worker) {
          body(AttentionPlan::block(index, rows, block_rows),
               buffers.workers[std::size_t(worker)].stage.view());
        },
        &buffers.pool);
  }

  // Whether V_bh is finite, once per (b, h) as the layer's forward finds it (not once per tile),
  // then body(item, scratch, value_is_finite) for every attention item.
  template <typename Body>
  void for_attention_items_with_values(const Matrix& values, Body&& body) {
    const Lease lease(workspace_, "bench");
    auto& buffers = lease.buffers();
    const Index H = plan_.heads(), S = plan_.key_steps, Dv = plan_.dims.value_dim;
    buffers.value_is_finite.assign(static_cast<std::size_t>(plan_.batch * H), 0);
    if (S > 0)
      sdmha::detail::parallel_for(
          plan_.batch * H, plan_.threads,
          [&](Index bh, int) {
            buffers.value_is_finite[std::size_t(bh)] =
                sdmha::detail::all_finite<float>(values.block((bh / H) * S, (bh % H) * Dv, S, Dv));
          },
          &buffers.pool);
    const Index items = plan_.attention_items();
    buffers.prepare_workers(plan_.workers(items), plan_.worker_scratch_bytes, plan_.tile_entries,
                            2);
    sdmha::detail::parallel_for(
        items, plan_.threads,
        [&](Index index, int worker) {
          const AttentionTile item = plan_.item_tile(index);
          body(item, buffers.workers[std::size_t(worker)].stage.view(),
               buffers.value_is_finite[std::size_t(item.batch * H + item.head)] != 0);
        },
        &buffers.pool);
  }

  // Q = X·Wq + bq by the layer's own query projection pass (its blocks, its stage, its scratch).
  void project_query(const Layer& layer, const sdmha::SparseQuery<float>& query,
                     Matrix& projected_query) {
    const Lease lease(workspace_, "bench");
    Internals::project_query(layer, plan_, query, lease.buffers(), projected_query);
  }

 private:
  using Lease = sdmha::Workspace<float>::Lease;
  sdmha::Workspace<float> workspace_;
  sdmha::AttentionOptions<float> options_;
  AttentionPlan plan_;
};

// The plans of one problem at one thread count: project-first (the layer's default tiles, which
// the shared stages walk too) and, where it is timed, sparse_regrouped (one tile of all T rows).
struct StagePlans {
  std::unique_ptr<LayerPlan> project_first, regrouped;
};

// One workload at one density: the inputs, both layers, the dense path's intermediates (the
// references every case is checked against) and the output buffers of the stage cases.
class Problem : public WorkloadInputs {
 public:
  Problem(const WorkloadShape& workload, double query_density)
      : WorkloadInputs(workload, query_density),
        sparse_layer(workload.config(), make_weights()),
        dense_layer(workload.config(), sparse_layer.weights()),
        bfloat16_layer(workload.config(), sparse_layer.shared_weights()),
        flops(flop_counts(workload, query.nonzeros())) {
    bfloat16_layer.set_precision(sdmha::Precision::bfloat16);
    build_references();
  }

  const sdmha::MhaWeights<float>& weights() const { return sparse_layer.weights(); }
  Index rows() const { return shape.batch * shape.steps; }
  float score_scale() const { return float(1.0 / std::sqrt(double(shape.head_dim))); }
  sdmha::TensorRef3<float> dense_query_tensor(const Matrix& dense) const {
    return sdmha::TensorRef3<float>(dense.data(), shape.batch, shape.steps, shape.query_dim);
  }

  // The layer's plans at `threads`, made on first use and kept with the problem.
  StagePlans& plans(int threads) {
    std::unique_ptr<StagePlans>& plans = stage_plans_[threads];
    if (!plans) {
      plans = std::make_unique<StagePlans>();
      plans->project_first = std::make_unique<LayerPlan>(
          sparse_layer, query, shape.key_steps, threads, sdmha::ScoreStrategy::project_first);
      if (regrouped_is_timed(shape, density))
        plans->regrouped = std::make_unique<LayerPlan>(
            sparse_layer, query, shape.key_steps, threads, sdmha::ScoreStrategy::sparse_regrouped);
    }
    return *plans;
  }

  const Layer sparse_layer;
  const sdmha::DenseMHA<float> dense_layer;
  Layer bfloat16_layer;  // the same weights, every kernel read in bfloat16
  const FlopCounts flops;

  // Each forward path keeps its workspace and result between calls, as a serving loop would (a
  // case's checked call starts from fresh ones, so that its peak heap includes them).
  sdmha::Workspace<float> sparse_workspace, regrouped_workspace, dense_workspace,
      bfloat16_workspace;
  sdmha::AttentionResult<float> forward_result;
  // The backward cases keep theirs the same way, as a training loop would.
  sdmha::Workspace<float> backward_workspace;
  sdmha::MhaGradients<float> gradients;
  sdmha::ProjectedContext<float> saved_context;  // K and V as a training forward keeps them

  // The densified query and the dense path's intermediates, one thread.
  Matrix dense_query, projected_query, keys, values, scores, probabilities, heads, output;
  // What the cases write.
  Matrix densified, projected_query_out, keys_out, values_out, scores_out, heads_out, output_out,
      gemm_out;

 private:
  void build_references();
  std::map<int, std::unique_ptr<StagePlans>> stage_plans_;
};

// ---- The stages, over the whole problem, walking the layer's plan (LayerPlan) with the
// layer's own stage objects (stages().score_kernel, stages().softmax, ...). Each stage alone reads
// and writes whole tensors; the layer instead keeps one tile's scores in a per-worker tile buffer
// between the score, softmax and attend stages. The scores of (b, h) are rows (b·H + h)·T … of a
// (B·H·T × S) matrix, the layout of attention_scores. ----

// An attention item's block of a (B·H·T × S) scores matrix.
template <typename MatrixType>
inline auto score_tile(MatrixType& scores, const AttentionPlan& plan, const AttentionTile& item) {
  return scores.block((item.batch * plan.heads() + item.head) * plan.steps + item.query_begin,
                      item.key_begin, item.query_rows, item.key_steps);
}
// Its rows of head h's block of a (B·T × H·D) matrix (Q or the concatenated heads).
template <typename MatrixType>
inline auto query_tile(MatrixType& matrix, const AttentionPlan& plan, const AttentionTile& item,
                       Index width) {
  return matrix.block(item.batch * plan.steps + item.query_begin, item.head * width,
                      item.query_rows, width);
}
// Its key steps of head h's block of a (B·S × H·D) matrix (K or V).
template <typename MatrixType>
inline auto key_tile(MatrixType& matrix, const AttentionPlan& plan, const AttentionTile& item,
                     Index width) {
  return matrix.block(item.batch * plan.key_steps + item.key_begin, item.head * width,
                      item.key_steps, width);
}

// input (rows × E) · kernel + bias → output in the plan's blocks of kProjectionRowBlock rows,
// as the layer's key, value and output projections go.
template <typename Projection>
inline void project_rows(LayerPlan& plan, const Projection& projection,
                         const sdmha::ConstMatrixRef<float>& input, const Matrix& kernel,
                         const sdmha::Vector<float>& bias, Matrix& output) {
  plan.for_row_blocks(input.rows(), sdmha::detail::kProjectionRowBlock,
                      [&](const RowBlock& block, sdmha::StageScratch scratch) {
                        typename Projection::Arguments args{
                            input.middleRows(block.begin, block.rows), kernel, bias,
                            output.middleRows(block.begin, block.rows), scratch};
                        Projection::can_implement(args);
                        projection(args);
                      });
}

// The dense baseline's query projection: DenseProjection of the dense query in blocks of
// kQueryProjectionRowBlock rows, as DenseMHA::forward goes. DenseMHA has no such pass, so
// the scratch of its query stage is sized here from the TileSizes DenseMHA::forward gives it.
inline void dense_query_projection(const Problem& p, LayerPlan& plan, const Matrix& dense_query,
                                   Matrix& output) {
  using Projection = sdmha::DenseMHA<float>::QueryProjection;
  const Projection& projection = p.dense_layer.stages().query_projection;
  sdmha::TileSizes block;
  block.rows = sdmha::detail::kQueryProjectionRowBlock;
  block.input_width = p.shape.query_dim;
  block.output_width = p.shape.heads * p.shape.head_dim;
  const auto& weights = p.weights();
  plan.for_row_blocks(
      dense_query.rows(), sdmha::detail::kQueryProjectionRowBlock,
      [&](const RowBlock& rows, sdmha::StageScratch scratch) {
        Projection::Arguments args{dense_query.middleRows(rows.begin, rows.rows),
                                   weights.query_kernel, weights.query_bias,
                                   output.middleRows(rows.begin, rows.rows), scratch};
        Projection::can_implement(args);
        projection(args);
      },
      sdmha::detail::stage_workspace_size<Projection>(block));
}

// The reference row: Eigen's own CSR × row-major dense product on the same arrays, in the plan's
// blocks of the query projection.
inline void eigen_query_projection(const Problem& p, LayerPlan& plan, Matrix& output) {
  const auto& csr = p.query.csr();
  const Eigen::Map<const Eigen::SparseMatrix<float, Eigen::RowMajor, int>> sparse(
      csr.rows, csr.cols, csr.nonzeros(), csr.row_offsets, csr.column_indices, csr.values);
  const auto& weights = p.weights();
  plan.for_row_blocks(p.rows(), sdmha::detail::kQueryProjectionRowBlock,
                      [&](const RowBlock& rows, sdmha::StageScratch) {
                        auto block = output.middleRows(rows.begin, rows.rows);
                        block.noalias() =
                            sparse.middleRows(rows.begin, rows.rows) * weights.query_kernel;
                        if (weights.query_bias.size() != 0)
                          block.rowwise() += weights.query_bias.transpose();
                      });
}

inline void key_value_projection(const Problem& p, LayerPlan& plan, Matrix& keys, Matrix& values) {
  const auto& projection = p.sparse_layer.stages().context_projection;
  project_rows(plan, projection, as_matrix(p.key), p.weights().key_kernel, p.weights().key_bias,
               keys);
  project_rows(plan, projection, as_matrix(p.value), p.weights().value_kernel,
               p.weights().value_bias, values);
}

inline void project_first_scores(const Problem& p, LayerPlan& plan, const Matrix& projected_query,
                                 const Matrix& keys, Matrix& scores) {
  using Kernel = Layer::ScoreKernel;
  const Kernel& kernel = p.sparse_layer.stages().score_kernel;
  const AttentionPlan& walk = plan.plan();
  const Index D = p.shape.head_dim;
  plan.for_attention_items([&](const AttentionTile& item, sdmha::StageScratch scratch) {
    Kernel::Arguments args{item.position(),
                           query_tile(projected_query, walk, item, D),
                           key_tile(keys, walk, item, D),
                           float(walk.scale),
                           plan.mask(item),
                           score_tile(scores, walk, item),
                           scratch};
    Kernel::can_implement(args);
    kernel(args);
  });
}

// On the regrouped plan: one tile of all T steps per (b, h), M_bh shared by all of b's rows.
inline void regrouped_scores(const Problem& p, LayerPlan& plan, const Matrix& keys,
                             Matrix& scores) {
  using Kernel = Layer::ScoreKernel;
  const Kernel& kernel = p.sparse_layer.stages().score_kernel;
  const AttentionPlan& walk = plan.plan();
  const Index D = p.shape.head_dim;
  const auto& weights = p.weights();
  const sdmha::Vector<float> no_bias;
  plan.for_attention_items([&](const AttentionTile& item, sdmha::StageScratch scratch) {
    const sdmha::ConstVectorRef<float> bias =
        weights.query_bias.size() != 0
            ? sdmha::ConstVectorRef<float>(weights.query_bias.segment(item.head * D, D))
            : sdmha::ConstVectorRef<float>(no_bias);
    Kernel::SparseArguments args{
        item.position(),
        p.query.csr().middle_rows(item.batch * walk.steps + item.query_begin, item.query_rows),
        weights.query_kernel.middleCols(item.head * D, D),
        bias,
        key_tile(keys, walk, item, D),
        float(walk.scale),
        plan.mask(item),
        score_tile(scores, walk, item),
        scratch};
    Kernel::can_implement(args);
    kernel(args);
  });
}

inline void softmax(const Problem& p, LayerPlan& plan, Matrix& scores) {
  using Softmax = Layer::Softmax;
  const Softmax& stage = p.sparse_layer.stages().softmax;
  plan.for_attention_items([&](const AttentionTile& item, sdmha::StageScratch scratch) {
    Softmax::Arguments args{item.position(), score_tile(scores, plan.plan(), item), scratch,
                            plan.plan().fully_masked_rows};
    Softmax::can_implement(args);
    stage(args);
  });
}

inline void attend_values(const Problem& p, LayerPlan& plan, const Matrix& probabilities,
                          const Matrix& values, Matrix& heads) {
  using Attend = Layer::AttendValues;
  const Attend& stage = p.sparse_layer.stages().attend_values;
  const AttentionPlan& walk = plan.plan();
  const Index D = p.shape.head_dim;
  plan.for_attention_items_with_values(
      values, [&](const AttentionTile& item, sdmha::StageScratch scratch, bool value_is_finite) {
        Attend::Arguments args{item.position(),
                               score_tile(probabilities, walk, item),
                               key_tile(values, walk, item, D),
                               query_tile(heads, walk, item, D),
                               value_is_finite,
                               scratch};
        Attend::can_implement(args);
        stage(args);
      });
}

// Plain Eigen products of the score and attend stages' sizes, item by item of the same plan over
// the same memory: the yardstick for those stages' GFLOP/s (no scale, no mask, no finiteness
// check, Eigen's own packing memory).
inline void plain_score_gemms(const Problem& p, LayerPlan& plan, Matrix& scores) {
  const AttentionPlan& walk = plan.plan();
  const Index D = p.shape.head_dim;
  plan.for_attention_items([&](const AttentionTile& item, sdmha::StageScratch) {
    score_tile(scores, walk, item).noalias() =
        query_tile(p.projected_query, walk, item, D) * key_tile(p.keys, walk, item, D).transpose();
  });
}
inline void plain_attend_gemms(const Problem& p, LayerPlan& plan, Matrix& heads) {
  const AttentionPlan& walk = plan.plan();
  const Index D = p.shape.head_dim;
  plan.for_attention_items([&](const AttentionTile& item, sdmha::StageScratch) {
    query_tile(heads, walk, item, D).noalias() =
        score_tile(p.probabilities, walk, item) * key_tile(p.values, walk, item, D);
  });
}

inline void output_projection(const Problem& p, LayerPlan& plan, const Matrix& heads,
                              Matrix& output) {
  project_rows(plan, p.sparse_layer.stages().output_projection, heads, p.weights().output_kernel,
               p.weights().output_bias, output);
}

inline void Problem::build_references() {
  const Index B = shape.batch, T = shape.steps, S = shape.key_steps, H = shape.heads;
  const Index D = shape.head_dim, hd = H * D;
  if (query.csr().row_nonzeros != nullptr)
    throw std::logic_error("the bench expects a compressed CSR query");
  dense_query = query.to_dense();
  projected_query.resize(rows(), hd);
  keys.resize(B * S, hd);
  values.resize(B * S, hd);
  scores.resize(B * H * T, S);
  heads.resize(rows(), hd);
  output.resize(rows(), shape.output_dim);
  LayerPlan& plan = *plans(1).project_first;
  const AttentionPlan& walk = plan.plan();
  if (walk.attention_items() == 0)
    throw std::logic_error("the layer's forward plan has no attention items");
  dense_query_projection(*this, plan, dense_query, projected_query);
  key_value_projection(*this, plan, keys, values);
  project_first_scores(*this, plan, projected_query, keys, scores);
  probabilities = scores;
  softmax(*this, plan, probabilities);
  attend_values(*this, plan, probabilities, values, heads);
  output_projection(*this, plan, heads, output);

  // The stages as wired here must be the layer: its own forward has to agree.
  sdmha::AttentionOptions<float> options;
  options.num_threads = 1;
  const Tensor3 layer_output =
      dense_layer.forward(dense_query_tensor(dense_query), {key, value}, options).output;
  const std::string disagreement =
      compare("DenseMHA::forward vs the bench's stage chain", as_matrix(layer_output), output);
  if (!disagreement.empty()) throw std::runtime_error(disagreement);

  projected_query_out.resize(rows(), hd);
  keys_out.resize(B * S, hd);
  values_out.resize(B * S, hd);
  scores_out.resize(B * H * T, S);
  heads_out.resize(rows(), hd);
  output_out.resize(rows(), shape.output_dim);
}

}  // namespace sdmha_bench
