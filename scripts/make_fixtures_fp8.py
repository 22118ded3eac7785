"""Golden fixtures of FP8 checkpoints, one per layout the Hub's FP8 writers use, each stored as
that writer stores it (config.json's quantization_config, e4m3 weights, scale tensors by their
names, shapes and dtypes), with float64 reference logits of the dequantized weights.
usage: make_fixtures_fp8.py OUTDIR SEED      (testdata/fixtures: SEED 4242, transformers 5.17)

  fp8-tensor   LlamaForCausalLM, quant_method fp8 as AutoFP8 writes it: per-tensor f32
               weight_scale and static input_scale (scalars), ignored_layers [lm_head]
  fp8-block    Qwen3ForCausalLM, quant_method fp8 with weight_block_size [32, 32] as Qwen3-FP8 /
               DeepSeek-V3: f32 weight_scale_inv per block, dynamic activations; quantized by
               transformers' own Fp8Quantize, and transformers' own CPU dequantization checked
               against this script's
  ct-mixed     MistralForCausalLM, compressed-tensors float-quantized: attention per-tensor
               weights with static per-tensor inputs, gate/up per-channel with dynamic per-token
               inputs, down_proj 32x32 blocks; bf16 scales; kv_cache_scheme with k_scale/v_scale
  fbgemm       Phi3ForCausalLM (fused qkv_proj, gate_up_proj), fbgemm_fp8: f32 per-channel
               weight_scale [rows, 1], activation_scale_ub 1200

Quantization follows each format's rule: scale = max|w| / 448 over the scale's tensor, row or
block, e4m3 = w / scale rounded to nearest even by torch, saturated at +-448. The reference is a
fresh float64 from_pretrained of the same model with every FP8 weight replaced by e4m3 x scale,
computed in float64 (exact: 4 + 24 significant bits), eager attention."""
import os, sys, json, random, shutil, tempfile, types
import torch
from safetensors.torch import save_file, load_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, MistralConfig, Phi3Config
from fixture_common import save_random_model, reference_cases

out, seed = sys.argv[1], int(sys.argv[2])
E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
base = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
            rms_norm_eps=1e-5, initializer_range=0.08, bos_token_id=1, eos_token_id=2, pad_token_id=0)
rope = {"rope_type": "default", "rope_theta": 10000.0}


def quantize(w, scale):
    """e4m3 of w / scale (scale broadcast over w), saturated as every writer does."""
    return torch.clamp(w.float() / scale.float(), -E4M3_MAX, E4M3_MAX).to(E4M3)


def amax_scale(amax, dtype):
    return (torch.where(amax > 0, amax, torch.ones_like(amax)) / E4M3_MAX).to(dtype)


def per_tensor(w, dtype):
    s = amax_scale(w.float().abs().amax(), dtype)
    return quantize(w, s), s


def per_channel(w, dtype):
    s = amax_scale(w.float().abs().amax(dim=1, keepdim=True), dtype)
    return quantize(w, s), s


def per_block(w, br, bc, dtype):
    r, c = w.shape
    tiles = w.float().reshape(r // br, br, c // bc, bc)
    s = amax_scale(tiles.abs().amax(dim=(1, 3)), dtype)
    q = quantize(tiles, s[:, None, :, None]).reshape(r, c)
    return q, s


def dequantize64(q, s):
    """e4m3 x scale in float64, the scale expanded over its tensor, row or block."""
    r, c = q.shape
    s = s.double()
    if s.numel() > 1 and s.dim() == 2 and s.shape[1] != 1:   # blocks
        s = s.repeat_interleave(r // s.shape[0], 0).repeat_interleave(c // s.shape[1], 1)
    return q.double() * s.reshape(-1, 1) if s.dim() == 1 else q.double() * s


def fineg_quantize(key, w, block):
    """transformers' FineGrainedFP8 quantizer (what from_pretrained(quantization_config=
    FineGrainedFP8Config) runs on a GPU), called on the CPU."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    quantizer = types.SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=block))
    got = Fp8Quantize(quantizer)._quantize_one(key, w)
    return got[key], got[key[:-len(".weight")] + ".weight_scale_inv"]


def is_projection(name):
    return name.endswith("_proj.weight")


def build(name, C, kw, quant_config, quantize_one, extra=None):
    torch.manual_seed(seed); rng = random.Random(seed)
    cfg = C(**kw)
    d = os.path.join(out, name)
    model, _ = save_random_model(cfg, d, torch.bfloat16)
    state = load_file(os.path.join(d, "model.safetensors"))
    stored, deq = {}, {}
    for k, v in state.items():
        deq[k] = v.double()
        stored[k] = v
        if not is_projection(k):
            continue
        tensors = quantize_one(k, v)   # {name: tensor} as the format stores them
        stored.pop(k)
        stored.update(tensors)
        scale = next(t for n, t in tensors.items() if n.endswith(("weight_scale", "weight_scale_inv")))
        deq[k] = dequantize64(tensors[k], scale)
    if extra:
        stored.update(extra(state))
    save_file({k: v.contiguous() for k, v in stored.items()}, os.path.join(d, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quant_config
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    # The reference: the dequantized weights in float64, loaded fresh as a user would load them.
    with tempfile.TemporaryDirectory() as tmp:
        model.config.save_pretrained(tmp)
        save_file({k: v.contiguous() for k, v in deq.items()}, os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt"})
        ref = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float64, attn_implementation="eager").eval()
    tensors, meta = reference_cases(ref, rng, cfg.vocab_size, greedy_len_in_meta=False)
    save_file(tensors, os.path.join(d, "expected.safetensors"))
    info = {"name": name, "hf_class": type(model).__name__, "weights_dtype": "float8_e4m3fn + scales",
            "quantization_config": quant_config,
            "reference": "HF transformers %s, eager attention, float64, dequantized weights (fresh load)"
                         % __import__("transformers").__version__,
            "cases": meta, "notes": "case2 shares its first 33 tokens with case1; case5 is 300 tokens"}
    with open(os.path.join(d, "expected.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(name, [c["min_margin"] for c in meta], flush=True)
    return d, deq


def fp8_tensor(k, w):
    q, s = per_tensor(w, torch.float32)
    # A calibrated activation scale, as AutoFP8 stores it: a float32 scalar.
    m = k[:-len(".weight")]
    return {k: q, m + ".weight_scale": s.reshape(()), m + ".input_scale": torch.tensor(0.05, dtype=torch.float32)}


def fp8_block(k, w):
    q, s = fineg_quantize(k, w, [32, 32])
    return {k: q, k[:-len(".weight")] + ".weight_scale_inv": s}


def ct_mixed(k, w):
    m = k[:-len(".weight")]
    if ".self_attn." in k:
        q, s = per_tensor(w, torch.bfloat16)
        return {k: q, m + ".weight_scale": s.reshape(1), m + ".input_scale": torch.tensor([0.04], dtype=torch.bfloat16)}
    if k.endswith("down_proj.weight"):
        q, s = per_block(w, 32, 32, torch.bfloat16)
    else:
        q, s = per_channel(w, torch.bfloat16)
    return {k: q, m + ".weight_scale": s}


def ct_kv_scales(state):
    out = {}
    for k in state:
        if k.endswith("self_attn.q_proj.weight"):
            m = k[:-len("q_proj.weight")]
            out[m + "k_scale"] = torch.tensor(0.02, dtype=torch.bfloat16)
            out[m + "v_scale"] = torch.tensor(0.01, dtype=torch.bfloat16)
    return out


def fbgemm(k, w):
    q, s = per_channel(w, torch.float32)
    return {k: q, k[:-len(".weight")] + ".weight_scale": s}


float8 = lambda strategy, dynamic, **more: dict(num_bits=8, type="float", strategy=strategy, symmetric=True,
                                                 dynamic=dynamic, group_size=None, block_structure=None, **more)
specs = {
    "fp8-tensor": (LlamaConfig, dict(base, tie_word_embeddings=False, rope_parameters=rope),
                   {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
                   fp8_tensor, None),
    "fp8-block": (Qwen3Config, dict(base, tie_word_embeddings=True, rope_parameters=rope),
                  {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [32, 32], "modules_to_not_convert": ["lm_head"]},
                  fp8_block, None),
    "ct-mixed": (MistralConfig, dict(base, tie_word_embeddings=False, sliding_window=None, rope_parameters=rope),
                 {"quant_method": "compressed-tensors", "format": "float-quantized",
                  "quantization_status": "compressed", "ignore": ["lm_head"],
                  "kv_cache_scheme": float8("tensor", False),
                  "config_groups": {
                      "group_0": {"targets": ["re:.*self_attn\\.(q|k|v|o)_proj$"],
                                  "weights": float8("tensor", False),
                                  "input_activations": float8("tensor", False)},
                      "group_1": {"targets": ["re:.*mlp\\.(gate|up)_proj$"],
                                  "weights": float8("channel", False),
                                  "input_activations": float8("token", True)},
                      "group_2": {"targets": ["re:.*mlp\\.down_proj$"],
                                  "weights": dict(float8("block", False), block_structure=[32, 32]),
                                  "input_activations": float8("token", True)}}},
                 ct_mixed, ct_kv_scales),
    "fbgemm": (Phi3Config, dict(base, tie_word_embeddings=False, rope_parameters=rope),
               {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
               fbgemm, None),
}
for name, (C, kw, qc, fn, extra) in specs.items():
    d, deq = build(name, C, kw, qc, fn, extra)
    if name == "fp8-block":
        # transformers dequantizes the saved checkpoint itself on a CPU (FineGrainedFP8's
        # Fp8Dequantize: e4m3 x weight_scale_inv in float32): its weights must be ours.
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).state_dict()
        for k, v in deq.items():
            if is_projection(k):
                err = ((hf[k].double() - v).abs() / v.abs().clamp(min=1e-30)).max().item()
                assert err <= 2.0 ** -24, (k, err)
        print("fp8-block: transformers' own dequantization agrees to float32 rounding", flush=True)
