// sdmha/detail/parallel.hpp — a fork-join loop over independent work items.
//
// Work items are fixed by the problem (row blocks, (batch, head) pairs), never by the thread
// count, and each item writes its own output: results are bitwise the same for any thread count.
// Eigen's own threading is not used (sdmha never enables OpenMP), so threads never multiply.
#pragma once

#include <atomic>
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

// Calls body(item, worker) for item in [0, count) on worker_count(count, threads) threads (the
// caller's included); `worker` in [0, worker_count) lets an item use that worker's scratch.
// Items are handed out dynamically; the first exception thrown by any item is rethrown.
template <typename Body>
void parallel_for(Index count, int threads, Body&& body) {
  if (count <= 0) return;
  const int workers = worker_count(count, threads);
  if (workers == 1) {
    for (Index item = 0; item < count; ++item) body(item, 0);
    return;
  }
  std::atomic<Index> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto work = [&](int worker) {
    try {
      for (Index item = next.fetch_add(1); item < count; item = next.fetch_add(1)) body(item, worker);
    } catch (...) {
      std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
      next.store(count);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(workers - 1));
  // A thread that cannot be created (resource limits) only means fewer workers: items are
  // independent of who runs them, so the result is the same.
  for (int worker = 1; worker < workers; ++worker) {
    try {
      pool.emplace_back(work, worker);
    } catch (const std::system_error&) {
      break;
    }
  }
  work(0);
  for (auto& thread : pool) thread.join();
  if (failure) std::rethrow_exception(failure);
}

// Row blocks of a fixed height, so that projections split the same way for any thread count.
constexpr Index kProjectionRowBlock = 64;
// Rows per query-projection work item: enough stored values per item for the by-feature kernel
// to pay on wide queries (see stages/query_projection.hpp).
constexpr Index kQueryProjectionRowBlock = 256;
// Query steps per attention work item: the scores in flight are kQueryTile × S per worker, never
// the whole (B, H, T, S) tensor.
constexpr Index kQueryTile = 64;

inline Index row_block_count(Index rows) {
  return (rows + kProjectionRowBlock - 1) / kProjectionRowBlock;
}

}  // namespace sdmha::detail
