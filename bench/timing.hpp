// bench/timing.hpp — what is timed and how: the cases (one timed call each: the whole layer,
// forward and backward, and each stage, sparse and dense), each checked against the dense path
// before it is timed; the interleaved medians of the summary; the memory-only workloads' one call.
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

#include "allocation_counter.hpp"
#include "problem.hpp"

namespace sdmha_bench {

// ---- Cases: one timed thing each ----

struct Case {
  std::string stage;       // forward, densify, query_projection, key_value_projection, scores, ...
  std::string variant;     // sparse, sparse_regrouped, dense, eigen_csr, or shared (same for both)
  double flops = 0;        // useful floating-point work of one call, bench/workloads.md's counting
  double query_bytes = 0;  // the query form the case reads (CSR or dense); 0 when none
  double items = 0;        // softmax: score entries per call
  double bytes = 0;        // densify: bytes written per call
  std::function<void()> prepare;       // untimed, before the checked call
  std::function<void()> run;           // one call: what is timed
  std::function<std::string()> check;  // after a call: empty when the result agrees

  std::string name() const { return stage + "/" + variant; }
};

inline sdmha::AttentionOptions<float> options_for(int threads, sdmha::ScoreStrategy strategy) {
  sdmha::AttentionOptions<float> result;
  result.num_threads = threads;
  result.score_strategy = strategy;
  return result;
}

// The whole layer's forward cases, in the order of case_names(). "dense" is what a user without
// sdmha runs: densify, then the dense layer.
inline void add_forward_cases(std::vector<Case>& cases, Problem& p, int threads) {
  const FlopCounts& f = p.flops;
  const double csr = csr_bytes(p.query), dense = dense_query_bytes(p.shape);
  auto options = [threads](sdmha::ScoreStrategy strategy) {
    return options_for(threads, strategy);
  };
  auto check_forward = [&p] {
    return compare("forward output", as_matrix(p.forward_result.output), p.output);
  };
  auto fresh = [&p](sdmha::Workspace<float>& workspace) {
    return [&p, &workspace] {
      workspace = sdmha::Workspace<float>();
      p.forward_result = sdmha::AttentionResult<float>();
    };
  };
  cases.push_back(
      {"forward", "sparse", f.sparse_total(), csr, 0, 0, fresh(p.sparse_workspace),
       [&p, o = options(sdmha::ScoreStrategy::project_first)] {
         p.sparse_layer.forward(p.query, {p.key, p.value}, o, p.sparse_workspace, p.forward_result);
       },
       check_forward});
  // The call most users make: no Workspace given, a new result each call.
  // Its workspace is the layer's own cache, emptied before the checked call.
  cases.push_back({"forward", "sparse_plain", f.sparse_total(), csr, 0, 0,
                   [&p] {
                     p.sparse_layer.release_workspace_cache();
                     p.forward_result = sdmha::AttentionResult<float>();
                   },
                   [&p, o = options(sdmha::ScoreStrategy::project_first)] {
                     p.forward_result = p.sparse_layer.forward(p.query, {p.key, p.value}, o);
                   },
                   check_forward});
  if (regrouped_is_timed(p.shape, p.density))
    cases.push_back({"forward", "sparse_regrouped", f.sparse_total(), csr, 0, 0,
                     fresh(p.regrouped_workspace),
                     [&p, o = options(sdmha::ScoreStrategy::sparse_regrouped)] {
                       p.sparse_layer.forward(p.query, {p.key, p.value}, o, p.regrouped_workspace,
                                              p.forward_result);
                     },
                     check_forward});
  cases.push_back({"forward", "sparse_bf16", f.sparse_total(), csr, 0, 0,
                   fresh(p.bfloat16_workspace),
                   [&p, o = options(sdmha::ScoreStrategy::project_first)] {
                     p.bfloat16_layer.forward(p.query, {p.key, p.value}, o, p.bfloat16_workspace,
                                              p.forward_result);
                   },
                   [&p] {
                     return compare("bfloat16 forward output", as_matrix(p.forward_result.output),
                                    p.output, kBFloat16RelativeTolerance);
                   }});
  cases.push_back({"forward", "dense", f.dense_total(), dense, 0, 0, fresh(p.dense_workspace),
                   [&p, o = options(sdmha::ScoreStrategy::project_first)] {
                     const Matrix densified = p.query.to_dense();
                     p.dense_layer.forward(p.dense_query_tensor(densified), {p.key, p.value}, o,
                                           p.dense_workspace, p.forward_result);
                   },
                   check_forward});
}

// The training pass (it recomputes the forward it needs), with and without the forward's
// ProjectedContext. Checked by an identity of the gradients: ∂loss/∂bo = Σ over rows of ∂loss/∂Y,
// and everything finite.
inline void add_backward_cases(std::vector<Case>& cases, Problem& p, int threads) {
  const double csr = csr_bytes(p.query);
  const sdmha::AttentionOptions<float> o = options_for(threads, sdmha::ScoreStrategy::automatic);
  auto check_backward = [&p] {
    const auto& g = p.gradients;
    if (!g.query_kernel.allFinite() || !g.key_kernel.allFinite() || !g.value_kernel.allFinite() ||
        !g.output_kernel.allFinite() || !g.query_values.allFinite())
      return std::string("backward: a gradient is not finite");
    const Matrix expected = as_matrix(p.d_output).colwise().sum();
    return compare("backward output bias gradient", g.output_bias.transpose(), expected);
  };
  auto fresh_backward = [&p] {
    p.backward_workspace = sdmha::Workspace<float>();
    p.gradients = sdmha::MhaGradients<float>();
  };
  cases.push_back({"backward", "sparse", 0, csr, 0, 0, fresh_backward,
                   [&p, o] {
                     p.sparse_layer.backward(p.query, {p.key, p.value}, p.d_output, o,
                                             p.backward_workspace, p.gradients);
                   },
                   check_backward});
  // The same reusing the K and V that the training step's forward projected (its
  // ProjectedContext), as a training loop does: the backward then skips their recomputation.
  cases.push_back({"backward", "sparse_saved_context", 0, csr, 0, 0,
                   [&p, threads, fresh_backward] {
                     p.saved_context = p.sparse_layer.project_context(p.key, p.value, threads);
                     fresh_backward();
                   },
                   [&p, o] {
                     p.sparse_layer.backward(p.query, {p.key, p.value, p.saved_context}, p.d_output,
                                             o, p.backward_workspace, p.gradients);
                   },
                   check_backward});
}

// Stage by stage, each walking the layer's own plan at this thread count (LayerPlan), and the
// plain Eigen GEMMs beside them.
inline void add_stage_cases(std::vector<Case>& cases, Problem& p, int threads) {
  const FlopCounts& f = p.flops;
  const double csr = csr_bytes(p.query), dense = dense_query_bytes(p.shape);
  const bool regrouped = regrouped_is_timed(p.shape, p.density);
  StagePlans& plans = p.plans(threads);
  LayerPlan* plan = plans.project_first.get();
  LayerPlan* regrouped_plan = plans.regrouped.get();
  cases.push_back({"densify", "dense", 0, csr, 0, dense, nullptr,
                   [&p] { p.densified = p.query.to_dense(); },
                   [&p] { return compare("densified query", p.densified, p.dense_query); }});
  auto check_projected_query = [&p] {
    return compare("projected query", p.projected_query_out, p.projected_query);
  };
  cases.push_back(
      {"query_projection", "sparse", f.query_projection_sparse, csr, 0, 0, nullptr,
       [&p, plan] { plan->project_query(p.sparse_layer, p.query, p.projected_query_out); },
       check_projected_query});
  cases.push_back(
      {"query_projection", "dense", f.query_projection_dense, dense, 0, 0, nullptr,
       [&p, plan] { dense_query_projection(p, *plan, p.dense_query, p.projected_query_out); },
       check_projected_query});
  cases.push_back({"query_projection", "eigen_csr", f.query_projection_sparse, csr, 0, 0, nullptr,
                   [&p, plan] { eigen_query_projection(p, *plan, p.projected_query_out); },
                   check_projected_query});
  cases.push_back({"key_value_projection", "shared", f.key_value_projection, 0, 0, 0, nullptr,
                   [&p, plan] { key_value_projection(p, *plan, p.keys_out, p.values_out); },
                   [&p] {
                     std::string error = compare("projected key", p.keys_out, p.keys);
                     return error.empty() ? compare("projected value", p.values_out, p.values)
                                          : error;
                   }});
  auto check_scores = [&p] { return compare("scores", p.scores_out, p.scores); };
  cases.push_back(
      {"scores", "shared", f.scores, 0, 0, 0, nullptr,
       [&p, plan] { project_first_scores(p, *plan, p.projected_query, p.keys, p.scores_out); },
       check_scores});
  // The regrouped kernel reads the CSR rows and the query kernel: it does the query
  // projection's job too, so its useful work is both stages'.
  if (regrouped) {
    if (regrouped_plan == nullptr)
      throw std::logic_error("no regrouped plan for a timed regrouped case");
    cases.push_back(
        {"scores", "sparse_regrouped", f.query_projection_sparse + f.scores, csr, 0, 0, nullptr,
         [&p, regrouped_plan] { regrouped_scores(p, *regrouped_plan, p.keys, p.scores_out); },
         check_scores});
  }
  // In place: the checked call turns a copy of the scores into probabilities; the timed calls
  // that follow rerun it on its own output, which costs the same.
  cases.push_back({"softmax", "shared", 0, 0, double(p.scores.size()), 0,
                   [&p] { p.scores_out = p.scores; },
                   [&p, plan] { softmax(p, *plan, p.scores_out); },
                   [&p] { return compare("probabilities", p.scores_out, p.probabilities); }});
  cases.push_back({"attend_values", "shared", f.attend_values, 0, 0, 0, nullptr,
                   [&p, plan] { attend_values(p, *plan, p.probabilities, p.values, p.heads_out); },
                   [&p] { return compare("attended heads", p.heads_out, p.heads); }});
  cases.push_back({"output_projection", "shared", f.output_projection, 0, 0, 0, nullptr,
                   [&p, plan] { output_projection(p, *plan, p.heads, p.output_out); },
                   [&p] { return compare("output", p.output_out, p.output); }});
  // The yardstick of the dense stages: one plain Eigen GEMM of the key projection's size,
  // (B·S × Ek)·(Ek × H·Dk) in a single call on one thread (whatever the row's thread count), as
  // Eigen runs it by itself.
  cases.push_back({"gemm", "eigen", f.key_value_projection / 2, 0, 0, 0, nullptr,
                   [&p] { p.gemm_out.noalias() = as_matrix(p.key) * p.weights().key_kernel; },
                   [&p] {
                     const Matrix expected = p.keys.rowwise() - p.weights().key_bias.transpose();
                     return compare("plain GEMM", p.gemm_out, expected);
                   }});
  cases.push_back(
      {"gemm", "eigen_scores_size", f.scores, 0, 0, 0, nullptr,
       [&p, plan] { plain_score_gemms(p, *plan, p.scores_out); },
       [&p] { return compare("plain score GEMMs", p.scores_out * p.score_scale(), p.scores); }});
  cases.push_back({"gemm", "eigen_attend_size", f.attend_values, 0, 0, 0, nullptr,
                   [&p, plan] { plain_attend_gemms(p, *plan, p.heads_out); },
                   [&p] { return compare("plain attend GEMMs", p.heads_out, p.heads); }});
}

// Every case of one problem at one thread count, in the order of case_names(). The regrouped
// cases are left out where regrouped_is_timed() says they would cost more than the dense layer.
inline std::vector<Case> make_cases(Problem& p, int threads) {
  std::vector<Case> cases;
  add_forward_cases(cases, p, threads);
  add_backward_cases(cases, p, threads);
  add_stage_cases(cases, p, threads);
  return cases;
}

// The names of make_cases' cases, in its order, known before any input is built.
inline std::vector<std::string> case_names(const WorkloadShape& shape, double density) {
  const bool regrouped = regrouped_is_timed(shape, density);
  std::vector<std::string> names = {"forward/sparse", "forward/sparse_plain"};
  if (regrouped) names.push_back("forward/sparse_regrouped");
  for (const char* name :
       {"forward/sparse_bf16", "forward/dense", "backward/sparse", "backward/sparse_saved_context",
        "densify/dense", "query_projection/sparse", "query_projection/dense",
        "query_projection/eigen_csr", "key_value_projection/shared", "scores/shared"})
    names.push_back(name);
  if (regrouped) names.push_back("scores/sparse_regrouped");
  for (const char* name : {"softmax/shared", "attend_values/shared", "output_projection/shared"})
    names.push_back(name);
  for (const char* name : {"gemm/eigen", "gemm/eigen_scores_size", "gemm/eigen_attend_size"})
    names.push_back(name);
  return names;
}

// The checked call of a case: the peak heap bytes of one call and the check's verdict.
struct CheckedCall {
  std::int64_t peak_bytes = -1;  // -1 when the heap is not counted
  std::string error;
};

inline CheckedCall checked_call(const Case& c) {
  CheckedCall result;
  try {
    if (c.prepare) c.prepare();
    const std::int64_t peak = peak_heap_bytes(c.run);
    if (AllocationCounter::counts_malloc()) result.peak_bytes = peak;
    result.error = c.check();
  } catch (const std::exception& error) {
    result.error = std::string("threw: ") + error.what();
  }
  return result;
}

// ---- Summary mode ----

struct CaseResult {
  std::string name;
  double flops = 0;
  std::vector<double> milliseconds;
  double median_ms = 0;
  std::int64_t peak_bytes = -1;
  std::int64_t steady_allocations = -1;  // heap blocks taken by one more call after the timed ones
  std::string error;
};

struct ConfigResult {
  WorkloadShape shape;
  double density = 0;
  Index nonzeros = 0, nonzeros_per_row = 0;
  int threads = 1;
  FlopCounts flops;
  double csr_bytes = 0, dense_bytes = 0;
  std::string bfloat16_gemms;  // the bf16 layer's bfloat16_gemm_engine()
  std::vector<CaseResult> cases;

  // nullptr for a case that was not run (the regrouped ones, see regrouped_is_timed).
  const CaseResult* find(const std::string& name) const {
    for (const CaseResult& c : cases)
      if (c.name == name) return &c;
    return nullptr;
  }
  const CaseResult& get(const std::string& name) const {
    if (const CaseResult* c = find(name)) return *c;
    throw std::logic_error("no case " + name);
  }
  // NaN when the case was not run or failed.
  double ms(const std::string& name) const {
    const CaseResult* c = find(name);
    return c == nullptr || !c->error.empty() ? std::nan("") : c->median_ms;
  }
  std::int64_t peak_bytes(const std::string& name) const {
    const CaseResult* c = find(name);
    return c == nullptr ? -1 : c->peak_bytes;
  }
  double speedup() const { return ms("forward/dense") / ms("forward/sparse"); }
  std::int64_t steady_allocations(const std::string& name) const {
    const CaseResult* c = find(name);
    return c == nullptr ? -1 : c->steady_allocations;
  }
  // The most that one more backward call takes, with or without the saved context.
  std::int64_t steady_backward_allocations() const {
    return std::max(steady_allocations("backward/sparse"),
                    steady_allocations("backward/sparse_saved_context"));
  }
};

inline double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n == 0 ? 0.0 : n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

inline double milliseconds_of(const std::function<void()>& call) {
  const auto start = std::chrono::steady_clock::now();
  call();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// Every case checked once, then timed `repetitions` times, interleaved (case 1, 2, …, 1, 2, …)
// so that a burst of load from elsewhere on the machine hits sparse and dense alike. Each timed
// call follows an untimed call of the same case: on a virtual machine the first touch of memory
// after another case frees a large block (the dense cases' densified query, 134 MB on bow) can
// cost more than the call itself, whichever case it lands on, and the steady state is what a
// server sees.
inline ConfigResult measure(Problem& p, int threads, int repetitions) {
  ConfigResult result;
  result.shape = p.shape;
  result.density = p.density;
  result.nonzeros = p.query.nonzeros();
  result.nonzeros_per_row = p.shape.nonzeros_per_row(p.density);
  result.threads = threads;
  result.flops = p.flops;
  result.csr_bytes = csr_bytes(p.query);
  result.dense_bytes = dense_query_bytes(p.shape);
  result.bfloat16_gemms = p.bfloat16_layer.bfloat16_gemm_engine();
  const std::vector<Case> cases = make_cases(p, threads);
  for (const Case& c : cases) {
    const CheckedCall call = checked_call(c);
    CaseResult r;
    r.name = c.name();
    r.flops = c.flops;
    r.peak_bytes = call.peak_bytes;
    r.error = call.error;
    result.cases.push_back(r);
  }
  for (int repetition = 0; repetition < repetitions; ++repetition)
    for (std::size_t i = 0; i < cases.size(); ++i)
      if (result.cases[i].error.empty()) {
        cases[i].run();
        result.cases[i].milliseconds.push_back(milliseconds_of(cases[i].run));
      }
  for (CaseResult& r : result.cases) r.median_ms = median(r.milliseconds);
  // The steady state: what one more call allocates once the timed calls have warmed it up.
  if (AllocationCounter::counts_malloc())
    for (std::size_t i = 0; i < cases.size(); ++i)
      if (result.cases[i].error.empty()) {
        const std::int64_t before = AllocationCounter::allocations();
        cases[i].run();
        result.cases[i].steady_allocations = AllocationCounter::allocations() - before;
      }
  return result;
}

// ---- Memory-only workloads (memory_workloads()) ----

struct MemoryResult {
  WorkloadShape shape;
  double density = 0;
  int threads = 1;
  std::int64_t sparse_peak = -1, dense_peak = -1;  // bytes; -1 when the heap is not counted
  double sparse_ms = 0, dense_ms = 0;              // that one call each, fresh workspace
  std::string error;
  // K and V of B·S key steps projected whole, the bytes that streaming them avoids holding.
  double whole_context_bytes() const {
    return double(shape.batch) * double(shape.key_steps) * 2.0 * double(shape.heads) *
           double(shape.head_dim) * double(sizeof(float));
  }
};

// One forward of each layer from a fresh workspace and result (the dense one densifying its
// query, as forward/dense does): their peak heap bytes and times, and the sparse output checked
// against the dense one.
inline MemoryResult measure_memory(const WorkloadShape& shape, double density, int threads) {
  MemoryResult result;
  result.shape = shape;
  result.density = density;
  result.threads = threads;
  try {
    const sdmha::SparseQuery<float> query = make_sparse_query(shape, density, kQuerySeed);
    const Tensor3 key = make_dense_input(shape.batch, shape.key_steps, shape.context_dim, kKeySeed);
    const Tensor3 value =
        make_dense_input(shape.batch, shape.key_steps, shape.context_dim, kValueSeed);
    const Layer sparse_layer(shape.config(), sdmha::MhaWeights<float>::glorot_uniform(
                                                 shape.config(), shape.query_dim, shape.context_dim,
                                                 shape.context_dim, kWeightSeed));
    const sdmha::DenseMHA<float> dense_layer(shape.config(), sparse_layer.weights());
    sdmha::AttentionOptions<float> options;
    options.num_threads = threads;
    options.score_strategy = sdmha::ScoreStrategy::project_first;
    sdmha::AttentionResult<float> sparse, dense;
    auto sparse_call = [&] {
      sdmha::Workspace<float> workspace;
      sparse_layer.forward(query, {key, value}, options, workspace, sparse);
    };
    auto dense_call = [&] {
      sdmha::Workspace<float> workspace;
      const Matrix densified = query.to_dense();
      dense_layer.forward(
          sdmha::TensorRef3<float>(densified.data(), shape.batch, shape.steps, shape.query_dim),
          {key, value}, options, workspace, dense);
    };
    result.sparse_ms = milliseconds_of([&] { result.sparse_peak = peak_heap_bytes(sparse_call); });
    result.dense_ms = milliseconds_of([&] { result.dense_peak = peak_heap_bytes(dense_call); });
    if (!AllocationCounter::counts_malloc()) result.sparse_peak = result.dense_peak = -1;
    result.error = compare("forward output", as_matrix(sparse.output), as_matrix(dense.output));
  } catch (const std::exception& error) {
    result.error = std::string("threw: ") + error.what();
  }
  return result;
}

}  // namespace sdmha_bench
