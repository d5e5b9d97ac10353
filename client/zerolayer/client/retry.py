"""Error-code-driven retries: the policy (pure) and the retry budget (a token bucket).

The policy decides from the error alone whether and how to retry; it does no I/O and
never sleeps. The reference policy, extended only where the server says the work never
started:

==========================  ===============================================================
error                       what the next attempt does
==========================  ===============================================================
GPU_OOM                     at once, ``max_tokens`` halved (stop when it would reach 0)
DEADLINE_EXCEEDED           after jittered backoff, lighter model (body and hint), doubled deadline
REFUSED_STREAM,             on a suggested alternative at once, else after ``retry-after``
RESOURCE_EXHAUSTED,         (or jittered backoff); a ``retry-after`` longer than
MODEL_UNAVAILABLE           ``max_delay_s`` is not waited for: the error is raised
MODEL_UNAVAILABLE with      *waiting for the model* (a fleet scaling from zero): after ``retry-after``
``retry-after`` >= 0.5 s,   (up to 20 % later) for as long as the request's first attempt is less
no alternatives             than ``model_wait_s`` (180 s) old; these waits spend neither
                            ``max_retries`` nor the retry budget (the server paces them)
RATE_LIMITED                on the *same* node after ``retry-after`` (quotas are per node:
                            another node would multiply the tenant's quota), never elsewhere
INTERNAL_ERROR              after jittered backoff, on another node when there is one
connection refused          at once, on another node
``x-should-retry: false``   raised, unless a row above changes the request (e.g.
                            ``request_too_large``: no unchanged retry can pass)
anything else               raised
==========================  ===============================================================

Safety first: an attempt is retried only if the caller received no output token from it,
and a unary request only if its outcome is known (a connection lost mid-request may have
completed on the server, so it is raised as ``APIConnectionError(processed=None)``).
"""

from __future__ import annotations

import dataclasses
import random
import threading
from typing import Callable, Mapping

from zerolayer.contract import MAX_DEADLINE_S

from . import errors


MODEL_WAIT_MIN_S = 0.5  # a shorter retry-after is not a paced wait: it goes through decide() and the budget


@dataclasses.dataclass(frozen=True)
class AttemptParams:
    """What one attempt sends that the policy may change between attempts."""

    number: int  # 1 for the first attempt
    max_tokens: int
    model_hint: str | None
    deadline_s: float | None
    model: str | None = None  # the body's ``model``; the lighter-model fallback changes it


@dataclasses.dataclass(frozen=True)
class RetryDecision:
    delay_s: float
    next: AttemptParams
    prefer: tuple[str, ...] = ()  # endpoints to try first (a refusing node's alternatives)
    avoid_same_node: bool = True
    reason: str = ""


class RetryBudget:
    """A token bucket that bounds retries to a fraction of requests.

    Each new request deposits ``ratio`` tokens (up to ``burst``); each retry spends one.
    The bucket starts full. Under sustained failure the number of retries is therefore at
    most ``burst + ratio * requests``, i.e. total attempts <= (1 + ratio) * requests + burst:
    the client cannot turn an outage into a retry storm. Thread-safe; share one budget
    between clients that talk to the same fleet.
    """

    def __init__(self, ratio: float = 0.2, burst: float = 10.0) -> None:
        if ratio < 0 or burst < 1:
            raise ValueError("retry budget needs ratio >= 0 and burst >= 1")
        self.ratio = ratio
        self.burst = burst
        self._tokens = burst
        self._lock = threading.Lock()
        self.requests = 0
        self.retries = 0
        self.denied = 0

    def on_request(self) -> None:
        with self._lock:
            self.requests += 1
            self._tokens = min(self.burst, self._tokens + self.ratio)

    def try_spend(self) -> bool:
        """Take one token for a retry; False (and nothing taken) when the budget is spent."""
        with self._lock:
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                self.retries += 1
                return True
            self.denied += 1
            return False

    @property
    def tokens(self) -> float:
        return self._tokens


class RetryPolicy:
    """The retry decision table above; stateless apart from its random source."""

    def __init__(
        self,
        *,
        max_retries: int = 3,
        base_delay_s: float = 0.2,
        max_delay_s: float = 8.0,
        lighter_models: Mapping[str, str] | None = None,
        model_wait_s: float = 180.0,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if model_wait_s < 0:
            raise ValueError("model_wait_s must be >= 0 (0: no waiting for a model)")
        self.max_retries = max_retries
        self.model_wait_s = model_wait_s
        self.base_delay_s = base_delay_s
        self.max_delay_s = max_delay_s
        self.lighter_models = dict(lighter_models or {})
        self._rng = rng

    def backoff(self, number: int) -> float:
        """Full-jitter exponential backoff after attempt ``number`` (1-based)."""
        return self._rng() * min(self.max_delay_s, self.base_delay_s * 2 ** (number - 1))

    def honour(self, retry_after: float | None, number: int) -> float | None:
        """Delay honouring ``retry-after`` (never earlier, up to 20 % later so clients spread out).

        ``None`` when the server asks for longer than ``max_delay_s``: better to raise.
        """
        if retry_after is None:
            return self.backoff(number)
        if retry_after > self.max_delay_s:
            return None
        return retry_after * (1.0 + 0.2 * self._rng())

    def wait_for_model(self, error: errors.APIError, waited_s: float) -> float | None:
        """The delay before asking again for a model no node serves yet, or ``None`` (then :meth:`decide`).

        Only a retryable ``MODEL_UNAVAILABLE`` refusal with no alternatives and a ``retry-after`` of
        at least ``MODEL_WAIT_MIN_S`` qualifies, and only while ``waited_s`` (since the request's
        first attempt) plus the delay stays within ``model_wait_s``.
        """
        if not isinstance(error, errors.ModelUnavailable) or error.alternatives or error.should_retry is False:
            return None
        if error.processed is not False or error.tokens_delivered or error.retry_after is None:
            return None
        if error.retry_after < MODEL_WAIT_MIN_S:
            return None
        delay = error.retry_after * (1.0 + 0.2 * self._rng())
        return delay if waited_s + delay <= self.model_wait_s else None

    def decide(self, error: errors.APIError, attempt: AttemptParams, *, streaming: bool) -> RetryDecision | None:
        """How to retry after ``error`` on ``attempt``, or ``None`` to raise it."""
        if attempt.number > self.max_retries:
            return None
        if error.tokens_delivered > 0:
            return None  # the caller already has output from this attempt
        if error.processed is None and not streaming:
            return None  # the server may have completed it: not ours to repeat
        nxt = dataclasses.replace(attempt, number=attempt.number + 1)

        if isinstance(error, errors.GpuOom):
            half = attempt.max_tokens // 2
            if half < 1:
                return None
            return RetryDecision(0.0, dataclasses.replace(nxt, max_tokens=half), avoid_same_node=False, reason="gpu_oom")
        if isinstance(error, errors.DeadlineExceeded):
            # The lighter model is asked for in the body (what the runtime serves) and in the hint
            # header (what routing reads before the body), never in the header alone.
            hint = self.lighter_models.get(attempt.model_hint or "", attempt.model_hint)
            model = self.lighter_models.get(attempt.model or "", attempt.model)
            deadline = min(attempt.deadline_s * 2, MAX_DEADLINE_S) if attempt.deadline_s is not None else None
            nxt = dataclasses.replace(nxt, model=model, model_hint=hint, deadline_s=deadline)
            return RetryDecision(self.backoff(attempt.number), nxt, avoid_same_node=False, reason="deadline")
        if error.should_retry is False:
            # The server says the same request cannot pass (e.g. request_too_large). The two cases
            # above retry a *changed* request, so only from here on does it apply.
            return None
        if isinstance(error, errors.RateLimitError):
            # The quota that refused is this node's: retrying elsewhere would spend another node's
            # quota for the same tenant. Same node, after its retry-after; alternatives are ignored.
            delay = self.honour(error.retry_after, attempt.number)
            if delay is None:
                return None
            return RetryDecision(delay, nxt, prefer=(error.endpoint,) if error.endpoint else (),
                                 avoid_same_node=False, reason="rate_limited")
        if isinstance(error, (errors.StreamRefused, errors.ResourceExhausted, errors.ModelUnavailable)):
            if error.alternatives:
                return RetryDecision(0.0, nxt, prefer=error.alternatives, reason="refused_alternative")
            delay = self.honour(error.retry_after, attempt.number)
            return None if delay is None else RetryDecision(delay, nxt, reason="refused")
        if isinstance(error, errors.InternalError):
            return RetryDecision(self.backoff(attempt.number), nxt, reason="internal")
        if isinstance(error, errors.APIConnectionError) and not isinstance(error, errors.APITimeoutError):
            delay = 0.0 if error.processed is False else self.backoff(attempt.number)
            return RetryDecision(delay, nxt, reason="connection")
        return None

