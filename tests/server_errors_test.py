"""Malformed and refused requests: each gets the right status and an OpenAI-shaped error naming
the problem, and the server keeps serving; a full waiting queue answers 503 with Retry-After."""

import json
import threading
import time

from server_harness import (Server, metrics, parse_args, post_json, raw_request, request,
                            rss_bytes, run_checks, sse_events)

KEY = "errors-test-key"
AUTH = {"Authorization": "Bearer " + KEY}
GOOD = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}



def nested(depth):
    return "[" * depth + "]" * depth


def chat_with(field_json):
    """A chat body (bytes) with `field_json` spliced in as is."""
    return ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
            + field_json + "}").encode()


DEEP = 20000  # 40 KB of brackets: enough to overflow the stack of any recursive walk

# (name, path, body (dict, or bytes sent as is), expected status, text the message must hold)
CASES = [
    ("malformed JSON", "/v1/completions", b'{"prompt": ', 400, "malformed JSON"),
    ("body not an object", "/v1/completions", [1, 2], 400, "JSON object"),
    ("missing prompt", "/v1/completions", {"max_tokens": 2}, 400, "'prompt' is required"),
    ("prompt of wrong type", "/v1/completions", {"prompt": 5}, 400, "'prompt' must be"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "empty list"),
    ("mixed prompt list", "/v1/completions", {"prompt": ["a", 5]}, 400, "'prompt' must be"),
    ("token id out of range", "/v1/completions", {"prompt": [1, 999999]}, 400, "out of range"),
    ("negative token id", "/v1/completions", {"prompt": [-3]}, 400, "out of range"),
    ("empty prompt string", "/v1/completions", {"prompt": ""}, 400, "prompt is empty"),
    ("max_tokens not an int", "/v1/completions", {**GOOD, "max_tokens": "ten"}, 400,
     "'max_tokens' must be an integer"),
    ("max_tokens zero", "/v1/completions", {**GOOD, "max_tokens": 0}, 400, "at least 1"),
    ("max_tokens past context", "/v1/completions", {**GOOD, "max_tokens": 1000000}, 400,
     "maximum context length"),
    ("max_tokens at INT64_MAX", "/v1/completions", {**GOOD, "max_tokens": 2**63 - 1}, 400,
     f"{2**63 - 1} for the completion"),
    ("prompt past context", "/v1/completions", {"prompt": "hello " * 9000, "max_tokens": 1},
     400, "maximum context length"),
    ("negative temperature", "/v1/completions", {**GOOD, "temperature": -1}, 400,
     "'temperature' must be >= 0"),
    ("temperature not a number", "/v1/completions", {**GOOD, "temperature": "hot"}, 400,
     "'temperature' must be a number"),
    ("top_p zero", "/v1/completions", {**GOOD, "top_p": 0}, 400, "'top_p' must be in (0, 1]"),
    ("top_p above one", "/v1/completions", {**GOOD, "top_p": 1.5}, 400, "'top_p'"),
    ("top_k negative", "/v1/completions", {**GOOD, "top_k": -5}, 400, "'top_k'"),
    ("min_p above one", "/v1/completions", {**GOOD, "min_p": 2}, 400, "'min_p'"),
    ("n zero", "/v1/completions", {**GOOD, "n": 0}, 400, "'n' must be in"),
    ("n too large", "/v1/completions", {**GOOD, "n": 1000}, 400, "'n' must be in"),
    ("presence_penalty out of range", "/v1/completions", {**GOOD, "presence_penalty": 2.5},
     400, "'presence_penalty' must be in [-2, 2]"),
    ("frequency_penalty out of range", "/v1/chat/completions",
     {**CHAT, "frequency_penalty": -3}, 400, "'frequency_penalty' must be in [-2, 2]"),
    ("repetition_penalty zero", "/v1/completions", {**GOOD, "repetition_penalty": 0}, 400,
     "'repetition_penalty' must be > 0"),
    ("tools not a list", "/v1/chat/completions", {**CHAT, "tools": {"type": "function"}}, 400,
     "'tools' must be a list"),
    ("tool_choice required", "/v1/chat/completions",
     {**CHAT, "tools": [], "tool_choice": "required"}, 400, "needs a non-empty 'tools' list"),
    ("tool_choice a named function", "/v1/chat/completions",
     {**CHAT, "tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400,
     "which is not among the 'tools'"),
    ("logit_bias not an object", "/v1/completions", {**GOOD, "logit_bias": [1, 2]}, 400,
     "'logit_bias' must be an object"),
    ("logit_bias key not an id", "/v1/completions", {**GOOD, "logit_bias": {"x1": 1}}, 400,
     "'logit_bias' keys must be token ids"),
    ("logit_bias id out of range", "/v1/completions", {**GOOD, "logit_bias": {"99999999": 1}},
     400, "logit_bias token id 99999999 is out of range"),
    ("logit_bias value too large", "/v1/completions", {**GOOD, "logit_bias": {"5": 101}}, 400,
     "'logit_bias' values must be numbers in [-100, 100]"),
    ("stop of wrong type", "/v1/completions", {**GOOD, "stop": 5}, 400, "'stop' must be"),
    ("stop list of numbers", "/v1/completions", {**GOOD, "stop": [1]}, 400, "'stop' entries"),
    ("logprobs too many", "/v1/completions", {**GOOD, "logprobs": 50}, 400, "'logprobs'"),
    ("stream not a bool", "/v1/completions", {**GOOD, "stream": "yes"}, 400,
     "'stream' must be a boolean"),
    ("seed not an int", "/v1/completions", {**GOOD, "seed": "x"}, 400, "'seed'"),
    ("echo", "/v1/completions", {**GOOD, "echo": True}, 400, "'echo' is not supported"),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-4"}, 400,
     "The model `gpt-4` does not exist"),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 2}, 400,
     "'messages' is required"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "non-empty list"),
    ("message not an object", "/v1/chat/completions", {"messages": ["hi"]}, 400,
     "must be an object"),
    ("message without role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400,
     "'role'"),
    ("message content of wrong type", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": 7}]}, 400, "'content'"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400,
     "needs 'logprobs'"),
    ("detokenize bad tokens", "/detokenize", {"tokens": "abc"}, 400, "'tokens'"),
    ("tokenize without prompt", "/tokenize", {}, 400, "'prompt'"),
    ("unknown route", "/v1/embeddings", GOOD, 404, "no route"),
    ("body too large", "/v1/completions", b"x" * 200000, 413, "too large"),
    ("deep unknown field", "/v1/chat/completions",
     ('{"messages": [{"role": "user", "content": "hi", "x": ' + nested(DEEP)
      + '}], "max_tokens": 2}').encode(), 400, "nested deeper than 128"),
    ("deep content", "/v1/chat/completions",
     ('{"messages": [{"role": "user", "content": [' + nested(DEEP) + ']}]}').encode(), 400,
     "nested deeper than 128"),
    ("deep tools", "/v1/chat/completions", chat_with('"tools": ' + nested(DEEP)), 400,
     "nested deeper than 128"),
    ("deep chat_template_kwargs", "/v1/chat/completions",
     chat_with('"chat_template_kwargs": {"a": ' + nested(DEEP) + "}"), 400,
     "nested deeper than 128"),
    ("deep tokenize messages", "/tokenize",
     ('{"messages": [{"role": "user", "content": "hi", "x": ' + nested(DEEP) + "}]}").encode(),
     400, "nested deeper than 128"),
    ("deep completion prompt", "/v1/completions", ('{"prompt": ' + nested(DEEP) + "}").encode(),
     400, "nested deeper than 128"),
]


def main():
    args = parse_args()
    extra = ["--api-key", KEY, "--max-body-bytes", "100000", "--max-num-seqs", "1",
             "--max-waiting", "2", "--shutdown-timeout", "1"]
    with Server(args.pagedlm, args.model, extra) as server:

        def still_serving():
            status, body = post_json(server, "/v1/completions", GOOD, AUTH)
            assert status == 200 and body["choices"][0]["text"], body

        def check_table():
            assert len(CASES) >= 20
            for name, path, body, want_status, want_text in CASES:
                raw = body if isinstance(body, bytes) else None
                status, _, payload = request(server, "POST", path, None if raw else body, AUTH,
                                             raw=raw)
                err = json.loads(payload)["error"]
                assert status == want_status, (name, status, err)
                assert err["code"] == want_status and isinstance(err["type"], str), (name, err)
                assert want_text in err["message"], (name, err["message"])
                assert set(err) == {"message", "type", "param", "code"}, (name, err)
                assert server.alive(), name
            still_serving()
            # Nesting within the bound is still accepted, through the template's walks too.
            status, _, payload = request(server, "POST", "/v1/chat/completions", None, AUTH,
                                         raw=chat_with('"chat_template_kwargs": {"a": '
                                                       + nested(100) + "}"))
            assert status == 200, payload

        def http_head(method, path, *lines, body_length=None):
            head = [f"{method} {path} HTTP/1.1", "Host: test", "Authorization: Bearer " + KEY,
                    "Content-Type: application/json", *lines]
            if body_length is not None:
                head.append(f"Content-Length: {body_length}")
            return ("\r\n".join(head) + "\r\n\r\n").encode()

        def check_http_limits():
            # Limit 100000 bytes (--max-body-bytes): a 50 MB chunked body is refused with 413
            # once past it, without the server holding it.
            rss_before = rss_bytes(server)
            chunk = b"x" * 65536
            parts = (b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(800))
            status, headers, body = raw_request(
                server, http_head("POST", "/v1/completions", "Transfer-Encoding: chunked"), parts)
            assert status == 413 and headers.get("connection") == "close", (status, headers)
            assert "too large" in json.loads(body)["error"]["message"], body
            assert rss_bytes(server) - rss_before < 20 << 20, "the chunked body was buffered"
            # A client that asks before sending (Expect: 100-continue) is refused up front,
            # and one that sends a chunked body after "100 Continue" still gets the 413.
            status, _, body = raw_request(server, http_head(
                "POST", "/v1/completions", "Expect: 100-continue", body_length=1 << 30))
            assert status == 413 and "too large" in body.decode(), (status, body)
            parts = (b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(10))
            status, _, body = raw_request(server, http_head(
                "POST", "/v1/completions", "Transfer-Encoding: chunked", "Expect: 100-continue"),
                parts)
            assert status == 413, (status, body)
            # A chunked body within the limit is served.
            good = json.dumps(GOOD).encode()
            parts = [b"%x\r\n%s\r\n" % (len(good), good), b"0\r\n\r\n"]
            status, _, body = raw_request(
                server, http_head("POST", "/v1/completions", "Transfer-Encoding: chunked"), parts)
            assert status == 200 and json.loads(body)["choices"][0]["text"], body
            # 2 MB of header lines, or one line that never ends: 431.
            many = [f"X-Filler-{i}: {'v' * 100}" for i in range(20000)]
            status, _, body = raw_request(server, http_head("GET", "/health", *many))
            assert status == 431 and "headers are too large" in body.decode(), (status, body)
            status, _, _ = raw_request(server, b"GET /health HTTP/1.1\r\nX-Long: " + b"v" * (1 << 20))
            assert status == 431, status
            # A compressed body would be inflated past the limit: 415.
            status, _, body = raw_request(
                server, http_head("POST", "/v1/completions", "Content-Encoding: gzip",
                                  body_length=4), [b"\x1f\x8b\x08\x00"])
            assert status == 415 and "Content-Encoding" in body.decode(), (status, body)
            # Ambiguous framing and malformed header lines: 400.
            for lines, text in [
                (["Content-Length: 2", "Transfer-Encoding: chunked"], "both Content-Length"),
                (["Content-Length: 2", "Content-Length: 3"], "conflicting Content-Length"),
                (["Content-Length: 2", "no colon here"], "without a colon"),
            ]:
                status, _, body = raw_request(server, http_head("POST", "/tokenize", *lines),
                                              [b"{}"])
                assert status == 400 and text in body.decode(), (lines, status, body)
            # A known path with the wrong method: 405 with Allow.
            for method, path, allow in [("GET", "/v1/completions", "POST"),
                                        ("PUT", "/v1/chat/completions", "POST"),
                                        ("POST", "/health", "GET, HEAD")]:
                status, headers, payload = request(server, method, path, {}, AUTH)
                assert status == 405 and headers.get("Allow") == allow, (method, path, headers)
                assert json.loads(payload)["error"]["code"] == 405, payload
            assert server.alive()
            still_serving()

        def check_auth():
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
                status, body = post_json(server, "/v1/completions", GOOD, headers)
                assert status == 401 and body["error"]["type"] == "authentication_error", body
            status, _, _ = request(server, "GET", "/health")
            assert status == 200, "health needs no key"
            still_serving()

        def check_overload():
            # One running sequence and room for two waiting: of eight concurrent requests,
            # some must be refused with 503 + Retry-After, and the rest succeed.
            results = []
            lock = threading.Lock()

            def one():
                status, headers, payload = request(
                    server, "POST", "/v1/completions",
                    {"prompt": "Count to ten:", "max_tokens": 24, "temperature": 0}, AUTH)
                with lock:
                    results.append((status, headers, json.loads(payload)))

            threads = [threading.Thread(target=one) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            statuses = sorted(r[0] for r in results)
            assert 503 in statuses and 200 in statuses, statuses
            for status, headers, body in results:
                if status == 503:
                    # The expected wait in whole seconds (the engine's measured start rate).
                    assert int(headers.get("Retry-After", "0")) >= 1, headers
                    assert "overloaded" in body["error"]["message"], body
                else:
                    assert status == 200, body
            still_serving()

        def check_shutdown_ends_streams():
            # SIGTERM while a long reply streams: after --shutdown-timeout (1 s here) the stream
            # ends with finish_reason "abort" and [DONE], and the server exits cleanly instead
            # of finishing the reply.
            tokens_before = metrics(server)["pagedlm_generation_tokens_total"]
            events = []

            def one():
                events.extend(sse_events(server, "/v1/completions", {
                    "prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0,
                    "stream": True}, AUTH))

            t = threading.Thread(target=one)
            t.start()
            deadline = time.time() + 60
            while metrics(server)["pagedlm_generation_tokens_total"] < tokens_before + 3:
                assert time.time() < deadline, "the stream did not start"
                time.sleep(0.1)
            start = time.time()
            server.stop()
            t.join(timeout=30)
            assert time.time() - start < 1 + 2, "shutdown waited for the stream to finish"
            assert events[-1] == "[DONE]", events[-3:]
            assert events[-2]["choices"][0]["finish_reason"] == "abort", events[-2]
            assert not any("error" in e for e in events[:-1]), events[-3:]

        run_checks([
            (f"bad-input table ({len(CASES)} requests)", check_table),
            ("HTTP limits: body, headers, framing, methods", check_http_limits),
            ("auth", check_auth),
            ("overload: 503 with Retry-After", check_overload),
            ("shutdown ends open streams", check_shutdown_ends_streams),
        ])


if __name__ == "__main__":
    main()
