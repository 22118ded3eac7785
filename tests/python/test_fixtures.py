"""Every golden fixture (testdata/fixtures: tiny HF checkpoints with HF transformers' float64
logits) through LLM.logits, to the golden_fixtures_test's float32 tolerance (relative Frobenius
error below 1e-4)."""

import pytest

from conftest import ROOT, THREADS
from gguf_families_test import TOLERANCE, read_safetensors, rel_error

import pagedlm

FIXTURES = sorted(p for p in (ROOT / "testdata" / "fixtures").iterdir()
                  if (p / "expected.safetensors").exists())
NUM_CASES = 6


def test_every_fixture_is_found():
    assert len(FIXTURES) >= 11, FIXTURES


@pytest.mark.parametrize("folder", FIXTURES, ids=lambda p: p.name)
def test_fixture_logits_match_reference(folder):
    expected = read_safetensors(folder / "expected.safetensors")
    prompts = [expected[f"case{i}.prompt"].astype(int).tolist() for i in range(NUM_CASES)]
    llm = pagedlm.LLM(str(folder), device="cpu", threads=THREADS, num_pages=256)
    try:
        got = llm.logits(prompts)
    finally:
        llm.close()
    assert len(got) == NUM_CASES
    for i in range(NUM_CASES):
        ref = expected[f"case{i}.logits"]
        assert got[i].shape == ref.shape, (folder.name, i)
        err = rel_error(got[i], ref)
        assert err < TOLERANCE, f"{folder.name} case {i}: relative error {err:.3g}"


# tensor_parallel_size reaches the engine: the model split over 2 CPU ranks (each fixture has 4
# q heads, 2 kv heads) still gives HF's float64 logits (a dense model and a mixture of experts).
@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-moe"])
def test_tensor_parallel_ranks_match_reference(name):
    folder = ROOT / "testdata" / "fixtures" / name
    expected = read_safetensors(folder / "expected.safetensors")
    prompts = [expected[f"case{i}.prompt"].astype(int).tolist() for i in range(NUM_CASES)]
    llm = pagedlm.LLM(str(folder), device="cpu", threads=THREADS, num_pages=256,
                      tensor_parallel_size=2)
    try:
        got = llm.logits(prompts)
    finally:
        llm.close()
    for i in range(NUM_CASES):
        err = rel_error(got[i], expected[f"case{i}.logits"])
        assert err < TOLERANCE, f"{name} at 2 ranks, case {i}: relative error {err:.3g}"


def test_tensor_parallel_size_the_model_cannot_split_is_refused():
    folder = ROOT / "testdata" / "fixtures" / "llama-gqa"
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide the 4 attention"):
        pagedlm.LLM(str(folder), device="cpu", threads=THREADS, num_pages=256,
                    tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1, got 0"):
        pagedlm.LLM(str(folder), device="cpu", threads=THREADS, tensor_parallel_size=0)
