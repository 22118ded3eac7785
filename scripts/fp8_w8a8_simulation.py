#!/usr/bin/env python3
"""What FP8 W8A8 costs on a golden fixture: a float64 forward whose FP8 projections round their
inputs to e4m3 as pagedlm's GPU does, scored against the fixture's float64 logits.

    python3 scripts/fp8_w8a8_simulation.py [--quantize-weights] FIXTURE ...
    python3 scripts/fp8_w8a8_simulation.py --kv-cache-only FIXTURE ...
    python3 scripts/fp8_w8a8_simulation.py --kv-cache-bf16 FIXTURE ...

With --kv-cache-only the projections stay float64 and only the KV cache is e4m3, as
--kv-cache-dtype fp8 stores it: each key (after rotary) and value rounded to bf16, divided by
its layer's self_attn.k_scale / v_scale (1.0 where the checkpoint has none), rounded to e4m3 and
multiplied back; tests/cuda_model_test.cc's FP8 KV cache bound comes from these numbers. With
--kv-cache-bf16 only the KV cache is rounded, to bf16, as the CPU's `--kv-cache-dtype bf16`
stores it from float32 keys and values; tests/golden_fixtures_test.cc's bound for it comes from
these numbers.

Checks the float64 forward itself first (no rounding: it must reproduce the reference to ~1e-6),
then prints each case's relative Frobenius error with the rounding. An FP8 checkpoint's
per-tensor and per-channel projections (fp8-tensor, ct-mixed, fbgemm) take e4m3 inputs: a
static `input_scale` where the file has one, else max |x| / 448 per row (at least
1 / (448 * 512)), max |x| clamped at activation_scale_ub; per-block weights keep unrounded
inputs (pagedlm runs them dequantized). With --quantize-weights (a bf16 fixture, as
`--quantization fp8`): every projection but the lm_head is rounded to e4m3 per output row
(scale max |w| / 448) and takes per-row e4m3 inputs. Rounding is to nearest, ties to the even
code, saturated at 448, from the input rounded to bf16 first (the GPU's activations are bf16).
Everything else stays float64, so the error is FP8's (the GPU adds bf16's elsewhere);
tests/cuda_model_test.cc's W8A8 bounds come from these numbers.

Covers the fixtures of Llama's layout (Llama, Mistral, Qwen2 with q/k/v biases, Phi-3's fused
qkv_proj and gate_up_proj; full rotary, no windows, no q/k norms: not fp8-block's Qwen3):
numpy only, runs on the CPU in seconds.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_host"))
from fixture_accuracy import FIXTURES, fixture_cases, read_safetensors, rel_err  # noqa: E402

E4M3_MAX = 448.0
MIN_SCALE = 1.0 / (448.0 * 512.0)


def e4m3_values():
    """Every code's value (NaN for the two NaN codes)."""
    out = []
    for code in range(256):
        e, m = (code >> 3) & 0xF, code & 7
        v = m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        out.append(np.nan if code & 0x7F == 0x7F else (-v if code & 0x80 else v))
    return np.array(out)


DECODE = e4m3_values()
MAGNITUDES = DECODE[:0x7F]  # codes 0..126, increasing


def round_e4m3(x):
    a = np.minimum(np.abs(x), E4M3_MAX)
    i = np.clip(np.searchsorted(MAGNITUDES, a), 1, len(MAGNITUDES) - 1)
    lo, hi = MAGNITUDES[i - 1], MAGNITUDES[i]
    tie_lo = (i - 1) % 2 == 0  # the even code
    pick = np.where(a - lo < hi - a, lo, np.where(a - lo > hi - a, hi, np.where(tie_lo, lo, hi)))
    return np.sign(x) * pick


def round_bf16(x):
    """float64 -> float32 -> bf16 (nearest, ties to even), back in float64."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


class Model:
    def __init__(self, fixture_dir, rounding, quantize_weights, kv_e4m3=False, kv_bf16=False):
        with open(os.path.join(fixture_dir, "config.json")) as f:
            self.c = json.load(f)
        self.rounding = rounding
        self.kv_e4m3 = kv_e4m3
        self.kv_bf16 = kv_bf16
        quant = self.c.get("quantization_config") or {}
        self.scale_ub = float(quant.get("activation_scale_ub", 0) or 0)
        tensors = {n: t if t.dtype == np.uint8 else t.astype(np.float64) for n, t in
                   read_safetensors(os.path.join(fixture_dir, "model.safetensors")).items()}
        self.w, self.fp8 = {}, {}  # fp8: module -> its input_scale (None: per row)
        self.kv_scales = {n: float(t.reshape(-1)[0]) for n, t in tensors.items()
                          if n.endswith(".k_scale") or n.endswith(".v_scale")}
        for name, t in tensors.items():
            if name in self.kv_scales:
                continue
            if t.dtype != np.uint8:
                self.w[name] = t
                continue
            module = name[: -len(".weight")]
            scale = tensors.get(f"{module}.weight_scale", tensors.get(f"{module}.weight_scale_inv"))
            rows, cols = t.shape
            if scale.size == 1:
                full = scale.reshape(())
            elif scale.size == rows:
                full = scale.reshape(rows, 1)
            else:  # per block: dequantized, unrounded inputs
                full = np.repeat(np.repeat(scale, rows // scale.shape[0], 0),
                                 cols // scale.shape[1], 1)
            self.w[name] = DECODE[t] * full
            if scale.size in (1, rows):
                s = tensors.get(f"{module}.input_scale")
                self.fp8[module] = None if s is None else float(s.reshape(-1)[0])
        if quantize_weights and rounding:
            for name in list(self.w):
                module = name[: -len(".weight")]
                if (".self_attn." in name or ".mlp." in name) and name.endswith(".weight"):
                    w = self.w[name]
                    s = np.maximum(np.abs(w).max(1, keepdims=True) / E4M3_MAX, MIN_SCALE)
                    self.w[name] = round_e4m3(w / s) * s
                    self.fp8[module] = None

    def linear(self, x, module):
        if self.rounding and module in self.fp8:
            x = round_bf16(x)  # the GPU quantizes its bf16 activations
            static = self.fp8[module]
            if static is not None:
                s = np.full((x.shape[0], 1), static)
            else:
                amax = np.abs(x).max(1, keepdims=True)
                if self.scale_ub:
                    amax = np.minimum(amax, self.scale_ub)
                s = np.maximum(amax / E4M3_MAX, MIN_SCALE)
            x = round_e4m3(x / s) * s
        y = x @ self.w[f"{module}.weight"].T
        return y + self.w[f"{module}.bias"] if f"{module}.bias" in self.w else y

    def forward(self, ids):
        c, w = self.c, self.w
        H, Hk = c["num_attention_heads"], c["num_key_value_heads"]
        d = c.get("head_dim") or c["hidden_size"] // H
        eps = c["rms_norm_eps"]
        theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 1e4))
        L = len(ids)

        def norm(x, weight):
            return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight

        angles = np.outer(np.arange(L), 1.0 / theta ** (np.arange(0, d, 2) / d))
        cos, sin = np.cos(np.tile(angles, 2)), np.sin(np.tile(angles, 2))

        def rope(t):
            rotated = np.concatenate([-t[..., d // 2:], t[..., : d // 2]], -1)
            return t * cos[:, None] + rotated * sin[:, None]

        x = w["model.embed_tokens.weight"][ids]
        for layer in range(c["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            h = norm(x, w[p + "input_layernorm.weight"])
            if p + "self_attn.qkv_proj.weight" in w:
                qkv = self.linear(h, p + "self_attn.qkv_proj")
                q, k, v = np.split(qkv, [H * d, (H + Hk) * d], axis=1)
            else:
                q, k, v = (self.linear(h, p + f"self_attn.{n}_proj") for n in "qkv")
            q, k = rope(q.reshape(L, H, d)), rope(k.reshape(L, Hk, d))
            if self.kv_e4m3:
                ks = self.kv_scales.get(p + "self_attn.k_scale", 1.0)
                vs = self.kv_scales.get(p + "self_attn.v_scale", 1.0)
                k = round_e4m3(round_bf16(k) / ks) * ks
                v = round_e4m3(round_bf16(v) / vs) * vs
            elif self.kv_bf16:
                k, v = round_bf16(k), round_bf16(v)
            k = np.repeat(k, H // Hk, 1)
            v = np.repeat(v.reshape(L, Hk, d), H // Hk, 1)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
            scores = scores + np.triu(np.full((L, L), -np.inf), 1)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", probs, v).reshape(L, H * d)
            x = x + self.linear(attn, p + "self_attn.o_proj")
            h = norm(x, w[p + "post_attention_layernorm.weight"])
            if p + "mlp.gate_up_proj.weight" in w:
                gate, up = np.split(self.linear(h, p + "mlp.gate_up_proj"), 2, axis=1)
            else:
                gate, up = self.linear(h, p + "mlp.gate_proj"), self.linear(h, p + "mlp.up_proj")
            x = x + self.linear(gate / (1 + np.exp(-gate)) * up, p + "mlp.down_proj")
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return norm(x, w["model.norm.weight"]) @ head.T


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantize-weights", action="store_true",
                    help="round a bf16 fixture's projection weights to e4m3 per row first")
    ap.add_argument("--kv-cache-only", action="store_true",
                    help="float64 projections; round only the cached keys and values to e4m3")
    ap.add_argument("--kv-cache-bf16", action="store_true",
                    help="float64 projections; round only the cached keys and values to bf16")
    ap.add_argument("fixtures", nargs="+")
    args = ap.parse_args()
    for name in args.fixtures:
        d = os.path.join(FIXTURES, name)
        prompts, want = fixture_cases(d)
        exact = Model(d, False, False)
        check = max(rel_err(exact.forward(np.array(p)), ref) for p, ref in zip(prompts, want))
        if check > 1e-5:
            raise SystemExit(f"{name}: the float64 forward is {check:.1e} from the reference; "
                             "this fixture's layout is not one this script covers")
        if args.kv_cache_only or args.kv_cache_bf16:
            model = Model(d, False, False, kv_e4m3=args.kv_cache_only,
                          kv_bf16=args.kv_cache_bf16)
        else:
            model = Model(d, True, args.quantize_weights)
        errs = [rel_err(model.forward(np.array(p)), ref) for p, ref in zip(prompts, want)]
        what = ("e4m3 KV cache" if args.kv_cache_only else
                "bf16 KV cache" if args.kv_cache_bf16 else "FP8")
        print(f"{name:12s} unrounded {check:.1e}; {what} cases " +
              " ".join(f"{e:.3e}" for e in errs) + f"; worst {max(errs):.3e}")


if __name__ == "__main__":
    main()
