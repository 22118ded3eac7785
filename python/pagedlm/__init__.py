"""pagedlm: a paged-KV-cache LLM inference engine, from Python.

The API follows vLLM's offline one::

    from pagedlm import LLM, SamplingParams
    llm = LLM()  # the default model (SmolLM2-135M-Instruct), on the CPU
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    print(out[0].outputs[0].text)

`LLM` runs one engine on a thread of its own; `generate`, `chat`, `stream` and `logits` hand it
requests and wait for their answers with the GIL released. `AsyncLLM` streams answers to asyncio.
"""

from pagedlm._llm import LLM, AsyncLLM, Tokenizer
from pagedlm._outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, ToolCall
from pagedlm._params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "Tokenizer",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "ToolCall",
]
