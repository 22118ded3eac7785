"""Golden fixtures at the head sizes between 64 and 128: Phi-3-mini's head_dim 96 and head_dim 80,
tiny random HF models + logits computed by HF transformers in float64.
usage: make_fixtures_head_dims.py OUTDIR SEED      (testdata/fixtures: SEED 9680, transformers 5.17)

phi3-d96 is Phi-3-mini's attention at tiny width: as many kv heads as q heads (no GQA), head_dim
96 = hidden / heads, a sliding window (Phi-3-mini-4k's is 2047 keys; 48 here, so the 130- and
300-token cases cross it). gemma2-d80 is Gemma 2 with head_dim 80: a sliding window on layer 0,
attention logit soft-cap, GQA 4 q heads / 2 kv heads. As make_fixtures_families.py: one seed for
both, every parameter non-trivial, bf16 weights, the reference from a fresh float64 load of the
saved checkpoint with eager attention."""
import os, sys, json
from transformers import Gemma2Config, Phi3Config
from fixture_common import make_bf16_fixture
out, seed = sys.argv[1], int(sys.argv[2])
base = dict(vocab_size=512, intermediate_size=512, num_hidden_layers=2, max_position_embeddings=1024,
            rms_norm_eps=1e-5, initializer_range=0.08, bos_token_id=1, eos_token_id=2, pad_token_id=0)
specs = {
  "phi3-d96":   (Phi3Config,   dict(base, hidden_size=384, num_attention_heads=4, num_key_value_heads=4,
                                    sliding_window=48, tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
  "gemma2-d80": (Gemma2Config, dict(base, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=80, query_pre_attn_scalar=80, sliding_window=32,
                                    layer_types=["sliding_attention", "full_attention"],
                                    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
summary = {}
for name, (C, kw) in specs.items():
    summary[name] = make_bf16_fixture(out, name, C, kw, seed)
    print(name, "head_dim", json.load(open(os.path.join(out, name, "config.json"))).get("head_dim"), flush=True)
print(json.dumps(summary)[:3000])
