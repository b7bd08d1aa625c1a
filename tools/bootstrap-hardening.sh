#!/usr/bin/env bash
# Installs what .ci/hardening.sh needs beyond tools/bootstrap.sh on Debian 12: clang and its
# sanitizer and libFuzzer runtimes. Installs nothing when it is all there already; runs apt-get
# through sudo when not root.
set -euo pipefail
"$(dirname "$0")/bootstrap.sh"
packages=(clang libclang-rt-14-dev)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "tools/bootstrap-hardening.sh: installing ${missing[*]}"
sudo_prefix=()
if [ "$(id -u)" -ne 0 ]; then sudo_prefix=(sudo); fi
"${sudo_prefix[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo_prefix[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
