"""`pagedlm serve --dummy`: random weights without a tokenizer (what serving benchmarks run on a
machine without the model files). Token-id prompts are served, with the generated ids in place
of text; everything that needs the tokenizer is refused with 400."""

import os

from server_harness import Server, parse_args, post_json, run_checks, sse_events

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


if __name__ == "__main__":
    main()
