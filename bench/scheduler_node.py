"""An in-process node: the server's calls around the scheduler, without sockets.

``InProcessNode`` does for one request exactly what ``runtime/serving/app.py`` does around the
scheduler — ``admit`` at HEADERS (prompt estimate, ``max_tokens=0``), ``admit`` at body with
the exact counts, generate with ``Admission.engine_priority``, ``settle`` with prompt + output
tokens — and samples the engine's KV-cache use through the real ``CpuSource`` in a
``PressureFeed`` thread, preempting what the scheduler returns (engine abort + the stream
ends with the preemption's code). No HTTP, so a bench on two shared cores measures
scheduling and the engine model, not the protocol stack.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from typing import Sequence

from zerolayer.contract import ErrorCode, Priority
from zerolayer.runtime.engine.base import ChatMessage, Engine, SamplingOptions
from zerolayer.runtime.gpu import CpuSource, GpuSource
from zerolayer.runtime.scheduler import MicroScheduler, Preemption, RunningStream, Ticket
from zerolayer.runtime.scheduler.feed import PressureFeed


@dataclasses.dataclass
class Outcome:
    priority: Priority
    status: str  # "ok" | "refused" | "preempted" | "timeout"
    code: ErrorCode | None = None
    reason: str = ""
    ttft_s: float | None = None
    total_s: float | None = None
    output_tokens: int = 0


@dataclasses.dataclass
class _Active:
    ticket: Ticket
    task: asyncio.Task | None = None
    tokens: int = 0
    preempted: Preemption | None = None
    engine_request: str | None = None


class InProcessNode:
    def __init__(self, engine: Engine, scheduler: MicroScheduler, *, source: GpuSource | None = None,
                 interval_s: float = 0.2, tenant: str = "bench") -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.tenant = tenant
        self.source = source or CpuSource(lambda: engine.stats().kv_cache_usage)
        self.feed = PressureFeed(scheduler, self.source, running=self._running, preempt=self._preempt,
                                 interval_s=interval_s)
        self.active: dict[str, _Active] = {}
        self._keys = itertools.count()
        self.preemptions_sent = 0

    async def start(self) -> None:
        await self.engine.start()
        self.feed.start()

    async def close(self) -> None:
        await self.feed.stop()
        await self.engine.close()

    # ------------------------------------------------------------------ the server's side
    def _running(self) -> tuple[Sequence[RunningStream], int]:
        streams = [RunningStream(k, a.ticket.priority, a.ticket.prompt_tokens + a.tokens, a.ticket.deadline)
                   for k, a in self.active.items() if a.engine_request is not None]
        return streams, self.engine.stats().waiting

    def _preempt(self, preemption: Preemption) -> None:
        active = self.active.get(preemption.stream_key)
        if active is None or active.preempted is not None:
            return
        active.preempted = preemption
        self.preemptions_sent += 1
        if active.task is not None:
            active.task.cancel()

    async def request(self, priority: Priority, words: int = 32, max_tokens: int = 16,
                      deadline_s: float | None = None) -> Outcome:
        """One request from arrival to settle; never raises for refusals or preemptions."""
        key = f"bench/{next(self._keys)}"
        arrived = time.monotonic()
        deadline = arrived + deadline_s if deadline_s is not None else None
        head = Ticket(key, self.tenant, priority, self.engine.models[0], words, 0, deadline)
        admission = self.scheduler.admit(head, arrived)
        if not admission.admitted:
            return Outcome(priority, "refused", admission.code, admission.reason)
        active = self.active[key] = _Active(head, asyncio.current_task())
        outcome = Outcome(priority, "ok")
        reservation = admission.reservation
        try:
            prompt = await self.engine.render(self.engine.models[0],
                                              [ChatMessage("user", " ".join(["word"] * words))])
            active.ticket = ticket = dataclasses.replace(head, prompt_tokens=prompt.token_count, max_tokens=max_tokens)
            admission = self.scheduler.admit(ticket, time.monotonic(), stage="body")
            if not admission.admitted:
                reservation = None
                return Outcome(priority, "refused", admission.code, admission.reason)
            reservation = admission.reservation
            request_id = f"req-{key}"
            active.engine_request = request_id
            engine_priority = admission.engine_priority if admission.engine_priority is not None else int(priority)
            async for delta in self.engine.generate(prompt, SamplingOptions(max_tokens), request_id, engine_priority):
                if delta.token_count and outcome.ttft_s is None:
                    outcome.ttft_s = time.monotonic() - arrived
                active.tokens += delta.token_count
                if delta.finish_reason == "abort":
                    break
            active.engine_request = None
            outcome.total_s = time.monotonic() - arrived
            outcome.output_tokens = active.tokens
            return outcome
        except asyncio.CancelledError:
            if active.preempted is None:
                raise  # the caller gave up (client timeout): the finally still aborts and settles
            asyncio.current_task().uncancel()
            return Outcome(priority, "preempted", active.preempted.code, active.preempted.reason,
                           outcome.ttft_s, None, active.tokens)
        finally:
            self.active.pop(key, None)
            if active.engine_request is not None:
                await asyncio.shield(self.engine.abort(active.engine_request))
            if reservation is not None:
                self.scheduler.settle(reservation, active.ticket.prompt_tokens + active.tokens, time.monotonic())
