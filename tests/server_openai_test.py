"""The official openai Python client against `pagedlm serve`: completions and chat, streaming
and not, n=2, stop strings, logprobs, auth and cache salting; greedy outputs equal across
streaming, repeated runs, and `pagedlm generate` on the same prompt (as text, as token ids,
and through the chat template)."""

import re
import subprocess
import sys

from server_harness import Server, parse_args, post_json, run_checks, skip

OPENAI_VERSION = "1.58.1"


def import_openai():
    try:
        import openai  # noqa: F401
    except ImportError:
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                              f"openai=={OPENAI_VERSION}"], capture_output=True, text=True)
        if pip.returncode != 0:
            skip("the openai package is not installed and pip could not install it:\n" +
                 pip.stderr[-2000:])
    import openai
    return openai


KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
PROMPT = "The three primary colors are"
CHAT = [{"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three fruits."}]


def main():
    args = parse_args()
    openai = import_openai()
    with Server(args.pagedlm, args.model, ["--api-key", KEY_A, "--api-key", KEY_B]) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY_A, max_retries=0,
                               timeout=120)
        client_b = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY_B, max_retries=0,
                                 timeout=120)
        model = server.model
        auth = {"Authorization": "Bearer " + KEY_A}

        def complete(**kw):
            return client.completions.create(model=model, **kw)

        def stream_text(create, **kw):
            """Concatenated text per choice index, finish reasons, and the usage chunk."""
            texts, reasons, usage = {}, {}, None
            for chunk in create(model=model, stream=True,
                                stream_options={"include_usage": True}, **kw):
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    piece = c.text if hasattr(c, "text") else (c.delta.content or "")
                    texts[c.index] = texts.get(c.index, "") + piece
                    if c.finish_reason:
                        reasons[c.index] = c.finish_reason
            return texts, reasons, usage

        def check_models():
            ids = [m.id for m in client.models.list()]
            assert ids == [model], ids

        def check_auth():
            bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong",
                                max_retries=0)
            try:
                bad.models.list()
            except openai.AuthenticationError as e:
                assert e.status_code == 401
            else:
                raise AssertionError("a wrong api key was accepted")

        greedy = {}

        def check_completion_greedy():
            r = complete(prompt=PROMPT, max_tokens=12, temperature=0)
            assert r.object == "text_completion" and r.id.startswith("cmpl-")
            c = r.choices[0]
            assert c.index == 0 and c.finish_reason == "length" and c.text, r
            assert r.usage.completion_tokens == 12
            assert r.usage.total_tokens == r.usage.prompt_tokens + 12
            again = complete(prompt=PROMPT, max_tokens=12, temperature=0)
            assert again.choices[0].text == c.text, "greedy output changed between runs"
            texts, reasons, usage = stream_text(client.completions.create, prompt=PROMPT,
                                                max_tokens=12, temperature=0)
            assert texts == {0: c.text} and reasons == {0: "length"}, (texts, c.text)
            assert usage.completion_tokens == 12 and usage.prompt_tokens == r.usage.prompt_tokens
            greedy["text"] = c.text

        def generate_cmd(*flags):
            cmd = [args.pagedlm, "generate", "--threads", "2", "--num-pages", "256", *flags]
            return cmd + (["--model", args.model] if args.model else [])

        def generated_texts(stdout):
            """The texts `pagedlm generate` printed: each ends at its "(finish: ...)" line;
            several prompts come in "=== [i] ..." sections."""
            texts = []
            for section in re.split(r"^=== \[\d+\] .*\n", stdout, flags=re.M):
                if "\n(finish: " in section:
                    texts.append(section.rsplit("\n(finish: ", 1)[0])
            return texts

        def check_matches_offline_engine():
            status, tok = post_json(server, "/tokenize", {"prompt": PROMPT}, auth)
            assert status == 200 and tok["count"] == len(tok["tokens"]) > 0, tok
            ids = tok["tokens"]
            system, user = CHAT[0]["content"], CHAT[1]["content"]
            runs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True) for cmd in (
                generate_cmd("--prompt", PROMPT, "--tokens", " ".join(map(str, ids)),
                             "--max-tokens", "12"),
                generate_cmd("--chat", "--system", system, "--prompt", user,
                             "--max-tokens", "16"))]
            outputs = [run.communicate(timeout=240)[0] for run in runs]
            assert all(run.returncode == 0 for run in runs)
            by_text, by_ids = generated_texts(outputs[0])
            assert by_text == greedy["text"], (by_text, greedy["text"])
            assert by_ids == greedy["text"], (by_ids, greedy["text"])
            (chat_text,) = generated_texts(outputs[1])
            r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16,
                                               temperature=0)
            assert r.choices[0].message.content == chat_text, (r.choices[0].message, chat_text)
            server_ids = complete(prompt=ids, max_tokens=12, temperature=0)
            assert server_ids.choices[0].text == greedy["text"]

        def check_chat():
            r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16,
                                               temperature=0)
            assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
            msg = r.choices[0].message
            assert msg.role == "assistant" and msg.content, r
            assert r.choices[0].finish_reason in ("stop", "length")
            texts, reasons, usage = stream_text(client.chat.completions.create, messages=CHAT,
                                                max_tokens=16, temperature=0)
            assert texts == {0: msg.content}, (texts, msg.content)
            assert reasons == {0: r.choices[0].finish_reason}
            assert usage.prompt_tokens == r.usage.prompt_tokens
            assert usage.completion_tokens == r.usage.completion_tokens
            status, tok = post_json(server, "/tokenize", {"messages": CHAT}, auth)
            assert status == 200 and tok["count"] == r.usage.prompt_tokens, tok

        def check_chat_ends_at_eos():
            # Enough room to finish: the reply ends with the end-of-turn token, not in text.
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=64, temperature=0)
            assert r.choices[0].finish_reason == "stop", r
            assert "<|im_end|>" not in r.choices[0].message.content

        def check_n2():
            kw = dict(prompt=PROMPT, max_tokens=10, temperature=1.0, seed=7, n=2)
            r = complete(**kw)
            assert [c.index for c in r.choices] == [0, 1], r
            a, b = r.choices[0].text, r.choices[1].text
            assert a != b, "n=2 with sampling gave two identical choices"
            again = complete(**kw)
            assert [c.text for c in again.choices] == [a, b], "seeded n=2 not reproducible"
            texts, _, usage = stream_text(client.completions.create, **kw)
            assert texts == {0: a, 1: b}, (texts, a, b)
            assert usage.completion_tokens == 20
            chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8,
                                                  n=2, temperature=0)
            assert [c.index for c in chat.choices] == [0, 1]
            assert chat.choices[0].message.content == chat.choices[1].message.content

        def check_stop_strings():
            full = complete(prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0)
            text, tokens = full.choices[0].text, full.choices[0].logprobs.tokens
            assert "".join(tokens) == text
            # A stop string made of the end of one token and the start of the next.
            boundary = None
            offset = 0
            for t, nxt in zip(tokens, tokens[1:]):
                offset += len(t)
                if t.strip() and nxt.strip():
                    boundary = offset
                    break
            assert boundary is not None, tokens
            stop = text[boundary - 1:boundary + 1]
            expected = text[:text.find(stop)]
            for stops in (stop, [stop, "never-appears-xyz"]):
                r = complete(prompt=PROMPT, max_tokens=12, temperature=0, stop=stops)
                assert r.choices[0].text == expected, (r.choices[0].text, expected, stop)
                assert r.choices[0].finish_reason == "stop"
                texts, reasons, _ = stream_text(client.completions.create, prompt=PROMPT,
                                                max_tokens=12, temperature=0, stop=stops)
                assert texts == {0: expected} and reasons == {0: "stop"}, (texts, expected)

        def check_logprobs():
            r = complete(prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
            lp = r.choices[0].logprobs
            assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
            assert "".join(lp.tokens) == r.choices[0].text
            assert lp.text_offset[0] == 0
            for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
                assert logprob <= 0 and len(top) <= 3 and len(top) >= 1
                # Greedy picks the most likely token.
                assert abs(max(top.values()) - logprob) < 1e-6 and top[token] == logprob
            chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6,
                                                  temperature=0, logprobs=True, top_logprobs=2)
            content = chat.choices[0].logprobs.content
            assert len(content) == chat.usage.completion_tokens
            assert "".join(c.token for c in content) == chat.choices[0].message.content
            for c in content:
                assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
                assert bytes(c.bytes).decode() == c.token
            texts, _, _ = stream_text(client.completions.create, prompt=PROMPT, max_tokens=6,
                                      temperature=0, logprobs=3)
            assert texts == {0: r.choices[0].text}

        def check_cache_salting():
            prompt = "Tenant isolation check. " * 12
            kw = dict(model=model, prompt=prompt, max_tokens=1, temperature=0)
            first = client.completions.create(**kw).usage
            second = client.completions.create(**kw).usage
            assert second.prompt_tokens_details.cached_tokens >= 16, second
            other_key = client_b.completions.create(**kw).usage
            assert other_key.prompt_tokens_details.cached_tokens == 0, other_key
            salted = client.completions.create(extra_body={"cache_salt": "s1"}, **kw).usage
            assert salted.prompt_tokens_details.cached_tokens == 0, salted
            salted2 = client.completions.create(extra_body={"cache_salt": "s1"}, **kw).usage
            assert salted2.prompt_tokens_details.cached_tokens >= 16, salted2
            assert first.prompt_tokens == second.prompt_tokens

        def check_logit_bias_and_repetition():
            def token_id(text):
                status, tok = post_json(server, "/tokenize",
                                        {"prompt": text, "add_special_tokens": False}, auth)
                assert status == 200 and len(tok["tokens"]) == 1, tok
                return tok["tokens"][0]

            the = token_id(" the")
            # +100 forces the token at every step, whatever the model prefers.
            forced = complete(prompt=PROMPT, max_tokens=4, temperature=0,
                              logit_bias={str(the): 100})
            assert forced.choices[0].text == " the" * 4, forced.choices[0].text
            # -100 keeps it out wherever the unbiased greedy run used it.
            plain = complete(prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1)
            banned = complete(prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1,
                              logit_bias={str(the): -100})
            assert " the" not in banned.choices[0].logprobs.tokens
            if " the" in plain.choices[0].logprobs.tokens:
                assert banned.choices[0].text != plain.choices[0].text
            rep = complete(prompt=PROMPT, max_tokens=12, temperature=0,
                           extra_body={"repetition_penalty": 1.3})
            assert rep.usage.completion_tokens == 12

        def check_errors_through_client():
            try:
                complete(prompt=PROMPT, max_tokens=4, temperature=-1)
            except openai.BadRequestError as e:
                assert e.status_code == 400 and "temperature" in e.message
            else:
                raise AssertionError("temperature -1 was accepted")
            try:
                client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
            except openai.BadRequestError as e:
                assert e.status_code == 400 and "no-such-model" in e.message
            else:
                raise AssertionError("an unknown model was accepted")

        run_checks([
            ("models", check_models),
            ("auth", check_auth),
            ("completion greedy: repeatable, streaming == non-streaming", check_completion_greedy),
            ("server == pagedlm generate (text, token ids, chat)", check_matches_offline_engine),
            ("chat: streaming == non-streaming, usage", check_chat),
            ("chat ends at end of turn", check_chat_ends_at_eos),
            ("n=2", check_n2),
            ("stop strings across token boundaries", check_stop_strings),
            ("logprobs", check_logprobs),
            ("cache salting by api key and cache_salt", check_cache_salting),
            ("logit_bias and repetition_penalty", check_logit_bias_and_repetition),
            ("errors through the client", check_errors_through_client),
        ])


if __name__ == "__main__":
    main()
