#!/usr/bin/env python3
"""FP8 W8A8 accuracy on the GPU: a PyTorch W8A8 forward (torch._scaled_mm) of the fixture's own
checkpoint beside pagedlm's, both scored against the fixture's float64 logits in the same run.

    python3 scripts/gpu_host/fp8_torch_reference.py [--pagedlm build-gpu/pagedlm] [FIXTURE ...]

Default fixtures: the four FP8 checkpoints (fp8-tensor, fp8-block, ct-mixed, fbgemm), each with
its own e4m3 weights and scales; a bf16 fixture named on the command line (llama-gqa, ...) has
every projection quantized per output feature first, as `pagedlm --quantization fp8` does. The
model is HF transformers' own module tree in bf16 (config.json without its quantization_config),
its FP8 projections replaced by a module that quantizes its input to e4m3 and multiplies with
torch._scaled_mm in rowwise mode (one scale per input row x one per weight row, f32
accumulation, bf16 out):
  - an `input_scale` in the file: that static scale for every row, values clamped at +-448
    (AutoFP8 / compressed-tensors static);
  - else per token: max |x| over the row / 448 (at least 1 / (448 * 512)), max |x| clamped at
    activation_scale_ub where the config has one (fbgemm_fp8);
  - per-tensor weight scales repeated per row; per-channel ones as they are;
  - per-block weight scales (fp8-block, ct-mixed's down_proj) dequantized to bf16, the bf16
    module kept: pagedlm runs those dequantized as well (cuBLASLt scales by 128x128 blocks only,
    these are 32x32).
Each forward is scored by its relative Frobenius error against the float64 reference, worst and
mean over the cases. With --pagedlm, the binary's logits (its default for FP8 checkpoints, W8A8
where the GPU has FP8 tensor cores; --quantization fp8 for bf16 fixtures) are scored the same
way, and the script exits 1 where pagedlm's worst case is worse than torch's. Both are one draw
of FP8's roundings each: on these tiny random models a different draw (scripts/
fp8_w8a8_simulation.py: bf16 inputs or not) moves a fixture's worst case by a few percent of
itself, so a close verdict says little; a factor says something.

Needs torch (CUDA, a GPU with FP8 tensor cores), transformers, safetensors and numpy.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixture_accuracy import FIXTURES, fixture_cases, pagedlm_logits, rel_err  # noqa: E402

FP8_FIXTURES = ["fp8-tensor", "fp8-block", "ct-mixed", "fbgemm"]
E4M3_MAX = 448.0
MIN_SCALE = 1.0 / (448.0 * 512.0)


class W8A8Linear(torch.nn.Module):
    """y = x W^T + b with W in e4m3 ([out, in]) and per-row f32 scales, x quantized per call."""

    def __init__(self, weight_fp8, weight_scale, bias, input_scale, scale_ub):
        super().__init__()
        self.weight_fp8 = weight_fp8  # [out, in] float8_e4m3fn
        self.weight_scale = weight_scale.reshape(1, -1).float()  # [1, out]
        self.bias = bias
        self.input_scale = input_scale  # None: per token
        self.scale_ub = scale_ub

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.input_scale is not None:
            scale = self.input_scale.float().reshape(1, 1).expand(x2.shape[0], 1).contiguous()
        else:
            amax = x2.abs().amax(dim=-1, keepdim=True).float()
            if self.scale_ub:
                amax = amax.clamp(max=self.scale_ub)
            scale = (amax / E4M3_MAX).clamp(min=MIN_SCALE)
        xq = (x2.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, self.weight_fp8.t(), scale_a=scale, scale_b=self.weight_scale,
                             bias=self.bias, out_dtype=torch.bfloat16, use_fast_accum=False)
        return y.reshape(*shape[:-1], -1)


def quantize_per_row(w):
    """A bf16 / f32 weight [out, in] as e4m3 with one scale per output feature."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=MIN_SCALE)
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale.reshape(-1)


def set_module(model, name, module):
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def torch_w8a8_model(fixture_dir):
    with open(os.path.join(fixture_dir, "config.json")) as f:
        raw = json.load(f)
    quant = raw.get("quantization_config") or {}
    scale_ub = float(quant.get("activation_scale_ub", 0) or 0)
    config = AutoConfig.from_pretrained(fixture_dir)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    tensors = load_file(os.path.join(fixture_dir, "model.safetensors"))
    fp8_modules = sorted(n[:-len(".weight")] for n, t in tensors.items()
                         if t.dtype == torch.float8_e4m3fn)
    state = {}
    replaced = []
    for module in fp8_modules:
        w = tensors[f"{module}.weight"]
        scale = tensors.get(f"{module}.weight_scale", tensors.get(f"{module}.weight_scale_inv"))
        scale = scale.float()
        rows, cols = w.shape
        if scale.numel() == 1:
            row_scale = scale.reshape(1).expand(rows)
        elif scale.numel() == rows:
            row_scale = scale.reshape(rows)
        else:  # per block: dequantized, the bf16 module kept
            br, bc = rows // scale.shape[0], cols // scale.shape[1]
            full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)
            state[f"{module}.weight"] = (w.float() * full).to(torch.bfloat16)
            continue
        replaced.append((module, w, row_scale, tensors.get(f"{module}.input_scale")))
    state.update({n: t.to(torch.bfloat16) for n, t in tensors.items()
                  if t.dtype != torch.float8_e4m3fn and n.endswith((".weight", ".bias"))})
    if not fp8_modules:  # a bf16 fixture: every projection quantized per output feature
        for name, m in model.named_modules():
            # The lm_head and routers (mlp.gate) stay bf16, as in pagedlm.
            if isinstance(m, torch.nn.Linear) and name != "lm_head" \
                    and not name.endswith(".gate") \
                    and m.weight.shape[0] % 16 == 0 and m.weight.shape[1] % 16 == 0:
                w, row_scale = quantize_per_row(state[f"{name}.weight"])
                replaced.append((name, w, row_scale, None))
    missing, unexpected = model.load_state_dict(state, strict=False)
    replaced_names = {f"{m}.weight" for m, *_ in replaced}
    if getattr(config, "tie_word_embeddings", False):
        replaced_names.add("lm_head.weight")  # the embedding's, tied
    left = [k for k in missing if k not in replaced_names]
    if left or unexpected:
        raise SystemExit(f"{fixture_dir}: missing {left}, unexpected {unexpected}")
    model = model.to("cuda")
    for module, w, row_scale, input_scale in replaced:
        bias = state.get(f"{module}.bias")
        set_module(model, module, W8A8Linear(
            w.to("cuda"), row_scale.to("cuda"), None if bias is None else bias.to("cuda"),
            None if input_scale is None else input_scale.to("cuda"), scale_ub))
    model.eval()
    return model, bool(fp8_modules)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pagedlm", help="also score this pagedlm binary (a CUDA build)")
    ap.add_argument("fixtures", nargs="*", help=f"fixture names (default: {' '.join(FP8_FIXTURES)})")
    args = ap.parse_args()
    print(f"{'fixture':14s} {'torch W8A8 worst':>17s} {'mean':>10s} {'pagedlm worst':>14s} "
          f"{'mean':>10s}  verdict")
    worse = []
    for name in args.fixtures or FP8_FIXTURES:
        d = os.path.join(FIXTURES, name)
        prompts, want = fixture_cases(d)
        model, fp8_checkpoint = torch_w8a8_model(d)
        with torch.no_grad():
            got = [model(torch.tensor([p], device="cuda")).logits[0].double().cpu().numpy()
                   for p in prompts]
        del model
        torch.cuda.empty_cache()
        ref = [rel_err(g, w) for g, w in zip(got, want)]
        line = f"{name:14s} {max(ref):17.3e} {np.mean(ref):10.3e}"
        if args.pagedlm:
            mode = "auto" if fp8_checkpoint else "fp8"
            ours = [rel_err(g, w) for g, w in
                    zip(pagedlm_logits(args.pagedlm, d, prompts, [], mode), want)]
            ok = max(ours) <= max(ref)
            line += f" {max(ours):14.3e} {np.mean(ours):10.3e}  " + (
                "ok" if ok else "WORSE THAN TORCH W8A8")
            if not ok:
                worse.append(name)
        print(line)
    if worse:
        print("pagedlm is worse than torch's W8A8 on: " + " ".join(worse))
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
