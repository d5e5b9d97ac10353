"""Wiring telemetry to the scheduler on the event loop (optional helper for the server).

``PressureFeed`` samples a GPU source in a thread (:class:`~zerolayer.runtime.gpu.GpuSampler`),
and on the event loop, for every sample: asks the server for its running streams, builds a
``Pressure``, calls ``scheduler.observe`` and ``scheduler.expired`` and hands every returned
preemption to the server's ``preempt`` callback (which sends the SSE error + RST_STREAM and
aborts the engine request). A failed sample changes nothing: the gate keeps its last state
(failing open would admit into an unknown memory state; failing closed would shed on a
driver hiccup), and ``expired`` still runs so deadlines are enforced without telemetry.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Sequence

from zerolayer.runtime.gpu import GpuSample, GpuSampler, GpuSource
from zerolayer.runtime.gpu.sampler import DEFAULT_INTERVAL_S

from .api import Preemption, RunningStream, Scheduler
from .pressure import pressure_from_readings

RunningSnapshot = Callable[[], tuple[Sequence[RunningStream], int]]  # (running streams, waiting count)


class PressureFeed:
    def __init__(self, scheduler: Scheduler, source: GpuSource, *, running: RunningSnapshot,
                 preempt: Callable[[Preemption], None], interval_s: float = DEFAULT_INTERVAL_S,
                 on_sample: Callable[[GpuSample], None] | None = None,
                 kv_cache_usage: Callable[[], float] | None = None) -> None:
        """``kv_cache_usage``: the engine's KV-cache use, read per sample as the pressure instead of
        the GPUs' memory (the ``kvCache`` pressure signal, for engines that pre-allocate: vLLM)."""
        self.scheduler = scheduler
        self._kv_cache_usage = kv_cache_usage
        self.source = source
        self._running = running
        self._preempt = preempt
        self._on_sample = on_sample
        self.interval_s = interval_s
        self._sampler: GpuSampler | None = None
        self.latest: GpuSample | None = None

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start sampling; callbacks run on ``loop`` (default: the running loop)."""
        loop = loop or asyncio.get_running_loop()
        self._sampler = GpuSampler(self.source, self.handle, interval_s=self.interval_s, loop=loop).start()

    async def stop(self) -> None:
        if self._sampler is not None:
            await asyncio.to_thread(self._sampler.stop)
            self._sampler = None

    def handle(self, sample: GpuSample) -> list[Preemption]:
        """Process one sample (runs on the loop); returns the preemptions handed to the server."""
        self.latest = sample
        running, waiting = self._running()
        now = time.monotonic()
        out: list[Preemption] = []
        if self._kv_cache_usage is not None:
            pressure = pressure_from_readings(sample.readings, running, waiting, sample.sampled_at,
                                              kv_cache_usage=self._kv_cache_usage())
            out.extend(self.scheduler.observe(pressure, now))
        elif sample.error is None and sample.readings:
            pressure = pressure_from_readings(sample.readings, running, waiting, sample.sampled_at)
            out.extend(self.scheduler.observe(pressure, now))
        out.extend(self.scheduler.expired(running, now))
        if self._on_sample is not None:
            self._on_sample(sample)
        for preemption in out:
            self._preempt(preemption)
        return out
