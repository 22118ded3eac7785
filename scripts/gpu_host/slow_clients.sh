#!/usr/bin/env bash
# The slow-clients measurement of the server's front end: 256 streaming clients (all at once,
# token-id prompts of 100-1024, 128 tokens each) against `pagedlm serve --dummy` on the GPU,
# without hostile connections, with 5,000 connections dripping a request head a byte per second
# plus 1,000 idle ones (scripts/serve_bench.py --slow-clients / --idle-clients), and without
# again (the run-to-run spread). Passes when the loaded run's ITL p99 is within 1.5x of the
# slower unloaded one. One JSON per run in OUT_DIR.
#   scripts/gpu_host/slow_clients.sh OUT_DIR
# Env: PAGEDLM (binary, default build-gpu/pagedlm), CONFIG (default configs/smollm2-135m.json),
# DEVICE (default cuda).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: slow_clients.sh OUT_DIR}
mkdir -p "$out"
bin=${PAGEDLM:-build-gpu/pagedlm}
port=8127
ulimit -n "$(ulimit -Hn)"  # 6,000 hostile connections on each side
"$bin" serve --dummy "${CONFIG:-configs/smollm2-135m.json}" --device "${DEVICE:-cuda}" \
  --port $port --max-waiting 2048 --max-connections-per-client 10000 2>"$out/serve.err" &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
bench=(python3 scripts/serve_bench.py --url "http://127.0.0.1:$port" --wait-ready 300 --rates inf
       --num-requests 256 --prompt-min 100 --prompt-max 1024 --max-tokens 128 --processes 8
       --timeout 120 --max-duration 120)
# A new seed per run: the same prompts again would be served from the prefix cache.
"${bench[@]}" --seed 1 --json "$out/unloaded.json"
"${bench[@]}" --seed 2 --slow-clients 5000 --idle-clients 1000 --json "$out/loaded.json"
"${bench[@]}" --seed 3 --json "$out/unloaded-again.json"
python3 - "$out" <<'PY'
import json, os, sys
r = {n: json.load(open(os.path.join(sys.argv[1], n + ".json")))["results"][0]
     for n in ("unloaded", "loaded", "unloaded-again")}
for n, row in r.items():
    print(f"{n:16} done {row['completed']}/{row['requests']}  ITL p50 {row['itl_ms_p50']:.2f} ms"
          f"  p99 {row['itl_ms_p99']:.2f} ms  TTFT p99 {row['ttft_ms_p99']:.1f} ms")
base = max(r["unloaded"]["itl_ms_p99"], r["unloaded-again"]["itl_ms_p99"])
ratio = r["loaded"]["itl_ms_p99"] / base
ok = ratio <= 1.5 and all(row["errors"] == 0 for row in r.values())
print(f"loaded ITL p99 / unloaded: {ratio:.2f} (bound 1.5): {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
