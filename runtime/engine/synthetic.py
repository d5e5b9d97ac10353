"""A deterministic stand-in for a model, named as one: the *synthetic* engine.

It renders chats with a fixed plain template, counts whitespace-separated words as
tokens and answers with words chosen by a hash of the prompt, so the same request
always gets the same answer. Optional pacing (time to first token, tokens per second)
makes streams last long enough for scheduling tests; with no pacing it measures pure
protocol cost. KV-cache use is modelled as tokens held by running requests over
``kv_capacity_tokens``, so memory pressure can be produced on purpose.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import AsyncIterator, Sequence

from zerolayer.runtime.engine.base import ChatMessage, Delta, EngineStats, Prompt, SamplingOptions
from zerolayer.runtime.errors import EngineError

_WORDS = (
    "zero layer stream token header tenant session priority deadline engine cache memory "
    "node cluster quota budget admit refuse settle observe sample pressure window frame"
).split()


class SyntheticEngine:
    kind = "synthetic"

    def __init__(
        self,
        models: Sequence[str] = ("synthetic",),
        *,
        output_tokens: int = 16,
        ttft_s: float = 0.0,
        tokens_per_second: float | None = None,
        kv_capacity_tokens: int = 65536,
        max_model_len: int | None = None,
    ) -> None:
        if not models:
            raise EngineError("the synthetic engine needs at least one model name")
        self.models = tuple(models)
        self.output_tokens = output_tokens
        self.ttft_s = ttft_s
        self.tokens_per_second = tokens_per_second
        self.kv_capacity_tokens = kv_capacity_tokens
        self.max_model_len = max_model_len  # context size (prompt + output) in tokens; None: unbounded
        self._held: dict[str, int] = {}  # request_id -> tokens in the modelled KV cache
        self._aborted: set[str] = set()
        self._started = False

    async def start(self) -> None:
        self._started = True

    async def close(self) -> None:
        self._started = False

    def ready(self) -> bool:
        return self._started

    async def render(self, model: str, messages: Sequence[ChatMessage]) -> Prompt:
        text = "".join(f"<{m.role}> {m.content}\n" for m in messages) + "<assistant>"
        ids = tuple(int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "big") % 32000
                    for w in text.split())
        return Prompt(text=text, token_ids=ids)

    async def generate(
        self, prompt: Prompt, options: SamplingOptions, request_id: str, priority: int
    ) -> AsyncIterator[Delta]:
        digest = hashlib.sha256(prompt.text.encode()).digest()
        count = min(options.max_tokens, self.output_tokens)
        finish = "length" if count >= options.max_tokens else "stop"
        self._held[request_id] = prompt.token_count
        try:
            if self.ttft_s:
                await asyncio.sleep(self.ttft_s)
            for i in range(count):
                if request_id in self._aborted:
                    yield Delta("", 0, "abort")
                    return
                if i and self.tokens_per_second:
                    await asyncio.sleep(1.0 / self.tokens_per_second)
                word = _WORDS[digest[i % len(digest)] % len(_WORDS)]
                self._held[request_id] += 1
                yield Delta(word if i == 0 else " " + word, 1, finish if i == count - 1 else None)
            if count == 0:
                yield Delta("", 0, finish)
        finally:
            self._held.pop(request_id, None)
            self._aborted.discard(request_id)

    async def abort(self, request_id: str) -> None:
        if request_id in self._held:
            self._aborted.add(request_id)

    def stats(self) -> EngineStats:
        used = sum(self._held.values())
        return EngineStats(running=len(self._held), waiting=0,
                           kv_cache_usage=min(1.0, used / self.kv_capacity_tokens))
