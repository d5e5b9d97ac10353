"""Sampling a GPU source every 200 ms in its own thread, off the event loop.

``GpuSampler`` calls ``source.sample()`` (which may block: NVML) in a daemon thread on a
fixed period and hands each :class:`GpuSample` to a callback: in the sampler thread, or, when
an event loop is given, on that loop via ``call_soon_threadsafe`` so the callback may touch
loop-owned state (the server's streams) without locks. ``sampled_at`` is taken on the
monotonic clock as soon as the source answers: reaction times are measured from it.

A period the source overran is not made up with a burst: the next sample is taken at once
and the schedule restarts from there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Callable, Sequence

from .api import GpuReading, GpuSource, GpuSourceError

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.2


@dataclasses.dataclass(frozen=True)
class GpuSample:
    readings: Sequence[GpuReading]
    sampled_at: float  # time.monotonic() right after the source answered
    error: GpuSourceError | None = None  # set (and readings empty) when the source failed

    @property
    def memory_fraction(self) -> float | None:
        """The fullest GPU's memory fraction; None when the sample failed or saw no GPU."""
        return max((r.memory_fraction for r in self.readings), default=None)


class GpuSampler:
    """Samples ``source`` every ``interval_s`` seconds until stopped."""

    def __init__(self, source: GpuSource, on_sample: Callable[[GpuSample], object], *,
                 interval_s: float = DEFAULT_INTERVAL_S, loop: asyncio.AbstractEventLoop | None = None,
                 name: str = "gpu-sampler") -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.source = source
        self.interval_s = interval_s
        self._on_sample = on_sample
        self._loop = loop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.samples_taken = 0
        self.errors = 0
        self.latest: GpuSample | None = None

    def start(self) -> "GpuSampler":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop sampling and wait for the thread (call from a thread, or via ``asyncio.to_thread``)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def __enter__(self) -> "GpuSampler":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def sample_once(self) -> GpuSample:
        try:
            readings = tuple(self.source.sample())
            sample = GpuSample(readings, time.monotonic())
        except GpuSourceError as exc:
            self.errors += 1
            sample = GpuSample((), time.monotonic(), exc)
        self.samples_taken += 1
        self.latest = sample
        return sample

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            sample = self.sample_once()
            if not self._deliver(sample):
                return
            next_at += self.interval_s
            now = time.monotonic()
            if next_at < now:
                next_at = now
            if self._stop.wait(next_at - now):
                return

    def _deliver(self, sample: GpuSample) -> bool:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._on_sample, sample)
            except RuntimeError:  # the loop closed under us: nobody is listening any more
                self._stop.set()
                return False
            return True
        try:
            self._on_sample(sample)
        except Exception:
            # a consumer bug must not silently stop telemetry (the scheduler would freeze in its last
            # state); it is logged with its traceback and sampling goes on
            log.exception("GPU sample consumer failed")
        return True
