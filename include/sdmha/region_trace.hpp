// sdmha/region_trace.hpp — RegionTrace: where a call's time goes, region by region and item by
// item.
//
// A call runs as a sequence of parallel regions: fork-join loops over work items fixed by the
// problem (row blocks of a projection, (batch, head, tile) items of the attention, …), each item
// claimed by whichever worker is free. A RegionTrace given to a Workspace records every region
// of the calls run on it: its name, its number of items and of workers, when it began and ended,
// and how long each item took.
//
//   sdmha::RegionTrace trace;
//   workspace.set_trace(&trace);
//   layer.forward(query, key, value, options, workspace, result);
//   for (const sdmha::RegionRecord& region : trace.regions()) …  // name, items, times
//   workspace.set_trace(nullptr);
//
// What the figures mean: end_seconds − begin_seconds spans the region as the calling thread saw
// it, fork and join included; item_seconds[i] is item i's own duration on the worker that ran it.
// So Σ item_seconds is the region's work on one thread, and (end − begin) − Σ item_seconds ÷
// workers is what the region lost to forking, joining and imbalance. Times between regions are
// the call's serial stretches. All times come from std::chrono::steady_clock.
//
// Tracing is for measuring, not for steady-state calls: it allocates (a record and its item times
// per region) and reads the clock twice per item. Without a trace a region costs one branch more.
// A trace is not synchronized: give it to workspaces used by one thread at a time.
#pragma once

#include <chrono>
#include <cstddef>
#include <utility>
#include <vector>

#include "sdmha/config.hpp"

namespace sdmha {

// One parallel region of a traced call.
struct RegionRecord {
  const char* name = "";  // a static string naming the region, e.g. "context projection"
  Index items = 0;        // work items, each run exactly once
  int workers = 0;        // threads that took part (the caller included)
  double begin_seconds = 0, end_seconds = 0;  // on the trace's clock (RegionTrace::now_seconds)
  std::vector<double> item_seconds;           // item i's duration in seconds, indexed by item
};

// Records every parallel region of the calls run on a Workspace given it (Workspace::set_trace).
class RegionTrace {
 public:
  RegionTrace() : origin_(Clock::now()) {}

  // Forgets every record and restarts the clock.
  void clear() {
    regions_.clear();
    origin_ = Clock::now();
  }
  // The regions recorded since the last clear(), in the order they began.
  const std::vector<RegionRecord>& regions() const { return regions_; }
  // Seconds since the trace was made or last cleared, on the clock of every record.
  double now_seconds() const {
    return std::chrono::duration<double>(Clock::now() - origin_).count();
  }

  // For parallel_for: opens the record of a region of `items` items, its item times sized (and
  // zeroed) before the region starts, so that the workers only write their own entries; returns
  // the record's index. end_region stamps its end and the workers that took part.
  std::size_t begin_region(const char* name, Index items) {
    RegionRecord record;
    record.name = name == nullptr ? "" : name;
    record.items = items;
    record.item_seconds.assign(static_cast<std::size_t>(items), 0.0);
    record.begin_seconds = now_seconds();
    regions_.push_back(std::move(record));
    return regions_.size() - 1;
  }
  // Where the workers write item times of region `region` (stays valid while regions are added:
  // a record's vector keeps its buffer when the list of records grows).
  double* item_seconds(std::size_t region) { return regions_[region].item_seconds.data(); }
  void end_region(std::size_t region, int workers) {
    regions_[region].end_seconds = now_seconds();
    regions_[region].workers = workers;
  }

 private:
  using Clock = std::chrono::steady_clock;
  Clock::time_point origin_;
  std::vector<RegionRecord> regions_;
};

}  // namespace sdmha
