// sdmha/detail/item_queue.hpp — how the workers of one parallel region share its items: an
// atomic counter that hands them out in index order, one at a time or in ranges.
//
//   math:  items [0, count) each run exactly once, by whichever worker claims them, one at a time
//          or (a body that asks) in ranges no longer than left / (kRangeShare · workers)
//   pre:   the body of an item writes only its own output and its worker's scratch
//   cost:  one atomic read-modify-write per claim
#pragma once

#include <atomic>
#include <exception>
#include <type_traits>
#include <utility>

#include "sdmha/config.hpp"

namespace sdmha::detail {

// Whether `Body` can also run a range of items at once: body.run_range(begin, end, worker), with
// the same bits in every item's output as body(item, worker) for each item of the range. A
// region on one worker hands such a body all of its items as one range (run_region): items
// that share set-up (the row blocks of a dense projection, each of which packs the same kernel
// panel; the windows of one row block of the sparse query projection, each of which walks the
// block's stored values) then share it.
template <typename Body, typename = void>
struct runs_ranges : std::false_type {};
template <typename Body>
struct runs_ranges<Body,
                   std::void_t<decltype(std::declval<Body&>().run_range(Index(0), Index(0), 0))>>
    : std::true_type {};

// Whether a range body also wants ranges on several workers (`static constexpr bool
// kGuidedRanges = true`): then each claim takes range_claim(left, workers) of the items not yet
// claimed, long at first and single items at the end, so that no worker idles while another
// holds a long range. A body whose neighbouring items are best run at once by different workers
// (the sparse query projection's row blocks of one window read the same columns of Wq, which
// they then share in L3) leaves it out and gets single items.
template <typename Body, typename = void>
struct claims_guided_ranges : std::false_type {};
template <typename Body>
struct claims_guided_ranges<Body, std::enable_if_t<std::remove_cv_t<Body>::kGuidedRanges>>
    : runs_ranges<Body> {};

// Whether `Body` wants its items claimed along rows: items are column · rows + row for
// body.claim_rows() rows, and body.run_row_range(row, first_column, end_column, worker) runs the
// columns [first_column, end_column) of one row at once, the same bits as item by item (the sparse
// query projection: rows are row blocks, columns windows of Wq). See RowQueue.
template <typename Body, typename = void>
struct claims_by_rows : std::false_type {};
template <typename Body>
struct claims_by_rows<Body, std::void_t<decltype(std::declval<Body&>().claim_rows()),
                                        decltype(std::declval<Body&>().run_row_range(
                                            Index(0), Index(0), Index(0), 0))>> : std::true_type {};

// The first exception of a region's items, kept for the calling thread; record() is called from
// a worker's catch block.
class RegionFailure {
 public:
  void record() noexcept {
    if (!failed_.exchange(true, std::memory_order_acq_rel)) failure_ = std::current_exception();
  }
  // On the calling thread once every worker is done (their writes published by the join).
  void rethrow() {
    if (failure_) std::rethrow_exception(failure_);
  }

 private:
  alignas(64) std::atomic<bool> failed_{false};
  std::exception_ptr failure_;
};

// Items [0, count) handed out one at a time, in index order, to whichever worker asks (an atomic
// counter), and the first exception any item throws. After a failure the counter jumps to the
// end: the other workers finish the item they hold and take no more. Which worker runs an item
// does not matter: an item writes its own output, and a worker's scratch is sized by the plan
// for any item before the region starts (CallBuffers::prepare_workers).
class ItemQueue {
 public:
  static constexpr Index kRangeShare = 2;

  ItemQueue(Index count, int workers) : count_(count), workers_(workers < 1 ? 1 : workers) {}

  // The length of the range a worker claims when `left` items are unclaimed among `workers`.
  static Index range_claim(Index left, int workers) {
    const Index share = left / (kRangeShare * (workers < 1 ? 1 : workers));
    return share < 1 ? 1 : share;
  }

  template <typename Body>
  void run(Body& body, int worker) noexcept {
    try {
      if constexpr (claims_guided_ranges<Body>::value)
        run_ranges(body, worker);
      else
        for (Index item = next_.fetch_add(1, std::memory_order_relaxed); item < count_;
             item = next_.fetch_add(1, std::memory_order_relaxed))
          body(item, worker);
    } catch (...) {
      failure_.record();
      next_.store(count_, std::memory_order_relaxed);
    }
  }
  void rethrow_failure() { failure_.rethrow(); }

 private:
  template <typename Body>
  void run_ranges(Body& body, int worker) {
    Index begin = next_.load(std::memory_order_relaxed);
    while (begin < count_) {
      const Index claim = range_claim(count_ - begin, workers_);
      const Index end = count_ - begin < claim ? count_ : begin + claim;
      if (!next_.compare_exchange_weak(begin, end, std::memory_order_relaxed)) continue;
      body.run_range(begin, end, worker);
      begin = next_.load(std::memory_order_relaxed);
    }
  }

  // The counter every worker updates, on a cache line of its own (the queue lives on the
  // caller's stack, among its locals).
  alignas(64) std::atomic<Index> next_{0};
  Index count_;
  int workers_;
  RegionFailure failure_;
};

// Items column · rows + row of a body that claims by rows (claims_by_rows), for `workers`
// workers: worker w starts on row w % rows and claims ranges of that row's columns, each
// left / (the workers that start on the row) long (at least one), then helps the other rows the
// same way. With no more workers than rows each worker so runs a whole row as one call (the
// query projection: one walk over its row block's stored values), and the workers' rows run
// their columns in the same order at the same time (the same columns of Wq, shared in L3); with
// more, a row's workers share it in shrinking ranges. More than kMaxRows rows, or a count that
// is not a multiple of the rows: single items, in index order.
class RowQueue {
 public:
  static constexpr Index kMaxRows = 64;

  template <typename Body>
  RowQueue(Index count, int workers, const Body& body)
      : rows_(body.claim_rows()), columns_(0), workers_(workers < 1 ? 1 : workers) {
    if (rows_ < 1 || rows_ > kMaxRows || count % rows_ != 0) {
      rows_ = 0;  // single items on cursors_[0], over all of `count`
      columns_ = count;
      cursors_[0].next.store(0, std::memory_order_relaxed);
      return;
    }
    columns_ = count / rows_;
    for (Index row = 0; row < rows_; ++row) cursors_[row].next.store(0, std::memory_order_relaxed);
  }

  template <typename Body>
  void run(Body& body, int worker) noexcept {
    try {
      if (rows_ == 0) {
        auto& next = cursors_[0].next;
        for (Index item = next.fetch_add(1, std::memory_order_relaxed); item < columns_;
             item = next.fetch_add(1, std::memory_order_relaxed))
          body(item, worker);
        return;
      }
      for (Index step = 0; step < rows_; ++step) claim_row(body, (worker + step) % rows_, worker);
    } catch (...) {
      failure_.record();
      for (Index row = 0; row < (rows_ == 0 ? 1 : rows_); ++row)
        cursors_[row].next.store(columns_, std::memory_order_relaxed);
    }
  }
  void rethrow_failure() { failure_.rethrow(); }

 private:
  template <typename Body>
  void claim_row(Body& body, Index row, int worker) {
    // The workers that start on this row: w ≡ row (mod rows), w < workers.
    const Index starters = row < workers_ ? (workers_ - 1 - row) / rows_ + 1 : 1;
    auto& next = cursors_[row].next;
    Index begin = next.load(std::memory_order_relaxed);
    while (begin < columns_) {
      const Index share = (columns_ - begin) / starters;
      const Index end = begin + (share < 1 ? 1 : share);
      if (!next.compare_exchange_weak(begin, end, std::memory_order_relaxed)) continue;
      body.run_row_range(row, begin, end, worker);
      begin = next.load(std::memory_order_relaxed);
    }
  }

  // One row's cursor a cache line (the workers of different rows claim at the same time).
  struct alignas(64) Cursor {
    std::atomic<Index> next{0};
  };
  Cursor cursors_[kMaxRows];
  Index rows_, columns_;
  Index workers_;
  RegionFailure failure_;
};

// The queue of a region whose body is `Body`.
template <typename Body>
using RegionQueue = std::conditional_t<claims_by_rows<Body>::value, RowQueue, ItemQueue>;
template <typename Body>
RegionQueue<Body> make_region_queue(Index count, int workers, const Body& body) {
  if constexpr (claims_by_rows<Body>::value)
    return RowQueue(count, workers, body);
  else
    return ItemQueue(count, workers);
}

}  // namespace sdmha::detail
