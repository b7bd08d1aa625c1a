// A soak test of a long-lived process: several threads, each with a Workspace, an AttentionResult
// and MhaGradients of its own, call forward and backward on one shared layer for a fixed time;
// every result is bitwise the one computed serially beforehand, and the resident memory of the
// process after the time is what it was once every thread had warmed up (a leak or a cache that
// grows per call would show). .ci/hardening.sh runs it under ThreadSanitizer too (filter Soak*).
#include "test_support.hpp"

#include "same_bits.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

namespace sdmha_test {
namespace {

constexpr int kSoakThreads = 4;
constexpr double kSoakSeconds = 2.0;
// Growth of the resident set allowed over the soak: a per-call leak of a few bytes over the
// thousands of calls of the soak exceeds it, the allocator's own settling does not.
constexpr long kResidentSlackBytes = 8L << 20;

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kResidentSetMeaningful = false;  // their allocators keep freed memory in quarantine
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kResidentSetMeaningful = false;
#else
constexpr bool kResidentSetMeaningful = true;
#endif
#else
constexpr bool kResidentSetMeaningful = true;
#endif

// The resident set of this process in bytes (Linux: /proc/self/statm), or -1.
long resident_bytes() {
  std::FILE* statm = std::fopen("/proc/self/statm", "r");
  if (statm == nullptr) return -1;
  long pages = 0, resident = -1;
  if (std::fscanf(statm, "%ld %ld", &pages, &resident) != 2) resident = -1;
  std::fclose(statm);
  return resident < 0 ? -1 : resident * ::sysconf(_SC_PAGESIZE);
}

// One thread's problem: the layer's widths, its own batch, lengths, masks and options.
struct SoakWork {
  Case<double> problem;
  sdmha::SparseQuery<double> query;
  sdmha::AttentionOptions<double> options;
  Tensor3<double> d_output;
  sdmha::AttentionResult<double> expected;
  sdmha::MhaGradients<double> expected_gradients;
};

SoakWork soak_work(int thread) {
  Shape s = Shape{}
                .sized(1 + thread % 2, 4 + 3 * thread, 5 + (thread * 5) % 7)
                .widths(24, 12, 10)
                .with_heads(2, 4, 3, 6);
  s.random_mask = thread % 2 == 1;
  s.causal = thread == 2;
  s.key_mask = thread == 3;
  SoakWork work;
  work.problem = make_case<double>(s, 900 + std::uint64_t(thread));
  work.query = work.problem.query();
  work.options = work.problem.options;
  work.options.num_threads = 1 + thread % 2;  // two threads use a pool worker of their own
  work.options.score_strategy = thread % 2 == 0 ? sdmha::ScoreStrategy::project_first
                                                : sdmha::ScoreStrategy::sparse_regrouped;
  work.d_output = Tensor3<double>(s.batch, s.steps, s.output_dim);
  work.d_output.setRandom();
  return work;
}

TEST(Soak, ThreadsWithTheirOwnWorkspacesGiveTheSerialResultsBitwiseAndTheHeapStaysFlat) {
  std::vector<SoakWork> work;
  for (int thread = 0; thread < kSoakThreads; ++thread) work.push_back(soak_work(thread));
  const sdmha::SparseDenseMHA<double> layer(work[0].problem.config, work[0].problem.weights);
  for (auto& w : work) {  // serially, each on a fresh workspace
    w.expected = layer.forward(w.query, {w.problem.key, w.problem.value}, w.options);
    w.expected_gradients =
        layer.backward(w.query, {w.problem.key, w.problem.value}, w.d_output, w.options);
  }
  std::atomic<int> warm{0}, mismatches{0}, failures{0};
  std::atomic<long> calls{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int thread = 0; thread < kSoakThreads; ++thread)
    threads.emplace_back([&, thread] {
      const SoakWork& w = work[std::size_t(thread)];
      sdmha::Workspace<double> workspace;
      sdmha::AttentionResult<double> result;
      sdmha::MhaGradients<double> gradients;
      try {
        for (long call = 0; !stop.load(std::memory_order_relaxed); ++call) {
          layer.forward(w.query, {w.problem.key, w.problem.value}, w.options, workspace, result);
          layer.backward(w.query, {w.problem.key, w.problem.value}, w.d_output, w.options,
                         workspace, gradients);
          if (!same_bits(result.output, w.expected.output) ||
              !same_gradients(gradients, w.expected_gradients))
            mismatches.fetch_add(1);
          calls.fetch_add(1, std::memory_order_relaxed);
          if (call == 3) warm.fetch_add(1);
        }
      } catch (...) {
        failures.fetch_add(1);
        if (warm.load() < kSoakThreads) warm.fetch_add(1);  // never keep the main thread waiting
      }
    });
  const auto start = std::chrono::steady_clock::now();
  while (warm.load() < kSoakThreads) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const long resident_warm = resident_bytes();
  const long calls_warm = calls.load();
  std::this_thread::sleep_until(start + std::chrono::duration<double>(kSoakSeconds));
  const long resident_end = resident_bytes();
  stop.store(true);
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0) << "calls threw";
  EXPECT_EQ(mismatches.load(), 0) << "calls differed from the serial results";
  EXPECT_GT(calls.load(), calls_warm) << "no call after the warm-up: the soak soaked nothing";
  RecordProperty("calls", int(calls.load()));
  RecordProperty("resident_growth_bytes", int(resident_end - resident_warm));
  if (kResidentSetMeaningful) {
    ASSERT_GT(resident_warm, 0) << "/proc/self/statm unreadable";
    EXPECT_LT(resident_end - resident_warm, kResidentSlackBytes)
        << "resident set grew from " << resident_warm << " to " << resident_end << " bytes over "
        << calls.load() - calls_warm << " calls";
  }
}

#undef SDMHA_SAME

}  // namespace
}  // namespace sdmha_test
