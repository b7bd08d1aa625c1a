// sdmha/detail/row_projection.hpp — the forward's dense projections (K, V, the output, the dense
// query) in fixed items, and the region that runs several projections' items together.
//
//   math:  output = input · kernel + bias, one item per row block × panel of output columns
//   pre:   a validated, planned call; input, kernel, bias and output of agreeing shapes
//   cost:  2 · rows · kernel.rows() · kernel.cols() flops, in items that depend on the shapes
//          only (row blocks of kProjectionRowBlock × column_panels_for's panels)
#pragma once

#include <algorithm>
#include <cstddef>
#include <tuple>
#include <type_traits>

#include "sdmha/config.hpp"
#include "sdmha/detail/attention_plan.hpp"
#include "sdmha/detail/gemm_bfloat16.hpp"
#include "sdmha/detail/parallel.hpp"
#include "sdmha/detail/stage_traits.hpp"
#include "sdmha/options.hpp"
#include "sdmha/projected_context.hpp"
#include "sdmha/stage.hpp"
#include "sdmha/workspace.hpp"

namespace sdmha::detail {

// A projection's bias, or an empty view when the layer has none.
template <typename Scalar>
ConstVectorRef<Scalar> bias_view(const Vector<Scalar>& bias) {
  static const Vector<Scalar> none;
  return bias.size() != 0 ? ConstVectorRef<Scalar>(bias) : ConstVectorRef<Scalar>(none);
}
template <typename Scalar>
ConstVectorRef<Scalar> bias_segment(const Vector<Scalar>& bias, Index start, Index size) {
  static const Vector<Scalar> none;
  return bias.size() != 0 ? ConstVectorRef<Scalar>(bias.segment(start, size))
                          : ConstVectorRef<Scalar>(none);
}

// One dense projection, output = input · kernel + bias, in fixed items: blocks of `block_rows`
// rows, each cut into `column_panels` panels of output columns when the rows alone give few
// items (column_panels_for). Every output entry is one item's; the items depend on the shapes
// only, so the bits do not depend on the thread count. The key, value and output projections,
// and the dense query's.
template <typename Scalar, typename Projection>
struct RowProjection {
  const Projection& projection;
  ConstMatrixRef<Scalar> input;
  const RowMatrix<Scalar>& kernel;
  const Vector<Scalar>& bias;
  mutable MatrixRef<Scalar> output;
  const BFloat16Kernel* kernel_bfloat16 = nullptr;  // the stage reads this copy when given
  Index block_rows = kProjectionRowBlock;
  Index column_panels = 1;

  Index row_blocks() const { return AttentionPlan::block_count(input.rows(), block_rows); }
  Index items() const { return row_blocks() * column_panels; }
  void run_item(Index index, StageScratch scratch) const {
    const Index block = index / column_panels, panel = index % column_panels;
    run_span(block, block + 1, panel, panel + 1, scratch);
  }
  // Items [first, last) (block-major: item = block · column_panels + panel), the same bits as one
  // by one. Where the stage gives each entry the same bits in any block of the product and
  // `scratch` holds the whole product's packing (the plan sizes it so: projection_scratch_rows),
  // as at most three calls (the rest of a block begun by another range, the whole blocks, the
  // start of the last block), which pack each panel of the kernel once instead of once per row
  // block; else item by item.
  void run_items(Index first, Index last, StageScratch scratch) const {
    const Index panels = column_panels;
    if (!fuses(scratch)) {
      for (Index item = first; item < last; ++item) run_item(item, scratch);
      return;
    }
    Index item = first;
    if (item % panels != 0) {
      const Index end = std::min(last, (item / panels + 1) * panels);
      run_span(item / panels, item / panels + 1, item % panels, item % panels + (end - item),
               scratch);
      item = end;
    }
    const Index whole_end = std::max(item, last / panels * panels);
    if (item < whole_end) run_span(item / panels, whole_end / panels, 0, panels, scratch);
    if (whole_end < last)
      run_span(whole_end / panels, whole_end / panels + 1, 0, last % panels, scratch);
  }
  bool fuses(StageScratch scratch) const {
    if (!same_bits_in_any_block<Projection>(kernel_bfloat16 != nullptr)) return false;
    TileSizes sizes;
    sizes.rows = input.rows();
    sizes.input_width = kernel.rows();
    sizes.output_width = kernel.cols();
    return scratch.bytes >= stage_workspace_size<Projection>(sizes);
  }
  // Row blocks [first_block, end_block) × column panels [first_panel, end_panel), as one call.
  void run_span(Index first_block, Index end_block, Index first_panel, Index end_panel,
                StageScratch scratch) const {
    const Index first_row = first_block * block_rows;
    const Index rows = std::min(input.rows(), end_block * block_rows) - first_row;
    const Index first = first_panel * panel_width();
    const Index columns = std::min(kernel.cols(), end_panel * panel_width()) - first;
    typename Projection::Arguments args{
        input.middleRows(first_row, rows), kernel.middleCols(first, columns),
        bias_segment(bias, first, columns), output.block(first_row, first, rows, columns), scratch};
    if constexpr (reads_bfloat16_kernel<Projection>::value) args.kernel_bfloat16 = kernel_bfloat16;
    Projection::can_implement(args);
    projection(args);
  }
  Index panel_width() const {
    const Index width = (kernel.cols() + column_panels - 1) / column_panels;
    return column_panels == 1 ? kernel.cols() : (width + 15) / 16 * 16;
  }
};

// Panels of output columns per row block: 1, 2 or 4, the fewest that give a projection at least
// kProjectionItemsWanted items, each panel at least kLeastPanelColumns wide; 1 for a bfloat16
// kernel (packed whole) and for narrow outputs.
constexpr Index kProjectionItemsWanted = 128;
constexpr Index kLeastPanelColumns = 128;
inline Index column_panels_for(Index row_blocks, Index columns, bool bfloat16_kernel) {
  Index panels = 1;
  while (!bfloat16_kernel && panels < 4 && row_blocks * panels < kProjectionItemsWanted &&
         columns / (panels * 2) >= kLeastPanelColumns)
    panels *= 2;
  return panels;
}

// The projection of `input` in row blocks of kProjectionRowBlock, its column panels chosen for
// `whole_rows` rows (all of them, or, for a chunk of K and V, all B·S: a chunk's items are then
// those of the whole projection, and so are its bits).
template <typename Scalar, typename Projection>
RowProjection<Scalar, Projection> row_projection(
    const Projection& projection, const ConstMatrixRef<Scalar>& input,
    const RowMatrix<Scalar>& kernel, const Vector<Scalar>& bias, MatrixRef<Scalar> output,
    const BFloat16Kernel* kernel_bfloat16, Index whole_rows) {
  RowProjection<Scalar, Projection> rows{projection, input, kernel, bias, output, kernel_bfloat16};
  rows.column_panels =
      column_panels_for(AttentionPlan::block_count(whole_rows, kProjectionRowBlock), kernel.cols(),
                        kernel_bfloat16 != nullptr);
  return rows;
}

enum class ContextSide { key, value };

// K = key·Wk + bk (ContextSide::key) or V = value·Wv + bv (ContextSide::value) of `rows` rows of
// key or value (all B·S, or a chunk's whole row blocks), into `output`.
template <typename Core>
auto context_projection_rows(const Core& core, const AttentionPlan& plan, ContextSide side,
                             const ConstMatrixRef<typename Core::ScalarType>& input,
                             MatrixRef<typename Core::ScalarType> output) {
  const auto& weights = core.weights();
  const bool key = side == ContextSide::key;
  using Copies = typename Core::DenseKernelsBFloat16;
  return row_projection<typename Core::ScalarType>(
      core.stages().context_projection, input, key ? weights.key_kernel : weights.value_kernel,
      key ? weights.key_bias : weights.value_bias, output,
      core.dense_kernel_bfloat16(key ? &Copies::key : &Copies::value), plan.batch * plan.key_steps);
}

// The region body of run_projections: item `index` is the extra items' first, then each
// projection's in turn. It takes guided ranges (ItemQueue), the whole region on one worker: the
// extra items' part of a range through their own run_range when they have one, each
// projection's part through RowProjection::run_items (the same bits as item by item).
template <typename Scalar, typename Extra, typename... Projections>
struct ProjectionItems {
  static constexpr bool kGuidedRanges = true;
  CallBuffers<Scalar>& buffers;
  Index extra_items;
  Extra& extra;
  std::tuple<const Projections&...> projections;

  void operator()(Index index, int worker) const { run_range(index, index + 1, worker); }
  void run_range(Index begin, Index end, int worker) const {
    const Index extra_end = std::min(end, extra_items);
    if constexpr (runs_ranges<Extra>::value) {
      if (begin < extra_end) extra.run_range(begin, extra_end, worker);
    } else {
      for (Index index = begin; index < extra_end; ++index) extra(index, worker);
    }
    const StageScratch scratch = buffers.workers[std::size_t(worker)].stage.view();
    Index offset = extra_items;  // the first item of the projection at hand
    auto run_part = [&](const auto& projection) {
      const Index first = std::max(begin, offset);
      const Index last = std::min(end, offset + projection.items());
      if (first < last) projection.run_items(first - offset, last - offset, scratch);
      offset += projection.items();
    };
    std::apply([&](const auto&... each) { (run_part(each), ...); }, projections);
  }
};

// Runs the items of several projections as one region, in the order given (callers put the
// costliest first): items [0, n0) are the first's, [n0, n0 + n1) the second's, and so on.
template <typename Scalar, typename Extra, typename... Projections>
void run_projections(const AttentionPlan& plan, CallBuffers<Scalar>& buffers, const char* region,
                     Index extra_items, Extra&& extra, const Projections&... projections) {
  const Index counts[] = {extra_items, projections.items()...};
  Index total = 0;
  for (Index count : counts) total += count;
  buffers.prepare_workers(plan.workers(total), plan.worker_scratch_bytes, plan.tile_entries, 2);
  parallel_for(total, plan.threads,
               ProjectionItems<Scalar, std::remove_reference_t<Extra>, Projections...>{
                   buffers, extra_items, extra, std::tie(projections...)},
               &buffers.pool, region);
}

// The rows a worker's scratch is sized for in a forward projection of `rows` rows: one fixed row
// block, or all of them when the stage fuses blocks (RowProjection::run_items).
template <typename Projection>
Index projection_scratch_rows(Index rows) {
  const bool whole = same_bits_in_any_block<Projection>(false);
  return std::max<Index>(1, whole ? rows : std::min(rows, kProjectionRowBlock));
}

// K and V of validated key and value, into `context` (resized; reallocated only when it grows).
template <typename Core>
void project_context_into(const Core& core, const AttentionPlan& plan,
                          const TensorRef3<typename Core::ScalarType>& key,
                          const TensorRef3<typename Core::ScalarType>& value,
                          CallBuffers<typename Core::ScalarType>& buffers,
                          ProjectedContext<typename Core::ScalarType>& context) {
  context.batch = value.dimension(0);
  context.key_steps = value.dimension(1);
  const Index rows = context.batch * context.key_steps;
  context.keys.resize(rows, plan.dims.projected_key_width());
  context.values.resize(rows, plan.dims.projected_value_width());
  run_projections(
      plan, buffers, "context projection", 0, [](Index, int) {},
      context_projection_rows(core, plan, ContextSide::key, key.as_matrix(), context.keys),
      context_projection_rows(core, plan, ContextSide::value, value.as_matrix(), context.values));
}

}  // namespace sdmha::detail
