// tests/support/allocation_counter.hpp — counts the heap of the process that includes it (the
// steady-state test's, the bench's): bytes live now and the peak since a mark.
//
// Every heap block of the process passes through one counter:
//  - operator new and delete (all of C++17's overloads: plain, array, nothrow, sized, aligned) are
//    replaced here and take their memory from malloc / aligned_alloc;
//  - malloc, free, calloc, realloc and aligned_alloc are wrapped by the linker
//    (-Wl,--wrap=malloc,..., see bench/CMakeLists.txt), so that the calls compiled into the bench
//    — Eigen's internal::aligned_malloc and aligned_realloc call std::malloc and std::realloc, and
//    the replaced operator new above — land in __wrap_malloc & co.
// A block counts as malloc_usable_size(block) bytes on the way in and on the way out, so the
// books balance exactly; that is the requested size rounded up by glibc (8–16 bytes for small
// blocks, to a page for large ones). `allocation_counting_check()` verifies the route end to end.
//
// This header defines the replacement functions: include it from exactly one translation unit.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

// Set by bench/CMakeLists.txt where the linker wraps malloc & co. (Linux, glibc).
#ifndef SDMHA_BENCH_WRAP_MALLOC
#define SDMHA_BENCH_WRAP_MALLOC 0
#endif
#if SDMHA_BENCH_WRAP_MALLOC
#include <malloc.h>
#endif

namespace sdmha_bench {

class AllocationCounter {
 public:
  static void allocated(std::size_t bytes) {
    count_.fetch_add(1, std::memory_order_relaxed);
    const std::int64_t now =
        live_.fetch_add(std::int64_t(bytes), std::memory_order_relaxed) + std::int64_t(bytes);
    std::int64_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
  static void freed(std::size_t bytes) {
    live_.fetch_sub(std::int64_t(bytes), std::memory_order_relaxed);
  }

  // Starts a measurement: the peak restarts from the bytes live now.
  static std::int64_t mark() {
    const std::int64_t now = live_.load(std::memory_order_relaxed);
    peak_.store(now, std::memory_order_relaxed);
    return now;
  }
  // The most bytes live at once since `mark()` returned `baseline`, above that baseline.
  static std::int64_t peak_above(std::int64_t baseline) {
    return peak_.load(std::memory_order_relaxed) - baseline;
  }
  static std::int64_t live() { return live_.load(std::memory_order_relaxed); }
  // Heap blocks taken since the start of the process.
  static std::int64_t allocations() { return count_.load(std::memory_order_relaxed); }

  // Whether the heap is counted at all: only where malloc is wrapped, since Eigen allocates
  // through it (without the wrap nothing is counted and memory is reported as unavailable).
  static constexpr bool counts_malloc() { return SDMHA_BENCH_WRAP_MALLOC != 0; }

  // Fault injection: the `n`th allocation from now (1: the next one) fails, malloc & co.
  // returning null and operator new throwing std::bad_alloc, and none after it; 0 disarms. For
  // one thread's allocations: with others allocating, which one fails is a race.
  static void fail_allocation(std::int64_t n) {
    countdown_.store(n < 0 ? 0 : n, std::memory_order_relaxed);
  }
  // Called by each allocation before it is made; true when it is the one to fail.
  static bool injected_failure() {
    if (countdown_.load(std::memory_order_relaxed) <= 0) return false;
    return countdown_.fetch_sub(1, std::memory_order_relaxed) == 1;
  }

 private:
  static inline std::atomic<std::int64_t> live_{0};
  static inline std::atomic<std::int64_t> peak_{0};
  static inline std::atomic<std::int64_t> count_{0};
  static inline std::atomic<std::int64_t> countdown_{0};
};

// Runs `call` once and returns the peak heap bytes it had live at once beyond what was live
// before it (its temporaries plus whatever it returns).
template <typename Call>
std::int64_t peak_heap_bytes(Call&& call) {
  const std::int64_t baseline = AllocationCounter::mark();
  call();
  return AllocationCounter::peak_above(baseline);
}

}  // namespace sdmha_bench

#if SDMHA_BENCH_WRAP_MALLOC
extern "C" {
void* __real_malloc(std::size_t size);
void __real_free(void* block);
void* __real_calloc(std::size_t count, std::size_t size);
void* __real_realloc(void* block, std::size_t size);
void* __real_aligned_alloc(std::size_t alignment, std::size_t size);

void* __wrap_malloc(std::size_t size) {
  if (sdmha_bench::AllocationCounter::injected_failure()) return nullptr;
  void* block = __real_malloc(size);
  if (block != nullptr) sdmha_bench::AllocationCounter::allocated(malloc_usable_size(block));
  return block;
}

void __wrap_free(void* block) {
  if (block == nullptr) return;
  sdmha_bench::AllocationCounter::freed(malloc_usable_size(block));
  __real_free(block);
}

void* __wrap_calloc(std::size_t count, std::size_t size) {
  if (sdmha_bench::AllocationCounter::injected_failure()) return nullptr;
  void* block = __real_calloc(count, size);
  if (block != nullptr) sdmha_bench::AllocationCounter::allocated(malloc_usable_size(block));
  return block;
}

void* __wrap_aligned_alloc(std::size_t alignment, std::size_t size) {
  if (sdmha_bench::AllocationCounter::injected_failure()) return nullptr;
  void* block = __real_aligned_alloc(alignment, size);
  if (block != nullptr) sdmha_bench::AllocationCounter::allocated(malloc_usable_size(block));
  return block;
}

// A moved block is counted as allocated before the old one is released, as it is in memory.
void* __wrap_realloc(void* block, std::size_t size) {
  if (size != 0 && sdmha_bench::AllocationCounter::injected_failure()) return nullptr;  // kept
  const std::size_t old_bytes = block == nullptr ? 0 : malloc_usable_size(block);
  void* moved = __real_realloc(block, size);
  if (moved == nullptr) {
    if (size == 0 && block != nullptr) sdmha_bench::AllocationCounter::freed(old_bytes);  // freed
    return nullptr;  // or failed, and the old block is untouched
  }
  sdmha_bench::AllocationCounter::allocated(malloc_usable_size(moved));
  sdmha_bench::AllocationCounter::freed(old_bytes);
  return moved;
}
}  // extern "C"
#endif

// Replaceable global allocation functions. They allocate through the (wrapped) C allocator, so
// that each block is counted once, in __wrap_malloc / __wrap_aligned_alloc / __wrap_free.
namespace sdmha_bench::detail {

inline void* counted_new(std::size_t size) {
  if (size == 0) size = 1;
  void* block = std::malloc(size);
  if (block == nullptr) throw std::bad_alloc();
  return block;
}

inline void* counted_new(std::size_t size, std::align_val_t alignment) {
  const std::size_t align = std::max(static_cast<std::size_t>(alignment), sizeof(void*));
  // aligned_alloc wants a size that is a multiple of the alignment.
  const std::size_t rounded = (std::max<std::size_t>(size, 1) + align - 1) / align * align;
  void* block = std::aligned_alloc(align, rounded);
  if (block == nullptr) throw std::bad_alloc();
  return block;
}

inline void counted_delete(void* block) noexcept { std::free(block); }

}  // namespace sdmha_bench::detail

void* operator new(std::size_t size) { return sdmha_bench::detail::counted_new(size); }
void* operator new[](std::size_t size) { return sdmha_bench::detail::counted_new(size); }
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  try {
    return sdmha_bench::detail::counted_new(size);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept {
  try {
    return sdmha_bench::detail::counted_new(size);
  } catch (...) {
    return nullptr;
  }
}
void* operator new(std::size_t size, std::align_val_t alignment) {
  return sdmha_bench::detail::counted_new(size, alignment);
}
void* operator new[](std::size_t size, std::align_val_t alignment) {
  return sdmha_bench::detail::counted_new(size, alignment);
}
void* operator new(std::size_t size, std::align_val_t alignment, const std::nothrow_t&) noexcept {
  try {
    return sdmha_bench::detail::counted_new(size, alignment);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t size, std::align_val_t alignment, const std::nothrow_t&) noexcept {
  try {
    return sdmha_bench::detail::counted_new(size, alignment);
  } catch (...) {
    return nullptr;
  }
}

void operator delete(void* block) noexcept { sdmha_bench::detail::counted_delete(block); }
void operator delete[](void* block) noexcept { sdmha_bench::detail::counted_delete(block); }
void operator delete(void* block, std::size_t) noexcept {
  sdmha_bench::detail::counted_delete(block);
}
void operator delete[](void* block, std::size_t) noexcept {
  sdmha_bench::detail::counted_delete(block);
}
void operator delete(void* block, const std::nothrow_t&) noexcept {
  sdmha_bench::detail::counted_delete(block);
}
void operator delete[](void* block, const std::nothrow_t&) noexcept {
  sdmha_bench::detail::counted_delete(block);
}
void operator delete(void* block, std::align_val_t) noexcept {
  sdmha_bench::detail::counted_delete(block);
}
void operator delete[](void* block, std::align_val_t) noexcept {
  sdmha_bench::detail::counted_delete(block);
}
void operator delete(void* block, std::size_t, std::align_val_t) noexcept {
  sdmha_bench::detail::counted_delete(block);
}
void operator delete[](void* block, std::size_t, std::align_val_t) noexcept {
  sdmha_bench::detail::counted_delete(block);
}
void operator delete(void* block, std::align_val_t, const std::nothrow_t&) noexcept {
  sdmha_bench::detail::counted_delete(block);
}
void operator delete[](void* block, std::align_val_t, const std::nothrow_t&) noexcept {
  sdmha_bench::detail::counted_delete(block);
}
