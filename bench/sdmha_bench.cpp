// sdmha_bench — the sparse-query layer against the dense baseline (densify the query, then
// DenseMHA), whole and stage by stage, on the canonical workloads of bench/workloads.md.
//
//   sdmha_bench [--quick] [--benchmark_filter=...]       a Google Benchmark binary: every
//                                                       workload × density × threads × case
//   sdmha_bench --summary [--quick] [--json FILE] [--repetitions N] [--workload NAME]...
//                                                       the comparison table (medians of N
//                                                       interleaved runs), optionally all numbers
//                                                       as JSON for bench/plot.py; a memory-only
//                                                       workload (long16k) runs when named
//   sdmha_bench --scaling [--quick] [--repetitions N] [--workload NAME]...
//                                                       the scaling model (bench/scaling/
//                                                       scaling_model.hpp): forward and training
//                                                       step timed at 1 and 2 threads, predicted
//                                                       for 2, 16, 32 and 64 from one-thread item
//                                                       times; seed 1 %, bow 1 %, long 5 %
//
// Every case builds its inputs once outside timing, runs once untimed to measure the peak heap
// bytes of one call and to check its result against the dense path's (relative tolerance), and
// only then is timed. A disagreement skips the case with an error and makes the exit code 1.
// The stage cases walk the layer's own plan of a forward call (bench/layer_internals.hpp: its
// attention items, row blocks, threads and per-worker scratch), never a split of their own.
#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "allocation_counter.hpp"
#include "layer_internals.hpp"
#include "scaling/scaling_model.hpp"
#include "workloads.hpp"

#ifndef SDMHA_BENCH_COMPILE_FLAGS
#define SDMHA_BENCH_COMPILE_FLAGS "(unknown)"
#endif

namespace sdmha_bench {

using Matrix = sdmha::RowMatrix<float>;
using ConstMatrixMap = Eigen::Map<const Matrix>;
// Keys in the order they are written (bench/plot.py looks them up by name; the order is for a
// reader and for diffs between runs).
using Json = nlohmann::ordered_json;

// A result agrees with its reference when max |result − reference| ≤ kRelativeTolerance ·
// max |reference|: float32 sums of a few hundred to a few thousand terms, taken in different
// orders by the sparse and dense kernels, differ by ~1e-6 of that scale.
constexpr double kRelativeTolerance = 1e-3;
// With every kernel and every projection's input rounded to bfloat16 (8 significant bits) each
// term x·w of a projection moves by up to 2⁻⁷ of itself; through the attention and the output
// projection the output moves by a few 1e-3 of its scale on these workloads.
constexpr double kBFloat16RelativeTolerance = 1e-2;

ConstMatrixMap as_matrix(const Tensor3& tensor) {
  return ConstMatrixMap(tensor.data(), tensor.dimension(0) * tensor.dimension(1),
                        tensor.dimension(2));
}

// Empty when `actual` agrees with `expected`, else what differs and by how much.
std::string compare(const char* what, const sdmha::ConstMatrixRef<float>& actual,
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
using sdmha::detail::AttentionItem;
using sdmha::detail::AttentionPlan;
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
  sdmha::BatchMask mask(const AttentionItem& item) const {
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
          body(plan_.attention_item(index), buffers.workers[std::size_t(worker)].stage.view());
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
          const AttentionItem item = plan_.attention_item(index);
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
class Problem {
 public:
  Problem(const WorkloadShape& workload, double query_density)
      : shape(workload),
        density(query_density),
        query(make_sparse_query(workload, query_density, kQuerySeed)),
        key(make_dense_input(workload.batch, workload.key_steps, workload.context_dim, kKeySeed)),
        value(
            make_dense_input(workload.batch, workload.key_steps, workload.context_dim, kValueSeed)),
        sparse_layer(workload.config(),
                     sdmha::MhaWeights<float>::glorot_uniform(workload.config(), workload.query_dim,
                                                              workload.context_dim,
                                                              workload.context_dim, kWeightSeed)),
        dense_layer(workload.config(), sparse_layer.weights()),
        bfloat16_layer(workload.config(), sparse_layer.shared_weights()),
        flops(flop_counts(workload, query.nonzeros())),
        d_output(make_dense_input(workload.batch, workload.steps, workload.output_dim,
                                  kOutputGradientSeed)) {
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

  const WorkloadShape shape;
  const double density;
  const sdmha::SparseQuery<float> query;
  const Tensor3 key, value;
  const Layer sparse_layer;
  const sdmha::DenseMHA<float> dense_layer;
  Layer bfloat16_layer;  // the same weights, every kernel read in bfloat16
  const FlopCounts flops;
  // ∂loss/∂output for the backward case.
  const Tensor3 d_output;

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
// layer's own stage objects (score_kernel(), softmax(), ...). Each stage alone reads and writes
// whole tensors; the layer instead keeps one tile's scores in a
// per-worker tile buffer between the score, softmax and attend stages. The scores of (b, h)
// are rows (b·H + h)·T … of a (B·H·T × S) matrix, the layout of attention_scores. ----

// An attention item's block of a (B·H·T × S) scores matrix.
template <typename MatrixType>
auto score_tile(MatrixType& scores, const AttentionPlan& plan, const AttentionItem& item) {
  return scores.block((item.batch * plan.heads() + item.head) * plan.steps + item.query_begin,
                      item.key_begin, item.query_rows, item.key_steps);
}
// Its rows of head h's block of a (B·T × H·D) matrix (Q or the concatenated heads).
template <typename MatrixType>
auto query_tile(MatrixType& matrix, const AttentionPlan& plan, const AttentionItem& item,
                Index width) {
  return matrix.block(item.batch * plan.steps + item.query_begin, item.head * width,
                      item.query_rows, width);
}
// Its key steps of head h's block of a (B·S × H·D) matrix (K or V).
template <typename MatrixType>
auto key_tile(MatrixType& matrix, const AttentionPlan& plan, const AttentionItem& item,
              Index width) {
  return matrix.block(item.batch * plan.key_steps + item.key_begin, item.head * width,
                      item.key_steps, width);
}

// input (rows × E) · kernel + bias → output in the plan's blocks of kProjectionRowBlock rows,
// as the layer's key, value and output projections go.
template <typename Projection>
void project_rows(LayerPlan& plan, const Projection& projection,
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
// the scratch of its query stage is sized here from the TileSizes DenseMHA::forward gives it
// (and its query_projection() has no const accessor: a default stage object stands in).
void dense_query_projection(const Problem& p, LayerPlan& plan, const Matrix& dense_query,
                            Matrix& output) {
  using Projection = sdmha::DenseMHA<float>::QueryProjection;
  const Projection projection;
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
void eigen_query_projection(const Problem& p, LayerPlan& plan, Matrix& output) {
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

void key_value_projection(const Problem& p, LayerPlan& plan, Matrix& keys, Matrix& values) {
  const auto& projection = p.sparse_layer.context_projection();
  project_rows(plan, projection, as_matrix(p.key), p.weights().key_kernel, p.weights().key_bias,
               keys);
  project_rows(plan, projection, as_matrix(p.value), p.weights().value_kernel,
               p.weights().value_bias, values);
}

void project_first_scores(const Problem& p, LayerPlan& plan, const Matrix& projected_query,
                          const Matrix& keys, Matrix& scores) {
  using Kernel = Layer::ScoreKernel;
  const Kernel& kernel = p.sparse_layer.score_kernel();
  const AttentionPlan& walk = plan.plan();
  const Index D = p.shape.head_dim;
  plan.for_attention_items([&](const AttentionItem& item, sdmha::StageScratch scratch) {
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
void regrouped_scores(const Problem& p, LayerPlan& plan, const Matrix& keys, Matrix& scores) {
  using Kernel = Layer::ScoreKernel;
  const Kernel& kernel = p.sparse_layer.score_kernel();
  const AttentionPlan& walk = plan.plan();
  const Index D = p.shape.head_dim;
  const auto& weights = p.weights();
  const sdmha::Vector<float> no_bias;
  plan.for_attention_items([&](const AttentionItem& item, sdmha::StageScratch scratch) {
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

void softmax(const Problem& p, LayerPlan& plan, Matrix& scores) {
  using Softmax = Layer::Softmax;
  const Softmax& stage = p.sparse_layer.softmax();
  plan.for_attention_items([&](const AttentionItem& item, sdmha::StageScratch scratch) {
    Softmax::Arguments args{item.position(), score_tile(scores, plan.plan(), item), scratch,
                            plan.plan().fully_masked_rows};
    Softmax::can_implement(args);
    stage(args);
  });
}

void attend_values(const Problem& p, LayerPlan& plan, const Matrix& probabilities,
                   const Matrix& values, Matrix& heads) {
  using Attend = Layer::AttendValues;
  const Attend& stage = p.sparse_layer.attend_values();
  const AttentionPlan& walk = plan.plan();
  const Index D = p.shape.head_dim;
  plan.for_attention_items_with_values(
      values, [&](const AttentionItem& item, sdmha::StageScratch scratch, bool value_is_finite) {
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
void plain_score_gemms(const Problem& p, LayerPlan& plan, Matrix& scores) {
  const AttentionPlan& walk = plan.plan();
  const Index D = p.shape.head_dim;
  plan.for_attention_items([&](const AttentionItem& item, sdmha::StageScratch) {
    score_tile(scores, walk, item).noalias() =
        query_tile(p.projected_query, walk, item, D) * key_tile(p.keys, walk, item, D).transpose();
  });
}
void plain_attend_gemms(const Problem& p, LayerPlan& plan, Matrix& heads) {
  const AttentionPlan& walk = plan.plan();
  const Index D = p.shape.head_dim;
  plan.for_attention_items([&](const AttentionItem& item, sdmha::StageScratch) {
    query_tile(heads, walk, item, D).noalias() =
        score_tile(p.probabilities, walk, item) * key_tile(p.values, walk, item, D);
  });
}

void output_projection(const Problem& p, LayerPlan& plan, const Matrix& heads, Matrix& output) {
  project_rows(plan, p.sparse_layer.output_projection(), heads, p.weights().output_kernel,
               p.weights().output_bias, output);
}

void Problem::build_references() {
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
      dense_layer.forward(dense_query_tensor(dense_query), key, value, options).output;
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

// ---- Cases: one timed thing each ----

struct Case {
  std::string stage;       // forward, densify, query_projection, key_value_projection, scores, ...
  std::string variant;     // sparse, sparse_regrouped, dense, eigen_csr, or shared (same for both)
  double flops = 0;        // useful floating-point work of one call, bench/workloads.md's counting
  double query_bytes = 0;  // the query form the case reads (CSR or dense); 0 when none
  double items = 0;        // softmax: score entries per call
  double bytes = 0;        // densify: bytes written per call
  std::function<void()> prepare;       // untimed, before the checked call
  std::function<void()> run;           // one call: what is timed
  std::function<std::string()> check;  // after a call: empty when the result agrees

  std::string name() const { return stage + "/" + variant; }
};

sdmha::AttentionOptions<float> options_for(int threads, sdmha::ScoreStrategy strategy) {
  sdmha::AttentionOptions<float> result;
  result.num_threads = threads;
  result.score_strategy = strategy;
  return result;
}

// The whole layer's forward cases, in the order of case_names(). "dense" is what a user without
// sdmha runs: densify, then the dense layer.
void add_forward_cases(std::vector<Case>& cases, Problem& p, int threads) {
  const FlopCounts& f = p.flops;
  const double csr = csr_bytes(p.query), dense = dense_query_bytes(p.shape);
  auto options = [threads](sdmha::ScoreStrategy strategy) {
    return options_for(threads, strategy);
  };
  auto check_forward = [&p] {
    return compare("forward output", as_matrix(p.forward_result.output), p.output);
  };
  auto fresh = [&p](sdmha::Workspace<float>& workspace) {
    return [&p, &workspace] {
      workspace = sdmha::Workspace<float>();
      p.forward_result = sdmha::AttentionResult<float>();
    };
  };
  cases.push_back({"forward", "sparse", f.sparse_total(), csr, 0, 0, fresh(p.sparse_workspace),
                   [&p, o = options(sdmha::ScoreStrategy::project_first)] {
                     p.sparse_layer.forward(p.query, p.key, p.value, o, p.sparse_workspace,
                                            p.forward_result);
                   },
                   check_forward});
  // The call most users make: no Workspace given, a new result each call.
  // Its workspace is the layer's own cache, emptied before the checked call.
  cases.push_back({"forward", "sparse_plain", f.sparse_total(), csr, 0, 0,
                   [&p] {
                     p.sparse_layer.release_workspace_cache();
                     p.forward_result = sdmha::AttentionResult<float>();
                   },
                   [&p, o = options(sdmha::ScoreStrategy::project_first)] {
                     p.forward_result = p.sparse_layer.forward(p.query, p.key, p.value, o);
                   },
                   check_forward});
  if (regrouped_is_timed(p.shape, p.density))
    cases.push_back({"forward", "sparse_regrouped", f.sparse_total(), csr, 0, 0,
                     fresh(p.regrouped_workspace),
                     [&p, o = options(sdmha::ScoreStrategy::sparse_regrouped)] {
                       p.sparse_layer.forward(p.query, p.key, p.value, o, p.regrouped_workspace,
                                              p.forward_result);
                     },
                     check_forward});
  cases.push_back({"forward", "sparse_bf16", f.sparse_total(), csr, 0, 0,
                   fresh(p.bfloat16_workspace),
                   [&p, o = options(sdmha::ScoreStrategy::project_first)] {
                     p.bfloat16_layer.forward(p.query, p.key, p.value, o, p.bfloat16_workspace,
                                              p.forward_result);
                   },
                   [&p] {
                     return compare("bfloat16 forward output", as_matrix(p.forward_result.output),
                                    p.output, kBFloat16RelativeTolerance);
                   }});
  cases.push_back({"forward", "dense", f.dense_total(), dense, 0, 0, fresh(p.dense_workspace),
                   [&p, o = options(sdmha::ScoreStrategy::project_first)] {
                     const Matrix densified = p.query.to_dense();
                     p.dense_layer.forward(p.dense_query_tensor(densified), p.key, p.value, o,
                                           p.dense_workspace, p.forward_result);
                   },
                   check_forward});
}

// The training pass (it recomputes the forward it needs), with and without the forward's
// ProjectedContext. Checked by an identity of the gradients: ∂loss/∂bo = Σ over rows of ∂loss/∂Y,
// and everything finite.
void add_backward_cases(std::vector<Case>& cases, Problem& p, int threads) {
  const double csr = csr_bytes(p.query);
  const sdmha::AttentionOptions<float> o = options_for(threads, sdmha::ScoreStrategy::automatic);
  auto check_backward = [&p] {
    const auto& g = p.gradients;
    if (!g.query_kernel.allFinite() || !g.key_kernel.allFinite() || !g.value_kernel.allFinite() ||
        !g.output_kernel.allFinite() || !g.query_values.allFinite())
      return std::string("backward: a gradient is not finite");
    const Matrix expected = as_matrix(p.d_output).colwise().sum();
    return compare("backward output bias gradient", g.output_bias.transpose(), expected);
  };
  auto fresh_backward = [&p] {
    p.backward_workspace = sdmha::Workspace<float>();
    p.gradients = sdmha::MhaGradients<float>();
  };
  cases.push_back({"backward", "sparse", 0, csr, 0, 0, fresh_backward,
                   [&p, o] {
                     p.sparse_layer.backward(p.query, p.key, p.value, p.d_output, o,
                                             p.backward_workspace, p.gradients);
                   },
                   check_backward});
  // The same reusing the K and V that the training step's forward projected (its
  // ProjectedContext), as a training loop does: the backward then skips their recomputation.
  cases.push_back({"backward", "sparse_saved_context", 0, csr, 0, 0,
                   [&p, threads, fresh_backward] {
                     p.saved_context = p.sparse_layer.project_context(p.key, p.value, threads);
                     fresh_backward();
                   },
                   [&p, o] {
                     p.sparse_layer.backward(p.query, p.key, p.value, p.saved_context, p.d_output,
                                             o, p.backward_workspace, p.gradients);
                   },
                   check_backward});
}

// Stage by stage, each walking the layer's own plan at this thread count (LayerPlan), and the
// plain Eigen GEMMs beside them.
void add_stage_cases(std::vector<Case>& cases, Problem& p, int threads) {
  const FlopCounts& f = p.flops;
  const double csr = csr_bytes(p.query), dense = dense_query_bytes(p.shape);
  const bool regrouped = regrouped_is_timed(p.shape, p.density);
  StagePlans& plans = p.plans(threads);
  LayerPlan* plan = plans.project_first.get();
  LayerPlan* regrouped_plan = plans.regrouped.get();
  cases.push_back({"densify", "dense", 0, csr, 0, dense, nullptr,
                   [&p] { p.densified = p.query.to_dense(); },
                   [&p] { return compare("densified query", p.densified, p.dense_query); }});
  auto check_projected_query = [&p] {
    return compare("projected query", p.projected_query_out, p.projected_query);
  };
  cases.push_back(
      {"query_projection", "sparse", f.query_projection_sparse, csr, 0, 0, nullptr,
       [&p, plan] { plan->project_query(p.sparse_layer, p.query, p.projected_query_out); },
       check_projected_query});
  cases.push_back(
      {"query_projection", "dense", f.query_projection_dense, dense, 0, 0, nullptr,
       [&p, plan] { dense_query_projection(p, *plan, p.dense_query, p.projected_query_out); },
       check_projected_query});
  cases.push_back({"query_projection", "eigen_csr", f.query_projection_sparse, csr, 0, 0, nullptr,
                   [&p, plan] { eigen_query_projection(p, *plan, p.projected_query_out); },
                   check_projected_query});
  cases.push_back({"key_value_projection", "shared", f.key_value_projection, 0, 0, 0, nullptr,
                   [&p, plan] { key_value_projection(p, *plan, p.keys_out, p.values_out); },
                   [&p] {
                     std::string error = compare("projected key", p.keys_out, p.keys);
                     return error.empty() ? compare("projected value", p.values_out, p.values)
                                          : error;
                   }});
  auto check_scores = [&p] { return compare("scores", p.scores_out, p.scores); };
  cases.push_back(
      {"scores", "shared", f.scores, 0, 0, 0, nullptr,
       [&p, plan] { project_first_scores(p, *plan, p.projected_query, p.keys, p.scores_out); },
       check_scores});
  // The regrouped kernel reads the CSR rows and the query kernel: it does the query
  // projection's job too, so its useful work is both stages'.
  if (regrouped) {
    if (regrouped_plan == nullptr)
      throw std::logic_error("no regrouped plan for a timed regrouped case");
    cases.push_back(
        {"scores", "sparse_regrouped", f.query_projection_sparse + f.scores, csr, 0, 0, nullptr,
         [&p, regrouped_plan] { regrouped_scores(p, *regrouped_plan, p.keys, p.scores_out); },
         check_scores});
  }
  // In place: the checked call turns a copy of the scores into probabilities; the timed calls
  // that follow rerun it on its own output, which costs the same.
  cases.push_back({"softmax", "shared", 0, 0, double(p.scores.size()), 0,
                   [&p] { p.scores_out = p.scores; },
                   [&p, plan] { softmax(p, *plan, p.scores_out); },
                   [&p] { return compare("probabilities", p.scores_out, p.probabilities); }});
  cases.push_back({"attend_values", "shared", f.attend_values, 0, 0, 0, nullptr,
                   [&p, plan] { attend_values(p, *plan, p.probabilities, p.values, p.heads_out); },
                   [&p] { return compare("attended heads", p.heads_out, p.heads); }});
  cases.push_back({"output_projection", "shared", f.output_projection, 0, 0, 0, nullptr,
                   [&p, plan] { output_projection(p, *plan, p.heads, p.output_out); },
                   [&p] { return compare("output", p.output_out, p.output); }});
  // The yardstick of the dense stages: one plain Eigen GEMM of the key projection's size,
  // (B·S × Ek)·(Ek × H·Dk) in a single call on one thread (whatever the row's thread count), as
  // Eigen runs it by itself.
  cases.push_back({"gemm", "eigen", f.key_value_projection / 2, 0, 0, 0, nullptr,
                   [&p] { p.gemm_out.noalias() = as_matrix(p.key) * p.weights().key_kernel; },
                   [&p] {
                     const Matrix expected = p.keys.rowwise() - p.weights().key_bias.transpose();
                     return compare("plain GEMM", p.gemm_out, expected);
                   }});
  cases.push_back(
      {"gemm", "eigen_scores_size", f.scores, 0, 0, 0, nullptr,
       [&p, plan] { plain_score_gemms(p, *plan, p.scores_out); },
       [&p] { return compare("plain score GEMMs", p.scores_out * p.score_scale(), p.scores); }});
  cases.push_back({"gemm", "eigen_attend_size", f.attend_values, 0, 0, 0, nullptr,
                   [&p, plan] { plain_attend_gemms(p, *plan, p.heads_out); },
                   [&p] { return compare("plain attend GEMMs", p.heads_out, p.heads); }});
}

// Every case of one problem at one thread count, in the order of case_names(). The regrouped
// cases are left out where regrouped_is_timed() says they would cost more than the dense layer.
std::vector<Case> make_cases(Problem& p, int threads) {
  std::vector<Case> cases;
  add_forward_cases(cases, p, threads);
  add_backward_cases(cases, p, threads);
  add_stage_cases(cases, p, threads);
  return cases;
}

// The names of make_cases' cases, in its order, known before any input is built.
std::vector<std::string> case_names(const WorkloadShape& shape, double density) {
  const bool regrouped = regrouped_is_timed(shape, density);
  std::vector<std::string> names = {"forward/sparse", "forward/sparse_plain"};
  if (regrouped) names.push_back("forward/sparse_regrouped");
  for (const char* name :
       {"forward/sparse_bf16", "forward/dense", "backward/sparse", "backward/sparse_saved_context",
        "densify/dense", "query_projection/sparse", "query_projection/dense",
        "query_projection/eigen_csr", "key_value_projection/shared", "scores/shared"})
    names.push_back(name);
  if (regrouped) names.push_back("scores/sparse_regrouped");
  for (const char* name : {"softmax/shared", "attend_values/shared", "output_projection/shared"})
    names.push_back(name);
  for (const char* name : {"gemm/eigen", "gemm/eigen_scores_size", "gemm/eigen_attend_size"})
    names.push_back(name);
  return names;
}

// The checked call of a case: the peak heap bytes of one call and the check's verdict.
struct CheckedCall {
  std::int64_t peak_bytes = -1;  // -1 when the heap is not counted
  std::string error;
};

CheckedCall checked_call(const Case& c) {
  CheckedCall result;
  try {
    if (c.prepare) c.prepare();
    const std::int64_t peak = peak_heap_bytes(c.run);
    if (AllocationCounter::counts_malloc()) result.peak_bytes = peak;
    result.error = c.check();
  } catch (const std::exception& error) {
    result.error = std::string("threw: ") + error.what();
  }
  return result;
}

// ---- The heap counter's own check ----

struct AllocationCheck {
  bool counted = false;  // the heap is counted and the check passed
  std::int64_t eigen_matrix_bytes = 0, std_vector_bytes = 0;
  std::string problem;
};

// A 1000 × 1000 float matrix (Eigen: aligned_malloc → std::malloc) and a vector of 10⁶ floats
// (operator new) must each be seen as 4·10⁶ bytes, plus at most the allocator's rounding, and
// the books must balance once both are gone.
AllocationCheck allocation_counting_check() {
  AllocationCheck check;
  if (!AllocationCounter::counts_malloc()) {
    check.problem = "malloc is not wrapped on this platform; memory is not counted";
    return check;
  }
  constexpr std::int64_t expected = 1000 * 1000 * 4, slack = 64 * 1024;
  const std::int64_t live_before = AllocationCounter::live();
  check.eigen_matrix_bytes = peak_heap_bytes([] {
    Eigen::MatrixXf matrix(1000, 1000);
    matrix.setConstant(1.0f);
    benchmark::DoNotOptimize(matrix.data());
    benchmark::ClobberMemory();
  });
  check.std_vector_bytes = peak_heap_bytes([] {
    std::vector<float> vector(1000 * 1000, 1.0f);
    benchmark::DoNotOptimize(vector.data());
    benchmark::ClobberMemory();
  });
  const std::int64_t leaked = AllocationCounter::live() - live_before;
  auto plausible = [&](std::int64_t bytes) {
    return bytes >= expected && bytes <= expected + slack;
  };
  if (!plausible(check.eigen_matrix_bytes) || !plausible(check.std_vector_bytes) || leaked != 0) {
    std::ostringstream message;
    message << "heap counting is off: Eigen::MatrixXf(1000, 1000) counted as "
            << check.eigen_matrix_bytes << " B, std::vector<float>(1e6) as "
            << check.std_vector_bytes << " B (expected " << expected << " to " << expected + slack
            << "), " << leaked << " B unbalanced";
    check.problem = message.str();
    return check;
  }
  check.counted = true;
  return check;
}

// ---- The machine ----

struct Machine {
  std::string cpu, compiler, flags, eigen;
  unsigned cores = 0;
  std::string line() const {
    std::ostringstream text;
    text << "machine: " << cpu << " | " << cores << " cores | " << compiler << " | " << flags
         << " | " << eigen;
    return text.str();
  }
};

Machine describe_machine() {
  Machine machine;
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      machine.cpu = line.substr(line.find(':') + 2);
      break;
    }
  }
  if (machine.cpu.empty()) machine.cpu = "unknown CPU";
  machine.cores = std::thread::hardware_concurrency();
#if defined(__clang__)
  machine.compiler = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  machine.compiler = std::string("g++ ") + __VERSION__;
#else
  machine.compiler = __VERSION__;
#endif
  machine.flags = SDMHA_BENCH_COMPILE_FLAGS;
  std::ostringstream eigen;
  eigen << "Eigen " << EIGEN_WORLD_VERSION << "." << EIGEN_MAJOR_VERSION << "."
        << EIGEN_MINOR_VERSION << " (" << Eigen::SimdInstructionSetsInUse() << ")";
  machine.eigen = eigen.str();
  return machine;
}

// The first three fields of /proc/loadavg, or "unknown".
std::string load_average() {
  std::ifstream file("/proc/loadavg");
  std::string one, five, fifteen;
  if (!(file >> one >> five >> fifteen)) return "unknown";
  return one + ", " + five + ", " + fifteen;
}

// ---- Google Benchmark mode ----

bool any_failure = false;

Problem& cached_problem(const WorkloadShape& shape, double density) {
  // One problem at a time (the long workload's references take ~1 GB); benchmarks run in
  // registration order, so each problem is built once.
  static std::unique_ptr<Problem> problem;
  if (!problem || problem->shape.name != shape.name || problem->density != density) {
    problem.reset();
    problem = std::make_unique<Problem>(shape, density);
  }
  return *problem;
}

void run_benchmark(benchmark::State& state, const std::string& name, const WorkloadShape& shape,
                   double density, int threads, std::size_t case_index) {
  static std::map<std::string, CheckedCall> checked;  // by benchmark name: once per process
  try {
    Problem& p = cached_problem(shape, density);
    std::vector<Case> cases = make_cases(p, threads);
    const Case& c = cases.at(case_index);
    if (c.name() != case_names(shape, density).at(case_index))
      throw std::logic_error("make_cases and case_names disagree at " + c.name());
    auto found = checked.find(name);
    if (found == checked.end()) found = checked.emplace(name, checked_call(c)).first;
    const CheckedCall& call = found->second;
    if (!call.error.empty()) {
      any_failure = true;
      state.SkipWithError(call.error.c_str());
      return;
    }
    if (c.prepare) c.prepare();
    for (auto _ : state) c.run();

    using benchmark::Counter;
    state.counters["nnz"] = double(p.query.nonzeros());
    state.counters["density"] = p.density;
    state.counters["threads"] = threads;
    state.counters["flops"] = Counter(c.flops, Counter::kIsIterationInvariantRate);
    if (call.peak_bytes >= 0)
      state.counters["peak_bytes"] =
          Counter(double(call.peak_bytes), Counter::kDefaults, Counter::kIs1024);
    if (c.query_bytes > 0)
      state.counters["query_bytes"] = Counter(c.query_bytes, Counter::kDefaults, Counter::kIs1024);
    if (c.items > 0) state.SetItemsProcessed(std::int64_t(c.items) * state.iterations());
    if (c.bytes > 0) state.SetBytesProcessed(std::int64_t(c.bytes) * state.iterations());
  } catch (const std::exception& error) {
    any_failure = true;
    state.SkipWithError((std::string("setup failed: ") + error.what()).c_str());
  }
}

std::string density_text(double density) {
  std::ostringstream text;
  text << density;
  return text.str();
}

void register_benchmarks(const std::vector<WorkloadShape>& shapes) {
  for (const WorkloadShape& shape : shapes)
    for (double density : shape.densities)
      for (int threads : {1, 2}) {
        const std::vector<std::string> names = case_names(shape, density);
        for (std::size_t index = 0; index < names.size(); ++index) {
          const std::string name = shape.name + "/d:" + density_text(density) +
                                   "/t:" + std::to_string(threads) + "/" + names[index];
          benchmark::RegisterBenchmark(
              name.c_str(),
              [name, shape, density, threads, index](benchmark::State& state) {
                run_benchmark(state, name, shape, density, threads, index);
              })
              ->UseRealTime()
              ->Unit(benchmark::kMillisecond);
        }
      }
}

// ---- Summary mode ----

struct CaseResult {
  std::string name;
  double flops = 0;
  std::vector<double> milliseconds;
  double median_ms = 0;
  std::int64_t peak_bytes = -1;
  std::int64_t steady_allocations = -1;  // heap blocks taken by one more call after the timed ones
  std::string error;
};

struct ConfigResult {
  WorkloadShape shape;
  double density = 0;
  Index nonzeros = 0, nonzeros_per_row = 0;
  int threads = 1;
  FlopCounts flops;
  double csr_bytes = 0, dense_bytes = 0;
  std::vector<CaseResult> cases;

  // nullptr for a case that was not run (the regrouped ones, see regrouped_is_timed).
  const CaseResult* find(const std::string& name) const {
    for (const CaseResult& c : cases)
      if (c.name == name) return &c;
    return nullptr;
  }
  const CaseResult& get(const std::string& name) const {
    if (const CaseResult* c = find(name)) return *c;
    throw std::logic_error("no case " + name);
  }
  // NaN when the case was not run or failed.
  double ms(const std::string& name) const {
    const CaseResult* c = find(name);
    return c == nullptr || !c->error.empty() ? std::nan("") : c->median_ms;
  }
  std::int64_t peak_bytes(const std::string& name) const {
    const CaseResult* c = find(name);
    return c == nullptr ? -1 : c->peak_bytes;
  }
  double speedup() const { return ms("forward/dense") / ms("forward/sparse"); }
  std::int64_t steady_allocations(const std::string& name) const {
    const CaseResult* c = find(name);
    return c == nullptr ? -1 : c->steady_allocations;
  }
  // The most that one more backward call takes, with or without the saved context.
  std::int64_t steady_backward_allocations() const {
    return std::max(steady_allocations("backward/sparse"),
                    steady_allocations("backward/sparse_saved_context"));
  }
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n == 0 ? 0.0 : n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

double milliseconds_of(const std::function<void()>& call) {
  const auto start = std::chrono::steady_clock::now();
  call();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// Every case checked once, then timed `repetitions` times, interleaved (case 1, 2, …, 1, 2, …)
// so that a burst of load from elsewhere on the machine hits sparse and dense alike. Each timed
// call follows an untimed call of the same case: on a virtual machine the first touch of memory
// after another case frees a large block (the dense cases' densified query, 134 MB on bow) can
// cost more than the call itself, whichever case it lands on, and the steady state is what a
// server sees.
ConfigResult measure(Problem& p, int threads, int repetitions) {
  ConfigResult result;
  result.shape = p.shape;
  result.density = p.density;
  result.nonzeros = p.query.nonzeros();
  result.nonzeros_per_row = p.shape.nonzeros_per_row(p.density);
  result.threads = threads;
  result.flops = p.flops;
  result.csr_bytes = csr_bytes(p.query);
  result.dense_bytes = dense_query_bytes(p.shape);
  const std::vector<Case> cases = make_cases(p, threads);
  for (const Case& c : cases) {
    const CheckedCall call = checked_call(c);
    CaseResult r;
    r.name = c.name();
    r.flops = c.flops;
    r.peak_bytes = call.peak_bytes;
    r.error = call.error;
    result.cases.push_back(r);
  }
  for (int repetition = 0; repetition < repetitions; ++repetition)
    for (std::size_t i = 0; i < cases.size(); ++i)
      if (result.cases[i].error.empty()) {
        cases[i].run();
        result.cases[i].milliseconds.push_back(milliseconds_of(cases[i].run));
      }
  for (CaseResult& r : result.cases) r.median_ms = median(r.milliseconds);
  // The steady state: what one more call allocates once the timed calls have warmed it up.
  if (AllocationCounter::counts_malloc())
    for (std::size_t i = 0; i < cases.size(); ++i)
      if (result.cases[i].error.empty()) {
        const std::int64_t before = AllocationCounter::allocations();
        cases[i].run();
        result.cases[i].steady_allocations = AllocationCounter::allocations() - before;
      }
  return result;
}

std::string format(const char* pattern, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, pattern, value);
  return buffer;
}

std::string megabytes(std::int64_t bytes) {
  return bytes < 0 ? "n/a" : format("%.2f", double(bytes) / 1e6);
}

// A time in ms, or "-" for a case that was not run.
std::string milliseconds_text(double ms) { return std::isnan(ms) ? "-" : format("%.2f", ms); }

// The stages alone: time (and GFLOP/s) of each, walking the layer's own plan of a forward call.
void print_stage_table(std::ostream& out, const std::vector<ConfigResult>& results) {
  char line[512];
  out << "\nstages alone, ms (GFLOP/s), each walking the layer's own plan of a forward call:\n";
  const char* stage_header =
      "%-5s %7s %3s | %8s %14s %14s %14s | %14s %14s %14s | %7s %14s %14s | %14s %14s %14s\n";
  std::snprintf(line, sizeof line, stage_header, "work", "density", "thr", "densify",
                "q-proj sparse", "q-proj dense", "q-proj eigen", "k+v proj", "scores",
                "scores regroup", "softmax", "attend values", "out proj", "GEMM k-proj",
                "GEMM scores", "GEMM attend");
  out << line;
  for (const ConfigResult& r : results) {
    auto cell = [&](const char* name) {
      const double ms = r.ms(name);
      const CaseResult* c = r.find(name);
      if (std::isnan(ms) || c->flops <= 0) return milliseconds_text(ms);
      char text[64];
      std::snprintf(text, sizeof text, "%.2f (%.0f)", ms, c->flops / ms * 1e-6);
      return std::string(text);
    };
    std::snprintf(
        line, sizeof line, stage_header, r.shape.name.c_str(), format("%g", r.density).c_str(),
        std::to_string(r.threads).c_str(), cell("densify/dense").c_str(),
        cell("query_projection/sparse").c_str(), cell("query_projection/dense").c_str(),
        cell("query_projection/eigen_csr").c_str(), cell("key_value_projection/shared").c_str(),
        cell("scores/shared").c_str(), cell("scores/sparse_regrouped").c_str(),
        cell("softmax/shared").c_str(), cell("attend_values/shared").c_str(),
        cell("output_projection/shared").c_str(), cell("gemm/eigen").c_str(),
        cell("gemm/eigen_scores_size").c_str(), cell("gemm/eigen_attend_size").c_str());
    out << line;
  }
  out << "(scores regroup includes the query projection, which it replaces; softmax and densify do "
         "no\n"
         "counted FLOPs; k+v, scores, softmax, attend values and out proj are the same code for "
         "both\n"
         "paths. GEMM k-proj = one plain Eigen `C.noalias() = A * B` of the key projection's size "
         "on one\n"
         "thread; GEMM scores / attend = plain Eigen products of the score and attend stages' tile "
         "sizes,\n"
         "tile by tile: the yardsticks of the dense stages' GFLOP/s. Scores, softmax and attend "
         "values\n"
         "walk the plan forward makes when it returns the scores, probabilities stored; where S > "
         "kKeyTile\n"
         "(long) forward itself runs an online softmax over key tiles instead, timed only "
         "whole.)\n";
}

void print_summary(std::ostream& out, const std::vector<ConfigResult>& results,
                   const Machine& machine, const AllocationCheck& allocation, int repetitions,
                   bool quick, const std::string& load_before, const std::string& load_after) {
  out << "sdmha_bench --summary"
      << (quick ? " --quick (reduced B and T: not the canonical shapes)" : "")
      << ": float32, median of " << repetitions
      << " interleaved runs per figure, each after an untimed call of its own\n";
  out << machine.line() << "\n";
  out << "load average (1, 5, 15 min) before: " << load_before << "; after: " << load_after
      << " (other work on the machine slows both paths; compare ratios, not times)\n";
  if (allocation.counted)
    out << "heap counting verified: Eigen::MatrixXf(1000, 1000) -> "
        << allocation.eigen_matrix_bytes << " B, std::vector<float>(1e6) -> "
        << allocation.std_vector_bytes << " B\n";
  else
    out << "heap counting unavailable: " << allocation.problem << "\n";
  out << "\n";

  char line[512];
  const char* header =
      "%-5s %7s %3s %7s | %9s %9s %9s %9s | %8s %9s | %7s %6s | %8s %8s %6s | %8s %8s | %7s | "
      "%9s %7s %9s %7s\n";
  std::snprintf(line, sizeof line, header, "work", "density", "thr", "nnz/row", "sparse", "plain",
                "regroup", "bf16", "densify", "dense", "speedup", "ideal", "peak MB", "peak MB",
                "mem", "query MB", "query MB", "allocs", "backward", "bwd/", "bwd ctx", "ctx/");
  out << line;
  std::snprintf(line, sizeof line, header, "", "", "", "", "ms", "ms", "ms", "ms", "ms", "ms", "",
                "", "sparse", "dense", "ratio", "CSR", "dense", "fwd/bwd", "ms", "fwd", "ms",
                "fwd");
  out << line;
  for (const ConfigResult& r : results) {
    const std::int64_t sparse_peak = r.peak_bytes("forward/sparse");
    const std::int64_t dense_peak = r.peak_bytes("forward/dense");
    const std::string ratio = sparse_peak > 0 && dense_peak >= 0
                                  ? format("%.1fx", double(dense_peak) / double(sparse_peak))
                                  : "n/a";
    const std::int64_t forward_allocations = r.steady_allocations("forward/sparse");
    const std::int64_t backward_allocations = r.steady_backward_allocations();
    auto count_text = [](std::int64_t count) {
      return count < 0 ? std::string("n/a") : std::to_string(count);
    };
    const std::string allocations =
        count_text(forward_allocations) + "/" + count_text(backward_allocations);
    const double backward_ms = r.ms("backward/sparse");
    const double context_backward_ms = r.ms("backward/sparse_saved_context");
    std::snprintf(line, sizeof line,
                  "%-5s %7g %3d %7ld | %9s %9s %9s %9s | %8s %9s | %6.2fx %6.2f | %8s %8s %6s | "
                  "%8.2f %8.2f | %7s | %9s %6.2fx %9s %6.2fx\n",
                  r.shape.name.c_str(), r.density, r.threads, long(r.nonzeros_per_row),
                  milliseconds_text(r.ms("forward/sparse")).c_str(),
                  milliseconds_text(r.ms("forward/sparse_plain")).c_str(),
                  milliseconds_text(r.ms("forward/sparse_regrouped")).c_str(),
                  milliseconds_text(r.ms("forward/sparse_bf16")).c_str(),
                  milliseconds_text(r.ms("densify/dense")).c_str(),
                  milliseconds_text(r.ms("forward/dense")).c_str(), r.speedup(),
                  r.flops.ideal_speedup(), megabytes(sparse_peak).c_str(),
                  megabytes(dense_peak).c_str(), ratio.c_str(), r.csr_bytes / 1e6,
                  r.dense_bytes / 1e6, allocations.c_str(), milliseconds_text(backward_ms).c_str(),
                  backward_ms / r.ms("forward/sparse"),
                  milliseconds_text(context_backward_ms).c_str(),
                  context_backward_ms / r.ms("forward/sparse"));
    out << line;
  }
  out << "\nsparse = SparseDenseMHA::forward (project_first) with a Workspace and result kept "
         "between\n"
         "calls; plain = the plain forward(query, key, value, options): a new result per call, "
         "the\n"
         "layer's own cached workspace; regroup = the same as sparse with sparse_regrouped\n"
         "scores (\"-\": not timed where it costs more FLOPs than the dense layer); bf16 = the\n"
         "same as sparse with set_precision(bfloat16); dense =\n"
         "SparseQuery::to_dense + DenseMHA::forward, densify included (and shown alone); speedup "
         "=\n"
         "dense / sparse; ideal = dense FLOP / sparse FLOP (bench/workloads.md), the speedup at "
         "equal\n"
         "efficiency; peak MB = most heap bytes one call has live at once, inputs excluded (the "
         "dense\n"
         "call's include its densified query; the first call with a fresh Workspace); query MB = "
         "the\n"
         "query's own bytes (CSR: values, column indices, row offsets); allocs fwd/bwd = heap "
         "blocks "
         "one\n"
         "more sparse forward / backward call (the more of both backward rows) takes after the "
         "timed\n"
         "ones (the steady state); backward =\n"
         "SparseDenseMHA::backward with a Workspace and MhaGradients kept (automatic strategy;\n"
         "it recomputes the forward, K and V included); bwd ctx = the same given the\n"
         "ProjectedContext that the training step's forward made (only Q, P and A are\n"
         "recomputed); bwd/fwd and ctx/fwd = those / sparse.\n";
  print_stage_table(out, results);
}

// JSON has no NaN or infinity: a figure that was not measured (NaN) is written as null.
Json json_number(double value) { return std::isfinite(value) ? Json(value) : Json(nullptr); }

// A count held in a double (FLOPs, bytes): written as an integer when it is one (below 2^53),
// as a number otherwise, null when not finite.
Json json_count(double value) {
  const bool whole =
      std::isfinite(value) && value == std::floor(value) && std::fabs(value) < 0x1p53;
  return whole ? Json(static_cast<std::int64_t>(value)) : json_number(value);
}

// A case's median in ms, or null where it was not timed.
Json json_ms(const ConfigResult& r, const char* name) { return json_number(r.ms(name)); }

// A byte count, or null where the heap was not counted (negative).
Json json_bytes(std::int64_t bytes) { return bytes < 0 ? Json(nullptr) : Json(bytes); }

// One run's stage times per path; the shared stages are timed once and listed on every path.
Json json_stages(const ConfigResult& r) {
  auto ms = [&](const char* name) { return json_ms(r, name); };
  // A path's own first stages, then the shared ones in pipeline order.
  auto path = [&](Json stages, bool with_scores) {
    stages["key_value_projection"] = ms("key_value_projection/shared");
    if (with_scores) stages["scores"] = ms("scores/shared");
    stages["softmax"] = ms("softmax/shared");
    stages["attend_values"] = ms("attend_values/shared");
    stages["output_projection"] = ms("output_projection/shared");
    return stages;
  };
  Json stages;
  stages["sparse"] = path({{"query_projection", ms("query_projection/sparse")}}, true);
  stages["sparse_regrouped"] =
      path({{"scores_with_query_projection", ms("scores/sparse_regrouped")}}, false);
  stages["dense"] = path(
      {{"densify", ms("densify/dense")}, {"query_projection", ms("query_projection/dense")}}, true);
  stages["reference"] = {{"eigen_csr_query_projection", ms("query_projection/eigen_csr")}};
  return stages;
}

Json json_flops(const ConfigResult& r) {
  const auto& f = r.flops;
  return {{"query_projection_dense", json_count(f.query_projection_dense)},
          {"query_projection_sparse", json_count(f.query_projection_sparse)},
          {"key_value_projection", json_count(f.key_value_projection)},
          {"scores", json_count(f.scores)},
          {"attend_values", json_count(f.attend_values)},
          {"output_projection", json_count(f.output_projection)},
          {"dense_total", json_count(f.dense_total())},
          {"sparse_total", json_count(f.sparse_total())},
          {"regrouped_scores_executed_estimate",
           json_count(regrouped_score_flops(r.shape, r.density))}};
}

Json json_cases(const ConfigResult& r) {
  Json cases = Json::array();
  for (const CaseResult& c : r.cases)
    cases.push_back(
        {{"name", c.name},
         {"median_ms", json_number(c.median_ms)},
         {"flops", json_count(c.flops)},
         {"gflops_per_s", json_number(c.median_ms > 0 ? c.flops / c.median_ms * 1e-6 : 0.0)},
         {"peak_bytes", json_bytes(c.peak_bytes)},
         {"steady_allocations", c.steady_allocations},
         {"error", c.error}});
  return cases;
}

// One configuration (workload, density, thread count); bench/plot.py reads some of it.
Json json_run(const ConfigResult& r) {
  const WorkloadShape& w = r.shape;
  auto ms = [&](const char* name) { return json_ms(r, name); };
  Json run;
  run["workload"] = w.name;
  run["shape"] = {{"B", w.batch},        {"T", w.steps}, {"Eq", w.query_dim}, {"S", w.key_steps},
                  {"Ek", w.context_dim}, {"H", w.heads}, {"Dk", w.head_dim},  {"O", w.output_dim}};
  run["density"] = json_number(r.density);
  run["nonzeros_per_row"] = r.nonzeros_per_row;
  run["nnz"] = r.nonzeros;
  run["threads"] = r.threads;
  run["flops"] = json_flops(r);
  run["speedup"] = json_number(r.speedup());
  run["ideal_speedup"] = json_number(r.flops.ideal_speedup());
  run["forward_ms"] = {{"sparse", ms("forward/sparse")},
                       {"sparse_plain", ms("forward/sparse_plain")},
                       {"sparse_regrouped", ms("forward/sparse_regrouped")},
                       {"sparse_bfloat16", ms("forward/sparse_bf16")},
                       {"dense", ms("forward/dense")},
                       {"densify", ms("densify/dense")}};
  run["backward_ms"] = ms("backward/sparse");
  run["backward_saved_context_ms"] = ms("backward/sparse_saved_context");
  run["steady_state_allocations_per_call"] = r.steady_allocations("forward/sparse");
  run["steady_state_allocations_per_backward_call"] = r.steady_backward_allocations();
  run["stages_ms"] = json_stages(r);
  run["memory_bytes"] = {
      {"sparse_peak", json_bytes(r.peak_bytes("forward/sparse"))},
      {"sparse_regrouped_peak", json_bytes(r.peak_bytes("forward/sparse_regrouped"))},
      {"dense_peak", json_bytes(r.peak_bytes("forward/dense"))},
      {"query_csr", json_count(r.csr_bytes)},
      {"query_dense", json_count(r.dense_bytes)}};
  run["cases"] = json_cases(r);
  return run;
}

void write_json(const std::string& path, const std::vector<ConfigResult>& results,
                const Machine& machine, int repetitions, bool quick, const std::string& load_before,
                const std::string& load_after) {
  Json document;
  document["machine"] = {{"cpu", machine.cpu},           {"cores", machine.cores},
                         {"compiler", machine.compiler}, {"flags", machine.flags},
                         {"eigen", machine.eigen},       {"line", machine.line()}};
  document["load_average_before"] = load_before;
  document["load_average_after"] = load_after;
  document["quick"] = quick;
  document["repetitions"] = repetitions;
  document["statistic"] = "median";
  document["runs"] = Json::array();
  for (const ConfigResult& r : results) document["runs"].push_back(json_run(r));
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path);
  // Text the bench collected (the CPU's name, error messages) may not be valid UTF-8: replaced.
  out << document.dump(2, ' ', false, Json::error_handler_t::replace) << "\n";
  if (!out) throw std::runtime_error("failed writing " + path);
}

// ---- Memory-only workloads (memory_workloads()) ----

struct MemoryResult {
  WorkloadShape shape;
  double density = 0;
  int threads = 1;
  std::int64_t sparse_peak = -1, dense_peak = -1;  // bytes; -1 when the heap is not counted
  double sparse_ms = 0, dense_ms = 0;              // that one call each, fresh workspace
  std::string error;
  // K and V of B·S key steps projected whole, the bytes that streaming them avoids holding.
  double whole_context_bytes() const {
    return double(shape.batch) * double(shape.key_steps) * 2.0 * double(shape.heads) *
           double(shape.head_dim) * double(sizeof(float));
  }
};

// One forward of each layer from a fresh workspace and result (the dense one densifying its
// query, as forward/dense does): their peak heap bytes and times, and the sparse output checked
// against the dense one.
MemoryResult measure_memory(const WorkloadShape& shape, double density, int threads) {
  MemoryResult result;
  result.shape = shape;
  result.density = density;
  result.threads = threads;
  try {
    const sdmha::SparseQuery<float> query = make_sparse_query(shape, density, kQuerySeed);
    const Tensor3 key = make_dense_input(shape.batch, shape.key_steps, shape.context_dim, kKeySeed);
    const Tensor3 value =
        make_dense_input(shape.batch, shape.key_steps, shape.context_dim, kValueSeed);
    const Layer sparse_layer(shape.config(), sdmha::MhaWeights<float>::glorot_uniform(
                                                 shape.config(), shape.query_dim, shape.context_dim,
                                                 shape.context_dim, kWeightSeed));
    const sdmha::DenseMHA<float> dense_layer(shape.config(), sparse_layer.weights());
    sdmha::AttentionOptions<float> options;
    options.num_threads = threads;
    options.score_strategy = sdmha::ScoreStrategy::project_first;
    sdmha::AttentionResult<float> sparse, dense;
    auto sparse_call = [&] {
      sdmha::Workspace<float> workspace;
      sparse_layer.forward(query, key, value, options, workspace, sparse);
    };
    auto dense_call = [&] {
      sdmha::Workspace<float> workspace;
      const Matrix densified = query.to_dense();
      dense_layer.forward(
          sdmha::TensorRef3<float>(densified.data(), shape.batch, shape.steps, shape.query_dim),
          key, value, options, workspace, dense);
    };
    result.sparse_ms = milliseconds_of([&] { result.sparse_peak = peak_heap_bytes(sparse_call); });
    result.dense_ms = milliseconds_of([&] { result.dense_peak = peak_heap_bytes(dense_call); });
    if (!AllocationCounter::counts_malloc()) result.sparse_peak = result.dense_peak = -1;
    result.error = compare("forward output", as_matrix(sparse.output), as_matrix(dense.output));
  } catch (const std::exception& error) {
    result.error = std::string("threw: ") + error.what();
  }
  return result;
}

void print_memory(std::ostream& out, const std::vector<MemoryResult>& results) {
  if (results.empty()) return;
  out << "\nmemory-only workloads: one forward from a fresh Workspace and result (sparse = "
         "SparseDenseMHA project_first; dense = densify + DenseMHA), checked against each other; "
         "K+V whole = what K and V projected whole would take:\n";
  char header[256];
  std::snprintf(header, sizeof header, "%-9s %7s %3s %-18s | %14s %7s | %13s %7s | %12s\n", "work",
                "density", "thr", "(B, T, S)", "sparse peak MB", "ms", "dense peak MB", "ms",
                "K+V whole MB");
  out << header;
  for (const MemoryResult& r : results) {
    char sizes[64], line[256];
    std::snprintf(sizes, sizeof sizes, "(%ld, %ld, %ld)", long(r.shape.batch), long(r.shape.steps),
                  long(r.shape.key_steps));
    std::snprintf(line, sizeof line, "%-9s %7.2f %3d %-18s | %14s %7.0f | %13s %7.0f | %12.1f",
                  r.shape.name.c_str(), r.density, r.threads, sizes,
                  megabytes(r.sparse_peak).c_str(), r.sparse_ms, megabytes(r.dense_peak).c_str(),
                  r.dense_ms, r.whole_context_bytes() / 1e6);
    out << line << (r.error.empty() ? "" : "  FAILED: " + r.error) << "\n";
  }
}

int run_summary(const std::vector<WorkloadShape>& shapes,
                const std::vector<WorkloadShape>& memory_shapes, int repetitions, bool quick,
                const std::string& json_path) {
  const Machine machine = describe_machine();
  const AllocationCheck allocation = allocation_counting_check();
  bool failed = AllocationCounter::counts_malloc() && !allocation.counted;
  const std::string load_before = load_average();
  std::vector<ConfigResult> results;
  const auto start = std::chrono::steady_clock::now();
  for (const WorkloadShape& shape : shapes) {
    for (double density : shape.densities) {
      std::cerr << shape.name << " density " << density << ": building inputs and references\n";
      std::unique_ptr<Problem> problem;
      try {
        problem = std::make_unique<Problem>(shape, density);
      } catch (const std::exception& error) {
        std::cerr << "FAILED " << shape.name << " density " << density << ": " << error.what()
                  << "\n";
        failed = true;
        continue;
      }
      for (int threads : {1, 2}) {
        results.push_back(measure(*problem, threads, repetitions));
        for (const CaseResult& c : results.back().cases) {
          if (c.error.empty()) continue;
          std::cerr << "FAILED " << shape.name << "/d:" << density << "/t:" << threads << "/"
                    << c.name << ": " << c.error << "\n";
          failed = true;
        }
        std::cerr << "  threads " << threads << " done, "
                  << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()
                  << " s so far\n";
      }
    }
  }
  std::vector<MemoryResult> memory;
  for (const WorkloadShape& shape : memory_shapes)
    for (double density : shape.densities)
      for (int threads : {1, 2}) {
        std::cerr << shape.name << " density " << density << " threads " << threads
                  << ": memory only\n";
        memory.push_back(measure_memory(shape, density, threads));
        if (memory.back().error.empty()) continue;
        std::cerr << "FAILED " << shape.name << "/d:" << density << "/t:" << threads
                  << "/memory: " << memory.back().error << "\n";
        failed = true;
      }
  const std::string load_after = load_average();
  print_summary(std::cout, results, machine, allocation, repetitions, quick, load_before,
                load_after);
  print_memory(std::cout, memory);
  if (!allocation.counted) std::cerr << "warning: " << allocation.problem << "\n";
  if (!json_path.empty())
    write_json(json_path, results, machine, repetitions, quick, load_before, load_after);
  if (failed) std::cout << "\nFAILED: see the errors above (stderr)\n";
  return failed ? 1 : 0;
}

// Keeps the workloads named by --workload (all of `shapes` when none is named; of
// `memory_shapes` only those named). False, with a message, when a name is neither.
bool select_workloads(const std::vector<std::string>& names, std::vector<WorkloadShape>& shapes,
                      std::vector<WorkloadShape>& memory_shapes) {
  auto named = [&](const WorkloadShape& w) {
    return std::find(names.begin(), names.end(), w.name) != names.end();
  };
  for (const std::string& name : names) {
    auto has_name = [&](const WorkloadShape& w) { return w.name == name; };
    if (std::none_of(shapes.begin(), shapes.end(), has_name) &&
        std::none_of(memory_shapes.begin(), memory_shapes.end(), has_name)) {
      std::cerr << "sdmha_bench: unknown workload " << name << " (expected one of";
      for (const WorkloadShape& w : shapes) std::cerr << " " << w.name;
      for (const WorkloadShape& w : memory_shapes) std::cerr << " " << w.name;
      std::cerr << ")\n";
      return false;
    }
  }
  if (!names.empty())
    shapes.erase(std::remove_if(shapes.begin(), shapes.end(),
                                [&](const WorkloadShape& w) { return !named(w); }),
                 shapes.end());
  memory_shapes.erase(std::remove_if(memory_shapes.begin(), memory_shapes.end(),
                                     [&](const WorkloadShape& w) { return !named(w); }),
                      memory_shapes.end());
  return true;
}

// `--scaling`: the scaling model on the canonical (or --quick) workloads named by --workload.
int run_scaling(const std::vector<WorkloadShape>& shapes, const std::vector<char*>& passed_on,
                int repetitions, const std::string& json_path, bool summary) {
  if (passed_on.size() > 1 || !json_path.empty() || summary) {
    std::cerr << "sdmha_bench --scaling: unknown argument "
              << (passed_on.size() > 1 ? passed_on[1]
                  : summary            ? "--summary"
                                       : "--json")
              << " (expected --quick, --repetitions N, --workload NAME)\n";
    return 2;
  }
  scaling::ScalingSettings settings;
  if (repetitions > 0) settings.repetitions = repetitions;
  std::cout << describe_machine().line() << "\nload average before: " << load_average() << "\n";
  const auto start = std::chrono::steady_clock::now();
  int status = 1;
  try {
    status = scaling::run_scaling_model(shapes, settings, std::cout);
  } catch (const std::exception& error) {
    std::cerr << "sdmha_bench --scaling: " << error.what() << "\n";
  }
  std::cout << "\nwhole run: "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()
            << " s; load average after: " << load_average() << "\n";
  return status;
}

}  // namespace sdmha_bench

int main(int argc, char** argv) {
  using namespace sdmha_bench;
  bool summary = false, quick = false, scaling = false;
  std::string json_path;
  int repetitions = 0;
  std::vector<std::string> workload_names;   // --workload: only these (all when empty)
  std::vector<char*> passed_on = {argv[0]};  // what Google Benchmark gets
  for (int i = 1; i < argc; ++i) {
    const std::string argument = argv[i];
    if (argument == "--summary") {
      summary = true;
    } else if (argument == "--scaling") {
      scaling = true;
    } else if (argument == "--quick") {
      quick = true;
    } else if (argument == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (argument.rfind("--json=", 0) == 0) {
      json_path = argument.substr(7);
    } else if (argument == "--repetitions" && i + 1 < argc) {
      repetitions = std::atoi(argv[++i]);
    } else if (argument.rfind("--repetitions=", 0) == 0) {
      repetitions = std::atoi(argument.c_str() + 14);
    } else if (argument == "--workload" && i + 1 < argc) {
      workload_names.push_back(argv[++i]);
    } else if (argument.rfind("--workload=", 0) == 0) {
      workload_names.push_back(argument.substr(11));
    } else {
      passed_on.push_back(argv[i]);
    }
  }
  std::vector<WorkloadShape> shapes = quick ? quick_workloads() : canonical_workloads();
  // Memory-only workloads run when named (--summary only), never by default.
  std::vector<WorkloadShape> memory_shapes = memory_workloads();
  if (!select_workloads(workload_names, shapes, memory_shapes)) return 2;

  if (scaling) return run_scaling(shapes, passed_on, repetitions, json_path, summary);
  if (summary) {
    if (passed_on.size() > 1) {
      std::cerr << "sdmha_bench --summary: unknown argument " << passed_on[1]
                << " (expected --quick, --json FILE, --repetitions N, --workload NAME)\n";
      return 2;
    }
    if (repetitions <= 0) repetitions = quick ? 3 : 5;
    try {
      return run_summary(shapes, memory_shapes, repetitions, quick, json_path);
    } catch (const std::exception& error) {
      std::cerr << "sdmha_bench: " << error.what() << "\n";
      return 1;
    }
  }
  if (!json_path.empty() || repetitions != 0 || !workload_names.empty()) {
    std::cerr << "sdmha_bench: --json, --repetitions and --workload go with --summary; Google "
                 "Benchmark's own are "
                 "--benchmark_out=FILE and --benchmark_repetitions=N\n";
    return 2;
  }

  const AllocationCheck allocation = allocation_counting_check();
  if (!allocation.counted) {
    std::cerr << (AllocationCounter::counts_malloc() ? "error: " : "warning: ")
              << allocation.problem << "\n";
    if (AllocationCounter::counts_malloc()) return 1;
  }
  const Machine machine = describe_machine();
  benchmark::AddCustomContext("sdmha_machine", machine.line());
  register_benchmarks(shapes);
  int benchmark_argc = int(passed_on.size());
  benchmark::Initialize(&benchmark_argc, passed_on.data());
  if (benchmark::ReportUnrecognizedArguments(benchmark_argc, passed_on.data())) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return any_failure ? 1 : 0;
}
