// bench/environment.hpp — what a run reports about where it ran: the machine (CPU, cores, compiler,
// flags, Eigen), the load average, and the heap counter's own check (allocation_counter.hpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <Eigen/Core>
#include <benchmark/benchmark.h>

#include "allocation_counter.hpp"

#ifndef SDMHA_BENCH_COMPILE_FLAGS
#define SDMHA_BENCH_COMPILE_FLAGS "(unknown)"
#endif

namespace sdmha_bench {

// ---- The heap counter's own check ----

struct AllocationCheck {
  bool counted = false;  // the heap is counted and the check passed
  std::int64_t eigen_matrix_bytes = 0, std_vector_bytes = 0;
  std::string problem;
};

// A 1000 × 1000 float matrix (Eigen: aligned_malloc → std::malloc) and a vector of 10⁶ floats
// (operator new) must each be seen as 4·10⁶ bytes, plus at most the allocator's rounding, and
// the books must balance once both are gone.
inline AllocationCheck allocation_counting_check() {
  AllocationCheck check;
  if (!AllocationCounter::counts_malloc()) {
    check.problem = "malloc is not wrapped on this platform; memory is not counted";
    return check;
  }
  constexpr std::int64_t expected = 1000 * 1000 * 4, slack = 64 * 1024;
  const std::int64_t live_before = AllocationCounter::live();
  check.eigen_matrix_bytes = peak_heap_bytes([] {
    Eigen::MatrixXf matrix(1000, 1000);
    matrix.setConstant(1.0f);
    benchmark::DoNotOptimize(matrix.data());
    benchmark::ClobberMemory();
  });
  check.std_vector_bytes = peak_heap_bytes([] {
    std::vector<float> vector(1000 * 1000, 1.0f);
    benchmark::DoNotOptimize(vector.data());
    benchmark::ClobberMemory();
  });
  const std::int64_t leaked = AllocationCounter::live() - live_before;
  auto plausible = [&](std::int64_t bytes) {
    return bytes >= expected && bytes <= expected + slack;
  };
  if (!plausible(check.eigen_matrix_bytes) || !plausible(check.std_vector_bytes) || leaked != 0) {
    std::ostringstream message;
    message << "heap counting is off: Eigen::MatrixXf(1000, 1000) counted as "
            << check.eigen_matrix_bytes << " B, std::vector<float>(1e6) as "
            << check.std_vector_bytes << " B (expected " << expected << " to " << expected + slack
            << "), " << leaked << " B unbalanced";
    check.problem = message.str();
    return check;
  }
  check.counted = true;
  return check;
}

// ---- The machine ----

struct Machine {
  std::string cpu, compiler, flags, eigen;
  unsigned cores = 0;
  std::string line() const {
    std::ostringstream text;
    text << "machine: " << cpu << " | " << cores << " cores | " << compiler << " | " << flags
         << " | " << eigen;
    return text.str();
  }
};

inline Machine describe_machine() {
  Machine machine;
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      machine.cpu = line.substr(line.find(':') + 2);
      break;
    }
  }
  if (machine.cpu.empty()) machine.cpu = "unknown CPU";
  machine.cores = std::thread::hardware_concurrency();
#if defined(__clang__)
  machine.compiler = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  machine.compiler = std::string("g++ ") + __VERSION__;
#else
  machine.compiler = __VERSION__;
#endif
  machine.flags = SDMHA_BENCH_COMPILE_FLAGS;
  std::ostringstream eigen;
  eigen << "Eigen " << EIGEN_WORLD_VERSION << "." << EIGEN_MAJOR_VERSION << "."
        << EIGEN_MINOR_VERSION << " (" << Eigen::SimdInstructionSetsInUse() << ")";
  machine.eigen = eigen.str();
  return machine;
}

// The first three fields of /proc/loadavg, or "unknown".
inline std::string load_average() {
  std::ifstream file("/proc/loadavg");
  std::string one, five, fifteen;
  if (!(file >> one >> five >> fifteen)) return "unknown";
  return one + ", " + five + ", " + fifteen;
}

}  // namespace sdmha_bench
