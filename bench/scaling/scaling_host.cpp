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
//                 [--precision float32|bfloat16] [--bfloat16-gemms auto,off,on,onednn,...]
//
// Per workload: every thread count's own Workspace, warmed by one training step; the outputs and
// gradients of every thread count compared bitwise with one thread's; then `repetitions` forward
// and training steps per thread count, interleaved, and their medians. With the model (the
// default), the one-thread trace, the regions' spans traced at each thread count, and the
// prediction at those counts and at 32 and 64.
//
// --precision bfloat16: the forward alone (the backward refuses bfloat16), float32 beside
// Precision::bfloat16 on each bfloat16 GEMM engine that --bfloat16-gemms names (values of
// SDMHA_BFLOAT16_GEMMS, default auto; a value the build refuses is reported and skipped), timed
// interleaved in one process, with each bfloat16 output's error against the float32 one
// (bfloat16_comparison.hpp); no model. Built with -DSDMHA_WITH_ONEDNN=1 and linked with oneDNN
// (-ldnnl), it can run the oneDNN engine and names the implementation oneDNN picks for a bfloat16
// matmul on this CPU (its AMX brgemm where usable).
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bfloat16_comparison.hpp"
#include "scaling_model.hpp"

#if defined(SDMHA_WITH_ONEDNN)
#include <oneapi/dnnl/dnnl.hpp>
#endif

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

// The CPU's flags that decide the bfloat16 engines, as /proc/cpuinfo lists them.
std::string bfloat16_cpu_flags() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("flags", 0) != 0) continue;
    std::string found;
    std::istringstream words(line.substr(line.find(':') + 1));
    for (std::string word; words >> word;)
      if (word == "avx512_bf16" || word == "amx_bf16" || word == "amx_tile")
        found += (found.empty() ? "" : " ") + word;
    return found.empty() ? "none of avx512_bf16, amx_bf16, amx_tile" : found;
  }
  return "unknown";
}

// oneDNN's version and the implementation it picks for a bfloat16 matmul of a projection's shape
// (512 rows, 512 × 512 weights, float32 output): "brg:avx512_core_amx_bf16" where AMX is usable.
std::string onednn_description() {
#if defined(SDMHA_WITH_ONEDNN)
  const dnnl_version_t* version = dnnl_version();
  std::string text = "oneDNN " + std::to_string(version->major) + "." +
                     std::to_string(version->minor) + "." + std::to_string(version->patch);
  try {
    using memory = dnnl::memory;
    const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    const memory::desc source({512, 512}, memory::data_type::bf16, memory::format_tag::ab);
    const memory::desc weights({512, 512}, memory::data_type::bf16, memory::format_tag::any);
    const memory::desc destination({512, 512}, memory::data_type::f32, memory::format_tag::ab);
#if DNNL_VERSION_MAJOR >= 3
    const dnnl::matmul::primitive_desc description(engine, source, weights, destination);
#else
    const dnnl::matmul::primitive_desc description(dnnl::matmul::desc(source, weights, destination),
                                                   engine);
#endif
    return text + ", bfloat16 matmul on " + description.impl_info_str();
  } catch (const dnnl::error& error) {
    return text + ", no bfloat16 matmul: " + error.what();
  }
#else
  return "none (built without SDMHA_WITH_ONEDNN)";
#endif
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

// The opening of workload i's JSON object, up to its "quick" field: both modes' files share it.
void write_workload_header(std::ostream& out, std::size_t i, const WorkloadShape& shape,
                           double density, Index nonzeros, bool quick) {
  out << (i ? ",\n  " : "\n  ") << "{\"workload\": " << json_string(shape.name)
      << ", \"density\": " << json_number(density) << ", \"nnz\": " << nonzeros
      << ", \"shape\": {\"B\": " << shape.batch << ", \"T\": " << shape.steps
      << ", \"Eq\": " << shape.query_dim << ", \"S\": " << shape.key_steps
      << "}, \"quick\": " << (quick ? "true" : "false");
}

// The workloads that failed (the first opens the list where no result did), then the file's end.
void write_failures_and_close(std::ofstream& out,
                              const std::vector<std::pair<std::string, std::string>>& failures,
                              bool no_result, const std::string& path) {
  for (std::size_t i = 0; i < failures.size(); ++i)
    out << (no_result && i == 0 ? "\n  " : ",\n  ")
        << "{\"workload\": " << json_string(failures[i].first)
        << ", \"error\": " << json_string(failures[i].second) << "}";
  out << "\n]}\n";
  if (!out) throw std::runtime_error("cannot write " + path);
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
    write_workload_header(out, i, r.shape, r.density, r.nonzeros, quick);
    out << ", \"bitwise_same\": " << (r.bitwise.empty() ? "true" : "false")
        << ", \"bitwise_difference\": " << json_string(r.bitwise)
        << ", \"seconds\": " << json_number(r.seconds) << ",\n   \"forward\": ";
    write_step(out, r.forward, settings.predicted_threads);
    out << ",\n   \"training\": ";
    write_step(out, r.training, settings.predicted_threads);
    out << "}";
  }
  write_failures_and_close(out, failures, results.empty(), path);
}

void write_precision_json(const std::string& path,
                          const std::vector<PrecisionWorkloadResult>& results,
                          const std::vector<std::pair<std::string, std::string>>& failures,
                          int repetitions, bool quick) {
  std::ofstream out(path);
  out << "{\"program\": \"sdmha_scaling\", \"mode\": \"precision\", \"cpu\": "
      << json_string(cpu_name()) << ", \"cpu_flags\": " << json_string(bfloat16_cpu_flags())
      << ", \"onednn\": " << json_string(onednn_description())
      << ", \"hardware_threads\": " << std::thread::hardware_concurrency()
      << ", \"flags\": " << json_string(SDMHA_SCALING_COMPILE_FLAGS)
      << ", \"repetitions\": " << repetitions << ", \"statistic\": \"median\""
      << ", \"error_measure\": \"max |y - y_float32| / max |y_float32|, whole output, one thread\""
      << ", \"workloads\": [";
  for (std::size_t i = 0; i < results.size(); ++i) {
    const PrecisionWorkloadResult& r = results[i];
    write_workload_header(out, i, r.shape, r.density, r.nonzeros, quick);
    out << ", \"seconds\": " << json_number(r.seconds) << ", \"variants\": [";
    for (std::size_t k = 0; k < r.variants.size(); ++k) {
      const PrecisionVariant& v = r.variants[k];
      out << (k ? ",\n    " : "\n    ") << "{\"gemms\": " << json_string(v.gemms);
      if (!v.refused.empty()) {
        out << ", \"refused\": " << json_string(v.refused) << "}";
        continue;
      }
      out << ", \"engine\": " << json_string(v.engine) << ", \"forward_ms\": {";
      for (std::size_t t = 0; t < v.measured_seconds.size(); ++t)
        out << (t ? ", " : "") << "\"" << v.measured_seconds[t].first
            << "\": " << json_number(v.measured_seconds[t].second * 1e3);
      out << "}, \"max_relative_error\": " << json_number(v.max_relative_error)
          << ", \"thread_invariant\": " << (v.thread_difference.empty() ? "true" : "false")
          << ", \"thread_difference\": " << json_string(v.thread_difference) << "}";
    }
    out << "]}";
  }
  write_failures_and_close(out, failures, results.empty(), path);
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

std::vector<std::string> parse_words(const std::string& list) {
  std::vector<std::string> words;
  std::stringstream stream(list);
  for (std::string item; std::getline(stream, item, ',');)
    if (!item.empty() && std::find(words.begin(), words.end(), item) == words.end())
      words.push_back(item);
  return words;
}

// --precision bfloat16: the float32 and bfloat16 forwards of each workload, side by side.
int run_precision(const std::vector<WorkloadShape>& shapes, const ScalingSettings& settings,
                  const std::vector<std::string>& gemms, const std::string& json_path, bool quick) {
  std::cout << "CPU flags: " << bfloat16_cpu_flags() << "; " << onednn_description() << "\n";
  std::vector<PrecisionWorkloadResult> results;
  std::vector<std::pair<std::string, std::string>> failures;
  int status = 0;
  for (const WorkloadShape& shape : shapes) {
    try {
      results.push_back(run_precision_workload(shape, settings.measured_threads, gemms,
                                               settings.repetitions, std::cerr));
    } catch (const std::exception& error) {
      std::cout << "\n" << shape.name << " FAILED: " << error.what() << "\n";
      failures.emplace_back(shape.name, error.what());
      if (!json_path.empty())
        write_precision_json(json_path, results, failures, settings.repetitions, quick);
      status = 1;
      continue;
    }
    print_precision_workload(std::cout, results.back());
    for (const PrecisionVariant& variant : results.back().variants)
      if (!variant.thread_difference.empty()) status = 1;
    if (!json_path.empty())  // kept after each workload
      write_precision_json(json_path, results, failures, settings.repetitions, quick);
  }
  return status;
}

int run(int argc, char** argv) {
  ScalingSettings settings;
  settings.measured_threads = {1, 2};
  settings.repetitions = 5;
  settings.trace_repetitions = 3;
  std::vector<std::string> names;
  std::string json_path;
  std::string precision = "float32";
  std::vector<std::string> gemms = {"auto"};
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
    } else if (argument == "--precision") {
      precision = value();
      if (precision != "float32" && precision != "bfloat16")
        throw std::invalid_argument("--precision: expected float32 or bfloat16, got " + precision);
    } else if (argument == "--bfloat16-gemms") {
      gemms = parse_words(value());
    } else {
      std::cerr << "sdmha_scaling: unknown argument " << argument
                << " (expected --threads LIST, --workload NAME, --repetitions N, --json FILE, "
                   "--no-model, --quick, --precision float32|bfloat16, --bfloat16-gemms LIST)\n";
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
  if (precision == "bfloat16") return run_precision(shapes, settings, gemms, json_path, quick);
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
