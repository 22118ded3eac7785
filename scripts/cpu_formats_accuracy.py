#!/usr/bin/env python3
"""The default SmolLM2 GGUF requantized to each ggml format by llama.cpp's quantizer, and
pagedlm's exact CPU logits on it held to a forward whose weights gguf-py dequantizes.

For each format (default: Q4_0 Q5_0 Q5_1 Q8_0 Q6_K Q4_K_M Q5_K_M Q3_K_S Q2_K-pure IQ4_NL
IQ4_XS):
  1. llama.cpp's llama_model_quantize (llama-cpp-python, scripts/requirements-cpu-peer.txt)
     requantizes the default Q4_1 file (allow_requantize: llama.cpp dequantizes each tensor to
     float32 and quantizes it again) into ~/.cache/pagedlm/requantized/. llama.cpp picks the
     tensors' formats itself: SmolLM2's 576-wide rows are not a multiple of the K-quants' 256, so
     most K-quant tensors fall back to Q5_0 / Q8_0 (its own rule), and only ffn_down
     (1536-wide) keeps Q4_K / Q6_K. A type named TYPE-pure is llama.cpp's `pure` quantization:
     every tensor that it can put in TYPE in TYPE (its Q2_K file keeps ffn_down in Q3_K, and its
     Q2_K_S wants an importance matrix, so Q2_K-pure is the one file with Q2_K tensors).
     IQ4_NL and IQ4_XS need no importance matrix. Both files keep token_embd in Q8_0 and the
     first 3 ffn_down in Q5_K; IQ4_XS's other 27 ffn_down are IQ4_XS and its 576-wide tensors
     fall back to IQ4_NL (its 256-weight blocks do not fit their rows).
  2. The reference: scripts/make_smollm2_reference.py's numpy forward, every tensor
     dequantized by gguf-py (gguf.quants.dequantize), in float32 and float64, decoding the
     prompt greedily for --tokens tokens (the float32 forward's argmax).
  3. `pagedlm logits` (exact mode, and --cpu-fixed32-activations / --cpu-q8-activations where
     asked) scores that whole
     sequence; we report max |pagedlm - reference| over the generated positions' logits, and
     whether pagedlm's argmax at each of them is the reference's token (teacher forcing: all
     equal means pagedlm's own greedy decode is the same sequence, since its decode and
     prefill steps give the same bits).

  4. With --llama, llama.cpp's own logits on the same file and sequence (llama_cpp_peer.py's
     Peer: one decode of the whole sequence, every position's logits) held to the same
     references, for the error of its own quantized activations (q8_0 / q8_K blocks) beside
     pagedlm's.

  pip install --require-hashes --no-binary llama-cpp-python -r scripts/requirements-cpu-peer.txt
  pip install safetensors        # make_smollm2_reference.py's, which reads pagedlm's output too
  scripts/cpu_formats_accuracy.py [--pagedlm build/pagedlm] [--types Q4_0 Q6_K] [--tokens 32]
                                  [--fixed32] [--q8] [--llama]
Exits 1 if any format's exact-mode or (with --fixed32) 32-bit fixed-point logits are further
than --tol from the float32 reference or any argmax differs.
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_smollm2_reference as ref  # noqa: E402  (the gguf-py + numpy forward)

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
          411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2,
          198, 1, 520, 9531, 198]


def cache_dir():
    return os.environ.get("PAGEDLM_CACHE") or os.path.expanduser("~/.cache/pagedlm")


def requantize(src, dst, type_name):
    import llama_cpp

    base, pure = type_name.removesuffix("-pure"), type_name.endswith("-pure")
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{base}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.pure = pure
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        sys.exit(f"llama_model_quantize({type_name}) failed: {rc}")


def tensor_types(path):
    from gguf import GGUFReader

    counts = {}
    for t in GGUFReader(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def greedy(cfg, tensors, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(ref.forward(cfg, tensors, ids)[-1].argmax()))
    return ids


def pagedlm_logits(binary, model, ids, extra):
    from safetensors.numpy import load_file

    with tempfile.TemporaryDirectory() as tmp:
        prompts = os.path.join(tmp, "prompts.json")
        out = os.path.join(tmp, "logits.safetensors")
        with open(prompts, "w") as f:
            json.dump([ids], f)
        subprocess.run([binary, "logits", "--model", model, "--input", prompts, "--output", out,
                        *extra], check=True, stdout=subprocess.DEVNULL)
        tensors = load_file(out)
        return next(iter(tensors.values())).reshape(len(ids), -1)


def llama_cpp_logits(model, ids):
    from llama_cpp_peer import Peer

    peer = Peer(model, threads=1, n_ctx=len(ids))
    try:
        got = peer.decode([(t, p, 0, True) for p, t in enumerate(ids)])
        return np.stack([got[i] for i in range(len(ids))])
    finally:
        peer.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pagedlm", default=os.path.join(HERE, "..", "build", "pagedlm"))
    ap.add_argument("--model", default=os.path.join(cache_dir(),
                                                    "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--types", nargs="+",
                    default=["Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q6_K", "Q4_K_M", "Q5_K_M", "Q3_K_S",
                             "Q2_K-pure", "IQ4_NL", "IQ4_XS"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--fixed32", action="store_true",
                    help="also check --cpu-fixed32-activations (held to --tol as the exact mode)")
    ap.add_argument("--q8", action="store_true", help="also report --cpu-q8-activations")
    ap.add_argument("--llama", action="store_true",
                    help="also report llama.cpp's logits on the same file (1 thread)")
    args = ap.parse_args()
    out_dir = os.path.join(cache_dir(), "requantized")
    os.makedirs(out_dir, exist_ok=True)
    ok = True
    for type_name in args.types:
        path = os.path.join(out_dir, f"SmolLM2-135M-Instruct.{type_name}.gguf")
        if not os.path.exists(path):
            requantize(args.model, path, type_name)
        cfg, t64 = ref.load(path)
        t32 = {k: v.astype(np.float32) for k, v in t64.items()}
        ids = greedy(cfg, t32, PROMPT, args.tokens)
        gen = slice(len(PROMPT) - 1, len(ids) - 1)  # positions whose argmax is a generated token
        want32 = ref.forward(cfg, t32, ids)[gen].astype(np.float64)
        want64 = ref.forward(cfg, t64, ids)[gen]
        del t32, t64
        print(f"{type_name}: {os.path.getsize(path) / 1e6:.1f} MB, tensors {tensor_types(path)}")
        runs = [("exact", [])]
        if args.fixed32:
            runs.append(("fixed32", ["--cpu-fixed32-activations"]))
        if args.q8:
            runs.append(("q8", ["--cpu-q8-activations"]))
        if args.llama:
            runs.append(("llama.cpp", None))
        for label, extra in runs:
            if extra is None:
                got = llama_cpp_logits(path, ids)[gen].astype(np.float64)
            else:
                got = pagedlm_logits(args.pagedlm, path, ids, extra)[gen].astype(np.float64)
            err32 = np.abs(got - want32).max()
            err64 = np.abs(got - want64).max()
            same = int((got.argmax(-1) == np.array(ids[len(PROMPT):])).sum())
            print(f"  {label:9s} max|logit - f32 ref| {err32:.2e}  max|logit - f64 ref| "
                  f"{err64:.2e}  (f32 ref vs f64 ref {np.abs(want32 - want64).max():.2e})  "
                  f"greedy tokens equal {same}/{args.tokens}")
            if label in ("exact", "fixed32") and (err32 > args.tol or same != args.tokens):
                ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
