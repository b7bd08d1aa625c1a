// Tests of forward's thread safety (sparse_dense_mha.hpp: "forward is const and safe to call from
// several threads at once"): one layer object called from 8 threads at once, 100 calls each, each
// thread with inputs of its own, every result bitwise equal to the one computed beforehand on a
// single thread. .ci/hardening.sh runs this suite under ThreadSanitizer (filter Concurrency*).
#include "test_support.hpp"

#include "dense_mha.hpp"  // the bench's dense baseline (bench/), which the layers are compared with

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

namespace sdmha_test {
namespace {

SDMHA_SCALAR_TYPED_TEST_SUITE(Concurrency);

constexpr int kThreads = 8;
constexpr int kCallsPerThread = 100;

// The layer's widths, shared by every thread's inputs; the rest of each thread's problem differs.
Shape thread_shape(int thread) {
  Shape s = Shape{}
                .sized(1 + thread % 3, 3 + thread, 4 + (thread * 5) % 7)
                .widths(20, 12, 10)
                .with_heads(2, 4, 3, 7);
  s.density = 0.15;
  s.random_mask = thread % 2 == 1;
  s.causal = thread % 4 >= 2;
  s.key_mask = thread % 3 == 2;
  s.empty_rows = thread == 5;
  s.duplicates = thread == 6;
  return s;
}

template <typename Scalar>
bool bitwise_equal(const Scalar* a, const Scalar* b, Index count) {
  return count == 0 || std::memcmp(a, b, sizeof(Scalar) * std::size_t(count)) == 0;
}

// Each thread's call: its query, key, value and options, and what a lone call returned.
template <typename Scalar>
struct ThreadWork {
  Case<Scalar> problem;
  sdmha::SparseQuery<Scalar> query;
  sdmha::AttentionOptions<Scalar> options;
  bool use_context = false;
  sdmha::ProjectedContext<Scalar> context;
  sdmha::AttentionResult<Scalar> expected;
};

// Releases all threads at once, so that their calls overlap from the first one.
class StartingGate {
 public:
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    opened_.wait(lock, [&] { return open_; });
  }
  void open() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      open_ = true;
    }
    opened_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable opened_;
  bool open_ = false;
};

TYPED_TEST(Concurrency, OneLayerFromEightThreadsGivesTheSingleThreadedResultsBitwise) {
  using Scalar = TypeParam;
  // The layer's weights come from thread 0's problem; every problem has the same widths.
  std::vector<ThreadWork<Scalar>> work(kThreads);
  for (int thread = 0; thread < kThreads; ++thread) {
    auto& w = work[std::size_t(thread)];
    w.problem = make_case<Scalar>(thread_shape(thread), 700 + std::uint64_t(thread));
    w.query = w.problem.query();
    w.options = w.problem.options;
    w.options.score_strategy = thread % 2 == 0 ? sdmha::ScoreStrategy::project_first
                                               : sdmha::ScoreStrategy::sparse_regrouped;
    w.options.num_threads = 1 + thread % 2;  // some calls spread their own work over 2 threads
    w.options.return_attention_scores = thread % 3 != 1;
    w.use_context = thread % 4 == 3;
    if (thread > 0) {  // the layer's weights, in the reference's twin too
      const auto& first = work[0].problem;
      w.problem.weights = first.weights;
      auto& p = w.problem.problem;
      p.query_kernel = first.problem.query_kernel;
      p.query_bias = first.problem.query_bias;
      p.key_kernel = first.problem.key_kernel;
      p.key_bias = first.problem.key_bias;
      p.value_kernel = first.problem.value_kernel;
      p.value_bias = first.problem.value_bias;
      p.output_kernel = first.problem.output_kernel;
      p.output_bias = first.problem.output_bias;
    }
  }
  const sdmha::SparseDenseMHA<Scalar> layer(work[0].problem.config, work[0].problem.weights);
  for (auto& w : work) {
    if (w.use_context) w.context = layer.project_context(w.problem.key, w.problem.value, 1);
    w.expected = w.use_context
                     ? layer.forward(w.query, w.context, w.options)
                     : layer.forward(w.query, {w.problem.key, w.problem.value}, w.options);
  }

  StartingGate gate;
  std::atomic<int> mismatches{0}, failures{0};
  std::vector<std::thread> threads;
  for (int thread = 0; thread < kThreads; ++thread) {
    threads.emplace_back([&, thread] {
      const auto& w = work[std::size_t(thread)];
      // Threads 0, 1, 4, 5 keep a Workspace of their own (threads 1 and 5 with a pool worker),
      // the others call the plain forward.
      const bool keep_workspace = thread % 4 < 2;
      sdmha::Workspace<Scalar> workspace;
      sdmha::AttentionResult<Scalar> kept;
      gate.wait();
      try {
        for (int call = 0; call < kCallsPerThread; ++call) {
          if (keep_workspace) {
            if (w.use_context)
              layer.forward(w.query, w.context, w.options, workspace, kept);
            else
              layer.forward(w.query, {w.problem.key, w.problem.value}, w.options, workspace, kept);
          }
          const auto& result =
              keep_workspace  ? kept
              : w.use_context ? layer.forward(w.query, w.context, w.options)
                              : layer.forward(w.query, {w.problem.key, w.problem.value}, w.options);
          const bool same =
              result.output.size() == w.expected.output.size() &&
              bitwise_equal(result.output.data(), w.expected.output.data(), result.output.size()) &&
              result.attention_scores.size() == w.expected.attention_scores.size() &&
              bitwise_equal(result.attention_scores.data(), w.expected.attention_scores.data(),
                            result.attention_scores.size());
          if (!same) mismatches.fetch_add(1);
        }
      } catch (...) {
        failures.fetch_add(1);
      }
    });
  }
  gate.open();
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0) << "calls threw";
  EXPECT_EQ(mismatches.load(), 0) << "calls differed from the single-threaded result";

  // The single-threaded results are right in the first place.
  for (const auto& w : work) {
    const auto reference = sdmha_reference::forward(w.problem.problem);
    EXPECT_TRUE(all_near(w.expected.output.data(), reference.output, relative_tolerance<Scalar>()));
  }
}

// The dense baseline shares the layer body; the same holds for it.
TYPED_TEST(Concurrency, DenseBaselineFromEightThreadsGivesTheSingleThreadedResultsBitwise) {
  using Scalar = TypeParam;
  std::vector<Case<Scalar>> problems;
  std::vector<Tensor3<Scalar>> queries;
  std::vector<sdmha::AttentionResult<Scalar>> expected;
  for (int thread = 0; thread < kThreads; ++thread) {
    problems.push_back(make_case<Scalar>(thread_shape(thread), 800 + std::uint64_t(thread)));
    problems.back().options.num_threads = 1 + thread % 2;
    queries.push_back(problems.back().dense_query());
  }
  const sdmha::DenseMHA<Scalar> layer(problems[0].config, problems[0].weights);
  for (int thread = 0; thread < kThreads; ++thread)
    expected.push_back(
        layer.forward(queries[std::size_t(thread)],
                      {problems[std::size_t(thread)].key, problems[std::size_t(thread)].value},
                      problems[std::size_t(thread)].options));

  StartingGate gate;
  std::atomic<int> mismatches{0}, failures{0};
  std::vector<std::thread> threads;
  for (int thread = 0; thread < kThreads; ++thread) {
    threads.emplace_back([&, thread] {
      const auto& c = problems[std::size_t(thread)];
      const auto& want = expected[std::size_t(thread)].output;
      gate.wait();
      try {
        for (int call = 0; call < kCallsPerThread / 2; ++call) {
          const auto result =
              layer.forward(queries[std::size_t(thread)], {c.key, c.value}, c.options);
          if (result.output.size() != want.size() ||
              !bitwise_equal(result.output.data(), want.data(), want.size()))
            mismatches.fetch_add(1);
        }
      } catch (...) {
        failures.fetch_add(1);
      }
    });
  }
  gate.open();
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(mismatches.load(), 0);
}

}  // namespace
}  // namespace sdmha_test
