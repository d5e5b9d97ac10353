"""Connection limits: every HTTP/2 hardening rule is a setting with a default.

Each limit that trips increments ``zerolayer_h2_limit_hits_total{limit="<field name>"}``
in ``/metrics``. Defaults follow nghttp2 / the CVE advisories where one exists.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from zerolayer.runtime.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Limits:
    # Header blocks (RFC 9113 §6.5.2 SETTINGS_MAX_HEADER_LIST_SIZE; count is ours).
    max_header_list_size: int = 65536
    max_header_count: int = 100
    # CONTINUATION flood (CVE-2024-27316 family): count frames, not bytes.
    max_continuation_frames: int = 32
    # Rapid reset (CVE-2023-44487): a token bucket over client RST_STREAMs, nghttp2's numbers.
    rapid_reset_burst: int = 1000
    rapid_reset_per_second: float = 33.0
    # Control frames (PING, SETTINGS) whose answers are still queued for a peer that does not read.
    max_queued_control_frames: int = 1000
    # Empty DATA/HEADERS frames without END_STREAM (CVE-2019-9518) and WINDOW_UPDATE floods.
    empty_frames_burst: int = 100
    empty_frames_per_second: float = 10.0
    window_update_burst: int = 1000
    window_update_per_second: float = 100.0
    # Frames we neither answer nor act on: PRIORITY, unknown types, PING and SETTINGS ACKs (issue 28,
    # item 4: 200,000 of them cost the loop seconds and drew no GOAWAY).
    ignored_frames_burst: int = 1000
    ignored_frames_per_second: float = 100.0
    # Streams and bodies.
    max_concurrent_streams: int = 256
    max_body_bytes: int = 8 * 1024 * 1024
    max_frame_size: int = 16384
    initial_window_size: int = 1024 * 1024
    # Per-stream outbound buffer: a stream's producer pauses above high, resumes below low.
    stream_buffer_high: int = 256 * 1024
    stream_buffer_low: int = 64 * 1024
    # Connection timers (DESIGN.md §4: PING every 30 s, clients keep alive 45 s).
    ping_interval_s: float = 30.0
    idle_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0
    # Slow peers (docs/security.md, finding 2): a request's header block must complete within
    # header_timeout_s of its first byte, its body within body_timeout_s of its HEADERS; a response
    # may make no write progress for write_timeout_s (a peer that stops reading, finding 17).
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    write_timeout_s: float = 60.0
    # Connections held at once, in all and from one peer address.
    max_connections: int = 10000
    max_connections_per_peer: int = 512
    # Request bodies buffered at once (accepted, not yet complete), in the process and per tenant.
    max_buffered_body_bytes: int = 512 * 1024 * 1024
    max_tenant_buffered_body_bytes: int = 64 * 1024 * 1024
    # Failed authentications per peer address (finding 18): a burst, then this many per second;
    # a peer past its budget gets 429 without its key being looked at.
    auth_failure_burst: int = 20
    auth_failures_per_second: float = 1.0
    # GET /v1/zerolayer/map serves one rendering of the fleet document for this long (finding 33).
    map_cache_s: float = 1.0

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> "Limits":
        """Build from a config mapping; unknown keys are an error, not silently ignored."""
        data = dict(data or {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"unknown limits: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        values: dict[str, Any] = {}
        for name, value in data.items():
            kind = float if known[name].type in ("float", float) else int
            try:
                values[name] = kind(value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"limits.{name}: expected a number, got {value!r}") from exc
            if values[name] <= 0:
                raise ConfigError(f"limits.{name}: must be positive, got {value!r}")
        return cls(**values)


class TokenBucket:
    """A burst/rate budget. ``take(now)`` is False once the budget is spent."""

    __slots__ = ("capacity", "rate", "tokens", "stamp")

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        self.capacity = capacity
        self.rate = rate
        self.tokens = capacity
        self.stamp = now

    def credit(self, amount: float) -> None:
        """Give back budget earned otherwise than by time (never above capacity)."""
        self.tokens = min(self.capacity, self.tokens + amount)

    def take(self, now: float) -> bool:
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class BodyBudget:
    """Bytes of request bodies buffered at once, process-wide and per owner (tenant).

    Shared by every connection core of a process. ``take`` either books all ``n`` bytes or
    none and names the limit that refused them; ``give`` returns bytes when a body leaves the
    buffer (handed to the application, refused, reset, or its connection ended).
    """

    __slots__ = ("total_cap", "owner_cap", "total", "by_owner")

    def __init__(self, total_cap: int, owner_cap: int) -> None:
        self.total_cap = total_cap
        self.owner_cap = owner_cap
        self.total = 0
        self.by_owner: dict[str | None, int] = {}

    @classmethod
    def from_limits(cls, limits: Limits) -> "BodyBudget":
        return cls(limits.max_buffered_body_bytes, limits.max_tenant_buffered_body_bytes)

    def take(self, owner: str | None, n: int) -> str | None:
        """Book ``n`` bytes for ``owner``; None on success, else the name of the limit hit."""
        if n <= 0:
            return None  # nothing to book (and no empty entry left behind: give() ignores n <= 0 too)
        if self.total + n > self.total_cap:
            return "max_buffered_body_bytes"
        held = self.by_owner.get(owner, 0)
        if held + n > self.owner_cap:
            return "max_tenant_buffered_body_bytes"
        self.total += n
        self.by_owner[owner] = held + n
        return None

    def give(self, owner: str | None, n: int) -> None:
        if n <= 0:
            return
        self.total -= n
        left = self.by_owner.get(owner, 0) - n
        if left > 0:
            self.by_owner[owner] = left
        else:
            self.by_owner.pop(owner, None)
