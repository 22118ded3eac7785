#!/usr/bin/env bash
# CPU side-by-side of pagedlm and llama.cpp (through llama-cpp-python) on the same GGUF, the
# same prompt token ids, greedy decoding and the same thread count. See docs/PERF.md,
# "CPU: pagedlm vs llama.cpp".
#
#   CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python    # the peer, once
#   cmake -S . -B build -DPAGEDLM_CUDA=OFF -DPAGEDLM_TESTS=OFF && make -C build -j2 pagedlm
#   scripts/cpu_peer_bench.sh [PAGEDLM_BINARY] [RUNS]
#
# Workloads (whole-process wall time, model load included on both sides):
#   load    one chat prompt, 1 new token (mostly model load)
#   single  the same prompt, 128 new tokens
#   prefill a ~1200-token prompt (the guide's request repeated), 1 new token: prompt processing
#   batch8  8 chat prompts x 64 new tokens: pagedlm runs them in one continuous batch,
#           llama-cpp-python (no continuous batching in its API) runs them one after another
# Each pair runs A (pagedlm) then B (llama.cpp), RUNS pairs after one warm-up pair; the ratio
# A/B is taken pair by pair and its median printed, with each engine's own tok/s (generation
# only, load excluded) parsed from its stderr.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PAGEDLM=${1:-$ROOT/build/pagedlm}
RUNS=${2:-5}
THREADS=${THREADS:-2}
PEER="$ROOT/scripts/llama_cpp_peer.py"
MODEL=$("$ROOT/scripts/fetch_model.sh")

python3 -c "import llama_cpp" 2>/dev/null || {
  echo "llama-cpp-python is missing: CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install llama-cpp-python" >&2
  exit 1
}
[[ -x "$PAGEDLM" ]] || { echo "no pagedlm binary at $PAGEDLM" >&2; exit 1; }

SINGLE_PROMPT="Write a detailed, step-by-step guide to planting and caring for a vegetable garden."
BATCH_PROMPTS=(
  "Explain how a refrigerator keeps food cold."
  "Write a short story about a lighthouse keeper and a storm."
  "What are the main causes of the French Revolution?"
  "Describe the water cycle for a ten-year-old."
  "Give me five tips for learning a new language."
  "How does a computer store numbers in memory?"
  "Write a poem about autumn leaves falling in a quiet park."
  "Compare cats and dogs as pets for a small apartment."
)

tokenize() { python3 "$PEER" tokenize --model "$MODEL" --chat --prompt "$1"; }

single_ids=$(tokenize "$SINGLE_PROMPT")
long_prompt=""
for _ in $(seq 60); do long_prompt+="$SINGLE_PROMPT "; done
long_ids=$(tokenize "$long_prompt")
batch_args=()
for p in "${BATCH_PROMPTS[@]}"; do batch_args+=(--tokens "$(tokenize "$p")"); done

echo "# $(date -u +%Y-%m-%d) commit $(git -C "$ROOT" rev-parse --short HEAD)," \
  "$(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
  "load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# model $MODEL; prompt: $(wc -w <<<"$single_ids") tokens; threads $THREADS"

echo "## agreement of greedy tokens (first 16, then 128)"
python3 "$PEER" check --model "$MODEL" --threads "$THREADS" --pagedlm "$PAGEDLM" \
  --tokens "$single_ids" --max-tokens 16 | tail -n +3
python3 "$PEER" check --model "$MODEL" --threads "$THREADS" --pagedlm "$PAGEDLM" \
  --tokens "$single_ids" --max-tokens 128 | tail -n +3

# Paired timing harness: argv = name, then A's argv, "--vs", B's argv.
paired() {
  python3 - "$RUNS" "$@" <<'PY'
import re, statistics, subprocess, sys, time
runs, name = int(sys.argv[1]), sys.argv[2]
rest = sys.argv[3:]
cut = rest.index("--vs")
cmds = {"pagedlm": rest[:cut], "llama.cpp": rest[cut + 1:]}
pat = re.compile(r"(\d+) tokens generated in ([\d.]+) s")

def once(argv):
    t = time.perf_counter()
    p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        sys.exit(f"{argv[0]} failed ({p.returncode}): {p.stderr[-2000:]}")
    m = pat.search(p.stderr)
    return wall, int(m.group(1)), float(m.group(2))

once(cmds["pagedlm"]); once(cmds["llama.cpp"])  # warm-up pair, not counted
res = {k: [] for k in cmds}
for _ in range(runs):
    for k in cmds:
        res[k].append(once(cmds[k]))
ratios = [a[0] / b[0] for a, b in zip(res["pagedlm"], res["llama.cpp"])]
med = statistics.median
print(f"## {name}: {runs} pairs")
for k, r in res.items():
    walls = [x[0] for x in r]
    toks = sorted({x[1] for x in r})
    rate = med(x[1] / x[2] for x in r)
    print(f"{k:10s} wall s min/median/max {min(walls):.2f} / {med(walls):.2f} / {max(walls):.2f}"
          f"; tokens {toks}; generation tok/s (median) {rate:.1f}")
print(f"wall ratio pagedlm/llama.cpp per pair: " + " ".join(f"{x:.2f}" for x in ratios)
      + f"; median {med(ratios):.2f}")
PY
}

P=("$PAGEDLM" generate --model "$MODEL" --threads "$THREADS" --device cpu)
L=(python3 "$PEER" generate --model "$MODEL" --threads "$THREADS")
paired load "${P[@]}" --tokens "$single_ids" --max-tokens 1 \
  --vs "${L[@]}" --tokens "$single_ids" --max-tokens 1
paired single "${P[@]}" --tokens "$single_ids" --max-tokens 128 \
  --vs "${L[@]}" --tokens "$single_ids" --max-tokens 128
paired batch8 "${P[@]}" "${batch_args[@]}" --max-tokens 64 \
  --vs "${L[@]}" "${batch_args[@]}" --max-tokens 64
echo "# prefill prompt: $(wc -w <<<"$long_ids") tokens"
paired prefill "${P[@]}" --tokens "$long_ids" --max-tokens 1 \
  --vs "${L[@]}" --tokens "$long_ids" --max-tokens 1
