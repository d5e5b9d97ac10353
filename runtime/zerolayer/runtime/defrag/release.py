"""The runtime's answer to gpu-defragd's nudge (SIGUSR1): give back what can be given back.

Steps, each only where it applies: the engine's own ``release_memory()`` (an engine adapter
defines it; it may return a :class:`~zerolayer.runtime.engine.base.MemoryRelease` saying what it
freed. For vLLM it frees nothing and says so: vLLM pre-allocates its KV cache and counts idle
prefix blocks as free already, so dropping them would only lose the prefix cache that routing
relies on), then ``gc.collect()`` (frees tensors only reachable from cycles),
then ``torch.cuda.empty_cache()`` when torch already drives a CUDA device in this process
(returns cached allocator blocks to the driver, which is what lowers NVML's "used" and the
fragmentation of docs/defragd.md). Nothing here stops or slows in-flight streams.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import signal
import sys
from typing import Any, Callable

from zerolayer.runtime.engine.base import MemoryRelease

log = logging.getLogger(__name__)


async def release(engine: Any) -> list[str]:
    """Release what can be released; returns the steps taken (for the log and tests)."""
    steps = []
    hook = getattr(engine, "release_memory", None)
    if callable(hook):
        try:
            result = hook()
            if inspect.isawaitable(result):
                result = await result
            steps.append(_engine_step(result))
        except Exception:  # the engine is foreign code: a failed release must not take the server down
            log.exception("SIGUSR1: engine.release_memory failed")
    collected = gc.collect()
    steps.append(f"gc.collect({collected})")
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
                steps.append("torch.cuda.empty_cache")
        except RuntimeError:
            log.exception("SIGUSR1: torch.cuda.empty_cache failed")
    log.info("SIGUSR1 from gpu-defragd: released memory (%s)", ", ".join(steps))
    return steps


def _engine_step(result: Any) -> str:
    """The engine step as listed: with what it freed when the adapter says (a ``MemoryRelease``)."""
    if not isinstance(result, MemoryRelease):
        return "engine.release_memory"
    said = f"freed {result.freed_bytes} bytes"
    return f"engine.release_memory({said}: {result.note})" if result.note else f"engine.release_memory({said})"


class ReleaseOnSignal:
    """Installs a SIGUSR1 handler on ``loop`` that runs :func:`release` as a task (never in the handler)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: Any,
                 on_release: Callable[[list[str]], None] | None = None) -> None:
        self.loop = loop
        self.engine = engine
        self.on_release = on_release
        self.count = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def install(self) -> "ReleaseOnSignal":
        self.loop.add_signal_handler(signal.SIGUSR1, self._on_signal)
        return self

    def remove(self) -> None:
        self.loop.remove_signal_handler(signal.SIGUSR1)

    def _on_signal(self) -> None:
        task = self.loop.create_task(self._release())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self) -> None:
        steps = await release(self.engine)
        self.count += 1
        if self.on_release is not None:
            self.on_release(steps)
