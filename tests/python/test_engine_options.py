"""LLM's engine options that mirror the command line's --dtype, --kv-cache-dtype, --quantization,
--async-scheduling, --gguf-blocks, --no-cascade-attention and --no-gemm-tuning: accepted, reaching
the engine where the CPU shows it, and refused with the command line's own message."""

import re
import subprocess

import pytest

from conftest import ROOT, THREADS

import pagedlm
from pagedlm import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "The three primary colors are"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=16)
DUMMY_CONFIG = ROOT / "testdata" / "fixtures" / "llama3-rope" / "config.json"


def texts(outputs):
    return [o.outputs[0].text for o in outputs]


def engine(**options):
    return pagedlm.LLM(device="cpu", threads=THREADS, kv_cache_bytes=64 << 20, **options)


def cli_refusal(binary, *flags):
    """What `pagedlm generate` says on stderr when it refuses the flags (it must refuse them)."""
    p = subprocess.run([binary, "generate", "--device", "cpu", "--threads", str(THREADS),
                        "--prompt", "x", "--max-tokens", "1", *flags],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode != 0, p.stdout
    return p.stderr


def refused_as_the_cli_refuses(binary, message, flag, value):
    """The CLI refuses `flag value` saying message; LLM(option=value) raises it as ValueError."""
    assert message in cli_refusal(binary, flag, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        engine(**{flag[2:].replace("-", "_"): value})


def test_async_scheduling_on_the_cpu_gives_the_outputs_of_synchronous_steps(llm):
    # The fixture's engine runs the CPU's default, synchronous steps (async_scheduling=None).
    expected_greedy = texts(llm.generate(PROMPTS, GREEDY))
    expected_seeded = texts(llm.generate(PROMPTS, SEEDED))
    for setting in (True, False):
        other = engine(async_scheduling=setting)
        try:
            assert texts(other.generate(PROMPTS, GREEDY)) == expected_greedy, setting
            assert texts(other.generate(PROMPTS, SEEDED)) == expected_seeded, setting
            # Streams see the same text when steps run ahead of their stop checks.
            streamed = "".join(d.outputs[0].text for d in other.stream(PROMPTS[1], GREEDY))
            assert streamed == expected_greedy[1], setting
        finally:
            other.close()
    with pytest.raises(ValueError, match=r"async_scheduling must be True, False or None .*'on'"):
        engine(async_scheduling="on")
    with pytest.raises(ValueError, match="async_scheduling must be True, False or None"):
        engine(async_scheduling=1)


def test_kv_cache_dtype_is_refused_as_the_cli_refuses_it(binary):
    # The CPU's cache holds f32 or bf16: fp8 is refused by the engine, with its message.
    with pytest.raises(ValueError, match=re.escape(
            "--kv-cache-dtype fp8 is GPU only (the CPU's attention reads f32 and bf16 caches)")):
        engine(kv_cache_dtype="fp8")
    # bf16 reaches the engine: twice the pages in the same bytes, and it generates.
    auto, bf16 = engine(kv_cache_dtype="auto"), engine(kv_cache_dtype="bf16")
    try:
        pages = auto.cache_info()["pages_total"]
        assert bf16.cache_info()["pages_total"] in (2 * pages, 2 * pages + 1)
        assert bf16.generate(PROMPTS[0], GREEDY)[0].outputs[0].text
    finally:
        auto.close()
        bf16.close()
    # An unknown name: the message `pagedlm --kv-cache-dtype fp16` gives.
    refused_as_the_cli_refuses(binary, "--kv-cache-dtype fp16: not auto, bf16 or fp8",
                               "--kv-cache-dtype", "fp16")
    # The default, named.
    explicit = engine(kv_cache_dtype="auto")
    try:
        assert explicit.generate(PROMPTS[0], GREEDY)[0].outputs[0].text
    finally:
        explicit.close()


def test_dtype_is_refused_as_the_cli_refuses_it(binary, llm):
    # The CPU's kernels compute in float32 only: another dtype is refused before any load.
    refused_as_the_cli_refuses(binary, "the CPU computes in f32, not in bf16 (--dtype",
                               "--dtype", "bfloat16")
    refused_as_the_cli_refuses(binary, "--dtype fp16: not auto, float32, bfloat16 or float16",
                               "--dtype", "fp16")
    # float32 named is the default.
    expected = texts(llm.generate(PROMPTS, GREEDY))
    named = engine(dtype="float32")
    try:
        assert texts(named.generate(PROMPTS, GREEDY)) == expected
    finally:
        named.close()


def test_quantization_is_refused_as_the_cli_refuses_it(binary):
    with pytest.raises(ValueError, match=re.escape(
            "FP8 weights (--quantization fp8) are a GPU option: the CPU computes in float32")):
        engine(quantization="fp8")
    refused_as_the_cli_refuses(
        binary, "--quantization int4: not auto, fp8, none or a GGUF block format",
        "--quantization", "int4")
    # A block format names dummy weights' blocks; a model file keeps its own.
    refused_as_the_cli_refuses(binary, "--quantization q8_0: block formats make --dummy weights",
                               "--quantization", "q8_0")


def test_quantization_none_and_cuda_only_options_keep_the_cpus_outputs(llm):
    # On the CPU these change nothing: the default model has no FP8 weights, and GGUF blocks,
    # cascade attention and GEMM tuning are the GPU's. They are taken, and the answers stay.
    expected = texts(llm.generate(PROMPTS, GREEDY))
    other = engine(quantization="none", gguf_blocks=True, use_cascade_attention=False,
                   tune_gemms=False)
    try:
        assert texts(other.generate(PROMPTS, GREEDY)) == expected
    finally:
        other.close()


def test_quantization_block_format_makes_dummy_weights_of_blocks():
    # 8-bit activations need projections in Q4_1 / Q8_0 blocks: dummy weights are bf16 unless
    # quantization names a block format, which the engine then multiplies in integers.
    with pytest.raises(ValueError, match=re.escape(
            "8-bit activations (--cpu-q8-activations) need a GGUF with projection weights")):
        pagedlm.LLM(str(DUMMY_CONFIG), load_format="dummy", device="cpu", threads=THREADS,
                    kv_cache_bytes=64 << 20, cpu_q8_activations=True)
    blocks = pagedlm.LLM(str(DUMMY_CONFIG), load_format="dummy", quantization="q8_0",
                         device="cpu", threads=THREADS, kv_cache_bytes=64 << 20,
                         cpu_q8_activations=True)
    try:
        out = blocks.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=5, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 5
    finally:
        blocks.close()


def test_fixed32_activations_take_the_same_checks_and_blocks():
    # 32-bit fixed-point activations go through the same integer kernels: refused without blocks
    # and together with 8-bit ones, and on dummy Q8_0 blocks the same greedy tokens as the exact
    # kernels (both are exact to float32 rounding).
    with pytest.raises(ValueError, match=re.escape(
            "32-bit fixed-point activations (--cpu-fixed32-activations) need a GGUF")):
        pagedlm.LLM(str(DUMMY_CONFIG), load_format="dummy", device="cpu", threads=THREADS,
                    kv_cache_bytes=64 << 20, cpu_fixed32_activations=True)
    with pytest.raises(ValueError, match="choose one"):
        pagedlm.LLM(str(DUMMY_CONFIG), load_format="dummy", quantization="q8_0", device="cpu",
                    threads=THREADS, kv_cache_bytes=64 << 20, cpu_q8_activations=True,
                    cpu_fixed32_activations=True)
    tokens = []
    for fixed32 in (False, True):
        llm = pagedlm.LLM(str(DUMMY_CONFIG), load_format="dummy", quantization="q8_0",
                          device="cpu", threads=THREADS, kv_cache_bytes=64 << 20,
                          cpu_fixed32_activations=fixed32)
        try:
            out = llm.generate([[1, 2, 3, 4]],
                               SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
            tokens.append(out[0].outputs[0].token_ids)
        finally:
            llm.close()
    assert len(tokens[1]) == 5
    assert tokens[1] == tokens[0]
