#!/usr/bin/env python3
"""Tensor parallelism on GPUs when something goes wrong: every case must end every rank with a
clear error, and none may hang.

  1. rank 1 is killed (SIGKILL) while the group decodes: rank 0 must end, naming rank 1;
  2. rank 0 is killed while the group decodes: rank 1 must end;
  3. rank 1 says another group size: both must end, rank 0 naming the sizes;
  4. rank 1 loads another model: both must end, rank 0 saying the models differ;
  5. (on a host with fewer GPUs than ranks) the default launch refuses with the GPU count.

    python3 scripts/gpu_host/tp_failures.py --pagedlm build-gpu/pagedlm [--share-gpu]

Ranks are started by hand here, on GPUs 0 and 1 or, with --share-gpu, both on GPU 0 with their
own NCCL_HOSTID (see tp_fixtures.py). Prints one row per case and exits 1 when any fails.
"""
import argparse
import os
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_fixtures import free_port, rank_by_hand  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "testdata", "fixtures")
DEADLINE_S = 60  # how long a rank may take to end once its peer is gone or refused


class Rank:
    """A rank's process and, read by a thread as it comes, its stderr."""

    def __init__(self, cmd, env):
        self.proc = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    def stderr(self):
        return "".join(self.lines)

    def wait(self, timeout):
        """The exit code, or None after killing a process still running at the timeout."""
        try:
            self.proc.wait(timeout=max(0.1, timeout))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.reader.join()
            return None
        self.reader.join()
        return self.proc.returncode


def start_group(binary, args_of_rank, share_gpu):
    """args_of_rank[r]: rank r's pagedlm arguments (with the group size it believes in); returns
    the started Ranks."""
    endpoint = f"127.0.0.1:{free_port()}"
    ranks = []
    for r, args in enumerate(args_of_rank):
        i = args.index("--tensor-parallel-size")
        flags, env = rank_by_hand(r, int(args[i + 1]), endpoint, share_gpu, 0.2)
        ranks.append(Rank([binary] + args[:i] + args[i + 2:] + flags + ["--device", "cuda"], env))
    return ranks


def wait_all(ranks, deadline_s):
    """(exit codes, None for a rank killed at the deadline; seconds until the last ended)."""
    t0 = time.monotonic()
    codes = [r.wait(deadline_s - (time.monotonic() - t0)) for r in ranks]
    return codes, time.monotonic() - t0


def last_line(text):
    lines = [l for l in text.replace("\r", "\n").splitlines() if l.strip()]
    return lines[-1][:160] if lines else "(nothing)"


def decoding_group(binary, share_gpu):
    """Two ranks of a Qwen3-0.6B-shaped model (random weights) decoding for minutes: (the Ranks,
    whether rank 0 finished its first timed run within 5 minutes, so that they decode steadily).
    The runs are short: ranks sharing one GPU over sockets take ~0.26 s a decode step."""
    bench = ["bench", "--dummy", os.path.join(ROOT, "configs", "qwen3-0.6b.json"),
             "--tensor-parallel-size", "2", "--num-requests", "8", "--prompt-max", "128",
             "--output-min", "32", "--output-max", "32", "--warmup", "1", "--repeat", "100"]
    ranks = start_group(binary, [bench, bench], share_gpu)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 300 and "requests done" not in ranks[0].stderr():
        if any(r.proc.poll() is not None for r in ranks):
            break
        time.sleep(0.2)
    return ranks, "requests done" in ranks[0].stderr()


def case_killed(binary, share_gpu, victim):
    ranks, decoding = decoding_group(binary, share_gpu)
    if not decoding:
        for r in ranks:
            r.wait(0)
        return False, f"the group never decoded: {last_line(ranks[0].stderr())}"
    ranks[victim].proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    survivor = ranks[1 - victim]
    code = survivor.wait(DEADLINE_S)
    took = time.monotonic() - killed_at
    ranks[victim].wait(DEADLINE_S)
    if code is None:
        return False, f"rank {1 - victim} still running {DEADLINE_S} s after rank {victim} died"
    err = survivor.stderr()
    ok = code != 0 and (victim == 0 or f"rank {victim}" in err)
    return ok, f"rank {1 - victim} exit {code} after {took:.1f} s: {last_line(err)}"


def replaced(args, flag, value):
    i = args.index(flag)
    return args[:i + 1] + [value] + args[i + 2:]


def case_refused(binary, share_gpu, flag, value, want):
    base = ["generate", "--model", os.path.join(FIXTURES, "llama-gqa"), "--tokens", "1 2 3",
            "--max-tokens", "4", "--tensor-parallel-size", "2"]
    ranks = start_group(binary, [base, replaced(base, flag, value)], share_gpu)
    codes, took = wait_all(ranks, DEADLINE_S)
    errs = [r.stderr() for r in ranks]
    ok = all(c not in (0, None) for c in codes) and want in errs[0]
    return ok, (f"exits {codes} after {took:.1f} s; rank 0: {last_line(errs[0])}; "
                f"rank 1: {last_line(errs[1])}")


def case_too_few_gpus(binary):
    gpus = len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
               .stdout.strip().splitlines())
    cmd = [binary, "generate", "--model", os.path.join(FIXTURES, "llama-gqa"), "--tokens", "1 2",
           "--max-tokens", "2", "--device", "cuda", "--tensor-parallel-size", str(gpus + 1)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE_S)
    ok = p.returncode != 0 and "GPU(s) are visible" in p.stderr
    return ok, f"{gpus + 1} ranks on {gpus} GPU(s): exit {p.returncode}: {last_line(p.stderr)}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pagedlm", required=True, help="the pagedlm binary (a CUDA build with NCCL)")
    ap.add_argument("--share-gpu", action="store_true",
                    help="both ranks on GPU 0, NCCL over loopback sockets (a one-GPU host)")
    args = ap.parse_args()
    b, s = args.pagedlm, args.share_gpu
    cases = [
        ("rank 1 killed while decoding", lambda: case_killed(b, s, 1)),
        ("rank 0 killed while decoding", lambda: case_killed(b, s, 0)),
        ("rank 1 in a group of 4", lambda: case_refused(
            b, s, "--tensor-parallel-size", "4", "rank 1 was started with 4 ranks")),
        ("rank 1 with another model", lambda: case_refused(
            b, s, "--model", os.path.join(FIXTURES, "qwen3-qknorm"), "another model")),
        ("more ranks than GPUs", lambda: case_too_few_gpus(b)),
    ]
    failed = 0
    for name, run in cases:
        try:
            ok, what = run()
        except Exception as e:  # a case that cannot even run is a failure, not a crash
            ok, what = False, f"{type(e).__name__}: {e}"
        failed += not ok
        print(f"{name:30s} {'ok' if ok else 'FAIL':4s}  {what}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
