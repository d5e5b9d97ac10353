"""Several base models on one node: one engine each, chosen by the request's model.

:class:`ModelRouter` is an :class:`~zerolayer.runtime.engine.base.Engine` over several engines
(for vLLM, one ``AsyncLLM`` per base model, each on its own GPUs). The server asks it for the
engine of the model a request names (:meth:`ModelRouter.for_model`) and drives that engine for
the whole stream: render, generate, tool-call parsing and abort all go to the same one. What the
server reads of the node as a whole (readiness, models, adapters, stats) is the engines' together.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Mapping, Sequence

from zerolayer.runtime.engine.base import (
    ChatMessage,
    Delta,
    Engine,
    EngineStats,
    MemoryRelease,
    Prompt,
    SamplingOptions,
    ToolCall,
    ToolCallStream,
    ToolSpec,
    ToolUse,
)
from zerolayer.runtime.errors import ConfigError, EngineError


def each_engine(engine: Any) -> tuple[Any, ...]:
    """The engines behind ``engine``: a :class:`ModelRouter`'s (``engines:``, one per base model), or
    ``engine`` itself."""
    return tuple(getattr(engine, "engines", (engine,)))


class ModelRouter:
    """Engines by model name. Every name (base models and LoRA adapters) belongs to exactly one
    engine; the first engine's first model answers requests that name none. Names are read from the
    engines at each call, so adapters loaded or unloaded in a running engine are served or refused
    at once (``for_model(base).add_adapter(...)`` reaches the engine of a base model)."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        if not engines:
            raise ConfigError("engines: give at least one")
        self.engines = tuple(engines)
        self._owners()  # refuses a name two engines serve
        self.kind = "+".join(dict.fromkeys(e.kind for e in self.engines))

    def _owners(self) -> dict[str, Engine]:
        """Every served name's engine, read afresh: an engine's adapters change while it runs."""
        owner: dict[str, Engine] = {}
        for engine in self.engines:
            for name in engine.models:
                if name in owner:
                    raise ConfigError(f"engines: model name {name!r} is served by two engines")
                owner[name] = engine
        return owner

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(name for engine in self.engines for name in engine.models)

    @property
    def adapters(self) -> dict[str, str]:
        return {name: base for engine in self.engines for name, base in engine.adapters.items()}

    def for_model(self, model: str) -> Engine:
        engine = next((e for e in self.engines if model in e.models), None)
        if engine is None:
            raise EngineError(f"no engine serves model {model!r}")
        return engine.for_model(model)

    def context_length(self, model: str) -> int | None:
        return self.for_model(model).context_length(model)

    def model_stats(self) -> list[tuple[str, EngineStats]]:
        return [pair for engine in self.engines for pair in engine.model_stats()]

    @property
    def preallocates_gpu_memory(self) -> bool:
        """Whether any engine pre-allocates its GPU memory (then GPU memory is no pressure signal)."""
        return any(getattr(e, "preallocates_gpu_memory", False) for e in self.engines)

    @property
    def kv_capacity_tokens(self) -> int | None:
        """The smallest engine's KV cache: admission projects one pool, so the tightest one bounds it."""
        sizes = [getattr(e, "kv_capacity_tokens", None) for e in self.engines]
        known = [s for s in sizes if s]
        return min(known) if known else None

    async def start(self) -> None:
        started: list[Engine] = []
        try:
            for engine in self.engines:  # one at a time: each vLLM start sizes its KV cache from free memory
                await engine.start()
                started.append(engine)
        except BaseException:
            for engine in reversed(started):
                await engine.close()
            raise

    async def close(self) -> None:
        for engine in reversed(self.engines):
            await engine.close()

    async def release_memory(self) -> MemoryRelease:
        """Each engine's own release (SIGUSR1 from gpu-defragd), summed; an engine without one gives
        nothing (a vLLM engine gives nothing either, and says why)."""
        freed, notes = 0, []
        for engine in self.engines:
            hook = getattr(engine, "release_memory", None)
            if hook is not None:
                released = await hook()
                if isinstance(released, MemoryRelease):
                    freed += released.freed_bytes
                    if released.note and released.note not in notes:
                        notes.append(released.note)
        return MemoryRelease(freed_bytes=freed, note="; ".join(notes))

    def ready(self) -> bool:
        return all(engine.ready() for engine in self.engines)

    def stats(self) -> EngineStats:
        """The node's view for the scheduler: requests summed, the fullest KV cache (pressure on any
        engine's GPUs is pressure on the node)."""
        stats = [engine.stats() for engine in self.engines]
        return EngineStats(running=sum(s.running for s in stats), waiting=sum(s.waiting for s in stats),
                           kv_cache_usage=max(s.kv_cache_usage for s in stats))

    # The per-request calls reach the model's own engine through for_model(); these delegate by
    # model (or by the prompt's model) for callers that hold the router.
    async def render(self, model: str, messages: Sequence[ChatMessage], *, tools: Sequence[ToolSpec] = (),
                     continue_final: bool = False, template_kwargs: Mapping[str, Any] | None = None) -> Prompt:
        extra = {"template_kwargs": template_kwargs} if template_kwargs else {}
        return await self.for_model(model).render(model, messages, tools=tools, continue_final=continue_final,
                                                  **extra)

    async def encode(self, model: str, prompt: str | Sequence[int]) -> Prompt:
        return await self.for_model(model).encode(model, prompt)

    def model_card(self, model: str) -> Mapping[str, Any]:
        return self.for_model(model).model_card(model)

    def parse_tool_calls(self, text: str, tools: ToolUse) -> tuple[str, tuple[ToolCall, ...]]:
        raise EngineError("several engines: parse tool calls with the model's engine (for_model)")

    def tool_call_stream(self, tools: ToolUse) -> ToolCallStream:
        raise EngineError("several engines: stream tool calls with the model's engine (for_model)")

    def generate(self, prompt: Prompt, options: SamplingOptions, request_id: str,
                 priority: int) -> AsyncIterator[Delta]:
        return self.for_model(prompt.model or self.models[0]).generate(prompt, options, request_id, priority)

    async def abort(self, request_id: str) -> None:
        for engine in self.engines:  # request ids are unique; an engine that never saw one ignores it
            await engine.abort(request_id)

    def tokens_so_far(self, request_id: str) -> int:
        return sum(engine.tokens_so_far(request_id) for engine in self.engines)  # one of them runs it

