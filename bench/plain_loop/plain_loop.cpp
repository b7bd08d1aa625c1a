// bench/plain_loop/plain_loop.cpp — the plain forward(query, {key, value}, options) called back to
// back, the way a server calls the layer: one workload of bench/workloads.hpp (its inputs and
// weights), one untimed call, then `calls` timed ones; prints their median, least and most.
//
//   g++ -std=c++17 -O3 -march=native -DNDEBUG -I include -I /usr/include/eigen3 -I bench
//       bench/plain_loop/plain_loop.cpp -o /tmp/plain_loop -pthread   (one line)
//   /tmp/plain_loop WORKLOAD DENSITY THREADS CALLS [bfloat16]
//   /tmp/plain_loop bow 0.01 1 15            # float32
//   /tmp/plain_loop bow 0.01 1 15 bfloat16   # after set_precision(Precision::bfloat16)
//
// sdmha_bench --summary times the same call interleaved with the other cases (the dense ones
// among them); this times one case alone, one process per figure. Run it right beside the peer
// it is compared with, and compare ratios, not times from different minutes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <sdmha/sdmha.hpp>

#include "workloads.hpp"

namespace {

int usage() {
  std::fprintf(stderr,
               "usage: plain_loop WORKLOAD DENSITY THREADS CALLS [bfloat16]\n"
               "  WORKLOAD: seed, bow or long; DENSITY in (0, 1]; THREADS >= 1; CALLS >= 1\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace sdmha_bench;
  if (argc < 5 || argc > 6) return usage();
  const std::string name = argv[1];
  const double density = std::atof(argv[2]);
  const int threads = std::atoi(argv[3]), calls = std::atoi(argv[4]);
  const bool bfloat16 = argc == 6 && std::string(argv[5]) == "bfloat16";
  if ((argc == 6 && !bfloat16) || !(density > 0.0 && density <= 1.0) || threads < 1 || calls < 1)
    return usage();
  const std::vector<WorkloadShape> shapes = canonical_workloads();
  const auto shape = std::find_if(shapes.begin(), shapes.end(),
                                  [&](const WorkloadShape& s) { return s.name == name; });
  if (shape == shapes.end()) return usage();

  const WorkloadShape& w = *shape;
  sdmha::SparseDenseMHA<float> layer(
      w.config(), sdmha::MhaWeights<float>::glorot_uniform(w.config(), w.query_dim, w.context_dim,
                                                           w.context_dim, kWeightSeed));
  if (bfloat16) layer.set_precision(sdmha::Precision::bfloat16);
  const auto query = make_sparse_query(w, density, kQuerySeed);
  const auto key = make_dense_input(w.batch, w.key_steps, w.context_dim, kKeySeed);
  const auto value = make_dense_input(w.batch, w.key_steps, w.context_dim, kValueSeed);
  sdmha::AttentionOptions<float> options;
  options.num_threads = threads;

  layer.forward(query, {key, value}, options);  // untimed: the layer's workspace and threads
  std::vector<double> milliseconds;
  for (int call = 0; call < calls; ++call) {
    const auto start = std::chrono::steady_clock::now();
    const auto result = layer.forward(query, {key, value}, options);
    const auto stop = std::chrono::steady_clock::now();
    milliseconds.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  std::sort(milliseconds.begin(), milliseconds.end());
  std::printf("%s %g %d thread(s) %s: median %.2f ms of %d calls (least %.2f, most %.2f)\n",
              name.c_str(), density, threads, bfloat16 ? "bfloat16" : "float32",
              milliseconds[milliseconds.size() / 2], calls, milliseconds.front(),
              milliseconds.back());
  return 0;
}
