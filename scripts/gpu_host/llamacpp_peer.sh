#!/usr/bin/env bash
# llama.cpp's CUDA build as a second in-run peer on a GPU host: builds llama-batched-bench from a
# llama.cpp source tree that travelled with the repo (no network there), writes one random bf16
# GGUF per config (scripts/gpu_host/random_gguf.py), and runs llama-batched-bench and
# `pagedlm bench` on the same file at the same prompt and output lengths, for each number of
# parallel sequences. A summary table comes last.
#   LLAMACPP_SRC=DIR scripts/gpu_host/llamacpp_peer.sh OUT_DIR smollm2-135m [llama-3.1-8b ...]
# Env: PAGEDLM (binary, default build-gpu/pagedlm), ARCHS (CUDA architectures for llama.cpp,
# default 90), PARALLEL (default "1 64 256"), PROMPT (default 512), GEN (default 256),
# MODELS_DIR (where the GGUFs go, default /tmp/peer-models), JOBS, QUANT (a llama-quantize type,
# e.g. Q4_K_M or Q8_0: the random bf16 GGUF requantized by llama.cpp's own quantizer, and pagedlm
# run on that file with --gguf-blocks, its blocks kept on the GPU).
# The sources: scripts/gpu_host/pack_llamacpp.sh packs them where there is network.
# Both sides decode every sequence's prompt apart (llama-batched-bench without -pps; pagedlm's
# prompts are random tokens, so no prefix is shared). The time compared is the whole batch's:
# prompt processing plus generation, llama.cpp's T against pagedlm's wall time.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: llamacpp_peer.sh OUT_DIR CONFIG...}
shift
src=${LLAMACPP_SRC:?LLAMACPP_SRC: a llama.cpp source tree}
bin=${PAGEDLM:-build-gpu/pagedlm}
parallel=${PARALLEL:-1 64 256}
prompt=${PROMPT:-512} gen=${GEN:-256}
models=${MODELS_DIR:-/tmp/peer-models}
mkdir -p "$out" "$models"
[[ -x $bin ]] || { echo "llamacpp_peer: no pagedlm binary at $bin" >&2; exit 1; }

llama_build=$src/build-cuda
quant=${QUANT:-}
targets=llama-batched-bench
[[ -n $quant ]] && targets="$targets llama-quantize"
if [[ ! -x $llama_build/bin/llama-batched-bench || (-n $quant && ! -x $llama_build/bin/llama-quantize) ]]; then
  start=$(date +%s)
  cmake -S "$src" -B "$llama_build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${ARCHS:-90}" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF >"$out/llamacpp-cmake.log" 2>&1
  # shellcheck disable=SC2086  # targets is a list
  ninja -C "$llama_build" -j "${JOBS:-$(nproc)}" $targets >"$out/llamacpp-build.log" 2>&1 ||
    { tail -20 "$out/llamacpp-build.log" >&2; exit 1; }
  echo "llama.cpp built in $(($(date +%s) - start)) s ($(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo "commit unknown"))"
fi

max_parallel=$(printf '%s\n' $parallel | sort -n | tail -1)
for model in "$@"; do
  gguf=$models/$model-bf16.gguf
  [[ -f $gguf ]] || python3 scripts/gpu_host/random_gguf.py "configs/$model.json" "$gguf" \
    --gguf-py "$src/gguf-py"
  blocks=()
  if [[ -n $quant ]]; then
    bf16=$gguf gguf=$models/$model-$quant.gguf blocks=(--gguf-blocks)
    [[ -f $gguf ]] || "$llama_build/bin/llama-quantize" "$bf16" "$gguf" "$quant" \
      >"$out/$model-quantize.log" 2>&1 || { tail -5 "$out/$model-quantize.log" >&2; exit 1; }
  fi
  npl=$(echo $parallel | tr ' ' ,)
  "$llama_build/bin/llama-batched-bench" -m "$gguf" -ngl 999 -fa on \
    -c $((max_parallel * (prompt + gen))) -b 2048 -ub 512 -npp "$prompt" -ntg "$gen" -npl "$npl" \
    --output-format jsonl >"$out/$model-llamacpp.jsonl" 2>"$out/$model-llamacpp.err" ||
    echo "$model: llama-batched-bench failed: $(tail -3 "$out/$model-llamacpp.err")"
  for n in $parallel; do
    "$bin" bench --device cuda --json --model "$gguf" "${blocks[@]}" --num-requests "$n" --warmup 8 \
      --prompt-min "$prompt" --prompt-max "$prompt" --output-min "$gen" --output-max "$gen" \
      >"$out/$model-pagedlm-$n.json" 2>"$out/$model-pagedlm-$n.err" ||
      echo "$model x$n: pagedlm bench failed: $(tail -1 "$out/$model-pagedlm-$n.err")"
  done
done

python3 - "$out" "$prompt" "$gen" "$@" <<'PY'
import json, os, sys
out, prompt, gen, models = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
print(f"prompt {prompt}, generated {gen} per sequence; tok/s = every sequence's generated tokens / batch time")
print(f"{'model':16} {'parallel':>8} {'llama.cpp s':>11} {'tok/s':>9} {'pagedlm s':>10} {'tok/s':>9} {'ratio':>6}")
for model in models:
    peer = {}
    try:
        for line in open(os.path.join(out, f"{model}-llamacpp.jsonl")):
            line = line.strip()
            if line.startswith("{"):
                r = json.loads(line)
                peer[r["pl"]] = r["t"]
    except OSError:
        pass
    for name in sorted(os.listdir(out)):
        if not (name.startswith(f"{model}-pagedlm-") and name.endswith(".json")):
            continue
        n = int(name[len(model) + 9:-5])
        try:
            ours = json.load(open(os.path.join(out, name)))["wall_s"]
        except (OSError, ValueError, KeyError):
            continue
        theirs = peer.get(n)
        t_s = f"{theirs:11.3f} {n * gen / theirs:9.0f}" if theirs else f"{'-':>11} {'-':>9}"
        ratio = f"{theirs / ours:6.2f}" if theirs else "     -"
        print(f"{model:16} {n:8} {t_s} {ours:10.3f} {n * gen / ours:9.0f} {ratio}")
PY
