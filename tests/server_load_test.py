"""64 concurrent streaming chat clients sharing a system prompt all get the same replies as
when run alone, the prefix cache serves the shared prompt, and after clients that disconnect
mid-stream no KV page is left in use."""

import http.client
import json
import random
import threading
import time

from server_harness import (Server, metrics, parse_args, post_json, run_checks, sse_events,
                            wait_idle)

SYSTEM = ("You are a helpful assistant for a small bakery. You answer questions about bread, "
          "cakes, opening hours and prices. Keep answers short and friendly, and never "
          "invent prices that you were not told about. The bakery opens at seven.")
QUESTIONS = ["When do you open?", "Do you sell rye bread?", "What cakes do you have?",
             "Can I order a birthday cake?"]
NUM_CLIENTS = 64


def chat_body(question, max_tokens, stream):
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def main():
    args = parse_args()
    with Server(args.pagedlm, args.model) as server:
        expected = {}

        def check_concurrent_streams():
            for q in QUESTIONS:
                status, body = post_json(server, "/v1/chat/completions", chat_body(q, 8, False))
                assert status == 200, body
                expected[q] = (body["choices"][0]["message"]["content"],
                               body["choices"][0]["finish_reason"])
            before = metrics(server)
            results, errors = [None] * NUM_CLIENTS, []

            def client(i):
                try:
                    events = sse_events(server, "/v1/chat/completions",
                                        chat_body(QUESTIONS[i % len(QUESTIONS)], 8, True))
                    assert events[-1] == "[DONE]", events[-1]
                    text, reason = "", None
                    for e in events[:-1]:
                        for c in e["choices"]:
                            text += c["delta"].get("content") or ""
                            reason = c["finish_reason"] or reason
                    results[i] = (text, reason)
                except Exception as e:  # reported below with the client's number
                    errors.append((i, repr(e)))

            threads = [threading.Thread(target=client, args=(i,)) for i in range(NUM_CLIENTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=150)
            assert not errors, errors[:5]
            for i, result in enumerate(results):
                assert result == expected[QUESTIONS[i % len(QUESTIONS)]], (i, result)
            after = wait_idle(server)
            hits = (after["pagedlm_prefix_cache_hits_total"] -
                    before["pagedlm_prefix_cache_hits_total"])
            queries = (after["pagedlm_prefix_cache_queries_total"] -
                       before["pagedlm_prefix_cache_queries_total"])
            # The system prompt is ~60 tokens: most of it must come from the cache.
            assert hits >= 32 * NUM_CLIENTS and queries >= hits, (hits, queries)
            assert after["pagedlm_time_to_first_token_seconds_count"] >= NUM_CLIENTS + 4
            assert after["pagedlm_inter_token_latency_seconds_count"] > 0
            assert after["pagedlm_generation_tokens_total"] >= 8 * NUM_CLIENTS
            assert after["pagedlm_kv_pages_used"] == 0, after

        def check_disconnects_free_pages():
            rng = random.Random(1234)
            done = []

            def client(i):
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
                body = chat_body(QUESTIONS[i % len(QUESTIONS)] + f" (visitor {i})", 200, True)
                conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                assert resp.status == 200
                # Some leave before any token, some after a few chunks, some read it all.
                leave_after = rng.choice([0, 1, 3, 6, None])
                chunks = 0
                for line in resp:
                    if line.startswith(b"data: "):
                        chunks += 1
                        if line.startswith(b"data: [DONE]"):
                            break
                    if leave_after is not None and chunks >= leave_after:
                        break
                conn.sock.close() if conn.sock else None
                conn.close()
                done.append(i)

            threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=150)
            assert len(done) == 24
            idle = wait_idle(server, timeout=90)
            assert idle["pagedlm_kv_pages_used"] == 0, idle
            assert idle["pagedlm_requests_cancelled_total"] > 0, idle
            total = idle["pagedlm_kv_pages_total"]
            assert idle["pagedlm_kv_pages_free"] == total, idle
            status, body = post_json(server, "/v1/chat/completions",
                                     chat_body(QUESTIONS[0], 8, False))
            assert status == 200
            assert body["choices"][0]["message"]["content"] == expected[QUESTIONS[0]][0]

        def check_non_streaming_disconnects_cancel():
            before = wait_idle(server)
            leavers = 4

            def client(i):
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
                body = chat_body(QUESTIONS[i % len(QUESTIONS)] + f" (leaver {i})", 2000, False)
                body["ignore_eos"] = True  # it would run far longer than the client waits
                conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
                time.sleep(1.5)
                conn.sock.close()
                conn.close()

            threads = [threading.Thread(target=client, args=(i,)) for i in range(leavers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            idle = wait_idle(server, timeout=60)
            cancelled = (idle["pagedlm_requests_cancelled_total"] -
                         before["pagedlm_requests_cancelled_total"])
            assert cancelled == leavers, (cancelled, idle)
            assert idle["pagedlm_kv_pages_used"] == 0, idle
            # A long non-streaming answer still arrives whole after the whitespace keep-alives.
            status, body = post_json(server, "/v1/chat/completions",
                                     {**chat_body(QUESTIONS[0], 48, False), "ignore_eos": True})
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == 48, body

        run_checks([
            (f"{NUM_CLIENTS} concurrent streaming clients, prefix-cache hits",
             check_concurrent_streams),
            ("random disconnects leak no pages", check_disconnects_free_pages),
            ("non-streaming clients that leave are cancelled", check_non_streaming_disconnects_cancel),
        ])


if __name__ == "__main__":
    main()
