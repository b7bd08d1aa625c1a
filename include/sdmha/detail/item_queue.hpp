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
      if (!failed_.exchange(true, std::memory_order_acq_rel)) failure_ = std::current_exception();
      next_.store(count_, std::memory_order_relaxed);
    }
  }
  // On the calling thread once every worker is done (their writes published by the join).
  void rethrow_failure() {
    if (failure_) std::rethrow_exception(failure_);
  }

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
  alignas(64) std::atomic<bool> failed_{false};
  std::exception_ptr failure_;
};

}  // namespace sdmha::detail
