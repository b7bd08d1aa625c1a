#!/usr/bin/env bash
# Installs what building, testing and benchmarking the C++ library needs on Debian 12 (plus any
# packages named as arguments), and nothing when it is all there already. Runs apt-get through
# sudo when not root. The Python package (python/, docs/python.md) has its own:
# tools/bootstrap-python.sh. libdnnl-dev (oneDNN) is optional to the build: with it the bfloat16
# mode gains its AMX engine (detail/gemm_onednn.hpp), and the tests exercise that engine.
set -euo pipefail
packages=(cmake g++ make pkg-config libeigen3-dev libgtest-dev libbenchmark-dev
          nlohmann-json3-dev libzip-dev libhdf5-dev libdnnl-dev
          "$@")
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "tools/bootstrap.sh: installing ${missing[*]}"
sudo_prefix=()
if [ "$(id -u)" -ne 0 ]; then sudo_prefix=(sudo); fi
"${sudo_prefix[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo_prefix[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
