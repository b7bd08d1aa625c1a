// sdmha/detail/parallel.hpp — a fork-join loop over independent work items.
//
// Work items are fixed by the problem (row blocks, (batch, head) pairs), never by the thread
// count, and each item writes its own output: results are bitwise the same for any thread count.
// Eigen's own threading is not used (sdmha never enables OpenMP), so threads never multiply.
#pragma once

#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "sdmha/config.hpp"

namespace sdmha::detail {

inline int resolve_thread_count(int requested) {
  if (requested > 0) return requested;
  const unsigned hardware = std::thread::hardware_concurrency();
  return hardware == 0 ? 1 : static_cast<int>(hardware);
}

// Calls body(item) for item in [0, count) on up to `threads` threads (the caller's included).
// Items are handed out dynamically; the first exception thrown by any item is rethrown.
template <typename Body>
void parallel_for(Index count, int threads, Body&& body) {
  if (count <= 0) return;
  const Index workers = std::min<Index>(std::max(threads, 1), count);
  if (workers == 1) {
    for (Index item = 0; item < count; ++item) body(item);
    return;
  }
  std::atomic<Index> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto work = [&]() {
    try {
      for (Index item = next.fetch_add(1); item < count; item = next.fetch_add(1)) body(item);
    } catch (...) {
      std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
      next.store(count);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(workers - 1));
  for (Index worker = 1; worker < workers; ++worker) pool.emplace_back(work);
  work();
  for (auto& thread : pool) thread.join();
  if (failure) std::rethrow_exception(failure);
}

// Row blocks of a fixed height, so that projections split the same way for any thread count.
constexpr Index kProjectionRowBlock = 64;

inline Index row_block_count(Index rows) {
  return (rows + kProjectionRowBlock - 1) / kProjectionRowBlock;
}

}  // namespace sdmha::detail
