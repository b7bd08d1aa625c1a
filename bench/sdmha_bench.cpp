// sdmha_bench — the sparse-query layer against the dense baseline (densify the query, then
// DenseMHA), whole and stage by stage, on the canonical workloads of bench/workloads.md.
//
//   sdmha_bench [--quick] [--benchmark_filter=...]       a Google Benchmark binary: every
//                                                       workload × density × threads × case
//   sdmha_bench --summary [--quick] [--json FILE] [--repetitions N] [--workload NAME]...
//                                                       the comparison table (medians of N
//                                                       interleaved runs), optionally all numbers
//                                                       as JSON for bench/plot.py; a memory-only
//                                                       workload (long16k) runs when named
//   sdmha_bench --scaling [--quick] [--repetitions N] [--workload NAME]...
//                                                       the scaling model (bench/scaling/
//                                                       scaling_model.hpp): forward and training
//                                                       step timed at 1 and 2 threads, predicted
//                                                       for 2, 16, 32 and 64 from one-thread item
//                                                       times; seed 1 %, bow 1 %, long 5 %
//
// Every case builds its inputs once outside timing, runs once untimed to measure the peak heap
// bytes of one call and to check its result against the dense path's (relative tolerance), and
// only then is timed. A disagreement skips the case with an error and makes the exit code 1.
// The stage cases walk the layer's own plan of a forward call (bench/layer_internals.hpp: its
// attention items, row blocks, threads and per-worker scratch), never a split of their own.
//
// The parts: workloads.hpp (the shapes and inputs of bench/workloads.md), problem.hpp (one
// workload's inputs, layers and dense references), timing.hpp (the cases and how they are
// timed), environment.hpp (machine, load, heap counter), report.hpp (tables and JSON),
// scaling/ (the scaling model); this file holds the three modes and main.
#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "environment.hpp"
#include "problem.hpp"
#include "report.hpp"
#include "scaling/scaling_model.hpp"
#include "timing.hpp"
#include "workloads.hpp"

namespace sdmha_bench {

// ---- Google Benchmark mode ----

bool any_failure = false;

Problem& cached_problem(const WorkloadShape& shape, double density) {
  // One problem at a time (the long workload's references take ~1 GB); benchmarks run in
  // registration order, so each problem is built once.
  static std::unique_ptr<Problem> problem;
  if (!problem || problem->shape.name != shape.name || problem->density != density) {
    problem.reset();
    problem = std::make_unique<Problem>(shape, density);
  }
  return *problem;
}

void run_benchmark(benchmark::State& state, const std::string& name, const WorkloadShape& shape,
                   double density, int threads, std::size_t case_index) {
  static std::map<std::string, CheckedCall> checked;  // by benchmark name: once per process
  try {
    Problem& p = cached_problem(shape, density);
    std::vector<Case> cases = make_cases(p, threads);
    const Case& c = cases.at(case_index);
    if (c.name() != case_names(shape, density).at(case_index))
      throw std::logic_error("make_cases and case_names disagree at " + c.name());
    auto found = checked.find(name);
    if (found == checked.end()) found = checked.emplace(name, checked_call(c)).first;
    const CheckedCall& call = found->second;
    if (!call.error.empty()) {
      any_failure = true;
      state.SkipWithError(call.error.c_str());
      return;
    }
    if (c.prepare) c.prepare();
    for (auto _ : state) c.run();

    using benchmark::Counter;
    state.counters["nnz"] = double(p.query.nonzeros());
    state.counters["density"] = p.density;
    state.counters["threads"] = threads;
    state.counters["flops"] = Counter(c.flops, Counter::kIsIterationInvariantRate);
    if (call.peak_bytes >= 0)
      state.counters["peak_bytes"] =
          Counter(double(call.peak_bytes), Counter::kDefaults, Counter::kIs1024);
    if (c.query_bytes > 0)
      state.counters["query_bytes"] = Counter(c.query_bytes, Counter::kDefaults, Counter::kIs1024);
    if (c.items > 0) state.SetItemsProcessed(std::int64_t(c.items) * state.iterations());
    if (c.bytes > 0) state.SetBytesProcessed(std::int64_t(c.bytes) * state.iterations());
  } catch (const std::exception& error) {
    any_failure = true;
    state.SkipWithError((std::string("setup failed: ") + error.what()).c_str());
  }
}

std::string density_text(double density) {
  std::ostringstream text;
  text << density;
  return text.str();
}

void register_benchmarks(const std::vector<WorkloadShape>& shapes) {
  for (const WorkloadShape& shape : shapes)
    for (double density : shape.densities)
      for (int threads : {1, 2}) {
        const std::vector<std::string> names = case_names(shape, density);
        for (std::size_t index = 0; index < names.size(); ++index) {
          const std::string name = shape.name + "/d:" + density_text(density) +
                                   "/t:" + std::to_string(threads) + "/" + names[index];
          benchmark::RegisterBenchmark(
              name.c_str(),
              [name, shape, density, threads, index](benchmark::State& state) {
                run_benchmark(state, name, shape, density, threads, index);
              })
              ->UseRealTime()
              ->Unit(benchmark::kMillisecond);
        }
      }
}

int run_summary(const std::vector<WorkloadShape>& shapes,
                const std::vector<WorkloadShape>& memory_shapes, int repetitions, bool quick,
                const std::string& json_path) {
  const Machine machine = describe_machine();
  const AllocationCheck allocation = allocation_counting_check();
  bool failed = AllocationCounter::counts_malloc() && !allocation.counted;
  const std::string load_before = load_average();
  std::vector<ConfigResult> results;
  const auto start = std::chrono::steady_clock::now();
  for (const WorkloadShape& shape : shapes) {
    for (double density : shape.densities) {
      std::cerr << shape.name << " density " << density << ": building inputs and references\n";
      std::unique_ptr<Problem> problem;
      try {
        problem = std::make_unique<Problem>(shape, density);
      } catch (const std::exception& error) {
        std::cerr << "FAILED " << shape.name << " density " << density << ": " << error.what()
                  << "\n";
        failed = true;
        continue;
      }
      for (int threads : {1, 2}) {
        results.push_back(measure(*problem, threads, repetitions));
        for (const CaseResult& c : results.back().cases) {
          if (c.error.empty()) continue;
          std::cerr << "FAILED " << shape.name << "/d:" << density << "/t:" << threads << "/"
                    << c.name << ": " << c.error << "\n";
          failed = true;
        }
        std::cerr << "  threads " << threads << " done, "
                  << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()
                  << " s so far\n";
      }
    }
  }
  std::vector<MemoryResult> memory;
  for (const WorkloadShape& shape : memory_shapes)
    for (double density : shape.densities)
      for (int threads : {1, 2}) {
        std::cerr << shape.name << " density " << density << " threads " << threads
                  << ": memory only\n";
        memory.push_back(measure_memory(shape, density, threads));
        if (memory.back().error.empty()) continue;
        std::cerr << "FAILED " << shape.name << "/d:" << density << "/t:" << threads
                  << "/memory: " << memory.back().error << "\n";
        failed = true;
      }
  const std::string load_after = load_average();
  print_summary(std::cout, results, machine, allocation, repetitions, quick, load_before,
                load_after);
  print_memory(std::cout, memory);
  if (!allocation.counted) std::cerr << "warning: " << allocation.problem << "\n";
  if (!json_path.empty())
    write_json(json_path, results, machine, repetitions, quick, load_before, load_after);
  if (failed) std::cout << "\nFAILED: see the errors above (stderr)\n";
  return failed ? 1 : 0;
}

// Keeps the workloads named by --workload (all of `shapes` when none is named; of
// `memory_shapes` only those named). False, with a message, when a name is neither.
bool select_workloads(const std::vector<std::string>& names, std::vector<WorkloadShape>& shapes,
                      std::vector<WorkloadShape>& memory_shapes) {
  auto named = [&](const WorkloadShape& w) {
    return std::find(names.begin(), names.end(), w.name) != names.end();
  };
  for (const std::string& name : names) {
    auto has_name = [&](const WorkloadShape& w) { return w.name == name; };
    if (std::none_of(shapes.begin(), shapes.end(), has_name) &&
        std::none_of(memory_shapes.begin(), memory_shapes.end(), has_name)) {
      std::cerr << "sdmha_bench: unknown workload " << name << " (expected one of";
      for (const WorkloadShape& w : shapes) std::cerr << " " << w.name;
      for (const WorkloadShape& w : memory_shapes) std::cerr << " " << w.name;
      std::cerr << ")\n";
      return false;
    }
  }
  if (!names.empty())
    shapes.erase(std::remove_if(shapes.begin(), shapes.end(),
                                [&](const WorkloadShape& w) { return !named(w); }),
                 shapes.end());
  memory_shapes.erase(std::remove_if(memory_shapes.begin(), memory_shapes.end(),
                                     [&](const WorkloadShape& w) { return !named(w); }),
                      memory_shapes.end());
  return true;
}

// `--scaling`: the scaling model on the canonical (or --quick) workloads named by --workload.
int run_scaling(const std::vector<WorkloadShape>& shapes, const std::vector<char*>& passed_on,
                int repetitions, const std::string& json_path, bool summary) {
  if (passed_on.size() > 1 || !json_path.empty() || summary) {
    std::cerr << "sdmha_bench --scaling: unknown argument "
              << (passed_on.size() > 1 ? passed_on[1]
                  : summary            ? "--summary"
                                       : "--json")
              << " (expected --quick, --repetitions N, --workload NAME)\n";
    return 2;
  }
  scaling::ScalingSettings settings;
  if (repetitions > 0) settings.repetitions = repetitions;
  std::cout << describe_machine().line() << "\nload average before: " << load_average() << "\n";
  const auto start = std::chrono::steady_clock::now();
  int status = 1;
  try {
    status = scaling::run_scaling_model(shapes, settings, std::cout);
  } catch (const std::exception& error) {
    std::cerr << "sdmha_bench --scaling: " << error.what() << "\n";
  }
  std::cout << "\nwhole run: "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()
            << " s; load average after: " << load_average() << "\n";
  return status;
}

}  // namespace sdmha_bench

int main(int argc, char** argv) {
  using namespace sdmha_bench;
  bool summary = false, quick = false, scaling = false;
  std::string json_path;
  int repetitions = 0;
  std::vector<std::string> workload_names;   // --workload: only these (all when empty)
  std::vector<char*> passed_on = {argv[0]};  // what Google Benchmark gets
  for (int i = 1; i < argc; ++i) {
    const std::string argument = argv[i];
    if (argument == "--summary") {
      summary = true;
    } else if (argument == "--scaling") {
      scaling = true;
    } else if (argument == "--quick") {
      quick = true;
    } else if (argument == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (argument.rfind("--json=", 0) == 0) {
      json_path = argument.substr(7);
    } else if (argument == "--repetitions" && i + 1 < argc) {
      repetitions = std::atoi(argv[++i]);
    } else if (argument.rfind("--repetitions=", 0) == 0) {
      repetitions = std::atoi(argument.c_str() + 14);
    } else if (argument == "--workload" && i + 1 < argc) {
      workload_names.push_back(argv[++i]);
    } else if (argument.rfind("--workload=", 0) == 0) {
      workload_names.push_back(argument.substr(11));
    } else {
      passed_on.push_back(argv[i]);
    }
  }
  std::vector<WorkloadShape> shapes = quick ? quick_workloads() : canonical_workloads();
  // Memory-only workloads run when named (--summary only), never by default.
  std::vector<WorkloadShape> memory_shapes = memory_workloads();
  if (!select_workloads(workload_names, shapes, memory_shapes)) return 2;

  if (scaling) return run_scaling(shapes, passed_on, repetitions, json_path, summary);
  if (summary) {
    if (passed_on.size() > 1) {
      std::cerr << "sdmha_bench --summary: unknown argument " << passed_on[1]
                << " (expected --quick, --json FILE, --repetitions N, --workload NAME)\n";
      return 2;
    }
    if (repetitions <= 0) repetitions = quick ? 3 : 5;
    try {
      return run_summary(shapes, memory_shapes, repetitions, quick, json_path);
    } catch (const std::exception& error) {
      std::cerr << "sdmha_bench: " << error.what() << "\n";
      return 1;
    }
  }
  if (!json_path.empty() || repetitions != 0 || !workload_names.empty()) {
    std::cerr << "sdmha_bench: --json, --repetitions and --workload go with --summary; Google "
                 "Benchmark's own are "
                 "--benchmark_out=FILE and --benchmark_repetitions=N\n";
    return 2;
  }

  const AllocationCheck allocation = allocation_counting_check();
  if (!allocation.counted) {
    std::cerr << (AllocationCounter::counts_malloc() ? "error: " : "warning: ")
              << allocation.problem << "\n";
    if (AllocationCounter::counts_malloc()) return 1;
  }
  const Machine machine = describe_machine();
  benchmark::AddCustomContext("sdmha_machine", machine.line());
  register_benchmarks(shapes);
  int benchmark_argc = int(passed_on.size());
  benchmark::Initialize(&benchmark_argc, passed_on.data());
  if (benchmark::ReportUnrecognizedArguments(benchmark_argc, passed_on.data())) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return any_failure ? 1 : 0;
}
