"""The contract between the HTTP/2 server and the micro-scheduler.

The server owns sockets and the engine; the scheduler owns decisions. The server
calls the scheduler at three moments and the scheduler never does I/O:

1. ``admit(ticket, now)`` when a stream's HEADERS arrive (and again once the body
   is parsed, with the real prompt token count, via ``admit(..., stage="body")``);
   returns an :class:`Admission`. A refusal carries the error code, a retry-after
   and the rate-limit headers to send. An accepted admission carries a
   reservation that **must** be passed to ``settle`` exactly once.
2. ``settle(reservation, used_tokens, now)`` when the stream ends for any reason.
3. ``observe(pressure, now)`` on every telemetry sample; returns the streams the
   server must preempt now (it sends the SSE error + RST_STREAM and aborts the
   engine request) and whether new work of each priority is admitted.

Everything is a plain snapshot so decisions are table-testable with no engine.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol, Sequence

from zerolayer.contract import ErrorCode, Priority


@dataclasses.dataclass(frozen=True)
class TenantPolicy:
    """Effective quota of one tenant (from a TenantQuota or the standalone config). ``None`` = unlimited."""

    tenant: str
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    max_concurrent_streams: int | None = None
    allowed_priorities: frozenset[Priority] = frozenset(Priority)
    allowed_models: frozenset[str] | None = None  # None = every served model


@dataclasses.dataclass(slots=True)  # slotted, not frozen: built per request (see engine.base.Delta)
class Ticket:
    """What is known about a stream when it asks to be admitted."""

    stream_key: str  # unique per stream in this process (e.g. "conn-id/stream-id")
    tenant: str
    priority: Priority
    model: str
    prompt_tokens: int  # estimate at HEADERS time (0 if unknown), exact at body time
    max_tokens: int
    deadline: float | None  # monotonic seconds, None = no deadline
    session: str | None = None
    arrived: float | None = None  # monotonic seconds the request arrived; bounds how far a deadline jumps

    def sized(self, model: str, priority: Priority, prompt_tokens: int, max_tokens: int) -> "Ticket":
        """This stream's ticket once its body is read (``admit(stage="body")``): ``dataclasses.replace``
        with these four, built directly (it runs per request; ``replace`` costs several times as much,
        ``bench/percall_micro.py``)."""
        return Ticket(self.stream_key, self.tenant, priority, model, prompt_tokens, max_tokens, self.deadline,
                      self.session, self.arrived)


@dataclasses.dataclass(slots=True)  # slotted, not frozen: built per request (see engine.base.Delta)
class Reservation:
    stream_key: str
    tenant: str
    priority: Priority
    reserved_tokens: int
    window_start: float  # the quota window the tokens were reserved in


@dataclasses.dataclass(slots=True)  # slotted, not frozen: built per request (see engine.base.Delta)
class Admission:
    admitted: bool
    reservation: Reservation | None = None
    code: ErrorCode | None = None
    reason: str = ""  # short machine-friendly reason, used as a metrics label
    message: str = ""  # human-readable, safe to send to the client
    retry_after_s: float | None = None
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)  # x-ratelimit-* etc.
    # Added (optional): the value to pass as vLLM's ``priority=`` (lower runs first). None means
    # "use ``ticket.priority.value``". Set by the scheduler's ordering policy on accepted admissions.
    engine_priority: int | None = None


@dataclasses.dataclass(frozen=True)
class RunningStream:
    stream_key: str
    priority: Priority
    tokens_so_far: int  # prompt + generated; "largest first" preemption uses this
    deadline: float | None


@dataclasses.dataclass(frozen=True)
class Pressure:
    """One telemetry sample: memory use as a fraction of capacity (GPU memory, or KV cache on CPU)."""

    memory_fraction: float
    running: Sequence[RunningStream]
    waiting: int
    sampled_at: float  # monotonic seconds


@dataclasses.dataclass(frozen=True)
class Preemption:
    stream_key: str
    code: ErrorCode
    reason: str


class Scheduler(Protocol):
    def set_tenants(self, policies: Mapping[str, TenantPolicy]) -> None: ...
    def admit(self, ticket: Ticket, now: float, stage: str = "headers") -> Admission: ...
    def settle(self, reservation: Reservation, used_tokens: int, now: float) -> None: ...
    def observe(self, pressure: Pressure, now: float) -> Sequence[Preemption]: ...
    def expired(self, running: Sequence[RunningStream], now: float) -> Sequence[Preemption]: ...
