#!/usr/bin/env bash
# clang-tidy over the C++ sources with the checks in .clang-tidy (bug-finding and performance
# checks; findings are errors). Needs build/compile_commands.json (scripts/build.sh makes it).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-tidy >/dev/null || { echo "clang-tidy not installed; skipping" >&2; exit 0; }
[[ -f build/compile_commands.json ]] || { echo "no build/compile_commands.json" >&2; exit 1; }
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! git ls-files 'src/*.cc' | xargs -P "$(nproc)" -n 4 clang-tidy -p build --quiet >"$log" 2>&1;
then
  grep -E "(warning|error):" "$log" | grep -v "warnings generated" | sort -u >&2 || cat "$log" >&2
  exit 1
fi
