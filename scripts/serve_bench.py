#!/usr/bin/env python3
"""Serving benchmark for an OpenAI-compatible server (`pagedlm serve`, or any other).

Requests arrive as a Poisson process (exponential inter-arrival times, seeded) at each given
rate; "inf" sends them all at once. Each is a streaming /v1/completions request whose prompt is
a list of random token ids (so no tokenizer is needed, and prompts never share a prefix), with
a fixed max_tokens and ignore_eos. Per rate it reports completed requests, duration, request
and output token throughput, time to first token (TTFT) and inter-token latency (ITL) p50/p99.

With --slow-clients / --idle-clients, another process holds that many hostile connections for
the whole run: slow ones drip a request head one byte per second, idle ones send nothing, and
any the server drops is reopened, so the measured clients' ITL can be compared with and without
them (slowloris).

Standard library only, so it runs on machines without our Python packages.

  python3 scripts/serve_bench.py --url http://127.0.0.1:8000 --rates 4,16,inf \\
      --num-requests 200 --prompt-min 100 --prompt-max 1024 --max-tokens 128 --json out.json
"""

import argparse
import http.client
import json
import math
import multiprocessing
import random
import resource
import socket
import sys
import threading
import time
import urllib.parse


def percentile(values, q):
    """The q-th percentile (0-100), interpolated linearly between order statistics."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class Result:
    """One request's timeline, in seconds of time.perf_counter()."""

    def __init__(self):
        self.send = None
        self.token_times = []  # one entry per chunk that carried output
        self.tokens = 0  # generated tokens (the server's usage count when it sends one)
        self.end = None
        self.error = None


def stream_completion(url, body, result, deadline, timeout):
    """Sends one streaming request and records when its output arrives."""
    conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout)
    try:
        result.send = time.perf_counter()
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            result.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return
        usage_tokens = None
        chunk_tokens = 0
        # SSE: `data: {json}` lines; blank lines and `: keep-alive` comments in between.
        for raw in resp:
            now = time.perf_counter()
            if now > deadline:
                result.error = "timed out (the run's deadline passed)"
                return
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                result.error = "stream error: " + event["error"].get("message", "")
                return
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
            n = 0
            for choice in event.get("choices", []):
                # A server without a tokenizer sends token ids; otherwise a chunk of text is at
                # least one token (the last chunk, with the finish reason, has no text).
                ids = choice.get("token_ids")
                n += len(ids) if ids is not None else (1 if choice.get("text") else 0)
            if n:
                result.token_times.append(now)
                chunk_tokens += n
        else:
            result.error = "stream ended without [DONE]"
            return
        result.end = time.perf_counter()
        result.tokens = usage_tokens if usage_tokens is not None else chunk_tokens
        if not result.token_times:
            result.error = "no output"
    except (OSError, http.client.HTTPException, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def make_requests(args, rate):
    """Seeded arrival offsets and bodies; a different seed per rate so runs share no prompts
    (a prefix cache would otherwise make later runs cheaper)."""
    rng = random.Random(f"{args.seed}/{rate}")
    t = 0.0
    out = []
    for _ in range(args.num_requests):
        if not math.isinf(rate):
            t += rng.expovariate(rate)
        length = rng.randint(args.prompt_min, args.prompt_max)
        prompt = [rng.randrange(args.min_token_id, args.max_token_id) for _ in range(length)]
        body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens,
                "temperature": args.temperature, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        out.append((0.0 if math.isinf(rate) else t, body))
    return out


def send_all(url, requests, start, deadline, timeout):
    """Sends each (offset, body) at start + offset on its own thread; returns their Results."""
    results = [Result() for _ in requests]
    threads = []
    for (offset, body), result in zip(requests, results):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if time.perf_counter() > deadline:
            break
        t = threading.Thread(target=stream_completion,
                             args=(url, body, result, deadline, timeout), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.perf_counter()) + timeout + 1)
    return results


def run_rate(args, url, rate):
    requests = make_requests(args, rate)
    if args.processes == 1:
        start = time.perf_counter()
        results = send_all(url, requests, start, start + args.max_duration, args.timeout)
    else:
        # One client process parses about 20k SSE events/s (the GIL), so at high rates the
        # requests are dealt round-robin to processes that share one schedule;
        # time.perf_counter() is the system's monotonic clock, the same in every process.
        start = time.perf_counter() + 0.5  # time for the workers to start
        jobs = [(url, requests[k::args.processes], start, start + args.max_duration,
                 args.timeout) for k in range(args.processes)]
        with multiprocessing.get_context("fork").Pool(args.processes) as pool:
            parts = pool.starmap(send_all, jobs)
        results = [r for part in parts for r in part]

    done = [r for r in results if r.end is not None and r.error is None]
    errors = [r.error or "not finished" for r in results if r not in done]
    sends = [r.send for r in results if r.send is not None]
    end = max((r.end for r in done), default=time.perf_counter())
    duration = end - min(sends) if sends else 0.0
    ttft = [r.token_times[0] - r.send for r in done]
    itl = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    tokens = sum(r.tokens for r in done)
    chunks = sum(len(r.token_times) for r in done)
    ms = 1000.0
    return {
        "rate": "inf" if math.isinf(rate) else rate,
        "requests": len(requests),
        "completed": len(done),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_tokens": tokens,
        "output_tok_s": tokens / duration if duration else 0.0,
        "tokens_per_chunk": tokens / chunks if chunks else 0.0,
        "output_tokens_min": min((r.tokens for r in done), default=0),
        "output_tokens_max": max((r.tokens for r in done), default=0),
        "ttft_ms_mean": ms * sum(ttft) / len(ttft) if ttft else float("nan"),
        "ttft_ms_p50": ms * percentile(ttft, 50),
        "ttft_ms_p99": ms * percentile(ttft, 99),
        "itl_ms_mean": ms * sum(itl) / len(itl) if itl else float("nan"),
        "itl_ms_p50": ms * percentile(itl, 50),
        "itl_ms_p99": ms * percentile(itl, 99),
    }


def hostile_clients(url, slow, idle, stop, counts):
    """Holds `slow` connections that drip a request head (one byte per connection per second)
    and `idle` ones that send nothing, reopening any the server closes, until `stop` is set.
    Runs in its own process, so its work does not slow the measured clients' reading."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10\r\n")

    def connect():
        try:
            s = socket.create_connection((url.hostname, url.port or 80), timeout=10)
            s.setblocking(False)
            return s
        except OSError:
            return None

    socks = [[connect(), 0, kind] for kind, n in (("slow", slow), ("idle", idle))
             for _ in range(n)]
    reopened = 0
    while not stop.is_set():
        round_start = time.perf_counter()
        for entry in socks:
            sock, sent, kind = entry
            try:
                if sock is None:
                    raise OSError
                if kind == "slow":
                    sock.send(head[sent % len(head):sent % len(head) + 1])
                    entry[1] = sent + 1
                elif sock.recv(1) == b"":  # an idle connection the server closed
                    raise OSError
            except BlockingIOError:
                pass
            except OSError:
                if sock is not None:
                    sock.close()
                entry[0], entry[1] = connect(), 0
                reopened += 1
        stop.wait(max(0.0, 1.0 - (time.perf_counter() - round_start)))
    counts.value = reopened
    for sock, _, _ in socks:
        if sock is not None:
            sock.close()


def get_json(url, path, timeout):
    conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def wait_ready(url, timeout):
    deadline = time.time() + timeout
    while True:
        try:
            if get_json(url, "/health", 5)[0] == 200:
                return
        except (OSError, http.client.HTTPException, ValueError):
            pass
        if time.time() > deadline:
            sys.exit(f"serve_bench: {url.geturl()} not healthy after {timeout}s")
        time.sleep(0.5)


def print_table(rows, header=True):
    head = (f"{'rate':>6} {'done':>9} {'err':>4} {'dur s':>7} {'req/s':>7} {'out tok/s':>10} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}  (ms)")
    if header:
        print(head)
    for r in rows:
        print(f"{str(r['rate']):>6} {r['completed']:>4}/{r['requests']:<4} {r['errors']:>4} "
              f"{r['duration_s']:>7.1f} {r['request_throughput']:>7.2f} {r['output_tok_s']:>10.0f} "
              f"{r['ttft_ms_p50']:>9.1f} {r['ttft_ms_p99']:>9.1f} {r['itl_ms_p50']:>8.2f} "
              f"{r['itl_ms_p99']:>8.2f}")
    sys.stdout.flush()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--model", default="", help="model id (default: the server's first model)")
    p.add_argument("--rates", default="4,16,inf",
                   help="comma-separated request rates in req/s; inf: all requests at once")
    p.add_argument("--num-requests", type=int, default=100, help="requests per rate")
    p.add_argument("--prompt-min", type=int, default=100, help="shortest prompt (tokens)")
    p.add_argument("--prompt-max", type=int, default=1024, help="longest prompt (tokens)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--min-token-id", type=int, default=100,
                   help="prompt ids are uniform in [min, max): below any special tokens' range")
    p.add_argument("--max-token-id", type=int, default=10000)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--processes", type=int, default=1,
                   help="client processes (each with a thread per request): more for high rates")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests first")
    p.add_argument("--timeout", type=float, default=60,
                   help="socket timeout per request (s); the server's keep-alives reset it")
    p.add_argument("--max-duration", type=float, default=300,
                   help="bound on one rate's run (s); requests unfinished by then are errors")
    p.add_argument("--wait-ready", type=float, default=0,
                   help="first wait up to this long (s) for GET /health to answer 200")
    p.add_argument("--slow-clients", type=int, default=0,
                   help="connections that drip a request head a byte per second (slowloris)")
    p.add_argument("--idle-clients", type=int, default=0,
                   help="connections that send nothing")
    p.add_argument("--json", default="", help="write the results (and settings) here")
    args = p.parse_args()
    if not 1 <= args.prompt_min <= args.prompt_max:
        p.error("need 1 <= --prompt-min <= --prompt-max")

    url = urllib.parse.urlsplit(args.url)
    if args.wait_ready:
        wait_ready(url, args.wait_ready)
    if not args.model:
        try:
            status, models = get_json(url, "/v1/models", args.timeout)
        except OSError as e:
            sys.exit(f"serve_bench: no server answers at {args.url} ({e}): start one first, e.g. "
                     "build/pagedlm serve --port 8000, or give --wait-ready SECONDS")
        if status != 200 or not models.get("data"):
            sys.exit(f"serve_bench: GET /v1/models answered {status}: {models}")
        args.model = models["data"][0]["id"]
    rates = [float(r) for r in args.rates.split(",")]

    if args.warmup:
        warm = argparse.Namespace(**{**vars(args), "num_requests": args.warmup,
                                     "seed": args.seed + 1_000_003})
        r = run_rate(warm, url, math.inf)
        if r["errors"]:
            sys.exit(f"serve_bench: warmup failed: {r['error_examples']}")

    hostile = None
    if args.slow_clients or args.idle_clients:
        ctx = multiprocessing.get_context("fork")
        stop, reopened = ctx.Event(), ctx.Value("q", 0)
        hostile = ctx.Process(target=hostile_clients,
                              args=(url, args.slow_clients, args.idle_clients, stop, reopened))
        hostile.start()
        time.sleep(5)  # every hostile connection is open and dripping
    rows = []
    try:
        for rate in rates:
            rows.append(run_rate(args, url, rate))
            print_table(rows[-1:], header=len(rows) == 1)  # progress; the full table comes last
            for e in rows[-1]["error_examples"]:
                print("  error:", e)
    finally:
        if hostile is not None:
            stop.set()
            hostile.join()
            print(f"hostile: {args.slow_clients} slow and {args.idle_clients} idle connections "
                  f"held, {reopened.value} reopened after the server closed them")
    print()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "results": rows}, f, indent=2)
    return 1 if any(r["completed"] == 0 for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
