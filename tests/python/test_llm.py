"""LLM on the default model: answers, agreement with `pagedlm generate`, streams, structured
output, tool calls, Ctrl-C, two engines in one process, asyncio, and the errors it raises."""

import asyncio
import json
import os
import re
import signal
import subprocess
import threading
import time

import jsonschema
import numpy as np
import pytest

from conftest import ROOT, THREADS

import pagedlm
from pagedlm import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "The three primary colors are"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=16)


def texts(outputs):
    return [o.outputs[0].text for o in outputs]


def test_chat_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=24))
    assert "Paris" in out[0].outputs[0].text, out[0].outputs[0].text
    assert out[0].prompt_token_ids and out[0].outputs[0].finish_reason in ("stop", "length")


def generate_cli(binary, prompts, extra):
    """`pagedlm generate`'s text for each prompt (its output for several prompts: a block
    '=== [i] prompt' with the text, then '(finish: ...)')."""
    cmd = [binary, "generate", "--device", "cpu", "--threads", str(THREADS)]
    for p in prompts:
        cmd += ["--prompt", p]
    p = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    found = []
    for i, prompt in enumerate(prompts):
        m = re.search(re.escape(f"=== [{i + 1}] {prompt}\n") + r"(.*?)\n\(finish: ", p.stdout,
                      re.S)
        assert m, p.stdout
        found.append(m.group(1))
    return found


def test_greedy_and_seeded_outputs_equal_the_cli(llm, binary):
    assert texts(llm.generate(PROMPTS, GREEDY)) == generate_cli(
        binary, PROMPTS, ["--max-tokens", "16", "--temperature", "0"])
    assert texts(llm.generate(PROMPTS, SEEDED)) == generate_cli(
        binary, PROMPTS, ["--max-tokens", "16", "--temperature", "0.8", "--top-p", "0.95",
                          "--seed", "7"])


def test_token_id_prompts_and_outputs_agree_with_the_tokenizer(llm):
    ids = llm.tokenizer.encode(PROMPTS[0])
    by_text = llm.generate(PROMPTS[0], GREEDY)[0]
    by_ids = llm.generate([ids], GREEDY)[0]
    assert by_text.prompt_token_ids == ids == by_ids.prompt_token_ids
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    assert by_text.outputs[0].text == llm.tokenizer.decode(by_text.outputs[0].token_ids,
                                                            skip_special_tokens=True)
    assert by_text.outputs[0].finish_reason == "length"
    assert len(by_text.outputs[0].token_ids) == 16


def test_logits_argmax_is_the_greedy_token(llm):
    ids = llm.tokenizer.encode(PROMPTS[2])
    logits = llm.logits(ids)
    assert isinstance(logits, np.ndarray) and logits.dtype == np.float32
    assert logits.shape == (len(ids), llm.tokenizer.vocab_size)
    first = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert int(np.argmax(logits[-1])) == first.outputs[0].token_ids[0]


def test_stream_deltas_concatenate_to_the_final_text(llm):
    for params in (GREEDY, SEEDED, SamplingParams(temperature=0.0, max_tokens=40, stop=["."])):
        whole = llm.generate(PROMPTS[1], params)[0].outputs[0]
        deltas = list(llm.stream(PROMPTS[1], params))
        assert len(deltas) > 1
        assert all(not d.finished for d in deltas[:-1]) and deltas[-1].finished
        assert "".join(d.outputs[0].text for d in deltas) == whole.text
        assert sum((d.outputs[0].token_ids for d in deltas), []) == whole.token_ids
        assert deltas[-1].outputs[0].finish_reason == whole.finish_reason


def test_stop_string_cuts_the_text(llm):
    full = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=40))[0]
    text = full.outputs[0].text
    cut_at = text.index(" ", 3)
    stop = text[cut_at:cut_at + 4]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=40, stop=stop))[0]
    assert out.outputs[0].text == text[:text.index(stop)]
    assert out.outputs[0].finish_reason == "stop"


def test_generate_shows_a_progress_bar_unless_told_not_to(llm, capsys):
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(PROMPTS[:2], params)  # on by default, as vLLM's
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err, err
    llm.chat([[{"role": "user", "content": "Hi"}]], params, use_tqdm=False)
    llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_loading_shows_a_progress_bar_unless_told_not_to(capsys):
    # The default GGUF holds 272 tensors (llama.cpp's loader counts as many).
    pagedlm.LLM(device="cpu", threads=1, kv_cache_bytes=16 << 20).close()
    err = capsys.readouterr().err
    assert "Loading weights" in err and "272/272" in err, err
    pagedlm.LLM(device="cpu", threads=1, kv_cache_bytes=16 << 20, use_tqdm_on_load=False).close()
    assert "Loading weights" not in capsys.readouterr().err


def test_logprobs(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 4
    for token, alternatives in zip(c.token_ids, c.logprobs):
        assert token in alternatives and len(alternatives) >= 3
        # Greedy: the sampled token is the most likely one.
        assert alternatives[token].logprob == max(lp.logprob for lp in alternatives.values())
        assert alternatives[token].logprob <= 0
    assert c.cumulative_logprob == pytest.approx(
        sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))


SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def test_structured_output_validates(llm):
    out = llm.chat([{"role": "user", "content": "Describe a person as JSON."}],
                   SamplingParams(temperature=0.7, seed=3, max_tokens=80, json_schema=SCHEMA))
    c = out[0].outputs[0]
    assert c.finish_reason == "stop", c
    jsonschema.validate(json.loads(c.text), SCHEMA)
    out = llm.generate("Is the sky blue?", SamplingParams(choice=["yes", "no"], max_tokens=8))
    assert out[0].outputs[0].text in ("yes", "no")
    out = llm.generate("A phone number:", SamplingParams(regex="[0-9]{3}-[0-9]{4}",
                                                         max_tokens=16))
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", out[0].outputs[0].text), out[0].outputs[0].text


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def test_tool_calls_parse(llm):
    # Qwen2.5's template writes calls in <tool_call> tags; the grammar has the model write one.
    template = (ROOT / "testdata" / "chat_templates" / "qwen2.5.jinja").read_text()
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    prompt = llm.tokenizer.apply_chat_template(messages, tools=TOOLS, chat_template=template)
    assert "get_weather" in prompt  # the template showed the model its tools
    out = llm.chat(messages, SamplingParams(choice=[call], max_tokens=64), tools=TOOLS,
                   chat_template=template)
    c = out[0].outputs[0]
    assert c.finish_reason == "tool_calls", c
    assert [t.name for t in c.tool_calls] == ["get_weather"]
    assert json.loads(c.tool_calls[0].arguments) == {"city": "Paris"}
    assert c.text.strip() == ""


WEATHER_AND_TIME = TOOLS + [{"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                   "required": ["timezone"]}}}]


def test_tool_choice_forces_a_valid_call(llm):
    # The model is left to its own sampling: only tool_choice's grammar makes it write a call.
    template = (ROOT / "testdata" / "chat_templates" / "qwen2.5.jinja").read_text()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER_AND_TIME}
    for choice, allowed in [("required", {"get_weather", "get_time"}),
                            ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})]:
        out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=96),
                       tools=WEATHER_AND_TIME, chat_template=template, tool_choice=choice)
        c = out[0].outputs[0]
        assert c.finish_reason == "tool_calls", (choice, c)
        assert len(c.tool_calls) == 1 and c.tool_calls[0].name in allowed, (choice, c)
        jsonschema.validate(json.loads(c.tool_calls[0].arguments), schemas[c.tool_calls[0].name])
    # Llama 3.1's template has no tag form: the forced call is a bare JSON reply.
    template = (ROOT / "testdata" / "chat_templates" / "llama3.1.jinja").read_text()
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=96),
                   tools=TOOLS, chat_template=template, tool_choice="required")
    c = out[0].outputs[0]
    assert [t.name for t in c.tool_calls] == ["get_weather"], c
    jsonschema.validate(json.loads(c.tool_calls[0].arguments), schemas["get_weather"])


def test_tool_choice_errors_carry_the_servers_message(llm):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="not among the 'tools'"):
        llm.chat(messages, tools=TOOLS,
                 tool_choice={"type": "function", "function": {"name": "get_time"}})
    with pytest.raises(ValueError, match="non-empty 'tools'"):
        llm.chat(messages, tool_choice="required")
    with pytest.raises(ValueError, match="must be 'auto', 'none', 'required'"):
        llm.chat(messages, tools=TOOLS, tool_choice="always")
    with pytest.raises(ValueError, match="one constraint per request"):
        llm.chat(messages, SamplingParams(regex="[a-z]+"), tools=TOOLS, tool_choice="required")


def test_dummy_weights_run_the_benchmarks_workload(binary):
    # `pagedlm bench`'s own count of the workload it ran is the reference for the requests the
    # binding hands out for the same spec.
    config = ROOT / "testdata" / "fixtures" / "llama3-rope" / "config.json"
    spec = dict(kind="random", num_requests=6, seed=3, prompt_min=8, prompt_max=40,
                output_min=2, output_max=9, prefix_len=0, unique_len=0, warmup=0)
    bench = subprocess.run(
        [binary, "bench", "--dummy", str(config), "--device", "cpu", "--threads", str(THREADS),
         "--json", "--num-requests", "6", "--seed", "3", "--prompt-min", "8", "--prompt-max",
         "40", "--output-min", "2", "--output-max", "9", "--warmup", "0"],
        capture_output=True, text=True, timeout=600)
    assert bench.returncode == 0, bench.stderr
    counted = json.loads(bench.stdout)
    llm = pagedlm.LLM(str(config), load_format="dummy", device="cpu", threads=THREADS,
                      kv_cache_bytes=64 << 20)
    try:
        warm, timed = pagedlm._pagedlm.benchmark_workload(vocab=512, **spec)
        assert warm == [] and len(timed) == 6
        assert sum(len(p) for p, _ in timed) == counted["prompt_tokens"]
        outs = llm.generate([p for p, _ in timed],
                            [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in timed])
        assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n in timed]
        assert sum(n for _, n in timed) == counted["generated_tokens"]
        with pytest.raises(ValueError, match="no tokenizer"):
            llm.generate("text needs a tokenizer")
    finally:
        llm.close()
    with pytest.raises(ValueError, match="load_format must be 'auto' or 'dummy'"):
        pagedlm.LLM(str(config), load_format="random")
    with pytest.raises(ValueError, match="needs model="):
        pagedlm.LLM(load_format="dummy")


def test_poll_all_wakes_for_any_streams_output():
    # One sequence at a time: the first stream given waits for the second one's 1,000 tokens
    # (tens of seconds on a CPU) before its own first; poll_all must return with the second
    # one's first output rather than wait for the first stream.
    engine = pagedlm.LLM(device="cpu", threads=THREADS, kv_cache_bytes=64 << 20, max_num_seqs=1)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
        running = engine._submit(None, engine.tokenizer.encode("Once upon a time"), params)
        waiting = engine._submit(None, engine.tokenizer.encode("The capital of France is"),
                                 params)
        start = time.monotonic()
        states = pagedlm._pagedlm.Stream.poll_all([waiting.stream, running.stream], 60.0)
        # Bit 0: output arrived; bit 1: done. Only the running stream has output, unfinished.
        assert list(states) == [0, 1], (list(states), time.monotonic() - start)
        running.stream.cancel()
        waiting.stream.cancel()
    finally:
        engine.close()


def test_tokenizer_and_chat_template(llm):
    tok = llm.tokenizer
    text = "Hello, world! Ünïcödé"
    assert tok.decode(tok.encode(text)) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert "Hi there" in rendered
    assert tok.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=True) == \
        tok.encode(rendered, add_special_tokens=False)


def test_prefix_cache_and_cache_info(llm):
    prompt = "A long shared prefix: " + " ".join(str(i) for i in range(60))
    llm.generate(prompt, GREEDY)
    again = llm.generate(prompt, GREEDY)[0]
    assert again.cached_tokens > 0
    info = llm.cache_info()
    assert info["page_size"] == 16 and info["pages_total"] > 0
    assert info["prefix_hit_tokens"] >= again.cached_tokens
    assert again.metrics.num_prompt_tokens == len(again.prompt_token_ids)
    assert again.metrics.finished_time >= again.metrics.arrival_time


def test_ctrl_c_mid_generate_leaves_the_engine_usable(llm):
    expected = texts(llm.generate(PROMPTS, GREEDY))
    # While decoding; while prefilling a 4,000-token prompt (seconds on a CPU).
    long_prompt = llm.tokenizer.encode(" ".join(["word"] * 4000))
    params = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0.0)
    for prompt in (PROMPTS[:1], [long_prompt]):
        sent = []

        def interrupt():
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)

        timer = threading.Timer(1.0, interrupt)
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(prompt, params)
            raised = time.monotonic()
        finally:
            timer.cancel()
            timer.join()
        assert sent and raised - sent[0] < 1.0, raised - sent[0]
        # The next call is served, with the answers of before.
        assert texts(llm.generate(PROMPTS, GREEDY)) == expected


def test_two_engines_in_one_process_answer_as_one_alone(llm):
    alone_greedy = texts(llm.generate(PROMPTS, GREEDY))
    alone_seeded = texts(llm.generate(PROMPTS, SEEDED))
    other = pagedlm.LLM(device="cpu", threads=1, kv_cache_bytes=256 << 20)
    try:
        results = {}

        def run(name, engine):
            results[name] = (texts(engine.generate(PROMPTS, GREEDY)),
                             texts(engine.generate(PROMPTS, SEEDED)))

        threads = [threading.Thread(target=run, args=(n, e))
                   for n, e in (("first", llm), ("second", other))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for name in ("first", "second"):
            assert results[name] == (alone_greedy, alone_seeded), name
    finally:
        other.close()


def test_asyncio_32_concurrent_streams(llm):
    prompts = [f"Story number {i}:" for i in range(32)]
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=12) for i in range(32)]
    expected = texts(llm.generate(prompts, params))
    engine = pagedlm.AsyncLLM.from_llm(llm)

    async def one(prompt, p):
        parts, finished = [], False
        async for delta in engine.generate(prompt, p):
            assert not finished
            parts.append(delta.outputs[0].text)
            finished = delta.finished
        assert finished
        return "".join(parts)

    async def main():
        return await asyncio.gather(*(one(t, p) for t, p in zip(prompts, params)))

    assert asyncio.run(main()) == expected


def test_bad_params_raise_the_engine_message(llm):
    cases = [(SamplingParams(temperature=-1.0), "temperature must be >= 0, got -1"),
             (SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\], got 0"),
             (SamplingParams(presence_penalty=3.0), r"presence_penalty must be in \[-2, 2\]"),
             (SamplingParams(json_schema="{not json"), "the JSON schema is not valid JSON")]
    for params, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPTS[0], params)
    with pytest.raises(ValueError, match="out of range for a vocabulary of"):
        llm.generate([[1, 2, 10 ** 7]], GREEDY)
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        pagedlm.LLM("/nonexistent/model.gguf")
    with pytest.raises(ValueError, match="device"):
        pagedlm.LLM(device="tpu")
    # Still serving.
    assert llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].text


def test_llm_seed_seeds_each_request_in_turn(llm):
    params = SamplingParams(temperature=0.9, max_tokens=12)
    seeded = pagedlm.LLM(device="cpu", threads=THREADS, kv_cache_bytes=64 << 20, seed=5)
    try:
        got = texts(seeded.generate(PROMPTS[:3], params))
    finally:
        seeded.close()
    # Request i of an LLM made with seed=5 samples as a request given seed 5 + i.
    expected = texts(llm.generate(PROMPTS[:3], [SamplingParams(temperature=0.9, max_tokens=12,
                                                               seed=5 + i) for i in range(3)]))
    assert got == expected
