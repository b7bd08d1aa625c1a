// bench/cache_lines/cache_lines_bench.cpp — how fast one core moves cache lines in the two
// access patterns of the query projection on wide queries, at working sets from L1 to DRAM.
//
//   g++ -std=c++17 -O3 -march=native -DNDEBUG bench/cache_lines/cache_lines_bench.cpp
//       -o /tmp/cache_lines_bench   (one line)
//   /tmp/cache_lines_bench [samples (default 15)]
//
// Each access touches a 512-byte panel (8 cache lines, 128 floats: the width of the query
// kernels' column panels) at a uniformly random panel of a buffer of the given size:
//   read:   8 accumulators += x · panel — the by-feature-blocks order, where a row's outputs stay
//           in registers and a panel of W is read per stored value;
//   update: panel += x · 8 registers — the by-feature order, where a feature's panel of W stays
//           in registers and a row's output panel is read, changed and written back per stored
//           value (the line is fetched, and later written back when evicted: two transfers).
// Printed: nanoseconds per cache line (median over the samples, each sample 2^20 accesses timed
// by this thread's CPU time, blind to other processes' time slices). These are this loop's rates
// over uniformly random panels, not hardware limits; a line count times them estimates what a
// kernel with that traffic can hope for on this machine. The measured kernels and the counts are
// in docs/performance.md.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <vector>

#if !defined(__AVX512F__)
int main() {
  std::printf(
      "cache_lines_bench: built without AVX-512F (__AVX512F__ undefined); nothing to measure\n");
  return 0;
}
#else
#include <immintrin.h>

namespace {

constexpr int kPanelLines = 8;  // 512 bytes
constexpr int kPanelFloats = kPanelLines * 16;
constexpr std::size_t kAccesses = std::size_t(1) << 20;

double thread_seconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return double(now.tv_sec) + 1e-9 * double(now.tv_nsec);
}

struct Pattern {
  std::vector<std::uint32_t> panel;  // the panel each access touches
  std::vector<float> value;          // its multiplier
};

Pattern random_pattern(std::size_t panels, std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::uniform_int_distribution<std::uint32_t> which(0, std::uint32_t(panels - 1));
  std::uniform_real_distribution<float> value(-1e-3f, 1e-3f);
  Pattern pattern;
  pattern.panel.resize(kAccesses);
  pattern.value.resize(kAccesses);
  for (std::size_t i = 0; i < kAccesses; ++i) {
    pattern.panel[i] = which(generator);
    pattern.value[i] = value(generator);
  }
  return pattern;
}

// Σ x · panel into registers; returns their sum so that nothing is optimised away.
float read_panels(const float* buffer, const Pattern& pattern) {
  __m512 accumulator[kPanelLines];
  for (auto& a : accumulator) a = _mm512_setzero_ps();
  for (std::size_t i = 0; i < kAccesses; ++i) {
    const float* panel = buffer + std::size_t(pattern.panel[i]) * kPanelFloats;
    const __m512 x = _mm512_set1_ps(pattern.value[i]);
    for (int q = 0; q < kPanelLines; ++q)
      accumulator[q] = _mm512_fmadd_ps(x, _mm512_load_ps(panel + 16 * q), accumulator[q]);
  }
  alignas(64) float lanes[kPanelLines * 16];
  for (int q = 0; q < kPanelLines; ++q) _mm512_store_ps(lanes + 16 * q, accumulator[q]);
  float total = 0.0f;
  for (const float lane : lanes) total += lane;
  return total;
}

// panel += x · registers, in place.
void update_panels(float* buffer, const Pattern& pattern) {
  __m512 row[kPanelLines];
  for (int q = 0; q < kPanelLines; ++q) row[q] = _mm512_set1_ps(1.0f + 0.125f * float(q));
  for (std::size_t i = 0; i < kAccesses; ++i) {
    float* panel = buffer + std::size_t(pattern.panel[i]) * kPanelFloats;
    const __m512 x = _mm512_set1_ps(pattern.value[i]);
    for (int q = 0; q < kPanelLines; ++q)
      _mm512_store_ps(panel + 16 * q, _mm512_fmadd_ps(x, row[q], _mm512_load_ps(panel + 16 * q)));
  }
}

// Median nanoseconds per line of `samples` timed passes of `pass` (after one untimed pass).
template <typename Pass>
double median_ns_per_line(int samples, Pass&& pass) {
  pass();
  std::vector<double> ns;
  for (int s = 0; s < samples; ++s) {
    const double start = thread_seconds();
    pass();
    ns.push_back(1e9 * (thread_seconds() - start) / double(kAccesses * kPanelLines));
  }
  std::nth_element(ns.begin(), ns.begin() + samples / 2, ns.end());
  return ns[std::size_t(samples / 2)];
}

}  // namespace

int main(int argc, char** argv) {
  const int samples = argc > 1 ? std::max(1, std::atoi(argv[1])) : 15;
  const std::size_t kilobytes[] = {32, 256, 512, 768, 4096, 65536};
  std::printf(
      "ns per 64-byte line, 512-byte panels at random, medians of %d samples of %zu "
      "accesses\n%10s %10s %10s\n",
      samples, kAccesses, "buffer KB", "read", "update");
  volatile float sink = 0.0f;
  for (const std::size_t kb : kilobytes) {
    const std::size_t floats = kb * 1024 / sizeof(float), panels = floats / kPanelFloats;
    float* buffer = static_cast<float*>(std::aligned_alloc(64, floats * sizeof(float)));
    if (buffer == nullptr) return 1;
    for (std::size_t i = 0; i < floats; ++i) buffer[i] = 1e-3f * float(i % 97);
    const Pattern pattern = random_pattern(panels, kb);
    const double read =
        median_ns_per_line(samples, [&] { sink = sink + read_panels(buffer, pattern); });
    const double update = median_ns_per_line(samples, [&] { update_panels(buffer, pattern); });
    sink = sink + buffer[0];
    std::printf("%10zu %10.3f %10.3f\n", kb, read, update);
    std::free(buffer);
  }
  return 0;
}
#endif
