#!/usr/bin/env bash
# Checks that every C++ source of the project is formatted by .clang-format (Debian's
# clang-format 14); with --fix, formats them in place. Exits non-zero and lists the files
# that differ otherwise.
set -euo pipefail
cd "$(dirname "$0")/../.."
command -v clang-format >/dev/null || tools/bootstrap.sh clang-format
mapfile -t files < <(git ls-files '*.hpp' '*.cpp' '*.h' | grep -v '^tests/lint/')
if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
unformatted=()
for file in "${files[@]}"; do
  if ! clang-format --dry-run --Werror "$file" >/dev/null 2>&1; then unformatted+=("$file"); fi
done
if [ ${#unformatted[@]} -ne 0 ]; then
  printf 'tools/dev/check_format.sh: not formatted by .clang-format (run it with --fix):\n' >&2
  printf '  %s\n' "${unformatted[@]}" >&2
  exit 1
fi
echo "tools/dev/check_format.sh: ${#files[@]} files formatted"
