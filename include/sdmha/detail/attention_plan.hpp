// sdmha/detail/attention_plan.hpp — AttentionPlan: everything one forward or backward call
// decides before it computes, so that both passes and the bench walk the same work.
//
// A plan holds the validated sizes, the score strategy, the work items with their absolute
// offsets — row blocks of the projections, (batch, head, query tile, key tile) items of the
// attention — and the scratch each worker needs, the largest of what every stage asks for
// through its workspace_size(). Work items are fixed by the problem, never by the thread count,
// and each writes its own output: results are bitwise the same for any number of threads.
//
// Key tiles: the softmax stage needs a row's every key at once, so by default an item has one
// key tile (all keys its rows may see: S, or fewer under a causal mask). With more than kKeyTile
// keys, the default softmax and attend-values stages and no scores to return, the forward runs an
// online softmax instead (attention_core.hpp): the item's keys go in tiles of kKeyTile, the
// probabilities are never stored, and a worker's memory no longer grows with S.
//
// Context streaming: a forward given key and value that runs the online softmax and whose K and
// V would exceed kContextBudgetBytes projects them per batch entry in chunks of key steps instead
// of whole (attention_core.hpp, attend_streamed), so the call's memory does not grow with S
// either. A chunk is a whole number of key tiles: the key tiles, and so every sum, are those of
// the unstreamed path.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "sdmha/config.hpp"
#include "sdmha/detail/dropout.hpp"
#include "sdmha/detail/parallel.hpp"
#include "sdmha/options.hpp"
#include "sdmha/sparse_query.hpp"
#include "sdmha/stage.hpp"
#include "sdmha/weights.hpp"

namespace sdmha::detail {

// Rows per dense-projection work item (the key, value and output projections).
constexpr Index kProjectionRowBlock = 64;
// Rows per query-projection work item: enough stored values for the by-feature kernel to pay on
// wide queries; each block streams the part of Wq its rows use once, so larger blocks read Wq
// fewer times. The dense baseline projects its query in blocks of the same height.
constexpr Index kQueryProjectionRowBlock = 512;
// Query steps per attention tile of a forward without a causal mask whose key tiles are at most
// kKeyTile wide (S ≤ kKeyTile, or the online softmax): the scores in flight are at most
// kForwardQueryTile × kKeyTile per worker (512 KB in float), and every key tile of K and V is
// packed and read once per this many rows, so larger tiles read K and V fewer times.
constexpr Index kForwardQueryTile = 256;
// Query steps per attention tile under a causal mask (forward and backward), whose key range
// reaches the tile's last row: small tiles skip more of the blocked keys. Also the least height
// of a backward tile.
constexpr Index kQueryTile = 64;
// Keys per key tile of the online-softmax forward.
constexpr Index kKeyTile = 512;
// A forward given key and value projects K and V whole up to kContextBudgetBytes (B·S·(H·Dk +
// H·Dv) scalars); beyond it, under the online softmax, in chunks of about kContextChunkBytes:
// K + V of at most 16 MB live at once, 4 MB per chunk (a few MB, so that a chunk's K and V stay
// in the last-level cache while every item of its batch entry reads them).
constexpr std::size_t kContextBudgetBytes = std::size_t(16) << 20;
constexpr std::size_t kContextChunkBytes = std::size_t(4) << 20;

// A layer's streaming sizes: the defaults above, lowered by tests (through detail::InternalAccess)
// to stream small problems in several chunks.
struct ContextStreaming {
  std::size_t budget_bytes = kContextBudgetBytes;
  std::size_t chunk_bytes = kContextChunkBytes;
};
// Backward tiles: three tile × S matrices (P, P' and dS) of at most this many entries each stay
// in L2 together; larger tiles waste less on packing their six small GEMMs.
constexpr Index kBackwardTileEntries = Index(1) << 15;
// Tiles of a weight gradient (rows × columns of dW), and features per block of the query
// gradients by feature: fixed, so that every entry of a gradient is one sum in one order.
constexpr Index kWeightTile = 128;
constexpr Index kFeatureBlock = 1024;

enum class Pass { forward, backward };

// A block of rows [begin, begin + rows) of a projection.
struct RowBlock {
  Index begin, rows;
};

// A tile of the scores: query steps [query_begin, query_begin + query_rows) of batch entry
// `batch`, head `head`, against key steps [key_begin, key_begin + key_steps). An attention item
// (the unit a worker claims) is one tile of query rows over all the keys it may see
// (item_tile); the online softmax walks an item in key tiles (key_tile_of).
struct AttentionTile {
  Index batch, head, query_begin, query_rows, key_begin, key_steps;
  TilePosition position() const { return TilePosition{batch, head, query_begin, key_begin}; }
};

// The sparse query's statistics that strategy and scratch depend on: U_b (the distinct
// features of batch entry b's rows) summed and at most, and the most stored values of one batch
// entry and of one query-projection block.
struct QueryStatistics {
  Index distinct_total = 0, distinct_largest = 0;
  Index batch_nonzeros_largest = 0, block_nonzeros_largest = 0;
};

template <typename Scalar, typename StorageIndex>
QueryStatistics query_statistics(const CsrView<Scalar, StorageIndex>& csr, Index batch, Index steps,
                                 bool count_features, std::vector<Index>& last_batch);

struct AttentionPlan {
  Pass pass = Pass::forward;
  Index batch = 0, steps = 0, key_steps = 0;  // B, T, S
  LayerDims dims;
  int threads = 1;
  bool causal = false;
  Index causal_offset = 0;  // a causal mask lets query step t see key steps s <= t + causal_offset
  double scale = 1.0;       // S = scale·Q·Kᵀ
  // Under FullyMaskedRows::uniform a fully blocked row averages all S keys, so no item's key
  // range is shortened by the causal mask and the online softmax is not taken.
  FullyMaskedRows fully_masked_rows = FullyMaskedRows::zeros;
  ScoreStrategy strategy = ScoreStrategy::project_first;
  QueryStatistics query;
  bool return_scores = false;  // the (B, H, T, S) probabilities are returned
  // The call's dropout (rate 0: none): its seed is drawn once per call, before any work.
  double dropout_rate = 0.0;
  std::uint64_t dropout_seed = 0;
  Index query_tile = 0, query_tiles = 0;  // rows per attention tile, tiles per (b, h)
  bool online_softmax = false;            // key tiles of key_tile, probabilities never stored
  Index key_tile = 0;                     // keys per key tile
  // Key steps per streamed chunk of K and V, a multiple of key_tile (0: K and V projected whole).
  Index context_chunk = 0;
  std::size_t worker_scratch_bytes = 0;  // each worker's stage scratch
  Index tile_entries = 0;                // each worker's tile buffers: entries of one score tile

  bool regrouped() const { return strategy == ScoreStrategy::sparse_regrouped; }
  DropoutMask dropout() const { return DropoutMask(dropout_rate, dropout_seed); }
  Index heads() const { return dims.num_heads; }

  // Attention items: (b, h, query tile) in that order, each the tile item_tile gives.
  Index attention_items() const { return key_steps > 0 ? batch * heads() * query_tiles : 0; }
  AttentionTile item_tile(Index index) const {
    const Index tile = index % query_tiles, bh = index / query_tiles;
    return tile_of(bh / heads(), bh % heads(), tile);
  }
  AttentionTile tile_of(Index b, Index h, Index tile) const {
    const Index begin = tile * query_tile, rows = std::min(query_tile, steps - begin);
    const bool shorten = causal && fully_masked_rows == FullyMaskedRows::zeros;
    const Index keys =
        shorten ? std::clamp<Index>(begin + rows + causal_offset, 0, key_steps) : key_steps;
    return AttentionTile{b, h, begin, rows, 0, keys};
  }

  // Key tile `index` of an item: its keys [key_begin, key_begin + key_steps) cut into key_tile.
  Index key_tiles(const AttentionTile& item) const {
    return key_tile > 0 ? (item.key_steps + key_tile - 1) / key_tile : 0;
  }
  AttentionTile key_tile_of(const AttentionTile& item, Index index) const {
    AttentionTile tile = item;
    tile.key_begin = item.key_begin + index * key_tile;
    tile.key_steps = std::min(key_tile, item.key_steps - index * key_tile);
    return tile;
  }

  // Key tiles of width key_tile over all S keys, per (b, h): the grid that every item's key
  // tiles lie on (item key ranges start at key 0), and that value_is_finite is kept on.
  Index key_tiles_per_head() const {
    return key_tile > 0 ? (key_steps + key_tile - 1) / key_tile : 0;
  }

  // Row blocks of a projection over `rows` rows.
  static Index block_count(Index rows, Index block_rows) {
    return (rows + block_rows - 1) / block_rows;
  }
  static RowBlock block(Index index, Index rows, Index block_rows) {
    const Index begin = index * block_rows;
    return RowBlock{begin, std::min(block_rows, rows - begin)};
  }
  int workers(Index items) const { return worker_count(items, threads); }
};

// Query rows per attention tile. The regrouped kernel shares M_bh across all of a batch entry's
// rows, so it takes them all; tiles under a causal mask are kQueryTile (whose key range they
// shorten); other forward tiles kForwardQueryTile when their key tiles (key_tile keys) are at
// most kKeyTile, else kQueryTile (a tile × S of scores stays small), halved down to kQueryTile
// while the B·H·⌈T/tile⌉ items are fewer than kAttentionItemsWanted (so that many cores have
// items to share: `bow`, B·H = 64 and T = 128, gets 128 items of 64 rows, not 64 of 128); other
// backward tiles as many rows as kBackwardTileEntries allows (on `seed`, S = 128: all T = 128
// rows in one tile). The tile depends on the problem only, never on the thread count.
constexpr Index kAttentionItemsWanted = 256;
inline Index plan_query_tile(Pass pass, bool regrouped, bool causal, Index batch_heads, Index steps,
                             Index key_steps, Index key_tile) {
  if (regrouped) return std::max<Index>(steps, 1);
  if (causal || key_steps == 0) return kQueryTile;
  if (pass == Pass::backward)
    return std::max(kQueryTile, std::min(steps, kBackwardTileEntries / key_steps));
  Index tile = key_tile <= kKeyTile ? kForwardQueryTile : kQueryTile;
  while (tile > kQueryTile && batch_heads * ((steps + tile - 1) / tile) < kAttentionItemsWanted)
    tile /= 2;
  return tile;
}

// Key steps per chunk of K and V for a forward given key and value: 0 (projected whole) unless
// the online softmax runs and K and V, scalar_bytes an entry, exceed streaming.budget_bytes;
// otherwise the most whole key tiles whose K and V fit in streaming.chunk_bytes (at least one
// tile, at most the tiles of S).
inline Index plan_context_chunk(const AttentionPlan& plan, std::size_t scalar_bytes,
                                const ContextStreaming& streaming) {
  const double step_bytes = double(scalar_bytes) * double(plan.dims.projected_key_width() +
                                                          plan.dims.projected_value_width());
  if (!plan.online_softmax || plan.key_tile <= 0 ||
      step_bytes * double(plan.batch) * double(plan.key_steps) <= double(streaming.budget_bytes))
    return 0;
  const Index tiles =
      std::clamp<Index>(Index(double(streaming.chunk_bytes) / (step_bytes * double(plan.key_tile))),
                        1, plan.key_tiles_per_head());
  return tiles * plan.key_tile;
}

// Whether regrouped scores cost less than project-first ones, given Σ_b U_b. The cost model
// counts, per call, project-first's 2·nnz·H·Dk sparse flops plus 2·B·H·T·S·Dk GEMM flops (about
// half under a causal mask, whose blocked key tiles are skipped) against regrouped's
// 2·H·Dk·S·Σ_b U_b GEMM flops plus 2·nnz·H·S sparse flops. A sparse flop is weighted as
// kSparseFlopCost GEMM flops: it streams a row of a dense operand per stored value instead of
// reusing registers and cache as a GEMM does.
inline bool regrouped_is_cheaper(const AttentionPlan& plan, Index nonzeros, Index distinct_total) {
  constexpr double kSparseFlopCost = 4.0;
  const double H = double(plan.dims.num_heads), Dk = double(plan.dims.key_dim);
  const double S = double(plan.key_steps), nnz = double(nonzeros);
  const double B = double(plan.batch), T = double(plan.steps);
  const double project_first =
      kSparseFlopCost * 2 * nnz * H * Dk + (plan.causal ? 0.5 : 1.0) * 2 * B * H * T * S * Dk;
  const double regrouped =
      2 * H * Dk * S * double(distinct_total) + kSparseFlopCost * 2 * nnz * H * S;
  return regrouped < project_first;
}

// The score strategy for `requested`, by the cost model of regrouped_is_cheaper.
inline ScoreStrategy choose_strategy(ScoreStrategy requested, const AttentionPlan& plan,
                                     Index nonzeros) {
  if (requested != ScoreStrategy::automatic) return requested;
  return regrouped_is_cheaper(plan, nonzeros, plan.query.distinct_total)
             ? ScoreStrategy::sparse_regrouped
             : ScoreStrategy::project_first;
}

// Whether planning `requested` needs U_b counted (query_statistics with count_features, a pass
// over every stored value with random accesses): regrouped sizes its tiles by them and automatic
// weighs them, unless regrouped loses even at Σ_b U_b = 0, its least: when its sparse flops
// alone outweigh project-first's whole cost, as with many stored values a row and S ≫ Dk.
inline bool counts_distinct_features(ScoreStrategy requested, const AttentionPlan& plan,
                                     Index nonzeros) {
  if (requested == ScoreStrategy::project_first) return false;
  if (requested == ScoreStrategy::sparse_regrouped) return true;
  return regrouped_is_cheaper(plan, nonzeros, 0);
}

template <typename Scalar, typename StorageIndex>
QueryStatistics query_statistics(const CsrView<Scalar, StorageIndex>& csr, Index batch, Index steps,
                                 bool count_features, std::vector<Index>& last_batch) {
  QueryStatistics statistics;
  for (Index first = 0; first < csr.rows; first += kQueryProjectionRowBlock)
    statistics.block_nonzeros_largest = std::max(
        statistics.block_nonzeros_largest,
        csr.middle_rows(first, std::min(kQueryProjectionRowBlock, csr.rows - first)).nonzeros());
  if (count_features) last_batch.assign(static_cast<std::size_t>(csr.cols), -1);
  for (Index b = 0; b < batch; ++b) {
    Index in_batch = 0, stored = 0;
    for (Index row = b * steps; row < (b + 1) * steps; ++row) {
      stored += csr.row_size(row);
      if (!count_features) continue;
      for (Index k = csr.row_begin(row); k < csr.row_end(row); ++k) {
        Index& seen = last_batch[std::size_t(csr.column_indices[k])];
        if (seen != b) {
          seen = b;
          ++in_batch;
        }
      }
    }
    statistics.distinct_total += in_batch;
    statistics.distinct_largest = std::max(statistics.distinct_largest, in_batch);
    statistics.batch_nonzeros_largest = std::max(statistics.batch_nonzeros_largest, stored);
  }
  return statistics;
}

}  // namespace sdmha::detail
