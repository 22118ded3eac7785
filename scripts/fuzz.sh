#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz/ (clang, ASan, UBSan; CPU only) into build-fuzz/
# and runs each for a bounded time from its seed corpora. Any crash, sanitizer report, leak,
# timeout or broken property fails the script; the input that caused it is kept under
# build-fuzz/findings/ and replays with `build-fuzz/tests/fuzz/<target> <file>`.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]   (default 20 s each, every target)
#
# CI runs it from scripts/test.sh with the default; a longer campaign is the same command with
# more seconds (e.g. 600). The corpus each run grows stays in build-fuzz/corpus/ for the next.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-20}
shift || true
targets=("$@")
if ((${#targets[@]} == 0)); then
  targets=(fuzz_http_request fuzz_openai_request fuzz_json_shapes fuzz_reply_parsers
           fuzz_tokenizer_json fuzz_jinja fuzz_gguf fuzz_safetensors fuzz_quant_config)
fi

# Seeds: tests/fuzz/seeds/<target>/, plus the repo's own files of the formats read as text.
extra_seeds() {
  case "$1" in
    fuzz_tokenizer_json) echo testdata/tokenizer/tiny ;;
    fuzz_jinja) echo testdata/chat_templates ;;
  esac
}

export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# Debug info for the reports; -O1 is enough for the sanitizers and compiles quickly.
CC=clang CXX=clang++ cmake -S . -B build-fuzz -DPAGEDLM_FUZZ=ON -DPAGEDLM_CUDA=OFF \
  -DPAGEDLM_TESTS=OFF -DPAGEDLM_WERROR=ON -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" \
  "${launcher[@]}" >/dev/null
cmake --build build-fuzz -j"$(nproc)" --target "${targets[@]}"

# Leaks count as findings; abort_on_error makes UBSan's reports crashes libFuzzer keeps.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
mkdir -p build-fuzz/findings
failed=()
for target in "${targets[@]}"; do
  corpus=build-fuzz/corpus/$target
  mkdir -p "$corpus"
  seeds=(tests/fuzz/seeds/"$target")
  [[ -d ${seeds[0]} ]] || seeds=()
  for extra in $(extra_seeds "$target"); do seeds+=("$extra"); done
  log=build-fuzz/findings/$target.log
  echo "fuzz: $target for ${seconds}s" >&2
  # -timeout: one input taking 10 s is a hang; -rss_limit_mb: a runaway allocation is a finding.
  if build-fuzz/tests/fuzz/"$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -max_len=65536 -print_final_stats=1 -artifact_prefix=build-fuzz/findings/"$target"- \
      "$corpus" "${seeds[@]}" >"$log" 2>&1; then
    grep -E "^stat::number_of_executed_units|^#[0-9]+.*DONE" "$log" | sed 's/^/  /' >&2 || true
  else
    echo "fuzz: $target FAILED; its log:" >&2
    tail -n 60 "$log" >&2
    failed+=("$target")
  fi
done
if ((${#failed[@]})); then
  echo "fuzz: findings in ${failed[*]} (inputs under build-fuzz/findings/)" >&2
  exit 1
fi
