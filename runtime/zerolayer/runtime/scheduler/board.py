"""One node's tenant quotas across its API processes (``server.api_processes``): a shared board.

With N API processes on one port (docs/api-processes.md), each process admits the streams of the
connections the kernel gave it, but a tenant's ``max_concurrent_streams``, requests and tokens per
minute are the node's. Dividing each limit by N would starve a tenant whose HTTP/2 connection (all
its traffic) lands on one process, so every process keeps its own exact ledger
(:class:`~zerolayer.runtime.scheduler.quota.TenantLedger`) and *publishes* its per-tenant totals in
a row of a shared-memory table; a check adds the other rows to its own:

    **Bound.** Every charge happens under one node-wide lock (a POSIX semaphore) held from the
    quota check to the charge and its publication, so for every tenant and every moment the sum
    over processes of (open streams, requests and tokens reserved in the trailing window) is at
    most the tenant's limit, as in one process (``quota.py``'s bound, node-wide).

Only a charge raises a row. Settles, releases and the window's expiry lower it, and each row has
one writer (its process, under its scheduler's lock), so those publish without the node-wide lock:
a check under the lock reads each counter's old, higher value or its new one, and both keep the
bound. The scheduler's admission runs its filter chain outside the lock and takes it only to decide
the quota again and charge (``MicroScheduler._charge``): with two API processes, holding it across
the whole admission made the processes wait on each other (docs/api-processes.md, "Measured").

A published row can only over-state: charges leave a process's window as time passes, and the
row is re-published at each of the process's own changes and on each telemetry sample
(:meth:`SharedQuotaLedger.refresh`, 200 ms by default), so a tenant may be refused up to one
sample interval early, never admitted beyond its limit. The lock is held for a few table reads and
writes (no system call when uncontended); it is not held across any I/O.

The board is plain memory (``multiprocessing.RawArray``) created by the parent before it spawns
the API processes: a fixed table of ``capacity`` tenant slots, keyed by a 64-bit hash of the
tenant name, each slot one row of three counters per process. A tenant that finds the table full
is refused with a clear error rather than counted wrongly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import multiprocessing
from typing import Any, Iterator

from .quota import QuotaLedger, TenantLedger

FIELDS = 3  # open streams, requests in window, tokens in window
DEFAULT_CAPACITY = 8192


class BoardFull(RuntimeError):
    """More distinct tenants than the board has slots."""


@dataclasses.dataclass
class QuotaBoard:
    """The shared table and its lock. Create with :meth:`create` in the parent; it pickles into
    ``multiprocessing`` spawn arguments (the array and lock travel as shared handles)."""

    processes: int
    capacity: int
    keys: Any  # RawArray('Q', capacity): 0 = free slot, else the tenant's hash
    counters: Any  # RawArray('q', capacity * processes * FIELDS)
    lock: Any  # multiprocessing RLock (a POSIX semaphore): a slot's claim may happen inside a charge's hold

    @classmethod
    def create(cls, processes: int, capacity: int = DEFAULT_CAPACITY, context: Any = None) -> "QuotaBoard":
        if processes < 1:
            raise ValueError("a quota board needs at least one process")
        ctx = context or multiprocessing.get_context("spawn")
        return cls(processes, capacity, ctx.RawArray("Q", capacity), ctx.RawArray("q", capacity * processes * FIELDS),
                   ctx.RLock())

    def slot(self, tenant: str) -> int:
        """The tenant's slot, claimed on first use under :attr:`lock` (two processes must not claim one
        hole for two tenants). Raises :class:`BoardFull`."""
        key = tenant_key(tenant)
        keys, capacity = self.keys, self.capacity
        with self.lock:
            index = key % capacity
            for _ in range(capacity):  # open addressing: slots are never freed, so a probe ends at the key or a hole
                held = keys[index]
                if held == key:
                    return index
                if held == 0:
                    keys[index] = key
                    return index
                index = (index + 1) % capacity
        raise BoardFull(f"the node's quota board holds {capacity} tenants; tenant {tenant!r} does not fit")

    def publish(self, slot: int, process: int, open_streams: int, requests: int, tokens: int) -> None:
        base = (slot * self.processes + process) * FIELDS
        counters = self.counters
        counters[base] = open_streams
        counters[base + 1] = requests
        counters[base + 2] = tokens

    def others(self, slot: int, process: int) -> tuple[int, int, int]:
        """The sum of the other processes' rows for ``slot``: (open streams, requests, tokens)."""
        counters, n = self.counters, self.processes
        open_streams = requests = tokens = 0
        for other in range(n):
            if other == process:
                continue
            base = (slot * n + other) * FIELDS
            open_streams += counters[base]
            requests += counters[base + 1]
            tokens += counters[base + 2]
        return open_streams, requests, tokens

    def totals(self, tenant: str) -> tuple[int, int, int]:
        """Node-wide (open streams, requests, tokens) of ``tenant`` as published (what tests read)."""
        slot = self.slot(tenant)
        with self.lock:
            return self.others(slot, -1)


def tenant_key(tenant: str) -> int:
    """A non-zero 64-bit key for ``tenant`` (0 marks a free slot)."""
    return int.from_bytes(hashlib.blake2b(tenant.encode(), digest_size=8).digest(), "little") or 1


class _PublishedLedger(TenantLedger):
    """A :class:`TenantLedger` that re-publishes its totals after every change (a charge's caller holds
    the board's lock, :meth:`SharedQuotaLedger.transaction`; the other changes only lower the row)."""

    def __init__(self, window_s: float, publish: Any) -> None:
        super().__init__(window_s)
        self._publish = publish

    def charge(self, stream_key: str, tokens: int, now: float, *, new_request: bool) -> float:
        at = super().charge(stream_key, tokens, now, new_request=new_request)
        self._publish(self, now)
        return at

    def settle(self, stream_key: str, used_tokens: int, now: float) -> None:
        super().settle(stream_key, used_tokens, now)
        self._publish(self, now)

    def restore(self, tokens: int, requests: int, now: float) -> None:
        super().restore(tokens, requests, now)
        self._publish(self, now)


class SharedQuotaLedger(QuotaLedger):
    """The :class:`QuotaLedger` of API process ``index`` of the board's N: its own charges, publishing
    them after every change; :meth:`QuotaLedger.check` and :meth:`QuotaLedger.headers` add what the
    other processes published (:meth:`others`). The scheduler holds :meth:`transaction` from check to
    charge (``MicroScheduler._charge``)."""

    node_wide = True

    def __init__(self, board: QuotaBoard, index: int, window_s: float = 60.0,
                 concurrency_retry_after_s: float = 1.0) -> None:
        if not 0 <= index < board.processes:
            raise ValueError(f"API process {index} is not one of the board's {board.processes}")
        super().__init__(window_s, concurrency_retry_after_s)
        self.board = board
        self.index = index
        self._slots: dict[str, int] = {}

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with self.board.lock:
            yield

    def tenant(self, name: str) -> TenantLedger:
        ledger = self._tenants.get(name)
        if ledger is None:
            ledger = self._tenants[name] = _PublishedLedger(self.window_s, lambda led, now: self._publish(name, led, now))
        return ledger

    def _slot(self, name: str) -> int:
        slot = self._slots.get(name)
        if slot is None:
            slot = self._slots[name] = self.board.slot(name)
        return slot

    def _publish(self, name: str, ledger: TenantLedger, now: float) -> None:
        self.board.publish(self._slot(name), self.index, len(ledger.open_streams), ledger.requests_in_window(now),
                           ledger.tokens_in_window(now))

    def others(self, tenant: str) -> tuple[int, int, int]:
        """The other processes' published totals for ``tenant`` (the scheduler holds :meth:`transaction`)."""
        return self.board.others(self._slot(tenant), self.index)

    def refresh(self, now: float) -> None:
        """Re-publish every tenant's totals (charges that left the window stop counting for the others)."""
        with self.board.lock:
            for name, ledger in self._tenants.items():
                self._publish(name, ledger, now)
