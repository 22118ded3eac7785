#!/usr/bin/env python3
"""llama.cpp peer for the CPU side-by-side in docs/PERF.md, through llama-cpp-python.

Install the peer (builds llama.cpp from source, several minutes on 2 cores):
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python

Subcommands:
  tokenize  --prompt TEXT [--chat]       prints the prompt's token ids (one line), rendered
                                         through the GGUF's own chat template with --chat
  generate  --tokens "IDS" [--tokens ..] greedy generation, one prompt after another (the
                                         high-level API has no continuous batching); prints
                                         each prompt's generated ids and a timing summary
  check     --tokens "IDS" --pagedlm BIN  agreement of the two engines' greedy tokens: llama.cpp
                                         generates N tokens; `pagedlm logits` scores the prompt
                                         plus those tokens, and its argmax at each step is
                                         compared with llama.cpp's choice (teacher forcing: up to
                                         the first mismatch this equals both engines' free-running
                                         greedy output)

Greedy decoding takes the argmax of the logits directly (no sampler chain), and stops at EOS
unless --ignore-eos is given, as `pagedlm generate` does with --temperature 0.
"""
import argparse
import os
import sys
import time


def load(model, threads, n_ctx):
    from llama_cpp import Llama

    return Llama(
        model_path=model,
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=n_ctx,
        n_batch=512,
        logits_all=False,
        verbose=False,
    )


def cmd_tokenize(args):
    llm = load(args.model, args.threads, 512)
    text = args.prompt
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


def greedy(llm, prompt, max_tokens, ignore_eos):
    """Greedy continuation of `prompt` (token ids) from an empty context."""
    import numpy as np

    eos = llm.token_eos()
    n_vocab = llm.n_vocab()
    llm.reset()
    llm.eval(prompt)
    out = []
    while len(out) < max_tokens:
        # The last evaluated position's logits (the only row computed without logits_all).
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
        tok = int(np.argmax(logits))
        if tok == eos and not ignore_eos:
            break
        out.append(tok)
        if len(out) == max_tokens:
            break
        llm.eval([tok])
    return out


def cmd_generate(args):
    t0 = time.perf_counter()
    prompts = [[int(t) for t in p.split()] for p in args.tokens]
    n_ctx = max(len(p) for p in prompts) + args.max_tokens + 8
    llm = load(args.model, args.threads, n_ctx)
    t1 = time.perf_counter()
    total = 0
    for i, p in enumerate(prompts):
        ids = greedy(llm, p, args.max_tokens, args.ignore_eos)
        total += len(ids)
        print(f"=== [{i + 1}] {len(p)} prompt tokens, {len(ids)} generated")
        print("ids:", " ".join(str(t) for t in ids))
        if args.text:
            print(llm.detokenize(ids).decode("utf-8", errors="replace"))
    t2 = time.perf_counter()
    print(
        f"llama.cpp: load {t1 - t0:.2f} s; {len(prompts)} sequences, {total} tokens generated in "
        f"{t2 - t1:.2f} s ({total / (t2 - t1):.1f} tok/s)",
        file=sys.stderr,
    )


def read_safetensors(path):
    import json
    import struct

    import numpy as np

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", info["dtype"]
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=np.float32).reshape(info["shape"])
    return out


def cmd_check(args):
    import json
    import subprocess
    import tempfile

    import numpy as np

    prompt = [int(t) for t in args.tokens[0].split()]
    llm = load(args.model, args.threads, len(prompt) + args.max_tokens + 8)
    ours = greedy(llm, prompt, args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        inp, outp = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.safetensors")
        with open(inp, "w") as f:
            json.dump([prompt + ours], f)
        subprocess.run(
            [args.pagedlm, "logits", "--model", args.model, "--input", inp, "--output", outp,
             "--threads", str(args.threads), "--device", "cpu"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        logits = read_safetensors(outp)["logits.0"]
    n = len(prompt)
    theirs = [int(np.argmax(logits[n - 1 + i])) for i in range(len(ours))]
    matches = sum(a == b for a, b in zip(ours, theirs))
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    print("llama.cpp ids:", " ".join(map(str, ours)))
    print("pagedlm ids:  ", " ".join(map(str, theirs)))
    print(f"{matches}/{len(ours)} steps agree under teacher forcing; "
          f"free-running greedy outputs identical for the first "
          f"{len(ours) if first is None else first} tokens")
    if first is not None:
        row = logits[n - 1 + first]
        top = np.argsort(row)[::-1][:2]
        print(f"first mismatch at step {first}: pagedlm top-2 logits "
              f"{int(top[0])}={row[top[0]]:.4f} {int(top[1])}={row[top[1]]:.4f} "
              f"(margin {row[top[0]] - row[top[1]]:.4f}); llama.cpp chose {ours[first]} "
              f"(pagedlm logit {row[ours[first]]:.4f})")


def main():
    default_model = os.path.expanduser("~/.cache/pagedlm/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("tokenize", "generate", "check"):
        p = sub.add_parser(name)
        p.add_argument("--model", default=default_model)
        p.add_argument("--threads", type=int, default=2)
        if name == "tokenize":
            p.add_argument("--prompt", required=True)
            p.add_argument("--chat", action="store_true")
            p.add_argument("--system", default="")
        else:
            p.add_argument("--tokens", action="append", required=True, help="prompt token ids")
            p.add_argument("--max-tokens", type=int, default=128)
            p.add_argument("--ignore-eos", action="store_true")
            p.add_argument("--text", action="store_true", help="also print the decoded text")
            if name == "check":
                p.add_argument("--pagedlm", required=True, help="path to the pagedlm binary")
    args = ap.parse_args()
    {"tokenize": cmd_tokenize, "generate": cmd_generate, "check": cmd_check}[args.cmd](args)


if __name__ == "__main__":
    main()
