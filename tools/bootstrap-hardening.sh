#!/usr/bin/env bash
# Installs what .ci/hardening.sh needs on Debian 12: tools/bootstrap.sh's list plus clang and its
# sanitizer and libFuzzer runtimes.
set -euo pipefail
exec "$(dirname "$0")/bootstrap.sh" clang libclang-rt-14-dev
