#!/usr/bin/env bash
# docs/PERF.md's benchmark table on a GPU host: `pagedlm bench` with random weights of each config
# named, on the random (256 x 100-1024 -> 256) and shared-prefix (128 x (2000 + 32) -> 64)
# workloads, one JSON per run in OUT_DIR and a summary table last. WORKLOADS may also name the
# long-context rows, long-32k (8 x 32768 -> 256) and long-120k (2 x 120000 -> 256), random
# prompts warmed up by one request of their length (a config whose context holds them).
#   scripts/gpu_host/bench.sh OUT_DIR smollm2-135m [qwen3-0.6b llama-3.1-8b ...]
# Env: PAGEDLM (binary, default build-gpu/pagedlm), REPEAT (runs of each, default 1),
# WORKLOADS (default "random shared-prefix"), FLAGS (more bench flags), TAG (name suffix).
# FLAGS="--repeat 3" times three runs in one process (one start-up: worth it for large models)
# and reports the median run.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: bench.sh OUT_DIR CONFIG...}
shift
bin=${PAGEDLM:-build-gpu/pagedlm}
mkdir -p "$out"
for model in "$@"; do
  for workload in ${WORKLOADS:-random shared-prefix}; do
    case $workload in
      shared-prefix)
        args=(--dummy "configs/$model.json" --workload shared-prefix --num-requests 128
          --prefix-len 2000 --unique-len 32 --output-min 64 --output-max 64) ;;
      long-32k | long-120k)
        n=8 len=32768
        [[ $workload == long-120k ]] && n=2 len=120000
        args=(--dummy "configs/$model.json" --workload random --num-requests "$n"
          --prompt-min "$len" --prompt-max "$len" --warmup 1) ;;
      *) args=(--dummy "configs/$model.json" --workload "$workload") ;;
    esac
    for ((i = 1; i <= ${REPEAT:-1}; i++)); do
      name="$model-$workload${TAG:+-$TAG}-$i"
      # shellcheck disable=SC2086  # FLAGS is a list of flags
      "$bin" bench --device cuda --json "${args[@]}" ${FLAGS:-} >"$out/$name.json" \
        2>"$out/$name.err" || echo "$name failed: $(tail -1 "$out/$name.err")"
    done
  done
done
python3 - "$out" <<'PY'
import glob, json, os, sys
print(f"{'run':44} {'out tok/s':>10} {'bound':>6} {'decode GB/s':>11} {'TTFT p50':>9} {'ITL p50':>8} {'wall s':>7} {'decode s':>8} {'device':>7} {'prefill s':>9} {'device':>7}")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    try:
        r = json.load(open(path))
    except ValueError:
        continue
    print(f"{os.path.basename(path)[:-5]:44} {r['output_tok_s']:10.0f} {100 * r['bound_fraction']:5.1f}% "
          f"{r['decode_bytes_per_s'] / 1e9:11.0f} {r['ttft_p50_ms']:9.1f} {r['itl_p50_ms']:8.2f} {r['wall_s']:7.3f}"
          f" {r['decode_s']:8.3f} {r['decode_gpu_s']:7.3f} {r['wall_s'] - r['decode_s']:9.3f}"
          f" {r.get('gpu_s', 0) - r['decode_gpu_s']:7.3f}")
    h = r.get("decode_host")
    if h and r["decode_steps"]:
        per = 1e3 / r["decode_steps"]
        loop = r["decode_s"] - sum(h.values())
        print(f"{'  decode host ms/step':44} schedule {h['schedule_s'] * per:.3f}, prepare {h['prepare_s'] * per:.3f}"
              f" (launch {r.get('decode_launch_s', 0) * per:.3f}), wait {h['wait_s'] * per:.3f},"
              f" finish {h['finish_s'] * per:.3f}, bench loop {loop * per:.3f}")
    if len(r.get("repeat_output_tok_s", [])) > 1:
        print(f"{'  (median of --repeat runs)':44} " + " ".join(f"{v:.0f}" for v in r["repeat_output_tok_s"]))
PY
