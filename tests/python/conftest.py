"""Shared fixtures of the Python package's tests (run by ctest's python_api_py, which puts the
built package on PYTHONPATH and names the pagedlm binary in PAGEDLM_BINARY).

The default model (SmolLM2-135M-Instruct, scripts/fetch_model.sh) must be there: LLM() raises
FileNotFoundError without it, and every test that uses it fails saying so."""

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))  # the server tests' helpers (safetensors reading, tolerances)

import pagedlm  # noqa: E402

# The machine's cores at most: the tests run beside other work on 2-core machines.
THREADS = min(2, os.cpu_count() or 1)


@pytest.fixture(scope="session")
def llm():
    """The default model on the CPU, shared by the tests that only read from it."""
    engine = pagedlm.LLM(device="cpu", threads=THREADS, kv_cache_bytes=256 << 20)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def binary():
    path = os.environ.get("PAGEDLM_BINARY")
    assert path and os.access(path, os.X_OK), "PAGEDLM_BINARY must name the built pagedlm binary"
    return path
