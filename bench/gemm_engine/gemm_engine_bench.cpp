// bench/gemm_engine/gemm_engine_bench.cpp — GFLOP/s of the AVX-512 float GEMM
// (sdmha/detail/gemm_avx512.hpp) against Eigen's own product (`C.noalias() = op(A) * op(B)` on the
// same matrices) on the layer's shapes, one thread, next to the core's FMA peak measured in the
// same run. The yardstick is Eigen's product written as a user of Eigen writes it, not
// sdmha::detail::gemm: built with AVX-512F, that dispatches float to the engine itself.
//
//   g++ -std=c++17 -O3 -march=native -DNDEBUG -I include -I /usr/include/eigen3
//       bench/gemm_engine/gemm_engine_bench.cpp -o /tmp/gemm_bench -pthread   (one line)
//   /tmp/gemm_bench [rounds (default 101)] [milliseconds per sample (default 1)]
//
// The machine is shared (2 cores, other builds and benchmarks running): every round times, for each
// shape, the FMA peak loop, the engine and Eigen (in alternating order) and the peak loop again,
// each sample about a millisecond long, so that a sample rarely straddles a time slice of another
// process and the peak is measured at the clock the samples ran at (it moves by ±10% here as the
// other core's load changes). The table shows medians over the rounds: GFLOP/s, and the per-round
// ratios engine / peak (the mean of the two peak samples around it) and engine / Eigen. Samples are
// timed by this thread's CPU time (clock_gettime(CLOCK_THREAD_CPUTIME_ID): the time the thread ran,
// blind to the slices other processes take) and by std::chrono::steady_clock (wall time, which
// includes them; shown for reference).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include <sdmha/detail/gemm.hpp>
#include <sdmha/detail/gemm_avx512.hpp>

#if !defined(__AVX512F__)
int main() {
  std::printf(
      "gemm_engine_bench: built without AVX-512F (__AVX512F__ undefined); nothing to measure\n");
  return 0;
}
#else

#include <immintrin.h>

namespace {

using sdmha::Index;
using sdmha::detail::GemmOperand;

double thread_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}
double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The FMA peak of one core: 12 independent chains of vfmadd231ps on zmm registers (two pipes of
// 4-cycle latency need ≥ 8), 24 FMAs per iteration, nothing else in the loop but the counter.
// clang-format off
#define SDMHA_BENCH_FMA(r) "vfmadd231ps %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define SDMHA_BENCH_FMA_ROUND                                                                   \
  SDMHA_BENCH_FMA(0) SDMHA_BENCH_FMA(1) SDMHA_BENCH_FMA(2) SDMHA_BENCH_FMA(3) SDMHA_BENCH_FMA(4) \
  SDMHA_BENCH_FMA(5) SDMHA_BENCH_FMA(6) SDMHA_BENCH_FMA(7) SDMHA_BENCH_FMA(8) SDMHA_BENCH_FMA(9) \
  SDMHA_BENCH_FMA(10) SDMHA_BENCH_FMA(11)
__attribute__((noinline)) void fma_loop(long iterations) {
  __asm__ volatile(
      "vxorps %%xmm31, %%xmm31, %%xmm31\n\t"
      "vxorps %%xmm30, %%xmm30, %%xmm30\n\t"
      "1:\n\t" SDMHA_BENCH_FMA_ROUND SDMHA_BENCH_FMA_ROUND
      "dec %0\n\t"
      "jnz 1b\n\t"
      : "+r"(iterations)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm30", "xmm31", "cc");
}
#undef SDMHA_BENCH_FMA_ROUND
#undef SDMHA_BENCH_FMA
// clang-format on
constexpr double kFlopsPerFmaIteration = 24.0 * 16 * 2;

struct Shape {
  const char* role;
  Index m, n, k;
  bool transpose_a, transpose_b;
};

struct Problem {
  Shape shape;
  sdmha::RowMatrix<float> a, b, c;       // stored A (or Aᵀ), stored B (or Bᵀ), C
  sdmha::detail::ScratchBuffer scratch;  // 64-byte aligned, as a Workspace gives (Eigen needs it)
  GemmOperand<float> a_op() const {
    return shape.transpose_a ? GemmOperand<float>{a.data(), shape.m, shape.k, a.cols(), false}
                             : GemmOperand<float>{a.data(), shape.m, shape.k, a.cols(), true};
  }
  GemmOperand<float> b_op() const {
    return shape.transpose_b ? GemmOperand<float>{b.data(), shape.k, shape.n, b.cols(), false}
                             : GemmOperand<float>{b.data(), shape.k, shape.n, b.cols(), true};
  }
};

Problem make_problem(const Shape& s, std::mt19937& rng) {
  Problem p{s, {}, {}, {}, {}};
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  p.a = s.transpose_a ? sdmha::RowMatrix<float>(s.k, s.m) : sdmha::RowMatrix<float>(s.m, s.k);
  p.b = s.transpose_b ? sdmha::RowMatrix<float>(s.n, s.k) : sdmha::RowMatrix<float>(s.k, s.n);
  for (Index i = 0; i < p.a.size(); ++i) p.a.data()[i] = value(rng);
  for (Index i = 0; i < p.b.size(); ++i) p.b.data()[i] = value(rng);
  p.c.setZero(s.m, s.n);
  p.scratch.reserve(sdmha::detail::gemm_avx512_workspace_size(s.m, s.n, s.k));
  return p;
}

// C = op(A)·op(B) by Eigen's product on the stored matrices: its GEBP kernel and its own packing
// blocks (on the heap once they exceed EIGEN_STACK_ALLOCATION_LIMIT), as a user of Eigen gets.
void eigen_product(const Problem& p, sdmha::RowMatrix<float>& c) {
  if (p.shape.transpose_a && p.shape.transpose_b)
    c.noalias() = p.a.transpose() * p.b.transpose();
  else if (p.shape.transpose_a)
    c.noalias() = p.a.transpose() * p.b;
  else if (p.shape.transpose_b)
    c.noalias() = p.a * p.b.transpose();
  else
    c.noalias() = p.a * p.b;
}

struct Sample {
  double cpu, wall;  // seconds per repetition
};

template <typename Body>
Sample time_it(long repetitions, Body&& body) {
  const double w0 = wall_seconds(), c0 = thread_seconds();
  for (long r = 0; r < repetitions; ++r) body();
  const double c1 = thread_seconds(), w1 = wall_seconds();
  return {(c1 - c0) / double(repetitions), (w1 - w0) / double(repetitions)};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::size_t(q * double(v.size() - 1))];
}
double best(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

struct Series {
  std::vector<double> cpu, wall;          // GFLOP/s per round
  std::vector<double> of_peak, of_eigen;  // per-round ratios (thread CPU time)
};

// Warm-up, which also checks that the engine and Eigen agree; false (after saying where) if not.
bool engines_agree(std::vector<Problem>& problems) {
  for (Problem& p : problems) {
    sdmha::RowMatrix<float> eigen_c(p.shape.m, p.shape.n);
    const sdmha::StageScratch scratch = p.scratch.view();
    eigen_product(p, eigen_c);
    sdmha::detail::gemm_avx512(p.a_op(), p.b_op(), sdmha::MatrixRef<float>(p.c), 1.0f, false,
                               scratch);
    float difference = 0;  // a plain loop: Eigen's vectorised maxCoeff trips GCC 12 bug 105593
    for (Index i = 0; i < eigen_c.size(); ++i)
      difference = std::max(difference, std::abs(eigen_c.data()[i] - p.c.data()[i]));
    if (!(difference <= 1e-4f * float(p.shape.k))) {
      std::printf("engines disagree on %s: max |difference| %g\n", p.shape.role,
                  double(difference));
      return false;
    }
  }
  return true;
}

void print_table(int rounds, double sample_seconds, const std::vector<Problem>& problems,
                 const Series& peak, const std::vector<Series>& ours,
                 const std::vector<Series>& eigen) {
  std::printf(
      "one core, %d rounds, ~%.1f ms samples; FMA peak (12 zmm chains): median %.1f GFLOP/s by "
      "thread "
      "CPU time (quartiles %.1f-%.1f), %.1f by wall time\n\n",
      rounds, sample_seconds * 1e3, median(peak.cpu), quantile(peak.cpu, 0.25),
      quantile(peak.cpu, 0.75), median(peak.wall));
  std::printf("%-19s %-15s %-6s|%29s|%22s|%16s\n", "", "", "", "thread CPU time, medians  ",
              "per-round ratios  ", "wall, medians ");
  std::printf("%-19s %-15s %-6s|%8s %6s %7s %6s|%8s %6s %6s|%8s %7s\n", "role", "m x n x k", "op",
              "ours", "best", "Eigen", "", "ours/pk", "Eig/pk", "x Eig", "ours", "Eigen");
  for (std::size_t s = 0; s < problems.size(); ++s) {
    const Shape& sh = problems[s].shape;
    const std::string dims =
        std::to_string(sh.m) + "x" + std::to_string(sh.n) + "x" + std::to_string(sh.k);
    const std::string op =
        std::string(sh.transpose_a ? "At" : "A") + (sh.transpose_b ? ".Bt" : ".B");
    std::printf("%-19s %-15s %-6s|%8.1f %6.1f %7.1f %6s|%7.1f%% %5.1f%% %5.2fx|%8.1f %7.1f\n",
                sh.role, dims.c_str(), op.c_str(), median(ours[s].cpu), best(ours[s].cpu),
                median(eigen[s].cpu), "", 100.0 * median(ours[s].of_peak),
                100.0 * median(eigen[s].of_peak), median(ours[s].of_eigen), median(ours[s].wall),
                median(eigen[s].wall));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::max(1, std::atoi(argv[1])) : 101;
  const double sample_seconds = (argc > 2 ? std::atof(argv[2]) : 1.0) * 1e-3;
  const Shape shapes[] = {
      {"projection block", 64, 512, 512, false, false},
      {"projection", 512, 512, 512, false, false},
      {"projection (whole)", 4096, 512, 512, false, false},
      {"scores Q.K^T", 64, 128, 64, false, true},
      {"scores Q.K^T", 64, 2048, 64, false, true},
      {"P.V", 64, 64, 128, false, false},
      {"P.V", 64, 64, 2048, false, false},
      {"dX = dY.W^T", 64, 512, 512, false, true},
      {"dW = X^T.dY", 256, 256, 4096, true, false},
      {"dW = X^T.dY", 512, 512, 4096, true, false},
      {"dV = P^T.dO", 2048, 64, 64, true, false},
  };
  std::mt19937 rng(42);
  std::vector<Problem> problems;
  for (const Shape& s : shapes) problems.push_back(make_problem(s, rng));
  if (!engines_agree(problems)) return 1;

  // Repetitions per sample: about sample_seconds each at the rate of a first timing.
  std::vector<long> repetitions;
  for (Problem& p : problems) {
    const double flops = 2.0 * double(p.shape.m) * double(p.shape.n) * double(p.shape.k);
    sdmha::MatrixRef<float> c(p.c);
    const auto a = p.a_op(), b = p.b_op();
    const Sample once =
        time_it(3, [&] { sdmha::detail::gemm_avx512(a, b, c, 1.0f, false, p.scratch.view()); });
    repetitions.push_back(std::max(1L, long(sample_seconds / std::max(once.cpu, 1e-9))));
    (void)flops;
  }

  Series peak;
  std::vector<Series> ours(problems.size()), eigen(problems.size());
  for (int round = 0; round < rounds; ++round) {
    for (std::size_t s = 0; s < problems.size(); ++s) {
      Problem& p = problems[s];
      const double flops = 2.0 * double(p.shape.m) * double(p.shape.n) * double(p.shape.k);
      const sdmha::StageScratch scratch = p.scratch.view();
      const auto a = p.a_op(), b = p.b_op();
      sdmha::MatrixRef<float> c(p.c);
      // Each sample starts warm (one untimed call): the layer runs a shape thousands of times on
      // the same weights, and here the other shapes' data (~60 MB) would otherwise evict this
      // one's.
      auto run_ours = [&] {
        sdmha::detail::gemm_avx512(a, b, c, 1.0f, false, scratch);
        return time_it(repetitions[s],
                       [&] { sdmha::detail::gemm_avx512(a, b, c, 1.0f, false, scratch); });
      };
      auto run_eigen = [&] {
        eigen_product(p, p.c);
        return time_it(repetitions[s], [&] { eigen_product(p, p.c); });
      };
      // The peak loop as long as the engine's sample (its iterations from the last round's time).
      const Sample last =
          ours[s].cpu.empty()
              ? Sample{sample_seconds, sample_seconds}
              : Sample{flops * double(repetitions[s]) / (ours[s].cpu.back() * 1e9), 0};
      const long fma_iterations = std::max(1L, long(last.cpu * 200e9 / kFlopsPerFmaIteration));
      const double fma_flops = kFlopsPerFmaIteration * double(fma_iterations);
      const Sample peak_before = time_it(1, [&] { fma_loop(fma_iterations); });
      Sample o{}, e{};
      if (round % 2 == 0) {
        o = run_ours();
        e = run_eigen();
      } else {
        e = run_eigen();
        o = run_ours();
      }
      const Sample peak_after = time_it(1, [&] { fma_loop(fma_iterations); });
      const double peak_cpu =
          0.5 * (fma_flops / peak_before.cpu + fma_flops / peak_after.cpu) / 1e9;
      const double peak_wall =
          0.5 * (fma_flops / peak_before.wall + fma_flops / peak_after.wall) / 1e9;
      const double o_cpu = flops / o.cpu / 1e9, e_cpu = flops / e.cpu / 1e9;
      peak.cpu.push_back(peak_cpu);
      peak.wall.push_back(peak_wall);
      ours[s].cpu.push_back(o_cpu);
      ours[s].wall.push_back(flops / o.wall / 1e9);
      ours[s].of_peak.push_back(o_cpu / peak_cpu);
      ours[s].of_eigen.push_back(o_cpu / e_cpu);
      eigen[s].cpu.push_back(e_cpu);
      eigen[s].wall.push_back(flops / e.wall / 1e9);
      eigen[s].of_peak.push_back(e_cpu / peak_cpu);
    }
  }
  print_table(rounds, sample_seconds, problems, peak, ours, eigen);
  return 0;
}

#endif  // __AVX512F__
