#!/usr/bin/env bash
# Fails when a C++/CUDA source differs from .clang-format (Google style, 100 columns).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null || { echo "clang-format not installed; skipping" >&2; exit 0; }
bad=()
while IFS= read -r f; do
  clang-format --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
if ((${#bad[@]})); then
  printf 'not clang-formatted (run clang-format -i):\n' >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
