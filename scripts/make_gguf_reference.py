#!/usr/bin/env python3
"""Writes testdata/gguf/reference.{json,bin}: ggml blocks and their dequantized floats, as an
independent reference for pagedlm's GGUF dequantization and Q/K un-permutation.

The reference is the `gguf` Python package (gguf-py from llama.cpp), not pagedlm:
  pip install gguf numpy
  python3 scripts/make_gguf_reference.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]

Contents:
  * "blocks": raw block bytes + gguf.quants.dequantize() floats for
    - random data quantized with gguf.quants.quantize() into Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16,
      BF16 (and F32);
    - random Q4_K, Q6_K, Q5_K, Q3_K and Q2_K blocks (gguf-py cannot quantize these, so the bytes are random
      with finite fp16 scales; dequantization does not care how the bytes were produced);
    - random IQ4_NL and IQ4_XS blocks likewise (written after everything else, so that the
      entries before them keep their offsets in reference.bin);
    - rows of real SmolLM2 tensors: token_embd (Q8_0), blk.0.attn_v (Q4_1), blk.0.attn_norm (F32).
  * "unpermuted": rows of blk.0.attn_q / attn_k of the SmolLM2 file, dequantized by gguf-py and
    un-permuted with numpy, i.e. the inverse of convert_hf_to_gguf.py's
      W.reshape(n_h, 2, rows // n_h // 2, *rest).swapaxes(1, 2).reshape(W.shape)
    under their Hugging Face names.
Floats and bytes live in reference.bin at the offsets given in reference.json (little-endian).
"""
import hashlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize, quantize

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT_DIR = Path(__file__).resolve().parent.parent / "testdata" / "gguf"


def permute(w, n_head):
    """convert_hf_to_gguf.py LlamaModel.permute (HF -> GGUF)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def unpermute(w, n_head):
    """The inverse of permute (GGUF -> HF)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


class Writer:
    def __init__(self):
        self.buf = bytearray()

    def add(self, data: bytes) -> dict:
        while len(self.buf) % 16:
            self.buf.append(0)
        off = len(self.buf)
        self.buf += data
        return {"offset": off, "length": len(data)}


def raw_bytes(blocks: np.ndarray) -> bytes:
    return np.ascontiguousarray(blocks).view(np.uint8).tobytes()


def main():
    cache = os.environ.get("PAGEDLM_CACHE", os.path.join(os.environ["HOME"], ".cache", "pagedlm"))
    model_path = Path(sys.argv[1] if len(sys.argv) > 1 else os.path.join(cache, MODEL))
    rng = np.random.default_rng(20240601)
    w = Writer()
    blocks, unpermuted = [], []

    def add_case(name, qtype, raw: np.ndarray, cols: int):
        ref = dequantize(raw, qtype).astype(np.float32).reshape(-1, cols)
        blocks.append({
            "name": name, "type": int(qtype), "type_name": qtype.name, "rows": ref.shape[0],
            "cols": cols, "bytes": w.add(raw_bytes(raw)), "floats": w.add(ref.tobytes()),
        })

    data = (rng.standard_normal((4, 256)) * rng.uniform(0.01, 3.0, (4, 1))).astype(np.float32)
    data[0, :32] = 0.0  # an all-zero block (scale 0)
    data[1, 32:64] = 1.5  # a constant block
    for qtype in (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        add_case(f"random_{qtype.name}", qtype, quantize(data, qtype), 256)

    # New formats go last: each draws from rng after the ones before, which stay as they were.
    for qtype, nbytes, scale_at in ((T.Q4_K, 144, (0, 2)), (T.Q6_K, 210, (208,)),
                                    (T.Q5_K, 176, (0, 2)), (T.Q3_K, 110, (108,)),
                                    (T.Q2_K, 84, (80, 82))):
        raw = rng.integers(0, 256, (3, nbytes * 2), dtype=np.uint8)
        for row in raw:
            for b in range(2):
                for at in scale_at:
                    half = np.array([rng.uniform(-0.05, 0.05)], np.float16).view(np.uint8)
                    row[b * nbytes + at:b * nbytes + at + 2] = half
        add_case(f"random_{qtype.name}", qtype, raw, 512)

    model_sha = None
    if model_path.exists():
        model_sha = hashlib.sha256(model_path.read_bytes()).hexdigest()
        reader = GGUFReader(str(model_path))
        tensors = {t.name: t for t in reader.tensors}

        def rows_of(name, begin, end):
            t = tensors[name]
            return t, np.asarray(t.data).reshape(int(t.shape[1]) if len(t.shape) > 1 else 1,
                                                 -1)[begin:end]

        for name, begin, end in (("token_embd.weight", 0, 2), ("token_embd.weight", 1000, 1002),
                                 ("blk.0.attn_v.weight", 0, 8), ("blk.0.attn_norm.weight", 0, 1)):
            t, raw = rows_of(name, begin, end)
            add_case(f"{name}[{begin}:{end}]", T(t.tensor_type), raw, int(t.shape[0]))

        def field(key):
            f = reader.fields[key]
            return int(f.parts[f.data[0]][0])

        n_head = field("llama.attention.head_count")
        n_head_kv = field("llama.attention.head_count_kv")
        for gguf_name, hf, n_h, begin, end in (
                ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", n_head, 64, 192),
                ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", n_head_kv, 128,
                 192)):
            t = tensors[gguf_name]
            full = dequantize(np.asarray(t.data), T(t.tensor_type)).astype(np.float32)
            full = full.reshape(int(t.shape[1]), int(t.shape[0]))
            assert np.array_equal(permute(unpermute(full, n_h), n_h), full)
            hf_rows = unpermute(full, n_h)[begin:end]
            unpermuted.append({"name": hf, "gguf_name": gguf_name, "n_head": n_h,
                               "row_begin": begin, "row_end": end, "cols": int(t.shape[0]),
                               "floats": w.add(np.ascontiguousarray(hf_rows).tobytes())})
    else:
        print(f"warning: {model_path} not found; writing only the random cases", file=sys.stderr)

    # Random blocks with finite fp16 scales, as the K-quants' above (block bytes, scale offset):
    # 512 weights a row, 16 IQ4_NL blocks or 2 IQ4_XS ones.
    for qtype, nbytes, block_elems, scale_at in ((T.IQ4_NL, 18, 32, 0), (T.IQ4_XS, 136, 256, 0)):
        per_row = 512 // block_elems
        raw = rng.integers(0, 256, (3, nbytes * per_row), dtype=np.uint8)
        for row in raw:
            for b in range(per_row):
                half = np.array([rng.uniform(-0.05, 0.05)], np.float16).view(np.uint8)
                row[b * nbytes + scale_at:b * nbytes + scale_at + 2] = half
        add_case(f"random_{qtype.name}", qtype, raw, 512)

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "reference.bin").write_bytes(bytes(w.buf))
    manifest = {
        "provenance": ("Generated by scripts/make_gguf_reference.py with the gguf Python package "
                       f"{importlib.metadata.version('gguf')} and numpy {np.__version__}; real rows "
                       f"come from {MODEL}"),
        "model_sha256": model_sha,
        "blocks": blocks,
        "unpermuted": unpermuted,
    }
    (OUT_DIR / "reference.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {OUT_DIR}/reference.bin ({len(w.buf)} bytes)")


if __name__ == "__main__":
    main()
