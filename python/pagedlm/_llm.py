"""LLM and AsyncLLM: vLLM's offline and asyncio APIs over pagedlm's engine thread."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import time
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional, Sequence, Union

from pagedlm import _pagedlm
from pagedlm._outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, ToolCall
from pagedlm._params import SamplingParams

# A prompt: text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}.
Prompt = Union[str, Sequence[int], Dict[str, Any]]

# How long one wait for the engine lasts with the GIL released; Python sees Ctrl-C between two.
_POLL_SECONDS = 0.05


class _LoadBar:
    """A progress bar of the weights loading (LLM(use_tqdm_on_load=True)), drawn on stderr
    from the loader's first report (tensors of a GGUF file, bytes of safetensors shards)."""

    def __init__(self):
        self._bar = None

    def update(self, done: int, total: int) -> None:
        if self._bar is None:
            from tqdm.auto import tqdm  # imported on first use: it is not cheap to import

            self._bar = tqdm(total=total, desc="Loading weights", dynamic_ncols=True)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class Tokenizer:
    """The model's tokenizer and chat template (llm.tokenizer / llm.get_tokenizer())."""

    def __init__(self, model: "_pagedlm.Model"):
        self._model = model

    @property
    def vocab_size(self) -> int:
        return self._model.vocab_size

    @property
    def eos_token_ids(self) -> List[int]:
        return list(self._model.eos_token_ids)

    @property
    def chat_template(self) -> Optional[str]:
        return self._model.chat_template_source()

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return list(self._model.encode(text, add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._model.decode([int(t) for t in token_ids], skip_special_tokens)

    def apply_chat_template(
        self,
        messages: List[Dict[str, Any]],
        tools: Optional[List[Dict[str, Any]]] = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: Optional[str] = None,
        **kwargs: Any,
    ) -> Union[str, List[int]]:
        """Renders a conversation as transformers' apply_chat_template does; chat_template: a
        Jinja source to use instead of the model's; kwargs: more template variables."""
        extra = dict(kwargs)
        if tools is not None:
            extra["tools"] = tools
        text = self._model.apply_chat_template(
            json.dumps(messages), add_generation_prompt, json.dumps(extra), chat_template or ""
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _token_ids(tokens: Sequence[int]) -> List[int]:
    """A list of its own of the ids as Python ints (numpy's integers too, as their values)."""
    ids = list(tokens)
    # Type by type in C rather than int() per token in Python: a batch's prompts are submitted
    # while the engine waits for them (256 prompts of 100-1024 tokens: ~1 ms rather than ~8).
    if not set(map(type, ids)) <= {int}:
        ids = [int(t) for t in ids]
    return ids


class _Request:
    """One prompt in flight: its native stream and what the caller gets back."""

    def __init__(self, request_id: str, stream: "_pagedlm.Stream", prompt: Optional[str],
                 prompt_ids: List[int], tokenizer: Optional[Tokenizer], parse_calls: bool):
        self.request_id = request_id
        self.stream = stream
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.tokenizer = tokenizer
        self.parse_calls = parse_calls
        self.metrics = RequestMetrics(arrival_time=time.time(),
                                      num_prompt_tokens=len(prompt_ids))

    def poll(self, timeout: float) -> bool:
        got = self.stream.poll(timeout)
        if got:
            self.got_output()
        return got

    def got_output(self) -> None:
        """A poll took in output: the first one times the first token."""
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.time()

    def done(self) -> bool:
        return self.stream.done()

    def _logprobs(self, entries) -> List[Dict[int, Logprob]]:
        decode = (lambda t: self.tokenizer.decode([t])) if self.tokenizer else (lambda t: None)
        out = []
        for token, logprob, top in entries:
            d = {token: Logprob(logprob, decode(token))}
            for alt, alt_logprob in top:
                d.setdefault(alt, Logprob(alt_logprob, decode(alt)))
            out.append(d)
        return out

    def _completion(self, i: int, text: str, reasoning: str, ids: List[int], entries, finish,
                    wants_logprobs: bool, result: Optional[Dict[str, Any]]) -> CompletionOutput:
        """result: the choice's stream.result(i) once it finished (None before)."""
        calls: List[ToolCall] = []
        if result is not None:
            calls = [ToolCall(name, args) for name, args in result["tool_calls"]]
        return CompletionOutput(
            index=i,
            text=text,
            token_ids=ids,
            finish_reason=finish,
            logprobs=self._logprobs(entries) if wants_logprobs else None,
            reasoning_content=reasoning or None,
            tool_calls=calls,
        )

    def delta(self, wants_logprobs: bool) -> RequestOutput:
        """What arrived since the last delta."""
        outputs = []
        for i in range(self.stream.num_choices()):
            text, reasoning, ids, entries, finish = self.stream.take(i)
            result = self.stream.result(i) if finish is not None else None
            outputs.append(self._completion(i, text, reasoning, ids, entries, finish,
                                            wants_logprobs, result))
        return self._output(outputs, list(self.prompt_ids))

    def next_delta(self, got: bool, wants_logprobs: bool) -> Optional[RequestOutput]:
        """After a poll that took in output (got) or not: the delta to hand out, None when
        nothing is new; raises the request's error once it is done."""
        done = self.done()
        if done:
            self.stream.raise_error()
        return self.delta(wants_logprobs) if got or done else None

    def final(self, wants_logprobs: bool) -> RequestOutput:
        """The whole output, once done (the request's last use: its prompt ids go with it)."""
        self.stream.raise_error()
        outputs = []
        results = [self.stream.result(i) for i in range(self.stream.num_choices())]
        for i, result in enumerate(results):
            # All logprobs: never taken before.
            entries = self.stream.take(i)[3] if wants_logprobs else []
            text = result["content"] if self.parse_calls else result["text"]
            out = self._completion(i, text, result["reasoning"], result["token_ids"], entries,
                                   result["finish_reason"], wants_logprobs, result)
            if out.logprobs is not None:
                out.cumulative_logprob = sum(
                    d[t].logprob for d, t in zip(out.logprobs, out.token_ids))
            outputs.append(out)
        return self._output(outputs, self.prompt_ids, results)

    def _output(self, outputs: List[CompletionOutput], prompt_ids: List[int],
                results: Optional[List[Dict[str, Any]]] = None) -> RequestOutput:
        """results: every choice's stream.result(i), when the caller has them."""
        finished = self.stream.done()
        if finished and self.metrics.finished_time is None:
            self.metrics.finished_time = time.time()
        cached = 0
        if finished:
            if results is None:
                results = [self.stream.result(i) for i in range(self.stream.num_choices())]
            cached = max(r["num_cached_tokens"] for r in results)
            self.metrics.num_generation_tokens = sum(len(r["token_ids"]) for r in results)
        return RequestOutput(self.request_id, self.prompt, prompt_ids, outputs,
                             finished, cached, self.metrics)


class LLM:
    """A model and its engine, as vLLM's LLM.

    model: an HF folder or a .gguf file (None: the default model, SmolLM2-135M-Instruct, fetched
    by scripts/fetch_model.sh). The options are `pagedlm serve`'s engine flags: device ("cpu",
    "cuda" or "auto"), page_size (tokens per KV page), num_pages (0: sized from kv_cache_bytes on
    the CPU, gpu_memory_fraction on the GPU), max_num_batched_tokens (0: the device's default),
    max_num_seqs, target_itl_ms (-1: the device's default), enable_prefix_cache, threads (CPU
    threads, 0: all; each LLM's engine thread keeps its own count), cpu_q8_activations,
    cpu_fixed32_activations, gpu_memory_fraction, use_cuda_graphs, and:

    - dtype: activations and dense weights, "auto" (the device's: "float32" on the CPU,
      "bfloat16" on the GPU, the only ones their kernels take; another raises ValueError). --dtype.
    - kv_cache_dtype: the KV cache's elements, "auto" (the compute dtype: f32 on the CPU, bf16
      on the GPU), "bf16" (on the CPU half the bytes of its f32 pages, each value rounded) or
      "fp8" (GPU: e4m3 with the checkpoint's per-layer k_scale / v_scale, else 1.0; twice the
      pages of bf16). --kv-cache-dtype.
    - quantization: "auto" keeps an FP8 checkpoint's weights in FP8 where the GPU can, "fp8"
      quantizes every projection to FP8 at load (GPUs with FP8 tensor cores), "none" runs every
      weight in bf16; with load_format="dummy", a GGUF block format ("q8_0", "q4_k", ...) makes
      the random projections blocks of it. --quantization.
    - async_scheduling: plan step N + 1 while the device runs step N; None: the device's default
      (on on the GPU, off on the CPU). Greedy and seeded outputs are the same either way.
      --async-scheduling / --no-async-scheduling.
    - gguf_blocks: GPU, a GGUF model: keep the projections in their blocks instead of expanding
      them to bf16 at load (a third to a quarter of the memory). --gguf-blocks.
    - use_cascade_attention, tune_gemms: GPU; False for A/B runs (--no-cascade-attention,
      --no-gemm-tuning).
    - tensor_parallel_size: CPU ranks (threads of this process, each running `threads` OpenMP
      threads) that split the model; a divisor of its attention heads.
      --tensor-parallel-size. GPU ranks are processes, which `pagedlm serve` starts: on the
      GPU, a size above 1 raises ValueError.

    seed: requests without a seed of their own get
    seed, seed + 1, ... in the order they are made (None: random). chat_template: a Jinja file
    replacing the model's template. reasoning_parser: any value splits chat replies' <think> block
    into reasoning_content. max_waiting: requests queued at most (beyond: RuntimeError).
    load_format: "auto" (the model's weights) or "dummy", as vLLM's: random weights of the shape
    model (a config.json, or a folder holding one) gives, and no tokenizer (prompts as token ids),
    for benchmarks (`pagedlm bench --dummy`).

    use_tqdm_on_load: a progress bar of the weights loading on stderr (vLLM's option; on by
    default, False for none).

    A missing model raises FileNotFoundError; a bad option ValueError, with the command line's
    message (an option value it does not know, or one this device cannot run).
    """

    def __init__(
        self,
        model: Optional[str] = None,
        *,
        device: str = "auto",
        page_size: int = 16,
        num_pages: int = 0,
        kv_cache_bytes: int = 2 << 30,
        max_num_batched_tokens: int = 0,
        max_num_seqs: int = 256,
        target_itl_ms: float = -1,
        enable_prefix_cache: bool = True,
        threads: int = 0,
        cpu_q8_activations: bool = False,
        cpu_fixed32_activations: bool = False,
        gpu_memory_fraction: float = 0.9,
        use_cuda_graphs: bool = True,
        seed: Optional[int] = None,
        chat_template: Optional[str] = None,
        reasoning_parser: Optional[str] = None,
        max_waiting: int = 1 << 20,
        load_format: str = "auto",
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        quantization: str = "auto",
        async_scheduling: Optional[bool] = None,
        gguf_blocks: bool = False,
        use_cascade_attention: bool = True,
        tune_gemms: bool = True,
        tensor_parallel_size: int = 1,
        use_tqdm_on_load: bool = True,
    ):
        if async_scheduling is not None and not isinstance(async_scheduling, bool):
            raise ValueError("async_scheduling must be True, False or None (the device's "
                             f"default), got {async_scheduling!r}")
        load_bar = _LoadBar() if use_tqdm_on_load and load_format != "dummy" else None
        try:
            self._model = _pagedlm.Model(
                model=os.fspath(model) if model is not None else "", device=device,
                page_size=page_size, num_pages=num_pages, kv_cache_bytes=kv_cache_bytes,
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                target_itl_ms=float(target_itl_ms), enable_prefix_cache=enable_prefix_cache,
                threads=threads, cpu_q8_activations=cpu_q8_activations,
                cpu_fixed32_activations=cpu_fixed32_activations,
                gpu_memory_fraction=gpu_memory_fraction, use_cuda_graphs=use_cuda_graphs,
                max_waiting=max_waiting,
                chat_template=os.fspath(chat_template) if chat_template else "",
                load_format=load_format, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                quantization=quantization,
                async_scheduling=-1 if async_scheduling is None else int(async_scheduling),
                gguf_blocks=gguf_blocks, use_cascade_attention=use_cascade_attention,
                tune_gemms=tune_gemms, tensor_parallel_size=tensor_parallel_size,
                load_progress=load_bar.update if load_bar is not None else None)
        finally:
            if load_bar is not None:
                load_bar.close()
        self._tokenizer = Tokenizer(self._model) if self._model.has_tokenizer() else None
        self._seed = seed
        self._reasoning = reasoning_parser is not None
        self._counter = itertools.count()
        self._grammars: Dict[tuple, Any] = {}

    # ---- the model -------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise ValueError("this model has no tokenizer: give token ids")
        return self._tokenizer

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    @property
    def device(self) -> str:
        return self._model.device

    @property
    def max_model_len(self) -> int:
        return self._model.max_model_len

    def cache_info(self) -> Dict[str, int]:
        """The KV cache between two steps: pages (total, used, free, cached), prefix-cache
        counters (query and hit tokens) and the sequences running and waiting."""
        return dict(self._model.cache_info())

    def close(self) -> None:
        """Stops the engine thread (also done when the LLM is garbage)."""
        self._model.close()

    # ---- requests --------------------------------------------------------------------------
    def _prompt(self, prompt: Prompt) -> tuple:
        """(text or None, token ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return None, _token_ids(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, _token_ids(prompt)

    def _grammar(self, params: SamplingParams):
        spec = params.structured()
        if spec is None:
            return None
        kind, text, choices = spec
        key = (kind, text, tuple(choices))
        if key not in self._grammars:
            self._grammars[key] = self._model.compile_grammar(kind, text, choices, True)
        return self._grammars[key]

    def _submit(self, text: Optional[str], ids: List[int], params: SamplingParams,
                tool_calls: str = "none", reasoning_opened: Optional[bool] = None,
                prompt_logits: bool = False, grammar: Any = None) -> _Request:
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(0, self.max_model_len - len(ids))
        sampler = params.sampler_fields()
        number = next(self._counter)
        if sampler["seed"] is None and self._seed is not None:
            sampler["seed"] = self._seed + number
        reasoning = reasoning_opened is not None
        stream = self._model.submit(
            [ids], sampler, [int(max_tokens)], int(params.n), params.stop_strings(),
            -1 if params.logprobs is None else int(params.logprobs), tool_calls, reasoning,
            bool(reasoning_opened), grammar if grammar is not None else self._grammar(params),
            prompt_logits)
        return _Request(str(number), stream, text, ids, self._tokenizer, tool_calls != "none")

    @staticmethod
    def _params_list(params, count: int) -> List[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"{len(params)} sampling params for {count} prompts")
        return params

    def _run_all(self, submits, params: List[SamplingParams],
                 use_tqdm: bool) -> List[RequestOutput]:
        """Submits every request (each a call that submits one), waits for all of them (a
        progress bar of the finished ones on stderr with use_tqdm) and returns their outputs; on
        any error, those already submitted are cancelled."""
        requests: List[_Request] = []
        # The engine admits the whole batch at one step boundary, as if handed over at once.
        self._model.hold_admissions()
        try:
            for submit in submits:
                requests.append(submit())
        except BaseException:
            for r in requests:
                r.stream.cancel()
            raise
        finally:
            self._model.release_admissions()
        self._wait(requests, "Processed prompts" if use_tqdm else None)
        return [r.final(p.logprobs is not None) for r, p in zip(requests, params)]

    @staticmethod
    def _wait(requests: List[_Request], progress: Optional[str] = None) -> None:
        """Waits until every request is done, counting the finished ones in a progress bar
        named `progress` where one is given; Ctrl-C cancels them all (the engine leaves the step
        in progress) and raises KeyboardInterrupt, the engine ready for the next call."""
        bar = None
        if progress is not None:
            from tqdm.auto import tqdm  # imported on first use: it is not cheap to import

            bar = tqdm(total=len(requests), desc=progress, unit="req", dynamic_ncols=True)
        try:
            pending = list(requests)
            streams = [r.stream for r in pending]
            # Once per engine step (poll_all wakes at a step's end): this loop is the Python
            # work of a step.
            while pending:
                states = _pagedlm.Stream.poll_all(streams, _POLL_SECONDS)
                for r, state in zip(pending, states):
                    if state & 1 and r.metrics.first_token_time is None:
                        r.got_output()
                if any(state & 2 for state in states):
                    before = len(pending)
                    pending = [r for r, state in zip(pending, states) if not state & 2]
                    streams = [r.stream for r in pending]
                    if bar is not None:
                        bar.update(before - len(pending))
        except BaseException:
            for r in requests:
                r.stream.cancel()
            raise
        finally:
            if bar is not None:
                bar.close()

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: bool = True,
    ) -> List[RequestOutput]:
        """Generates for each prompt (text, token ids, or a list of either); one RequestOutput per
        prompt, in order. sampling_params: one for all, or one per prompt. use_tqdm: a progress
        bar of the finished prompts on stderr (vLLM's default; False for none)."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_list(sampling_params, len(prompts))

        def submit(prompt: Prompt, p: SamplingParams) -> _Request:
            text, ids = self._prompt(prompt)
            return self._submit(text, ids, p)

        return self._run_all([functools.partial(submit, prompt, p)
                              for prompt, p in zip(prompts, params)], params, use_tqdm)

    def _forced_tool_call(self, tools, tool_choice, template_format: str):
        """(grammar, call form) of the one call tool_choice forces, or None ("auto", "none");
        template_format: the chat template's call form (Model.tool_call_format)."""
        if isinstance(tool_choice, str) and tool_choice in ("auto", "none"):
            return None
        return self._model.compile_tool_choice(json.dumps(tools), json.dumps(tool_choice),
                                               template_format)

    def _chat_prompt(self, messages, tools, chat_template, add_generation_prompt, kwargs):
        """(text, token ids, reasoning opened) of one conversation."""
        tokenizer = self.tokenizer
        text = tokenizer.apply_chat_template(messages, tools=tools,
                                             add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, **(kwargs or {}))
        opened = _pagedlm.prompt_opens_reasoning(text) if self._reasoning else None
        return text, tokenizer.encode(text, add_special_tokens=False), opened

    def chat(
        self,
        messages: Union[List[Dict[str, Any]], List[List[Dict[str, Any]]]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        tools: Optional[List[Dict[str, Any]]] = None,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
        use_tqdm: bool = True,
        tool_choice: Union[str, Dict[str, Any]] = "auto",
    ) -> List[RequestOutput]:
        """Answers a conversation (a list of {"role", "content"} messages) or a list of them,
        rendered with the model's chat template (or chat_template, a Jinja source). With tools
        (OpenAI's function list) on a template whose call form is known, the reply's calls are
        parsed into CompletionOutput.tool_calls. tool_choice, as OpenAI's: "auto" (the model
        decides), "none", "required" (the reply is one call to one of the tools) or
        {"type": "function", "function": {"name": ...}} (one call to that tool); a forced call's
        arguments are held to the tool's parameter schema, so no sampling_params may carry
        another grammar. use_tqdm: a progress bar of the finished conversations on stderr, as
        generate's."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        params = self._params_list(sampling_params, len(conversations))
        # The template's call form, read from its source once for the whole call.
        source = chat_template or self.tokenizer.chat_template or ""
        template_format = self._model.tool_call_format(source)
        forced = self._forced_tool_call(tools, tool_choice, template_format)
        if forced is not None and any(p.structured() is not None for p in params):
            raise ValueError("tool_choice and a structured-output constraint in sampling_params "
                             "cannot be combined: one constraint per request")
        tool_calls = "none"
        if tools:
            if "tools" not in source:
                raise ValueError("this chat template does not render 'tools'; the model would "
                                 "not see them")
            tool_calls = template_format

        def submit(conversation, p: SamplingParams) -> _Request:
            text, ids, opened = self._chat_prompt(
                conversation, tools, chat_template, add_generation_prompt, chat_template_kwargs)
            if forced is not None:
                grammar, forced_format = forced
                return self._submit(text, ids, p, forced_format, opened, grammar=grammar)
            return self._submit(text, ids, p, tool_calls, opened)

        return self._run_all([functools.partial(submit, c, p)
                              for c, p in zip(conversations, params)], params, use_tqdm)

    def stream(self, prompt: Prompt,
               sampling_params: Optional[SamplingParams] = None) -> Iterator[RequestOutput]:
        """Yields one prompt's output as it is generated: each RequestOutput's outputs hold the
        text and token ids new since the previous one (their concatenation is the whole
        output); the last has finished set."""
        params = sampling_params or SamplingParams()
        text, ids = self._prompt(prompt)
        request = self._submit(text, ids, params)
        return self._deltas(request, params)

    def _deltas(self, request: _Request, params: SamplingParams) -> Iterator[RequestOutput]:
        try:
            while True:
                out = request.next_delta(request.poll(_POLL_SECONDS), params.logprobs is not None)
                if out is not None:
                    yield out
                if request.done():
                    return
        finally:
            if not request.done():
                request.stream.cancel()

    def logits(self, token_ids: Union[Sequence[int], Sequence[Sequence[int]]]):
        """Every prompt position's logits (float32 numpy array [len, vocab]) for token ids, or a
        list of arrays for a list of prompts; computed in one batch, never from the cache."""
        single = bool(token_ids) and isinstance(token_ids[0], int)
        prompts = [token_ids] if single else list(token_ids)
        params = SamplingParams(max_tokens=0, temperature=0.0)
        requests = [self._submit(None, _token_ids(p), params, prompt_logits=True)
                    for p in prompts]
        self._wait(requests)
        out = []
        for r in requests:
            r.stream.raise_error()
            out.append(r.stream.prompt_logits(0))
        return out[0] if single else out


class AsyncLLM:
    """LLM for asyncio: generate() is an async iterator of deltas, as LLM.stream's; any number of
    them may run at once on one event loop (the engine batches them)."""

    def __init__(self, model: Optional[str] = None, **options: Any):
        self.llm = LLM(model, **options)

    @classmethod
    def from_llm(cls, llm: LLM) -> "AsyncLLM":
        """An AsyncLLM over an LLM's engine (both may be used, from one thread each)."""
        engine = cls.__new__(cls)
        engine.llm = llm
        return engine

    @property
    def tokenizer(self) -> Tokenizer:
        return self.llm.tokenizer

    async def generate(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        params = sampling_params or SamplingParams()
        text, ids = self.llm._prompt(prompt)
        request = self.llm._submit(text, ids, params)
        if request_id is not None:
            request.request_id = request_id
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        fd = request.stream.notify_fd()

        def readable() -> None:
            try:
                while os.read(fd, 4096):
                    pass
            except BlockingIOError:
                pass
            wake.set()

        loop.add_reader(fd, readable)
        try:
            while True:
                wake.clear()
                out = request.next_delta(request.poll(0), params.logprobs is not None)
                if out is not None:
                    yield out
                if request.done():
                    return
                await wake.wait()
        finally:
            loop.remove_reader(fd)
            if not request.done():
                request.stream.cancel()
