#!/usr/bin/env python3
"""Writes a bf16 GGUF with random weights in the shape of a Llama-architecture config.json, so that
llama.cpp and pagedlm can be benchmarked on the same file where no checkpoint can be carried (a GPU
host reaches no model hub, and 16 GB does not travel).

  python3 scripts/gpu_host/random_gguf.py configs/llama-3.1-8b.json OUT.gguf --gguf-py DIR

--gguf-py is llama.cpp's gguf-py folder (pure Python + numpy). The vocabulary is synthetic: a
SentencePiece-style list (unk, bos, eos, the 256 byte tokens, then placeholders) of the config's
vocab_size, enough for benchmarks that feed token ids. The values are N(0, 0.02) in bf16; one
random block is tiled over each tensor, since only the shapes matter for speed. The norms' weights
are ones in f32, as llama.cpp's converter writes one-dimensional tensors (its CPU backend cannot
multiply f32 by bf16).
"""
import argparse
import json
import sys

import numpy as np


def bf16(values):
    """float32 -> bf16 bits, rounded to nearest even."""
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--gguf-py", required=True, help="llama.cpp's gguf-py folder")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sys.path.insert(0, args.gguf_py)
    import gguf  # noqa: E402  (found through --gguf-py)

    cfg = json.load(open(args.config))
    if cfg.get("model_type") not in ("llama", "mistral"):
        sys.exit(f"random_gguf: model_type {cfg.get('model_type')!r}: only Llama-shaped configs")
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim", hidden // heads)
    vocab = cfg["vocab_size"]

    rng = np.random.default_rng(args.seed)
    block = bf16(rng.normal(0.0, 0.02, size=1 << 22))

    def tiled(shape):
        return np.resize(block, int(np.prod(shape))).reshape(shape)

    w = gguf.GGUFWriter(args.out, "llama")
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-5)))
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(vocab - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (vocab - 259)
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    bf = gguf.GGMLQuantizationType.BF16

    def add(name, shape):
        w.add_tensor(name, tiled(shape), raw_dtype=bf)

    def add_norm(name, size):
        w.add_tensor(name, np.ones(size, dtype=np.float32))

    add("token_embd.weight", (vocab, hidden))
    for i in range(layers):
        p = f"blk.{i}."
        add_norm(p + "attn_norm.weight", hidden)
        add(p + "attn_q.weight", (heads * head_dim, hidden))
        add(p + "attn_k.weight", (kv_heads * head_dim, hidden))
        add(p + "attn_v.weight", (kv_heads * head_dim, hidden))
        add(p + "attn_output.weight", (hidden, heads * head_dim))
        add_norm(p + "ffn_norm.weight", hidden)
        add(p + "ffn_gate.weight", (inter, hidden))
        add(p + "ffn_up.weight", (inter, hidden))
        add(p + "ffn_down.weight", (hidden, inter))
    add_norm("output_norm.weight", hidden)
    if not cfg.get("tie_word_embeddings", False):
        add("output.weight", (vocab, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
