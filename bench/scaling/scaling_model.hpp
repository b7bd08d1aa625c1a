// bench/scaling/scaling_model.hpp — how the forward and the training step scale with threads:
// measured at the thread counts a machine has, and predicted for many more from one-thread item
// times. Used by `sdmha_bench --scaling` (a 2-core machine) and by bench/scaling/scaling_host.cpp
// (bench/scaling/run.sh, a many-core host); bench/scaling/README.md says what the model assumes.
//
// The model, per call (a forward, or a training step: forward then backward to every weight, in
// one Workspace, steady state):
//  - every parallel region of the call is found in a RegionTrace of the call at one thread (never
//    named here: the regions are whatever the pipeline runs), with each item's time; the median
//    over repetitions is taken per region and item index;
//  - serial time = the call's span − Σ the regions' spans (validation, planning, serial passes),
//    the same at any thread count;
//  - a region at P threads takes the makespan of its items under the scheduler (items claimed in
//    index order by the first free worker: list scheduling in index order) on min(P, items)
//    workers, plus its fork-join overhead o(P);
//  - o(2) is measured per region: the call's regions replayed on the 2-thread workspace's pool
//    with trivial items (the same item counts, the same serial stretches between them spun on
//    the calling thread); o(P) = o(2)·(1 + log2(P/2)), a tree of wake-ups and joins;
//  - the call at P threads = serial time + Σ regions; its speedup = the one-thread call (serial +
//    Σ item times) ÷ that.
// It ignores shared memory bandwidth and L3 contention: every item takes its one-thread time at
// any thread count. Regions run outside the workspace's pool are not traced and count as serial.
#pragma once

#include <sdmha/region_trace.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <numeric>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "../workloads.hpp"

namespace sdmha_bench::scaling {

using Layer = sdmha::SparseDenseMHA<float>;

// ---- What is timed ----

// The workloads of the scaling runs and the density each is run at: seed 1 %, bow 1 %,
// long 5 % (bench/workloads.md).
inline double scaling_density(const WorkloadShape& shape) {
  return shape.name == "long" ? 0.05 : 0.01;
}

// One workload's inputs and layer, built as bench/workloads.md says.
struct StepProblem : WorkloadInputs {
  StepProblem(const WorkloadShape& workload, double query_density)
      : WorkloadInputs(workload, query_density), layer(workload.config(), make_weights()) {}

  const Layer layer;
};

enum class Step { forward, training };
inline const char* step_name(Step step) { return step == Step::forward ? "forward" : "training"; }

// One thread count's calls: its own Workspace, result and gradients, kept between calls as a
// serving or training loop keeps them (so every call after the first is a steady-state call).
// The layer is the problem's, or another on the same weights (the bfloat16 comparison's).
class StepRunner {
 public:
  StepRunner(const StepProblem& problem, int threads)
      : StepRunner(problem, problem.layer, threads) {}
  StepRunner(const StepProblem& problem, const Layer& layer, int threads)
      : problem_(problem), layer_(layer), threads_(threads) {
    options_.num_threads = threads;
  }
  int threads() const { return threads_; }
  sdmha::Workspace<float>& workspace() { return workspace_; }
  const sdmha::AttentionResult<float>& result() const { return result_; }
  const sdmha::MhaGradients<float>& gradients() const { return gradients_; }

  // forward: the layer's forward into the kept result. training: that forward, then the
  // backward to every weight given ∂loss/∂output (it recomputes what it needs of the forward).
  void run(Step step) {
    const StepProblem& p = problem_;
    layer_.forward(p.query, {p.key, p.value}, options_, workspace_, result_);
    if (step == Step::training)
      layer_.backward(p.query, {p.key, p.value}, p.d_output, options_, workspace_, gradients_);
  }

 private:
  const StepProblem& problem_;
  const Layer& layer_;
  int threads_;
  sdmha::AttentionOptions<float> options_;
  sdmha::Workspace<float> workspace_;
  sdmha::AttentionResult<float> result_;
  sdmha::MhaGradients<float> gradients_;
};

// Empty when `runner`'s last training step gave the same bits as `reference`'s (output and every
// gradient), else what differs: results must not depend on the thread count.
inline std::string bitwise_difference(const StepRunner& runner, const StepRunner& reference) {
  auto same = [](const auto& a, const auto& b) {
    return a.size() == b.size() &&
           std::memcmp(a.data(), b.data(), std::size_t(a.size()) * sizeof(float)) == 0;
  };
  const auto& g = runner.gradients();
  const auto& r = reference.gradients();
  const std::pair<const char*, bool> checks[] = {
      {"output", same(runner.result().output, reference.result().output)},
      {"query kernel gradient", same(g.query_kernel, r.query_kernel)},
      {"key kernel gradient", same(g.key_kernel, r.key_kernel)},
      {"value kernel gradient", same(g.value_kernel, r.value_kernel)},
      {"output kernel gradient", same(g.output_kernel, r.output_kernel)},
      {"query values gradient", same(g.query_values, r.query_values)},
      {"output bias gradient", same(g.output_bias, r.output_bias)}};
  for (const auto& [what, equal] : checks)
    if (!equal)
      return std::string(what) + " at " + std::to_string(runner.threads()) +
             " threads differs from " + std::to_string(reference.threads()) + " thread(s)";
  return {};
}

// ---- Small statistics ----

inline double median_of(std::vector<double> values) {
  if (values.empty()) return std::nan("");
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

inline double seconds_of(const std::function<void()>& call) {
  const auto start = std::chrono::steady_clock::now();
  call();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The calling thread kept busy (not asleep) for `seconds`, as it is during a serial stretch.
inline void spin_for(double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) {
  }
}

// ---- The schedule ----

// Items claimed in index order by the first free worker (ties to the lowest-numbered worker):
// list scheduling. The region ends when its last worker does.
inline double list_schedule_makespan(const std::vector<double>& item_seconds, int workers) {
  if (item_seconds.empty()) return 0.0;
  const std::size_t lanes =
      std::min<std::size_t>(std::size_t(std::max(workers, 1)), item_seconds.size());
  std::priority_queue<double, std::vector<double>, std::greater<double>> free_at;
  for (std::size_t lane = 0; lane < lanes; ++lane) free_at.push(0.0);
  double makespan = 0;
  for (double item : item_seconds) {
    const double finish = free_at.top() + item;
    free_at.pop();
    free_at.push(finish);
    makespan = std::max(makespan, finish);
  }
  return makespan;
}

// o(P) from o(2): a tree of wake-ups and joins, one level more per doubling. o(1) = 0: one worker
// runs the items in a loop on the calling thread.
inline double overhead_at(double overhead_at_two, int workers) {
  if (workers <= 1) return 0.0;
  return overhead_at_two * (1.0 + std::log2(double(workers) / 2.0));
}

// ---- One call, profiled ----

// One region of the call, over the repetitions of the one-thread trace.
struct RegionProfile {
  std::string name;
  Index items = 0;
  std::vector<double> item_seconds;              // per item index, the median over repetitions
  double span_seconds = 0;                       // the median span at one thread
  double gap_seconds = 0;                        // the median serial stretch before it
  double overhead_two = 0;                       // o(2): fork and join, measured (the replay)
  double claim_seconds = 0;                      // c: one contended claim, measured (the replay)
  double slowdown = 1;                           // s: items' time with 2 threads running ÷ alone
  std::vector<std::pair<int, double>> measured;  // (threads, median span) where traced
  std::vector<std::pair<int, double>> measured_work;  // (threads, median Σ item times) there

  double work() const { return std::accumulate(item_seconds.begin(), item_seconds.end(), 0.0); }
  double largest_item() const {
    return item_seconds.empty() ? 0.0 : *std::max_element(item_seconds.begin(), item_seconds.end());
  }
  int workers(int threads) const {
    return int(std::min<Index>(std::max(threads, 1), std::max<Index>(items, 1)));
  }
  // On one worker, the items' one-thread times. On W >= 2: each item s times its one-thread time
  // plus one claim, list-scheduled; the fork and join; and the first round of claims, which
  // meet on the queue's counter at once (W - 1 claims before the last worker's first item).
  double predicted(int threads) const {
    const int lanes = workers(threads);
    if (lanes <= 1) return work();
    std::vector<double> contended(item_seconds);
    for (double& item : contended) item = item * slowdown + claim_seconds;
    return list_schedule_makespan(contended, lanes) + overhead_at(overhead_two, lanes) +
           (lanes - 1) * claim_seconds;
  }
  double measured_at(int threads) const {
    for (const auto& [t, seconds] : measured)
      if (t == threads) return seconds;
    return std::nan("");
  }
};

struct CallProfile {
  Step step = Step::forward;
  std::vector<RegionProfile> regions;
  double traced_span_seconds = 0;  // the median traced call at one thread
  double serial_seconds = 0;       // the median of (call − Σ region spans)

  double one_thread() const {
    double total = serial_seconds;
    for (const RegionProfile& r : regions) total += r.work();
    return total;
  }
  double predicted(int threads) const {
    double total = serial_seconds;
    for (const RegionProfile& r : regions) total += r.predicted(threads);
    return total;
  }
};

// The regions of `repetitions` traced calls: each call's records, its start and its end (on the
// trace's clock). Every call must run the same regions (names and item counts) in the same order.
struct TracedCalls {
  std::vector<std::vector<sdmha::RegionRecord>> regions;
  std::vector<double> begin, end;
};

// `repetitions` traced calls on each runner, each after an untraced call of its own, interleaved
// (repetition r of every runner, then r + 1), so that a drift of the machine's speed hits every
// thread count alike and repetition r of two runners can be compared. One TracedCalls per runner,
// in the runners' order.
inline std::vector<TracedCalls> trace_calls(const std::vector<StepRunner*>& runners, Step step,
                                            int repetitions) {
  std::vector<sdmha::RegionTrace> traces(runners.size());
  std::vector<TracedCalls> calls(runners.size());
  const auto detach = [&] {
    for (StepRunner* runner : runners) runner->workspace().set_trace(nullptr);
  };
  try {
    for (std::size_t i = 0; i < runners.size(); ++i) {
      runners[i]->workspace().set_trace(&traces[i]);
      runners[i]->run(step);  // the trace's own records grow once, untimed
    }
    for (int repetition = 0; repetition < repetitions; ++repetition)
      for (std::size_t i = 0; i < runners.size(); ++i) {
        runners[i]->run(step);  // steady state: after a call of its own (see steady_seconds)
        traces[i].clear();
        calls[i].begin.push_back(traces[i].now_seconds());
        runners[i]->run(step);
        calls[i].end.push_back(traces[i].now_seconds());
        calls[i].regions.push_back(traces[i].regions());
      }
  } catch (...) {
    detach();
    throw;
  }
  detach();
  for (const TracedCalls& runner_calls : calls)
    for (const auto& call : runner_calls.regions) {
      const auto& first = runner_calls.regions.front();
      bool same = call.size() == first.size();
      for (std::size_t k = 0; same && k < call.size(); ++k)
        same = call[k].items == first[k].items && std::strcmp(call[k].name, first[k].name) == 0;
      if (!same)
        throw std::runtime_error(std::string("the ") + step_name(step) +
                                 " ran different regions in two repetitions");
    }
  return calls;
}

inline double span(const sdmha::RegionRecord& record) {
  return record.end_seconds - record.begin_seconds;
}
inline double item_sum(const sdmha::RegionRecord& record) {
  return std::accumulate(record.item_seconds.begin(), record.item_seconds.end(), 0.0);
}

// The one-thread profile of a call: per region, item medians, span and the serial gap before it.
inline CallProfile profile_call(const TracedCalls& calls, Step step) {
  CallProfile profile;
  profile.step = step;
  const std::size_t count = calls.regions.front().size();
  std::vector<double> samples(calls.regions.size());
  for (std::size_t k = 0; k < count; ++k) {
    const sdmha::RegionRecord& first = calls.regions.front()[k];
    RegionProfile region;
    region.name = first.name[0] != '\0' ? first.name : "(unnamed region " + std::to_string(k) + ")";
    region.items = first.items;
    for (std::size_t item = 0; item < first.item_seconds.size(); ++item) {
      for (std::size_t r = 0; r < calls.regions.size(); ++r)
        samples[r] = calls.regions[r][k].item_seconds[item];
      region.item_seconds.push_back(median_of(samples));
    }
    for (std::size_t r = 0; r < calls.regions.size(); ++r) samples[r] = span(calls.regions[r][k]);
    region.span_seconds = median_of(samples);
    for (std::size_t r = 0; r < calls.regions.size(); ++r)
      samples[r] = calls.regions[r][k].begin_seconds -
                   (k == 0 ? calls.begin[r] : calls.regions[r][k - 1].end_seconds);
    region.gap_seconds = std::max(0.0, median_of(samples));
    profile.regions.push_back(std::move(region));
  }
  std::vector<double> spans, serial;
  for (std::size_t r = 0; r < calls.regions.size(); ++r) {
    double in_regions = 0;
    for (const sdmha::RegionRecord& record : calls.regions[r]) in_regions += span(record);
    spans.push_back(calls.end[r] - calls.begin[r]);
    serial.push_back(spans.back() - in_regions);
  }
  profile.traced_span_seconds = median_of(spans);
  profile.serial_seconds = std::max(0.0, median_of(serial));
  return profile;
}

// Each region's median span and Σ item times in `calls`, traced at `threads` threads, where
// their regions are the profile's (same names and items in the same order); false when not.
// At 2 threads also each region's slowdown s: per repetition, its items' time there ÷ in the
// same repetition at one thread (`one_thread`, traced beside it), the median; at least 1 (an
// item does not run faster for having company: below 1 is the machine's noise).
inline bool add_measured_spans(CallProfile& profile, const TracedCalls& calls, int threads,
                               const TracedCalls& one_thread) {
  const auto& first = calls.regions.front();
  if (first.size() != profile.regions.size()) return false;
  for (std::size_t k = 0; k < first.size(); ++k)
    if (first[k].items != profile.regions[k].items) return false;
  for (std::size_t k = 0; k < first.size(); ++k) {
    std::vector<double> spans, work, ratios;
    for (std::size_t r = 0; r < calls.regions.size(); ++r) {
      spans.push_back(span(calls.regions[r][k]));
      work.push_back(item_sum(calls.regions[r][k]));
      const double alone = item_sum(one_thread.regions[r][k]);
      if (alone > 0) ratios.push_back(work.back() / alone);
    }
    RegionProfile& region = profile.regions[k];
    region.measured.emplace_back(threads, median_of(spans));
    region.measured_work.emplace_back(threads, median_of(work));
    if (threads == 2 && !ratios.empty()) region.slowdown = std::max(1.0, median_of(ratios));
  }
  return true;
}

// The median time of `region`'s replay on the 2-thread pool with `items` trivial items (each
// writes its own byte) after its serial stretch spun on the calling thread, inside one lease
// per replay as a call holds it.
inline std::vector<double> replay_regions(const CallProfile& profile,
                                          sdmha::Workspace<float>& two_threads, int repetitions,
                                          const std::function<Index(const RegionProfile&)>& items) {
  Index most_items = 1;
  for (const RegionProfile& r : profile.regions) most_items = std::max(most_items, items(r));
  std::vector<char> written(static_cast<std::size_t>(most_items));
  std::vector<std::vector<double>> samples(profile.regions.size());
  for (int repetition = 0; repetition < repetitions + 1; ++repetition) {
    const sdmha::Workspace<float>::Lease lease(two_threads, "sdmha_bench --scaling");
    for (std::size_t k = 0; k < profile.regions.size(); ++k) {
      const RegionProfile& region = profile.regions[k];
      spin_for(region.gap_seconds);
      const double seconds = seconds_of([&] {
        sdmha::detail::parallel_for(
            items(region), 2, [&](Index item, int) { written[std::size_t(item)] = 1; },
            &lease.buffers().pool, "scaling overhead");
      });
      if (repetition > 0) samples[k].push_back(seconds);  // the first replay warms the pool
    }
  }
  std::vector<double> medians;
  for (const auto& region_samples : samples) medians.push_back(median_of(region_samples));
  return medians;
}

// o(2) and c of every region from two replays of the call's regions on a 2-thread pool: with
// min(items, 2) trivial items, the fork and the join alone: o(2); with all its items, which the
// two workers claim one at a time from one counter as fast as they can, so that every claim
// moves the counter's cache line between the cores: c = (that − o(2)) ÷ items, the cost of a
// claim at its worst (a real item's claim meets the other worker's less often).
inline void measure_overheads(CallProfile& profile, sdmha::Workspace<float>& two_threads,
                              int repetitions) {
  const std::vector<double> fork_join =
      replay_regions(profile, two_threads, repetitions,
                     [](const RegionProfile& r) { return std::min<Index>(r.items, 2); });
  const std::vector<double> claiming = replay_regions(
      profile, two_threads, repetitions, [](const RegionProfile& r) { return r.items; });
  for (std::size_t k = 0; k < profile.regions.size(); ++k) {
    RegionProfile& region = profile.regions[k];
    region.overhead_two = fork_join[k];
    region.claim_seconds =
        region.items > 2 ? std::max(0.0, claiming[k] - fork_join[k]) / double(region.items) : 0.0;
  }
}

// ---- Regions grouped by name (a name may run several times per call) ----

struct RegionGroup {
  std::string name;
  std::vector<const RegionProfile*> runs;

  Index items() const {
    Index total = 0;
    for (const RegionProfile* r : runs) total += r->items;
    return total;
  }
  template <typename Of>
  double sum(Of of) const {
    double total = 0;
    for (const RegionProfile* r : runs) total += of(*r);
    return total;
  }
  double predicted(int threads) const {
    return sum([&](const RegionProfile& r) { return r.predicted(threads); });
  }
};

inline std::vector<RegionGroup> group_regions(const CallProfile& profile) {
  std::vector<RegionGroup> groups;
  for (const RegionProfile& region : profile.regions) {
    auto found = std::find_if(groups.begin(), groups.end(),
                              [&](const RegionGroup& g) { return g.name == region.name; });
    if (found == groups.end()) found = groups.insert(groups.end(), RegionGroup{region.name, {}});
    found->runs.push_back(&region);
  }
  return groups;
}

inline std::string fixed(double value, int decimals) {
  if (!std::isfinite(value)) return "-";
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", decimals, value);
  return text;
}

// Why a region takes the time it does on `threads` threads, in words.
inline std::string cap_reason(const RegionProfile& region, int threads) {
  const int workers = region.workers(threads);
  const double time = region.predicted(threads);
  const double claims = region.items * region.claim_seconds / workers;
  const double overhead =
      overhead_at(region.overhead_two, workers) + (workers - 1) * region.claim_seconds + claims;
  const double ideal = region.work() * region.slowdown / threads;
  const double largest = region.largest_item() * region.slowdown + region.claim_seconds;
  std::ostringstream why;
  if (overhead >= 0.5 * time) {
    why << "bound by its fork, join and claims: o(" << workers
        << ") = " << fixed(overhead_at(region.overhead_two, workers) * 1e6, 1) << " us, claims "
        << fixed((overhead - overhead_at(region.overhead_two, workers)) * 1e6, 1) << " us";
  } else if (region.items < threads) {
    why << "bound by its item count: " << region.items << " items for " << threads << " workers";
  } else if (largest >= 0.8 * (time - overhead)) {
    why << "bound by its largest item, " << fixed(largest * 1e3, 3) << " ms";
  } else {
    why << "bound by its work: " << fixed(ideal * 1e3, 3)
        << " ms an even share (s = " << fixed(region.slowdown, 2) << "), "
        << fixed((time - overhead) / std::max(ideal, 1e-12), 2) << "x that scheduled";
  }
  return why.str();
}

// The same for a group: its costliest run, and how many runs it has.
inline std::string cap_reason(const RegionGroup& group, int threads) {
  const RegionProfile* costliest = group.runs.front();
  for (const RegionProfile* r : group.runs)
    if (r->predicted(threads) > costliest->predicted(threads)) costliest = r;
  std::string why = cap_reason(*costliest, threads);
  if (group.runs.size() > 1)
    why += " (the costliest of its " + std::to_string(group.runs.size()) + " runs, " +
           std::to_string(costliest->items) + " items)";
  return why;
}

// ---- One workload: measured and predicted ----

// The thread counts of the summary line (`scaling WORKLOAD forward P2 P16 P32 P64 …`).
inline const std::vector<int> kSummaryThreads = {2, 16, 32, 64};

struct ScalingSettings {
  std::vector<int> measured_threads = {1, 2};            // timed, untraced
  std::vector<int> predicted_threads = {2, 16, 32, 64};  // the model's thread counts (tables)
  int repetitions = 9;                                   // timed calls per step and thread count
  int trace_repetitions = 7;      // traced calls per step and thread count, interleaved
  int overhead_repetitions = 20;  // replays for o(2)
  bool model = true;
};

struct StepResult {
  Step step = Step::forward;
  std::vector<std::pair<int, double>> measured_seconds;  // (threads, median)
  CallProfile profile;                                   // when the model ran

  double measured_at(int threads) const {
    for (const auto& [t, seconds] : measured_seconds)
      if (t == threads) return seconds;
    return std::nan("");
  }
};

struct WorkloadResult {
  WorkloadShape shape;
  double density = 0;
  Index nonzeros = 0;
  StepResult forward, training;
  std::string bitwise;  // empty when every thread count gave the same bits
  double seconds = 0;   // wall time of this workload's run
};

// Steady state: a timed call follows an untimed call of the same step on the same thread count,
// as in a serving or training loop. After a call on another thread count, during which a helper
// core idled (on a virtual machine, one whose virtual CPU the host put to sleep), the first call
// runs at that core's lowered clock: up to 10-20 % slower at 2 threads, measured, however quick
// the pool's wake-up.
inline double steady_seconds(StepRunner& runner, Step step) {
  runner.run(step);
  return seconds_of([&] { runner.run(step); });
}

// Every step at every measured thread count, `repetitions` times in rounds of kRound steady
// calls (thread counts and steps in turn, so that a burst of load from elsewhere hits them alike).
inline void measure_steps(std::vector<std::unique_ptr<StepRunner>>& runners, int repetitions,
                          WorkloadResult& result) {
  constexpr int kRound = 3;
  std::vector<std::vector<double>> forward(runners.size()), training(runners.size());
  for (int done = 0; done < repetitions; done += kRound)
    for (std::size_t i = 0; i < runners.size(); ++i)
      for (Step step : {Step::forward, Step::training}) {
        std::vector<double>& samples = step == Step::forward ? forward[i] : training[i];
        samples.push_back(steady_seconds(*runners[i], step));
        for (int more = 1; more < std::min(kRound, repetitions - done); ++more)
          samples.push_back(seconds_of([&] { runners[i]->run(step); }));
      }
  for (std::size_t i = 0; i < runners.size(); ++i) {
    result.forward.measured_seconds.emplace_back(runners[i]->threads(), median_of(forward[i]));
    result.training.measured_seconds.emplace_back(runners[i]->threads(), median_of(training[i]));
  }
}

inline WorkloadResult run_workload(const WorkloadShape& shape, const ScalingSettings& settings,
                                   std::ostream& log) {
  const auto start = std::chrono::steady_clock::now();
  WorkloadResult result;
  result.shape = shape;
  result.training.step = Step::training;
  result.density = scaling_density(shape);
  log << shape.name << " " << result.density * 100 << " %: building inputs\n" << std::flush;
  const StepProblem problem(shape, result.density);
  result.nonzeros = problem.query.nonzeros();
  std::vector<int> counts = settings.measured_threads;
  if (std::find(counts.begin(), counts.end(), 1) == counts.end()) counts.insert(counts.begin(), 1);
  if (settings.model && std::find(counts.begin(), counts.end(), 2) == counts.end())
    counts.push_back(2);  // o(2) is measured on the 2-thread workspace
  std::vector<std::unique_ptr<StepRunner>> runners;
  for (int threads : counts) runners.push_back(std::make_unique<StepRunner>(problem, threads));
  for (auto& runner : runners) runner->run(Step::training);  // sizes workspaces, starts threads
  for (auto& runner : runners)
    if (result.bitwise.empty()) result.bitwise = bitwise_difference(*runner, *runners.front());
  log << shape.name << ": timing at";
  for (int threads : counts) log << " " << threads;
  log << " threads, " << settings.repetitions << " repetitions\n" << std::flush;
  measure_steps(runners, settings.repetitions, result);
  if (settings.model) {
    StepRunner* two =
        runners[std::size_t(std::find(counts.begin(), counts.end(), 2) - counts.begin())].get();
    std::vector<StepRunner*> traced;
    for (auto& runner : runners) traced.push_back(runner.get());
    for (StepResult* step : {&result.forward, &result.training}) {
      log << shape.name << ": tracing the " << step_name(step->step) << "\n" << std::flush;
      const std::vector<TracedCalls> calls =
          trace_calls(traced, step->step, settings.trace_repetitions);
      step->profile = profile_call(calls.front(), step->step);
      for (std::size_t i = 1; i < runners.size(); ++i)
        if (!add_measured_spans(step->profile, calls[i], runners[i]->threads(), calls.front()))
          log << "  (at " << runners[i]->threads()
              << " threads the regions differ from one thread's: no measured spans)\n";
      measure_overheads(step->profile, two->workspace(), settings.overhead_repetitions);
    }
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

// ---- Printing ----

inline void print_model_header(std::ostream& out, const ScalingSettings& settings) {
  out << "The model, per call: every parallel region's items timed at one thread (median of "
      << settings.trace_repetitions
      << " traced calls, per item); serial time = the call - the regions' spans. A region at P "
         "threads = makespan of its items, each s times its one-thread time plus one claim c, "
         "claimed in index order by the first free worker (list scheduling) on W = min(P, items) "
         "workers, + o(W) + (W - 1)*c (the first claims, all at once). Measured per region on 2 "
         "threads: s = its items' time with 2 threads running / alone (traced calls interleaved "
         "with the one-thread ones; shared caches, memory bandwidth, clocks), o(2) = fork and "
         "join (its serial stretch and min(items, 2) trivial items replayed on the 2-thread "
         "pool), c = (the replay with all its items trivial - o(2)) / items; o(P) = "
         "o(2)*(1 + log2(P/2)) (a tree of wake-ups).\nThe call = serial + sum of regions. The "
         "model holds s at its 2-thread value for every P: where many cores share one memory "
         "bus, regions that stream memory slow down more, and its speedups at 16-64 threads "
         "are upper bounds there.\n";
}

// How much longer the items took with more threads running (Σ item times there ÷ at one
// thread), for the call and its most slowed region: what the model leaves out (shared caches
// and memory bandwidth, or other processes), seen where it could be measured.
inline void print_item_slowdown(std::ostream& out, const CallProfile& profile,
                                const std::vector<int>& columns) {
  for (int threads : columns) {
    double one = 0, many = 0, worst = 0;
    const RegionProfile* slowest = nullptr;
    for (const RegionProfile& r : profile.regions)
      for (const auto& [t, work] : r.measured_work)
        if (t == threads) {
          one += r.work();
          many += work;
          if (r.work() > 0.02 * profile.one_thread() && work / r.work() > worst) {
            worst = work / r.work();
            slowest = &r;
          }
        }
    if (one <= 0) continue;
    out << "items' time at " << threads << " threads / at 1: " << fixed(many / one, 2) << "x";
    if (slowest != nullptr) out << " (most: " << slowest->name << " " << fixed(worst, 2) << "x)";
    out << "\n";
  }
}

// One step's region table: per region name, its runs and items, its one-thread time, measured
// and predicted spans, and the call's totals.
inline void print_step_table(std::ostream& out, const StepResult& step,
                             const ScalingSettings& settings) {
  const CallProfile& profile = step.profile;
  std::vector<int> columns = settings.predicted_threads;
  for (const auto& [threads, seconds] : step.measured_seconds)
    if (threads > 1 && std::find(columns.begin(), columns.end(), threads) == columns.end())
      columns.push_back(threads);
  std::sort(columns.begin(), columns.end());
  char cell[96];
  std::snprintf(cell, sizeof cell, "%-28s %4s %7s %9s %7s %6s %5s", "region", "runs", "items",
                "1 thr ms", "o(2) us", "c ns", "s");
  out << "\n"
      << step_name(step.step) << " (ms; 'meas' = traced at that thread count here):\n"
      << cell;
  for (int threads : columns) {
    std::snprintf(cell, sizeof cell, " | %4d: meas %8s", threads, "pred");
    out << cell;
  }
  out << " | largest item ms\n";
  for (const RegionGroup& group : group_regions(profile)) {
    const double runs = double(group.runs.size()),
                 work = group.sum([](const RegionProfile&r) { return r.work(); });
    const double slowed = group.sum([](const RegionProfile& r) { return r.work() * r.slowdown; });
    std::snprintf(cell, sizeof cell, "%-28.28s %4zu %7ld %9.3f %7.1f %6.0f %5.2f",
                  group.name.c_str(), group.runs.size(), long(group.items()), work * 1e3,
                  group.sum([](const RegionProfile& r) { return r.overhead_two; }) * 1e6 / runs,
                  group.sum([](const RegionProfile& r) { return r.claim_seconds; }) * 1e9 / runs,
                  work > 0 ? slowed / work : 1.0);
    out << cell;
    for (int threads : columns) {
      const double measured =
          group.sum([&](const RegionProfile& r) { return r.measured_at(threads); });
      std::snprintf(cell, sizeof cell, " | %10s %8.3f", fixed(measured * 1e3, 3).c_str(),
                    group.predicted(threads) * 1e3);
      out << cell;
    }
    std::snprintf(cell, sizeof cell, " | %8.3f\n",
                  group.sum([](const RegionProfile& r) { return r.largest_item(); }) * 1e3);
    out << cell;
  }
  std::snprintf(cell, sizeof cell, "%-28s %4s %7s %9.3f %20s", "(serial, between regions)", "", "",
                profile.serial_seconds * 1e3, "");
  out << cell;
  for (std::size_t c = 0; c < columns.size(); ++c) {
    std::snprintf(cell, sizeof cell, " | %10s %8.3f", "", profile.serial_seconds * 1e3);
    out << cell;
  }
  std::snprintf(cell, sizeof cell, "\n%-28s %4s %7s %9.3f %20s", "call", "", "",
                profile.one_thread() * 1e3, "");
  out << cell;
  for (int threads : columns) {
    std::snprintf(cell, sizeof cell, " | %10s %8.3f",
                  fixed(step.measured_at(threads) * 1e3, 3).c_str(),
                  profile.predicted(threads) * 1e3);
    out << cell;
  }
  out << "\n";
  std::snprintf(cell, sizeof cell, "%-28s %4s %7s %9s %20s", "speedup over 1 thread", "", "",
                "1.00", "");
  out << cell;
  const double one = step.measured_at(1);
  for (int threads : columns) {
    std::snprintf(cell, sizeof cell, " | %10s %8.2f",
                  fixed(one / step.measured_at(threads), 2).c_str(),
                  profile.one_thread() / profile.predicted(threads));
    out << cell;
  }
  out << "\n(the traced one-thread call took " << fixed(profile.traced_span_seconds * 1e3, 3)
      << " ms; untraced, measured: " << fixed(one * 1e3, 3) << " ms)\n";
  print_item_slowdown(out, profile, columns);
  // The medians of the items add up to the call's median when the machine is quiet; a busy one
  // stretches whole calls (preempted) far more often than it stretches one item in most calls.
  if (std::abs(profile.traced_span_seconds / profile.one_thread() - 1.0) > 0.1)
    out << "warning: the traced calls and their items' medians differ by more than 10 %: the "
           "machine was busy, and the measured speedups are unreliable\n";
}

// The region (or the serial time) with the largest share of the predicted call at `threads`.
inline std::string speedup_cap(const CallProfile& profile, int threads) {
  const double total = profile.predicted(threads);
  std::string name = "(serial, between regions)";
  double largest = profile.serial_seconds;
  std::string reason = "serial stretches between regions, the same at any thread count";
  for (const RegionGroup& group : group_regions(profile))
    if (group.predicted(threads) > largest) {
      largest = group.predicted(threads);
      name = group.name;
      reason = cap_reason(group, threads);
    }
  std::ostringstream text;
  text << name << " (" << fixed(100.0 * largest / total, 1) << " % of the predicted " << threads
       << "-thread call; " << reason << ")";
  return text.str();
}

inline double predicted_speedup(const CallProfile& profile, int threads) {
  return profile.one_thread() / profile.predicted(threads);
}

// The workload's tables, the region that caps each step, and its last line:
// scaling WORKLOAD forward P2 P16 P32 P64 training T2 T16 T32 T64 measured2 M F
inline void print_workload(std::ostream& out, const WorkloadResult& result,
                           const ScalingSettings& settings) {
  const WorkloadShape& w = result.shape;
  out << "\n== " << w.name << " " << result.density * 100 << " % (B " << w.batch << ", T "
      << w.steps << ", Eq " << w.query_dim << ", S " << w.key_steps << ", nnz " << result.nonzeros
      << "), " << fixed(result.seconds, 1) << " s\n";
  if (!result.bitwise.empty())
    out << "RESULTS DIFFER BETWEEN THREAD COUNTS: " << result.bitwise << "\n";
  for (const StepResult* step : {&result.forward, &result.training}) {
    print_step_table(out, *step, settings);
    out << step_name(step->step) << " speedup capped at " << kSummaryThreads.back()
        << " threads by " << speedup_cap(step->profile, kSummaryThreads.back()) << "\n";
  }
  out << "scaling " << w.name << " forward";
  for (int threads : kSummaryThreads)
    out << " " << fixed(predicted_speedup(result.forward.profile, threads), 2);
  out << " training";
  for (int threads : kSummaryThreads)
    out << " " << fixed(predicted_speedup(result.training.profile, threads), 2);
  out << " measured2 " << fixed(result.forward.measured_at(1) / result.forward.measured_at(2), 2)
      << " " << fixed(result.training.measured_at(1) / result.training.measured_at(2), 2) << "\n"
      << std::flush;
}

// `sdmha_bench --scaling`: the model on every workload of `shapes` at 1 and 2 threads measured.
// Returns 1 when results differ between thread counts or a workload fails, else 0.
inline int run_scaling_model(const std::vector<WorkloadShape>& shapes,
                             const ScalingSettings& settings, std::ostream& out) {
  print_model_header(out, settings);
  int status = 0;
  for (const WorkloadShape& shape : shapes) {
    try {
      const WorkloadResult result = run_workload(shape, settings, std::cerr);
      print_workload(out, result, settings);
      if (!result.bitwise.empty()) status = 1;
    } catch (const std::exception& error) {
      out << "\n== " << shape.name << " FAILED: " << error.what() << "\n";
      status = 1;
    }
  }
  return status;
}

}  // namespace sdmha_bench::scaling
