#!/usr/bin/env bash
# tools/device/prepare_carry.sh — fills .carry/ (git-ignored) with what tools/device/amx_check.sh
# needs on a host that has g++, Python and CMake but no Eigen, GoogleTest or oneDNN, and no
# network: the headers and libraries of this (Debian 12) machine, copied as they are installed.
#
# Usage:
#   tools/device/prepare_carry.sh [CARRY_DIR]        (default: .carry in the checkout)
#
# What it writes (about 24 MB; the checkout's tracked files are about 5 MB more, 64 MiB may travel):
#   eigen3/                 /usr/include/eigen3 (Eigen 3.4, with unsupported/: the Tensor module)
#   include/gtest/          GoogleTest's headers           (libgtest-dev)
#   include/oneapi/, include/dnnl*.h*   oneDNN's headers     (libdnnl-dev)
#   lib/libgtest.a, lib/libgtest_main.a                      (libgtest-dev, built by Debian's g++ 12)
#   lib/libdnnl.so.2.xz     oneDNN's shared library, xz-compressed (40 MB → 7 MB); amx_check.sh
#                           unpacks it into its build folder, never into the carried one
#   lib/fallback/           libgomp.so.1 and libOpenCL.so.1, which libdnnl needs: put on
#                           LD_LIBRARY_PATH only where the host lacks its own
#   src/googletest/         GoogleTest's sources (googletest package), to build it there should
#                           the carried static libraries not link with that host's compiler
#   MANIFEST.txt            versions and checksums
# The folder must be ignored by git in the checkout the device call copies (the `run` tool copies
# ignored paths only when named in `carry`): the script adds `.carry/` to .git/info/exclude of the
# main checkout (shared by its worktrees) when it is not ignored already.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
carry=${1:-$repo/.carry}
multiarch=/usr/lib/x86_64-linux-gnu

need() {
  for path in "$@"; do
    if [[ ! -e $path ]]; then
      echo "prepare_carry.sh: $path is missing (apt-get install libeigen3-dev libgtest-dev googletest libdnnl-dev)" >&2
      exit 1
    fi
  done
}
need /usr/include/eigen3/Eigen/Core /usr/include/eigen3/unsupported/Eigen/CXX11/Tensor \
  /usr/include/gtest/gtest.h "$multiarch/libgtest.a" "$multiarch/libgtest_main.a" \
  /usr/src/googletest/googletest/src/gtest-all.cc /usr/include/oneapi/dnnl/dnnl.hpp \
  "$multiarch/libdnnl.so.2" "$multiarch/libgomp.so.1" "$multiarch/libOpenCL.so.1"

rm -rf "$carry"
mkdir -p "$carry/include" "$carry/lib/fallback" "$carry/src"
cp -r /usr/include/eigen3 "$carry/eigen3"
cp -r /usr/include/gtest "$carry/include/gtest"
cp -r /usr/include/oneapi "$carry/include/oneapi"
cp /usr/include/dnnl*.h /usr/include/dnnl*.hpp "$carry/include/"
cp "$multiarch/libgtest.a" "$multiarch/libgtest_main.a" "$carry/lib/"
xz -T2 -6 -c "$(readlink -f "$multiarch/libdnnl.so.2")" >"$carry/lib/libdnnl.so.2.xz"
cp -L "$multiarch/libgomp.so.1" "$multiarch/libOpenCL.so.1" "$carry/lib/fallback/"
mkdir -p "$carry/src/googletest"
cp -r /usr/src/googletest/googletest/include /usr/src/googletest/googletest/src \
  "$carry/src/googletest/"

{
  echo "Carried by tools/device/prepare_carry.sh from $(. /etc/os-release && echo "$PRETTY_NAME"), $(date -u +%FT%TZ)"
  dpkg-query -W -f='${Package} ${Version}\n' libeigen3-dev libgtest-dev googletest libdnnl-dev \
    libdnnl2 libgomp1 ocl-icd-libopencl1 2>/dev/null || true
  echo "g++ here: $(g++ --version | head -n 1)"
  (cd "$carry" && find . -type f ! -name MANIFEST.txt -path './lib/*' -exec sha256sum {} +)
} >"$carry/MANIFEST.txt"

# Ignored in the checkout that travels (the main one; worktrees share its info/exclude).
common=$(git -C "$repo" rev-parse --git-common-dir)
[[ $common = /* ]] || common=$repo/$common
relative=${carry#"$repo"/}
if [[ $relative != "$carry" ]] && ! git -C "$repo" check-ignore -q "$relative/MANIFEST.txt"; then
  mkdir -p "$common/info"
  echo "/$relative/" >>"$common/info/exclude"
  echo "prepare_carry.sh: added /$relative/ to $common/info/exclude"
fi

tracked=$(git -C "$repo" ls-files -z | (cd "$repo" && xargs -0 du -cb 2>/dev/null) | tail -n 1 | cut -f1)
carried=$(du -sb "$carry" | cut -f1)
echo "prepare_carry.sh: $carry holds $((carried / 1024 / 1024)) MiB; with the tracked tree" \
  "($((tracked / 1024 / 1024)) MiB) $(((carried + tracked) / 1024 / 1024)) MiB of the 64 MiB that may travel"
