#!/usr/bin/env bash
# CI hardening stages, run from .ci/run after the README's test command:
#   1. the whole suite in a Debug build (assertions on) under AddressSanitizer +
#      UndefinedBehaviorSanitizer, in build-asan/;
#   2. the threaded tests under ThreadSanitizer (clang), in build-tsan/;
#   3. every libFuzzer target for SDMHA_FUZZ_SECONDS (default 60) over a copy of its seed corpus,
#      in build-fuzz/;
#   4. the unit tests (sdmha_tests and the steady-state allocation test) built without
#      -march=native (x86-64's baseline, SSE2), in build-portable/: the paths a CPU without
#      AVX-512 takes (Eigen's GEMM, the portable bfloat16 loops and packers), which the test
#      builds of the README command and stages 1-2 compile out on an AVX-512 machine (the fuzz
#      targets, built without -march=native, reach the few of them they call).
# Any sanitizer report, failed test or fuzzer finding fails the script. About 37 minutes on a
# 2-core machine from a cold compiler cache (tests/fuzz/README.md has the figures).
#
# SDMHA_HARDENING_STAGES picks stages for a local run, e.g. "tsan fuzz" (default: all four);
# SDMHA_FUZZ_SECONDS sets the time per fuzz target; SDMHA_FUZZ_SEED (default 1) is libFuzzer's
# -seed, fixed so that a run can be repeated: the same seed, corpus and build give the same
# mutations (up to the time limit and, in fuzz_forward, the thread scheduling).
set -euo pipefail
cd "$(dirname "$0")/.."

readonly JOBS=2
readonly FUZZ_SECONDS=${SDMHA_FUZZ_SECONDS:-60}
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
# module (an instrumented extension cannot be loaded into an uninstrumented interpreter).
common=(-DSDMHA_BUILD_BENCH=OFF -DSDMHA_BUILD_PYTHON=OFF -DSDMHA_INSTALL=OFF "${launcher[@]}")

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
# slower than the calls, which made this build most of CI's time. The
# consumer tests are left out: they configure and build other projects (without the sanitizer
# flags) and test packaging, not memory safety.
if wanted asan; then
banner "1/4 Debug + AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/, clang)"
asan_flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_CXX_FLAGS="$asan_flags -fsanitize-address-outline-instrumentation" \
  -DCMAKE_CXX_FLAGS_DEBUG="-g -O1" -DCMAKE_EXE_LINKER_FLAGS="$asan_flags" "${common[@]}"
cmake --build build-asan -j"$JOBS"
ASAN_OPTIONS=halt_on_error=1:abort_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:strict_init_order=1:check_initialization_order=1 \
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -j"$JOBS" -LE consumer
done_banner "1/4 ASan + UBSan"
fi

# ---- 2. ThreadSanitizer, the threaded tests ------------------------------------------------------
# The tests that run threads: one layer shared by 8 threads (Concurrency) and the thread-count
# invariance tests (the layer and the backward pass on 1 to 8 workers), the backward's ordered
# sums of dK and dV across tile groups (BackwardTiles: up to 64 workers, and a failing tile), and
# the Workspace and ThreadPool tests (persistent worker threads kept between calls).
if wanted tsan; then
banner "2/4 ThreadSanitizer (build-tsan/, clang)"
tsan_flags="-fsanitize=thread -fno-omit-frame-pointer"
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_CXX_FLAGS="$tsan_flags" -DCMAKE_CXX_FLAGS_DEBUG="-g -O1" \
  -DCMAKE_EXE_LINKER_FLAGS="$tsan_flags" -DSDMHA_BUILD_EXAMPLES=OFF -DSDMHA_BUILD_TOOLS=OFF "${common[@]}"
cmake --build build-tsan -j"$JOBS" --target sdmha_tests
tsan_filter='Concurrency*:*ThreadCount*:*Workspace*:ThreadPool*:BackwardTiles*'
echo "running build-tsan/tests/sdmha_tests --gtest_filter=$tsan_filter"
TSAN_OPTIONS=halt_on_error=1:abort_on_error=1:second_deadlock_stack=1 \
  build-tsan/tests/sdmha_tests --gtest_filter="$tsan_filter"
done_banner "2/4 TSan"
fi

# ---- 3. libFuzzer -------------------------------------------------------------------------------
if wanted fuzz; then
banner "3/4 libFuzzer, ${FUZZ_SECONDS} s per target, -seed=${FUZZ_SEED} (build-fuzz/, clang)"
cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=clang++ \
  -DSDMHA_BUILD_FUZZERS=ON -DSDMHA_BUILD_TESTS=OFF -DSDMHA_BUILD_EXAMPLES=OFF \
  -DSDMHA_BUILD_TOOLS=OFF "${common[@]}"
targets=(fuzz_sparse_query fuzz_safetensors fuzz_npy fuzz_forward)
cmake --build build-fuzz -j"$JOBS" --target "${targets[@]}"
for target in "${targets[@]}"; do
  echo "---- $target: ${FUZZ_SECONDS} s"
  # libFuzzer adds what it finds to the first corpus directory: a scratch copy, never the repo's.
  work=build-fuzz/run/$target
  rm -rf "$work" && mkdir -p "$work/corpus" "$work/artifacts"
  if [ -d "tests/fuzz/corpus/$target" ]; then cp -R "tests/fuzz/corpus/$target/." "$work/corpus/"; fi
  dictionary=()
  if [ -f "tests/fuzz/$target.dict" ]; then dictionary=(-dict="tests/fuzz/$target.dict"); fi
  # One worker (-jobs is left alone): 2 cores, and fuzz_forward itself starts threads. The full
  # log stays in $work/log.txt; its end is printed.
  if ASAN_OPTIONS=halt_on_error=1:abort_on_error=1:detect_leaks=1 \
     UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
     "build-fuzz/tests/fuzz/$target" "$work/corpus" "${dictionary[@]}" \
       -seed="$FUZZ_SEED" -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 -timeout=30 -print_final_stats=1 \
       -artifact_prefix="$work/artifacts/" >"$work/log.txt" 2>&1; then
    grep -v -e '^#' -e 'NEW_FUNC' "$work/log.txt" | tail -n 8
  else
    tail -n 150 "$work/log.txt"
    echo "hardening: $target found a problem; the reproducer is in $work/artifacts/" \
         "(tests/fuzz/README.md: from a crash to a regression test)"
    exit 1
  fi
done
done_banner "3/4 libFuzzer"
fi
# ---- 4. Portable: the unit tests without -march=native ------------------------------------------
# Release with the default compiler (g++ on Debian), as a user's default build;
# GemmEngine.NeedsAvx512 skips by design there. The allocation test is what notices a portable
# kernel that allocates per call (a planned workspace too small is served, not refused).
if wanted portable; then
banner "4/4 portable build without -march=native (build-portable/, Release)"
cmake -S . -B build-portable -DCMAKE_BUILD_TYPE=Release -DSDMHA_TESTS_NATIVE=OFF \
  -DSDMHA_BUILD_EXAMPLES=OFF -DSDMHA_BUILD_TOOLS=OFF "${common[@]}"
cmake --build build-portable -j"$JOBS" --target sdmha_tests sdmha_allocation_tests
for binary in sdmha_tests sdmha_allocation_tests; do
  echo "running build-portable/tests/$binary"
  "build-portable/tests/$binary" --gtest_brief=1
done
done_banner "4/4 portable"
fi
echo "hardening: all stages passed"
