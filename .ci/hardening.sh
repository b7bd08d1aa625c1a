#!/usr/bin/env bash
# CI hardening stages, run from .ci/run after the README's test command:
#   1. the whole suite in a Debug build (assertions on) under AddressSanitizer +
#      UndefinedBehaviorSanitizer, in build-asan/;
#   2. the threaded tests under ThreadSanitizer (clang), in build-tsan/, built from the test
#      files that declare them only;
#   3. every libFuzzer target for SDMHA_FUZZ_SECONDS (default 40) over a copy of its seed corpus,
#      two targets at a time, in build-fuzz/;
#   4. the unit tests that run the kernels (sdmha_tests' files but those of io/ and four others,
#      see stage 4, and the steady-state allocation test) built without -march=native (x86-64's
#      baseline, SSE2), in build-portable/: the paths a CPU without AVX-512 takes (Eigen's GEMM,
#      the portable bfloat16 loops and packers, the portable exponentials), which the test
#      builds of the README command and stages 1-2 compile out on an AVX-512 machine (the fuzz
#      targets, built without -march=native, reach the few of them they call).
# Any sanitizer report, failed test or fuzzer finding fails the script. About 30 minutes on a
# 2-core machine from a cold compiler cache: an estimate, from the stage times of the last runs
# as they were (ASan + UBSan 1050-1450 s, TSan 305-450 s, libFuzzer 355-420 s, portable
# 490-530 s) and the compile times of their parts measured here (tests/fuzz/README.md, "Time").
#
# SDMHA_HARDENING_STAGES picks stages for a local run, e.g. "tsan fuzz" (default: all four);
# SDMHA_FUZZ_SECONDS sets the time per fuzz target; SDMHA_FUZZ_SEED (default 1) is libFuzzer's
# -seed, fixed so that a run can be repeated: the same seed, corpus and build give the same
# mutations (up to the time limit and, in fuzz_forward, the thread scheduling).
set -euo pipefail
cd "$(dirname "$0")/.."

readonly JOBS=2
# Five targets, two at a time, take three rounds: 40 s each keeps the stage's fuzzing at 120 s,
# what two rounds of four targets at 60 s took.
readonly FUZZ_SECONDS=${SDMHA_FUZZ_SECONDS:-40}
readonly FUZZ_SEED=${SDMHA_FUZZ_SEED:-1}
readonly STAGES=" ${SDMHA_HARDENING_STAGES:-asan tsan fuzz portable} "
wanted() { [[ $STAGES == *" $1 "* ]]; }
# A misspelt stage would otherwise run nothing and report that all stages passed.
for stage in $STAGES; do
  case $stage in
    asan | tsan | fuzz | portable) ;;
    *) echo "hardening: unknown stage '$stage' in SDMHA_HARDENING_STAGES (asan, tsan, fuzz, portable)" >&2
       exit 2 ;;
  esac
done

tools/bootstrap-hardening.sh
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
# Only the library, its tests and sdmha-run (the tool tests run it): no bench, and no Python
# module (an instrumented extension cannot be loaded into an uninstrumented interpreter). No
# oneDNN engine either: libdnnl and its OpenMP runtime are not instrumented, so the sanitizers
# would see half of each call; the Release suite tests that engine where libdnnl-dev is present.
common=(-DSDMHA_BUILD_BENCH=OFF -DSDMHA_BUILD_PYTHON=OFF -DSDMHA_INSTALL=OFF
        -DSDMHA_WITH_ONEDNN=OFF "${launcher[@]}")

stage_start=0
banner() {
  stage_start=$SECONDS
  printf '\n==================== hardening: %s ====================\n' "$*"
}
done_banner() {
  printf '==================== hardening: %s passed in %d s ====================\n' "$1" \
    $((SECONDS - stage_start))
}

# ---- 1. Debug + ASan + UBSan, the whole suite ---------------------------------------------------
# Debug keeps NDEBUG undefined, so SDMHA_ASSERT and Eigen's assertions are on. clang rather than
# g++: its UBSan also reports pointer arithmetic on null (g++'s does not). -O1, as ASan's own
# documentation advises: the suite's central-difference checks run thousands of forwards, which
# at -O0 through Eigen's expression templates would take most of CI's time. ASan's checks are
# calls rather than inline code (-fsanitize-address-outline-instrumentation; the same checks):
# on an AVX-512 machine (the tests build with -march=native) every test file instantiates the
# AVX-512 GEMM's unrolled micro-kernels, and clang 14 compiles their inline checks several times
# slower than the calls, which made this build most of CI's time. Debug information is line
# tables only (sanitizer_debug, also for stage 2): what a sanitizer report's stack needs
# (functions, files, lines, inlined frames); the full -g (variables and types, for a debugger)
# cost about a fifth more compile time (test_backward.cpp: 159 against 129 CPU seconds) and twice
# the object size. The consumer tests are left out: they configure and build other projects
# (without the sanitizer flags) and test packaging, not memory safety; and the lint tests, the
# same script over the same headers as the README command's run, which ran them already.
sanitizer_debug="-gline-tables-only -O1"
if wanted asan; then
banner "1/4 Debug + AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/, clang)"
asan_flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_CXX_FLAGS="$asan_flags -fsanitize-address-outline-instrumentation" \
  -DCMAKE_CXX_FLAGS_DEBUG="$sanitizer_debug" -DCMAKE_EXE_LINKER_FLAGS="$asan_flags" "${common[@]}"
cmake --build build-asan -j"$JOBS"
ASAN_OPTIONS=halt_on_error=1:abort_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:strict_init_order=1:check_initialization_order=1 \
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -j"$JOBS" -LE 'consumer|lint'
done_banner "1/4 ASan + UBSan"
fi

# ---- 2. ThreadSanitizer, the threaded tests ------------------------------------------------------
# The tests that run threads: one layer shared by 8 threads (Concurrency) and the thread-count
# invariance tests (the layer and the backward pass on 1 to 8 workers), the backward's ordered
# sums of dK and dV across tile groups (BackwardTiles: up to 64 workers, and a failing tile), and
# the Workspace and ThreadPool tests (persistent worker threads kept between calls), and the soak
# test (4 threads with workspaces of their own on one layer, forward and backward for 2 s).
# Built: sdmha_test_subset (tests/CMakeLists.txt), the test files that declare a test the filter
# may select (found by their TEST macros at configure time, listed in the configure output), with
# sdmha_tests' settings: the same tests as the filter selects from the whole sdmha_tests (the
# same 47 when this was written), from 8 of its files (38 % of its compile time when measured).
if wanted tsan; then
banner "2/4 ThreadSanitizer (build-tsan/, clang)"
tsan_flags="-fsanitize=thread -fno-omit-frame-pointer"
tsan_filter='Concurrency*:*ThreadCount*:*Workspace*:ThreadPool*:BackwardTiles*:Soak*'
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_CXX_FLAGS="$tsan_flags" -DCMAKE_CXX_FLAGS_DEBUG="$sanitizer_debug" \
  -DCMAKE_EXE_LINKER_FLAGS="$tsan_flags" -DSDMHA_BUILD_EXAMPLES=OFF -DSDMHA_BUILD_TOOLS=OFF \
  -DSDMHA_TEST_SUBSET_FILTER="$tsan_filter" -DSDMHA_TEST_SUBSET_EXCLUDE= "${common[@]}"
cmake --build build-tsan -j"$JOBS" --target sdmha_test_subset
# A filter that selects nothing would pass without testing anything.
selected=$(build-tsan/tests/sdmha_test_subset --gtest_filter="$tsan_filter" --gtest_list_tests |
           grep -c '^  ' || true)
if [ "$selected" -eq 0 ]; then
  echo "hardening: the filter $tsan_filter selects no test" >&2
  exit 1
fi
echo "running build-tsan/tests/sdmha_test_subset --gtest_filter=$tsan_filter ($selected tests)"
TSAN_OPTIONS=halt_on_error=1:abort_on_error=1:second_deadlock_stack=1 \
  build-tsan/tests/sdmha_test_subset --gtest_filter="$tsan_filter"
done_banner "2/4 TSan"
fi

# ---- 3. libFuzzer -------------------------------------------------------------------------------
if wanted fuzz; then
banner "3/4 libFuzzer, ${FUZZ_SECONDS} s per target, -seed=${FUZZ_SEED} (build-fuzz/, clang)"
cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=clang++ \
  -DSDMHA_BUILD_FUZZERS=ON -DSDMHA_BUILD_TESTS=OFF -DSDMHA_BUILD_EXAMPLES=OFF \
  -DSDMHA_BUILD_TOOLS=OFF "${common[@]}"
targets=(fuzz_sparse_query fuzz_safetensors fuzz_npy fuzz_forward fuzz_keras)
cmake --build build-fuzz -j"$JOBS" --target "${targets[@]}"
# Two targets at a time, each for the whole FUZZ_SECONDS: a libFuzzer process runs one input at a
# time on one core (fuzz_forward's layer takes at most 3 threads, for problems of a few rows), so
# one target after another left one of the 2 cores idle. A pair takes the time of one target, and
# each still gets its FUZZ_SECONDS (rather than half of it), its -seed and its corpus: the same
# fuzzing in half the time. One worker per target (-jobs is left alone). Each full log stays in
# build-fuzz/run/<target>/log.txt; its end is printed once the pair is done, and a finding fails
# the stage when both have ended.
fuzz_start() {  # target: starts it over a scratch copy of its corpus; its pid in fuzz_pid
  local target=$1 work=build-fuzz/run/$1
  # libFuzzer adds what it finds to the first corpus directory: a scratch copy, never the repo's.
  rm -rf "$work" && mkdir -p "$work/corpus" "$work/artifacts"
  if [ -d "tests/fuzz/corpus/$target" ]; then cp -R "tests/fuzz/corpus/$target/." "$work/corpus/"; fi
  if [ "$target" = fuzz_keras ]; then  # the Keras test files and the damaged ones, made from them
    cp tests/data/keras/*.keras tests/data/keras/*.weights.h5 tests/data/keras/damaged/*.h5 "$work/corpus/"
    python3 tests/fuzz/make_keras_seeds.py "$work/corpus"
  fi
  local dictionary=()
  if [ -f "tests/fuzz/$target.dict" ]; then dictionary=(-dict="tests/fuzz/$target.dict"); fi
  ASAN_OPTIONS=halt_on_error=1:abort_on_error=1:detect_leaks=1 \
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    "build-fuzz/tests/fuzz/$target" "$work/corpus" "${dictionary[@]}" \
      -seed="$FUZZ_SEED" -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 -timeout=30 -print_final_stats=1 \
      -artifact_prefix="$work/artifacts/" >"$work/log.txt" 2>&1 &
  fuzz_pid=$!
}
fuzz_finish() {  # target pid: waits for it and prints the end of its log; fails on a finding
  local target=$1 work=build-fuzz/run/$1 status=0
  wait "$2" || status=$?
  echo "---- $target: ${FUZZ_SECONDS} s"
  if [ "$status" -eq 0 ]; then
    grep -v -e '^#' -e 'NEW_FUNC' "$work/log.txt" | tail -n 8
  else
    tail -n 150 "$work/log.txt"
    echo "hardening: $target found a problem (exit status $status); the reproducer is in" \
         "$work/artifacts/ (tests/fuzz/README.md: from a crash to a regression test)"
    return 1
  fi
}
fuzz_failed=0
for ((i = 0; i < ${#targets[@]}; i += 2)); do
  pair=("${targets[@]:i:2}")
  pids=()
  for target in "${pair[@]}"; do
    fuzz_start "$target"
    pids+=("$fuzz_pid")
  done
  for j in "${!pair[@]}"; do
    fuzz_finish "${pair[j]}" "${pids[j]}" || fuzz_failed=1
  done
  if [ "$fuzz_failed" -ne 0 ]; then exit 1; fi
done
done_banner "3/4 libFuzzer"
fi
# ---- 4. Portable: the unit tests without -march=native ------------------------------------------
# Release with the default compiler (g++ on Debian), as a user's default build;
# GemmEngine.NeedsAvx512 skips by design there. The allocation test is what notices a portable
# kernel that allocates per call (a planned workspace too small is served, not refused).
# Built: the test files that run the code -march=native changes (sdmha_test_subset without the
# files portable_exclude names, tests/CMakeLists.txt). What changes is the float GEMM (Eigen's
# instead of the AVX-512 engine, and with it the workspace sizes and which blocks may be fused
# bitwise), the bfloat16 kernels and packers, and the softmax's exponentials and row maximum
# (detail/softmax_exp.hpp, with the flush that makes a blocked key exactly 0), so every file whose
# tests check the numbers of a stage or a layer stays: kernels/, stages/, layer/, plan/ (the online
# softmax, context streaming), the semantics files that run the layer (numerics with NaN and Inf
# behind blocked keys, biases with -inf, the options, the goldens at the README's tolerances) and
# runtime/test_workspace (reuse through shape changes, bitwise). Left out, 22 % of sdmha_tests'
# compile time when measured: io/ (file formats and loaders), runtime/test_parallel (the pool
# alone), runtime/test_concurrency and runtime/test_soak (threads on one layer: what the calls
# share is the layer's, the same code in both builds, and the kernels work in the scratch each
# call is given),
# semantics/test_mask (mask building) and semantics/test_bad_input (input refused before any
# arithmetic). A test file renamed or added is built: the list names what may be left out, not
# what is kept.
if wanted portable; then
banner "4/4 portable build without -march=native (build-portable/, Release)"
portable_exclude='^(io/|runtime/test_(parallel|concurrency|soak)[.]cpp$|semantics/test_(mask|bad_input)[.]cpp$)'
cmake -S . -B build-portable -DCMAKE_BUILD_TYPE=Release -DSDMHA_TESTS_NATIVE=OFF \
  -DSDMHA_BUILD_EXAMPLES=OFF -DSDMHA_BUILD_TOOLS=OFF \
  -DSDMHA_TEST_SUBSET_FILTER= -DSDMHA_TEST_SUBSET_EXCLUDE="$portable_exclude" "${common[@]}"
cmake --build build-portable -j"$JOBS" --target sdmha_test_subset sdmha_allocation_tests
for binary in sdmha_test_subset sdmha_allocation_tests; do
  echo "running build-portable/tests/$binary"
  "build-portable/tests/$binary" --gtest_brief=1
done
done_banner "4/4 portable"
fi
echo "hardening: all stages passed"
