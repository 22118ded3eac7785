#!/usr/bin/env python3
"""bf16 accuracy on the GPU: pagedlm against HF transformers' own bf16 forward, same machine, same run.

For every golden fixture (testdata/fixtures/*: tiny HF checkpoints with float64 reference logits),
both engines compute every case's prompt logits in bf16 on the GPU, and each is scored by its
relative Frobenius error against the float64 reference. pagedlm passes a fixture when its worst
case is no worse than HF's worst case (the tolerance a bf16 engine can be held to is the error of
the reference implementation's own bf16 forward).

    python3 scripts/gpu_host/fixture_accuracy.py --pagedlm build-gpu/pagedlm [FIXTURE ...]

Needs torch and transformers (the GPU host has them) and numpy; prints one table row per fixture
and exits 1 when pagedlm is worse than HF on any.
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "testdata", "fixtures")


def read_safetensors(path):
    """name -> numpy array (F32, I32, BF16 as float32), without the safetensors package."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = data[a:b]
        dtype = info["dtype"]
        if dtype == "F32":
            arr = np.frombuffer(raw, dtype=np.float32)
        elif dtype == "I32":
            arr = np.frombuffer(raw, dtype=np.int32)
        elif dtype == "BF16":
            arr = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"{path}: tensor {name} has dtype {dtype}")
        out[name] = arr.reshape(info["shape"])
    return out


def rel_err(got, want):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def hf_bf16_logits(fixture_dir, prompts):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fixture_dir, dtype=torch.bfloat16).to("cuda")
    model.eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], dtype=torch.long, device="cuda")
            out.append(model(ids).logits[0].float().cpu().numpy())
    del model
    torch.cuda.empty_cache()
    return out


def pagedlm_logits(binary, fixture_dir, prompts, extra):
    with tempfile.TemporaryDirectory() as tmp:
        prompts_path = os.path.join(tmp, "prompts.json")
        out_path = os.path.join(tmp, "logits.safetensors")
        with open(prompts_path, "w") as f:
            json.dump(prompts, f)
        subprocess.run([binary, "logits", "--model", fixture_dir, "--input", prompts_path,
                        "--output", out_path, "--device", "cuda", *extra],
                       check=True, stdout=subprocess.DEVNULL)
        t = read_safetensors(out_path)
        return [t[f"logits.{i}"] for i in range(len(prompts))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pagedlm", required=True, help="the pagedlm binary (a CUDA build)")
    ap.add_argument("fixtures", nargs="*", help="fixture names (default: all)")
    args = ap.parse_args()
    names = args.fixtures or sorted(
        d for d in os.listdir(FIXTURES) if os.path.isfile(os.path.join(FIXTURES, d, "expected.json")))
    print(f"{'fixture':14s} {'HF bf16 worst':>14s} {'pagedlm worst':>14s} "
          f"{'pagedlm chunked':>16s} {'HF mean':>9s} {'ours mean':>10s}  verdict")
    worse = []
    for name in names:
        d = os.path.join(FIXTURES, name)
        exp = read_safetensors(os.path.join(d, "expected.safetensors"))
        cases = sorted(int(k[4:-7]) for k in exp if k.endswith(".prompt"))
        prompts = [exp[f"case{i}.prompt"].astype(int).tolist() for i in cases]
        want = [exp[f"case{i}.logits"] for i in cases]
        hf = [rel_err(g, w) for g, w in zip(hf_bf16_logits(d, prompts), want)]
        ours = [rel_err(g, w) for g, w in zip(pagedlm_logits(args.pagedlm, d, prompts, []), want)]
        chunked = [rel_err(g, w) for g, w in zip(
            pagedlm_logits(args.pagedlm, d, prompts, ["--max-num-batched-tokens", "16"]), want)]
        ok = max(ours) <= max(hf) and max(chunked) <= max(hf)
        if not ok:
            worse.append(name)
        print(f"{name:14s} {max(hf):14.3e} {max(ours):14.3e} {max(chunked):16.3e} "
              f"{np.mean(hf):9.3e} {np.mean(ours):10.3e}  {'ok' if ok else 'WORSE THAN HF'}")
    if worse:
        print("pagedlm is worse than HF bf16 on: " + " ".join(worse))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
