"""Shared helpers for the server tests: start `pagedlm serve` on a free loopback port, talk
HTTP with the standard library, and read /metrics."""

import argparse
import http.client
import importlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

SKIP = 77  # ctest's SKIP_RETURN_CODE for these tests


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pagedlm", required=True, help="the pagedlm binary")
    parser.add_argument("--model", default="", help="model path (default: the SmolLM2 GGUF)")
    return parser.parse_args()


class Server:
    """`pagedlm serve` on 127.0.0.1 and an OS-chosen port, stopped on exit."""

    def __init__(self, binary, model="", extra=()):
        cmd = [binary, "serve", "--host", "127.0.0.1", "--port", "0", "--threads", "2"]
        if model:
            cmd += ["--model", model]
        cmd += list(extra)
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.log = []
        deadline = time.time() + 120
        while True:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("server exited: " + "".join(self.log))
            self.log.append(line)
            match = re.search(r"serving (\S+) on http://127\.0\.0\.1:(\d+)", line)
            if match:
                self.model, self.port = match.group(1), int(match.group(2))
                break
            if time.time() > deadline:
                raise RuntimeError("server did not start")
        threading.Thread(target=self._drain, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.port}"

    def _drain(self):
        for line in self.proc.stderr:
            self.log.append(line)

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        assert self.proc.returncode == 0, f"server exit code {self.proc.returncode}"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.alive():
            self.stop()


def request(server, method, path, body=None, headers=None, raw=None, timeout=60):
    """Returns (status, headers, body bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    hdrs = {"Content-Type": "application/json"}
    hdrs.update(headers or {})
    conn.request(method, path, body=data, headers=hdrs)
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), payload


def raw_request(server, head, body_parts=(), timeout=30):
    """Sends `head` (bytes, as is) and then each of `body_parts` over a plain socket, stopping
    when the server closes its end, and returns (status, headers with lowercase names, body
    bytes) of the final response (after any "100 Continue"). For requests http.client will
    not send."""

    def final(received):
        while re.match(rb"HTTP/1\.1 1\d\d ", received) and b"\r\n\r\n" in received:
            received = received.partition(b"\r\n\r\n")[2]
        return received

    sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    received = b""
    try:
        sock.sendall(head)
        for part in body_parts:
            sock.sendall(part)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed before taking everything
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                break
            received += data
            head_text, blank, rest = final(received).partition(b"\r\n\r\n")
            length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head_text)
            if blank and length and len(rest) >= int(length.group(1)):
                break
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    head_text, _, rest = final(received).partition(b"\r\n\r\n")
    lines = head_text.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), received[:200]
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.setdefault(name.strip().lower(), value.strip())
    return int(lines[0].split()[1]), headers, rest


def rss_bytes(server):
    """The server's resident memory."""
    with open(f"/proc/{server.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def post_json(server, path, body, headers=None):
    status, _, payload = request(server, "POST", path, body, headers)
    return status, json.loads(payload)


def sse_events(server, path, body, headers=None):
    """Streams a request; returns the parsed `data:` payloads (the last one is '[DONE]')."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    hdrs = {"Content-Type": "application/json"}
    hdrs.update(headers or {})
    conn.request("POST", path, body=json.dumps(body).encode(), headers=hdrs)
    resp = conn.getresponse()
    assert resp.status == 200, (resp.status, resp.read())
    events = []
    for line in resp:
        line = line.decode().rstrip("\n")
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            if data == "[DONE]":
                break
    conn.close()
    return events


def metrics(server):
    status, _, payload = request(server, "GET", "/metrics")
    assert status == 200
    values = {}
    for line in payload.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def wait_idle(server, timeout=60):
    """Waits until no request runs or waits; returns the metrics then."""
    deadline = time.time() + timeout
    while True:
        m = metrics(server)
        if m["pagedlm_num_requests_running"] == 0 and m["pagedlm_num_requests_waiting"] == 0:
            return m
        if time.time() > deadline:
            raise AssertionError(f"server not idle after {timeout}s: {m}")
        time.sleep(0.2)


def run_checks(checks):
    """Runs named checks in order, printing each; exits 1 on the first failure."""
    for name, fn in checks:
        start = time.time()
        try:
            fn()
        except Exception:
            print(f"FAIL {name}", flush=True)
            raise
        print(f"ok   {name} ({time.time() - start:.1f}s)", flush=True)


def skip(reason):
    print("SKIP: " + reason)
    sys.exit(SKIP)


def install_pinned(requirements, target, what):
    """Installs `requirements` (pip's hash-checked requirements text: wheels pinned by version and
    sha256) into the folder `target` and puts it first on sys.path; skips the test when pip
    cannot install them."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(requirements)
    try:
        pip = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--require-hashes",
             "--only-binary=:all:", "--upgrade", "--target", str(target), "-r", f.name],
            capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if pip.returncode != 0:
        skip(f"{what} not installed and pip could not install them:\n" + pip.stderr[-2000:])
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
    importlib.invalidate_caches()


def root():
    return os.geteuid() == 0
