// sdmha/detail/item_queue.hpp — how the workers of one parallel region share its items: an
// atomic counter that hands them out one at a time, in index order.
//
//   math:  items [0, count) each run exactly once, by whichever worker claims them
//   pre:   the body of an item writes only its own output and its worker's scratch
//   cost:  one atomic fetch-add per item
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
// that share set-up (the windows of one row block of the sparse query projection, each of which
// walks the block's stored values again) then share it. Several workers claim single items, in
// index order, which is what lets them share what neighbouring items read (the same columns
// of Wq for the row blocks of one window).
template <typename Body, typename = void>
struct runs_ranges : std::false_type {};
template <typename Body>
struct runs_ranges<Body,
                   std::void_t<decltype(std::declval<Body&>().run_range(Index(0), Index(0), 0))>>
    : std::true_type {};

// Items [0, count) handed out one at a time, in index order, to whichever worker asks (an atomic
// counter), and the first exception any item throws. After a failure the counter jumps to the
// end: the other workers finish the item they hold and take no more. Which worker runs an item
// does not matter: an item writes its own output, and a worker's scratch is sized by the plan
// for any item before the region starts (CallBuffers::prepare_workers).
class ItemQueue {
 public:
  explicit ItemQueue(Index count) : count_(count) {}

  template <typename Body>
  void run(Body& body, int worker) noexcept {
    try {
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
  // The counter every worker updates, on a cache line of its own (the queue lives on the
  // caller's stack, among its locals).
  alignas(64) std::atomic<Index> next_{0};
  Index count_;
  alignas(64) std::atomic<bool> failed_{false};
  std::exception_ptr failure_;
};

}  // namespace sdmha::detail
