// sdmha/detail/scratch.hpp — ScratchBuffer, the grow-only aligned memory a Workspace keeps per
// worker, and ScratchCarver, which deals it out to a stage call as typed arrays.
//
// Sizes are planned before a parallel pass (AttentionPlan), so a buffer grows on the calling
// thread before the workers start and never inside them: the steady state allocates nothing.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>

#include "sdmha/config.hpp"
#include "sdmha/stage.hpp"

namespace sdmha::detail {

// Rounds `bytes` up to the scratch alignment, so that consecutive carvings stay aligned.
constexpr std::size_t aligned_bytes(std::size_t bytes) {
  return (bytes + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
}

// The bytes of `count` objects of T in a carving (T trivially copyable).
template <typename T>
constexpr std::size_t array_bytes(Index count) {
  return aligned_bytes(std::size_t(count > 0 ? count : 0) * sizeof(T));
}

class ScratchBuffer {
 public:
  // Grows to at least `bytes` (contents are not kept); never shrinks.
  void reserve(std::size_t bytes) {
    if (bytes <= capacity_) return;
    const std::size_t size = aligned_bytes(bytes);
    data_.reset(static_cast<std::byte*>(::operator new(size, std::align_val_t(kScratchAlignment))));
    capacity_ = size;
  }
  StageScratch view() const { return {data_.get(), capacity_}; }
  std::size_t bytes() const { return capacity_; }

 private:
  struct Free {
    void operator()(std::byte* data) const {
      ::operator delete(data, std::align_val_t(kScratchAlignment));
    }
  };
  std::unique_ptr<std::byte, Free> data_;
  std::size_t capacity_ = 0;
};

// The memory of one call: the caller's scratch when it holds `bytes`, otherwise a buffer of its
// own, freed with this object. A stage or GEMM called without a planned workspace (or with one
// planned for smaller shapes) so gives the same result, with an allocation.
class ScratchOrOwn {
 public:
  ScratchOrOwn(StageScratch scratch, std::size_t bytes) : view_(scratch) {
    if (bytes == 0 || (scratch.data != nullptr && scratch.bytes >= bytes)) return;
    own_.reserve(bytes);
    view_ = own_.view();
  }
  StageScratch view() const { return view_; }

 private:
  ScratchBuffer own_;
  StageScratch view_;
};

// Takes typed arrays off the front of a StageScratch; the caller has sized it (a stage's
// workspace_size adds the same array_bytes). Running out is a planning bug, caught in debug builds
// and reported as nullptr in release builds, where callers fall back to a slower path.
class ScratchCarver {
 public:
  explicit ScratchCarver(StageScratch scratch) : next_(scratch.data), left_(scratch.bytes) {}

  template <typename T>
  T* take(Index count) {
    const std::size_t bytes = array_bytes<T>(count);
    if (bytes > left_ || next_ == nullptr) return nullptr;
    T* result = reinterpret_cast<T*>(next_);
    next_ += bytes;
    left_ -= bytes;
    return result;
  }
  StageScratch rest() const { return {next_, left_}; }

 private:
  std::byte* next_;
  std::size_t left_;
};

}  // namespace sdmha::detail
