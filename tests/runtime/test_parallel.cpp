// Tests of sdmha/detail/parallel.hpp (the runtime) and sdmha/region_trace.hpp: every item of a
// region runs exactly once whatever the number of workers (1 to 64, on a machine of any size),
// each worker index names one running thread, items are claimed in index order, the first
// exception reaches the caller and stops the region, a pool serves many regions and calls, a
// RegionTrace records what it should, a body that runs ranges gets them whole on one worker (and
// guided ranges on several when it asks, or rows when it claims by rows), and num_threads = 0
// resolves to a sane count.
// (Suite names match the ThreadSanitizer stage's filter in .ci/hardening.sh.)
#include "test_support.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>
#include <stdexcept>
#include <thread>

namespace sdmha_test {
namespace {

using sdmha::detail::parallel_for;
using sdmha::detail::ThreadPool;

// What one item saw: the worker index it was given and the thread that ran it.
struct ItemRun {
  std::atomic<int> runs{0};
  int worker = -1;
  std::thread::id thread;
};

// Runs a region of `count` items on `workers` workers and checks that every item ran once, that
// every worker index is in [0, workers), and that one worker index means one thread and two
// worker indices two threads.
void expect_each_item_once(Index count, int workers, ThreadPool* pool) {
  std::vector<ItemRun> runs(static_cast<std::size_t>(count));
  parallel_for(
      count, workers,
      [&](Index item, int worker) {
        ItemRun& run = runs[std::size_t(item)];
        run.runs.fetch_add(1, std::memory_order_relaxed);
        run.worker = worker;
        run.thread = std::this_thread::get_id();
      },
      pool);
  std::vector<std::thread::id> thread_of(static_cast<std::size_t>(workers));
  for (Index item = 0; item < count; ++item) {
    const ItemRun& run = runs[std::size_t(item)];
    ASSERT_EQ(run.runs.load(), 1) << "item " << item << " of " << count << " on " << workers;
    ASSERT_GE(run.worker, 0);
    ASSERT_LT(run.worker, workers);
    std::thread::id& thread = thread_of[std::size_t(run.worker)];
    if (thread == std::thread::id()) thread = run.thread;
    ASSERT_EQ(thread, run.thread) << "worker " << run.worker << " ran on two threads";
  }
  for (std::size_t a = 0; a < thread_of.size(); ++a)
    for (std::size_t b = a + 1; b < thread_of.size(); ++b)
      if (thread_of[a] != std::thread::id()) {
        ASSERT_NE(thread_of[a], thread_of[b])
            << "workers " << a << " and " << b << " share a thread";
      }
}

TEST(ThreadPoolParallelFor, EveryItemRunsExactlyOnceOnAnyNumberOfWorkers) {
  for (int workers : {1, 2, 3, 16, 64}) {
    ThreadPool pool;
    for (Index count :
         {Index(0), Index(1), Index(2), Index(5), Index(63), Index(64), Index(1000)}) {
      SCOPED_TRACE(::testing::Message() << workers << " workers, " << count << " items");
      expect_each_item_once(count, workers, &pool);
      {
        const ThreadPool::CallScope call(pool);
        expect_each_item_once(count, workers, &pool);
        expect_each_item_once(count, workers, &pool);
      }
      expect_each_item_once(count, workers, nullptr);  // threads started for the region
    }
    EXPECT_EQ(pool.started_threads(), workers - 1);
  }
}

TEST(ThreadPoolParallelFor, SixtyFourWorkersRunManyShortRegionsOnAnyMachine) {
  // 64 threads on a machine with fewer cores: pollers yield, so the region's items and its join
  // get the processors. Each region's sum is checked, and the whole run is timed for the report.
  ThreadPool pool;
  std::vector<Index> values(256);
  const auto start = std::chrono::steady_clock::now();
  {
    const ThreadPool::CallScope call(pool);
    for (int region = 0; region < 200; ++region) {
      parallel_for(
          Index(values.size()), 64,
          [&](Index item, int) { values[std::size_t(item)] = item + region; }, &pool);
      Index sum = 0;
      for (Index value : values) sum += value;
      ASSERT_EQ(sum, Index(values.size()) * (Index(values.size()) - 1) / 2 +
                         Index(values.size()) * region);
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  RecordProperty("seconds_for_200_regions_on_64_workers", std::to_string(seconds));
  EXPECT_EQ(pool.started_threads(), 63);
}

TEST(ThreadPoolParallelFor, EachWorkerClaimsItemsInIndexOrder) {
  ThreadPool pool;
  constexpr int kWorkers = 4;
  constexpr Index kItems = 2000;
  std::vector<std::vector<Index>> claimed(kWorkers);
  for (auto& items : claimed) items.reserve(kItems);
  parallel_for(
      kItems, kWorkers,
      [&](Index item, int worker) { claimed[std::size_t(worker)].push_back(item); }, &pool);
  Index total = 0;
  for (const auto& items : claimed) {
    EXPECT_TRUE(std::is_sorted(items.begin(), items.end()));
    total += Index(items.size());
  }
  EXPECT_EQ(total, kItems);
  // One worker: the plain loop, in order.
  std::vector<Index> order;
  parallel_for(
      5, 1, [&](Index item, int) { order.push_back(item); }, &pool);
  EXPECT_EQ(order, (std::vector<Index>{0, 1, 2, 3, 4}));
}

// A region whose item 0 throws while every other item first waits for that throw and then sleeps
// 100 microseconds: the exception reaches the caller, and the workers stop taking items long
// before the end. The wait and the sleep make the count independent of the machine's load: the
// worker that claimed item 0 may be descheduled before it throws (16 workers on 2 busy cores), and
// sleeping items leave it the processor to record the failure.
void expect_exception_stops_region(int workers, ThreadPool* pool) {
  constexpr Index kItems = 20000;
  std::atomic<bool> thrown{false};
  std::atomic<Index> ran{0};
  const auto body = [&](Index item, int) {
    if (item == 0) {
      thrown.store(true);
      throw std::runtime_error("item 0 failed");
    }
    while (!thrown.load()) std::this_thread::yield();
    ran.fetch_add(1, std::memory_order_relaxed);
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  };
  try {
    parallel_for(kItems, workers, body, pool);
    ADD_FAILURE() << "no exception from " << workers << " workers";
  } catch (const std::runtime_error& error) {
    EXPECT_STREQ(error.what(), "item 0 failed");
  }
  if (workers == 1)
    EXPECT_EQ(ran.load(), 0);
  else
    EXPECT_LT(ran.load(), kItems / 2) << workers << " workers";
}

TEST(ThreadPoolParallelFor, TheFirstExceptionReachesTheCallerAndStopsTheRegion) {
  ThreadPool pool;
  for (int workers : {1, 2, 3, 16}) {
    expect_exception_stops_region(workers, &pool);
    expect_exception_stops_region(workers, nullptr);
  }
  // Every item throwing: one exception comes back, and the pool serves the next region.
  EXPECT_THROW(parallel_for(
                   100, 8, [](Index, int) { throw std::logic_error("every item"); }, &pool),
               std::logic_error);
  expect_each_item_once(100, 8, &pool);
}

TEST(ThreadPoolParallelFor, APoolServesManyRegionsAndCallScopes) {
  ThreadPool pool;
  std::vector<double> out(333);
  for (int call = 0; call < 30; ++call) {
    ThreadPool::CallScope scope(pool);
    EXPECT_EQ(pool.open_calls(), 1);
    for (int region = 0; region < 20; ++region) {
      const int threads = 1 + (call + region) % 6;  // fewer workers than threads, and more
      const Index count = 1 + (call * 7 + region * 13) % Index(out.size());
      parallel_for(
          count, threads,
          [&](Index item, int worker) {
            ASSERT_LT(worker, threads);
            out[std::size_t(item)] = double(item) * 0.5 + call;
          },
          &pool);
      for (Index item = 0; item < count; ++item)
        ASSERT_EQ(out[std::size_t(item)], double(item) * 0.5 + call);
    }
    if (call % 3 == 0) {
      scope.close();  // closed early: the destructor does nothing more
      EXPECT_EQ(pool.open_calls(), 0);
      // Past the spin between calls: the helpers sleep, and the next region wakes them.
      std::this_thread::sleep_for(std::chrono::microseconds(300));
      expect_each_item_once(50, 6, &pool);
    }
  }
  EXPECT_EQ(pool.open_calls(), 0);
  EXPECT_EQ(pool.started_threads(), 5);
}

TEST(ThreadPoolParallelFor, APoolStopsWhetherItsThreadsPollOrSleep) {
  for (int round = 0; round < 20; ++round) {
    ThreadPool pool;
    const ThreadPool::CallScope call(pool);
    expect_each_item_once(40, 4, &pool);
    if (round % 2 == 1) std::this_thread::sleep_for(std::chrono::milliseconds(3));
  }  // the scope closes, then the pool stops its (polling or sleeping) threads
}

TEST(ThreadPoolParallelFor, AWorkspaceLeaseMarksACallInFlight) {
  sdmha::Workspace<float> workspace;
  {
    const sdmha::Workspace<float>::Lease lease(workspace, "test");
    EXPECT_EQ(lease.buffers().pool.open_calls(), 1);
    SDMHA_EXPECT_THROW_WITH(sdmha::Workspace<float>::Lease(workspace, "second"), sdmha::ConfigError,
                            "in use by another call");
    EXPECT_EQ(lease.buffers().pool.open_calls(), 1);
  }
  const sdmha::Workspace<float>::Lease again(workspace, "test");
  EXPECT_EQ(again.buffers().pool.open_calls(), 1);
}

TEST(ThreadPoolTrace, RecordsNamesItemsWorkersAndTimes) {
  ThreadPool pool;
  sdmha::RegionTrace trace;
  parallel_for(
      8, 2, [](Index, int) {}, &pool, "not traced");
  EXPECT_TRUE(trace.regions().empty());

  pool.set_trace(&trace);
  EXPECT_EQ(pool.trace(), &trace);
  const auto sleep_item = [](Index item, int) {
    std::this_thread::sleep_for(std::chrono::microseconds(200 * (item % 3)));
  };
  parallel_for(12, 3, sleep_item, &pool, "sleeping items");
  parallel_for(4, 1, sleep_item, &pool, "one worker");
  parallel_for(0, 4, sleep_item, &pool, "no items");  // nothing to record
  parallel_for(6, 2, sleep_item, &pool);
  EXPECT_THROW(parallel_for(
                   5, 2, [](Index, int) { throw std::runtime_error("traced"); }, &pool, "failing"),
               std::runtime_error);

  const auto& regions = trace.regions();
  ASSERT_EQ(regions.size(), 4u);
  EXPECT_STREQ(regions[0].name, "sleeping items");
  EXPECT_STREQ(regions[1].name, "one worker");
  EXPECT_STREQ(regions[2].name, "");
  EXPECT_STREQ(regions[3].name, "failing");
  EXPECT_EQ(regions[1].workers, 1);
  // Workers that took part: at most those asked for (a helper that arrives after the last item
  // is claimed sits the region out), and exactly one for a one-worker region.
  const Index items[] = {12, 4, 6, 5};
  const int workers[] = {3, 1, 2, 2};
  double previous_end = 0;
  for (std::size_t r = 0; r < regions.size(); ++r) {
    const sdmha::RegionRecord& region = regions[r];
    EXPECT_EQ(region.items, items[r]);
    EXPECT_GE(region.workers, 1);
    EXPECT_LE(region.workers, workers[r]);
    ASSERT_EQ(region.item_seconds.size(), std::size_t(items[r]));
    EXPECT_GE(region.begin_seconds, previous_end);
    EXPECT_GE(region.end_seconds, region.begin_seconds);
    previous_end = region.end_seconds;
    for (double seconds : region.item_seconds) {
      EXPECT_GE(seconds, 0.0);
      EXPECT_LE(seconds, region.end_seconds - region.begin_seconds);
    }
  }
  // A sleeping item lasts at least its sleep.
  for (Index item = 0; item < 12; ++item)
    EXPECT_GE(regions[0].item_seconds[std::size_t(item)], 200e-6 * double(item % 3));
  EXPECT_LE(regions.back().end_seconds, trace.now_seconds());

  trace.clear();
  EXPECT_TRUE(trace.regions().empty());
  EXPECT_LT(trace.now_seconds(), 1.0);
  pool.set_trace(nullptr);
  parallel_for(
      8, 2, [](Index, int) {}, &pool, "after");
  EXPECT_TRUE(trace.regions().empty());
}

TEST(ThreadPoolTrace, AWorkspaceTracesItsCallsAndTheResultsStayTheSame) {
  const auto c = make_case<float>(Shape{}, 5);
  const sdmha::SparseDenseMHA<float> layer(c.config, c.weights);
  auto options = c.options;
  options.num_threads = 2;
  sdmha::Workspace<float> workspace;
  EXPECT_EQ(workspace.trace(), nullptr);
  sdmha::AttentionResult<float> plain, traced;
  layer.forward(c.query(), {c.key, c.value}, options, workspace, plain);

  sdmha::RegionTrace trace;
  workspace.set_trace(&trace);
  EXPECT_EQ(workspace.trace(), &trace);
  layer.forward(c.query(), {c.key, c.value}, options, workspace, traced);
  workspace.set_trace(nullptr);
  ASSERT_EQ(plain.output.size(), traced.output.size());
  EXPECT_EQ(std::memcmp(plain.output.data(), traced.output.data(),
                        sizeof(float) * std::size_t(plain.output.size())),
            0);
  ASSERT_FALSE(trace.regions().empty());
  for (const sdmha::RegionRecord& region : trace.regions()) {
    EXPECT_NE(region.name, nullptr);
    EXPECT_GT(region.items, 0);
    EXPECT_GE(region.workers, 1);
    EXPECT_LE(region.workers, 2);
    EXPECT_EQ(region.item_seconds.size(), std::size_t(region.items));
  }
  const std::size_t recorded = trace.regions().size();
  layer.forward(c.query(), {c.key, c.value}, options, workspace, traced);
  EXPECT_EQ(trace.regions().size(), recorded);  // set_trace(nullptr): no more records
}

// A body that runs ranges: records each range it was handed (a single item is [item, item + 1))
// and marks each item of it.
struct RangeRecorder {
  std::vector<std::atomic<int>>& runs;
  std::mutex& mutex;
  std::vector<std::pair<Index, Index>>& ranges;
  void operator()(Index item, int worker) const { run_range(item, item + 1, worker); }
  void run_range(Index begin, Index end, int) const {
    for (Index item = begin; item < end; ++item)
      runs[std::size_t(item)].fetch_add(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mutex);
    ranges.emplace_back(begin, end);
  }
};

// Runs a Recorder body (RangeRecorder or one derived from it) over 1, 7, 64 and 1000 items on
// 1, 2, 3 and 8 workers, in a pool and without one; checks that every item ran once, then hands
// the ranges the body saw to `check(workers, count, ranges)`.
template <typename Recorder, typename Check>
void for_every_region(Check check) {
  ThreadPool pool;
  for (int workers : {1, 2, 3, 8}) {
    for (Index count : {1, 7, 64, 1000}) {
      for (ThreadPool* where : {&pool, static_cast<ThreadPool*>(nullptr)}) {
        std::vector<std::atomic<int>> runs(static_cast<std::size_t>(count));
        std::mutex mutex;
        std::vector<std::pair<Index, Index>> ranges;
        parallel_for(count, workers, Recorder{RangeRecorder{runs, mutex, ranges}}, where);
        for (Index item = 0; item < count; ++item)
          ASSERT_EQ(runs[std::size_t(item)].load(), 1)
              << "item " << item << " of " << count << " on " << workers;
        check(workers, count, ranges);
      }
    }
  }
}

TEST(ThreadPoolParallelFor, ABodyThatRunsRangesGetsOneRangeOnOneWorkerAndSingleItemsOnMore) {
  static_assert(sdmha::detail::runs_ranges<RangeRecorder>::value);
  static_assert(!sdmha::detail::runs_ranges<std::function<void(Index, int)>>::value);
  for_every_region<RangeRecorder>(
      [](int workers, Index count, const std::vector<std::pair<Index, Index>>& ranges) {
        if (workers == 1 || count == 1) {
          ASSERT_EQ(ranges.size(), 1u) << "one worker runs the region as one range";
          EXPECT_EQ(ranges[0], std::make_pair(Index(0), count));
        } else {
          ASSERT_EQ(ranges.size(), std::size_t(count)) << "several workers claim single items";
        }
      });
}

// A range body that asks for guided ranges on several workers.
struct GuidedRecorder : RangeRecorder {
  static constexpr bool kGuidedRanges = true;
};

TEST(ThreadPoolParallelFor, AGuidedRangeBodyGetsEveryItemOnceInShrinkingRanges) {
  using sdmha::detail::ItemQueue;
  static_assert(sdmha::detail::claims_guided_ranges<GuidedRecorder>::value);
  static_assert(!sdmha::detail::claims_guided_ranges<RangeRecorder>::value);
  for_every_region<GuidedRecorder>([](int workers, Index count,
                                      std::vector<std::pair<Index, Index>> ranges) {
    const int used = sdmha::detail::worker_count(count, workers);
    std::sort(ranges.begin(), ranges.end());
    for (const auto& range : ranges) {
      ASSERT_LT(range.first, range.second);
      // On several workers, a claim takes at most its share of what was left when it was
      // made.
      if (used > 1) {
        EXPECT_LE(range.second - range.first, ItemQueue::range_claim(count - range.first, used));
      }
    }
    if (used == 1) {
      EXPECT_EQ(ranges.size(), 1u) << "one worker runs the region as one range";
    }
  });
}

TEST(ThreadPoolParallelFor, RangeClaimsShrinkToSingleItemsAsTheItemsRunOut) {
  using sdmha::detail::ItemQueue;
  EXPECT_EQ(ItemQueue::range_claim(1000, 4), 1000 / (ItemQueue::kRangeShare * 4));
  EXPECT_EQ(ItemQueue::range_claim(3, 4), 1);
  EXPECT_EQ(ItemQueue::range_claim(1, 1), 1);
  EXPECT_EQ(ItemQueue::range_claim(10, 0), 10 / ItemQueue::kRangeShare);
  Index left = 1000, previous = ItemQueue::range_claim(left, 4);
  while (left > 0) {
    const Index claim = std::min(left, ItemQueue::range_claim(left, 4));
    EXPECT_LE(claim, previous);
    previous = claim;
    left -= claim;
  }
  EXPECT_EQ(previous, 1);
}

// A body that claims by rows: records each (row, columns) range and marks each item of it.
struct RowRecorder {
  Index rows;
  std::vector<std::atomic<int>>& runs;
  std::mutex& mutex;
  std::vector<std::array<Index, 4>>& claims;  // row, first column, end column, worker
  Index claim_rows() const { return rows; }
  void operator()(Index item, int worker) const {
    run_row_range(item % rows, item / rows, item / rows + 1, worker);
  }
  void run_row_range(Index row, Index first, Index end, int worker) const {
    for (Index column = first; column < end; ++column)
      runs[std::size_t(column * rows + row)].fetch_add(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mutex);
    claims.push_back({row, first, end, Index(worker)});
  }
};

TEST(ThreadPoolParallelFor, ARowBodyGetsEveryItemOnceAndWholeRowsWhenWorkersAreFew) {
  static_assert(sdmha::detail::claims_by_rows<RowRecorder>::value);
  static_assert(!sdmha::detail::claims_by_rows<RangeRecorder>::value);
  ThreadPool pool;
  for (Index rows : {1, 2, 3, 8, 65}) {
    for (Index columns : {1, 5, 8}) {
      for (int workers : {2, 3, 8, 16}) {
        for (ThreadPool* where : {&pool, static_cast<ThreadPool*>(nullptr)}) {
          const Index count = rows * columns;
          std::vector<std::atomic<int>> runs(static_cast<std::size_t>(count));
          std::mutex mutex;
          std::vector<std::array<Index, 4>> claims;
          parallel_for(count, workers, RowRecorder{rows, runs, mutex, claims}, where);
          for (Index item = 0; item < count; ++item)
            ASSERT_EQ(runs[std::size_t(item)].load(), 1)
                << "item " << item << " of " << rows << " x " << columns << " on " << workers;
          const int used = sdmha::detail::worker_count(count, workers);
          if (rows <= sdmha::detail::RowQueue::kMaxRows && used > 1 && used <= rows &&
              where == &pool) {
            // Each worker's first claim is a whole row: its own, w % rows, unless another
            // worker that had finished took it first (then the rest of it).
            for (const auto& claim : claims) {
              if (claim[0] == claim[3] % rows && claim[1] == 0) {
                EXPECT_EQ(claim[2], columns) << "row " << claim[0] << " of " << rows;
              }
            }
          }
          if (rows > sdmha::detail::RowQueue::kMaxRows) {
            for (const auto& claim : claims) EXPECT_EQ(claim[2] - claim[1], 1);
          }
        }
      }
    }
  }
}

TEST(ThreadPoolTrace, OneWorkerRunsARangeBodyWholeAndSharesItsTimeEqually) {
  ThreadPool pool;
  sdmha::RegionTrace trace;
  pool.set_trace(&trace);
  std::vector<std::atomic<int>> runs(6);
  std::mutex mutex;
  std::vector<std::pair<Index, Index>> ranges;
  struct Slow {
    RangeRecorder recorder;
    void operator()(Index item, int worker) const { run_range(item, item + 1, worker); }
    void run_range(Index begin, Index end, int worker) const {
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
      recorder.run_range(begin, end, worker);
    }
  };
  parallel_for(6, 1, Slow{{runs, mutex, ranges}}, &pool, "ranges");
  ASSERT_EQ(trace.regions().size(), 1u);
  const sdmha::RegionRecord& region = trace.regions()[0];
  EXPECT_EQ(region.items, 6);
  EXPECT_EQ(region.workers, 1);
  ASSERT_EQ(ranges.size(), 1u);
  double total = 0;
  for (double seconds : region.item_seconds) {
    EXPECT_EQ(seconds, region.item_seconds[0]);
    total += seconds;
  }
  EXPECT_GE(total, 3e-3);
  EXPECT_LE(total, region.end_seconds - region.begin_seconds);
}

TEST(ResolveThreadCount, ZeroTakesThePhysicalCoresAndAPositiveCountIsKept) {
  const unsigned hardware = std::max(1u, std::thread::hardware_concurrency());
  const int available = sdmha::detail::resolve_thread_count(0);
  EXPECT_GE(available, 1);
  EXPECT_LE(available, int(hardware));
  EXPECT_EQ(sdmha::detail::resolve_thread_count(0), available);  // read once, the same after
  const int physical = sdmha::detail::physical_core_count();
  EXPECT_GE(physical, 0);
  EXPECT_LE(physical, int(hardware));
  if (physical > 0) {
    EXPECT_EQ(available, physical);
  }
  for (int requested : {1, 2, 3, 16, 64, 1024}) {
    EXPECT_EQ(sdmha::detail::resolve_thread_count(requested), requested);
  }
}

}  // namespace
}  // namespace sdmha_test
