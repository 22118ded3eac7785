"""Golden fixtures of the families beyond make_fixtures.py's: Gemma 2, Gemma 3, Phi-3, YaRN Qwen3,
Qwen3-MoE and Mixtral. Tiny random HF models + logits computed by HF transformers in float64.
usage: make_fixtures_families.py OUTDIR SEED      (testdata/fixtures: SEED 4242, transformers 5.17)

As make_fixtures.py: one seed for every fixture, every parameter non-trivial (norm weights around
1.0 +/- 0.2, Gemma's stored as w - 1 since its RMSNorm multiplies by 1 + w), bf16 weights, and the
reference computed from a fresh float64 load of the saved checkpoint with eager attention (and
eager experts for the mixtures of experts)."""
import os, sys, json
from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config, Qwen3Config, Qwen3MoeConfig, MixtralConfig
from fixture_common import make_bf16_fixture
out, seed = sys.argv[1], int(sys.argv[2])
base = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            rms_norm_eps=1e-5, initializer_range=0.08, bos_token_id=1, eos_token_id=2, pad_token_id=0)
gemma = dict(base, head_dim=64, query_pre_attn_scalar=64, sliding_window=32,
             layer_types=["sliding_attention", "full_attention"], hidden_activation="gelu_pytorch_tanh",
             tie_word_embeddings=True)
specs = {
  "gemma2":     (Gemma2Config,     dict(gemma, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
  "gemma3":     (Gemma3TextConfig, dict(gemma, attn_logit_softcapping=None, final_logit_softcapping=None,
                                        rope_parameters={
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
  "phi3":       (Phi3Config,       dict(base, tie_word_embeddings=False,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
  "qwen3-yarn": (Qwen3Config,      dict(base, head_dim=64, max_position_embeddings=512, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 8.0,
                                                         "original_max_position_embeddings": 64})),
  "qwen3-moe":  (Qwen3MoeConfig,   dict(base, head_dim=64, tie_word_embeddings=True, num_experts=8,
                                        num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
  "mixtral":    (MixtralConfig,    dict(base, intermediate_size=128, tie_word_embeddings=False, num_local_experts=4,
                                        num_experts_per_tok=2,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}
moe = {"qwen3-moe", "mixtral"}
summary = {}
for name, (C, kw) in specs.items():
    summary[name] = make_bf16_fixture(out, name, C, kw, seed, experts=name in moe)
    print(name, json.load(open(os.path.join(out, name, "config.json"))).get("rope_parameters"), flush=True)
print(json.dumps(summary)[:3000])
