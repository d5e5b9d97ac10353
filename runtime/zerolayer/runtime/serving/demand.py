"""Demand for models this node does not serve: the signal that scales an InferenceFleet from zero.

In a cluster, a model missing here may be one a fleet declares and has scaled to zero, so the gate
answers a request for it with a retryable refusal (:func:`not_served_here`: 503 MODEL_UNAVAILABLE
with Retry-After, answered from the header block before any body byte is read) and records it in a :class:`DemandLedger`. The runtime gossips
the ledger as ``status.demand`` (:meth:`DemandLedger.entries`); the operator sums the entries naming a
fleet's models across every InferenceNode and scales that fleet to at least one node
(operator/zerolayer/operator/fleet_plan.py ``recorded_demand``). No proxy holds the request: the client
retries, and its retry lands on the node once it serves the model.

Imports nothing of the runtime; the gate calls :meth:`record` on the event loop and the gossip thread
calls :meth:`entries`, so both take a lock (held for a dict update).
"""

from __future__ import annotations

import re
import threading
from typing import Any, Callable

from zerolayer.contract import ErrorCode
from zerolayer.gpumap import utc_now_rfc3339
from zerolayer.runtime.errors import RequestRefused

# How long a client should wait before retrying a model that is not served yet: about the time the
# operator takes to notice the demand (its fleet timer, 10 s) plus the first part of a cold start.
RETRY_AFTER_S = 5.0
# Distinct model names remembered (the oldest is forgotten): a client cannot grow the status without bound.
MAX_MODELS = 16
# A model not asked for during this long starts a new count (what the operator reads is a recent burst).
QUIET_S = 120.0
# Only names an InferenceNode could declare are recorded (the CRD's pattern and length): anything else can
# never be scaled up, and would make the status patch invalid.
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


class DemandLedger:
    """Per model name: refused requests in the current burst and when the last one came (Unix seconds)."""

    def __init__(self, *, clock: Callable[[], float] | None = None, max_models: int = MAX_MODELS,
                 quiet_s: float = QUIET_S) -> None:
        import time

        self._clock = clock or time.time
        self._max_models = max_models
        self._quiet_s = quiet_s
        self._lock = threading.Lock()
        self._models: dict[str, tuple[int, float]] = {}  # name -> (requests, last), oldest first
        self.version = 0  # bumped by each record, so a publisher can tell a change cheaply

    def record(self, model: str, now: float | None = None) -> None:
        if not MODEL_NAME.match(model):
            return
        now = self._clock() if now is None else now
        with self._lock:
            count, last = self._models.pop(model, (0, float("-inf")))
            self._models[model] = (1 if now - last > self._quiet_s else count + 1, now)
            while len(self._models) > self._max_models:
                del self._models[next(iter(self._models))]
            self.version += 1

    def entries(self) -> list[dict[str, Any]]:
        """``status.demand``: ``[{"model", "requests", "lastRequested"}]`` by name."""
        with self._lock:
            items = sorted(self._models.items())
        return [{"model": name, "requests": count, "lastRequested": utc_now_rfc3339(last)}
                for name, (count, last) in items]


def not_served_here(model: str, served: tuple[str, ...] | list[str]) -> RequestRefused:
    """The retryable refusal for a model this node does not serve while demand is being recorded."""
    return RequestRefused(
        ErrorCode.MODEL_UNAVAILABLE,
        f"model {model!r} is not served here (serving: {', '.join(served)}); the demand is recorded and a "
        f"fleet declaring it scales up: retry after {RETRY_AFTER_S:g}s",
        reason="model_not_served_yet", retry_after_s=RETRY_AFTER_S)
