"""The request side of the header contract (``zerolayer.contract``), parsed at HEADERS time.

Pure: takes the header mapping and the two clocks, returns :class:`RequestContract` or
raises :class:`~zerolayer.runtime.errors.RequestRefused` (INVALID_REQUEST for a malformed
value, DEADLINE_EXCEEDED for a deadline already past on arrival).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping, Sequence

from zerolayer import contract
from zerolayer.contract import ErrorCode, Priority
from zerolayer.runtime.errors import RequestRefused


@dataclasses.dataclass(frozen=True)
class RequestContract:
    priority: Priority
    priority_given: bool
    session: str | None
    model_hint: str | None
    output_format: str | None
    deadline: float | None  # monotonic seconds, from the deadline headers
    ttft_deadline: float | None  # monotonic seconds, from x-slo-ttft-ms; applies until the first token

    def effective_deadline(self, first_token_sent: bool) -> float | None:
        """The deadline the scheduler enforces now: the TTFT SLO counts only before the first token."""
        ttft = None if first_token_sent else self.ttft_deadline
        if ttft is None or self.deadline is None:
            return self.deadline if ttft is None else ttft
        return min(self.deadline, ttft)


# Contract fields a deployment may make mandatory (``headers.required`` in the config).
REQUIRABLE: dict[str, tuple[str, ...]] = {
    "session": contract.SESSION,
    "priority": contract.PRIORITY,
    "model_hint": contract.MODEL_HINT,
    "output_format": contract.OUTPUT_FORMAT,
    "deadline": contract.DEADLINE_NANOS,
}


# Every header name the contract reads: a request with none of them gets the default terms.
CONTRACT_HEADERS = frozenset((*contract.SESSION, *contract.PRIORITY, *contract.MODEL_HINT, *contract.OUTPUT_FORMAT,
                              *contract.DEADLINE_NANOS, *contract.SLO_TTFT_MS))


@functools.lru_cache(maxsize=None, typed=True)  # typed: a plain int is not taken for its Priority
def default_terms(priority: Priority) -> RequestContract:
    """The terms of a request that sends no contract header (one shared, frozen instance per priority)."""
    return RequestContract(priority=priority, priority_given=False, session=None, model_hint=None,
                           output_format=None, deadline=None, ttft_deadline=None)


def first(headers: Mapping[str, str], names: Sequence[str]) -> str | None:
    for name in names:
        value = headers.get(name)
        if value is not None and value.strip() != "":
            return value.strip()
    return None


def _bad(message: str) -> RequestRefused:
    return RequestRefused(ErrorCode.INVALID_REQUEST, message, reason="bad_header")


def _deadline(raw_deadline: str | None, now_mono: float, now_wall_ns: int) -> float | None:
    """The deadline header as monotonic seconds (absolute Unix nanoseconds, or nanoseconds from now)."""
    if raw_deadline is None:
        return None
    try:
        # 20 digits hold any sane Unix time in ns; longer is refused before int() does work on it.
        nanos = int(raw_deadline) if len(raw_deadline) <= 20 else -1
    except ValueError:
        raise _bad(f"deadline must be an integer number of nanoseconds, got {raw_deadline[:40]!r}") from None
    if nanos <= 0:
        raise _bad("deadline must be a positive integer of at most 20 digits")
    relative_ns = nanos - now_wall_ns if nanos >= contract.DEADLINE_ABSOLUTE_THRESHOLD_NS else nanos
    if relative_ns > contract.MAX_DEADLINE_S * 1e9:
        raise _bad(f"deadline is more than {contract.MAX_DEADLINE_S:g} s away")
    deadline = now_mono + relative_ns / 1e9
    if deadline <= now_mono:
        raise RequestRefused(ErrorCode.DEADLINE_EXCEEDED, "deadline already passed on arrival",
                             reason="deadline_on_arrival")
    return deadline


def parse_contract(headers: Mapping[str, str], now_mono: float, now_wall_ns: int,
                   required: Sequence[str] = (), default_priority: Priority = Priority.NORMAL) -> RequestContract:
    """Parse the contract; a field named in ``required`` (keys of REQUIRABLE) must be present (else 400).
    A request naming no priority gets ``default_priority`` (``priority_given`` False)."""
    if not required and CONTRACT_HEADERS.isdisjoint(headers):
        return default_terms(default_priority)  # most requests: no contract header to parse
    for field in required:
        if first(headers, REQUIRABLE[field]) is None:
            raise _bad(f"missing mandatory header {REQUIRABLE[field][0]} "
                       f"(or {', '.join(REQUIRABLE[field][1:])})" if len(REQUIRABLE[field]) > 1
                       else f"missing mandatory header {REQUIRABLE[field][0]}")
    raw_priority = first(headers, contract.PRIORITY)
    try:
        priority = Priority.parse(raw_priority) if raw_priority is not None else default_priority
    except ValueError as exc:
        raise _bad(str(exc)) from None

    deadline = _deadline(first(headers, contract.DEADLINE_NANOS), now_mono, now_wall_ns)
    ttft: float | None = None
    raw_ttft = first(headers, contract.SLO_TTFT_MS)
    if raw_ttft is not None:
        try:
            ms = float(raw_ttft)
        except ValueError:
            raise _bad(f"x-slo-ttft-ms must be a number of milliseconds, got {raw_ttft[:40]!r}") from None
        # inf, nan and 1e400 parse as floats: finite and bounded, or the scheduler's arithmetic overflows.
        if not (math.isfinite(ms) and 0 < ms <= contract.MAX_DEADLINE_S * 1000):
            raise _bad(f"x-slo-ttft-ms must be a positive number of milliseconds up to "
                       f"{contract.MAX_DEADLINE_S * 1000:g}")
        ttft = now_mono + ms / 1000.0

    output_format = first(headers, contract.OUTPUT_FORMAT)
    if output_format is not None and output_format.lower() not in ("json", "text"):
        raise _bad(f"output format must be json or text, got {output_format!r}")

    return RequestContract(
        priority=priority,
        priority_given=raw_priority is not None,
        session=first(headers, contract.SESSION),
        model_hint=first(headers, contract.MODEL_HINT),
        output_format=output_format.lower() if output_format else None,
        deadline=deadline,
        ttft_deadline=ttft,
    )
