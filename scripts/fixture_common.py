"""What the golden fixtures' generators share (scripts/make_fixtures.py,
scripts/make_fixtures_families.py, scripts/make_fixtures_head_dims.py): a tiny random HF model with
every parameter made non-trivial, saved, reloaded in float64, and its six reference cases."""
import json
import os
import random
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM


def save_random_model(config, out_dir, dtype, norm_mean=1.0, **reload_kwargs):
    """Draws the model from torch's current seed, sets norm weights to norm_mean +/- 0.2 and biases
    to +/- 0.1, saves it in `dtype` to out_dir and returns (saved model, float64 reload)."""
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for n, p in model.named_parameters():   # make every parameter non-trivial
            if "norm" in n: p.copy_(norm_mean + 0.2 * torch.randn_like(p))
            elif n.endswith("bias"): p.copy_(0.1 * torch.randn_like(p))
    model = model.to(dtype)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    # Reload from disk: model.to(bf16) above also rounded the rotary inv_freq buffer to bf16, which a
    # fresh load of the checkpoint does not do. The reference must be what a user of the checkpoint gets.
    ref = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float64, attn_implementation="eager",
                                               **reload_kwargs).eval()
    return model, ref


def reference_cases(ref, rng, vocab, greedy_len_in_meta):
    """The six prompts (drawn from rng: lengths 7, 40, 40 sharing 33 tokens, 130, 1, 300), each with
    its float64 logits and 12 greedy tokens with their top-1 - top-2 margins. Returns the tensors of
    expected.safetensors and the per-case summary of expected.json."""
    t = lambda n: [rng.randrange(3, vocab) for _ in range(n)]
    c1 = t(40); c2 = c1[:33] + t(7)
    prompts = [t(7), c1, c2, t(130), t(1), t(300)]
    tensors, meta = {}, []
    for i, p in enumerate(prompts):
        with torch.no_grad():
            logits = ref(torch.tensor([p])).logits[0]
            g, margins, cur = [], [], list(p)
            for _ in range(12):
                lg = ref(torch.tensor([cur])).logits[0, -1]
                top = torch.topk(lg, 2); g.append(int(top.indices[0])); margins.append(float(top.values[0] - top.values[1]))
                cur.append(g[-1])
        tensors[f"case{i}.prompt"] = torch.tensor(p, dtype=torch.int32)
        tensors[f"case{i}.logits"] = logits.to(torch.float32).contiguous()
        tensors[f"case{i}.greedy"] = torch.tensor(g, dtype=torch.int32)
        tensors[f"case{i}.greedy_margin"] = torch.tensor(margins, dtype=torch.float32)
        case = {"case": i, "prompt_len": len(p)}
        if greedy_len_in_meta: case["greedy_len"] = len(g)
        case.update(min_margin=min(margins), logit_std=float(logits.std()))
        meta.append(case)
    return tensors, meta


def make_bf16_fixture(out, name, config_class, config_kwargs, seed, experts=False):
    """One bf16 fixture in out/name, drawn from `seed`: the checkpoint, expected.safetensors and
    expected.json (the reference from a fresh float64 load, eager attention and, with experts,
    eager experts). Returns the per-case summary."""
    torch.manual_seed(seed); rng = random.Random(seed)
    cfg = config_class(**config_kwargs)
    d = os.path.join(out, name)
    # Gemma's RMSNorm multiplies by 1 + w: its checkpoints store w - 1.
    model, ref = save_random_model(cfg, d, torch.bfloat16, norm_mean=0.0 if name.startswith("gemma") else 1.0,
                                   **({"experts_implementation": "eager"} if experts else {}))
    tensors, meta = reference_cases(ref, rng, cfg.vocab_size, greedy_len_in_meta=False)
    save_file(tensors, os.path.join(d, "expected.safetensors"))
    info = {"name": name, "hf_class": type(model).__name__, "weights_dtype": "bfloat16",
            "reference": "HF transformers %s, eager attention, float64 (fresh load of the saved checkpoint)"
                         % __import__("transformers").__version__,
            "cases": meta, "notes": "case2 shares its first 33 tokens with case1; case5 is 300 tokens"}
    with open(os.path.join(d, "expected.json"), "w") as f:
        json.dump(info, f, indent=1)
    return meta
