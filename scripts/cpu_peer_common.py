"""What the CPU peer scripts (cpu_peer_bench.py, cpu_accuracy.py) share: how to install the pinned
llama.cpp peer, and running a command with its failure reported by the caller's fail()."""
import shlex
import subprocess

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
