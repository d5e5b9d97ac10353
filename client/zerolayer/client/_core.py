"""What the sync and async clients share: configuration, shared state and the per-request
attempt planner. No I/O here; the clients do the sending and the sleeping.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from zerolayer import contract, prefix

from . import errors, wire
from .events import Listener, RequestLatency, RetryScheduled, emit
from .nodes import NodeMap, StaticNodeMap
from .retry import AttemptParams, RetryBudget, RetryPolicy
from .routing import Router, Target
from .tracecontext import with_trace_context

MESSAGES_PATH = "/v1/messages"
DEFAULT_BASE_URL = "http://127.0.0.1:8080"
CONTRACT_OPTIONS = ("api_key", "priority", "session", "model_hint", "output_format", "deadline")


class Shared:
    """State shared by a client and every client derived from it with ``with_options``."""

    def __init__(
        self,
        *,
        base_url: str | None,
        nodes: NodeMap | Sequence[str] | None,
        fallback_url: str | None,
        max_retries: int,
        retry_policy: RetryPolicy | None,
        retry_budget: RetryBudget | None,
        lighter_models: Mapping[str, str] | None,
        breaker_threshold: int,
        breaker_reset_s: float,
        stale_after_s: float,
        on_event: Listener | None,
        model_wait_s: float = 180.0,
    ) -> None:
        if nodes is not None and base_url is not None:
            raise ValueError("give either base_url or nodes, not both")
        if nodes is None:
            nodes = StaticNodeMap([base_url or os.environ.get("ZEROLAYER_BASE_URL") or DEFAULT_BASE_URL])
        elif not hasattr(nodes, "nodes"):
            nodes = StaticNodeMap(list(nodes))  # type: ignore[arg-type]
        self.node_map: NodeMap = nodes  # type: ignore[assignment]
        self.listener = on_event
        self.router = Router(
            self.node_map,
            fallback=fallback_url,
            stale_after_s=stale_after_s,
            breaker_threshold=breaker_threshold,
            breaker_reset_s=breaker_reset_s,
            listener=on_event,
        )
        self.policy = retry_policy or RetryPolicy(max_retries=max_retries, lighter_models=lighter_models,
                                                  model_wait_s=model_wait_s)
        self.budget = retry_budget or RetryBudget()
        self._latency: dict[str, str] = {}
        self._lock = threading.Lock()

    def take_latency_report(self, endpoint: str) -> str | None:
        with self._lock:
            return self._latency.pop(endpoint, None)

    def put_latency_report(self, endpoint: str, value: str) -> None:
        with self._lock:
            self._latency[endpoint] = value


def make_contract(api_key: str | None, **options: Any) -> wire.RequestContract:
    key = api_key or os.environ.get("ZEROLAYER_API_KEY")
    if not key:
        raise ValueError("api_key is required (or set ZEROLAYER_API_KEY): the runtime authenticates every tenant")
    fields = {k: v for k, v in options.items() if v is not None}
    if "deadline" in fields:
        fields["deadline_s"] = fields.pop("deadline")
    return wire.RequestContract(api_key=key, **fields)


@dataclasses.dataclass(frozen=True)
class Attempt:
    target: Target
    url: str
    headers: dict[str, str]
    body: dict[str, Any]
    number: int


class Call:
    """One logical request across its attempts: where each goes, what it sends, whether to retry."""

    def __init__(
        self,
        shared: Shared,
        request_contract: wire.RequestContract,
        body: dict[str, Any],
        *,
        streaming: bool,
        extra_headers: Mapping[str, str] | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shared = shared
        self._clock = clock
        self.started = clock()  # the first attempt: waits for a model are bounded from here
        self.contract = request_contract
        self.body = body
        self.streaming = streaming
        self.extra_headers = with_trace_context(extra_headers or {})  # the caller's span, on every attempt
        self.params = AttemptParams(
            number=1,
            max_tokens=int(body["max_tokens"]),
            model_hint=request_contract.model_hint or str(body["model"]),
            deadline_s=request_contract.deadline_s,
            model=str(body["model"]),
        )
        self.failed: list[str] = []
        self.prefer: tuple[str, ...] = ()
        self.prefix = prefix.chat_block_hashes(prefix.chat_turns(body))  # for prefix-aware node choice
        shared.budget.on_request()

    def plan(self) -> Attempt:
        """The next attempt. Raises NoNodeAvailable when nowhere is usable."""
        model = self.params.model or str(self.body["model"])
        target = self.shared.router.choose(self.contract.session, failed=self.failed, prefer=self.prefer, model=model,
                                           prefix=self.prefix)
        headers = {
            **self.extra_headers,
            **self.contract.headers(model=model, model_hint=self.params.model_hint, deadline_s=self.params.deadline_s),
        }
        report = self.shared.take_latency_report(target.endpoint)
        if report:
            headers[contract.CLIENT_LATENCY] = report
        if self.streaming:
            headers["accept"] = "text/event-stream"
        body = {**self.body, "model": model, "max_tokens": self.params.max_tokens}
        if self.streaming:
            body["stream"] = True
        return Attempt(target, target.endpoint + MESSAGES_PATH, headers, body, self.params.number)

    def succeeded(self, attempt: Attempt, request_id: str | None, ttft_s: float | None, total_s: float) -> None:
        self.shared.router.record(attempt.target, None)
        self.shared.put_latency_report(attempt.target.endpoint, wire.latency_header(ttft_s, total_s, request_id))
        emit(
            self.shared.listener,
            RequestLatency(attempt.target.endpoint, request_id, ttft_s, total_s, attempt.number, self.streaming),
        )

    def failed_attempt(self, attempt: Attempt, error: errors.APIError) -> float | None:
        """Record the failure; the delay before the next attempt, or ``None`` to raise ``error``."""
        self.shared.router.record(attempt.target, error)
        wait = self.shared.policy.wait_for_model(error, self._clock() - self.started)
        if wait is not None:  # no node serves the model yet: paced by the server, no retry spent
            self.prefer = ()
            emit(self.shared.listener, RetryScheduled(attempt.target.endpoint, attempt.number,
                                                      "MODEL_UNAVAILABLE", wait, "model_wait"))
            return wait
        decision = self.shared.policy.decide(error, self.params, streaming=self.streaming)
        if decision is None or not self.shared.budget.try_spend():
            return None
        if decision.avoid_same_node:
            self.failed.append(attempt.target.endpoint)
        self.params = decision.next
        self.prefer = decision.prefer
        code = error.code.value if error.code is not None else type(error).__name__
        emit(
            self.shared.listener,
            RetryScheduled(attempt.target.endpoint, attempt.number, code, decision.delay_s, decision.reason),
        )
        return decision.delay_s


def request_body(model: str, max_tokens: int, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> dict:
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if not model:
        raise ValueError("model is required")
    return {"model": model, "max_tokens": max_tokens, "messages": list(messages), **params}
