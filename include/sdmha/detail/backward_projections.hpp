// sdmha/detail/backward_projections.hpp — the projections' backward: the gradients of the
// output, key and value projections (dense) and of the sparse query projection, each in fixed
// row blocks, weight tiles or column panels.
//
//   math:  d_input = d_output·Wᵀ,  dW = inputᵀ·d_output,  db = 1ᵀ·d_output;  for the query,
//          dWq = Xᵀ·dQ and dX = dQ·Wqᵀ at X's stored positions (then in from_coo's entry order)
//   pre:   a validated, planned call; d_output (dY, dQ, dK or dV) formed in the call's buffers
//   cost:  O(rows·E·width) per dense product; O(nnz(X)·H·Dk) for each of dWq and dX
//
// Each block, tile or panel is one work item summing its entries in one order: no sum depends on
// the thread count.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "sdmha/config.hpp"
#include "sdmha/detail/attention_plan.hpp"
#include "sdmha/detail/csr_dense_product.hpp"
#include "sdmha/detail/finite.hpp"
#include "sdmha/detail/parallel.hpp"
#include "sdmha/detail/scratch.hpp"
#include "sdmha/gradients.hpp"
#include "sdmha/workspace.hpp"

namespace sdmha::detail {

// The projections' part of detail::Backward<Layer>: static functions over a projection stage,
// the plan and the call's buffers (the query's through the layer's public query_projection()).
template <typename Layer>
struct BackwardProjections {
  using Scalar = typename Layer::ScalarType;
  using Query = typename Layer::Query;
  using QueryProjection = typename Layer::QueryProjection;
  using Buffers = CallBuffers<Scalar>;

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

  // dW, db and, where `input_wanted`, d_input of the key or the value projection (else d_input
  // is left empty).
  template <typename Projection>
  static void context_gradients(const AttentionPlan& plan, const Projection& projection,
                                const ConstMatrixRef<Scalar>& input,
                                const RowMatrix<Scalar>& kernel,
                                const RowMatrix<Scalar>& d_projected, bool use_bias,
                                bool input_wanted, Buffers& buffers, RowMatrix<Scalar>& d_kernel,
                                Vector<Scalar>& d_bias,
                                Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& d_input) {
    kernel_gradient(plan, projection, input, d_projected, buffers, d_kernel);
    bias_gradient(plan, use_bias, d_projected, d_bias, buffers);
    if (!input_wanted) {
      d_input.resize(0, 0, 0);
      return;
    }
    d_input.resize(plan.batch, plan.key_steps, kernel.rows());
    input_gradient(
        plan, projection, d_projected, kernel,
        Eigen::Map<RowMatrix<Scalar>>(d_input.data(), plan.batch * plan.key_steps, kernel.rows()),
        buffers);
  }

  // ---- the sparse query projection ---------------------------------------------------------

  // dWq and, where `values_wanted`, dX (else gradients.query_values is left empty): by feature
  // over X's CSC when Wq is beyond L2 (bow), else by rows; then dX in from_coo's entry order
  // when the query came from COO.
  static constexpr Index kEntryBlock = Index(1) << 14;  // COO entries per item of the reorder
  static void query_gradients(const Layer& layer, const AttentionPlan& plan, const Query& query,
                              bool values_wanted, Buffers& buffers,
                              MhaGradients<Scalar>& gradients) {
    BackwardBuffers<Scalar>& scratch = buffers.backward;
    const auto& coo_to_stored = query.coo_to_stored();
    Vector<Scalar>& d_stored = coo_to_stored.empty() ? gradients.query_values : scratch.d_stored;
    d_stored.resize(values_wanted ? query.csr().nonzeros() : 0);
    Vector<Scalar>* values = values_wanted ? &d_stored : nullptr;
    gradients.query_kernel.resize(plan.dims.query_dim, plan.dims.projected_key_width());
    if (query_gradients_by_feature(query.csr(), plan.dims.projected_key_width()))
      query_gradients_by_features(layer, plan, query, buffers, values, gradients.query_kernel);
    else
      query_gradients_by_rows(layer, plan, query, buffers, values, gradients.query_kernel);
    if (!values_wanted) {
      gradients.query_values.resize(0);
    } else if (!coo_to_stored.empty()) {
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

  // dWq, and dX into `d_stored` where it is given.
  static void query_gradients_by_features(const Layer& layer, const AttentionPlan& plan,
                                          const Query& query, Buffers& buffers,
                                          Vector<Scalar>* d_stored, RowMatrix<Scalar>& d_kernel) {
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
          layer.stages().query_projection.backward(kernel_args);
          if (d_stored == nullptr) return;
          typename QueryProjection::ValuesGradientArguments values_args{
              csr,       layer.weights().query_kernel, d_queries, *d_stored, &groups, block.begin,
              block.rows};
          QueryProjection::can_implement(values_args);
          layer.stages().query_projection.backward(values_args);
        },
        &buffers.pool, "query gradients by feature");
  }

  // By rows: dWq in fixed column panels of kQueryKernelPanel (each reads all of X's CSR, so
  // narrow panels cost only its rereading), dX in the projection's row blocks. Without query
  // rows (B·T = 0) dWq is 0; the panels would be offsets on dQ's null data.
  static constexpr Index kQueryKernelPanel = 64;
  static void query_gradients_by_rows(const Layer& layer, const AttentionPlan& plan,
                                      const Query& query, Buffers& buffers,
                                      Vector<Scalar>* d_stored, RowMatrix<Scalar>& d_kernel) {
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
          layer.stages().query_projection.backward(args);
        },
        &buffers.pool, "query kernel gradient");
    if (d_stored != nullptr) query_values_by_rows(layer, plan, query, buffers, *d_stored);
  }

  // dX in the projection's row blocks.
  static void query_values_by_rows(const Layer& layer, const AttentionPlan& plan,
                                   const Query& query, Buffers& buffers, Vector<Scalar>& d_stored) {
    const auto& csr = query.csr();
    const RowMatrix<Scalar>& d_queries = buffers.backward.d_queries;
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
          layer.stages().query_projection.backward(args);
        },
        &buffers.pool, "query values gradient");
  }
};

}  // namespace sdmha::detail
