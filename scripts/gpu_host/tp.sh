#!/usr/bin/env bash
# Tensor parallelism on a host with 2 GPUs (H200), everything the issue asks for in one run:
#   1. every golden fixture at 2 ranks against 1 rank on the GPU (tp_fixtures.py: bf16 logits,
#      greedy tokens, CUDA graphs on);
#   2. Llama-3.1-70B's shape (random bf16 weights, configs/llama-3.1-70b.json) at 2 ranks on the
#      random and shared-prefix workloads: output tok/s and the fraction of the 2-GPU bound;
#   3. Llama-3.1-8B at 1 and 2 ranks in the same run (throughput, TTFT, ITL);
#   4. the decode step's all-reduce time, from an nsys profile of an 8B 2-rank run (skipped
#      when nsys is missing).
# Logs and JSON go to OUT_DIR; a table is printed last.
#   scripts/gpu_host/tp.sh OUT_DIR
# Needs: build-gpu/pagedlm from scripts/gpu_host/build.sh with NCCL found (PAGEDLM overrides),
# numpy, 2 GPUs. The 70B runs hold ~70 GB of bf16 weights per GPU and, while loading, ~70 GB of
# host memory per rank.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: tp.sh OUT_DIR}
mkdir -p "$out"
bin=${PAGEDLM:-build-gpu/pagedlm}
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[[ $gpus -ge 2 ]] || { echo "needs 2 GPUs, found $gpus" >&2; exit 1; }
nvidia-smi -L >"$out/gpus.txt"
git log -1 --format='%H %cd' >"$out/commit.txt" 2>/dev/null || true

echo "== 0. smoke: a fixture at 2 ranks"
timeout 300 "$bin" generate --model testdata/fixtures/llama-gqa --tokens "1 2 3" --max-tokens 8 \
  --device cuda --tensor-parallel-size 2 >"$out/smoke.txt" 2>&1
echo "exit $? ($(grep '^tokens:' "$out/smoke.txt" | tail -1))"

echo "== 1. fixtures, 2 ranks against 1"
timeout 1800 python3 scripts/gpu_host/tp_fixtures.py --pagedlm "$bin" 2>&1 | tee "$out/fixtures.txt"

bench() {  # NAME CONFIG TP WORKLOAD [more flags]
  local name=$1 config=$2 tp=$3 workload=$4
  shift 4
  local args=(--dummy "configs/$config.json" --workload "$workload")
  if [[ $workload == shared-prefix ]]; then
    args+=(--num-requests 128 --prefix-len 2000 --unique-len 32 --output-min 64 --output-max 64)
  fi
  echo "-- $name"
  timeout 1800 "$bin" bench --device cuda --json --tensor-parallel-size "$tp" "${args[@]}" "$@" \
    >"$out/$name.json" 2>"$out/$name.err" || echo "$name failed: $(tail -3 "$out/$name.err")"
}

echo "== 2. Llama-3.1-70B shape at 2 ranks"
bench 70b-tp2-random llama-3.1-70b 2 random
bench 70b-tp2-shared-prefix llama-3.1-70b 2 shared-prefix

echo "== 3. Llama-3.1-8B at 1 and 2 ranks"
bench 8b-tp1-random llama-3.1-8b 1 random
bench 8b-tp2-random llama-3.1-8b 2 random
bench 8b-tp1-shared-prefix llama-3.1-8b 1 shared-prefix
bench 8b-tp2-shared-prefix llama-3.1-8b 2 shared-prefix

echo "== 4. decode-step all-reduce time (8B, 2 ranks, decode-heavy)"
if command -v nsys >/dev/null; then
  timeout 1200 nsys profile --trace=cuda,nvtx --cuda-graph-trace=node --trace-fork-before-exec=true \
    -o "$out/8b-tp2-nsys" --force-overwrite true \
    "$bin" bench --device cuda --json --tensor-parallel-size 2 --dummy configs/llama-3.1-8b.json \
    --workload random --num-requests 64 --output-min 256 --output-max 256 \
    >"$out/8b-tp2-nsys.json" 2>"$out/8b-tp2-nsys.err"
  nsys stats --report cuda_gpu_kern_sum --format csv "$out/8b-tp2-nsys.nsys-rep" \
    >"$out/8b-tp2-kernels.csv" 2>/dev/null || true
else
  echo "nsys not found: no all-reduce time" | tee "$out/8b-tp2-kernels.csv"
fi

python3 - "$out" <<'PY'
import csv, glob, json, os, sys
out = sys.argv[1]
print()
print(open(os.path.join(out, "fixtures.txt")).read().strip().splitlines()[-1]
      if os.path.exists(os.path.join(out, "fixtures.txt")) else "fixtures: no output")
print(f"{'run':24} {'out tok/s':>10} {'bound':>7} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} "
      f"{'ITL p99 ms':>11} {'decode ms/step':>15}")
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    try:
        r = json.load(open(path))
    except ValueError:
        continue
    steps = r.get("decode_steps") or 0
    per = 1e3 * r["decode_s"] / steps if steps else float("nan")
    print(f"{os.path.basename(path)[:-5]:24} {r['output_tok_s']:10.0f} {100 * r['bound_fraction']:6.1f}% "
          f"{r['ttft_p50_ms']:12.1f} {r['itl_p50_ms']:11.2f} {r['itl_p99_ms']:11.2f} {per:15.3f}")
kern = os.path.join(out, "8b-tp2-kernels.csv")
rows = []
try:
    rows = [row for row in csv.DictReader(open(kern)) if "nccl" in row.get("Name", "").lower()]
except (OSError, csv.Error):
    pass
if rows:
    total_ns = sum(float(r["Total Time (ns)"]) for r in rows)
    calls = sum(int(r["Instances"]) for r in rows)
    prof = json.load(open(os.path.join(out, "8b-tp2-nsys.json")))
    steps = prof.get("decode_steps") or 1
    print(f"NCCL kernels (8B, 2 ranks, both ranks' GPUs, whole run incl. prefill): {calls} calls, "
          f"{total_ns / 1e6:.1f} ms, {total_ns / calls / 1e3:.1f} us a call; "
          f"{prof['decode_steps']} decode steps, {total_ns / 2 / steps / 1e6:.3f} ms a step and rank "
          f"(upper bound for the decode step's all-reduces: prefill steps included)")
else:
    print("NCCL kernel time: not measured (see 8b-tp2-kernels.csv)")
PY
