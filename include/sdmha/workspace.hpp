// sdmha/workspace.hpp — Workspace: the memory and the worker threads of forward and backward
// calls, kept between calls so that a repeated call with the same shapes allocates nothing.
//
// A call plans its work first (detail::AttentionPlan): K and V, the projected query, the
// concatenated heads, and per worker one tile of scores and the scratch its stages ask for
// (workspace_size(), GEMM packing included). Without a workspace each call allocates them and
// starts its threads; with one, the first call sizes the buffers and starts the threads, and
// later calls with the same (or smaller) shapes reuse them. No stage keeps memory of its own.
//
//   sdmha::Workspace<float> workspace;            // one per calling thread
//   sdmha::AttentionResult<float> result;         // reused too: its tensors keep their memory
//   for (auto& batch : batches) layer.forward(batch.query, {key, value}, options, workspace,
//   result);
//
// backward takes a workspace the same way, with an MhaGradients to fill:
//
//   layer.backward(query, {key, value, context}, d_output, options, workspace, gradients);
//
// One workspace serves one call at a time: using it from two threads at once throws ConfigError
// (give each calling thread its own). Buffers grow to the largest shapes seen and are freed with
// the workspace; bytes() tells how much it holds, all of it.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "sdmha/attention_result.hpp"
#include "sdmha/config.hpp"
#include "sdmha/detail/parallel.hpp"
#include "sdmha/detail/scratch.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/options.hpp"
#include "sdmha/projected_context.hpp"

namespace sdmha {

namespace detail {

// One worker's memory: its stages' scratch, its tile buffers (scores or P, P after dropout,
// dP → dS), each of the plan's tile_entries, and a flag per tile row (fully blocked rows).
template <typename Scalar>
struct WorkerBuffers {
  ScratchBuffer stage;
  ScratchBuffer tiles;
  std::vector<char> row_flags;

  Eigen::Map<RowMatrix<Scalar>> tile(int which, Index rows, Index columns,
                                     Index tile_entries) const {
    Scalar* base = reinterpret_cast<Scalar*>(tiles.view().data) + which * tile_entries;
    return Eigen::Map<RowMatrix<Scalar>>(base, rows, columns);
  }
  std::size_t bytes() const { return stage.bytes() + tiles.bytes() + row_flags.capacity(); }
};

// Turns for sums taken in a fixed order across work items: per slot, the index of the next
// item allowed to add (the backward's terms of dK_bh and dV_bh, one slot per (b, h), in query
// tile order). An item waits for its turn and passes it on; an item that fails abandons the
// call, and every wait then ends.
class OrderedTurns {
 public:
  // `slots` slots at turn 0; grows the memory only when there are more slots than ever before.
  void reset(Index slots) {
    if (Index(turns_.size()) < slots)
      turns_ = std::vector<std::atomic<Index>>(static_cast<std::size_t>(slots));
    for (Index slot = 0; slot < slots; ++slot)
      turns_[std::size_t(slot)].store(0, std::memory_order_relaxed);
    abandoned_.store(false, std::memory_order_relaxed);
  }
  // Until `slot` is at `turn` (true, the writes of the item that passed it visible), or the call
  // was abandoned (false). Polls, then yields the processor (with more threads than cores, the
  // item it waits for may need this core).
  bool await(Index slot, Index turn) const {
    const std::atomic<Index>& word = turns_[std::size_t(slot)];
    for (int poll = 0;; ++poll) {
      if (word.load(std::memory_order_acquire) == turn) return true;
      if (abandoned_.load(std::memory_order_acquire)) return false;
      if (poll < 256)
        cpu_relax();
      else
        std::this_thread::yield();
    }
  }
  void pass(Index slot, Index turn) {
    turns_[std::size_t(slot)].store(turn, std::memory_order_release);
  }
  void abandon() { abandoned_.store(true, std::memory_order_release); }
  std::size_t bytes() const { return turns_.capacity() * sizeof(std::atomic<Index>); }

 private:
  std::vector<std::atomic<Index>> turns_;
  std::atomic<bool> abandoned_{false};
};

// What one backward call works in besides the forward's buffers.
template <typename Scalar>
struct BackwardBuffers {
  RowMatrix<Scalar> d_heads, d_queries, d_keys, d_values;  // dA, dQ, dK, dV
  RowMatrix<Scalar> gathered_input, gathered_output;  // rows of a non-finite input with a gradient
  std::vector<Index> gathered_rows, block_start;
  std::vector<char> block_flags;    // per row block of an input: all finite
  Vector<Scalar> d_stored;          // dX in CSR order when from_coo's order differs
  ScratchBuffer feature_groups;     // the whole query's CSC, for the query gradients by feature
  RowMatrix<Scalar> bias_partials;  // a broadcast bias's gradient: one partial sum per run
  // The backward's per-call arena, grow-only: partial sums of dK/dV and of the bias gradients'
  // column sums, finiteness flags, the CSC's buckets (carved per region by
  // detail/backward_projections.hpp).
  ScratchBuffer scratch;
  OrderedTurns tile_turns;  // dK_bh, dV_bh: each (b, h)'s query tiles add in order

  std::size_t bytes() const {
    auto matrix_bytes = [](const auto& m) { return std::size_t(m.size()) * sizeof(Scalar); };
    return matrix_bytes(d_heads) + matrix_bytes(d_queries) + matrix_bytes(d_keys) +
           matrix_bytes(d_values) + matrix_bytes(gathered_input) + matrix_bytes(gathered_output) +
           matrix_bytes(d_stored) + matrix_bytes(bias_partials) +
           (gathered_rows.capacity() + block_start.capacity()) * sizeof(Index) +
           block_flags.capacity() + feature_groups.bytes() + scratch.bytes() + tile_turns.bytes();
  }
};

// What one call works in. Matrices are resized to each call's shapes; Eigen reallocates only
// when the number of entries changes.
template <typename Scalar>
struct CallBuffers {
  ProjectedContext<Scalar> context;         // K and V, unless the caller passes a context
  ProjectedContext<Scalar> context_chunk;   // K and V of one chunk of key steps, when streamed
  RowMatrix<Scalar> projected_query;        // Q (project-first, the dense baseline, backward)
  RowMatrix<Scalar> heads;                  // [A_0 … A_{H−1}], B·T × H·Dv
  RowMatrix<Scalar> online_statistics;      // the online softmax's (m_t, l_t), B·T × 2·H
  std::vector<char> value_is_finite;        // per (b, h, key tile)
  std::vector<Index> feature_marks;         // the query statistics' scratch (Eq entries)
  std::vector<ScratchBuffer> query_groups;  // per query row block: its CSC by feature, if built
  std::vector<WorkerBuffers<Scalar>> workers;
  BackwardBuffers<Scalar> backward;
  ThreadPool pool;

  // Grows every worker's buffers to the plan's sizes, on the calling thread, before the workers
  // start: a worker never allocates.
  void prepare_workers(int count, std::size_t stage_bytes, Index tile_entries, int tiles_per_worker,
                       Index flag_rows = 0) {
    if (workers.size() < static_cast<std::size_t>(count))
      workers.resize(static_cast<std::size_t>(count));
    for (auto& worker : workers) {
      worker.stage.reserve(stage_bytes);
      worker.tiles.reserve(std::size_t(tiles_per_worker) * std::size_t(tile_entries) *
                           sizeof(Scalar));
      if (worker.row_flags.size() < static_cast<std::size_t>(flag_rows))
        worker.row_flags.resize(static_cast<std::size_t>(flag_rows));
    }
  }

  std::size_t bytes() const {
    auto matrix_bytes = [](const RowMatrix<Scalar>& m) {
      return std::size_t(m.size()) * sizeof(Scalar);
    };
    std::size_t total = matrix_bytes(context.keys) + matrix_bytes(context.values) +
                        matrix_bytes(context_chunk.keys) + matrix_bytes(context_chunk.values) +
                        matrix_bytes(projected_query) + matrix_bytes(heads) +
                        matrix_bytes(online_statistics) + value_is_finite.capacity() +
                        feature_marks.capacity() * sizeof(Index);
    for (const auto& worker : workers) total += worker.bytes();
    for (const auto& groups : query_groups) total += groups.bytes();
    return total + backward.bytes();
  }
};

}  // namespace detail

template <typename Scalar>
class Workspace {
 public:
  Workspace() : buffers_(std::make_unique<detail::CallBuffers<Scalar>>()) {}
  Workspace(Workspace&& other) noexcept : buffers_(std::move(other.buffers_)) {}
  Workspace& operator=(Workspace&& other) noexcept {
    buffers_ = std::move(other.buffers_);
    return *this;
  }

  // Bytes held: every buffer, the workers' stage scratch and GEMM packing included.
  std::size_t bytes() const { return buffers_ ? buffers_->bytes() : 0; }
  // Worker threads started so far (the calling thread works too, so a call on N threads keeps
  // N − 1 here).
  int threads() const { return buffers_ ? buffers_->pool.started_threads() : 0; }

  // Records every parallel region of the calls run on this workspace in `trace` (see
  // region_trace.hpp: where a call's time goes), until set_trace(nullptr), the default. Tracing
  // allocates and times every item: for measuring, not for steady-state calls. Call it between
  // calls, from the thread that makes them; the trace must outlive its use here.
  void set_trace(RegionTrace* trace) {
    if (buffers_) buffers_->pool.set_trace(trace);
  }
  RegionTrace* trace() const { return buffers_ ? buffers_->pool.trace() : nullptr; }

  // Exclusive use for the duration of one call: a second concurrent user gets ConfigError. The
  // lease also marks the call in flight on the workspace's threads (ThreadPool::CallScope): they
  // poll between the call's parallel regions, which then start within microseconds, and go to
  // sleep shortly after the lease ends.
  class Lease {
   public:
    Lease(Workspace& workspace, const char* where)
        : workspace_(acquire(workspace, where)), call_(workspace.buffers_->pool) {}
    ~Lease() {
      call_.close();
      workspace_.in_use_.store(false, std::memory_order_release);
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    detail::CallBuffers<Scalar>& buffers() const { return *workspace_.buffers_; }

   private:
    static Workspace& acquire(Workspace& workspace, const char* where) {
      if (!workspace.buffers_)
        detail::fail<ConfigError>(where, "workspace was moved from; expected a live Workspace");
      if (workspace.in_use_.exchange(true, std::memory_order_acquire))
        detail::fail<ConfigError>(where,
                                  "workspace is in use by another call; expected one "
                                  "Workspace per calling thread");
      return workspace;
    }

    Workspace& workspace_;
    detail::ThreadPool::CallScope call_;
  };

 private:
  std::unique_ptr<detail::CallBuffers<Scalar>> buffers_;
  std::atomic<bool> in_use_{false};
};

namespace detail {

// The workspaces a layer keeps for its calls that are given none (forward, backward and
// project_context without a Workspace). Such a call borrows an idle one, or makes one, and gives
// it back when it returns, so a repeated call reuses memory and threads as it would with a
// caller's Workspace: allocating every buffer afresh costs first-touch page faults on tens of MB
// and starting threads, more than the forward itself on small layers. As many are kept as calls
// have run at once; release() frees them. Copies and moves of a layer start with none.
template <typename Scalar>
class WorkspaceCache {
 public:
  WorkspaceCache() = default;
  WorkspaceCache(const WorkspaceCache&) {}
  WorkspaceCache& operator=(const WorkspaceCache&) { return *this; }

  // One idle workspace (or a new one) for the duration of a call.
  class Borrowed {
   public:
    explicit Borrowed(const WorkspaceCache& cache) : cache_(cache), workspace_(cache.take()) {}
    ~Borrowed() { cache_.give_back(std::move(workspace_)); }
    Borrowed(const Borrowed&) = delete;
    Borrowed& operator=(const Borrowed&) = delete;
    Workspace<Scalar>& workspace() const { return *workspace_; }

   private:
    const WorkspaceCache& cache_;
    std::unique_ptr<Workspace<Scalar>> workspace_;
  };

  // Bytes held by the idle workspaces (a borrowed one is counted when it is given back).
  std::size_t bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::size_t total = 0;
    for (const auto& workspace : idle_) total += workspace->bytes();
    return total;
  }
  // Frees the idle workspaces and stops their threads.
  void release() const {
    std::vector<std::unique_ptr<Workspace<Scalar>>> freed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      freed.swap(idle_);
    }
  }

 private:
  std::unique_ptr<Workspace<Scalar>> take() const {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!idle_.empty()) {
        std::unique_ptr<Workspace<Scalar>> workspace = std::move(idle_.back());
        idle_.pop_back();
        return workspace;
      }
    }
    return std::make_unique<Workspace<Scalar>>();
  }
  // Never throws: a workspace that cannot be kept (no memory for the list) is freed instead.
  void give_back(std::unique_ptr<Workspace<Scalar>> workspace) const noexcept {
    try {
      std::lock_guard<std::mutex> lock(mutex_);
      idle_.push_back(std::move(workspace));
    } catch (...) {
    }
  }

  mutable std::mutex mutex_;
  mutable std::vector<std::unique_ptr<Workspace<Scalar>>> idle_;
};

}  // namespace detail

}  // namespace sdmha
