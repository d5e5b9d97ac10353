"""Counter increments and histogram observations made on every request, held as plain numbers until the
registry is read (issue 29).

A ``prometheus_client`` counter child's ``inc`` checks the metric and takes the value's lock, five times
per request (two admissions, the answer's status, two token counts): several times what adding to a
dict costs (``python3 bench/percall_micro.py``, row "counter +1"). The
serving path instead adds to a dict keyed by the child (:meth:`PendingIncrements.add`), and the
numbers are moved into the children when the registry is collected: this collector is registered in
the registry before the counters it feeds, and a registry collects in registration order, so every
reader (``generate_latest`` for ``/metrics``, ``get_sample_value``, the API processes' merge of their
pages) sees every increment made before it read. Nothing else changes: the same counters, names,
labels and exposition. Histogram observations (time to first token, time per output token) wait the same
way (:meth:`PendingIncrements.observe`): ``Histogram.observe`` takes two locks and walks the buckets in
Python (1.40 µs in a scratch timeit, against 0.08 for a list append). When applied, each histogram's
values are counted into its buckets with ``bisect`` and each bucket and the sum get one increment, which
is what observing them one by one gives (``tests/unit/runtime/test_counting.py`` compares the pages).
That reads three attributes of ``prometheus_client``'s histogram child (``_upper_bounds``, ``_buckets``,
``_sum``), the ones its own ``observe`` uses; the test fails if a release renames them. Observations are
applied once :data:`MAX_OBSERVATIONS` wait, so a registry nobody reads holds no more than that.

Both ``add`` and ``collect`` run on the serving event loop's thread (the runtime's ``/metrics`` and
metrics port are served there), so neither takes a lock.
"""

from __future__ import annotations

import bisect
from typing import Any, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector


#: Observations held at most: past this many, they are applied at once (a registry nobody scrapes stays bounded).
MAX_OBSERVATIONS = 1024


class PendingIncrements(Collector):
    """Register before the counters and histograms that :meth:`add` and :meth:`observe` are given (see the
    module doc)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._pending: dict[Any, float] = {}
        self._observed: dict[Any, list[float]] = {}  # histogram (child) -> values not yet applied
        self._count = 0  # values in _observed
        registry.register(self)

    def add(self, child: Any, amount: float = 1.0) -> None:
        """``child.inc(amount)``, applied at the next read of the registry."""
        pending = self._pending
        pending[child] = pending.get(child, 0.0) + amount

    def observe(self, histogram: Any, value: float) -> None:
        """``histogram.observe(value)`` for a histogram without labels (or a labelled one's child),
        applied at the next read of the registry (or once :data:`MAX_OBSERVATIONS` wait)."""
        values = self._observed.get(histogram)
        if values is None:
            values = self._observed[histogram] = []
        values.append(value)
        self._count += 1
        if self._count >= MAX_OBSERVATIONS:
            self._apply_observed()

    def _apply_observed(self) -> None:
        observed, self._observed, self._count = self._observed, {}, 0
        for histogram, values in observed.items():
            bounds = histogram._upper_bounds  # ascending, the last +Inf: what Histogram.observe walks
            counts = [0] * len(bounds)
            for value in values:
                if value == value:  # NaN lands in no bucket, as in Histogram.observe
                    counts[bisect.bisect_left(bounds, value)] += 1  # the first bound >= value
            for bucket, count in zip(histogram._buckets, counts):
                if count:
                    bucket.inc(count)
            histogram._sum.inc(sum(values))

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for child, amount in pending.items():
            child.inc(amount)
        self._apply_observed()

    def describe(self) -> Iterable[Any]:
        return ()

    def collect(self) -> Iterable[Any]:
        self.flush()
        return ()
