#!/usr/bin/env python3
"""CPU side-by-side of pagedlm and llama.cpp on the same GGUF with the same thread count: the
table of docs/PERF.md, "CPU: pagedlm vs llama.cpp". Run through scripts/cpu_peer_bench.sh.

Rows (every row: one warm-up pair, then --pairs pairs, pagedlm then llama.cpp, each run a fresh
process; times exclude the model load on both sides):
  prefill N   a prompt of N tokens, 1 new token: prompt tokens / time to the first token.
              pagedlm: `pagedlm bench --json` (random workload, one request, no warm-up
              request), its TTFT. llama.cpp: one llama_decode stream over the prompt's ids.
  decode      one stream, a 60-token prompt, 128 new tokens: tok/s of the decode steps alone
              (127 steps after the token that the prompt's logits give). pagedlm: `pagedlm
              bench --json`, decode_steps / decode_s, after one untimed warm-up request of the
              same lengths; llama.cpp likewise after one untimed warm-up of the same shape.
  batch K     K prompts of 60 tokens, 64 new tokens each, all in one batch: generated tokens /
              time from the first prompt token to the last new one. pagedlm: `pagedlm bench
              --json` output_tok_s with K untimed warm-up requests; llama.cpp: its batched API
              (one llama_decode per step with a token of every sequence) after one untimed
              warm-up of the same shape.
Both engines decode greedily and never stop at EOS. The prompts' token ids differ between the
engines (pagedlm bench draws random ids; llama.cpp gets ids of English text), which a dense
model's speed does not depend on; the lengths are the same.

Derived figures:
  GFLOP/s (prefill)  2 x the layers' matrix parameters x N + 2 x the output head's parameters
                     (one position) + causal attention 4 x layers x heads x head_dim x
                     N(N+1)/2 (q.k and p.v, the masked half not counted); norms, RoPE and
                     activations not counted.
  GB/s (decode)      bytes of the weights one step reads (every tensor in the GGUF, the token
                     embedding only when it is also the output head) x steps / time; the K/V
                     reads (a few MB at these lengths) are not counted. Set against the copy
                     bandwidth that bench/copy_bandwidth.c measures with the same thread count
                     on buffers far larger than the caches (before and after the rows).
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_peer_common  # noqa: E402

ROOT = cpu_peer_common.ROOT
PEER = os.path.join(ROOT, "scripts", "llama_cpp_peer.py")
PROMPT_LEN = 60  # the decode and batch rows' prompt length


def fail(msg):
    sys.exit(f"cpu_peer_bench: {msg}")


def check_python_deps():
    missing = []
    for mod in ("numpy", "gguf", "llama_cpp"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        fail(
            f"missing Python packages: {', '.join(missing)}. Install the pinned peer (builds "
            "llama.cpp from source, several minutes on 2 cores):\n" + cpu_peer_common.LLAMA_CPP_INSTALL
        )


def run(argv, what, timeout=3600):
    return cpu_peer_common.run(argv, what, fail, timeout)


def last_json(text, what):
    """The last JSON object in `text` that starts a line (one line or pretty-printed)."""
    decoder = json.JSONDecoder()
    starts = [i for i in range(len(text)) if text[i] == "{" and (i == 0 or text[i - 1] == "\n")]
    for i in reversed(starts):
        try:
            return decoder.raw_decode(text, i)[0]
        except json.JSONDecodeError:
            continue
    fail(f"{what} printed no JSON result:\n{text[-2000:]}")


# --- the machine -------------------------------------------------------------------------------


def build_probe(build_dir):
    src = os.path.join(ROOT, "bench", "copy_bandwidth.c")
    exe = os.path.join(build_dir, "copy_bandwidth")
    if not os.path.exists(exe) or os.path.getmtime(exe) < os.path.getmtime(src):
        os.makedirs(build_dir, exist_ok=True)
        cc = os.environ.get("CC", "cc")
        run([cc, "-O3", "-march=native", "-fopenmp", src, "-o", exe],
            f"compiling the bandwidth probe with {cc} (apt-get install gcc)")
    return exe


def probe_bandwidth(exe, threads, mib):
    return last_json(run([exe, str(threads), str(mib)], "the bandwidth probe"), "probe")


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


# --- the model ---------------------------------------------------------------------------------


class ModelFacts:
    """Sizes read from the GGUF with the gguf package (the format's reference reader)."""

    def __init__(self, path):
        from gguf import GGUFReader

        r = GGUFReader(path)
        arch = self._field(r, "general.architecture")
        self.n_layer = int(self._field(r, f"{arch}.block_count"))
        self.n_embd = int(self._field(r, f"{arch}.embedding_length"))
        self.n_head = int(self._field(r, f"{arch}.attention.head_count"))
        kl = self._field(r, f"{arch}.attention.key_length", None)
        self.head_dim = int(kl) if kl is not None else self.n_embd // self.n_head
        names = {t.name: t for t in r.tensors}
        emb = names.get("token_embd.weight")
        head = names.get("output.weight", emb)
        if head is None:
            fail(f"{path} has neither output.weight nor token_embd.weight")
        self.head_params = int(head.n_elements)
        self.layer_params = sum(
            int(t.n_elements) for t in r.tensors
            if t.name.startswith("blk.") and len([d for d in t.shape if d > 1]) >= 2
        )
        # Every tensor is read once per decode step, except the token embedding when a separate
        # output head exists (then a step reads one row of it).
        self.step_bytes = sum(int(t.n_bytes) for t in r.tensors)
        if "output.weight" in names and emb is not None:
            self.step_bytes -= int(emb.n_bytes)

    @staticmethod
    def _field(reader, key, default=KeyError):
        f = reader.fields.get(key)
        if f is None:
            if default is KeyError:
                fail(f"the GGUF has no {key}")
            return default
        v = f.parts[f.data[0]]
        if f.types and f.types[0].name == "STRING":
            return bytes(v).decode("utf-8")
        return v[0]

    def prefill_flops(self, n):
        attn = 4 * self.n_layer * self.n_head * self.head_dim * n * (n + 1) / 2
        return 2 * self.layer_params * n + 2 * self.head_params + attn


def text_ids(model, n):
    """n token ids of English text (the repository's own docs), from llama.cpp's tokenizer."""
    text = ""
    for rel in ("docs/ARCHITECTURE.md", "README.md", "docs/PERF.md"):
        try:
            with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                text += f.read() + "\n"
        except OSError:
            pass
    if not text:
        fail("no docs to take prompt text from")
    # Through a file: the docs together are past the kernel's 128 KiB limit on one argument.
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt") as f:
        f.write(text)
        f.flush()
        out = run([sys.executable, PEER, "tokenize", "--model", model, "--prompt-file", f.name],
                  "tokenizing the prompt text")
    ids = [int(t) for t in out.split()]
    while len(ids) < n:
        ids += ids
    return ids[:n]


# --- the rows ----------------------------------------------------------------------------------


class Row:
    def __init__(self, label, unit, a_argv, b_argv, a_rate, b_rate, extra=None):
        self.label, self.unit = label, unit
        self.a_argv, self.b_argv = a_argv, b_argv
        self.a_rate, self.b_rate = a_rate, b_rate  # stdout -> rate (higher is better)
        self.extra = extra  # rate -> text (GFLOP/s, GB/s)
        self.a, self.b = [], []

    def once(self, side):
        argv, rate, store = ((self.a_argv, self.a_rate, self.a) if side == "a"
                             else (self.b_argv, self.b_rate, self.b))
        value = rate(run(argv, f"{self.label} ({'pagedlm' if side == 'a' else 'llama.cpp'})"))
        store.append(value)
        return value


def pagedlm_bench(args, *, prompt, output, requests, warmup):
    return [args.pagedlm, "bench", "--model", args.model, "--device", "cpu",
            "--threads", str(args.threads), "--workload", "random", "--json",
            "--num-requests", str(requests), "--prompt-min", str(prompt),
            "--prompt-max", str(prompt), "--output-min", str(output),
            "--output-max", str(output), "--warmup", str(warmup)] + args.pagedlm_args


def peer(args, sub, *rest):
    return [sys.executable, PEER, sub, "--model", args.model, "--threads", str(args.threads),
            *rest]


def build_rows(args, facts, ids):
    rows = []
    for n in args.prefill:
        def a_rate(out, n=n):
            j = last_json(out, "pagedlm bench")
            return n / (j["ttft_p50_ms"] / 1e3)

        def b_rate(out):
            j = last_json(out, "llama.cpp prefill")
            return j["prompt_tokens"] / j["seconds"]

        def gflops(rate, n=n):
            return f"{facts.prefill_flops(n) / (n / rate) / 1e9:.1f} GFLOP/s"

        rows.append(Row(
            f"prefill, {n}-token prompt, 1 new token", "prompt tok/s",
            pagedlm_bench(args, prompt=n, output=1, requests=1, warmup=0),
            peer(args, "prefill", "--tokens", " ".join(map(str, ids[:n]))),
            a_rate, b_rate, gflops))

    if args.decode:
        d = args.decode

        def a_dec(out):
            j = last_json(out, "pagedlm bench")
            if j["decode_steps"] != d - 1:
                fail(f"pagedlm bench ran {j['decode_steps']} decode steps, not {d - 1}")
            return j["decode_steps"] / j["decode_s"]

        def b_dec(out):
            j = last_json(out, "llama.cpp decode")
            return j["decode_steps"] / j["seconds"]

        def gbs(rate):
            bw = facts.step_bytes * rate / 1e9
            return f"{bw:.2f} GB/s"

        rows.append(Row(
            f"one stream decoding {d} tokens ({PROMPT_LEN}-token prompt)", "decode tok/s",
            pagedlm_bench(args, prompt=PROMPT_LEN, output=d, requests=1, warmup=1),
            peer(args, "decode", "--warmup", "--max-tokens", str(d),
                 "--tokens", " ".join(map(str, ids[:PROMPT_LEN]))),
            a_dec, b_dec, gbs))

    for k in args.batch:
        prompts = []
        for i in range(k):
            chunk = ids[(i * PROMPT_LEN) % (len(ids) - PROMPT_LEN):][:PROMPT_LEN]
            prompts += ["--tokens", " ".join(map(str, chunk))]

        def a_bat(out, k=k):
            j = last_json(out, "pagedlm bench")
            if j["generated_tokens"] != k * args.batch_tokens:
                fail(f"pagedlm bench generated {j['generated_tokens']} tokens, "
                     f"not {k * args.batch_tokens}")
            return j["output_tok_s"]

        def b_bat(out):
            j = last_json(out, "llama.cpp batch")
            return j["generated"] / j["seconds"]

        rows.append(Row(
            f"{k} parallel prompts ({PROMPT_LEN} -> {args.batch_tokens} tokens each)",
            "generated tok/s",
            pagedlm_bench(args, prompt=PROMPT_LEN, output=args.batch_tokens, requests=k,
                          warmup=k),
            peer(args, "batch", "--warmup", "--max-tokens", str(args.batch_tokens), *prompts),
            a_bat, b_bat))
    return rows


def spread(xs, fmt):
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pagedlm", default=os.path.join(ROOT, "build", "pagedlm"),
                    help="the pagedlm binary (default: build/pagedlm)")
    ap.add_argument("--model", default=None, help="GGUF (default: scripts/fetch_model.sh's)")
    ap.add_argument("--threads", type=int, default=2, help="threads on both sides (default 2)")
    ap.add_argument("--pairs", type=int, default=5, help="counted pairs per row (default 5)")
    ap.add_argument("--prefill", default="125,500,1000,4000",
                    help="prompt lengths of the prefill rows (comma-separated; '' for none)")
    ap.add_argument("--decode", type=int, default=128,
                    help="tokens of the single-stream row (0: no such row)")
    ap.add_argument("--batch", default="8,32", help="parallel prompts of the batch rows")
    ap.add_argument("--batch-tokens", type=int, default=64, help="new tokens per batch prompt")
    ap.add_argument("--pagedlm-args", default="",
                    help='extra arguments for pagedlm, e.g. "--cpu-q8-activations"')
    ap.add_argument("--probe-mib", type=int, default=1024,
                    help="MiB per buffer of the bandwidth probe (default 1024)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1 pair, no warm-up pair, prefill 125, decode 32, batch 8 x 16")
    ap.add_argument("--output", help="also write the markdown to this file")
    # "--pagedlm-args --cpu-q8-activations": argparse would read the value as an option.
    argv, rest = [], sys.argv[1:]
    while rest:
        a = rest.pop(0)
        argv.append(f"{a}={rest.pop(0)}" if a == "--pagedlm-args" and rest else a)
    args = ap.parse_args(argv)

    if args.quick:
        args.pairs, args.prefill, args.decode, args.batch, args.batch_tokens = 1, "125", 32, "8", 16
    try:
        args.prefill = [int(x) for x in args.prefill.split(",") if x.strip()]
        args.batch = [int(x) for x in args.batch.split(",") if x.strip()]
    except ValueError:
        fail("--prefill and --batch take comma-separated whole numbers")
    if args.threads < 1 or args.pairs < 1:
        fail("--threads and --pairs must be at least 1")
    if any(n < 1 or n > 8000 for n in args.prefill):
        fail("prefill lengths must lie in 1..8000 (the default model's context is 8192)")
    if args.decode == 1 or args.decode < 0 or any(k < 1 for k in args.batch) or args.batch_tokens < 1:
        fail("--decode must be 0 or at least 2; --batch sizes and --batch-tokens at least 1")
    args.pagedlm_args = shlex.split(args.pagedlm_args)
    check_python_deps()
    args.model = cpu_peer_common.check_binary_and_model(args.pagedlm, args.model, fail)

    import llama_cpp

    facts = ModelFacts(args.model)
    need = max([*args.prefill, PROMPT_LEN * max(args.batch or [1]) + PROMPT_LEN, 2 * PROMPT_LEN])
    ids = text_ids(args.model, need)
    probe = build_probe(os.path.join(os.path.dirname(os.path.abspath(args.pagedlm)), "peer"))
    bw_before = probe_bandwidth(probe, args.threads, args.probe_mib)
    load_before = loadavg()
    # The commit of the checkout that holds the binary (a --pagedlm of another worktree is that
    # worktree's build, not this one's).
    commit = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(args.pagedlm)),
                             "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    rows = build_rows(args, facts, ids)
    started = time.time()
    for row in rows:
        if not args.quick:
            row.once("a"), row.once("b")  # the warm-up pair: page cache, CPU clocks
            row.a.clear(), row.b.clear()
        for i in range(args.pairs):
            a, b = row.once("a"), row.once("b")
            print(f"  {row.label}: pair {i + 1}: pagedlm {a:.1f}, llama.cpp {b:.1f} "
                  f"{row.unit} ({a / b:.2f}x)", file=sys.stderr, flush=True)
    bw_after = probe_bandwidth(probe, args.threads, args.probe_mib)
    copy_bw = min(bw_before["copy_gb_s"], bw_after["copy_gb_s"]), max(
        bw_before["copy_gb_s"], bw_after["copy_gb_s"])
    read_bw = min(bw_before["read_gb_s"], bw_after["read_gb_s"]), max(
        bw_before["read_gb_s"], bw_after["read_gb_s"])

    extra = " ".join(shlex.quote(a) for a in args.pagedlm_args)
    lines = [
        f"{datetime.date.today().isoformat()}, commit {commit}, {cpu_name()}, "
        f"{os.cpu_count()} cores; {args.threads} thread(s) on both sides; load average "
        f"{load_before} at the start, {loadavg()} at the end; {args.pairs} pair(s) per row"
        + ("" if args.quick else " after one warm-up pair")
        + f" ({time.time() - started:.0f} s). Model {os.path.basename(args.model)}; pagedlm "
        f"{os.path.relpath(args.pagedlm, ROOT)}{' ' + extra if extra else ''}; llama.cpp "
        f"through llama-cpp-python {llama_cpp.__version__}. Copy bandwidth (bench/"
        f"copy_bandwidth.c, {args.threads} thread(s), 2 x {args.probe_mib} MiB, before/after): "
        f"copy {bw_before['copy_gb_s']:.1f}/{bw_after['copy_gb_s']:.1f} GB/s, memcpy "
        f"{bw_before['memcpy_gb_s']:.1f}/{bw_after['memcpy_gb_s']:.1f}, read "
        f"{bw_before['read_gb_s']:.1f}/{bw_after['read_gb_s']:.1f}. A decode step reads "
        f"{facts.step_bytes / 1e6:.1f} MB of weights.",
        "",
        "| workload | pagedlm, median (min-max) | llama.cpp, median (min-max) "
        "| pagedlm / llama.cpp, pair by pair |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        ratios = [a / b for a, b in zip(row.a, row.b)]
        cells = []
        for xs in (row.a, row.b):
            cell = f"{spread(xs, '{:.1f}')} {row.unit}"
            if row.extra:
                cell += f"; {row.extra(statistics.median(xs))}"
                if row.unit == "decode tok/s":
                    bw = facts.step_bytes * statistics.median(xs) / 1e9
                    cell += f" ({100 * bw / copy_bw[1]:.0f}% of copy, {100 * bw / read_bw[1]:.0f}% of read)"
            cells.append(cell)
        lines.append(f"| {row.label} | {cells[0]} | {cells[1]} | {spread(ratios, '{:.2f}x')} |")
    text = "\n".join(lines)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
