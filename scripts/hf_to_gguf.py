#!/usr/bin/env python3
"""Converts a small Hugging Face checkpoint folder (config.json + model.safetensors, such as the
fixtures in testdata/fixtures/) into a GGUF file the way llama.cpp's convert_hf_to_gguf.py does,
so that pagedlm's GGUF reading can be checked against the checkpoint's HF reference logits.

Names come from gguf-py (the `gguf` package of the llama.cpp project) rather than from pagedlm:
tensor names from gguf.get_tensor_name_map / gguf.MODEL_TENSOR, metadata keys through
GGUFWriter's add_* methods (gguf.Keys). What each architecture gets follows convert_hf_to_gguf.py:
  * llama (LlamaForCausalLM, MistralForCausalLM): Q/K rows permuted so that each head's two rope
    halves interleave; vocab_size and rope.dimension_count; a llama3 rope is written as the
    rope_freqs tensor of per-frequency divisors rather than as metadata.
  * qwen2, qwen3: the common keys; yarn rope scaling as rope.scaling.* keys.
  * gemma2: norm weights stored as 1 + w; logit soft-caps and the sliding window; no lm_head
    (Gemma ties it to the embeddings).
  * gemma3: norm weights stored as 1 + w; rope.freq_base is the global layers' theta and
    rope.freq_base_swa the sliding layers'; the sliding window; the final soft-cap when set.
    Nothing says which layers slide: llama.cpp fixes the pattern (every 6th layer is global).
  * phi3: fused attn_qkv and ffn_up (gate and up) kept as HF stores them; sliding_window 0 when
    the config has none (llama.cpp's marker for "no window"); rope.scaling.original_context_length.
  * qwen3moe (Qwen3MoeForCausalLM) and llama (MixtralForCausalLM): each layer's per-expert
    matrices stacked into one 3-D tensor per projection ([experts, rows, cols]); expert_count and
    expert_used_count, and Qwen3-MoE's expert_feed_forward_length.

One deviation: real converted files carry the tokenizer, whose token list tells the vocabulary
size. The fixtures have no tokenizer, so every file gets {arch}.vocab_size instead (a key
llama.cpp reads for any architecture).

Usage: hf_to_gguf.py MODEL_DIR OUT.gguf [--type f32|q8_0|q8_0-as-f32]
(q8_0-as-f32: the values a Q8_0 file holds, dequantized by gguf-py and stored as F32.)
Requires numpy and gguf (see tests/gguf_families_test.py for the pinned versions).
"""
import argparse
import json
import math
import re
import struct
import sys
from pathlib import Path

import numpy as np

import gguf

# HF class -> llama.cpp architecture.
ARCHITECTURES = {
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "MistralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
    "Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2,
    "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3,
    "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3,
    "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE,
    "MixtralForCausalLM": gguf.MODEL_ARCH.LLAMA,
}

# A per-expert HF weight: layer, MLP prefix, expert, projection.
EXPERT_WEIGHT = re.compile(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")


def read_safetensors(path):
    """{name: float32 array} of a safetensors file (F32, F16 and BF16 tensors)."""
    data = Path(path).read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    body = memoryview(data)[8 + header_len:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = body[start:end]
        dtype = info["dtype"]
        if dtype == "F32":
            a = np.frombuffer(raw, dtype="<f4")
        elif dtype == "F16":
            a = np.frombuffer(raw, dtype="<f2").astype(np.float32)
        elif dtype == "BF16":
            # bfloat16 is the upper half of a float32: widening is exact.
            a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"{path}: tensor {name} has dtype {dtype}, not F32/F16/BF16")
        out[name] = a.reshape(info["shape"]).astype(np.float32)
    return out


def rope_parameters(config):
    """The global layers' rope parameters, from transformers 5's rope_parameters (for Gemma 3 its
    "full_attention" entry) or the Hub's rope_theta + rope_scaling, as convert_hf_to_gguf.py
    normalizes them."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params = dict(params.get("full_attention", params))
    if "rope_theta" not in params and "rope_theta" in config:
        params["rope_theta"] = config["rope_theta"]
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params["type"]
    return params


def sliding_rope_theta(config):
    params = config.get("rope_parameters") or {}
    if "sliding_attention" in params:
        return params["sliding_attention"].get("rope_theta")
    return config.get("rope_local_base_freq")


def permute(w, n_head, n_head_kv):
    """llama.cpp's LlamaModel.permute: each head's rows [first half; second half] become
    interleaved pairs, the layout of llama.cpp's rope (adjacent dimensions rotate together)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def llama3_rope_divisors(params, head_dim):
    """convert_hf_to_gguf.py's rope_freqs for a llama3 rope: inv_freq[i] is divided by it.
    llama.cpp reads original_max_position_embeddings from the top of the config (default 8192);
    transformers keeps it with the other rope parameters, which is where HF's model reads it, so
    that is taken here."""
    base = params.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor = params.get("factor", 8.0)
    low_freq_factor = params.get("low_freq_factor", 1.0)
    high_freq_factor = params.get("high_freq_factor", 4.0)
    old_context_len = params.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    divisors = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_freq_wavelen:
            divisors.append(1.0)
        elif wavelen > low_freq_wavelen:
            divisors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def write_common_keys(w, config, params):
    """TextModel.set_gguf_parameters: dimensions, rope base and scaling, epsilon, head size."""
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    if "num_key_value_heads" in config:
        w.add_head_count_kv(config["num_key_value_heads"])
    rope_type = params.get("rope_type")
    factor = params.get("factor")
    if rope_type == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif rope_type == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        if params.get("extrapolation_factor") is not None:
            w.add_rope_scaling_yarn_ext_factor(params["extrapolation_factor"])
        attn_factor = params.get("attention_factor", params.get("attn_factor"))
        if attn_factor is not None:
            w.add_rope_scaling_yarn_attn_factor(attn_factor)
        if params.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(params["beta_fast"])
        if params.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(params["beta_slow"])
    elif rope_type not in (None, "default", "llama3"):
        raise ValueError(f"rope_type {rope_type!r} is not handled here")
    if params.get("rope_theta") is not None:
        w.add_rope_freq_base(params["rope_theta"])
    if (local := sliding_rope_theta(config)) is not None:
        w.add_rope_freq_base_swa(local)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim") is not None:
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])


def write_metadata(w, arch, config):
    params = rope_parameters(config)
    if arch == gguf.MODEL_ARCH.PHI3:
        # Phi3MiniModel writes its own keys and not the common ones.
        n_embd, n_head = config["hidden_size"], config["num_attention_heads"]
        rot_pct = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        w.add_context_length(config["max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(config["intermediate_size"])
        w.add_block_count(config["num_hidden_layers"])
        w.add_head_count(n_head)
        w.add_head_count_kv(config["num_key_value_heads"])
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
        w.add_rope_dimension_count(int(rot_pct * n_embd) // n_head)
        w.add_rope_freq_base(params["rope_theta"])
        w.add_sliding_window(config.get("sliding_window") or 0)
        if params.get("rope_type") not in (None, "default"):
            raise ValueError("Phi-3 long-context rope scaling is not handled here")
    elif arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3):
        # Gemma2Model and Gemma3Model: the keys below, Gemma 3 after the common ones.
        if arch == gguf.MODEL_ARCH.GEMMA3:
            write_common_keys(w, config, params)
        else:
            w.add_context_length(config["max_position_embeddings"])
            w.add_embedding_length(config["hidden_size"])
            w.add_block_count(config["num_hidden_layers"])
            w.add_feed_forward_length(config["intermediate_size"])
            w.add_head_count(config["num_attention_heads"])
            w.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
            w.add_layer_norm_rms_eps(config["rms_norm_eps"])
            w.add_key_length(config["head_dim"])
            w.add_value_length(config["head_dim"])
            w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
            w.add_final_logit_softcapping(config["final_logit_softcapping"])
        if arch == gguf.MODEL_ARCH.GEMMA3:
            if config.get("attn_logit_softcapping") is not None:
                raise ValueError("Gemma 3 has no attention logit soft-cap")
            if config.get("final_logit_softcapping"):
                w.add_final_logit_softcapping(config["final_logit_softcapping"])
            if config.get("sliding_window_pattern") == 1:
                raise ValueError("a Gemma 3 config without sliding layers is not handled here")
        w.add_sliding_window(config["sliding_window"])
    else:
        write_common_keys(w, config, params)
        if arch == gguf.MODEL_ARCH.LLAMA:
            head_dim = config.get("head_dim") or config["hidden_size"] // config[
                "num_attention_heads"]
            w.add_rope_dimension_count(head_dim)
    # TextModel.set_gguf_parameters (experts) and Qwen2MoeModel's expert size.
    if (n_experts := config.get("num_local_experts", config.get("num_experts"))) is not None:
        w.add_expert_count(n_experts)
        w.add_expert_used_count(config["num_experts_per_tok"])
    if arch == gguf.MODEL_ARCH.QWEN3MOE:
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    # See the module docstring: the token list that would give the vocabulary size is missing.
    w.add_vocab_size(config["vocab_size"])


def tensors_to_write(arch, config, hf):
    """(GGUF name, float32 array) in HF order, transformed as convert_hf_to_gguf.py does."""
    n_layers = config["num_hidden_layers"]
    n_head = config["num_attention_heads"]
    n_head_kv = config.get("num_key_value_heads", n_head)
    names = gguf.get_tensor_name_map(arch, n_layers)
    gemma = arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3)
    out = []
    # convert_hf_to_gguf.py merges each layer's experts, in expert order, into one tensor named
    # as HF's without the expert index.
    experts = {}
    for name in list(hf):
        if m := EXPERT_WEIGHT.fullmatch(name):
            merged = f"model.layers.{m[1]}.{m[2]}.experts.{m[4]}.weight"
            experts.setdefault(merged, {})[int(m[3])] = hf.pop(name)
    for merged, by_expert in experts.items():
        hf[merged] = np.stack([by_expert[e] for e in range(len(by_expert))])
    for name, data in hf.items():
        if gemma and name == "lm_head.weight":
            continue  # convert_hf_to_gguf.py skips it: llama.cpp ties Gemma's output
        if gemma and name.endswith("norm.weight"):
            data = data + 1  # Gemma's RMSNorm multiplies by (1 + w)
        if arch == gguf.MODEL_ARCH.LLAMA:
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                data = permute(data, n_head, n_head)
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                data = permute(data, n_head, n_head_kv)
        new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise ValueError(f"gguf-py has no {arch.name} name for tensor {name}")
        out.append((new_name, data))
    params = rope_parameters(config)
    if arch == gguf.MODEL_ARCH.LLAMA and params.get("rope_type") == "llama3":
        head_dim = config.get("head_dim") or config["hidden_size"] // n_head
        out.append((gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                    llama3_rope_divisors(params, head_dim)))
    return out


def convert(model_dir, out_path, out_type="f32"):
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    hf_arch = config["architectures"][0]
    if hf_arch not in ARCHITECTURES:
        raise ValueError(f"{hf_arch} is not one of {sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[hf_arch]
    hf = read_safetensors(model_dir / "model.safetensors")

    w = gguf.GGUFWriter(str(out_path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(model_dir.name)
    write_metadata(w, arch, config)
    q8 = out_type in ("q8_0", "q8_0-as-f32")
    as_f32 = out_type != "q8_0"
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if as_f32 else gguf.LlamaFileType.MOSTLY_Q8_0)
    for name, data in tensors_to_write(arch, config, hf):
        data = np.ascontiguousarray(data, dtype=np.float32)
        # As llama.cpp's converter: 1-D tensors (norms, biases, rope factors) stay F32.
        if q8 and data.ndim in (2, 3) and data.shape[-1] % 32 == 0:
            qtype = gguf.GGMLQuantizationType.Q8_0
            blocks = gguf.quants.quantize(data, qtype)
            if as_f32:  # the values Q8_0 holds, dequantized by gguf-py
                w.add_tensor(name, gguf.quants.dequantize(blocks, qtype).reshape(data.shape))
            else:
                w.add_tensor(name, blocks, raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--type", choices=["f32", "q8_0", "q8_0-as-f32"], default="f32")
    args = parser.parse_args()
    convert(args.model_dir, args.out, args.type)
    return 0


if __name__ == "__main__":
    sys.exit(main())
