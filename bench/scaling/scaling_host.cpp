// bench/scaling/scaling_host.cpp — sdmha_scaling: the forward and the training step of seed 1 %,
// bow 1 % and long 5 % timed at several thread counts on one machine, with the scaling model's
// prediction beside them (scaling_model.hpp). Needs only the library's headers and Eigen's, so
// that bench/scaling/run.sh can build it with one compiler line on a host without CMake's
// dependencies (Google Benchmark, nlohmann/json):
//
//   g++ -std=c++17 -O3 -march=native -DNDEBUG -pthread -Iinclude -I<eigen3>
//       bench/scaling/scaling_host.cpp -o sdmha_scaling
//   sdmha_scaling [--threads 1,2,4,8,16] [--workload NAME]... [--repetitions N] [--no-model]
//                 [--quick] [--json FILE]
//
// Per workload: every thread count's own Workspace, warmed by one training step; the outputs and
// gradients of every thread count compared bitwise with one thread's; then `repetitions` forward
// and training steps per thread count, interleaved, and their medians. With the model (the
// default), the one-thread trace, the regions' spans traced at each thread count, and the
// prediction at those counts and at 32 and 64.
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "scaling_model.hpp"

#ifndef SDMHA_SCALING_COMPILE_FLAGS
#define SDMHA_SCALING_COMPILE_FLAGS "-O3 -march=native -DNDEBUG (as run.sh builds it)"
#endif

namespace sdmha_bench::scaling {
namespace {

std::string cpu_name() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

std::string json_string(const std::string& text) {
  std::string quoted = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') quoted += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) quoted += c;
  }
  return quoted + "\"";
}

std::string json_number(double value) {
  if (!std::isfinite(value)) return "null";
  std::ostringstream text;
  text.precision(6);
  text << value;
  return text.str();
}

// One step of one workload: measured and predicted milliseconds by thread count, and per region
// its items, one-thread work, o(2) and spans.
void write_step(std::ostream& out, const StepResult& step, const std::vector<int>& predicted) {
  out << "{\"measured_ms\": {";
  for (std::size_t i = 0; i < step.measured_seconds.size(); ++i)
    out << (i ? ", " : "") << "\"" << step.measured_seconds[i].first
        << "\": " << json_number(step.measured_seconds[i].second * 1e3);
  out << "}";
  if (step.profile.regions.empty()) {
    out << "}";
    return;
  }
  const CallProfile& profile = step.profile;
  out << ", \"model_one_thread_ms\": " << json_number(profile.one_thread() * 1e3)
      << ", \"serial_ms\": " << json_number(profile.serial_seconds * 1e3)
      << ", \"predicted_ms\": {";
  for (std::size_t i = 0; i < predicted.size(); ++i)
    out << (i ? ", " : "") << "\"" << predicted[i]
        << "\": " << json_number(profile.predicted(predicted[i]) * 1e3);
  out << "}, \"regions\": [";
  for (std::size_t k = 0; k < profile.regions.size(); ++k) {
    const RegionProfile& r = profile.regions[k];
    out << (k ? ",\n      " : "\n      ") << "{\"name\": " << json_string(r.name)
        << ", \"items\": " << r.items << ", \"work_ms\": " << json_number(r.work() * 1e3)
        << ", \"largest_item_ms\": " << json_number(r.largest_item() * 1e3)
        << ", \"overhead_two_us\": " << json_number(r.overhead_two * 1e6)
        << ", \"claim_ns\": " << json_number(r.claim_seconds * 1e9)
        << ", \"slowdown_two\": " << json_number(r.slowdown) << ", \"span_ms\": {";
    for (std::size_t i = 0; i < r.measured.size(); ++i)
      out << (i ? ", " : "") << "\"" << r.measured[i].first
          << "\": " << json_number(r.measured[i].second * 1e3);
    out << "}, \"predicted_ms\": {";
    for (std::size_t i = 0; i < predicted.size(); ++i)
      out << (i ? ", " : "") << "\"" << predicted[i]
          << "\": " << json_number(r.predicted(predicted[i]) * 1e3);
    out << "}}";
  }
  out << "]}";
}

void write_json(const std::string& path, const std::vector<WorkloadResult>& results,
                const std::vector<std::pair<std::string, std::string>>& failures,
                const ScalingSettings& settings, bool quick) {
  std::ofstream out(path);
  out << "{\"program\": \"sdmha_scaling\", \"cpu\": " << json_string(cpu_name())
      << ", \"hardware_threads\": " << std::thread::hardware_concurrency()
      << ", \"flags\": " << json_string(SDMHA_SCALING_COMPILE_FLAGS)
      << ", \"repetitions\": " << settings.repetitions << ", \"statistic\": \"median\""
      << ", \"workloads\": [";
  for (std::size_t i = 0; i < results.size(); ++i) {
    const WorkloadResult& r = results[i];
    out << (i ? ",\n  " : "\n  ") << "{\"workload\": " << json_string(r.shape.name)
        << ", \"density\": " << json_number(r.density) << ", \"nnz\": " << r.nonzeros
        << ", \"shape\": {\"B\": " << r.shape.batch << ", \"T\": " << r.shape.steps
        << ", \"Eq\": " << r.shape.query_dim << ", \"S\": " << r.shape.key_steps
        << "}, \"quick\": " << (quick ? "true" : "false")
        << ", \"bitwise_same\": " << (r.bitwise.empty() ? "true" : "false")
        << ", \"bitwise_difference\": " << json_string(r.bitwise)
        << ", \"seconds\": " << json_number(r.seconds) << ",\n   \"forward\": ";
    write_step(out, r.forward, settings.predicted_threads);
    out << ",\n   \"training\": ";
    write_step(out, r.training, settings.predicted_threads);
    out << "}";
  }
  for (std::size_t i = 0; i < failures.size(); ++i)
    out << (results.empty() && i == 0 ? "\n  " : ",\n  ")
        << "{\"workload\": " << json_string(failures[i].first)
        << ", \"error\": " << json_string(failures[i].second) << "}";
  out << "\n]}\n";
  if (!out) throw std::runtime_error("cannot write " + path);
}

// The measured table: per thread count, each step's median and its speedup over one thread.
void print_measured(std::ostream& out, const WorkloadResult& r) {
  out << "\n"
      << r.shape.name << " " << r.density * 100 << " %: measured (median ms)\n"
      << "threads | forward | speedup | training step | speedup\n";
  for (const auto& [threads, seconds] : r.forward.measured_seconds) {
    char line[160];
    std::snprintf(line, sizeof line, "%7d | %7.2f | %7.2f | %13.2f | %7.2f\n", threads,
                  seconds * 1e3, r.forward.measured_at(1) / seconds,
                  r.training.measured_at(threads) * 1e3,
                  r.training.measured_at(1) / r.training.measured_at(threads));
    out << line;
  }
}

std::vector<int> parse_threads(const std::string& list) {
  std::vector<int> threads;
  std::stringstream stream(list);
  for (std::string item; std::getline(stream, item, ',');) {
    const int count = std::atoi(item.c_str());
    if (count <= 0) throw std::invalid_argument("--threads: expected positive counts, got " + list);
    if (std::find(threads.begin(), threads.end(), count) == threads.end()) threads.push_back(count);
  }
  std::sort(threads.begin(), threads.end());
  return threads;
}

int run(int argc, char** argv) {
  ScalingSettings settings;
  settings.measured_threads = {1, 2};
  settings.repetitions = 5;
  settings.trace_repetitions = 3;
  std::vector<std::string> names;
  std::string json_path;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string argument = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(argument + " needs a value");
      return argv[++i];
    };
    if (argument == "--threads") {
      settings.measured_threads = parse_threads(value());
    } else if (argument == "--workload") {
      names.push_back(value());
    } else if (argument == "--repetitions") {
      settings.repetitions = std::max(1, std::atoi(value().c_str()));
    } else if (argument == "--json") {
      json_path = value();
    } else if (argument == "--no-model") {
      settings.model = false;
    } else if (argument == "--quick") {
      quick = true;
    } else {
      std::cerr << "sdmha_scaling: unknown argument " << argument
                << " (expected --threads LIST, --workload NAME, --repetitions N, --json FILE, "
                   "--no-model, --quick)\n";
      return 2;
    }
  }
  settings.predicted_threads = settings.measured_threads;
  for (int threads : {32, 64}) settings.predicted_threads.push_back(threads);
  settings.predicted_threads.erase(
      std::remove(settings.predicted_threads.begin(), settings.predicted_threads.end(), 1),
      settings.predicted_threads.end());
  std::sort(settings.predicted_threads.begin(), settings.predicted_threads.end());
  settings.predicted_threads.erase(
      std::unique(settings.predicted_threads.begin(), settings.predicted_threads.end()),
      settings.predicted_threads.end());

  std::vector<WorkloadShape> shapes = quick ? quick_workloads() : canonical_workloads();
  for (const std::string& name : names)
    if (std::none_of(shapes.begin(), shapes.end(),
                     [&](const WorkloadShape& w) { return w.name == name; }))
      throw std::invalid_argument("unknown workload " + name + " (expected seed, bow or long)");
  if (!names.empty())
    shapes.erase(std::remove_if(shapes.begin(), shapes.end(),
                                [&](const WorkloadShape& w) {
                                  return std::find(names.begin(), names.end(), w.name) ==
                                         names.end();
                                }),
                 shapes.end());

  std::cout << "sdmha_scaling: " << cpu_name() << ", " << std::thread::hardware_concurrency()
            << " hardware threads, " << SDMHA_SCALING_COMPILE_FLAGS << "\n";
  if (settings.model) print_model_header(std::cout, settings);
  std::vector<WorkloadResult> results;
  std::vector<std::pair<std::string, std::string>> failures;  // (workload, what it threw)
  int status = 0;
  for (const WorkloadShape& shape : shapes) {
    try {
      results.push_back(run_workload(shape, settings, std::cerr));
    } catch (const std::exception& error) {
      std::cout << "\n" << shape.name << " FAILED: " << error.what() << "\n";
      failures.emplace_back(shape.name, error.what());
      if (!json_path.empty()) write_json(json_path, results, failures, settings, quick);
      status = 1;
      continue;
    }
    print_measured(std::cout, results.back());
    if (settings.model) print_workload(std::cout, results.back(), settings);
    if (!results.back().bitwise.empty()) {
      if (!settings.model)  // print_workload says so otherwise
        std::cout << "RESULTS DIFFER BETWEEN THREAD COUNTS: " << results.back().bitwise << "\n";
      status = 1;
    }
    if (!json_path.empty())  // kept after each workload
      write_json(json_path, results, failures, settings, quick);
  }
  return status;
}

}  // namespace
}  // namespace sdmha_bench::scaling

int main(int argc, char** argv) {
  try {
    return sdmha_bench::scaling::run(argc, argv);
  } catch (const std::exception& error) {
    std::cerr << "sdmha_scaling: " << error.what() << "\n";
    return 2;
  }
}
