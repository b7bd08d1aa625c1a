#!/usr/bin/env bash
# The Python package as a PyTorch user installs it: builds the wheel (python3 -m build --wheel
# --no-isolation: pyproject.toml, setup.py's CMake step), installs it into a fresh virtual
# environment that sees the system's packages (--system-site-packages: Debian's torch, numpy and
# pytest), checks that `import sdmha.torch` finds the installed package, and runs python/tests
# from a copy outside the source tree against it: with the kernels chosen for this CPU, then
# with SDMHA_KERNELS=portable (the extension that runs on any x86-64 CPU).
#
#   tools/dev/check_wheel.sh                          a fresh CMake build in build-python/
#   SDMHA_CMAKE_BUILD_DIR=build tools/dev/check_wheel.sh   reuse a configured build tree (CI: nothing
#                                                      is compiled again)
# PYTHON picks the interpreter (default /usr/bin/python3, Debian's, which has torch).
set -euo pipefail
source_dir=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-/usr/bin/python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$python" -m build --wheel --no-isolation --outdir "$work/dist" "$source_dir"
"$python" -m venv --system-site-packages "$work/venv"
"$work/venv/bin/python" -m pip install --no-index --no-deps --quiet "$work"/dist/sdmha-*.whl
cp -r "$source_dir/python/tests" "$work/tests"
cd "$work"
"$work/venv/bin/python" - "$work/venv" <<'PY'
import pathlib, sys
import sdmha, sdmha.torch
installed = pathlib.Path(sdmha.__file__).resolve()
assert pathlib.Path(sys.argv[1]).resolve() in installed.parents, f"sdmha imported from {installed}, not the venv"
print(f"sdmha {sdmha.__version__} from {installed.parent}: {sdmha.kernels()}")
PY
for kernels in "" portable; do
  echo "pytest with SDMHA_KERNELS=${kernels:-(unset)}"
  SDMHA_KERNELS=$kernels SDMHA_SOURCE_DIR="$source_dir" PYTHONDONTWRITEBYTECODE=1 \
    "$work/venv/bin/python" -m pytest -q -p no:cacheprovider "$work/tests"
done
