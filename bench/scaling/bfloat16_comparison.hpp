// bench/scaling/bfloat16_comparison.hpp — the forward in float32 and under
// Precision::bfloat16 on each bfloat16 GEMM engine, side by side at several thread counts:
// `sdmha_scaling --precision bfloat16` (scaling_host.cpp). Forward only: the backward refuses
// bfloat16.
//
// Per workload (seed 1 %, bow 1 %, long 5 %, as the scaling runs): one float32 layer and one
// bfloat16 layer per value of SDMHA_BFLOAT16_GEMMS asked for (the variable is read by
// set_precision, so each layer keeps the engine it was given), all on the same weights; a value
// set_precision refuses (a ConfigError: not a value this build knows) is reported with its
// message and left out. Every layer at every thread count has its own Workspace; the timed calls
// follow scaling_model.hpp's measure_steps: rounds of 3 steady calls, thread counts and layers in
// turn, medians. Outside timing: each layer's output at every thread count bitwise against its
// one-thread output, and each bfloat16 output against the float32 one.
#pragma once

#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "scaling_model.hpp"

namespace sdmha_bench::scaling {

// One layer of the comparison: float32, or bfloat16 with SDMHA_BFLOAT16_GEMMS = `gemms`.
struct PrecisionVariant {
  std::string gemms;    // "float32" for the float32 layer, else the variable's value
  std::string refused;  // set_precision's message when it refused the value
  // The engine set_precision chose (the layer's bfloat16_gemm_engine, named as the variable
  // names it): "off" (the GEMM stages in float32; Wq in bfloat16), "on" (the vdpbf16ps engine),
  // "onednn" (the projections on oneDNN's matmul), "amx" or "amx-emulated" (every GEMM stage on
  // AMX tiles, the CPU's or their emulation).
  std::string engine;
  std::vector<std::pair<int, double>> measured_seconds;  // (threads, median forward)
  // max |y − y_float32| / max |y_float32| over the whole output, at one thread.
  double max_relative_error = std::numeric_limits<double>::quiet_NaN();
  std::string thread_difference;  // empty when every thread count gave the one-thread bits
};

struct PrecisionWorkloadResult {
  WorkloadShape shape;
  double density = 0;
  Index nonzeros = 0;
  std::vector<PrecisionVariant> variants;  // float32 first
  double seconds = 0;                      // wall time of this workload's run
};

// Runs `call` with the environment variable `name` set to `value`, and restores it after.
template <typename Call>
void with_environment(const char* name, const std::string& value, Call&& call) {
  const char* old = std::getenv(name);
  const std::optional<std::string> previous = old ? std::optional<std::string>(old) : std::nullopt;
  ::setenv(name, value.c_str(), 1);
  try {
    call();
  } catch (...) {
    previous ? ::setenv(name, previous->c_str(), 1) : ::unsetenv(name);
    throw;
  }
  previous ? ::setenv(name, previous->c_str(), 1) : ::unsetenv(name);
}

inline double max_relative_difference(const Tensor3& got, const Tensor3& expected) {
  double largest_difference = 0, largest = 0;
  for (Index i = 0; i < expected.size(); ++i) {
    largest_difference =
        std::max(largest_difference, std::abs(double(got.data()[i]) - double(expected.data()[i])));
    largest = std::max(largest, std::abs(double(expected.data()[i])));
  }
  return largest > 0 ? largest_difference / largest : largest_difference;
}

inline bool same_bits(const Tensor3& a, const Tensor3& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), std::size_t(a.size()) * sizeof(float)) == 0;
}

inline PrecisionWorkloadResult run_precision_workload(const WorkloadShape& shape,
                                                      const std::vector<int>& thread_counts,
                                                      const std::vector<std::string>& gemms,
                                                      int repetitions, std::ostream& log) {
  const auto start = std::chrono::steady_clock::now();
  PrecisionWorkloadResult result;
  result.shape = shape;
  result.density = scaling_density(shape);
  log << shape.name << " " << result.density * 100 << " %: building inputs and layers\n"
      << std::flush;
  const StepProblem problem(shape, result.density);
  result.nonzeros = problem.query.nonzeros();
  const auto weights = std::make_shared<sdmha::MhaWeights<float>>(problem.make_weights());

  // The layers: the problem's (float32), then one per accepted value of the variable.
  std::vector<const Layer*> layers = {&problem.layer};
  std::vector<std::unique_ptr<Layer>> bfloat16_layers;
  result.variants.push_back({"float32", "", "float32", {}, 0.0, ""});
  for (const std::string& value : gemms) {
    PrecisionVariant variant;
    variant.gemms = value;
    auto layer = std::make_unique<Layer>(shape.config(), weights);
    try {
      with_environment("SDMHA_BFLOAT16_GEMMS", value,
                       [&] { layer->set_precision(sdmha::Precision::bfloat16); });
    } catch (const sdmha::ConfigError& error) {
      variant.refused = error.what();
      log << shape.name << ": SDMHA_BFLOAT16_GEMMS=" << value << " refused: " << error.what()
          << "\n";
      result.variants.push_back(variant);
      continue;
    }
    variant.engine = layer->bfloat16_gemm_engine();
    result.variants.push_back(variant);
    layers.push_back(layer.get());
    bfloat16_layers.push_back(std::move(layer));
  }
  std::vector<PrecisionVariant*> running;  // the variants of `layers`, in the same order
  for (PrecisionVariant& variant : result.variants)
    if (variant.refused.empty()) running.push_back(&variant);

  std::vector<int> counts = thread_counts;
  if (std::find(counts.begin(), counts.end(), 1) == counts.end()) counts.insert(counts.begin(), 1);
  // runners[layer][thread count], counts[0] = 1.
  std::vector<std::vector<std::unique_ptr<StepRunner>>> runners(layers.size());
  for (std::size_t v = 0; v < layers.size(); ++v)
    for (int threads : counts) {
      runners[v].push_back(std::make_unique<StepRunner>(problem, *layers[v], threads));
      runners[v].back()->run(Step::forward);  // sizes the workspace, starts its threads
    }
  const Tensor3& float32_output = runners[0][0]->result().output;
  for (std::size_t v = 0; v < layers.size(); ++v) {
    const Tensor3& one_thread = runners[v][0]->result().output;
    if (v > 0) running[v]->max_relative_error = max_relative_difference(one_thread, float32_output);
    for (std::size_t t = 1; t < counts.size(); ++t)
      if (running[v]->thread_difference.empty() &&
          !same_bits(runners[v][t]->result().output, one_thread))
        running[v]->thread_difference =
            "output at " + std::to_string(counts[t]) + " threads differs from one thread's";
  }

  log << shape.name << ": timing the forward of " << layers.size() << " layers at";
  for (int threads : counts) log << " " << threads;
  log << " threads, " << repetitions << " repetitions\n" << std::flush;
  constexpr int kRound = 3;
  std::vector<std::vector<std::vector<double>>> samples(
      layers.size(), std::vector<std::vector<double>>(counts.size()));
  for (int done = 0; done < repetitions; done += kRound)
    for (std::size_t t = 0; t < counts.size(); ++t)
      for (std::size_t v = 0; v < layers.size(); ++v) {
        StepRunner& runner = *runners[v][t];
        samples[v][t].push_back(steady_seconds(runner, Step::forward));
        for (int more = 1; more < std::min(kRound, repetitions - done); ++more)
          samples[v][t].push_back(seconds_of([&] { runner.run(Step::forward); }));
      }
  for (std::size_t v = 0; v < layers.size(); ++v)
    for (std::size_t t = 0; t < counts.size(); ++t)
      running[v]->measured_seconds.emplace_back(counts[t], median_of(samples[v][t]));
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

// Per layer: the engine, the median forward at each thread count with its speedup over the
// float32 layer at the same count, and the error against the float32 output.
inline void print_precision_workload(std::ostream& out, const PrecisionWorkloadResult& r) {
  const PrecisionVariant& float32 = r.variants.front();
  out << "\n"
      << r.shape.name << " " << r.density * 100
      << " %: forward, median ms (float32 ÷ this: its speedup); error = max |y − y_float32| ÷ "
         "max |y_float32|\n"
      << "SDMHA_BFLOAT16_GEMMS | engine  ";
  for (const auto& measured : float32.measured_seconds) {
    const int threads = measured.first;
    char label[64];
    std::snprintf(label, sizeof label, " | %-15s",
                  (std::to_string(threads) + (threads == 1 ? " thread" : " threads")).c_str());
    out << label;
  }
  out << " | error\n";
  for (const PrecisionVariant& variant : r.variants) {
    char line[256];
    std::snprintf(line, sizeof line, "%-20s | %-8s", variant.gemms.c_str(),
                  variant.refused.empty() ? variant.engine.c_str() : "refused");
    out << line;
    if (!variant.refused.empty()) {
      out << " | " << variant.refused << "\n";
      continue;
    }
    for (std::size_t t = 0; t < variant.measured_seconds.size(); ++t) {
      const double seconds = variant.measured_seconds[t].second;
      std::snprintf(line, sizeof line, " | %8.2f %5.2fx", seconds * 1e3,
                    float32.measured_seconds[t].second / seconds);
      out << line;
    }
    std::snprintf(line, sizeof line, " | %.2e", variant.max_relative_error);
    out << (variant.gemms == "float32" ? " | –" : line) << "\n";
    if (!variant.thread_difference.empty())
      out << "RESULTS DIFFER BETWEEN THREAD COUNTS (" << variant.gemms
          << "): " << variant.thread_difference << "\n";
  }
}

}  // namespace sdmha_bench::scaling
