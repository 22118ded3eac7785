"""What generate, chat and stream return, shaped as vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class Logprob:
    """A token's log-probability under the model (before temperature and filters)."""

    logprob: float
    decoded_token: Optional[str] = None


@dataclass
class ToolCall:
    """One call the reply made: the tool's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass
class CompletionOutput:
    """One sample of one prompt. In a stream, text and token_ids hold what is new since the
    previous item; finish_reason is set on the last ("stop", "length", "tool_calls", "abort")."""

    index: int
    text: str
    token_ids: List[int]
    finish_reason: Optional[str] = None
    # Per generated token: {token id: Logprob} for the sampled token and its alternatives.
    logprobs: Optional[List[Dict[int, Logprob]]] = None
    reasoning_content: Optional[str] = None
    # Chat with tools: the reply's calls; text then holds the rest of the reply.
    tool_calls: List[ToolCall] = field(default_factory=list)
    cumulative_logprob: Optional[float] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request, and its token counts."""

    arrival_time: float
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


@dataclass
class RequestOutput:
    """A prompt and its samples."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    cached_tokens: int = 0  # prompt tokens served by the prefix cache
    metrics: Optional[RequestMetrics] = None

    @property
    def num_cached_tokens(self) -> int:
        return self.cached_tokens
