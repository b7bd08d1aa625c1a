#!/usr/bin/env bash
# Installs what the Python package (python/, docs/python.md) needs on Debian 12 besides
# tools/bootstrap.sh's list: the interpreter's headers and pybind11 to build it; NumPy, PyTorch
# and pytest to run and test it; setuptools, wheel, pybind11's Python package, build and venv for
# `pip install --no-build-isolation .` and `python3 -m build --wheel --no-isolation`
# (pyproject.toml; tools/dev/check_wheel.sh). Debian's python3-torch 1.13 needs an OpenBLAS (without
# one it falls back to the reference BLAS and the dense comparisons crawl).
set -euo pipefail
exec "$(dirname "$0")/bootstrap.sh" python3-dev pybind11-dev python3-numpy python3-torch \
  libopenblas0-pthread python3-pytest python3-setuptools python3-wheel python3-pybind11 \
  python3-build python3-venv python3-pip "$@"
