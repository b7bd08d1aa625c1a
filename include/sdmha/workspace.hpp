// sdmha/workspace.hpp — Workspace: the memory and the worker threads of forward and backward
// calls, kept between calls so that a repeated call with the same shapes allocates nothing.
//
// A forward call needs K and V (B·S × H·Dk, B·S × H·Dv), the projected query (B·T × H·Dk), the
// concatenated heads (B·T × H·Dv), one query tile × S score block per worker, and threads. Without
// a workspace each call allocates them and starts its threads; with one, the first call sizes the
// buffers and starts the threads, and later calls with the same (or smaller) shapes reuse them.
// Eigen's GEMM packing blocks are kept per thread (detail/gemm.hpp), so with the workspace's
// persistent threads those stop allocating too.
//
//   sdmha::Workspace<float> workspace;            // one per calling thread
//   sdmha::AttentionResult<float> result;         // reused too: its tensors keep their memory
//   for (auto& batch : batches) layer.forward(batch.query, key, value, options, workspace, result);
//
// backward (sdmha/backward.hpp) takes a workspace the same way, with an MhaGradients to fill:
//
//   layer.backward(query, key, value, context, d_output, options, workspace, gradients);
//
// One workspace serves one call at a time: using it from two threads at once throws ConfigError
// (give each calling thread its own). Buffers grow to the largest shapes seen and are freed with
// the workspace; bytes() tells how much it holds.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <vector>

#include "sdmha/config.hpp"
#include "sdmha/detail/parallel.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/options.hpp"

namespace sdmha {

namespace detail {

// What one backward call works in besides CallBuffers' context, pool and strategy scratch: Q,
// dA = dY·Woᵀ, the heads A, dQ, dK, dV, per-worker tile scratch, and the gathers of the
// non-finite paths. Empty until a backward call uses the workspace.
template <typename Scalar>
struct BackwardBuffers {
  RowMatrix<Scalar> queries, d_heads, heads, d_queries, d_keys, d_values;
  std::vector<RowMatrix<Scalar>> tile_probabilities, tile_dropped, tile_d_scores;  // per worker
  std::vector<Index> gathered_rows, block_start;
  RowMatrix<Scalar> gathered_input, gathered_output;
  Vector<Scalar> d_stored;

  std::size_t bytes() const {
    auto matrix_bytes = [](const auto& m) { return std::size_t(m.size()) * sizeof(Scalar); };
    std::size_t total = matrix_bytes(queries) + matrix_bytes(d_heads) + matrix_bytes(heads) +
                        matrix_bytes(d_queries) + matrix_bytes(d_keys) + matrix_bytes(d_values) +
                        matrix_bytes(gathered_input) + matrix_bytes(gathered_output) +
                        matrix_bytes(d_stored) +
                        (gathered_rows.capacity() + block_start.capacity()) * sizeof(Index);
    for (const auto* list : {&tile_probabilities, &tile_dropped, &tile_d_scores})
      for (const auto& m : *list) total += matrix_bytes(m);
    return total;
  }
};

// What one forward call works in. Matrices are resized to each call's shapes; Eigen reallocates
// only when the number of entries changes.
template <typename Scalar>
struct CallBuffers {
  ProjectedContext<Scalar> context;              // K and V, unless the caller passes a context
  RowMatrix<Scalar> projected_query;             // Q (project-first, and the dense baseline)
  RowMatrix<Scalar> heads;                       // [A_0 … A_{H−1}], B·T × H·Dv
  std::vector<char> value_is_finite;             // per (b, h)
  std::vector<RowMatrix<Scalar>> tile_scores;    // per worker: the query tile's scores
  std::vector<RowMatrix<Scalar>> tile_dropped;   // per worker: probabilities after dropout
  std::vector<Index> feature_batch;              // the score-strategy cost model's scratch
  BackwardBuffers<Scalar> backward;              // the rest of a backward call's memory
  ThreadPool pool;

  // Grows a per-worker list to `workers` entries (keeping what the entries hold).
  template <typename T>
  static void ensure_workers(std::vector<T>& list, int workers) {
    if (list.size() < static_cast<std::size_t>(workers)) list.resize(static_cast<std::size_t>(workers));
  }

  std::size_t bytes() const {
    auto matrix_bytes = [](const RowMatrix<Scalar>& m) { return std::size_t(m.size()) * sizeof(Scalar); };
    std::size_t total = matrix_bytes(context.keys) + matrix_bytes(context.values) +
                        matrix_bytes(projected_query) + matrix_bytes(heads) + value_is_finite.capacity() +
                        feature_batch.capacity() * sizeof(Index);
    for (const auto& m : tile_scores) total += matrix_bytes(m);
    for (const auto& m : tile_dropped) total += matrix_bytes(m);
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

  // Bytes held in buffers (not counting the per-thread GEMM packing blocks, which belong to the
  // threads: about kc·(mc + nc) scalars each, a few hundred KB).
  std::size_t bytes() const { return buffers_ ? buffers_->bytes() : 0; }
  // Worker threads started so far (the calling thread works too, so a call on N threads keeps
  // N − 1 here).
  int threads() const { return buffers_ ? buffers_->pool.started_threads() : 0; }

  // Exclusive use for the duration of one call: a second concurrent user gets ConfigError.
  class Lease {
   public:
    Lease(Workspace& workspace, const char* where) : workspace_(workspace) {
      if (!workspace.buffers_)
        detail::fail<ConfigError>(where, "workspace was moved from; expected a live Workspace");
      if (workspace.in_use_.exchange(true, std::memory_order_acquire))
        detail::fail<ConfigError>(where, "workspace is in use by another call; expected one "
                                         "Workspace per calling thread");
    }
    ~Lease() { workspace_.in_use_.store(false, std::memory_order_release); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    detail::CallBuffers<Scalar>& buffers() const { return *workspace_.buffers_; }

   private:
    Workspace& workspace_;
  };

 private:
  std::unique_ptr<detail::CallBuffers<Scalar>> buffers_;
  std::atomic<bool> in_use_{false};
};

}  // namespace sdmha
