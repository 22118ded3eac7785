"""Ctrl-C in `pagedlm generate` and `pagedlm bench`: the command stops at the next engine step,
prints what it has (generate: the text so far and an "interrupted" finish; bench: a line saying
so, and no numbers) and exits with status 130, as a shell reports a process that Ctrl-C ended."""

import os
import signal
import subprocess
import threading
import time

from server_harness import parse_args, run_checks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Command:
    """A pagedlm command whose stdout is read as it arrives."""

    def __init__(self, argv):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out = b""
        self.err = b""
        self.lock = threading.Lock()
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stdout, "out")),
                        threading.Thread(target=self._read, args=(self.proc.stderr, "err"))]
        for r in self.readers:
            r.start()

    def _read(self, pipe, name):
        while True:
            data = pipe.read1(4096)
            if not data:
                return
            with self.lock:
                setattr(self, name, getattr(self, name) + data)

    def stdout_so_far(self):
        with self.lock:
            return self.out

    def interrupt_and_wait(self, timeout):
        """SIGINT; returns (exit status, seconds until the process was gone)."""
        start = time.time()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running {timeout}s after SIGINT")
        gone = time.time() - start
        for r in self.readers:
            r.join(timeout=10)
        return self.proc.returncode, gone


def generate(pagedlm, model):
    """A streamed story: Ctrl-C once text has come; the text printed so far stays, the request
    ends as interrupted, the exit status is 130."""
    argv = [pagedlm, "generate", "--threads", "2", "--chat", "--temperature", "0",
            "--max-tokens", "4000",
            "--prompt", "Write a long story about a dragon who learns to fly."]
    if model:
        argv += ["--model", model]
    cmd = Command(argv)
    deadline = time.time() + 120
    while len(cmd.stdout_so_far()) < 40:
        assert cmd.proc.poll() is None, cmd.err.decode(errors="replace")
        assert time.time() < deadline, "no text after 120 s"
        time.sleep(0.05)
    before = cmd.stdout_so_far()
    status, gone = cmd.interrupt_and_wait(timeout=10)
    out, err = cmd.out.decode(errors="replace"), cmd.err.decode(errors="replace")
    print(f"     generate gone {gone:.2f}s after SIGINT, {len(cmd.out)} bytes of output",
          flush=True)
    assert status == 130, (status, err[-500:])
    assert cmd.out.startswith(before), (before, cmd.out[:200])
    assert "(finish: interrupted;" in out, out[-300:]
    assert "interrupted" in err, err[-300:]


def bench(pagedlm, _model):
    """A long random-weights run: Ctrl-C mid-run; a line says it was interrupted, no table or
    JSON is printed, the exit status is 130."""
    cmd = Command([pagedlm, "bench", "--threads", "2", "--json",
                   "--dummy", os.path.join(REPO, "configs", "smollm2-135m.json"),
                   "--num-requests", "64", "--prompt-min", "64", "--prompt-max", "128",
                   "--output-min", "256", "--output-max", "256", "--warmup", "2"])
    time.sleep(3)
    assert cmd.proc.poll() is None, "the run ended before the interrupt: make it longer"
    status, gone = cmd.interrupt_and_wait(timeout=10)
    out, err = cmd.out.decode(errors="replace"), cmd.err.decode(errors="replace")
    print(f"     bench gone {gone:.2f}s after SIGINT", flush=True)
    assert status == 130, (status, err[-500:])
    assert "interrupted" in err and "no results" in err, err[-300:]
    assert "output_tok_s" not in out and "tok/s" not in out, out[:300]


def main():
    args = parse_args()
    model = args.model or os.path.join(
        os.environ.get("PAGEDLM_CACHE", os.path.expanduser("~/.cache/pagedlm")),
        "SmolLM2-135M-Instruct.Q4_1.gguf")
    checks = [("Ctrl-C in bench", lambda: bench(args.pagedlm, args.model))]
    if os.path.exists(model):
        checks.insert(0, ("Ctrl-C in generate", lambda: generate(args.pagedlm, args.model)))
    else:
        print(f"note: no default model at {model}; generate's check is skipped", flush=True)
    run_checks(checks)


if __name__ == "__main__":
    main()
