// sdmha/detail/parallel.hpp — a fork-join loop over independent work items, on threads started
// for the call or on a persistent ThreadPool.
//
// Work items are fixed by the problem (row blocks, (batch, head) pairs), never by the thread
// count, and each item writes its own output: results are bitwise the same for any thread count.
// Eigen's own threading is not used (sdmha never enables OpenMP), so threads never multiply.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "sdmha/config.hpp"

namespace sdmha::detail {

inline int resolve_thread_count(int requested) {
  if (requested > 0) return requested;
  const unsigned hardware = std::thread::hardware_concurrency();
  return hardware == 0 ? 1 : static_cast<int>(hardware);
}

// The number of workers parallel_for uses for `count` items on `threads` threads.
inline int worker_count(Index count, int threads) {
  return static_cast<int>(std::max<Index>(1, std::min<Index>(std::max(threads, 1), count)));
}

// Deals items [0, count) to the workers that call run_items, and keeps the first exception.
// Items are dealt round-robin, not taken first come first served: share `offset` of `shares`
// is items offset, offset + shares, …, the same items on every call. So each thread sees the
// same work, and the scratch it keeps between calls (Eigen's packing blocks, the stages'
// per-thread buffers) reaches its final size in the first call: later calls with the same
// shapes allocate nothing. Items are fine-grained (row blocks, (b, h, tile)), so the deal is even.
class ItemQueue {
 public:
  ItemQueue(Index count, int shares) : count_(count), shares_(shares) {}
  template <typename Body>
  void run_items(Body& body, int offset, int worker) {
    try {
      for (Index item = offset; item < count_ && !failed_.load(std::memory_order_relaxed);
           item += shares_)
        body(item, worker);
    } catch (...) {
      std::lock_guard<std::mutex> lock(failure_mutex_);
      if (!failure_) failure_ = std::current_exception();
      failed_.store(true);
    }
  }
  void rethrow_failure() {
    if (failure_) std::rethrow_exception(failure_);
  }

 private:
  Index count_;
  int shares_;
  std::atomic<bool> failed_{false};
  std::exception_ptr failure_;
  std::mutex failure_mutex_;
};

// Worker threads that outlive the calls they serve, so that a repeated call neither starts
// threads nor allocates. run() is not reentrant: one call at a time per pool (a Workspace owns
// one and is used by one thread at a time). Threads are started on first need, up to the most
// ever requested, and stopped by the destructor.
class ThreadPool {
 public:
  ThreadPool() = default;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_.store(true, std::memory_order_relaxed);
    }
    wake_.notify_all();
    for (auto& thread : threads_) thread.join();
  }

  // The threads started so far (the caller of run() is one more worker).
  int started_threads() const { return static_cast<int>(threads_.size()); }

  // Calls body(item, worker) for every item on `workers` workers: the caller and workers − 1
  // pool threads (fewer when threads cannot be created; the result does not depend on it).
  template <typename Body>
  void run(Index count, int workers, Body& body) {
    const int helpers = start_threads(workers - 1);
    ItemQueue queue(count, helpers + 1);
    Job job{&queue, &body, &invoke<Body>, helpers};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = job;
      pending_.store(helpers, std::memory_order_relaxed);
      generation_.store(generation_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    }
    if (helpers > 0) wake_.notify_all();
    queue.run_items(body, 0, 0);
    if (!spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock<std::mutex> lock(mutex_);
      done_.wait(lock, [&] { return pending_.load(std::memory_order_relaxed) == 0; });
    }
    queue.rethrow_failure();
  }

 private:
  struct Job {
    ItemQueue* queue = nullptr;
    void* body = nullptr;
    void (*call)(ItemQueue&, void*, int) = nullptr;
    int helpers = 0;
  };

  template <typename Body>
  static void invoke(ItemQueue& queue, void* body, int worker) {
    queue.run_items(*static_cast<Body*>(body), worker, worker);
  }

  // Starts threads until `wanted` exist (or creation fails); returns how many there are to use.
  int start_threads(int wanted) {
    while (static_cast<int>(threads_.size()) < wanted) {
      const int index = static_cast<int>(threads_.size());
      try {
        // The thread starts from the current generation: the job it is started for comes next.
        threads_.emplace_back(
            [this, index, generation = generation_.load(std::memory_order_relaxed)] {
              serve(index, generation);
            });
      } catch (const std::system_error&) {
        break;
      }
    }
    return std::min(wanted, static_cast<int>(threads_.size()));
  }

  // Waking a sleeping thread takes tens of microseconds (a system call, and on a virtual
  // machine an interrupt to the idle virtual CPU), as long as a small parallel loop: so a
  // thread that runs out of work first polls for up to kSpinTime before it sleeps. A forward
  // runs a handful of loops back to back, and the gaps between them are far shorter than that.
  static constexpr std::chrono::microseconds kSpinTime{100};
  template <typename Ready>
  static bool spin_until(Ready ready) {
    const auto until = std::chrono::steady_clock::now() + kSpinTime;
    do {
      for (int poll = 0; poll < 64; ++poll) {
        if (ready()) return true;
        std::this_thread::yield();
      }
    } while (std::chrono::steady_clock::now() < until);
    return ready();
  }

  void serve(int index, std::uint64_t seen) {
    for (;;) {
      Job job;
      spin_until([&] {
        return stopping_.load(std::memory_order_relaxed) ||
               generation_.load(std::memory_order_acquire) != seen;
      });
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] {
          return stopping_.load(std::memory_order_relaxed) ||
                 generation_.load(std::memory_order_relaxed) != seen;
        });
        if (stopping_.load(std::memory_order_relaxed)) return;
        seen = generation_.load(std::memory_order_relaxed);
        job = job_;
      }
      if (index >= job.helpers) continue;  // not needed for this call
      job.call(*job.queue, job.body, index + 1);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        pending_.fetch_sub(1, std::memory_order_release);
      }
      done_.notify_one();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  Job job_;
  // Written under mutex_; atomic so that spin_until may poll them without it.
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stopping_{false};
};

// Calls body(item, worker) for item in [0, count) on worker_count(count, threads) workers (the
// caller's thread included), on `pool`'s threads when one is given, else on threads started for
// this call; `worker` in [0, worker_count) lets an item use that worker's scratch. Items are dealt
// round-robin (see ItemQueue); the first exception thrown by any item is rethrown, and the other
// workers stop at their next item.
template <typename Body>
void parallel_for(Index count, int threads, Body&& body, ThreadPool* pool = nullptr) {
  if (count <= 0) return;
  const int workers = worker_count(count, threads);
  if (workers == 1) {
    for (Index item = 0; item < count; ++item) body(item, 0);
    return;
  }
  if (pool != nullptr) {
    pool->run(count, workers, body);
    return;
  }
  ItemQueue queue(count, workers);
  std::vector<std::thread> spawned;
  spawned.reserve(static_cast<std::size_t>(workers - 1));
  // A thread that cannot be created (resource limits) only means fewer workers: the caller runs
  // the shares nobody took, and items are independent of who runs them, so the result is the same.
  int started = 1;
  for (; started < workers; ++started) {
    try {
      spawned.emplace_back([&queue, &body, started] { queue.run_items(body, started, started); });
    } catch (const std::system_error&) {
      break;
    }
  }
  queue.run_items(body, 0, 0);
  for (int orphan = started; orphan < workers; ++orphan) queue.run_items(body, orphan, 0);
  for (auto& thread : spawned) thread.join();
  queue.rethrow_failure();
}

}  // namespace sdmha::detail
