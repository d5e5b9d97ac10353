"""The CPU source: a runtime with no GPU reports its engine's KV-cache use as "memory".

On CPU the scarce memory the scheduler protects is the engine's KV cache, so the reading's
``memory_fraction`` is the KV-cache use (0..1) the engine reports (vLLM's
``kv_cache_usage`` from a stat logger). ``memory_total_bytes`` is the KV-cache size when the
caller knows it (``kv_cache_memory_bytes``), else a nominal 1 GiB: only the fraction is
meaningful. The engine's processes and their resident memory come from /proc (no psutil),
and ``utilization`` is their CPU time over wall time across all cores since the last sample.
"""

from __future__ import annotations

import os
import pathlib
import socket
import threading
import time
from typing import Callable, Iterable, Sequence

from .api import GpuProcess, GpuReading, GpuSourceError

NOMINAL_TOTAL = 1024**3
PROC = pathlib.Path("/proc")


def _read_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, utime+stime in clock ticks) or None if the process is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # the command name may contain spaces and parentheses: split after the last ')'
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[11]) + int(fields[12])


def _rss_bytes(pid: int) -> int | None:
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return 0  # kernel threads have no VmRSS line


def _descendants(roots: Iterable[int]) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            stat = _read_stat(int(entry.name))
            if stat is not None:
                parents.setdefault(stat[0], []).append(int(entry.name))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(parents.get(pid, ()))
    return out


class CpuSource:
    """Readings for a CPU-only node; one pseudo-GPU of index 0."""

    kind = "cpu"

    def __init__(self, kv_cache_usage: Callable[[], float], *, kv_cache_bytes: int | None = None,
                 pids: Sequence[int] | None = None, include_children: bool = True,
                 name: str = "CPU (engine KV cache)") -> None:
        self._usage = kv_cache_usage
        self._total = int(kv_cache_bytes) if kv_cache_bytes else NOMINAL_TOTAL
        self._roots = tuple(pids) if pids else (os.getpid(),)
        self._children = include_children
        self._name = name
        self._uuid = f"CPU-{socket.gethostname()}"
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._cores = os.cpu_count() or 1
        self._last: tuple[float, int] | None = None
        self._lock = threading.Lock()

    def processes(self) -> list[int]:
        pids = _descendants(self._roots) if self._children else list(self._roots)
        return sorted(set(pids))

    def sample(self) -> Sequence[GpuReading]:
        try:
            usage = float(self._usage())
        except Exception as exc:  # the engine's callable is foreign code: convert at the boundary
            raise GpuSourceError(f"cannot read the engine's KV-cache use: {exc}") from exc
        if usage != usage:  # NaN
            raise GpuSourceError("engine reported a KV-cache use of NaN")
        usage = min(1.0, max(0.0, usage))
        processes, cpu_ticks = [], 0
        for pid in self.processes():
            rss, stat = _rss_bytes(pid), _read_stat(pid)
            if rss is None or stat is None:
                continue  # exited between listing and reading
            processes.append(GpuProcess(pid, rss))
            cpu_ticks += stat[1]
        if not processes:
            raise GpuSourceError(f"none of the engine processes {list(self._roots)} exists any more")
        now = time.monotonic()
        with self._lock:
            utilization = 0.0
            if self._last is not None and now > self._last[0]:
                busy_s = max(0, cpu_ticks - self._last[1]) / self._ticks
                utilization = min(1.0, busy_s / ((now - self._last[0]) * self._cores))
            self._last = (now, cpu_ticks)
        return [GpuReading(uuid=self._uuid, index=0, name=self._name, memory_used_bytes=round(usage * self._total),
                           memory_total_bytes=self._total, utilization=utilization, processes=tuple(processes))]

    def close(self) -> None:
        pass
