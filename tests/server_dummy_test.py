"""`pagedlm serve --dummy`: random weights without a tokenizer (what serving benchmarks run on a
machine without the model files). Token-id prompts are served, with the generated ids in place
of text; everything that needs the tokenizer is refused with 400."""

import json
import os
import threading

from server_harness import (Server, metrics, parse_args, post_json, request, run_checks,
                            sse_events)

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testdata", "fixtures",
                      "llama-gqa", "config.json")
IDS = {"prompt": [5, 17, 42, 7], "max_tokens": 6, "ignore_eos": True, "temperature": 0}

# (name, path, body, text the 400 message must hold)
REFUSED = [
    ("text prompt", "/v1/completions", {**IDS, "prompt": "Hello"}, "no tokenizer"),
    ("list with a text prompt", "/v1/completions", {**IDS, "prompt": [[1, 2], "Hi"]},
     "no tokenizer"),
    ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]},
     "no tokenizer"),
    ("stop strings", "/v1/completions", {**IDS, "stop": ["\n"]}, "no tokenizer"),
    ("logprobs", "/v1/completions", {**IDS, "logprobs": 1}, "no tokenizer"),
    ("tokenize", "/tokenize", {"prompt": "Hello"}, "no tokenizer"),
    ("detokenize", "/detokenize", {"tokens": [1, 2]}, "no tokenizer"),
]


def main():
    args = parse_args()
    with Server(args.pagedlm, extra=["--dummy", CONFIG]) as server:

        def check_token_ids_completion():
            status, body = post_json(server, "/v1/completions", IDS)
            assert status == 200, body
            choice = body["choices"][0]
            assert choice["text"] == "" and len(choice["token_ids"]) == 6, choice
            assert choice["finish_reason"] == "length", choice
            assert body["usage"]["completion_tokens"] == 6, body["usage"]

        def check_token_ids_stream():
            events = sse_events(server, "/v1/completions", {
                **IDS, "stream": True, "stream_options": {"include_usage": True}})
            assert events[-1] == "[DONE]", events[-3:]
            ids = [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids", [])]
            assert len(ids) == 6, events
            assert events[-2]["usage"]["completion_tokens"] == 6, events[-2]
            # Greedy on the same weights: the stream makes the same tokens as the plain reply.
            _, body = post_json(server, "/v1/completions", IDS)
            assert ids == body["choices"][0]["token_ids"], (ids, body)

        def check_refused():
            for name, path, body, text in REFUSED:
                status, reply = post_json(server, path, body)
                assert status == 400, (name, status, reply)
                assert text in reply["error"]["message"], (name, reply)
            check_token_ids_completion()  # still serving

        run_checks([
            ("token-id completion", check_token_ids_completion),
            ("token-id stream", check_token_ids_stream),
            (f"text endpoints refused ({len(REFUSED)} requests)", check_refused),
        ])

    # The KV cache map and the partial-page prefix-hit counters, behind an API key.
    key = "cache-map-key"
    auth = {"Authorization": "Bearer " + key}
    first = list(range(100, 120))  # 20 tokens: page 0 whole, page 1 holds 4 (page size 16)
    second = first[:18] + [7, 8]   # shares 18: page 0 by reference, 2 tokens copied from page 1
    with Server(args.pagedlm, extra=["--dummy", CONFIG, "--api-key", key, "--page-size", "16",
                                     "--max-num-seqs", "4"]) as server:

        def cache_map():
            status, _, payload = request(server, "GET", "/v1/cache", headers=auth)
            assert status == 200, payload
            return json.loads(payload)

        def check_needs_key():
            status, _, _ = request(server, "GET", "/v1/cache")
            assert status == 401, status
            status, _, _ = request(server, "GET", "/v1/cache?max_free_pages=x", headers=auth)
            assert status == 400, status

        def check_partial_hit_counted():
            for prompt in (first, second):
                status, body = post_json(server, "/v1/completions",
                                         {**IDS, "prompt": prompt, "max_tokens": 2}, headers=auth)
                assert status == 200, body
            values = metrics(server)
            assert values["pagedlm_prefix_cache_hits_total"] == 18, values
            assert values["pagedlm_prefix_cache_partial_hits_total"] == 1, values
            assert values["pagedlm_prefix_cache_partial_hit_tokens_total"] == 2, values
            snap = cache_map()
            assert snap["page_size"] == 16, snap
            assert snap["sequences"] == [], snap
            assert snap["prefix_cache"]["partial_hit_tokens"] == 2, snap
            # Both requests' pages are free and still serve hits: page 0 whole, and each one's
            # partly filled second page (20 prompt tokens + 1 computed output: 5 tokens).
            free = snap["free_pages"]
            assert sum(1 for p in free if p["full"] and p["num_tokens"] == 16) == 1, free
            assert sum(1 for p in free if not p["full"] and p["num_tokens"] == 5) == 2, free
            assert all(p["ref_count"] == 0 for p in free), free
            assert len(cache_map_limited(1)["free_pages"]) == 1

        def cache_map_limited(n):
            status, _, payload = request(server, "GET", f"/v1/cache?max_free_pages={n}",
                                         headers=auth)
            assert status == 200, payload
            return json.loads(payload)

        def check_running_sequence_shows_its_copy():
            # A long request sharing 17 tokens; the map, polled while it runs, shows page 0
            # shared with the cache and its second page's first token copied from a cached page.
            third = first[:17] + [9, 9, 9]
            done = threading.Event()

            def run():
                try:
                    post_json(server, "/v1/completions",
                              {**IDS, "prompt": third, "max_tokens": 900}, headers=auth)
                finally:
                    done.set()

            thread = threading.Thread(target=run)
            thread.start()
            seen = None
            while not done.is_set() and seen is None:
                for seq in cache_map()["sequences"]:
                    seen = seq
            thread.join()
            assert seen is not None, "the request finished before the map showed it"
            assert seen["num_cached_tokens"] == 17, seen
            copy = seen["partial_copy"]
            assert copy["page_index"] == 1 and copy["num_tokens"] == 1, seen
            assert copy["page"] == seen["pages"][1]["page"] and copy["src_page"] != copy["page"]
            assert seen["pages"][0]["ref_count"] == 1, seen  # page 0 is cached, held by it alone
            assert not any(p.get("released") for p in seen["pages"]), seen

        run_checks([
            ("cache map needs the API key", check_needs_key),
            ("partial-page hit in the metrics and the cache map", check_partial_hit_counted),
            ("running sequence's copy in the cache map", check_running_sequence_shows_its_copy),
        ])


if __name__ == "__main__":
    main()
