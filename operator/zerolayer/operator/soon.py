"""Coalesced reconciles: a burst of triggers for one object becomes one reconcile, a moment later.

For bursts of events that each change little, e.g. a DaemonSet's status moving through scheduled,
updated and ready: the reconcile runs once, from the newest cached state, when the burst is over.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Sequence

from zerolayer.operator.errors import KubeError, SpecError, WaitingFor

log = logging.getLogger(__name__)

Key = tuple[tuple[str, str], str]  # ((apiVersion, kind), name)


class ReconcileSoon:
    """Background reconciles by (kind, name), each due at a time; ``run(kind, name)`` does one.

    A reconcile that must wait or fails is scheduled again after its delay, as kopf would retry it
    (``retry_seconds`` for an API error no retry soon can mend)."""

    def __init__(self, run: Callable[[tuple[str, str], str], Awaitable[Any]], retry_seconds: float):
        self.run = run
        self.retry_seconds = retry_seconds
        self.pending: dict[Key, tuple[asyncio.Task, float]] = {}  # the task and when it is due

    def __call__(self, kind: tuple[str, str], name: str, delay: float) -> None:
        """Reconcile the named object ``delay`` seconds from now; requests for it until then join
        that one (it reads the newest cached state when it runs), and a request due sooner than the
        pending one moves it earlier."""
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        pending = self.pending.get((kind, name))
        if pending is not None:
            if pending[1] <= due:
                return
            pending[0].cancel()  # still sleeping (a task leaves `pending` before it reconciles)
        self.pending[(kind, name)] = (loop.create_task(self._later(kind, name, delay)), due)

    async def _later(self, kind: tuple[str, str], name: str, delay: float) -> None:
        try:
            await asyncio.sleep(delay)
        finally:
            # Events from here on schedule a new one (unless this one was replaced by a sooner one).
            if self.pending.get((kind, name), (None,))[0] is asyncio.current_task():
                del self.pending[(kind, name)]
        try:
            await self.run(kind, name)
        except WaitingFor as exc:
            self(kind, name, exc.delay)
        except KubeError as exc:
            log.info("%s %s: %s; again in a moment", kind[1], name, exc)
            self(kind, name, 2.0 if exc.retryable else self.retry_seconds)
        except SpecError:
            pass  # the status says why; a spec change triggers the next reconcile

    async def close(self, others: Sequence[asyncio.Task] = ()) -> None:
        """Cancel the reconciles still waiting to run (and ``others``), and wait for them to end."""
        tasks = [task for task, _ in self.pending.values()] + list(others)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.pending.clear()  # a task cancelled before it ever ran did not remove itself
