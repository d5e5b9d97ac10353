"""A *model* of a batch- and KV-cache-limited engine, for scheduling tests and benches.

The runtime's ``SyntheticEngine`` runs every request at once with no contention, so load
never slows it down and "twice the node's capacity" means nothing to it. This model keeps
its deterministic answers (it renders and words like the synthetic engine) and adds the two
limits that make a real engine saturate, the way vLLM v1 does on a GPU:

* **Continuous batching.** One decode step produces one token for every running request
  and takes ``step_base_s + step_per_seq_s * running``: more concurrency, more throughput,
  slower tokens.
* **A KV cache of ``kv_capacity_tokens``.** A running request holds prompt + generated
  tokens. Waiting requests are taken in ``(priority, arrival)`` order (vLLM's
  ``scheduling_policy="priority"``: lower first) while a slot (``max_num_seqs``) and room
  for the prompt remain; the head of the queue blocks the rest. When the running requests
  cannot all grow by one token, the lowest-priority, latest one is preempted back to the
  queue and later recomputed (vLLM's recompute preemption).

``kv_cache_usage`` is held tokens over capacity, as vLLM reports it. It is a model, named as
one: it implements the runtime's ``Engine`` protocol so the real server and scheduler can
drive it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import heapq
import itertools
from typing import AsyncIterator, Sequence

from zerolayer.runtime.engine.base import Delta, EngineStats, Prompt, SamplingOptions
from zerolayer.runtime.engine.synthetic import _WORDS, SyntheticEngine
from zerolayer.runtime.errors import EngineError


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: str
    priority: int
    arrival: int
    prompt_tokens: int
    target: int
    digest: bytes
    queue: asyncio.Queue
    generated: int = 0
    held: int = 0  # tokens in the KV cache now (0 while waiting)
    done: bool = False

    def order(self) -> tuple[int, int]:
        return (self.priority, self.arrival)


class ContendedEngine(SyntheticEngine):
    kind = "synthetic-contended"

    def __init__(self, models: Sequence[str] = ("synthetic",), *, output_tokens: int = 16,
                 kv_capacity_tokens: int = 2048, max_num_seqs: int = 64, step_base_s: float = 0.01,
                 step_per_seq_s: float = 0.0005) -> None:
        super().__init__(models, output_tokens=output_tokens, kv_capacity_tokens=kv_capacity_tokens)
        self.max_num_seqs = max_num_seqs
        self.step_base_s = step_base_s
        self.step_per_seq_s = step_per_seq_s
        self._waiting: list[tuple[tuple[int, int], _Request]] = []
        self._running: list[_Request] = []
        self._by_id: dict[str, _Request] = {}
        self._arrivals = itertools.count()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.steps = 0
        self.engine_preemptions = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await super().start()
        self._loop_task = asyncio.create_task(self._step_loop(), name="contended-engine")

    async def close(self) -> None:
        await super().close()
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None

    # ------------------------------------------------------------------ Engine protocol
    async def generate(self, prompt: Prompt, options: SamplingOptions, request_id: str, priority: int
                       ) -> AsyncIterator[Delta]:
        if self._loop_task is None:
            raise EngineError("the contended engine is not started")
        if prompt.token_count + 1 > self.kv_capacity_tokens:
            raise EngineError(f"prompt of {prompt.token_count} tokens cannot fit a KV cache of "
                              f"{self.kv_capacity_tokens}")
        target = min(options.max_tokens, self.output_tokens)
        req = _Request(request_id, int(priority), next(self._arrivals), prompt.token_count, target,
                       hashlib.sha256(prompt.text.encode()).digest(), asyncio.Queue())
        self._by_id[request_id] = req
        heapq.heappush(self._waiting, (req.order(), req))
        self._wake.set()
        try:
            if target <= 0:
                yield Delta("", 0, "length")
                return
            while True:
                delta = await req.queue.get()
                yield delta
                if delta.finish_reason:
                    return
        finally:
            self._drop(req)

    async def abort(self, request_id: str) -> None:
        req = self._by_id.get(request_id)
        if req is not None:
            self._drop(req)
            req.queue.put_nowait(Delta("", 0, "abort"))

    def stats(self) -> EngineStats:
        held = sum(r.held for r in self._running)
        return EngineStats(running=len(self._running), waiting=len(self._waiting),
                           kv_cache_usage=min(1.0, held / self.kv_capacity_tokens))

    # ------------------------------------------------------------------ internals
    def _drop(self, req: _Request) -> None:
        if req.done:
            return
        req.done = True
        self._by_id.pop(req.request_id, None)
        if req in self._running:
            self._running.remove(req)
        req.held = 0
        # a waiting entry is skipped lazily when popped (req.done)

    def _held_tokens(self) -> int:
        return sum(r.held for r in self._running)

    def _schedule(self) -> None:
        # running requests first: each must grow by one token; preempt lowest priority, latest first
        while self._running and self._held_tokens() + len(self._running) > self.kv_capacity_tokens:
            victim = max(self._running, key=_Request.order)
            self._running.remove(victim)
            victim.held = 0
            self.engine_preemptions += 1
            heapq.heappush(self._waiting, (victim.order(), victim))
        while self._waiting and len(self._running) < self.max_num_seqs:
            _, head = self._waiting[0]
            if head.done:
                heapq.heappop(self._waiting)
                continue
            need = head.prompt_tokens + head.generated + 1  # recompute: prompt and output so far
            if self._held_tokens() + len(self._running) + need > self.kv_capacity_tokens:
                break  # the head of the queue blocks the rest, as in vLLM
            heapq.heappop(self._waiting)
            head.held = head.prompt_tokens + head.generated
            self._running.append(head)

    async def _step_loop(self) -> None:
        while True:
            self._schedule()
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = list(self._running)
            await asyncio.sleep(self.step_base_s + self.step_per_seq_s * len(batch))
            self.steps += 1
            for req in batch:
                if req.done or req not in self._running:
                    continue  # aborted or preempted during the step
                word = _WORDS[req.digest[req.generated % len(req.digest)] % len(_WORDS)]
                req.generated += 1
                req.held += 1
                last = req.generated >= req.target
                req.queue.put_nowait(Delta(word if req.generated == 1 else " " + word, 1,
                                           "length" if last else None))
                if last:
                    self._running.remove(req)
                    req.held = 0

    def capacity_rps(self, prompt_tokens: int) -> float:
        """Steady-state requests/s this engine completes when saturated (the bench's "1x").

        Saturated, the cache holds ``N`` requests of on average ``prompt + target/2`` tokens
        (or ``max_num_seqs``); each needs ``target`` steps of ``step_base + step_per_seq * N``.
        """
        target = self.output_tokens
        n = min(self.max_num_seqs, max(1, int(self.kv_capacity_tokens / (prompt_tokens + target / 2))))
        return n / (target * (self.step_base_s + self.step_per_seq_s * n))
