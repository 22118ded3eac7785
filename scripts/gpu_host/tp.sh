#!/usr/bin/env bash
# Tensor parallelism on a host with 2 GPUs (H200), every tensor-parallel measurement in one run:
#   1. every golden fixture at 2 ranks against 1 rank on the GPU (tp_fixtures.py: bf16 logits,
#      greedy tokens, CUDA graphs on), and the failure cases (tp_failures.py);
#   2. Llama-3.1-70B's shape (random bf16 weights, configs/llama-3.1-70b.json) at 2 ranks on the
#      random and shared-prefix workloads: output tok/s and the fraction of the 2-GPU bound;
#   3. Llama-3.1-8B at 1 and 2 ranks in the same run (throughput, TTFT, ITL), and HF
#      transformers' own tensor parallelism (hf_peer.py --tp) on 64 of the random requests;
#   4. the decode step's all-reduce time, from an nsys profile of an 8B 2-rank run (skipped
#      when nsys is missing).
# Logs and JSON go to OUT_DIR; a table is printed last.
#   scripts/gpu_host/tp.sh OUT_DIR [--share-gpu]
# --share-gpu is for a host with one GPU: every rank runs on GPU 0, started by hand with its own
# NCCL_HOSTID so that NCCL joins them over loopback sockets (tp_fixtures.py says why). It checks
# the same code end to end, fixtures at 2 and 4 ranks, and leaves out what such a run cannot
# show: the 70B shape (two ranks' 70 GB do not fit one GPU's memory with a KV cache) and every
# speed figure (the ranks take turns on one GPU and their all-reduces go through host sockets).
# Needs: build-gpu/pagedlm from scripts/gpu_host/build.sh with NCCL found (PAGEDLM overrides),
# numpy, 2 GPUs. The 70B runs hold ~70 GB of bf16 weights per GPU and, while loading, ~70 GB of
# host memory per rank.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: tp.sh OUT_DIR [--share-gpu]}
share=${2:-}
mkdir -p "$out"
bin=${PAGEDLM:-build-gpu/pagedlm}
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[[ $gpus -ge 2 || $share == --share-gpu ]] || { echo "needs 2 GPUs, found $gpus" >&2; exit 1; }
nvidia-smi -L >"$out/gpus.txt"
git log -1 --format='%H %cd' >"$out/commit.txt" 2>/dev/null || true

# run_group TP NAME CMD...: CMD at TP ranks, rank 0's stdout to stdout. With --share-gpu ranks
# 1..TP-1 are started here on GPU 0 (their stderr in OUT_DIR/NAME.rankR.err), each KV cache
# taking a share of the GPU's memory; otherwise rank 0 starts them itself, one per GPU.
run_group() {
  local tp=$1 name=$2
  shift 2
  if [[ $share != --share-gpu || $tp == 1 ]]; then
    "$@" --tensor-parallel-size "$tp"
    return
  fi
  local endpoint=127.0.0.1:$((20000 + RANDOM % 20000)) r rc
  local fraction=$(python3 -c "print(round(0.6 / $tp, 3))")
  for ((r = tp - 1; r >= 0; r--)); do
    local args=(--tensor-parallel-size "$tp" --tensor-parallel-rank "$r"
      --tensor-parallel-endpoint "$endpoint" --tensor-parallel-device 0
      --gpu-memory-fraction "$fraction")
    if [[ $r -gt 0 ]]; then
      NCCL_HOSTID=pagedlm-shared-gpu-rank$r NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 \
        "$@" "${args[@]}" >/dev/null 2>"$out/$name.rank$r.err" &
    else
      NCCL_HOSTID=pagedlm-shared-gpu-rank0 NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 \
        "$@" "${args[@]}"
      rc=$?
    fi
  done
  wait
  return $rc
}
export -f run_group
export share out

echo "== 0. smoke: a fixture at 2 ranks"
timeout 300 bash -c 'run_group "$@"' run_group 2 smoke "$bin" generate \
  --model testdata/fixtures/llama-gqa --tokens "1 2 3" --max-tokens 8 --device cuda \
  >"$out/smoke.txt" 2>&1
echo "exit $? ($(grep '^tokens:' "$out/smoke.txt" | tail -1))"

if [[ ${SKIP_FIXTURES:-} != 1 ]]; then  # SKIP_FIXTURES=1: the benchmarks only
  echo "== 1. fixtures, 2 ranks against 1; failures"
  sizes=2
  [[ $share == --share-gpu ]] && sizes=2,4
  timeout 1800 python3 scripts/gpu_host/tp_fixtures.py --pagedlm "$bin" --sizes $sizes $share \
    2>&1 | tee "$out/fixtures.txt"
  timeout 900 python3 scripts/gpu_host/tp_failures.py --pagedlm "$bin" $share 2>&1 |
    tee "$out/failures.txt"
fi

bench() {  # NAME CONFIG TP WORKLOAD [more flags]
  local name=$1 config=$2 tp=$3 workload=$4
  shift 4
  local args=(--dummy "configs/$config.json" --workload "$workload")
  if [[ $workload == shared-prefix ]]; then
    args+=(--num-requests 128 --prefix-len 2000 --unique-len 32 --output-min 64 --output-max 64)
  fi
  echo "-- $name"
  timeout 1800 bash -c 'run_group "$@"' run_group "$tp" "$name" "$bin" bench --device cuda \
    --json "${args[@]}" "$@" \
    >"$out/$name.json" 2>"$out/$name.err" || echo "$name failed: $(tail -3 "$out/$name.err")"
}

if [[ $share != --share-gpu ]]; then
  echo "== 2. Llama-3.1-70B shape at 2 ranks"
  bench 70b-tp2-random llama-3.1-70b 2 random
  bench 70b-tp2-shared-prefix llama-3.1-70b 2 shared-prefix
fi

echo "== 3. Llama-3.1-8B at 1 and 2 ranks"
bench 8b-tp1-random llama-3.1-8b 1 random
bench 8b-tp2-random llama-3.1-8b 2 random
bench 8b-tp1-shared-prefix llama-3.1-8b 1 shared-prefix
bench 8b-tp2-shared-prefix llama-3.1-8b 2 shared-prefix
if [[ $share != --share-gpu ]]; then
  echo "-- peer: HF transformers' tensor parallelism (tp_plan=auto), 8B, 2 ranks, 64 requests"
  bench 8b-tp2-random-64 llama-3.1-8b 2 random --num-requests 64
  timeout 1800 python3 -m torch.distributed.run --nproc-per-node 2 scripts/gpu_host/hf_peer.py \
    configs/llama-3.1-8b.json --tp --num-requests 64 --padded >"$out/hf-8b-tp2.jsonl" \
    2>"$out/hf-8b-tp2.err" || echo "HF peer failed: $(tail -3 "$out/hf-8b-tp2.err")"
  grep '^{' "$out/hf-8b-tp2.jsonl"
fi

echo "== 4. decode-step all-reduce time (8B, 2 ranks, decode-heavy)"
if [[ $share == --share-gpu ]]; then
  echo "one GPU: the all-reduces go through host sockets, no time to show" |
    tee "$out/8b-tp2-kernels.csv"
elif command -v nsys >/dev/null; then
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

python3 - "$out" "$share" <<'PY'
import csv, glob, json, os, sys
out = sys.argv[1]
print()
if sys.argv[2] == "--share-gpu":
    print("ranks sharing one GPU: the speeds below are no measure of tensor parallelism")
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
