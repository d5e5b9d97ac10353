"""The engine interface the server drives: render a chat into a prompt, stream deltas, abort.

Two implementations: :class:`~zerolayer.runtime.engine.synthetic.SyntheticEngine`
(deterministic, no model, for tests and benchmarks that isolate protocol and
scheduling cost) and :class:`~zerolayer.runtime.engine.vllm_engine.VllmEngine` (vLLM's
``AsyncLLM`` in this process, with vLLM's own tokenizer and chat template). Engines
import nothing above this layer; they raise :class:`~zerolayer.runtime.errors.EngineError`.
"""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator, Protocol, Sequence

from zerolayer.runtime.errors import EngineError


class InputRejected(EngineError):
    """The engine refuses this request's input (a chat template that rejects the messages, text
    that cannot be tokenized): the client's mistake, answered 400 INVALID_REQUEST, not retried."""


@dataclasses.dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant"
    content: str


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A chat rendered by the model's template, ready to generate from."""

    text: str
    token_ids: tuple[int, ...]

    @property
    def token_count(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclasses.dataclass(frozen=True)
class Delta:
    """New output since the previous delta. ``finish_reason`` is set on the last one:
    ``"stop"`` (end of turn or a stop string), ``"length"`` (max_tokens) or ``"abort"``."""

    text: str
    token_count: int
    finish_reason: str | None = None


@dataclasses.dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_cache_usage: float  # 0..1


class Engine(Protocol):
    kind: str  # "synthetic" | "vllm"
    models: Sequence[str]

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    def ready(self) -> bool: ...
    async def render(self, model: str, messages: Sequence[ChatMessage]) -> Prompt: ...
    def generate(
        self, prompt: Prompt, options: SamplingOptions, request_id: str, priority: int
    ) -> AsyncIterator[Delta]: ...
    async def abort(self, request_id: str) -> None: ...
    def stats(self) -> EngineStats: ...
