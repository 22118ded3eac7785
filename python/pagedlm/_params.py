"""SamplingParams: what the engine samples with and where an output stops."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union


@dataclass
class SamplingParams:
    """Sampling and stopping for one request, as the HTTP server takes them.

    temperature 0 is greedy. top_k 0, top_p 1 and min_p 0 are off. The penalties are OpenAI's
    (presence, frequency: [-2, 2]) and vLLM's repetition penalty (1: off). seed makes the sample
    reproducible whatever else runs in the batch. max_tokens None: up to the model's context.
    stop: strings that end the output (not part of it); stop_token_ids: tokens that do.
    logprobs: the sampled token's log-probability and this many alternatives (None: off).
    At most one of json_schema (a dict or its JSON text), json_object, regex, choice and
    grammar (EBNF, root rule "root") holds the output to a grammar (structured output).
    The engine checks the values; a bad one raises ValueError with its message.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: Optional[int] = 16
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[Dict[int, float]] = None
    logprobs: Optional[int] = None
    json_schema: Optional[Union[Dict[str, Any], str]] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict, repr=False)

    def stop_strings(self) -> List[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampler_fields(self) -> Dict[str, Any]:
        """The fields the native engine takes as they are."""
        return {
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": int(self.top_k),
            "min_p": float(self.min_p),
            "presence_penalty": float(self.presence_penalty),
            "frequency_penalty": float(self.frequency_penalty),
            "repetition_penalty": float(self.repetition_penalty),
            "seed": self.seed,
            "ignore_eos": bool(self.ignore_eos),
            "stop_token_ids": list(self.stop_token_ids or []),
            "logit_bias": [(int(t), float(b)) for t, b in (self.logit_bias or {}).items()],
        }

    def structured(self) -> Optional[tuple]:
        """(kind, text, choices) of the grammar the output is held to, or None."""
        given = [
            ("json_schema", self.json_schema is not None),
            ("json_object", self.json_object),
            ("regex", self.regex is not None),
            ("choice", self.choice is not None),
            ("grammar", self.grammar is not None),
        ]
        kinds = [k for k, on in given if on]
        if len(kinds) > 1:
            raise ValueError(f"give at most one of {', '.join(kinds)}")
        if not kinds:
            return None
        kind = kinds[0]
        if kind == "json_schema":
            schema = self.json_schema
            text = schema if isinstance(schema, str) else json.dumps(schema)
            return ("json_schema", text, [])
        if kind == "json_object":
            return ("json_object", "", [])
        if kind == "regex":
            return ("regex", self.regex, [])
        if kind == "choice":
            return ("choice", "", [str(c) for c in self.choice])
        return ("grammar", self.grammar, [])
