#!/usr/bin/env python3
"""The HF transformers peer for `pagedlm bench --dummy CONFIG`: the same config with random bf16
weights, the same workloads, measured as generated tokens / wall seconds.

    python3 scripts/gpu_host/hf_peer.py configs/gemma-2-9b.json [--workload random] [--padded]

Workloads as scripts/gpu_host/bench.sh runs them: random (256 requests, prompts of 100-1024
tokens, 256 generated each) and shared-prefix (128 x (2000 + 32) -> 64); --num-requests takes
fewer (compare with `pagedlm bench --num-requests` of the same count). Continuous batching is
HF's generate_batch with attn_implementation "paged|sdpa"; where HF cannot run it (it raises),
the error is printed and --padded measures HF's padded generate (batches of 64) instead.
Prints one JSON line per measurement.

--tp runs HF's own tensor parallelism (from_pretrained with tp_plan="auto") under torchrun:

    torchrun --nproc-per-node 2 scripts/gpu_host/hf_peer.py configs/llama-3.1-8b.json --tp

tp_plan needs a checkpoint on disk: rank 0 draws the random model on its GPU once and saves it
under the temporary folder (hf-tp-CONFIG, ~16 GB for the 8B shape; a 70B shape does not fit one
GPU to draw it), then every rank loads its shard. Only rank 0 prints.
"""
import argparse
import json
import os
import random
import tempfile
import time
import traceback

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig


def workload(name, vocab, num_requests):
    rng = random.Random(1)
    if name == "random":
        prompts = [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(100, 1024))]
                   for _ in range(num_requests or 256)]
        return prompts, 256
    prefix = [rng.randrange(10, 1000) for _ in range(2000)]
    return [prefix + [rng.randrange(10, 1000) for _ in range(32)]
            for _ in range(num_requests or 128)], 64


def make(config_path, attn, tp=False):
    with open(config_path) as f:
        cfg = AutoConfig.for_model(**json.load(f))
    torch.manual_seed(0)
    if not tp:
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16,
                                                     attn_implementation=attn)
        return model.eval(), cfg
    name = os.path.splitext(os.path.basename(config_path))[0]
    path = os.path.join(tempfile.gettempdir(), f"hf-tp-{name}")
    if torch.distributed.get_rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(path)
        del model
        torch.cuda.empty_cache()
    torch.distributed.barrier()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 attn_implementation=attn, tp_plan="auto")
    return model.eval(), cfg


def continuous_batching(model, prompts, max_new):
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=prompts[:8], generation_config=gc, progress_bar=False)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=gc, progress_bar=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    tokens = sum(len(getattr(v, "generated_tokens", None) or v.get("generated_tokens", []))
                 for v in out.values())
    return tokens, dt


def padded(model, prompts, max_new, batch=64):
    tokens = 0
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device="cuda")
        o = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                           min_new_tokens=max_new, do_sample=False, pad_token_id=0,
                           eos_token_id=None)
        tokens += (o.shape[1] - width) * len(chunk)
    torch.cuda.synchronize()
    return tokens, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--workload", default="random", choices=["random", "shared-prefix"])
    ap.add_argument("--num-requests", type=int, default=0,
                    help="requests (default: the workload's 256 or 128), as bench --num-requests")
    ap.add_argument("--padded", action="store_true", help="also measure padded generate")
    ap.add_argument("--tp", action="store_true",
                    help="HF's tensor parallelism (tp_plan=auto), under torchrun")
    args = ap.parse_args()
    rank = 0
    if args.tp:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local))
        rank = torch.distributed.get_rank()
    runs = [("hf-cb paged|sdpa", "paged|sdpa", continuous_batching)]
    if args.padded:
        runs.append(("hf-generate padded sdpa bs64", "sdpa", padded))
    for label, attn, fn in runs:
        if args.tp:
            label += f" tp_plan=auto x{torch.distributed.get_world_size()}"
        result = {"config": args.config, "workload": args.workload, "peer": label,
                  "gpu": torch.cuda.get_device_name()}
        try:
            t = time.perf_counter()
            model, cfg = make(args.config, attn, args.tp)
            if rank == 0:
                print(f"{label}: model built in {time.perf_counter() - t:.1f} s", flush=True)
            prompts, max_new = workload(args.workload, cfg.vocab_size, args.num_requests)
            if fn is padded:
                prompts = prompts[:128]  # padded generate is slow: half the requests
            tokens, dt = fn(model, prompts, max_new)
            result.update(gen_tokens=tokens, s=round(dt, 2), tok_s=round(tokens / dt, 1))
            del model
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001: the peer's failure is the measurement
            traceback.print_exc()
            result["error"] = repr(e)[:400]
        if rank == 0:
            print(json.dumps(result), flush=True)
    if args.tp:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
