// bench/report.hpp — the summary's text tables and its JSON document (read by bench/plot.py), and
// the memory-only workloads' table.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "environment.hpp"
#include "timing.hpp"

namespace sdmha_bench {

// Keys in the order they are written (bench/plot.py looks them up by name; the order is for a
// reader and for diffs between runs).
using Json = nlohmann::ordered_json;

// What the bf16 column's GEMM stages ran on, named by the SDMHA_BFLOAT16_GEMMS value that forces
// it: its layer's choice (the same for every configuration of one process).
inline std::string bfloat16_gemms(const std::vector<ConfigResult>& results) {
  return results.empty() ? "(nothing run)" : results.front().bfloat16_gemms;
}

inline std::string format(const char* pattern, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, pattern, value);
  return buffer;
}

inline std::string megabytes(std::int64_t bytes) {
  return bytes < 0 ? "n/a" : format("%.2f", double(bytes) / 1e6);
}

// A time in ms, or "-" for a case that was not run.
inline std::string milliseconds_text(double ms) {
  return std::isnan(ms) ? "-" : format("%.2f", ms);
}

// The stages alone: time (and GFLOP/s) of each, walking the layer's own plan of a forward call.
inline void print_stage_table(std::ostream& out, const std::vector<ConfigResult>& results) {
  char line[512];
  out << "\nstages alone, ms (GFLOP/s), each walking the layer's own plan of a forward call:\n";
  const char* stage_header =
      "%-5s %7s %3s | %8s %14s %14s %14s | %14s %14s %14s | %7s %14s %14s | %14s %14s %14s\n";
  std::snprintf(line, sizeof line, stage_header, "work", "density", "thr", "densify",
                "q-proj sparse", "q-proj dense", "q-proj eigen", "k+v proj", "scores",
                "scores regroup", "softmax", "attend values", "out proj", "GEMM k-proj",
                "GEMM scores", "GEMM attend");
  out << line;
  for (const ConfigResult& r : results) {
    auto cell = [&](const char* name) {
      const double ms = r.ms(name);
      const CaseResult* c = r.find(name);
      if (std::isnan(ms) || c->flops <= 0) return milliseconds_text(ms);
      char text[64];
      std::snprintf(text, sizeof text, "%.2f (%.0f)", ms, c->flops / ms * 1e-6);
      return std::string(text);
    };
    std::snprintf(
        line, sizeof line, stage_header, r.shape.name.c_str(), format("%g", r.density).c_str(),
        std::to_string(r.threads).c_str(), cell("densify/dense").c_str(),
        cell("query_projection/sparse").c_str(), cell("query_projection/dense").c_str(),
        cell("query_projection/eigen_csr").c_str(), cell("key_value_projection/shared").c_str(),
        cell("scores/shared").c_str(), cell("scores/sparse_regrouped").c_str(),
        cell("softmax/shared").c_str(), cell("attend_values/shared").c_str(),
        cell("output_projection/shared").c_str(), cell("gemm/eigen").c_str(),
        cell("gemm/eigen_scores_size").c_str(), cell("gemm/eigen_attend_size").c_str());
    out << line;
  }
  out << "(scores regroup includes the query projection, which it replaces; softmax and densify do "
         "no\n"
         "counted FLOPs; k+v, scores, softmax, attend values and out proj are the same code for "
         "both\n"
         "paths. GEMM k-proj = one plain Eigen `C.noalias() = A * B` of the key projection's size "
         "on one\n"
         "thread; GEMM scores / attend = plain Eigen products of the score and attend stages' tile "
         "sizes,\n"
         "tile by tile: the yardsticks of the dense stages' GFLOP/s. Scores, softmax and attend "
         "values\n"
         "walk the plan forward makes when it returns the scores, probabilities stored; where S > "
         "kKeyTile\n"
         "(long) forward itself runs an online softmax over key tiles instead, timed only "
         "whole.)\n";
}

inline void print_summary(std::ostream& out, const std::vector<ConfigResult>& results,
                          const Machine& machine, const AllocationCheck& allocation,
                          int repetitions, bool quick, const std::string& load_before,
                          const std::string& load_after) {
  out << "sdmha_bench --summary"
      << (quick ? " --quick (reduced B and T: not the canonical shapes)" : "")
      << ": float32, median of " << repetitions
      << " interleaved runs per figure, each after an untimed call of its own\n";
  out << machine.line() << "\n";
  out << "bf16's GEMM stages: SDMHA_BFLOAT16_GEMMS=" << bfloat16_gemms(results) << " ("
      << (std::getenv("SDMHA_BFLOAT16_GEMMS") != nullptr ? "as set" : "this CPU's choice") << ")\n";
  out << "load average (1, 5, 15 min) before: " << load_before << "; after: " << load_after
      << " (other work on the machine slows both paths; compare ratios, not times)\n";
  if (allocation.counted)
    out << "heap counting verified: Eigen::MatrixXf(1000, 1000) -> "
        << allocation.eigen_matrix_bytes << " B, std::vector<float>(1e6) -> "
        << allocation.std_vector_bytes << " B\n";
  else
    out << "heap counting unavailable: " << allocation.problem << "\n";
  out << "\n";

  char line[512];
  const char* header =
      "%-5s %7s %3s %7s | %9s %9s %9s %9s | %8s %9s | %7s %6s | %8s %8s %6s | %8s %8s | %7s | "
      "%9s %7s %9s %7s\n";
  std::snprintf(line, sizeof line, header, "work", "density", "thr", "nnz/row", "sparse", "plain",
                "regroup", "bf16", "densify", "dense", "speedup", "ideal", "peak MB", "peak MB",
                "mem", "query MB", "query MB", "allocs", "backward", "bwd/", "bwd ctx", "ctx/");
  out << line;
  std::snprintf(line, sizeof line, header, "", "", "", "", "ms", "ms", "ms", "ms", "ms", "ms", "",
                "", "sparse", "dense", "ratio", "CSR", "dense", "fwd/bwd", "ms", "fwd", "ms",
                "fwd");
  out << line;
  for (const ConfigResult& r : results) {
    const std::int64_t sparse_peak = r.peak_bytes("forward/sparse");
    const std::int64_t dense_peak = r.peak_bytes("forward/dense");
    const std::string ratio = sparse_peak > 0 && dense_peak >= 0
                                  ? format("%.1fx", double(dense_peak) / double(sparse_peak))
                                  : "n/a";
    const std::int64_t forward_allocations = r.steady_allocations("forward/sparse");
    const std::int64_t backward_allocations = r.steady_backward_allocations();
    auto count_text = [](std::int64_t count) {
      return count < 0 ? std::string("n/a") : std::to_string(count);
    };
    const std::string allocations =
        count_text(forward_allocations) + "/" + count_text(backward_allocations);
    const double backward_ms = r.ms("backward/sparse");
    const double context_backward_ms = r.ms("backward/sparse_saved_context");
    std::snprintf(line, sizeof line,
                  "%-5s %7g %3d %7ld | %9s %9s %9s %9s | %8s %9s | %6.2fx %6.2f | %8s %8s %6s | "
                  "%8.2f %8.2f | %7s | %9s %6.2fx %9s %6.2fx\n",
                  r.shape.name.c_str(), r.density, r.threads, long(r.nonzeros_per_row),
                  milliseconds_text(r.ms("forward/sparse")).c_str(),
                  milliseconds_text(r.ms("forward/sparse_plain")).c_str(),
                  milliseconds_text(r.ms("forward/sparse_regrouped")).c_str(),
                  milliseconds_text(r.ms("forward/sparse_bf16")).c_str(),
                  milliseconds_text(r.ms("densify/dense")).c_str(),
                  milliseconds_text(r.ms("forward/dense")).c_str(), r.speedup(),
                  r.flops.ideal_speedup(), megabytes(sparse_peak).c_str(),
                  megabytes(dense_peak).c_str(), ratio.c_str(), r.csr_bytes / 1e6,
                  r.dense_bytes / 1e6, allocations.c_str(), milliseconds_text(backward_ms).c_str(),
                  backward_ms / r.ms("forward/sparse"),
                  milliseconds_text(context_backward_ms).c_str(),
                  context_backward_ms / r.ms("forward/sparse"));
    out << line;
  }
  out << "\nsparse = SparseDenseMHA::forward (project_first) with a Workspace and result kept "
         "between\n"
         "calls; plain = the plain forward(query, {key, value}, options): a new result per call, "
         "the\n"
         "layer's own cached workspace; regroup = the same as sparse with sparse_regrouped\n"
         "scores (\"-\": not timed where it costs more FLOPs than the dense layer); bf16 = the\n"
         "same as sparse with set_precision(bfloat16); dense =\n"
         "SparseQuery::to_dense + DenseMHA::forward, densify included (and shown alone); speedup "
         "=\n"
         "dense / sparse; ideal = dense FLOP / sparse FLOP (bench/workloads.md), the speedup at "
         "equal\n"
         "efficiency; peak MB = most heap bytes one call has live at once, inputs excluded (the "
         "dense\n"
         "call's include its densified query; the first call with a fresh Workspace); query MB = "
         "the\n"
         "query's own bytes (CSR: values, column indices, row offsets); allocs fwd/bwd = heap "
         "blocks "
         "one\n"
         "more sparse forward / backward call (the more of both backward rows) takes after the "
         "timed\n"
         "ones (the steady state); backward =\n"
         "SparseDenseMHA::backward with a Workspace and MhaGradients kept (automatic strategy;\n"
         "it recomputes the forward, K and V included); bwd ctx = the same given the\n"
         "ProjectedContext that the training step's forward made (only Q, P and A are\n"
         "recomputed); bwd/fwd and ctx/fwd = those / sparse.\n";
  print_stage_table(out, results);
}

// JSON has no NaN or infinity: a figure that was not measured (NaN) is written as null.
inline Json json_number(double value) { return std::isfinite(value) ? Json(value) : Json(nullptr); }

// A count held in a double (FLOPs, bytes): written as an integer when it is one (below 2^53),
// as a number otherwise, null when not finite.
inline Json json_count(double value) {
  const bool whole =
      std::isfinite(value) && value == std::floor(value) && std::fabs(value) < 0x1p53;
  return whole ? Json(static_cast<std::int64_t>(value)) : json_number(value);
}

// A case's median in ms, or null where it was not timed.
inline Json json_ms(const ConfigResult& r, const char* name) { return json_number(r.ms(name)); }

// A byte count, or null where the heap was not counted (negative).
inline Json json_bytes(std::int64_t bytes) { return bytes < 0 ? Json(nullptr) : Json(bytes); }

// One run's stage times per path; the shared stages are timed once and listed on every path.
inline Json json_stages(const ConfigResult& r) {
  auto ms = [&](const char* name) { return json_ms(r, name); };
  // A path's own first stages, then the shared ones in pipeline order.
  auto path = [&](Json stages, bool with_scores) {
    stages["key_value_projection"] = ms("key_value_projection/shared");
    if (with_scores) stages["scores"] = ms("scores/shared");
    stages["softmax"] = ms("softmax/shared");
    stages["attend_values"] = ms("attend_values/shared");
    stages["output_projection"] = ms("output_projection/shared");
    return stages;
  };
  Json stages;
  stages["sparse"] = path({{"query_projection", ms("query_projection/sparse")}}, true);
  stages["sparse_regrouped"] =
      path({{"scores_with_query_projection", ms("scores/sparse_regrouped")}}, false);
  stages["dense"] = path(
      {{"densify", ms("densify/dense")}, {"query_projection", ms("query_projection/dense")}}, true);
  stages["reference"] = {{"eigen_csr_query_projection", ms("query_projection/eigen_csr")}};
  return stages;
}

inline Json json_flops(const ConfigResult& r) {
  const auto& f = r.flops;
  return {{"query_projection_dense", json_count(f.query_projection_dense)},
          {"query_projection_sparse", json_count(f.query_projection_sparse)},
          {"key_value_projection", json_count(f.key_value_projection)},
          {"scores", json_count(f.scores)},
          {"attend_values", json_count(f.attend_values)},
          {"output_projection", json_count(f.output_projection)},
          {"dense_total", json_count(f.dense_total())},
          {"sparse_total", json_count(f.sparse_total())},
          {"regrouped_scores_executed_estimate",
           json_count(regrouped_score_flops(r.shape, r.density))}};
}

inline Json json_cases(const ConfigResult& r) {
  Json cases = Json::array();
  for (const CaseResult& c : r.cases)
    cases.push_back(
        {{"name", c.name},
         {"median_ms", json_number(c.median_ms)},
         {"flops", json_count(c.flops)},
         {"gflops_per_s", json_number(c.median_ms > 0 ? c.flops / c.median_ms * 1e-6 : 0.0)},
         {"peak_bytes", json_bytes(c.peak_bytes)},
         {"steady_allocations", c.steady_allocations},
         {"error", c.error}});
  return cases;
}

// One configuration (workload, density, thread count); bench/plot.py reads some of it.
inline Json json_run(const ConfigResult& r) {
  const WorkloadShape& w = r.shape;
  auto ms = [&](const char* name) { return json_ms(r, name); };
  Json run;
  run["workload"] = w.name;
  run["shape"] = {{"B", w.batch},        {"T", w.steps}, {"Eq", w.query_dim}, {"S", w.key_steps},
                  {"Ek", w.context_dim}, {"H", w.heads}, {"Dk", w.head_dim},  {"O", w.output_dim}};
  run["density"] = json_number(r.density);
  run["nonzeros_per_row"] = r.nonzeros_per_row;
  run["nnz"] = r.nonzeros;
  run["threads"] = r.threads;
  run["flops"] = json_flops(r);
  run["speedup"] = json_number(r.speedup());
  run["ideal_speedup"] = json_number(r.flops.ideal_speedup());
  run["forward_ms"] = {{"sparse", ms("forward/sparse")},
                       {"sparse_plain", ms("forward/sparse_plain")},
                       {"sparse_regrouped", ms("forward/sparse_regrouped")},
                       {"sparse_bfloat16", ms("forward/sparse_bf16")},
                       {"dense", ms("forward/dense")},
                       {"densify", ms("densify/dense")}};
  run["backward_ms"] = ms("backward/sparse");
  run["backward_saved_context_ms"] = ms("backward/sparse_saved_context");
  run["steady_state_allocations_per_call"] = r.steady_allocations("forward/sparse");
  run["steady_state_allocations_per_backward_call"] = r.steady_backward_allocations();
  run["stages_ms"] = json_stages(r);
  run["memory_bytes"] = {
      {"sparse_peak", json_bytes(r.peak_bytes("forward/sparse"))},
      {"sparse_regrouped_peak", json_bytes(r.peak_bytes("forward/sparse_regrouped"))},
      {"dense_peak", json_bytes(r.peak_bytes("forward/dense"))},
      {"query_csr", json_count(r.csr_bytes)},
      {"query_dense", json_count(r.dense_bytes)}};
  run["cases"] = json_cases(r);
  return run;
}

inline void write_json(const std::string& path, const std::vector<ConfigResult>& results,
                       const Machine& machine, int repetitions, bool quick,
                       const std::string& load_before, const std::string& load_after) {
  Json document;
  document["machine"] = {{"cpu", machine.cpu},           {"cores", machine.cores},
                         {"compiler", machine.compiler}, {"flags", machine.flags},
                         {"eigen", machine.eigen},       {"line", machine.line()}};
  document["bfloat16_gemms"] = bfloat16_gemms(results);
  document["load_average_before"] = load_before;
  document["load_average_after"] = load_after;
  document["quick"] = quick;
  document["repetitions"] = repetitions;
  document["statistic"] = "median";
  document["runs"] = Json::array();
  for (const ConfigResult& r : results) document["runs"].push_back(json_run(r));
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path);
  // Text the bench collected (the CPU's name, error messages) may not be valid UTF-8: replaced.
  out << document.dump(2, ' ', false, Json::error_handler_t::replace) << "\n";
  if (!out) throw std::runtime_error("failed writing " + path);
}

inline void print_memory(std::ostream& out, const std::vector<MemoryResult>& results) {
  if (results.empty()) return;
  out << "\nmemory-only workloads: one forward from a fresh Workspace and result (sparse = "
         "SparseDenseMHA project_first; dense = densify + DenseMHA), checked against each other; "
         "K+V whole = what K and V projected whole would take:\n";
  char header[256];
  std::snprintf(header, sizeof header, "%-9s %7s %3s %-18s | %14s %7s | %13s %7s | %12s\n", "work",
                "density", "thr", "(B, T, S)", "sparse peak MB", "ms", "dense peak MB", "ms",
                "K+V whole MB");
  out << header;
  for (const MemoryResult& r : results) {
    char sizes[64], line[256];
    std::snprintf(sizes, sizeof sizes, "(%ld, %ld, %ld)", long(r.shape.batch), long(r.shape.steps),
                  long(r.shape.key_steps));
    std::snprintf(line, sizeof line, "%-9s %7.2f %3d %-18s | %14s %7.0f | %13s %7.0f | %12.1f",
                  r.shape.name.c_str(), r.density, r.threads, sizes,
                  megabytes(r.sparse_peak).c_str(), r.sparse_ms, megabytes(r.dense_peak).c_str(),
                  r.dense_ms, r.whole_context_bytes() / 1e6);
    out << line << (r.error.empty() ? "" : "  FAILED: " + r.error) << "\n";
  }
}

}  // namespace sdmha_bench
