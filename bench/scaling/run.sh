#!/usr/bin/env bash
# bench/scaling/run.sh — sdmha's forward and training step at 1, 2, 4, 8, 16 threads and the
# host's core count, on seed 1 %, bow 1 % and long 5 %, with ONNX Runtime and PyTorch beside them
# at the same thread counts; one markdown table and one JSON file. For a many-core host with a
# C++17 compiler and Python 3 (PyTorch and onnxruntime optional: a peer that is missing is
# skipped), and nothing else: Eigen's headers come from the caller, no network, no CMake
# dependencies. Everything is built from this checkout; the whole run takes under 5 minutes.
#
# Usage:
#   bench/scaling/run.sh [EIGEN_DIR [OUT_DIR]]
#   EIGEN_DIR=path/to/eigen3 OUT=out bench/scaling/run.sh
#
#   EIGEN_DIR   the folder holding Eigen/Core (a copy of /usr/include/eigen3). To carry it to a
#               host without Eigen: copy it into the checkout under a name git ignores, e.g.
#                 cp -r /usr/include/eigen3 build-eigen3        (build*/ is in .gitignore)
#               send that folder with the checkout, and pass EIGEN_DIR=build-eigen3.
#   OUT         where the results go (default: $BUILD_DIR/out): scaling_table.md,
#               scaling_results.json and scaling_log.txt, nothing else.
#   BUILD_DIR   where the program, the ONNX graphs and the raw JSON go (default:
#               build-scaling-host in the checkout; git ignores it).
#   THREADS     the thread counts (default 1,2,4,8,16,<cores>, those above the core count left out)
#   REPETITIONS sdmha's timed calls per step and thread count (default 5; peers: 3)
#   PYTHON      the Python with numpy, torch, onnx and onnxruntime (default: the first of python3
#               and /usr/bin/python3 that imports numpy)
#   CXX         the compiler (default g++)
set -uo pipefail

start=$SECONDS
deadline=$((start + 290))  # 5 minutes, with a margin for the report
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"

eigen=${1:-${EIGEN_DIR:-}}
build=${BUILD_DIR:-$repo/build-scaling-host}
out=${2:-${OUT:-$build/out}}
cxx=${CXX:-g++}
repetitions=${REPETITIONS:-5}

usage() {
  awk '/^# Usage:/ { on = 1 } on && !/^#/ { exit } on { sub(/^# ?/, ""); print }' "$0" >&2
  exit 2
}
if [[ -z "$eigen" || ! -f "$eigen/Eigen/Core" ]]; then
  echo "run.sh: no Eigen/Core under '${eigen}': give Eigen's headers (a copy of /usr/include/eigen3)" >&2
  usage
fi
eigen=$(cd "$eigen" && pwd)
mkdir -p "$build" "$out"
log="$out/scaling_log.txt"
: >"$log"
say() { echo "$*" | tee -a "$log"; }

cores=$(nproc)
if [[ -n "${THREADS:-}" ]]; then
  threads=$THREADS
else
  threads=$(printf '%s\n' 1 2 4 8 16 "$cores" | awk -v cores="$cores" '$1 <= cores' | sort -n -u |
    paste -s -d, -)
fi
say "run.sh: $(date -u +%FT%TZ), $(uname -n), $cores cores, threads $threads, Eigen from $eigen"
say "commit: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$repo" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"

python=${PYTHON:-}
if [[ -z "$python" ]]; then
  for candidate in python3 /usr/bin/python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import numpy' 2>/dev/null; then
      python=$candidate
      break
    fi
  done
fi
have() { [[ -n "$python" ]] && "$python" -c "import $1" 2>/dev/null; }

# 1. Build the timing program (and, meanwhile, the ONNX graphs: neither is timed).
flags="-std=c++17 -O3 -march=native -DNDEBUG -pthread"
compiler_version=$("$cxx" --version | head -n 1)
say "building sdmha_scaling: $cxx $flags -Iinclude -I$eigen bench/scaling/scaling_host.cpp"
"$cxx" $flags -Iinclude -I"$eigen" \
  -DSDMHA_SCALING_COMPILE_FLAGS="\"$flags, $compiler_version\"" \
  bench/scaling/scaling_host.cpp -o "$build/sdmha_scaling" 2>"$build/compile.log" &
compile=$!
onnx_dir=""
if have onnx && have onnxruntime; then
  onnx_dir="$build/onnx"
  "$python" bench/peers/onnx_peer.py --out "$onnx_dir" --densities all \
    --workloads seed,bow,long >"$build/onnx_peer.log" 2>&1 &
  graphs=$!
else
  say "ONNX Runtime peer skipped: ${python:-no Python with numpy} lacks onnx or onnxruntime"
  graphs=""
fi
if ! wait "$compile"; then
  say "run.sh: the build failed:"
  tail -n 30 "$build/compile.log" | tee -a "$log"
  exit 1
fi
say "built in $((SECONDS - start)) s"
if [[ -n "$graphs" ]] && ! wait "$graphs"; then
  say "onnx_peer.py failed (ONNX Runtime peer skipped):"
  tail -n 10 "$build/onnx_peer.log" | tee -a "$log"
  onnx_dir=""
fi

# 2. sdmha: every thread count, interleaved, with the scaling model beside it.
say "timing sdmha ($((SECONDS - start)) s so far)"
rm -f "$build/sdmha.json"
timeout $((deadline - SECONDS - 60)) "$build/sdmha_scaling" --threads "$threads" \
  --repetitions "$repetitions" --json "$build/sdmha.json" 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
[[ $status -eq 124 ]] && say "sdmha_scaling ran out of time; the workloads it finished are kept"

# 3. The peers, in the time that is left.
peers_json=""
if [[ -n "$python" ]] && (have torch || [[ -n "$onnx_dir" ]]); then
  budget=$((deadline - SECONDS - 20))
  say "timing the peers with $python, budget $budget s"
  rm -f "$build/peers.json"
  timeout $((budget + 40)) "$python" bench/scaling/peers.py --threads "$threads" \
    ${onnx_dir:+--onnx-dir "$onnx_dir"} --budget "$budget" --json "$build/peers.json" 2>&1 |
    tee -a "$log"
  peers_json="$build/peers.json"
else
  say "peers skipped: no Python with numpy and torch or onnxruntime"
fi

# 4. One table and one JSON file.
report_python=${python:-python3}
"$report_python" bench/scaling/report.py --sdmha "$build/sdmha.json" \
  ${peers_json:+--peers "$peers_json"} --markdown "$out/scaling_table.md" \
  --json "$out/scaling_results.json" \
  --note "run.sh on $(uname -n), $cores cores, $((SECONDS - start)) s in all." >/dev/null
say "wrote $out/scaling_table.md, $out/scaling_results.json and $log ($((SECONDS - start)) s in all)"
cat "$out/scaling_table.md"
exit "$status"
