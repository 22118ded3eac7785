#!/usr/bin/env python3
"""Accuracy of pagedlm and llama.cpp against Hugging Face's float32 forward of the same GGUF.

Hugging Face transformers loads the GGUF (dequantizing every tensor to float32) and decodes
each of 10 chat prompts greedily for --tokens tokens (the argmax of its own logits, no logits
processor, not stopping at EOS). Then, for each engine:
  teacher forcing   the engine scores HF's whole sequence (pagedlm: `pagedlm logits`;
                    llama.cpp: every position's logits from one llama_decode) and we count the
                    generated positions where the engine's argmax is HF's token, note the first
                    position where it is not, and measure max / mean |engine logit - HF logit|
                    over those positions and the whole vocabulary;
  free running      the engine decodes the prompt greedily itself (pagedlm: `pagedlm generate
                    --tokens`, which prints text, so its divergence is the first HF token whose
                    text no longer starts pagedlm's output; llama.cpp: token ids, one
                    llama_decode per token) and we note the first token that differs from HF's.
HF's own teacher-forced argmax (one forward over the whole sequence against its step-by-step
greedy decode) is reported as the float32 noise floor. Mismatches come with HF's top-2 margin at
that position: a flip of a near tie reads differently from a wrong answer.

  pip install --require-hashes -r scripts/requirements-cpu-reference.txt      # HF reference
  scripts/cpu_accuracy.py [--threads 2] [--pagedlm-args "" --pagedlm-args "--cpu-q8-activations"]

Each --pagedlm-args value is one pagedlm mode to report (default: one row, no extra
arguments). The llama.cpp rows need the peer (scripts/requirements-cpu-peer.txt); --no-llama-cpp
leaves them out.
"""
import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_peer_common  # noqa: E402

ROOT = cpu_peer_common.ROOT
PEER = os.path.join(ROOT, "scripts", "llama_cpp_peer.py")

# Chat prompts of varied topics, each asking for an answer longer than the tokens scored.
PROMPTS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about a lighthouse keeper and a storm.",
    "What were the main causes of the French Revolution?",
    "Describe the water cycle for a ten-year-old.",
    "Give me five tips for learning a new language as an adult.",
    "How does a computer store negative numbers in memory?",
    "Write a poem about autumn leaves falling in a quiet park.",
    "Compare cats and dogs as pets for a small apartment.",
    "What is photosynthesis and why does it matter for life on Earth?",
    "Plan a three-day trip to Rome for someone who loves history and food.",
]


def fail(msg):
    sys.exit(f"cpu_accuracy: {msg}")


def check_deps(need_llama):
    missing = []
    for mod in ("numpy", "torch", "transformers", "gguf", "accelerate", "safetensors"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        fail(f"missing Python packages: {', '.join(missing)}. Install the pinned reference:\n"
             "  pip install --require-hashes -r scripts/requirements-cpu-reference.txt")
    if need_llama:
        try:
            __import__("llama_cpp")
        except ImportError:
            fail("llama-cpp-python is missing (or pass --no-llama-cpp). Install the pinned peer:\n"
                 + cpu_peer_common.LLAMA_CPP_INSTALL)


def run(argv, what, timeout=3600):
    return cpu_peer_common.run(argv, what, fail, timeout)


# --- the reference -----------------------------------------------------------------------------


def hf_reference(model_path, prompts, n_tokens, threads):
    """Token ids of each chat prompt, HF's greedy continuation and HF's float32 logits of the
    whole sequence (teacher forced, one forward)."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    folder, name = os.path.split(os.path.abspath(model_path))
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                              dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for text in prompts:
            ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                          add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            ids = [int(t) for t in ids]
            # Step-by-step greedy decode with the K/V cache, the argmax of the raw logits.
            step = model(torch.tensor([ids]), use_cache=True)
            gen = []
            while True:
                nxt = int(torch.argmax(step.logits[0, -1]))
                gen.append(nxt)
                if len(gen) == n_tokens:
                    break
                step = model(torch.tensor([[nxt]]), cache=step.cache, use_cache=True)
            full = model(torch.tensor([ids + gen])).logits[0].float().numpy()
            out.append({"prompt": ids, "gen": gen, "logits": full})
    return tok, out


# --- the engines -------------------------------------------------------------------------------


def pagedlm_logits(args, extra, seqs, tmp):
    from safetensors.numpy import load_file

    inp, outp = os.path.join(tmp, "seqs.json"), os.path.join(tmp, "pagedlm.safetensors")
    with open(inp, "w") as f:
        json.dump(seqs, f)
    run([args.pagedlm, "logits", "--model", args.model, "--input", inp, "--output", outp,
         "--device", "cpu", "--threads", str(args.threads), *extra], "pagedlm logits")
    t = load_file(outp)
    return [t[f"logits.{i}"] for i in range(len(seqs))]


def pagedlm_generate_texts(args, extra, prompts, n_tokens):
    argv = [args.pagedlm, "generate", "--model", args.model, "--device", "cpu",
            "--threads", str(args.threads), "--max-tokens", str(n_tokens), "--temperature", "0",
            *extra]
    for p in prompts:
        argv += ["--tokens", " ".join(map(str, p))]
    out = run(argv, "pagedlm generate")
    if len(prompts) == 1:
        # One prompt streams its text, then a newline and the finish line.
        text, sep, _ = out.rpartition("\n(finish: ")
        if not sep:
            fail(f"cannot read pagedlm generate's output:\n{out[-1000:]}")
        return [text[:-1] if text.endswith("\n") else text]
    texts = []
    for i in range(len(prompts)):
        m = re.search(rf"^=== \[{i + 1}\] [^\n]*\n(.*?)\n\(finish: ", out, re.S | re.M)
        if not m:
            fail(f"cannot find prompt {i + 1}'s text in pagedlm generate's output")
        texts.append(m.group(1))
    return texts


def text_divergence(tok, gen, text):
    """The first HF token whose decoded text is not a prefix of the engine's text."""
    for k in range(1, len(gen) + 1):
        if not text.startswith(tok.decode(gen[:k], skip_special_tokens=False)):
            return k - 1
    return len(gen)


def llama_cpp_scores(args, seqs, prompt_lens, n_tokens, tmp):
    import numpy as np

    inp, outp = os.path.join(tmp, "seqs_peer.json"), os.path.join(tmp, "peer.npz")
    with open(inp, "w") as f:
        json.dump(seqs, f)
    run([sys.executable, PEER, "score", "--model", args.model, "--threads", str(args.threads),
         "--input", inp, "--output", outp, "--greedy", str(n_tokens),
         "--prompt-len", ",".join(map(str, prompt_lens))], "llama.cpp score")
    z = np.load(outp)
    return ([z[f"logits.{i}"] for i in range(len(seqs))],
            [[int(t) for t in z[f"greedy.{i}"]] for i in range(len(seqs))])


# --- the comparison ----------------------------------------------------------------------------


def compare(ref, logits, free_div):
    """Agreement of one engine with HF over every prompt's generated positions."""
    import numpy as np

    agree = total = 0
    first_tf, margins = [], []
    max_err, err_sum, err_n = 0.0, 0.0, 0
    for r, lg in zip(ref, logits):
        n, g = len(r["prompt"]), len(r["gen"])
        if lg.shape != r["logits"].shape:
            fail(f"logits of shape {lg.shape}, HF's are {r['logits'].shape}")
        rows = slice(n - 1, n - 1 + g)
        mine, hf = lg[rows], r["logits"][rows]
        am = mine.argmax(-1)
        hits = am == np.array(r["gen"])
        agree += int(hits.sum())
        total += g
        miss = np.flatnonzero(~hits)
        first_tf.append(int(miss[0]) if miss.size else g)
        for j in miss:
            top2 = np.sort(hf[j])[-2:]
            margins.append(float(top2[1] - top2[0]))
        d = np.abs(mine.astype(np.float64) - hf.astype(np.float64))
        max_err = max(max_err, float(d.max()))
        err_sum += float(d.sum())
        err_n += d.size
    return {
        "agree": agree, "total": total, "first_tf": first_tf, "free": free_div,
        "margins": margins, "max_err": max_err, "mean_err": err_sum / err_n,
    }


def row(name, c, g):
    full = sum(1 for d in c["free"] if d == g)
    margins = c["margins"]
    near = (f"HF top-2 margin at the flips: median {sorted(margins)[len(margins) // 2]:.3f}, "
            f"max {max(margins):.3f}") if margins else "no flips"
    return (f"| {name} | {c['agree']}/{c['total']} | {min(c['first_tf'])} / "
            f"{sum(c['first_tf']) / len(c['first_tf']):.1f} | {full}/{len(c['free'])} prompts; "
            f"first divergence min {min(c['free'])}, mean {sum(c['free']) / len(c['free']):.1f} "
            f"| {c['max_err']:.3g} / {c['mean_err']:.3g} | {near} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pagedlm", default=os.path.join(ROOT, "build", "pagedlm"))
    ap.add_argument("--model", default=None, help="GGUF (default: scripts/fetch_model.sh's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per prompt")
    ap.add_argument("--pagedlm-args", action="append", default=None,
                    help='extra pagedlm arguments of one mode (repeatable; "" is the default mode)')
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 prompts, 8 tokens")
    ap.add_argument("--output", help="also write the markdown to this file")
    # "--pagedlm-args --cpu-q8-activations": argparse would read the value as an option.
    argv, rest = [], sys.argv[1:]
    while rest:
        a = rest.pop(0)
        argv.append(f"{a}={rest.pop(0)}" if a == "--pagedlm-args" and rest else a)
    args = ap.parse_args(argv)
    prompts = PROMPTS
    if args.quick:
        prompts, args.tokens = PROMPTS[:2], 8
    if args.tokens < 1 or args.threads < 1:
        fail("--tokens and --threads must be at least 1")
    modes = [shlex.split(m) for m in (args.pagedlm_args or [""])]
    check_deps(not args.no_llama_cpp)
    args.model = cpu_peer_common.check_binary_and_model(args.pagedlm, args.model, fail)

    import transformers

    print(f"HF float32 reference: {len(prompts)} prompts x {args.tokens} greedy tokens ...",
          file=sys.stderr, flush=True)
    tok, ref = hf_reference(args.model, prompts, args.tokens, args.threads)
    seqs = [r["prompt"] + r["gen"] for r in ref]
    eos = [i + 1 for i, r in enumerate(ref) if tok.eos_token_id in r["gen"]]
    hf_self = compare(ref, [r["logits"] for r in ref], [args.tokens] * len(ref))

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for extra in modes:
            label = "pagedlm" + (" " + shlex.join(extra) if extra else " (exact, default)")
            print(f"{label} ...", file=sys.stderr, flush=True)
            logits = pagedlm_logits(args, extra, seqs, tmp)
            texts = pagedlm_generate_texts(args, extra, [r["prompt"] for r in ref], args.tokens)
            free = [text_divergence(tok, r["gen"], t) for r, t in zip(ref, texts)]
            results.append((label, compare(ref, logits, free)))
        if not args.no_llama_cpp:
            import llama_cpp

            print("llama.cpp ...", file=sys.stderr, flush=True)
            logits, greedy = llama_cpp_scores(args, seqs, [len(r["prompt"]) for r in ref],
                                              args.tokens, tmp)
            free = []
            for r, gen in zip(ref, greedy):
                diff = [j for j, (a, b) in enumerate(zip(gen, r["gen"])) if a != b]
                free.append(diff[0] if diff else args.tokens)
            results.append((f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
                            compare(ref, logits, free)))

    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    g = args.tokens
    lines = [
        f"Commit {commit}; model {os.path.basename(args.model)}; {len(prompts)} chat prompts x "
        f"{g} tokens; reference: HF transformers {transformers.__version__} float32 forward of "
        f"the dequantized GGUF (greedy). HF's own teacher-forced argmax agrees with its greedy "
        f"decode at {hf_self['agree']}/{hf_self['total']} positions."
        + (f" HF's greedy output holds EOS in prompt(s) {eos} (scored past it all the same)."
           if eos else ""),
        "",
        "| engine | teacher-forced argmax = HF token | first teacher-forced miss, min / mean "
        f"(of {g}) | free-running greedy = HF | max / mean abs logit error vs HF | flips |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [row(name, c, g) for name, c in results]
    text = "\n".join(lines)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
