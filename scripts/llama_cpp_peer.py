#!/usr/bin/env python3
"""llama.cpp, the peer of the CPU side-by-side in docs/PERF.md, through llama-cpp-python's
low-level bindings (the C API of llama.h: llama_batch, llama_decode, llama_get_logits_ith).

Install the peer (builds llama.cpp from source, several minutes on 2 cores):
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS=-mno-amx-int8 \\
        -DCMAKE_CXX_FLAGS=-mno-amx-int8" pip install --no-cache-dir --require-hashes \\
        --no-binary llama-cpp-python -r scripts/requirements-cpu-peer.txt
(requirements-cpu-peer.txt says why AMX is left out.)

The context takes llama.cpp's own defaults (llama_context_default_params: n_batch 2048,
n_ubatch 512, f16 K/V, flash attention where the backend has it) except for the sizes below and
the thread count, which is the same for prompt processing and generation. Greedy decoding takes
the argmax of the logits (no sampler chain) and never stops at EOS, as `pagedlm bench` does.

Subcommands (each loads the model once and prints one line of JSON on stdout; times exclude
the load):
  tokenize --prompt TEXT [--chat]     the prompt's token ids, through the GGUF's chat template
           (or --prompt-file PATH)    with --chat; --prompt-file reads the text from a file
                                      ("-": stdin), for text past the kernel's 128 KiB limit
                                      on one argument
  prefill  --tokens IDS               one prompt, 1 new token: the prompt's evaluation time
  decode   --tokens IDS --max-tokens N one stream: N tokens, the first from the prompt's logits;
                                      the time of the N-1 single-token decode steps alone
  batch    --tokens IDS (repeatable)  all prompts in one batch with one sequence id each, then
           --max-tokens N             one llama_decode per step with one token of every
                                      sequence, as llama.cpp's batched example and
                                      llama-server --parallel do; the time from the first
                                      prompt token to the last generated one
  score    --input JSON --output NPZ  teacher forcing: every position's logits of each token
           [--greedy N]               list in the JSON file (one decode of the whole sequence),
                                      and with --greedy N also N free-running greedy tokens
                                      after each list's first --prompt-len tokens
"""
import argparse
import json
import os
import sys
import time


def _require_llama_cpp():
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        sys.exit(
            "llama-cpp-python is missing. Install it from source (several minutes on 2 cores):\n"
            '  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS=-mno-amx-int8 '
            '-DCMAKE_CXX_FLAGS=-mno-amx-int8" pip install --no-cache-dir --require-hashes '
            "--no-binary llama-cpp-python -r scripts/requirements-cpu-peer.txt"
        )


class Peer:
    """One llama.cpp model and context, driven through the C API."""

    def __init__(self, model, threads, n_ctx, n_seq_max=1):
        _require_llama_cpp()
        import llama_cpp as L

        self.L = L
        if not os.path.isfile(model):
            sys.exit(f"no model file at {model}")
        L.llama_backend_init()
        L.llama_log_set(_quiet_log, None)
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(model.encode(), mp)
        if not self.model:
            sys.exit(f"llama.cpp could not load {model}")
        cp = L.llama_context_default_params()
        # Sequences get n_ctx / n_seq_max cells each (the K/V cache is not unified by default).
        self.n_ctx = max(256, -(-n_ctx * n_seq_max // 256) * 256)
        cp.n_ctx = self.n_ctx
        cp.n_seq_max = n_seq_max
        cp.n_threads = threads
        cp.n_threads_batch = threads
        self.n_batch = int(cp.n_batch)
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            sys.exit("llama.cpp could not create a context")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)

    def close(self):
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def clear(self):
        """Forgets every sequence's K/V."""
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def decode(self, entries):
        """entries: (token, position, sequence id, wants logits) tuples, decoded in order in
        chunks of n_batch tokens. Returns {index into entries: logits (numpy, a copy)}."""
        import numpy as np

        L, b = self.L, self.batch
        bad = [e[0] for e in entries if not 0 <= e[0] < self.n_vocab]
        if bad:
            sys.exit(f"token id {bad[0]} is outside the model's vocabulary of {self.n_vocab}")
        out = {}
        for lo in range(0, len(entries), self.n_batch):
            chunk = entries[lo : lo + self.n_batch]
            b.n_tokens = len(chunk)
            for i, (tok, pos, seq, want) in enumerate(chunk):
                b.token[i] = tok
                b.pos[i] = pos
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = 1 if want else 0
            rc = L.llama_decode(self.ctx, b)
            if rc != 0:
                sys.exit(f"llama_decode failed ({rc}): the context holds {self.n_ctx} cells")
            for i, (_, _, _, want) in enumerate(chunk):
                if want:
                    row = L.llama_get_logits_ith(self.ctx, i)
                    out[lo + i] = np.ctypeslib.as_array(row, shape=(self.n_vocab,)).copy()
        return out

    def prompts(self, prompts, last_logits=True):
        """Evaluates each prompt as its own sequence (id = its index), all in one batch stream;
        returns the logits of each prompt's last position."""
        entries = [
            (t, p, s, last_logits and p == len(ids) - 1)
            for s, ids in enumerate(prompts)
            for p, t in enumerate(ids)
        ]
        got = self.decode(entries)
        return [got[i] for i in sorted(got)]

    def greedy(self, prompts, max_tokens):
        """Greedy continuation of every prompt together: one decode per step with one token per
        sequence. Returns the generated ids of each prompt."""
        import numpy as np

        last = self.prompts(prompts)
        outs = [[int(np.argmax(row))] for row in last]
        lens = [len(p) for p in prompts]
        for step in range(1, max_tokens):
            entries = [(o[-1], lens[s] + step - 1, s, True) for s, o in enumerate(outs)]
            got = self.decode(entries)
            for s in range(len(outs)):
                outs[s].append(int(np.argmax(got[s])))
        return outs


def _quiet_log_impl(level, text, user_data):
    # llama.cpp logs every load step to stderr; keep only errors (level 4: GGML_LOG_LEVEL_ERROR).
    if level == 4:
        sys.stderr.write(text.decode("utf-8", errors="replace"))


def _make_log_callback():
    try:
        import llama_cpp as L
    except ImportError:
        return None
    return L.llama_log_callback(_quiet_log_impl)


_quiet_log = _make_log_callback()


def parse_ids(text):
    try:
        ids = [int(t) for t in text.split()]
    except ValueError:
        sys.exit(f"--tokens takes whitespace-separated token ids, not {text[:60]!r}")
    if not ids or min(ids) < 0:
        sys.exit("--tokens holds no token ids (or a negative one)")
    return ids


def emit(obj):
    print(json.dumps(obj), flush=True)


def cmd_tokenize(args):
    _require_llama_cpp()
    from llama_cpp import Llama

    llm = Llama(model_path=args.model, n_ctx=256, vocab_only=True, verbose=False)
    if args.prompt_file is None:
        text = args.prompt
    elif args.prompt_file == "-":
        text = sys.stdin.read()
    else:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
    if args.chat:
        import jinja2

        template = llm.metadata["tokenizer.chat_template"]
        env = jinja2.Environment(loader=jinja2.BaseLoader())
        messages = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        messages.append({"role": "user", "content": text})
        text = env.from_string(template).render(messages=messages, add_generation_prompt=True)
    ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    print(" ".join(str(t) for t in ids))


def cmd_prefill(args):
    import numpy as np

    ids = parse_ids(args.tokens[0])
    peer = Peer(args.model, args.threads, len(ids) + 8)
    t0 = time.perf_counter()
    (row,) = peer.prompts([ids])
    first = int(np.argmax(row))
    seconds = time.perf_counter() - t0
    emit({"prompt_tokens": len(ids), "seconds": seconds, "first_token": first})
    peer.close()


def cmd_decode(args):
    import numpy as np

    ids = parse_ids(args.tokens[0])
    n = args.max_tokens
    if n < 2:
        sys.exit("decode needs --max-tokens 2 or more (the first token comes from the prompt)")
    peer = Peer(args.model, args.threads, len(ids) + n + 8)
    if args.warmup:
        # The same shape, untimed, then forgotten: the timed run finds a warm context.
        peer.greedy([ids], 4)
        peer.clear()
    (row,) = peer.prompts([ids])
    out = [int(np.argmax(row))]
    t0 = time.perf_counter()
    for step in range(1, n):
        got = peer.decode([(out[-1], len(ids) + step - 1, 0, True)])
        out.append(int(np.argmax(got[0])))
    seconds = time.perf_counter() - t0
    emit({"decode_steps": n - 1, "seconds": seconds, "ids": out})
    peer.close()


def cmd_batch(args):
    prompts = [parse_ids(t) for t in args.tokens]
    n = args.max_tokens
    peer = Peer(args.model, args.threads, max(len(p) for p in prompts) + n + 8, len(prompts))
    if args.warmup:
        peer.greedy(prompts, 2)
        peer.clear()
    t0 = time.perf_counter()
    outs = peer.greedy(prompts, n)
    seconds = time.perf_counter() - t0
    emit({"sequences": len(prompts), "generated": sum(len(o) for o in outs), "seconds": seconds})
    peer.close()


def cmd_score(args):
    import numpy as np

    with open(args.input) as f:
        seqs = json.load(f)
    if not isinstance(seqs, list) or not seqs or not all(isinstance(s, list) and s for s in seqs):
        sys.exit(f"{args.input} must hold a non-empty JSON list of non-empty token-id lists")
    longest = max(len(s) for s in seqs) + args.greedy
    peer = Peer(args.model, args.threads, longest + 8)
    out = {}
    for i, ids in enumerate(seqs):
        peer.clear()
        got = peer.decode([(t, p, 0, True) for p, t in enumerate(ids)])
        out[f"logits.{i}"] = np.stack([got[p] for p in range(len(ids))]).astype(np.float32)
        if args.greedy:
            peer.clear()
            (gen,) = peer.greedy([ids[: args.prompt_len[i]]], args.greedy)
            out[f"greedy.{i}"] = np.array(gen, dtype=np.int64)
    np.savez(args.output, **out)
    peer.close()


def main():
    default_model = os.path.expanduser(
        os.path.join(os.environ.get("PAGEDLM_CACHE", "~/.cache/pagedlm"),
                     "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("tokenize", "prefill", "decode", "batch", "score"):
        p = sub.add_parser(name)
        p.add_argument("--model", default=default_model)
        p.add_argument("--threads", type=int, default=2)
        if name == "tokenize":
            text = p.add_mutually_exclusive_group(required=True)
            text.add_argument("--prompt")
            text.add_argument("--prompt-file", help="file holding the prompt text (-: stdin)")
            p.add_argument("--chat", action="store_true")
            p.add_argument("--system", default="")
        elif name == "score":
            p.add_argument("--input", required=True, help="JSON list of token-id lists")
            p.add_argument("--output", required=True, help=".npz file to write")
            p.add_argument("--greedy", type=int, default=0, help="free-running greedy tokens")
            p.add_argument("--prompt-len", type=lambda s: [int(x) for x in s.split(",")],
                           default=None, help="comma-separated prompt length of each list")
        else:
            p.add_argument("--tokens", action="append", required=True, help="prompt token ids")
            if name != "prefill":
                p.add_argument("--max-tokens", type=int, default=128)
                p.add_argument("--warmup", action="store_true",
                               help="run the same shape once, untimed, before the timed run")
    args = ap.parse_args()
    if args.threads < 1:
        sys.exit("--threads must be at least 1")
    if args.cmd == "score" and args.greedy and (
        args.prompt_len is None or len(args.prompt_len) != len(json.load(open(args.input)))
    ):
        sys.exit("score --greedy needs --prompt-len with one length per token list")
    {"tokenize": cmd_tokenize, "prefill": cmd_prefill, "decode": cmd_decode,
     "batch": cmd_batch, "score": cmd_score}[args.cmd](args)


if __name__ == "__main__":
    main()
