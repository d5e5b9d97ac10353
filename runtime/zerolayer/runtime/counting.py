"""Counter increments made on every request, held as plain numbers until the registry is read (issue 29).

A ``prometheus_client`` counter child's ``inc`` checks the metric and takes the value's lock, five times
per request (two admissions, the answer's status, two token counts): several times what adding to a
dict costs (``python3 bench/percall_micro.py``, row "counter +1"). The
serving path instead adds to a dict keyed by the child (:meth:`PendingIncrements.add`), and the
numbers are moved into the children when the registry is collected: this collector is registered in
the registry before the counters it feeds, and a registry collects in registration order, so every
reader (``generate_latest`` for ``/metrics``, ``get_sample_value``, the API processes' merge of their
pages) sees every increment made before it read. Nothing else changes: the same counters, names,
labels and exposition.

Both ``add`` and ``collect`` run on the serving event loop's thread (the runtime's ``/metrics`` and
metrics port are served there), so neither takes a lock.
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector


class PendingIncrements(Collector):
    """Register before the counters whose children :meth:`add` is given (see the module doc)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._pending: dict[Any, float] = {}
        registry.register(self)

    def add(self, child: Any, amount: float = 1.0) -> None:
        """``child.inc(amount)``, applied at the next read of the registry."""
        pending = self._pending
        pending[child] = pending.get(child, 0.0) + amount

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for child, amount in pending.items():
            child.inc(amount)

    def describe(self) -> Iterable[Any]:
        return ()

    def collect(self) -> Iterable[Any]:
        self.flush()
        return ()
