// sdmha/detail/parallel.hpp — the runtime: a fork-join loop over independent work items
// (parallel_for), on a persistent ThreadPool or on threads started for the call.
//
// Work items are fixed by the problem (row blocks, (batch, head) pairs), never by the thread
// count, and each item writes its own output: results are bitwise the same for any thread count
// and whichever worker runs an item. Items are claimed dynamically, in index order, by whichever
// worker is free (callers put the costliest first), so a slow or preempted core delays only the
// items it holds. Eigen's own threading is not used (sdmha never enables OpenMP), so threads
// never multiply.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64) || defined(_M_IX86)
#include <immintrin.h>
#endif

#include "sdmha/config.hpp"
#include "sdmha/detail/item_queue.hpp"
#include "sdmha/region_trace.hpp"

namespace sdmha::detail {

#if defined(__linux__)
// One integer from /sys/devices/system/cpu/cpuN/topology/<field>; false when unreadable.
inline bool read_cpu_topology(int cpu, const char* field, long& value) {
  char path[96];
  std::snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu%d/topology/%s", cpu, field);
  std::FILE* file = std::fopen(path, "r");
  if (file == nullptr) return false;
  const bool read = std::fscanf(file, "%ld", &value) == 1;
  std::fclose(file);
  return read;
}
#endif

// The physical cores this process may run on: the CPUs of its affinity mask, each (package,
// core) pair counted once, so that the hardware threads of one core count as one (they share
// its FMA units and L1/L2, which the dense kernels fill from one thread). 0 when the topology
// cannot be read (not Linux, no /sys, more CPUs than a cpu_set_t holds).
inline int physical_core_count() {
#if defined(__linux__)
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return 0;
  std::vector<std::pair<long, long>> cores;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed)) continue;
    long package = 0, core = 0;
    if (!read_cpu_topology(cpu, "physical_package_id", package) ||
        !read_cpu_topology(cpu, "core_id", core))
      return 0;
    cores.emplace_back(package, core);
  }
  std::sort(cores.begin(), cores.end());
  return static_cast<int>(std::unique(cores.begin(), cores.end()) - cores.begin());
#else
  return 0;
#endif
}

// The worker threads of a call that asks for `requested`: that many, or for 0 the physical cores
// available to the process (physical_core_count; else std::thread::hardware_concurrency(); else
// 1), read once per process.
inline int resolve_thread_count(int requested) {
  if (requested > 0) return requested;
  static const int available = [] {
    const int cores = physical_core_count();
    if (cores > 0) return cores;
    const unsigned hardware = std::thread::hardware_concurrency();
    return hardware == 0 ? 1 : static_cast<int>(hardware);
  }();
  return available;
}

// The number of workers parallel_for uses for `count` items on `threads` threads.
inline int worker_count(Index count, int threads) {
  return static_cast<int>(std::max<Index>(1, std::min<Index>(std::max(threads, 1), count)));
}

// A hint to the core that this thread is polling (x86 PAUSE, ARM YIELD): it frees the pipeline
// for the core's other hardware thread and avoids a memory-order flush when the polled word
// changes.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64) || defined(_M_IX86)
  _mm_pause();
#elif defined(__aarch64__) || defined(__arm__)
  __asm__ __volatile__("yield");
#endif
}

// Polls `ready` until it holds (returns true) or budget() has passed since the wait began
// (returns false), with a pause between polls, or a yield of the processor when `yield` is set:
// when there are more threads than cores, a polling thread hands its core to a thread with work.
// Otherwise it does not yield: where other processes compete for the core, a yield gives it to
// them for their whole time slice (milliseconds), and the region would wait that long for this
// thread. The clock is read once per 64 polls.
template <typename Ready, typename Budget>
bool spin_until(Ready&& ready, Budget&& budget, bool yield) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    for (int poll = 0; poll < 64; ++poll) {
      if (ready()) return true;
      if (yield)
        std::this_thread::yield();
      else
        cpu_relax();
    }
    if (std::chrono::steady_clock::now() - start >= budget()) return ready();
  }
}

// Worker threads that outlive the calls they serve, so that a repeated call neither starts
// threads nor allocates. run() is not reentrant: one region at a time per pool (a Workspace owns
// one and is used by one thread at a time). Threads are started on first need, up to the most
// ever requested (a thread that cannot be created means fewer workers, the same result), and
// stopped by the destructor.
//
// The fork: the caller publishes the region (job_), opens its admission and bumps a generation
// word; idle helpers poll that word, and each needed one enters the region (a compare-exchange
// on the admission word) before it reads job_. The join: once the queue is dry the caller closes
// the admission, which tells it how many helpers entered, and polls until that many have
// finished. A helper that arrives after the close skips the region, so a caller never waits for
// a helper that is asleep, descheduled or late and would find no item left.
//
// Polling costs a core; sleeping on a condition variable costs a wake-up of tens of
// microseconds per region (a system call, and on a virtual machine an interrupt to an idle
// virtual CPU), as long as a small region. So helpers poll while a call is in flight (a
// CallScope is open: regions follow one another after short serial stretches) for up to
// kIdleInCall, and between calls for kIdleBetweenCalls, then sleep until the next region or the
// next call.
class ThreadPool {
 public:
  ThreadPool() = default;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_.store(true);
    }
    wake_.notify_all();
    for (auto& thread : threads_) thread.join();
  }

  // Marks one call in flight on this pool for its lifetime (Workspace::Lease opens one per
  // forward or backward call): helpers poll between its regions instead of sleeping, and
  // sleeping helpers are woken when it opens, so that they are polling by the first region.
  class CallScope {
   public:
    explicit CallScope(ThreadPool& pool) noexcept : pool_(&pool) { pool.open_call(); }
    ~CallScope() { close(); }
    CallScope(const CallScope&) = delete;
    CallScope& operator=(const CallScope&) = delete;
    // Ends the scope early (the destructor then does nothing).
    void close() noexcept {
      if (pool_ != nullptr) pool_->calls_open_.fetch_sub(1, std::memory_order_relaxed);
      pool_ = nullptr;
    }

   private:
    ThreadPool* pool_;
  };

  // The threads started so far (the caller of run() is one more worker).
  int started_threads() const { return static_cast<int>(threads_.size()); }
  // The CallScopes open on this pool now.
  int open_calls() const { return calls_open_.load(std::memory_order_relaxed); }

  // The trace that records this pool's regions (parallel_for), or nullptr: none.
  void set_trace(RegionTrace* trace) { trace_ = trace; }
  RegionTrace* trace() const { return trace_; }

  // Calls body(item, worker) for every item on up to `workers` workers: the caller (worker 0)
  // and up to workers − 1 pool threads (fewer when threads cannot be created or arrive after the
  // last item is claimed; the result does not depend on it). Returns the number of workers that
  // took part. Rethrows the first exception of any item once every worker has stopped.
  template <typename Body>
  int run(Index count, int workers, Body& body) {
    const int helpers = start_threads(workers - 1);
    RegionQueue<Body> queue = make_region_queue(count, helpers + 1, body);
    if (helpers > 0) {
      job_ = Job{&queue, const_cast<void*>(static_cast<const void*>(&body)), &invoke<Body>};
      finished_.store(0, std::memory_order_relaxed);
      post(helpers);
    }
    queue.run(body, 0);
    const int entered = helpers > 0 ? join() : 0;
    queue.rethrow_failure();
    return entered + 1;
  }

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::microseconds kIdleInCall{1000};
  static constexpr std::chrono::microseconds kIdleBetweenCalls{50};
  // The generation word: a sequence number above, the helpers wanted below, so that a helper
  // that is not needed learns it from the word alone. The admission word: the low 32 bits of
  // the same sequence number above, an open bit, and the helpers that entered below.
  static constexpr int kHelperBits = 24;
  static constexpr std::uint64_t kHelperMask = (std::uint64_t(1) << kHelperBits) - 1;
  static constexpr std::uint64_t kOpen = std::uint64_t(1) << 31;
  static constexpr std::uint64_t kEnteredMask = kOpen - 1;

  struct Job {
    void* queue = nullptr;  // the region's RegionQueue<Body>
    void* body = nullptr;
    void (*call)(void*, void*, int) = nullptr;
  };

  template <typename Body>
  static void invoke(void* queue, void* body, int worker) {
    static_cast<RegionQueue<Body>*>(queue)->run(*static_cast<Body*>(body), worker);
  }

  // Starts threads until `wanted` exist (or creation fails); returns how many there are to use.
  int start_threads(int wanted) {
    wanted = std::clamp(wanted, 0, static_cast<int>(kHelperMask));
    const std::size_t before = threads_.size();
    while (static_cast<int>(threads_.size()) < wanted) {
      const int index = static_cast<int>(threads_.size());
      try {
        // The thread starts from the current generation: the region it is started for comes next.
        threads_.emplace_back([this, index, seen = generation_.load(std::memory_order_relaxed)] {
          serve(index, seen);
        });
      } catch (const std::system_error&) {
        break;
      }
    }
    if (threads_.size() != before) {
      // More threads than processors: pollers yield, so that the threads with work get the
      // processors quickly (64 threads on 2 cores make progress).
      const unsigned processors = std::max(1u, std::thread::hardware_concurrency());
      oversubscribed_.store(threads_.size() + 1 > processors, std::memory_order_relaxed);
    }
    return std::min(wanted, static_cast<int>(threads_.size()));
  }

  bool oversubscribed() const { return oversubscribed_.load(std::memory_order_relaxed); }
  Clock::duration idle_budget() const {
    return calls_open_.load(std::memory_order_relaxed) > 0 ? Clock::duration(kIdleInCall)
                                                           : Clock::duration(kIdleBetweenCalls);
  }
  static std::uint64_t admission_sequence(std::uint64_t word) {
    return (word >> kHelperBits) & 0xffffffffu;
  }

  // The caller's side of the fork: open the admission, publish the region, wake any sleeping
  // helper. The sequentially consistent store and load pair with a sleeper's increment of
  // sleepers_ and its check of the word (under mutex_): one of the two sees the other, so no
  // sleeper misses a region.
  void post(int helpers) {
    const std::uint64_t word =
        (((generation_.load(std::memory_order_relaxed) >> kHelperBits) + 1) << kHelperBits) |
        std::uint64_t(helpers);
    admission_.store((admission_sequence(word) << 32) | kOpen, std::memory_order_relaxed);
    generation_.store(word);
    if (sleepers_.load() > 0) wake_all();
  }
  void wake_all() {
    { std::lock_guard<std::mutex> lock(mutex_); }
    wake_.notify_all();
  }
  void open_call() noexcept {
    calls_open_.fetch_add(1, std::memory_order_relaxed);
    call_openings_.fetch_add(1);
    if (sleepers_.load() > 0) wake_all();
  }

  // The caller's side of the join: close the admission, then wait for the helpers that entered,
  // polling, then (after kIdleInCall: a long item still running) asleep on done_. Returns how
  // many entered.
  int join() {
    const int entered =
        static_cast<int>(admission_.fetch_and(~kOpen, std::memory_order_acq_rel) & kEnteredMask);
    const auto all_finished = [&] { return finished_.load(std::memory_order_acquire) == entered; };
    if (spin_until(
            all_finished, [] { return Clock::duration(kIdleInCall); }, oversubscribed()))
      return entered;
    std::unique_lock<std::mutex> lock(mutex_);
    caller_waiting_.store(true);
    done_.wait(lock, [&] { return finished_.load() == entered; });
    caller_waiting_.store(false, std::memory_order_relaxed);
    return entered;
  }

  // A helper's entry into the region of generation word `word`: false when the admission has
  // closed (the queue is dry) or moved on to a later region.
  bool enter(std::uint64_t word) {
    std::uint64_t state = admission_.load(std::memory_order_relaxed);
    for (;;) {
      if ((state >> 32) != admission_sequence(word) || (state & kOpen) == 0) return false;
      if (admission_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel,
                                           std::memory_order_relaxed))
        return true;
    }
  }

  // A helper's wait for the next region (a generation word other than `seen`), or for the pool
  // to stop (returns `seen`, with stopping_ set).
  std::uint64_t next_region(std::uint64_t seen) {
    for (;;) {
      std::uint64_t word = seen;
      const auto posted = [&] {
        word = generation_.load(std::memory_order_acquire);
        return word != seen || stopping_.load(std::memory_order_relaxed);
      };
      if (spin_until(
              posted, [&] { return idle_budget(); }, oversubscribed()))
        return word;
      std::unique_lock<std::mutex> lock(mutex_);
      const std::uint64_t openings = call_openings_.load();
      sleepers_.fetch_add(1);
      wake_.wait(lock, [&] {
        return generation_.load() != seen || stopping_.load() || call_openings_.load() != openings;
      });
      sleepers_.fetch_sub(1);
    }
  }

  void serve(int index, std::uint64_t seen) {
    for (;;) {
      seen = next_region(seen);
      if (stopping_.load(std::memory_order_relaxed)) return;
      if (std::uint64_t(index) >= (seen & kHelperMask) || !enter(seen)) continue;
      // job_ stays as it is until the caller has seen this helper finish.
      job_.call(job_.queue, job_.body, index + 1);
      // Wakes a caller that gave up polling (the same pairing as post's, on finished_).
      finished_.fetch_add(1);
      if (caller_waiting_.load()) {
        { std::lock_guard<std::mutex> lock(mutex_); }
        done_.notify_one();
      }
    }
  }

  // Written by the caller per region, polled by every idle helper: a cache line of its own.
  alignas(64) std::atomic<std::uint64_t> generation_{0};
  Job job_;
  // Updated by the caller and each entering helper once per region.
  alignas(64) std::atomic<std::uint64_t> admission_{0};
  // Updated by each helper that entered, polled by the caller.
  alignas(64) std::atomic<int> finished_{0};
  alignas(64) std::atomic<int> calls_open_{0};
  std::atomic<std::uint64_t> call_openings_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> caller_waiting_{false};
  std::atomic<bool> stopping_{false};
  std::atomic<bool> oversubscribed_{false};
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  RegionTrace* trace_ = nullptr;
};

// Runs the region's items on `workers` workers: on the calling thread for one (a range body
// runs them as one range), on `pool` when given, else on threads started for this region (a
// thread that cannot be created means fewer workers: the others claim its items). Returns the
// workers that took part.
template <typename Body>
int run_region(Index count, int workers, Body& body, ThreadPool* pool) {
  if (workers == 1) {
    if constexpr (runs_ranges<Body>::value)
      body.run_range(0, count, 0);
    else
      for (Index item = 0; item < count; ++item) body(item, 0);
    return 1;
  }
  if (pool != nullptr) return pool->run(count, workers, body);
  RegionQueue<Body> queue = make_region_queue(count, workers, body);
  std::vector<std::thread> spawned;
  spawned.reserve(static_cast<std::size_t>(workers - 1));
  for (int worker = 1; worker < workers; ++worker) {
    try {
      spawned.emplace_back([&queue, &body, worker] { queue.run(body, worker); });
    } catch (const std::system_error&) {
      break;
    }
  }
  queue.run(body, 0);
  for (auto& thread : spawned) thread.join();
  queue.rethrow_failure();
  return static_cast<int>(spawned.size()) + 1;
}

// A body that records each item's duration in `item_seconds`; a range timed whole and its time
// shared equally by its items, which is what each cost there.
template <typename Body>
struct TimedBody {
  static constexpr bool kGuidedRanges = claims_guided_ranges<Body>::value;
  Body& body;
  double* item_seconds;
  void operator()(Index item, int worker) {
    const auto start = std::chrono::steady_clock::now();
    body(item, worker);
    item_seconds[item] = seconds_since(start);
  }
  template <typename Self = Body, typename = std::enable_if_t<runs_ranges<Self>::value>>
  void run_range(Index begin, Index end, int worker) {
    const auto start = std::chrono::steady_clock::now();
    body.run_range(begin, end, worker);
    std::fill(item_seconds + begin, item_seconds + end, seconds_since(start) / double(end - begin));
  }
  template <typename Self = Body, typename = std::enable_if_t<claims_by_rows<Self>::value>>
  Index claim_rows() const {
    return body.claim_rows();
  }
  template <typename Self = Body, typename = std::enable_if_t<claims_by_rows<Self>::value>>
  void run_row_range(Index row, Index first_column, Index end_column, int worker) {
    const auto start = std::chrono::steady_clock::now();
    body.run_row_range(row, first_column, end_column, worker);
    const double share = seconds_since(start) / double(end_column - first_column);
    const Index rows = body.claim_rows();
    for (Index column = first_column; column < end_column; ++column)
      item_seconds[column * rows + row] = share;
  }
  static double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
};

// A region recorded in `trace`: its span, its workers and each item's duration.
template <typename Body>
void run_traced_region(Index count, int workers, Body& body, ThreadPool& pool, RegionTrace& trace,
                       const char* region) {
  const std::size_t record = trace.begin_region(region, count);
  TimedBody<Body> timed{body, trace.item_seconds(record)};
  int took_part = workers;
  try {
    took_part = run_region(count, workers, timed, &pool);
  } catch (...) {
    trace.end_region(record, took_part);
    throw;
  }
  trace.end_region(record, took_part);
}

// Calls body(item, worker) for item in [0, count) on worker_count(count, threads) workers (the
// caller's thread included), on `pool`'s threads when one is given, else on threads started for
// this call. `worker` is in [0, worker_count) and names one running thread, so an item may use
// that worker's scratch. Items are claimed in index order by whichever worker is free (see
// ItemQueue; on one worker, a body with run_range gets all items as one range: runs_ranges).
// The first exception thrown by any item is rethrown, and the other workers stop at their next
// item. `region` names the region in the pool's RegionTrace, when it has one.
template <typename Body>
void parallel_for(Index count, int threads, Body&& body, ThreadPool* pool = nullptr,
                  const char* region = "") {
  if (count <= 0) return;
  const int workers = worker_count(count, threads);
  if (pool != nullptr && pool->trace() != nullptr) {
    run_traced_region(count, workers, body, *pool, *pool->trace(), region);
    return;
  }
  run_region(count, workers, body, pool);
}

}  // namespace sdmha::detail
