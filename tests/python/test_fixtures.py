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
