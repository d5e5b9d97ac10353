"""Events the SDK reports to the caller's listener (``Client(on_event=...)``).

Each event has a ``type`` string; the listener is called synchronously on the thread
(or event loop) that made the request, so it must be quick. An exception raised by the
listener is logged and does not fail the request.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Union

log = logging.getLogger("zerolayer.client")


@dataclasses.dataclass(frozen=True)
class FallbackTriggered:
    """A node's circuit opened after ``consecutive_errors`` failures in a row."""

    endpoint: str
    fallback: str | None  # the configured fallback endpoint, or None: the ring's next node
    consecutive_errors: int
    type: str = "fallback_triggered"


@dataclasses.dataclass(frozen=True)
class CircuitHalfOpen:
    """The open circuit's cool-down passed; one probe request goes to the node."""

    endpoint: str
    type: str = "circuit_half_open"


@dataclasses.dataclass(frozen=True)
class CircuitClosed:
    """The probe succeeded: the node takes its sessions back."""

    endpoint: str
    type: str = "circuit_closed"


@dataclasses.dataclass(frozen=True)
class RetryScheduled:
    endpoint: str
    attempt: int  # the attempt that failed (1-based)
    error: str  # the vocabulary code, or the exception class name
    delay_s: float
    reason: str
    type: str = "retry"


@dataclasses.dataclass(frozen=True)
class RequestLatency:
    """Client-side timing of one finished request (its last, successful attempt).

    ``ttft_s`` is the time to the first output token (streams only); ``total_s`` is from
    sending the attempt to the end of the response. The same numbers travel to the server
    on the next request to that endpoint in ``x-zerolayer-client-latency``.
    """

    endpoint: str
    request_id: str | None
    ttft_s: float | None
    total_s: float
    attempts: int
    streaming: bool
    type: str = "latency"


Event = Union[FallbackTriggered, CircuitHalfOpen, CircuitClosed, RetryScheduled, RequestLatency]
Listener = Callable[[Event], None]


def emit(listener: Listener | None, event: Event) -> None:
    if listener is None:
        return
    try:
        listener(event)
    except Exception:  # a listener's bug must not fail the caller's request
        log.exception("zerolayer.client event listener failed on %s", event.type)
