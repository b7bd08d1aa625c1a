#!/usr/bin/env bash
# tools/device/amx_check.sh — the bfloat16 engines on a many-core host with AMX, in one call of a
# few minutes: their unit tests, then the forward of seed 1 %, bow 1 % and long 5 % in float32 and
# bfloat16 on each engine at 1 and all threads, beside ONNX Runtime and PyTorch. For a host with
# g++, Python 3 (numpy; onnx, onnxruntime and torch optional) and nothing else: Eigen, GoogleTest
# and oneDNN come from the folder tools/device/prepare_carry.sh fills (.carry, sent with the
# checkout). tools/device/README.md has the device call.
#
# Usage:
#   bash tools/device/amx_check.sh
#
# Settings (environment):
#   OUT          where the results go (default: $BUILD_DIR/out); four files, nothing else:
#                  amx_check_log.txt    everything printed, each phase with its seconds
#                  bfloat16_tests.txt   the GoogleTest run
#                  bfloat16_table.md    the timing table (precision_report.py)
#                  bfloat16_results.json   its rows, sdmha's and the peers' JSON
#   CARRY        the carried folder (default: .carry in the checkout)
#   BUILD_DIR    build products, libdnnl unpacked, raw JSON (default: build-amx-check)
#   THREADS      thread counts (default: 1,<cores>)
#   GEMMS        the SDMHA_BFLOAT16_GEMMS values timed (default: off,on,onednn,amx; a value the
#                build refuses is reported as such)
#   REPETITIONS  sdmha's timed forwards per layer and thread count (default 9; peers: 3)
#   QUICK        1: sdmha's reduced shapes (--quick), for a rehearsal; the peers keep theirs
#   JOBS         parallel compilations (default: the core count)
#   BUDGET       seconds for the whole run (default 450); each phase has its own limit within it
#   TEST_FILTER  the gtest filter (default *BFloat16*:*OneDnn*:*Amx*:CpuFeatures*:ActiveKernels*)
#   EXTRA_CXXFLAGS  added to every compilation (a define a new test file needs)
#   GTEST_FROM_SOURCE  1: GoogleTest built from its carried sources, not the carried libgtest.a
#                (which is tried first otherwise, and built from source only if it fails to link)
#   SKIP_BUILD   1: a second call on the same (still warm) machine uses the programs and ONNX
#                graphs the first left in BUILD_DIR (when they are there), to time again sooner
#   SKIP_TESTS   1: the tests are not run (a second call that only times)
#   PYTHON       the Python with numpy (default: the first of python3, /usr/bin/python3 with it)
#   CXX          the compiler (default g++)
# The exit status is 1 when the build, a test or the timing failed, else 0.
set -uo pipefail

start=$SECONDS
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo" || exit 2
carry=$(cd "${CARRY:-$repo/.carry}" 2>/dev/null && pwd) || {
  echo "amx_check.sh: no carried folder ${CARRY:-$repo/.carry} (tools/device/prepare_carry.sh fills it)" >&2
  exit 2
}
build=${BUILD_DIR:-$repo/build-amx-check}
mkdir -p "$build"
build=$(cd "$build" && pwd)
out=${OUT:-$build/out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cores=$(nproc)
threads=${THREADS:-1,$cores}
gemms=${GEMMS:-off,on,onednn,amx}
repetitions=${REPETITIONS:-9}
jobs=${JOBS:-$cores}
budget=${BUDGET:-450}
filter=${TEST_FILTER:-'*BFloat16*:*OneDnn*:*Amx*:CpuFeatures*:ActiveKernels*'}
cxx=${CXX:-g++}
deadline=$((start + budget))
lib=$build/lib
status=0
unset SDMHA_BFLOAT16_GEMMS SDMHA_KERNELS  # the tests and the bench set what they force

exec > >(tee "$out/amx_check_log.txt") 2>&1
tee_pid=$!
trap 'exec >&- 2>&-; wait "$tee_pid"' EXIT  # the log complete before the call returns
say() { echo "[$((SECONDS - start)) s] $*"; }

# A phase: its limit is `cap` seconds, or less where the run's deadline minus `later` (the least
# the phases after it need) comes first; `left` is what remains of it, for each command's timeout.
phase_names=()
phase_seconds=()
begin() {
  phase=$1
  phase_start=$SECONDS
  local limit=$(($2 < deadline - $3 - SECONDS ? $2 : deadline - $3 - SECONDS))
  ((limit < 5)) && limit=5
  phase_deadline=$((SECONDS + limit))
  say "== $phase (limit $limit s)"
}
left() { local l=$((phase_deadline - SECONDS)); echo $((l < 1 ? 1 : l)); }
end() {
  phase_names+=("$phase")
  phase_seconds+=($((SECONDS - phase_start)))
  say "== $phase: $((SECONDS - phase_start)) s${1:+ ($1)}"
}

say "amx_check.sh on $(uname -n): $cores cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
say "CPU flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx512_bf16|amx_bf16|amx_tile|amx_int8)$' | paste -sd' ')"
if commit=$(git rev-parse --short HEAD 2>/dev/null); then
  git diff --quiet HEAD 2>/dev/null || commit+=" (with uncommitted changes)"
else
  commit="unknown (no git repository here)"
fi
say "$($cxx --version | head -n 1); commit $commit"
say "threads $threads, engines $gemms, repetitions $repetitions${QUICK:+, quick shapes}, jobs $jobs, budget $budget s"
say "carried: $carry ($(du -sh "$carry" | cut -f1)); $(head -n 1 "$carry/MANIFEST.txt" 2>/dev/null)"

python=${PYTHON:-}
if [[ -z $python ]]; then
  for candidate in python3 /usr/bin/python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import numpy' 2>/dev/null; then
      python=$candidate
      break
    fi
  done
fi
have() { [[ -n $python ]] && "$python" -c "import $1" 2>/dev/null; }

# ---- 1. oneDNN's library out of the carried folder ----------------------------------------------
unpack_library() {
  begin unpack 60 360
  mkdir -p "$lib"
  if command -v xz >/dev/null; then
    timeout "$(left)" xz -dc "$carry/lib/libdnnl.so.2.xz" >"$lib/libdnnl.so.2.tmp"
  else  # Python's lzma, where the host has no xz
    timeout "$(left)" "${python:-python3}" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$carry/lib/libdnnl.so.2.xz" "$lib/libdnnl.so.2.tmp"
  fi
  if [[ $? -eq 0 ]]; then
    mv "$lib/libdnnl.so.2.tmp" "$lib/libdnnl.so.2"
    ln -sf libdnnl.so.2 "$lib/libdnnl.so"
    end "$(du -h "$lib/libdnnl.so.2" | cut -f1) libdnnl.so.2"
  else
    end "FAILED: libdnnl.so.2 not unpacked"
    status=1
  fi
}
reuse=""
if [[ -n ${SKIP_BUILD:-} && -x $build/bfloat16_tests && -x $build/sdmha_scaling && -f $lib/libdnnl.so.2 ]]; then
  reuse=1
  say "SKIP_BUILD: the programs and ONNX graphs of the last call in $build are used again"
else
  unpack_library
fi

# ONNX Runtime's graphs and inputs, written meanwhile (not timed; done before any timing starts).
onnx_dir=""
graphs=""
if [[ -n $reuse && -f $build/onnx/shapes.json ]]; then
  onnx_dir=$build/onnx
elif have onnx && have onnxruntime; then
  onnx_dir=$build/onnx
  timeout 300 "$python" bench/peers/onnx_peer.py --out "$onnx_dir" --densities all \
    --workloads seed,bow,long >"$build/onnx_peer.log" 2>&1 &
  graphs=$!
  say "writing ONNX Runtime's graphs in the background (bench/peers/onnx_peer.py)"
else
  say "ONNX Runtime peer skipped: ${python:-no Python with numpy} lacks onnx or onnxruntime"
fi

# ---- 2. The tests and sdmha_scaling, compiled side by side -------------------------------------
build_programs() {
  begin build 300 170
  # The test files: the bfloat16 engines' (named), any whose name says amx, onednn or bfloat16, and
  # any that declares a test of a suite the filter selects; from the folders sdmha_tests takes
  # (tests/CMakeLists.txt), io/ left out (it needs nlohmann/json and libzip).
  mapfile -t test_files < <(
    {
      printf '%s\n' tests/kernels/test_gemm_bfloat16.cpp tests/kernels/test_cpu_features.cpp \
        tests/layer/test_bfloat16_layer.cpp tests/layer/test_bfloat16_query.cpp
      ls tests/test_*.cpp tests/{runtime,plan,kernels,stages,layer,semantics}/test_*.cpp 2>/dev/null |
        grep -v '/runtime/test_fault_injection[.]cpp$' >"$build/candidates.txt"
      grep -iE '/test_[^/]*(amx|onednn|bfloat16)[^/]*[.]cpp$' "$build/candidates.txt"
      xargs grep -lE '^\s*(TYPED_)?TEST(_F|_P)?\(\s*[A-Za-z0-9_]*(BFloat16|OneDnn|Amx|CpuFeatures|ActiveKernels)' \
        <"$build/candidates.txt"
    } | sort -u | while read -r file; do [[ -f $file ]] && echo "$file"; done
  )
  say "test files: ${test_files[*]}"
  carried_includes=(-isystem "$carry/eigen3" -isystem "$carry/include")
  test_flags=(-std=c++17 -O2 -march=native -pthread -Wall -Wextra -Wpedantic -Wshadow
    -Wno-deprecated-copy -Wno-maybe-uninitialized -DSDMHA_WITH_ONEDNN=1
    "-DSDMHA_TEST_DATA_DIR=\"$repo/tests/data\"" -Iinclude -Itests -Itests/support
    "${carried_includes[@]}" -include test_support.hpp ${EXTRA_CXXFLAGS:-})
  scaling_flags="-std=c++17 -O3 -march=native -DNDEBUG -pthread"
  rm -rf "$build/obj" "$build/sdmha_scaling" "$build/bfloat16_tests"
  mkdir -p "$build/obj"
  compile() {  # compile NAME COMMAND...: its log and exit status in obj/NAME.{log,status}
    local name=$1
    shift
    timeout "$(left)" "$@" >"$build/obj/$name.log" 2>&1
    echo $? >"$build/obj/$name.status"
  }
  # The longest first: sdmha_scaling (-O3), then the test files by size.
  compiling=()  # their process ids (a bare `wait` would wait for the log's tee too)
  compile scaling "$cxx" $scaling_flags -DSDMHA_WITH_ONEDNN=1 -MD -MF "$build/obj/scaling.d" \
    -DSDMHA_SCALING_COMPILE_FLAGS="\"$scaling_flags, $($cxx --version | head -n 1)\"" \
    -Iinclude "${carried_includes[@]}" ${EXTRA_CXXFLAGS:-} bench/scaling/scaling_host.cpp \
    -o "$build/sdmha_scaling" -L"$lib" -Wl,-rpath,"$lib" -ldnnl -ldl &
  compiling+=($!)
  for file in $(ls -S "${test_files[@]}"); do
    while (($(jobs -rp | wc -l) >= jobs)); do sleep 0.2; done
    name=$(basename "$file" .cpp)
    compile "$name" "$cxx" "${test_flags[@]}" -MD -MF "$build/obj/$name.d" -c "$file" \
      -o "$build/obj/$name.o" &
    compiling+=($!)
  done
  wait "${compiling[@]}"
  objects=()
  failed_files=()
  for file in "${test_files[@]}"; do
    name=$(basename "$file" .cpp)
    if [[ $(cat "$build/obj/$name.status" 2>/dev/null) == 0 ]]; then
      objects+=("$build/obj/$name.o")
    else
      failed_files+=("$file")
      [[ $(cat "$build/obj/$name.status" 2>/dev/null) == 124 ]] &&
        say "COMPILE TIMED OUT at the build phase's limit (left out of the tests): $file" ||
        say "COMPILE FAILED (left out of the tests): $file"
      grep -m 20 -E 'error|Error' "$build/obj/$name.log"
      status=1
    fi
  done
  if [[ $(cat "$build/obj/scaling.status" 2>/dev/null) != 0 ]]; then
    say "COMPILE FAILED: bench/scaling/scaling_host.cpp"
    grep -m 20 -E 'error|Error' "$build/obj/scaling.log"
    status=1
  fi
  # Warnings in the project's files (GCC 12 reports false ones inside its own avx512fintrin.h).
  warnings=$(cat "$build"/obj/*.log | grep 'warning:' | grep -vc '^/usr/')
  ((warnings > 0)) && { say "$warnings compiler warnings, the first:"; cat "$build"/obj/*.log | grep 'warning:' | grep -v '^/usr/' | head -n 10; }
  # Every header outside the system's own must come from the checkout or the carried folder.
  foreign=$(cat "$build"/obj/*.d 2>/dev/null | tr ' \\' '\n\n' | grep -E '^/' | sort -u |
    grep -vE "^($repo|$carry)/" | grep -E '/(eigen3|Eigen|unsupported|gtest|gmock|oneapi|dnnl)' || true)
  if [[ -n $foreign ]]; then
    say "WARNING: headers from outside the carried folder:"
    echo "$foreign" | head -n 10
  else
    say "headers: Eigen, GoogleTest and oneDNN all from $carry"
  fi
  link() {
    timeout "$(left)" "$cxx" -pthread "${objects[@]}" -o "$build/bfloat16_tests" "$@" \
      -L"$lib" -Wl,-rpath,"$lib" -ldnnl -ldl >"$build/link.log" 2>&1
  }
  if ((${#objects[@]} > 0)); then
    if [[ -n ${GTEST_FROM_SOURCE:-} ]] || ! link "$carry/lib/libgtest_main.a" "$carry/lib/libgtest.a"; then
      say "building GoogleTest from its carried sources ($([[ -n ${GTEST_FROM_SOURCE:-} ]] &&
        echo GTEST_FROM_SOURCE is set || echo 'linking with the carried libgtest failed'))"
      tail -n 5 "$build/link.log" 2>/dev/null
      gtest=$carry/src/googletest
      compiling=()
      for part in gtest-all gtest_main; do
        timeout "$(left)" "$cxx" -std=c++17 -O2 -pthread -I"$gtest/include" -I"$gtest" \
          -c "$gtest/src/$part.cc" -o "$build/obj/$part.gtest.o" &
        compiling+=($!)
      done
      wait "${compiling[@]}"
      rm -f "$build/libgtest_built.a"
      ar rcs "$build/libgtest_built.a" "$build/obj/gtest-all.gtest.o" "$build/obj/gtest_main.gtest.o"
      link "$build/libgtest_built.a" || { cat "$build/link.log"; status=1; }
    fi
  fi
  end "${#objects[@]} of ${#test_files[@]} test files; sdmha_scaling $([[ -x $build/sdmha_scaling ]] && echo built || echo MISSING)"
}
test_files=()
objects=()
failed_files=()
if [[ -z $reuse ]]; then
  build_programs
else
  test_files=("(the last call's)")
  objects=("${test_files[@]}")
fi

# libdnnl needs libgomp and libOpenCL: the host's where it has them, else the carried ones.
fallback_libraries=""
if [[ -x $build/bfloat16_tests ]] && ldd "$build/bfloat16_tests" | grep -q 'not found'; then
  fallback_libraries=$carry/lib/fallback
  say "the host lacks $(ldd "$build/bfloat16_tests" | grep 'not found' | awk '{print $1}' | paste -sd' '): the carried ones are used"
fi
run_cxx() {
  if [[ -n $fallback_libraries ]]; then
    LD_LIBRARY_PATH="$fallback_libraries${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"
  else
    "$@"
  fi
}
[[ -x $build/bfloat16_tests ]] && run_cxx ldd "$build/bfloat16_tests" | grep -E 'dnnl|gomp|OpenCL|gtest|not found'

# ---- 3. The tests ---------------------------------------------------------------------------
begin tests 150 130
tests_summary="not run"
if [[ -n ${SKIP_TESTS:-} ]]; then
  tests_summary="not run (SKIP_TESTS)"
elif [[ -x $build/bfloat16_tests ]]; then
  run_cxx timeout "$(left)" "$build/bfloat16_tests" --gtest_filter="$filter" --gtest_color=no \
    >"$out/bfloat16_tests.txt" 2>&1
  tests_status=$?
  grep -E '^\[==========\]|^\[ +(SKIPPED|FAILED) +\] [A-Za-z]|oneDNN [0-9]' "$out/bfloat16_tests.txt" |
    awk '!seen[$1 $2 $3 $4]++' 
  tests_summary=$(grep -E '^\[ +(PASSED|SKIPPED|FAILED) +\] [0-9]+ test' "$out/bfloat16_tests.txt" |
    sed -E 's/^\[ +([A-Z]+) +\] ([0-9]+) tests?.*/\2 \1/' | tr 'A-Z' 'a-z' | paste -sd',' - | sed 's/,/, /g')
  tests_summary="${tests_summary:-no summary} (exit status $tests_status)"
  ((tests_status == 124)) && tests_summary="TIMED OUT after $((SECONDS - phase_start)) s; $tests_summary"
  ((tests_status != 0)) && status=1
fi
end "$tests_summary"

# ---- 4. sdmha: float32 and bfloat16 on each engine, interleaved in one process -------------------
if [[ -n $graphs ]]; then  # the peers' graphs must not be written beside the timed calls
  for ((waited = 0; waited < 90; ++waited)); do kill -0 "$graphs" 2>/dev/null || break; sleep 1; done
  if kill -0 "$graphs" 2>/dev/null; then
    kill "$graphs"
    say "onnx_peer.py still running 90 s after the tests: stopped (ONNX Runtime peer skipped)"
    onnx_dir=""
  elif ! wait "$graphs"; then
    say "onnx_peer.py failed (ONNX Runtime peer skipped):"
    tail -n 5 "$build/onnx_peer.log"
    onnx_dir=""
  else
    say "onnx_peer.py done: $(tail -n 1 "$build/onnx_peer.log")"
  fi
fi
begin timing 240 60
rm -f "$build/precision.json"
if [[ -x $build/sdmha_scaling ]]; then
  run_cxx timeout "$(left)" "$build/sdmha_scaling" --precision bfloat16 --bfloat16-gemms "$gemms" \
    --threads "$threads" --repetitions "$repetitions" ${QUICK:+--quick} \
    --json "$build/precision.json"
  timing_status=$?
  ((timing_status == 124)) && say "sdmha_scaling ran out of time; the workloads it finished are kept"
  ((timing_status != 0)) && status=1
  end "exit status $timing_status"
else
  end "not run: no sdmha_scaling"
fi

# ---- 5. ONNX Runtime and PyTorch at the same thread counts ---------------------------------------
begin peers 200 15
peers_json=""
if [[ -n $python ]] && (have torch || [[ -n $onnx_dir ]]); then
  rm -f "$build/peers.json"
  timeout "$(left)" "$python" bench/scaling/peers.py --threads "$threads" --steps forward \
    ${onnx_dir:+--onnx-dir "$onnx_dir"} --budget $(($(left) - 15)) --json "$build/peers.json"
  peers_status=$?
  peers_json=$build/peers.json
  end "exit status $peers_status"
else
  end "skipped: no Python with numpy and torch or onnxruntime"
fi

# ---- 6. The table ----------------------------------------------------------------------------
begin report 30 0
phases=""
for i in "${!phase_names[@]}"; do phases+="${phases:+, }${phase_names[$i]} ${phase_seconds[$i]} s"; done
timeout "$(left)" "${python:-python3}" bench/scaling/precision_report.py --sdmha "$build/precision.json" \
  ${peers_json:+--peers "$peers_json"} --markdown "$out/bfloat16_table.md" \
  --json "$out/bfloat16_results.json" \
  --note "Tests ($filter, ${#objects[@]} of ${#test_files[@]} test files built${failed_files[*]:+; failed to compile: ${failed_files[*]}}): $tests_summary." \
  --note "amx_check.sh on $(uname -n), $cores cores: $phases; $((SECONDS - start)) s in all." >/dev/null ||
  say "precision_report.py failed"
cat "$out/bfloat16_table.md" 2>/dev/null
end
say "amx_check.sh: $([[ $status == 0 ]] && echo "done" || echo 'FAILED (see above)') in $((SECONDS - start)) s; wrote $(ls "$out" | paste -sd' ') to $out"
exit $status
