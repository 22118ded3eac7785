#!/usr/bin/env python3
"""The Python package's overhead over the CLI on one GPU, same build, same run.

Batch: `pagedlm bench --dummy CONFIG --repeat R` (the random workload: 256 requests, prompts of
100-1024 tokens, 256 new tokens each, after 8 warm-up requests) against the very same requests
(pagedlm._pagedlm.benchmark_workload, the bench's own generator) through one
`LLM(CONFIG, load_format="dummy").generate(...)` call per repeat; output tok/s = generated tokens /
wall time from the first submission to the last output, as the bench counts it. Both sample at
--temperature (default 0, greedy, the bench's default; SamplingParams' default is vLLM's 1.0):
sampling at 1.0 costs a step more than an argmax does (on a CPU most of a step of a small
model), a cost that is no part of the binding's overhead, so the two sides must agree.
Single stream: `pagedlm bench --num-requests 1` (a 512-token prompt, 256 new tokens) against
`LLM.stream()` of the same request: decode tok/s from the second token to the last (the bench:
its decode steps over their time; stream(): tokens after the first delta over the time from the
first delta to the last).

  PYTHONPATH=build-gpu/python python3 scripts/gpu_host/python_overhead.py \\
      --pagedlm build-gpu/pagedlm [--config configs/smollm2-135m.json] [--repeat 2]
A table comes last; --json FILE writes every number.
"""
import argparse
import json
import subprocess
import time

import pagedlm
from pagedlm import SamplingParams

RANDOM = dict(kind="random", num_requests=256, seed=0, prompt_min=100, prompt_max=1024,
              output_min=256, output_max=256, prefix_len=0, unique_len=0, warmup=8)
SINGLE = dict(RANDOM, num_requests=1, prompt_min=512, prompt_max=512, warmup=2)


TEMPERATURE = [0.0]  # --temperature, for both sides


def bench_params(max_tokens):
    """A request's sampling as `pagedlm bench` has it: max_tokens exactly, at --temperature."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=TEMPERATURE[0])


def bench_cli(args, spec, repeat):
    cmd = [args.pagedlm, "bench", "--dummy", args.config, "--device", args.device, "--json",
           "--num-requests", str(spec["num_requests"]), "--seed", str(spec["seed"]),
           "--prompt-min", str(spec["prompt_min"]), "--prompt-max", str(spec["prompt_max"]),
           "--output-min", str(spec["output_min"]), "--output-max", str(spec["output_max"]),
           "--warmup", str(spec["warmup"]), "--repeat", str(repeat),
           "--temperature", str(TEMPERATURE[0])]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"pagedlm bench failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout)


def workload(llm, spec, variant):
    vocab = llm._model.vocab_size
    return pagedlm._pagedlm.benchmark_workload(vocab=vocab, token_variant=variant, **spec)


def warm_up(llm, spec):
    """The bench's untimed warm-up requests, as it runs them before its timed ones."""
    warm, _ = workload(llm, spec, 0)
    llm.generate([p for p, _ in warm],
                 [bench_params(n) for _, n in warm])


def python_batch(llm, spec, repeat):
    warm_up(llm, spec)
    runs = []
    for variant in range(repeat):
        _, timed = workload(llm, spec, variant)
        params = [bench_params(n) for _, n in timed]
        start = time.perf_counter()
        outs = llm.generate([p for p, _ in timed], params)
        wall = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        assert generated == sum(n for _, n in timed), "a request ended early"
        runs.append(generated / wall)
    return runs


def python_single(llm, spec, repeat):
    warm_up(llm, spec)
    runs = []
    for variant in range(repeat):
        _, timed = workload(llm, spec, variant)
        (prompt, n), = timed
        first = last = None
        tokens = 0
        for delta in llm.stream(prompt, bench_params(n)):
            got = len(delta.outputs[0].token_ids)
            now = time.perf_counter()
            if first is None:
                first, tokens = now, got - 1  # the first delta's first token is the prefill's
            else:
                tokens += got
            last = now
        runs.append(tokens / (last - first))
    return runs


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pagedlm", default="build-gpu/pagedlm")
    ap.add_argument("--config", default="configs/smollm2-135m.json")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    ap.add_argument("--num-requests", type=int, default=256, help="of the batch workload")
    ap.add_argument("--temperature", type=float, default=0.0, help="both sides' sampling")
    args = ap.parse_args()
    RANDOM["num_requests"] = args.num_requests
    TEMPERATURE[0] = args.temperature

    result = {"config": args.config, "temperature": args.temperature}
    # The CLI first, in processes of its own, then one LLM for both Python measurements.
    cli = bench_cli(args, RANDOM, args.repeat)
    result["cli_batch_tok_s"] = cli.get("repeat_output_tok_s", [cli["output_tok_s"]])
    result["cli_prompt_tokens"] = cli["prompt_tokens"]
    single = [bench_cli(args, SINGLE, 1) for _ in range(args.repeat)]
    result["cli_single_decode_tok_s"] = [s["decode_steps"] / s["decode_s"] for s in single]

    llm = pagedlm.LLM(args.config, load_format="dummy", device=args.device)
    _, timed = workload(llm, RANDOM, 0)
    result["python_prompt_tokens"] = sum(len(p) for p, _ in timed)
    result["python_batch_tok_s"] = python_batch(llm, RANDOM, args.repeat)
    result["python_single_decode_tok_s"] = python_single(llm, SINGLE, args.repeat)
    llm.close()

    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    same = result["cli_prompt_tokens"] == result["python_prompt_tokens"]
    print(f"{args.config}: the same workload on both sides: {same} "
          f"({result['cli_prompt_tokens']} / {result['python_prompt_tokens']} prompt tokens)")
    print(f"{'measure':34} {'CLI':>22} {'Python':>22} {'Python / CLI':>12}")
    for name, c, p in [("random 256, output tok/s", result["cli_batch_tok_s"],
                        result["python_batch_tok_s"]),
                       ("single stream, decode tok/s", result["cli_single_decode_tok_s"],
                        result["python_single_decode_tok_s"])]:
        fmt = lambda v: ", ".join(f"{x:.0f}" for x in v)  # noqa: E731
        ratio = (sum(p) / len(p)) / (sum(c) / len(c))
        print(f"{name:34} {fmt(c):>22} {fmt(p):>22} {ratio:12.3f}")


if __name__ == "__main__":
    main()
