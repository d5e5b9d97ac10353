"""Tenant quota book-keeping: a sliding-window ledger per tenant.

Why a sliding window and not fixed minutes: with fixed windows a tenant can spend its whole
budget at 0:59 and again at 1:00, i.e. twice the limit inside one minute. Here every charge
is timestamped and counts against the limit for exactly ``window_s`` after it was made, so

    **Bound.** For every interval of length ``window_s`` (aligned to nothing), the tokens
    *reserved* by admissions made in it are <= ``tokens_per_minute`` and the admissions are
    <= ``requests_per_minute``; concurrently open streams are <= ``max_concurrent_streams``.

Reservations are ``prompt_tokens + max_tokens``. Settling replaces a charge by the real count
(never more than reserved once the body stage has given the exact prompt size, because the
engine stops at ``max_tokens``); a settle that reports *more* than was reserved is charged in
full (honest billing) and is the only way consumption can exceed the bound, by the size of
the prompt-token under-estimate made at HEADERS time. The ledger is single-threaded: the
scheduler holds its lock around every call.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
from typing import Callable, ContextManager

from zerolayer.contract import RATELIMIT_HEADERS

from .api import TenantPolicy

(
    H_LIMIT_REQUESTS,
    H_REMAINING_REQUESTS,
    H_RESET_REQUESTS,
    H_LIMIT_TOKENS,
    H_REMAINING_TOKENS,
    H_RESET_TOKENS,
) = RATELIMIT_HEADERS


@dataclasses.dataclass
class _Charge:
    at: float
    tokens: int
    stream_key: str


@dataclasses.dataclass(frozen=True)
class QuotaVerdict:
    """Why a tenant cannot start a stream now, and when it could."""

    reason: str  # "tokens" | "requests" | "concurrency" | "request_too_large"
    message: str
    retry_after_s: float | None


class TenantLedger:
    """Charges of one tenant within the trailing window, plus its open streams."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._charges: collections.deque[_Charge] = collections.deque()
        self._by_stream: dict[str, _Charge] = {}
        self._requests: collections.deque[float] = collections.deque()
        self._tokens = 0
        self.open_streams: set[str] = set()
        self._expired_at: float | None = None  # the last expire's time: an admission reads the ledger ~10 times at one

    def set_window(self, window_s: float) -> None:
        self.window_s = window_s
        self._expired_at = None

    # ------------------------------------------------------------------ reading
    def expire(self, now: float) -> None:
        # At the same ``now`` nothing more can leave: a charge made since is at ``now``, inside a window > 0.
        if now == self._expired_at:
            return
        self._expired_at = now
        horizon = now - self.window_s
        while self._charges and self._charges[0].at <= horizon:
            charge = self._charges.popleft()
            self._tokens -= charge.tokens
            if self._by_stream.get(charge.stream_key) is charge:
                del self._by_stream[charge.stream_key]
        while self._requests and self._requests[0] <= horizon:
            self._requests.popleft()

    def tokens_in_window(self, now: float) -> int:
        self.expire(now)
        return self._tokens

    def requests_in_window(self, now: float) -> int:
        self.expire(now)
        return len(self._requests)

    def charged(self, stream_key: str) -> int:
        charge = self._by_stream.get(stream_key)
        return charge.tokens if charge else 0

    def tokens_retry_after(self, need: int, limit: int, now: float) -> float:
        """Seconds until ``need`` more tokens fit under ``limit`` if nothing else is admitted."""
        self.expire(now)
        excess = self._tokens + need - limit
        if excess <= 0:
            return 0.0
        freed = 0
        for charge in self._charges:
            freed += charge.tokens
            if freed >= excess:
                return max(0.0, charge.at + self.window_s - now)
        return self.window_s  # only reached if need > limit, which callers refuse first

    def requests_retry_after(self, limit: int, now: float) -> float:
        self.expire(now)
        excess = len(self._requests) + 1 - limit
        if excess <= 0:
            return 0.0
        return max(0.0, self._requests[excess - 1] + self.window_s - now)

    def full_reset_after(self, now: float, *, tokens: bool) -> float:
        """Seconds until every current charge has left the window (OpenAI's ``reset-*``)."""
        self.expire(now)
        if tokens:
            # Newest first: O(1) in the usual case (this runs on every admission; the window can
            # hold a minute of charges).
            newest = next((c.at for c in reversed(self._charges) if c.tokens > 0), None)
        else:
            newest = self._requests[-1] if self._requests else None
        return 0.0 if newest is None else max(0.0, newest + self.window_s - now)

    # ------------------------------------------------------------------ writing
    def charge(self, stream_key: str, tokens: int, now: float, *, new_request: bool) -> float:
        """Record (or re-size) the reservation of ``stream_key``; returns its charge time."""
        self.expire(now)
        existing = self._by_stream.get(stream_key)
        if existing is not None:
            self._tokens += tokens - existing.tokens
            existing.tokens = tokens
            at = existing.at
        else:
            charge = _Charge(now, tokens, stream_key)
            self._charges.append(charge)
            self._by_stream[stream_key] = charge
            self._tokens += tokens
            at = now
        if new_request:
            self._requests.append(now)
        self.open_streams.add(stream_key)
        return at

    def settle(self, stream_key: str, used_tokens: int, now: float) -> None:
        """Replace the reservation by the real count and close the stream."""
        self.expire(now)
        self.open_streams.discard(stream_key)
        charge = self._by_stream.pop(stream_key, None)
        if charge is not None:  # None: the charge already left the window, nothing to refund
            used = max(0, int(used_tokens))
            self._tokens += used - charge.tokens
            charge.tokens = used

    def release(self, stream_key: str, now: float) -> None:
        """Undo a reservation whose stream never started (body-stage refusal)."""
        self.settle(stream_key, 0, now)

    def restore(self, tokens: int, requests: int, now: float) -> None:
        """Count ``tokens`` and ``requests`` made before a restart as reserved at ``now`` (no stream:
        they leave the window ``window_s`` from now, never sooner than the real ones would have)."""
        self.expire(now)
        if tokens > 0:
            self._charges.append(_Charge(now, int(tokens), ""))
            self._tokens += int(tokens)
        self._requests.extend([now] * max(0, int(requests)))


class QuotaLedger:
    """All tenants' ledgers, and the check that the quota filter runs."""

    def __init__(self, window_s: float = 60.0, concurrency_retry_after_s: float = 1.0) -> None:
        self.window_s = window_s
        # when a stream will end is unknown, so a concurrency refusal suggests a fixed pause
        self.concurrency_retry_after_s = concurrency_retry_after_s
        self._tenants: dict[str, TenantLedger] = {}

    def retune(self, window_s: float, concurrency_retry_after_s: float) -> None:
        """New settings for a running ledger (``MicroScheduler.reconfigure``): charges are kept; with a
        shorter window the older ones leave at the next check, with a longer one those still held count longer."""
        self.window_s = window_s
        self.concurrency_retry_after_s = concurrency_retry_after_s
        for ledger in self._tenants.values():
            ledger.set_window(window_s)

    def tenants(self) -> set[str]:
        """Names of the tenants with a ledger (charged at least once)."""
        return set(self._tenants)

    #: Whether other processes charge the same tenants (several API processes' shared board, ``board.py``):
    #: the scheduler then decides the quota again inside :meth:`transaction`, from check to charge.
    node_wide = False

    def transaction(self) -> ContextManager[None]:
        """Held by the scheduler from the quota check to the charge it allows. Nothing to hold in one
        process (the scheduler's own lock serialises it); the node-wide ledger of several API processes
        takes its shared lock here (``board.py``)."""
        return contextlib.nullcontext()

    def refresh(self, now: float) -> None:
        """Called on every telemetry sample; nothing to do for a ledger that shares nothing."""

    def others(self, tenant: str) -> tuple[int, int, int]:
        """What other API processes of this node hold for ``tenant``: (open streams, requests, tokens in
        the window). None here; the node-wide ledger of several API processes reads its board (``board.py``)."""
        return 0, 0, 0

    def _retry_after(self, own_wait: Callable[[int], float], others: int, limit: int) -> float:
        """A refusal's retry-after: when this ledger's own charges free room under ``limit`` less what
        the others hold (``own_wait``). When the others leave the window is not known here, so a refusal
        caused by them alone suggests the fixed pause of a concurrency refusal."""
        if not others:
            return own_wait(limit)
        wait = own_wait(limit - others) if others < limit else 0.0
        return wait or self.concurrency_retry_after_s

    def tenant(self, name: str) -> TenantLedger:
        ledger = self._tenants.get(name)
        if ledger is None:
            ledger = self._tenants[name] = TenantLedger(self.window_s)
        return ledger

    def check(self, policy: TenantPolicy, stream_key: str, tokens: int, now: float, *, new_request: bool
              ) -> QuotaVerdict | None:
        """None if ``stream_key`` may hold ``tokens`` now; else why not and when to retry.

        ``new_request`` is False when re-sizing the reservation of a stream already admitted
        at HEADERS time: it is then not counted again against requests or concurrency.
        """
        ledger = self.tenant(policy.tenant)
        o_open, o_requests, o_tokens = self.others(policy.tenant)
        window = _window_words(self.window_s)
        if new_request:
            limit = policy.max_concurrent_streams
            open_streams = ledger.open_streams
            if limit is not None and len(open_streams) - (stream_key in open_streams) + o_open >= limit:
                return QuotaVerdict("concurrency", f"tenant {policy.tenant!r} already has {limit} open streams "
                                    "(max_concurrent_streams)", self.concurrency_retry_after_s)
            limit = policy.requests_per_minute
            if limit is not None and limit <= 0:
                return QuotaVerdict("requests", f"tenant {policy.tenant!r} may make no requests", None)
            if limit is not None and ledger.requests_in_window(now) + o_requests + 1 > limit:
                return QuotaVerdict("requests", f"tenant {policy.tenant!r} reached {limit} requests per {window}",
                                    self._retry_after(lambda room: ledger.requests_retry_after(max(1, room), now),
                                                      o_requests, limit))
        limit = policy.tokens_per_minute
        if limit is not None:
            if tokens > limit:
                return QuotaVerdict("request_too_large", f"request needs {tokens} tokens (prompt + max_tokens) but "
                                    f"tenant {policy.tenant!r} may use {limit} per {window}; lower max_tokens", None)
            need = tokens - ledger.charged(stream_key)
            if ledger.tokens_in_window(now) + o_tokens + need > limit:
                return QuotaVerdict("tokens", f"tenant {policy.tenant!r} reached {limit} tokens per {window}",
                                    self._retry_after(lambda room: ledger.tokens_retry_after(need, max(need, room), now),
                                                      o_tokens, limit))
        return None

    def headers(self, policy: TenantPolicy, now: float) -> dict[str, str]:
        """OpenAI-style ``x-ratelimit-*`` headers for the limits this tenant has: the remaining counts are
        the node's (:meth:`others` included), the reset times this ledger's own."""
        ledger = self.tenant(policy.tenant)
        _, o_requests, o_tokens = self.others(policy.tenant)
        out: dict[str, str] = {}
        if policy.requests_per_minute is not None:
            used = ledger.requests_in_window(now) + o_requests
            out[H_LIMIT_REQUESTS] = str(policy.requests_per_minute)
            out[H_REMAINING_REQUESTS] = str(max(0, policy.requests_per_minute - used))
            out[H_RESET_REQUESTS] = format_duration(ledger.full_reset_after(now, tokens=False))
        if policy.tokens_per_minute is not None:
            used = ledger.tokens_in_window(now) + o_tokens
            out[H_LIMIT_TOKENS] = str(policy.tokens_per_minute)
            out[H_REMAINING_TOKENS] = str(max(0, policy.tokens_per_minute - used))
            out[H_RESET_TOKENS] = format_duration(ledger.full_reset_after(now, tokens=True))
        return out


def retry_after_header(seconds: float) -> str:
    """``retry-after`` is whole seconds (RFC 9110); round up so a client never comes back early."""
    return str(max(0, math.ceil(seconds - 1e-9)))


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: ``"250ms"``, ``"1.5s"``, ``"6m0s"``, ``"1h2m3s"``."""
    if seconds <= 0:
        return "0s"
    # The text depends only on the whole milliseconds (rounded up) and on which side of 1 s the value
    # is: two x-ratelimit-reset headers per admission, mostly the same millisecond as the last ones.
    return _format_ms(math.ceil(seconds * 1000), seconds < 1)


@functools.lru_cache(maxsize=256)
def _format_ms(ms: int, under_a_second: bool) -> str:
    if under_a_second:
        return f"{max(1, ms)}ms"
    seconds = ms / 1000
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{int(hours)}h{int(minutes)}m{text}"
    if minutes:
        return f"{int(minutes)}m{text}"
    return text


def _window_words(window_s: float) -> str:
    return "minute" if window_s == 60 else f"{window_s:g} s"
