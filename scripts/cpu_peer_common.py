"""What the CPU peer scripts (cpu_peer_bench.py, cpu_accuracy.py) share: how to install the pinned
llama.cpp peer, running a command with its failure reported by the caller's fail(), and the
pagedlm binary and model file they run."""
import os
import shlex
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# llama-cpp-python built from source for this CPU (scripts/requirements-cpu-peer.txt says why).
LLAMA_CPP_INSTALL = (
    '  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS=-mno-amx-int8 '
    '-DCMAKE_CXX_FLAGS=-mno-amx-int8" pip install --no-cache-dir --require-hashes --no-binary '
    "llama-cpp-python -r scripts/requirements-cpu-peer.txt")


def run(argv, what, fail, timeout=3600):
    """argv's stdout; fail(message) when it cannot start, runs past timeout s or exits non-zero."""
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        fail(f"{what} ran past {timeout} s: {shlex.join(argv)[:300]}")
    except OSError as e:
        fail(f"{what} could not start: {e}")
    if p.returncode != 0:
        fail(f"{what} failed (exit {p.returncode}): {shlex.join(argv)[:300]}\n{p.stderr[-3000:]}")
    return p.stdout


def check_binary_and_model(pagedlm, model, fail):
    """The model file to run (the default model through scripts/fetch_model.sh when model is
    None); fail(message) without an executable pagedlm or the model file."""
    if not (os.path.isfile(pagedlm) and os.access(pagedlm, os.X_OK)):
        fail(f"no pagedlm binary at {pagedlm}: build it with\n"
             "  cmake -S . -B build -DPAGEDLM_CUDA=OFF -DPAGEDLM_TESTS=OFF && "
             "cmake --build build -j2 --target pagedlm")
    if model is None:
        model = run([os.path.join(ROOT, "scripts", "fetch_model.sh")],
                    "scripts/fetch_model.sh", fail).strip().splitlines()[-1]
    if not os.path.isfile(model):
        fail(f"no model file at {model}")
    return model
