"""What the golden fixtures' generators share (scripts/make_fixtures.py,
scripts/make_fixtures_families.py): a tiny random HF model with every parameter made
non-trivial, saved, reloaded in float64, and its six reference cases."""
import os
import torch
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
