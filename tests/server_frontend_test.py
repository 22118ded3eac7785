"""The event-driven front end under hostile clients, with default flags unless a check says
otherwise: connections that drip their head a byte at a time or sit idle do not stop /health or
completions for anyone else and are dropped at their deadline; 400 simultaneous requests see
503s with Retry-After rather than silent queueing; memory returns after large bodies; SIGTERM
drains (running requests end cleanly within --shutdown-timeout, /health says draining) and the
process exits; /metrics can be put behind the API key."""

import http.client
import json
import re
import resource
import selectors
import signal
import socket
import threading
import time

from server_harness import (Server, metrics, parse_args, post_json, request, rss_bytes,
                            run_checks, sse_events, wait_idle)

GOOD = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
CONCURRENT_BODIES = 64
MID_PREFILL_STREAMS = 31  # and the long prompt: 32 requests open at SIGTERM


def raise_fd_limit(want):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    return min(want, hard)


def connect(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setblocking(False)
    return s


def closed_by_server(sock):
    """True when the server has closed its end (EOF or reset), without blocking."""
    try:
        return sock.recv(4096) == b""
    except BlockingIOError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True


def timed(fn):
    start = time.time()
    result = fn()
    return result, time.time() - start


def completion_body(max_tokens, stream=False):
    return {"prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}


def slow_clients(pagedlm, model):
    """1,000 connections drip a request head one byte per 0.2 s and 1,000 more sit idle; a
    3 s --header-timeout. /health, a completion and a stream still answer promptly, and the
    server closes every slow connection at its deadline."""
    n_drip, n_idle = 1000, 1000
    if raise_fd_limit(n_drip + n_idle + 256) < n_drip + n_idle + 256:
        raise AssertionError("cannot open enough descriptors for the test")
    # All from one address: past the default share of one client.
    with Server(pagedlm, model, ["--header-timeout", "3",
                                 "--max-connections-per-client", "10000"]) as server:
        # Unloaded figures first.
        _, health_alone = timed(lambda: request(server, "GET", "/health"))
        (status, _), completion_alone = timed(
            lambda: post_json(server, "/v1/completions", completion_body(8)))
        assert status == 200
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 10\r\n")
        drips = [connect(server.port) for _ in range(n_drip)]
        idle = [connect(server.port) for _ in range(n_idle)]
        stop = threading.Event()

        def drip():
            i = 0
            while not stop.is_set():
                for s in drips:
                    try:
                        s.send(head[i % len(head):i % len(head) + 1])
                    except OSError:
                        pass  # closed by the server: what the check wants
                i += 1
                stop.wait(0.2)

        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        try:
            time.sleep(1.0)  # every slow connection has started its head
            for _ in range(3):
                (status, _, body), took = timed(lambda: request(server, "GET", "/health",
                                                                timeout=10))
                assert status == 200 and took < max(1.0, 10 * health_alone), (status, took)
            (status, body), took = timed(
                lambda: post_json(server, "/v1/completions", completion_body(8)))
            assert status == 200 and body["choices"][0]["text"], body
            assert took < 3 * completion_alone + 1.0, (took, completion_alone)
            events, took = timed(lambda: sse_events(server, "/v1/completions",
                                                    completion_body(8, stream=True)))
            assert events[-1] == "[DONE]" and took < 3 * completion_alone + 1.0, took
            # Past the 3 s head deadline (counted from each connection's start), every slow
            # connection was closed by the server, dripping or not.
            deadline = time.time() + 10
            while True:
                open_drips = sum(not closed_by_server(s) for s in drips)
                open_idle = sum(not closed_by_server(s) for s in idle)
                if open_drips == 0 and open_idle == 0:
                    break
                assert time.time() < deadline, (open_drips, open_idle)
                time.sleep(0.5)
        finally:
            stop.set()
            dripper.join()
            for s in drips + idle:
                s.close()
        assert server.alive()
        status, _, _ = request(server, "GET", "/health")
        assert status == 200


def slow_body(pagedlm, model):
    """A body that arrives too slowly is cut off at --body-timeout; the server keeps serving."""
    with Server(pagedlm, model, ["--body-timeout", "2"]) as server:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{")
        start = time.time()
        closed = False
        while time.time() - start < 6:
            try:
                s.sendall(b" ")
            except OSError:
                closed = True
                break
            s.settimeout(0.5)
            try:
                if s.recv(4096) == b"":
                    closed = True
                    break
            except socket.timeout:
                pass
            except OSError:
                closed = True
                break
        took = time.time() - start
        s.close()
        assert closed and 1.5 < took < 4, (closed, took)
        status, body = post_json(server, "/v1/completions", GOOD)
        assert status == 200, body


def framing(pagedlm, model):
    """What the errors test does not cover: a Transfer-Encoding other than chunked, and a head
    sent with bare line feeds or a bad request line, get 400 and a closed connection."""
    with Server(pagedlm, model) as server:
        def answer(raw):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(raw)
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            s.close()
            return data

        data = answer(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked"
                      b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
        assert data.startswith(b"HTTP/1.1 400 ") and b"Transfer-Encoding" in data, data
        data = answer(b"GET /health HTTP/1.1 extra\r\nHost: x\r\n\r\n")
        assert data.startswith(b"HTTP/1.1 400 "), data
        data = answer(b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: v\r\n\r\n")
        assert data.startswith(b"HTTP/1.1 400 "), data
        status, _, _ = request(server, "GET", "/health")
        assert status == 200


def overload(pagedlm, model):
    """400 requests sent at once to a server with default flags: some are refused with 503 and
    Retry-After (counted, not queued unseen), every other one is answered, and the server lives."""
    n = 400
    raise_fd_limit(n + 256)
    with Server(pagedlm, model) as server:
        body = json.dumps(completion_body(4)).encode()
        raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        socks = [socket.create_connection(("127.0.0.1", server.port), timeout=10)
                 for _ in range(n)]
        for s in socks:
            s.sendall(raw)
        sel = selectors.DefaultSelector()
        replies = {}
        for s in socks:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
            replies[s] = b""
        deadline = time.time() + 240
        open_count = n
        while open_count and time.time() < deadline:
            for key, _ in sel.select(timeout=1):
                data = key.fileobj.recv(65536)
                if data:
                    replies[key.fileobj] += data
                else:
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                    open_count -= 1
        assert open_count == 0, f"{open_count} requests unanswered"
        statuses = {}
        for data in replies.values():
            head, _, payload = data.partition(b"\r\n\r\n")
            status = int(head.split()[1])
            statuses[status] = statuses.get(status, 0) + 1
            if status == 503:
                retry = re.search(rb"\r\nRetry-After: (\d+)\r\n", head)
                assert retry and 1 <= int(retry.group(1)) <= 3600, head
                assert "overloaded" in json.loads(payload)["error"]["message"], payload
            else:
                assert status == 200, data[:300]
        print(f"     statuses of {n} simultaneous requests: {statuses}", flush=True)
        assert statuses.get(503, 0) > 0 and statuses.get(200, 0) > 0, statuses
        assert server.alive()
        wait_idle(server)


def large_bodies(pagedlm, model):
    """64 concurrent 8 MB bodies (the default --max-body-bytes): while they are held, RSS stays
    within 3 bodies' worth per request above idle (the body as read, its parsed JSON and the
    string the completion takes from it), and the memory is handed back afterwards."""
    # The KV pool's pages become resident as requests first use them (about 240 KB per new
    # page here), so a small pool, every page of which the warm-up uses, keeps that growth out
    # of the measurement.
    with Server(pagedlm, model, ["--num-pages", "64"]) as server:
        # Warm: 5 rounds of 64 concurrent small requests touch all 64 pages and grow the
        # engine's batch buffers as the large ones will.
        for _ in range(5):
            warm = [threading.Thread(target=post_json, args=(server, "/v1/completions",
                                                             {**GOOD, "max_tokens": 1}))
                    for _ in range(CONCURRENT_BODIES)]
            for t in warm:
                t.start()
            for t in warm:
                t.join()
        idle = rss_bytes(server)
        pad = "x" * ((8 << 20) - 200)
        body = json.dumps({**GOOD, "max_tokens": 1, "user": pad}).encode()
        assert len(body) <= 8 << 20
        results = []

        def one():
            status, _, _ = request(server, "POST", "/v1/completions", raw=body, timeout=120)
            results.append(status)

        peak = [idle]
        threads = [threading.Thread(target=one) for _ in range(CONCURRENT_BODIES)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            peak[0] = max(peak[0], rss_bytes(server))
            time.sleep(0.05)
        assert results == [200] * CONCURRENT_BODIES, results
        after = rss_bytes(server)
        print(f"     RSS idle {idle >> 20} MB, peak {peak[0] >> 20} MB, after {after >> 20} MB",
              flush=True)
        # The stated bound while held; within 10% of idle after, from a peak of hundreds of MB
        # above it.
        assert peak[0] <= idle + CONCURRENT_BODIES * 3 * len(body), (idle, peak[0])
        assert peak[0] > idle + (128 << 20), "the bodies were never held: the check proves nothing"
        assert after <= idle * 1.1, (idle, peak[0], after)


def shutdown(pagedlm, model):
    """SIGTERM with 8 streams and a non-streaming request open, --shutdown-timeout 2: /health on
    an open connection says draining, new connections are refused, each stream ends with
    finish_reason "abort" and [DONE], the non-streaming request gets a 503 error, and the
    process is gone within the drain time plus 2 s."""
    with Server(pagedlm, model, ["--shutdown-timeout", "2"]) as server:
        long_body = {**completion_body(4000), "ignore_eos": True}
        streams, plain = [], []

        def stream():
            streams.append(sse_events(server, "/v1/completions", {**long_body, "stream": True}))

        def non_streaming():
            plain.append(request(server, "POST", "/v1/completions", long_body, timeout=60))

        keep = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        keep.request("GET", "/health")
        assert keep.getresponse().read() == b'{"status":"ok"}'
        threads = [threading.Thread(target=stream) for _ in range(8)]
        threads.append(threading.Thread(target=non_streaming))
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while metrics(server)["pagedlm_num_requests_running"] < 9:
            assert time.time() < deadline, "the requests did not start"
            time.sleep(0.1)
        start = time.time()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        keep.request("GET", "/health")
        resp = keep.getresponse()
        assert resp.status == 503 and json.loads(resp.read()) == {"status": "draining"}
        try:
            socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
            accepted = True
        except OSError:
            accepted = False
        assert not accepted, "a new connection was accepted while draining"
        server.proc.wait(timeout=2 + 2 + 1)
        gone = time.time() - start
        for t in threads:
            t.join(timeout=10)
        assert gone < 2 + 2, gone
        assert server.proc.returncode == 0, server.proc.returncode
        assert len(streams) == 8, len(streams)
        for events in streams:
            assert events[-1] == "[DONE]", events[-2:]
            assert events[-2]["choices"][0]["finish_reason"] == "abort", events[-2]
        status, _, payload = plain[0]
        assert status == 503 and "shutting down" in json.loads(payload)["error"]["message"]


def shutdown_mid_prefill(pagedlm, model):
    """SIGTERM while 31 streams decode and a 6,000-token prompt is being prefilled beside them (a
    step budget of 8192 would take it whole; a few hundred tokens a second on the CPU): its
    prefill goes in chunks held to --target-itl-ms (200 ms by default on the CPU), so the engine
    stops between two of them instead of being abandoned inside one. Every stream ends with
    finish_reason "abort" and [DONE], the long non-streaming request gets a 503, and the process
    is gone within the drain time plus 2 s."""
    with Server(pagedlm, model, ["--shutdown-timeout", "1",
                                 "--max-num-batched-tokens", "8192"]) as server:
        streams, plain = [], []

        def stream():
            streams.append(sse_events(server, "/v1/completions",
                                      {**completion_body(4000), "ignore_eos": True,
                                       "stream": True}))

        def long_prompt():
            prompt = [100 + (i * 7919) % 9000 for i in range(6000)]
            plain.append(request(server, "POST", "/v1/completions",
                                 {"prompt": prompt, "max_tokens": 4, "temperature": 0},
                                 timeout=60))

        threads = [threading.Thread(target=stream) for _ in range(MID_PREFILL_STREAMS)]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while metrics(server)["pagedlm_generation_tokens_total"] < 2 * MID_PREFILL_STREAMS:
            assert time.time() < deadline, "the streams did not start"
            time.sleep(0.1)
        threads.append(threading.Thread(target=long_prompt))
        threads[-1].start()
        # Some chunks of it are done, most are not (in one step it would take 10 s or more).
        time.sleep(1.5)
        start = time.time()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=1 + 2 + 5)
        gone = time.time() - start
        for t in threads:
            t.join(timeout=10)
        assert gone < 1 + 2, gone
        assert server.proc.returncode == 0, server.proc.returncode
        time.sleep(0.2)  # the log's last lines
        cut = [line for line in server.log
               if "without waiting for the engine's current step" in line]
        assert not cut, "the engine was abandoned inside a step: " + "".join(server.log[-5:])
        print(f"     gone {gone:.1f}s after SIGTERM", flush=True)
        assert len(streams) == MID_PREFILL_STREAMS, len(streams)
        for events in streams:
            assert events[-1] == "[DONE]", events[-2:]
            assert events[-2]["choices"][0]["finish_reason"] == "abort", events[-2]
        status, _, payload = plain[0]
        assert status == 503 and "shutting down" in json.loads(payload)["error"]["message"], \
            (status, payload[:200])


def metrics_auth(pagedlm, model):
    """--metrics-auth puts /metrics behind --api-key; without it /metrics stays open."""
    with Server(pagedlm, model, ["--api-key", "k1", "--metrics-auth"]) as server:
        status, _, _ = request(server, "GET", "/metrics")
        assert status == 401, status
        status, _, body = request(server, "GET", "/metrics", headers={"Authorization": "Bearer k1"})
        assert status == 200 and b"pagedlm_num_requests_running" in body, status
        status, _, _ = request(server, "GET", "/health")
        assert status == 200
    with Server(pagedlm, model, ["--api-key", "k1"]) as server:
        status, _, _ = request(server, "GET", "/metrics")
        assert status == 200, status


def main():
    args = parse_args()
    run_checks([
        ("1,000 dripping and 1,000 idle connections", lambda: slow_clients(args.pagedlm,
                                                                           args.model)),
        ("a body past --body-timeout", lambda: slow_body(args.pagedlm, args.model)),
        ("framing: Transfer-Encoding, request line, field names", lambda: framing(args.pagedlm,
                                                                                  args.model)),
        ("400 simultaneous requests with default flags", lambda: overload(args.pagedlm,
                                                                          args.model)),
        ("64 concurrent 8 MB bodies: memory bounded, then returned",
         lambda: large_bodies(args.pagedlm, args.model)),
        ("SIGTERM drains", lambda: shutdown(args.pagedlm, args.model)),
        ("SIGTERM while a long prompt is prefilled beside streams",
         lambda: shutdown_mid_prefill(args.pagedlm, args.model)),
        ("/metrics behind the key", lambda: metrics_auth(args.pagedlm, args.model)),
    ])


if __name__ == "__main__":
    main()
