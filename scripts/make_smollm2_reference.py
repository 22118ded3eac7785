#!/usr/bin/env python3
"""Reference logits for the default SmolLM2 GGUF, computed independently of pagedlm.

The `gguf` package (llama.cpp's own Python reader) dequantizes every tensor; this script then
runs a plain float64 numpy forward of the Llama architecture (HF's formulation: RMSNorm, NEOX
rope on un-permuted q/k, GQA, SiLU MLP, tied lm_head). The prompts' logits at their last
positions go to testdata/smollm2/reference.safetensors.

usage: pip install gguf numpy safetensors; scripts/make_smollm2_reference.py [GGUF]
"""
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file

PROMPTS = [  # token ids: chat-formatted and plain text prompts of the SmolLM2 vocabulary
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
    [19556, 905, 17],
    [504, 3575, 282, 4649, 314],
    [1, 4093, 198, 23811, 253, 1789, 3108, 30, 2, 198, 1, 520, 9531, 198],
    [2], 
    [33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 33, 34, 35],
]
LAST_POSITIONS = 2


def load(path):
    reader = GGUFReader(path)
    meta = {f.name: f for f in reader.fields.values()}

    def scalar(key):
        f = meta[key]
        return f.parts[f.data[0]][0]

    cfg = dict(
        layers=int(scalar("llama.block_count")), heads=int(scalar("llama.attention.head_count")),
        kv_heads=int(scalar("llama.attention.head_count_kv")),
        theta=float(scalar("llama.rope.freq_base")),
        eps=float(scalar("llama.attention.layer_norm_rms_epsilon")))
    tensors = {}
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type).astype(np.float64)
        tensors[t.name] = data.reshape([int(d) for d in reversed(t.shape)])
    return cfg, tensors


def unpermute(w, n_head):
    # GGUF row h*d + 2j + s holds HF row h*d + s*d/2 + j (convert_hf_to_gguf's permute).
    rows, cols = w.shape
    d = rows // n_head
    return w.reshape(n_head, d // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def forward(cfg, t, ids):
    n = len(ids)
    x = t["token_embd.weight"][ids]
    H, Hk = cfg["heads"], cfg["kv_heads"]
    d = x.shape[1] // H
    inv_freq = 1.0 / cfg["theta"] ** (np.arange(0, d, 2) / d)
    ang = np.arange(n)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], 1)), np.sin(np.concatenate([ang, ang], 1))

    def rope(v):  # [n, heads, d], rotate_half form
        half = np.concatenate([-v[..., d // 2:], v[..., :d // 2]], -1)
        return v * cos[:, None, :] + half * sin[:, None, :]

    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(cfg["layers"]):
        p = f"blk.{i}."
        h = rms_norm(x, t[p + "attn_norm.weight"], cfg["eps"])
        q = (h @ unpermute(t[p + "attn_q.weight"], H).T).reshape(n, H, d)
        k = (h @ unpermute(t[p + "attn_k.weight"], Hk).T).reshape(n, Hk, d)
        v = (h @ t[p + "attn_v.weight"].T).reshape(n, Hk, d)
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, H // Hk, axis=1), np.repeat(v, H // Hk, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", s, v).reshape(n, H * d)
        x = x + o @ t[p + "attn_output.weight"].T
        h = rms_norm(x, t[p + "ffn_norm.weight"], cfg["eps"])
        g, u = h @ t[p + "ffn_gate.weight"].T, h @ t[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ t[p + "ffn_down.weight"].T
    x = rms_norm(x, t["output_norm.weight"], cfg["eps"])
    head = t.get("output.weight", t["token_embd.weight"])
    return x @ head.T


def main():
    cache = os.environ.get("PAGEDLM_CACHE") or os.path.expanduser("~/.cache/pagedlm")
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        cache, "SmolLM2-135M-Instruct.Q4_1.gguf")
    cfg, tensors = load(path)
    out = {}
    for i, ids in enumerate(PROMPTS):
        logits = forward(cfg, tensors, ids)
        keep = min(LAST_POSITIONS, len(ids))
        out[f"case{i}.prompt"] = np.array(ids, dtype=np.int32)
        out[f"case{i}.logits"] = logits[-keep:].astype(np.float32)
        print(f"case {i}: {len(ids)} tokens, argmax {logits[-1].argmax()}")
    here = os.path.dirname(os.path.abspath(__file__))
    save_file(out, os.path.join(here, "..", "testdata", "smollm2", "reference.safetensors"),
              metadata={"source": "gguf dequantize + float64 numpy forward",
                        "model": os.path.basename(path)})


if __name__ == "__main__":
    main()
