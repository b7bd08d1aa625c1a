// sdmha/detail/sparse_query_source.hpp — the sparse query as the forward pass's query source
// (detail/forward_pass.hpp): Q = X·Wq + bq in fixed items, and each tile's scores by the plan's
// strategy.
//
//   math:  Q = X·Wq + bq, X (B·T × Eq) in CSR; items (row block of kQueryProjectionRowBlock rows)
//          × (window of the stage's column_window_width columns, when it takes windows)
//   pre:   a validated call and its plan (SparseDenseMHA::forward, backward, project_query)
//   cost:  the stage's, per item; with a Wq beyond L2, one CSC by feature per row block
//          (a preparation item) that the block's windows share
//
// Each entry of Q is one window's, the same sequence of FMAs as in a whole-block call, so the
// items, fixed by the problem, leave the bits what they are for any thread count. Included at
// the end of sdmha/sparse_dense_mha.hpp: this is the layer's private nested QuerySource.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "sdmha/sparse_dense_mha.hpp"

namespace sdmha {

template <typename Scalar, typename QueryProjectionT, typename ScoreKernelT, typename SoftmaxT,
          typename AttendValuesT, typename OutputProjectionT, typename ContextProjectionT>
struct SparseDenseMHA<Scalar, QueryProjectionT, ScoreKernelT, SoftmaxT, AttendValuesT,
                      OutputProjectionT, ContextProjectionT>::QuerySource {
  const SparseDenseMHA& layer;
  const detail::AttentionPlan& call_plan;  // the tiles' (the passes hand theirs in as `plan`)
  const Query& query;
  RowMatrix<Scalar>& projected_query;
  bool always_project = false;  // Q even for regrouped scores (the backward's dK needs it)

  // ---- What the forward pass asks of a query source ----

  bool projects(const detail::AttentionPlan& plan) const {
    return always_project || !plan.regrouped();
  }
  Index projection_items(const detail::AttentionPlan& plan) const {
    return projects(plan) ? row_blocks() * windows(plan) : 0;
  }
  // One item per row block building its CSC, before any window runs (0: none needed).
  Index preparation_items(const detail::AttentionPlan& plan) const {
    return projects(plan) && shares_groups(plan) ? row_blocks() : 0;
  }
  void prepare(const detail::AttentionPlan& plan, detail::CallBuffers<Scalar>& buffers) {
    if (!projects(plan)) return;
    projected_query.resize(query.rows(), plan.dims.projected_key_width());
    if (preparation_items(plan) == 0) return;
    if (buffers.query_groups.size() < std::size_t(row_blocks()))
      buffers.query_groups.resize(std::size_t(row_blocks()));
    for (Index block = 0; block < row_blocks(); ++block) {
      const auto rows =
          detail::AttentionPlan::block(block, query.rows(), detail::kQueryProjectionRowBlock);
      buffers.query_groups[std::size_t(block)].reserve(
          kGroupsHeader +
          QueryProjection::query_groups_bytes(
              query.features(), query.csr().middle_rows(rows.begin, rows.rows).nonzeros()));
    }
  }
  // Builds row block `index`'s CSC into its memory when its windows will read one, and says so
  // in the memory's header either way.
  void prepare_item(const detail::AttentionPlan& plan, Index index,
                    detail::CallBuffers<Scalar>& buffers, int) const {
    if constexpr (detail::shares_feature_groups<QueryProjection>::value) {
      const Index N = plan.dims.projected_key_width();
      auto args = block_arguments(index, 0, N, StageScratch{});
      args.kernel_columns = N;
      const StageScratch memory = buffers.query_groups[std::size_t(index)].view();
      memory.data[0] = std::byte{0};
      if (!QueryProjection::reads_feature_groups(args)) return;
      const auto built = QueryProjection::build_query_groups(
          args.query, StageScratch{memory.data + kGroupsHeader, memory.bytes - kGroupsHeader});
      std::memcpy(memory.data + 8, &built, sizeof(built));
      memory.data[0] = std::byte{1};
    }
  }
  // Item `index`: window index / row_blocks(), row block index % row_blocks(). Window-major: the
  // row blocks' items of one window follow one another, so that workers running them at once
  // read the same columns of Wq (one pass from memory, shared in L3).
  void project_item(const detail::AttentionPlan& plan, Index index,
                    detail::CallBuffers<Scalar>& buffers, int worker) const {
    const Index window = index / row_blocks();
    project_windows(plan, index % row_blocks(), window, window + 1, buffers, worker);
  }
  // Items [begin, end) at once: each row block's windows among them (consecutive, by the
  // window-major order) as one wider window, whose entries are the same sums as each window's
  // (the stage's contract), so that the block's stored values are walked once, not per window.
  void project_items(const detail::AttentionPlan& plan, Index begin, Index end,
                     detail::CallBuffers<Scalar>& buffers, int worker) const {
    const Index blocks = row_blocks();
    for (Index block = 0; block < blocks; ++block) {
      // The windows w with begin <= w·blocks + block < end.
      const Index first_window = std::max<Index>(0, begin - block + blocks - 1) / blocks;
      const Index end_window = std::max<Index>(0, end - block + blocks - 1) / blocks;
      if (first_window < end_window)
        project_windows(plan, block, first_window, end_window, buffers, worker);
    }
  }
  // The row blocks: the rows of the items (window · projection_rows + block).
  Index projection_rows(const detail::AttentionPlan&) const { return row_blocks(); }
  // Row block `block` of Q over windows [first_window, end_window) of Wq's columns, as one call.
  void project_windows(const detail::AttentionPlan& plan, Index block, Index first_window,
                       Index end_window, detail::CallBuffers<Scalar>& buffers, int worker) const {
    const StageScratch scratch = buffers.workers[std::size_t(worker)].stage.view();
    const Index N = plan.dims.projected_key_width();
    if constexpr (detail::splits_columns<QueryProjection>::value) {
      const Index first = first_window * window_width();
      const Index columns = std::min(end_window * window_width(), N) - first;
      auto args = block_arguments(block, first, columns, scratch);
      args.kernel_columns = N;
      args.first_column = first;
      if constexpr (detail::shares_feature_groups<QueryProjection>::value) {
        typename QueryProjection::FeatureGroups built;  // outlives the call below
        if (preparation_items(plan) > 0 &&
            read_groups(buffers.query_groups[std::size_t(block)], built))
          args.feature_groups = &built;
        QueryProjection::can_implement(args);
        layer.stages().query_projection(args);
        return;
      }
      QueryProjection::can_implement(args);
      layer.stages().query_projection(args);
    } else {
      (void)first_window;
      (void)end_window;
      const auto args = block_arguments(block, 0, N, scratch);
      QueryProjection::can_implement(args);
      layer.stages().query_projection(args);
    }
  }

  // One tile's masked scores, before the attention bias (SparseDenseMHA::tile_scores).
  void operator()(const detail::AttentionTile& item, const BatchMask& mask,
                  const ConstMatrixRef<Scalar>& key, BFloat16Operands bfloat16_operands,
                  StageScratch scratch, MatrixRef<Scalar> scores) const {
    layer.tile_scores(call_plan, item, query, projected_query, mask, key, bfloat16_operands,
                      scratch, scores);
  }

 private:
  bool kernel_is_bfloat16() const { return layer.query_kernel_bfloat16_ != nullptr; }
  Index row_blocks() const {
    return detail::AttentionPlan::block_count(query.rows(), detail::kQueryProjectionRowBlock);
  }
  Index window_width() const { return QueryProjection::column_window_width(kernel_is_bfloat16()); }
  Index windows(const detail::AttentionPlan& plan) const {
    if constexpr (detail::splits_columns<QueryProjection>::value)
      return std::max<Index>(
          1, (plan.dims.projected_key_width() + window_width() - 1) / window_width());
    return 1;
  }
  // Whether the windows share a CSC per row block: the stage can, and Wq is beyond L2 (the
  // by-feature kernels' condition; each block decides the rest itself).
  bool shares_groups(const detail::AttentionPlan& plan) const {
    if constexpr (detail::shares_feature_groups<QueryProjection>::value)
      return windows(plan) > 1 && QueryProjection::kernel_beyond_cache(
                                      plan.dims.query_dim, plan.dims.projected_key_width());
    return false;
  }

  // The Arguments of row block `index` and Wq's columns [first, first + columns).
  typename QueryProjection::Arguments block_arguments(Index index, Index first, Index columns,
                                                      StageScratch scratch) const {
    const auto& weights = layer.weights();
    const detail::RowBlock block =
        detail::AttentionPlan::block(index, query.rows(), detail::kQueryProjectionRowBlock);
    typename QueryProjection::Arguments args{
        query.csr().middle_rows(block.begin, block.rows),
        weights.query_kernel.middleCols(first, columns),
        detail::bias_segment(weights.query_bias, first, columns),
        projected_query.block(block.begin, first, block.rows, columns), scratch};
    if constexpr (detail::reads_bfloat16_kernel<QueryProjection>::value)
      if (kernel_is_bfloat16()) args.kernel_bfloat16 = &layer.query_kernel_bfloat16_->rounded;
    return args;
  }

  // A row block's CSC memory: a header (whether it was built, and the built FeatureGroups, whose
  // arrays point past the header), then the arrays (query_groups_bytes).
  static constexpr std::size_t kGroupsHeader = 128;
  template <typename Groups>
  static bool read_groups(const detail::ScratchBuffer& memory, Groups& groups) {
    static_assert(std::is_trivially_copyable<Groups>::value && sizeof(Groups) + 8 <= kGroupsHeader);
    const std::byte* header = memory.view().data;
    if (header[0] == std::byte{0}) return false;
    std::memcpy(&groups, header + 8, sizeof(Groups));
    return true;
  }
};

}  // namespace sdmha
