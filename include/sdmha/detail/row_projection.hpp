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
    const RowBlock block = AttentionPlan::block(index / column_panels, input.rows(), block_rows);
    const Index width = panel_width(), first = index % column_panels * width;
    const Index columns = std::min(width, kernel.cols() - first);
    typename Projection::Arguments args{
        input.middleRows(block.begin, block.rows), kernel.middleCols(first, columns),
        bias_segment(bias, first, columns), output.block(block.begin, first, block.rows, columns),
        scratch};
    if constexpr (reads_bfloat16_kernel<Projection>::value) args.kernel_bfloat16 = kernel_bfloat16;
    Projection::can_implement(args);
    projection(args);
  }
  // Every item as one call, when the stage gives each entry the same bits in any block of the
  // product and `scratch` holds the whole product's packing (the plan sizes it so when its
  // regions run on one worker: projection_scratch_rows); returns false, having done nothing,
  // otherwise. One call packs each block of the kernel once instead of once per row block.
  bool run_whole(StageScratch scratch) const {
    if (!same_bits_in_any_block<Projection>(kernel_bfloat16 != nullptr)) return false;
    TileSizes sizes;
    sizes.rows = input.rows();
    sizes.input_width = kernel.rows();
    sizes.output_width = kernel.cols();
    if (scratch.bytes < stage_workspace_size<Projection>(sizes)) return false;
    typename Projection::Arguments args{input, kernel, bias_view(bias), output, scratch};
    Projection::can_implement(args);
    projection(args);
    return true;
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

// K = key·Wk + bk and V = value·Wv + bv of `rows` rows of key and value (all B·S, or a chunk's
// whole row blocks), into `keys` and `values`.
template <typename Core>
auto key_projection(const Core& core, const AttentionPlan& plan,
                    const ConstMatrixRef<typename Core::ScalarType>& key,
                    MatrixRef<typename Core::ScalarType> keys) {
  const auto& weights = core.weights();
  return row_projection<typename Core::ScalarType>(
      core.context_projection(), key, weights.key_kernel, weights.key_bias, keys,
      core.dense_kernel_bfloat16(&Core::DenseKernelsBFloat16::key), plan.batch * plan.key_steps);
}
template <typename Core>
auto value_projection(const Core& core, const AttentionPlan& plan,
                      const ConstMatrixRef<typename Core::ScalarType>& value,
                      MatrixRef<typename Core::ScalarType> values) {
  const auto& weights = core.weights();
  return row_projection<typename Core::ScalarType>(
      core.context_projection(), value, weights.value_kernel, weights.value_bias, values,
      core.dense_kernel_bfloat16(&Core::DenseKernelsBFloat16::value), plan.batch * plan.key_steps);
}

// The region body of run_projections: item `index` is the extra items' first, then each
// projection's in turn. On one worker it runs as one range: the extra items, then each
// projection whole where run_whole can (the same bits as item by item).
template <typename Scalar, typename Extra, typename... Projections>
struct ProjectionItems {
  CallBuffers<Scalar>& buffers;
  Index extra_items;
  Extra& extra;
  std::tuple<const Projections&...> projections;

  void operator()(Index index, int worker) const {
    if (index < extra_items) {
      extra(index, worker);
      return;
    }
    index -= extra_items;
    const StageScratch scratch = buffers.workers[std::size_t(worker)].stage.view();
    bool done = false;
    auto try_one = [&](const auto& projection) {
      if (done) return;
      if (index < projection.items()) {
        projection.run_item(index, scratch);
        done = true;
      } else {
        index -= projection.items();
      }
    };
    std::apply([&](const auto&... each) { (try_one(each), ...); }, projections);
  }
  void run_range(Index begin, Index end, int worker) const {
    SDMHA_ASSERT(begin == 0 && end == extra_items + total_items());  // one worker: the whole region
    if constexpr (runs_ranges<Extra>::value)
      extra.run_range(0, extra_items, worker);
    else
      for (Index index = 0; index < extra_items; ++index) extra(index, worker);
    const StageScratch scratch = buffers.workers[std::size_t(worker)].stage.view();
    auto run_one = [&](const auto& projection) {
      if (!projection.run_whole(scratch))
        for (Index item = 0; item < projection.items(); ++item) projection.run_item(item, scratch);
    };
    std::apply([&](const auto&... each) { (run_one(each), ...); }, projections);
  }
  Index total_items() const {
    return std::apply([](const auto&... each) { return (Index(0) + ... + each.items()); },
                      projections);
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

// The rows a worker's scratch is sized for in a forward projection of `rows` rows: its fixed row
// blocks, or all of them when the plan's regions run on one worker and the stage fuses blocks
// (RowProjection::run_whole).
template <typename Projection>
Index projection_scratch_rows(const AttentionPlan& plan, Index rows) {
  const bool whole = plan.threads == 1 && same_bits_in_any_block<Projection>(false);
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
      plan, buffers, "key/value projection", 0, [](Index, int) {},
      key_projection(core, plan, key.as_matrix(), context.keys),
      value_projection(core, plan, value.as_matrix(), context.values));
}

}  // namespace sdmha::detail
