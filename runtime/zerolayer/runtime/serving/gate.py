"""The admission gate: a request's header block in, a decision out. No body, no I/O, no await.

:meth:`AdmissionGate.decide` runs the moment a header block is complete — before a single
body byte is kept (the protocol cores call it from ``receive``). In order: route and method,
the per-address authentication throttle, the tenant (API-key hash), the header contract, the
model hint, the declared size, and the scheduler's ``admit(stage="headers")``. It returns
``Reject`` (an error response from the contract table) or ``Accept`` whose ``context`` is an
:class:`Admitted` — the route, and for chat routes the tenant, terms, ticket and reservation the
stream session starts from. Given ``open_session`` (the application passes its session table's
``open``), an admitted chat request's ``context`` is the session opened from that :class:`Admitted`.

To add a route: a row in :data:`ROUTES` (its kind says whether it needs a key and whether it is
admitted like a chat request), and its handler in :class:`zerolayer.runtime.serving.app.Application`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

from zerolayer import contract
from zerolayer.contract import ERRORS, ErrorCode, Priority
from zerolayer.runtime.api.anthropic_wire import ANTHROPIC
from zerolayer.runtime.api.completions_wire import COMPLETIONS
from zerolayer.runtime.api.openai_wire import OPENAI
from zerolayer.runtime.api.wire import WireApi, error_response
from zerolayer.runtime.serving.demand import DemandLedger, not_served_here
from zerolayer.runtime.engine.base import Engine
from zerolayer.runtime.errors import RequestRefused
from zerolayer.runtime.serving.headers import RequestContract, parse_contract
from zerolayer.runtime.limits import Limits
from zerolayer.runtime.serving.metrics import RuntimeMetrics
from zerolayer.runtime.serving.tracing import trace_id_of
from zerolayer.runtime.protocol.events import Accept, Reject, RequestHead, stream_key
from zerolayer.runtime.scheduler.api import Admission, Reservation, Scheduler, Ticket
from zerolayer.runtime.tenants import AuthThrottle, Tenant, TenantDirectory

PRESSURE_CODES = frozenset({ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.GPU_OOM})
BYTES_PER_TOKEN_ESTIMATE = 4  # a HEADERS-time guess from content-length, replaced at body time

OPEN, KEYED, CHAT = "open", "keyed", "chat"  # route kinds: no key; a tenant key; a key and admission


@dataclasses.dataclass(frozen=True)
class Route:
    name: str  # the ``route`` label of zerolayer_requests_total
    method: str
    kind: str  # OPEN | KEYED | CHAT
    wire: WireApi = ANTHROPIC  # the error format (and, for CHAT, the request and answer format)
    body: bool = False  # a KEYED route that reads a body (up to limits.max_body_bytes); CHAT routes always do


WIRES: dict[str, WireApi] = {"anthropic": ANTHROPIC, "openai": OPENAI}  # by WireApi.name

ROUTES: dict[str, Route] = {
    "/v1/messages": Route("messages", "POST", CHAT, ANTHROPIC),
    "/v1/chat/completions": Route("chat", "POST", CHAT, OPENAI),
    "/v1/completions": Route("completions", "POST", CHAT, COMPLETIONS),
    # Counted with the template and tokenizer /v1/messages prompts use; nothing is generated or admitted.
    "/v1/messages/count_tokens": Route("count_tokens", "POST", KEYED, ANTHROPIC, body=True),
    "/v1/models": Route("models", "GET", KEYED),
    "/healthz": Route("healthz", "GET", OPEN),
    "/readyz": Route("readyz", "GET", OPEN),
    "/metrics": Route("metrics", "GET", OPEN),
    "/v1/zerolayer/map": Route("map", "GET", KEYED),
}


@dataclasses.dataclass(slots=True)  # slotted, not frozen: built per request (see engine.base.Delta)
class Admitted:
    """What the gate decided for an accepted request (``Accept.context``)."""

    route: Route
    key: str = ""  # stream key (CHAT only)
    conn_id: int = 0
    tenant: Tenant | None = None
    terms: RequestContract | None = None
    ticket: Ticket | None = None
    reservation: Reservation | None = None
    arrived: float = 0.0
    gated: float = 0.0  # when the headers were admitted (the "gate" span ends here)
    traceparent: str | None = None  # the client's W3C trace context, for the request's spans


def default_priority(allowed: frozenset[Priority]) -> Priority:
    """A request naming no priority runs at normal, or at the tenant's nearest allowed class."""
    for candidate in (Priority.NORMAL, Priority.LOW, Priority.HIGH):
        if candidate in allowed:
            return candidate
    return Priority.NORMAL


def unknown_model(model: str, served: Sequence[str]) -> RequestRefused:
    return RequestRefused(ErrorCode.MODEL_UNAVAILABLE,
                          f"model {model!r} is not served here (serving: {', '.join(served)})",
                          reason="unknown_model", http_status=404)


def model_refusal(model: str, served: Sequence[str], demand: DemandLedger | None,
                  tenant: Tenant | None = None) -> RequestRefused:
    """The refusal for a model not served here: 404 standalone; with a demand ledger (in a cluster,
    where a fleet may serve it after scaling up) the demand is recorded and the refusal is retryable.
    A tenant whose policy does not allow the model gets the 404 and scales nothing."""
    allowed = tenant is None or tenant.policy.allowed_models is None or model in tenant.policy.allowed_models
    if demand is None or not allowed:
        return unknown_model(model, served)
    demand.record(model)
    return not_served_here(model, tuple(served))


def refusal(admission: Admission, session: str | None,
            alternatives: Callable[[str | None], str | None] | None) -> RequestRefused:
    """The error for a scheduler refusal (either stage), with alternatives on pressure refusals."""
    code = admission.code or ErrorCode.RESOURCE_EXHAUSTED
    headers = admission.headers
    if code in PRESSURE_CODES and alternatives is not None:
        # Where the client can go instead: other admitting nodes in the session's hash order.
        endpoints = alternatives(session)
        if endpoints:
            headers = {**headers, contract.ALTERNATIVES: endpoints}
    # A request bigger than the tenant's whole per-minute quota can never pass, here or on any node:
    # a fixed status marks it not retryable (x-should-retry: false, no retry-after).
    fixed_status = ERRORS[code].http_status if admission.reason == "request_too_large" else None
    return RequestRefused(code, admission.message or code.value, reason=admission.reason or "scheduler",
                          retry_after_s=admission.retry_after_s, headers=headers, http_status=fixed_status)


_NO_ROUTE = Route("unknown", "", OPEN)


class AdmissionGate:
    """Decides from the header block alone; see the module docstring.

    ``alternatives(session)`` gives the ALTERNATIVES header value for a pressure refusal (None:
    no header); ``draining()`` is true once the node is shutting down. Neither may block.
    ``open_session(admitted)``: what an admitted chat request's ``Accept.context`` is (the
    application's stream session; by default the :class:`Admitted` itself).
    """

    def __init__(self, *, engine: Engine, scheduler: Scheduler, tenants: TenantDirectory, metrics: RuntimeMetrics,
                 limits: Limits, clock: Callable[[], float] = time.monotonic, required_headers: Sequence[str] = (),
                 alternatives: Callable[[str | None], str | None] | None = None,
                 draining: Callable[[], bool] = lambda: False, metrics_on_serving_port: bool = True,
                 demand: DemandLedger | None = None, open_session: Callable[[Admitted], Any] | None = None) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.tenants = tenants
        self.metrics = metrics
        self.limits = limits
        self.clock = clock
        self.required_headers = tuple(required_headers)
        self.alternatives = alternatives
        self.draining = draining
        self.demand = demand  # requests for models not served here, gossiped (demand.py)
        self.open_session = open_session
        # False when metrics have their own listener (``--metrics-port``): the serving port, which every
        # tenant namespace reaches, then answers /metrics with 404 (per-tenant usage is not theirs to read).
        self.metrics_on_serving_port = metrics_on_serving_port
        self.auth_throttle = AuthThrottle(limits.auth_failure_burst, limits.auth_failures_per_second)

    def decide(self, conn_id: int, head: RequestHead, peer: str | None = None) -> Accept | Reject:
        """Accept (with an :class:`Admitted`) or Reject. ``peer``: the client's address, whose failed
        authentications are throttled."""
        path = head.path.split("?", 1)[0]
        traceparent = head.headers.get("traceparent")
        route = ROUTES.get(path)
        if route is None or (route.name == "metrics" and not self.metrics_on_serving_port):
            detail = "metrics are served on the metrics port" if route is not None else f"no route for {path}"
            return self.reject(_NO_ROUTE, RequestRefused(ErrorCode.INVALID_REQUEST, detail, reason="not_found",
                                                         http_status=404), traceparent)
        if head.method != route.method:
            return self.reject(route, RequestRefused(ErrorCode.INVALID_REQUEST, f"{path} accepts {route.method} only",
                                                     reason="method", http_status=405), traceparent)
        if route.kind == OPEN:
            return Accept(0, Admitted(route))
        if peer is not None:
            wait = self.auth_throttle.blocked(peer, self.clock())
            if wait is not None:
                # Too many wrong keys from this address: the key is not even looked at, so guessing
                # runs at auth_failures_per_second at most, and a right guess is not confirmed now.
                self.metrics.limit_hits.labels("auth_failure_burst").inc()
                return self.reject(route, RequestRefused(
                    ErrorCode.RATE_LIMITED, "too many failed authentications from this address",
                    reason="auth_throttled", retry_after_s=wait), traceparent)
        tenant = self.tenants.authenticate(head.headers)
        if tenant is None:
            if peer is not None:
                self.auth_throttle.failed(peer, self.clock())
            return self.reject(route, RequestRefused(
                ErrorCode.AUTHENTICATION, "missing or unknown API key (x-api-key or Authorization: Bearer)",
                reason="no_key"), traceparent)
        if route.kind == KEYED:
            if route.body:
                return Accept(self.limits.max_body_bytes, Admitted(route, tenant=tenant), owner=tenant.name)
            return Accept(0, Admitted(route, tenant=tenant))
        try:
            admitted = self._admit(conn_id, route, tenant, head, traceparent)
        except RequestRefused as refused:
            return self.reject(route, refused, traceparent)
        context = admitted if self.open_session is None else self.open_session(admitted)
        return Accept(self.limits.max_body_bytes, context, owner=tenant.name)

    def _admit(self, conn_id: int, route: Route, tenant: Tenant, head: RequestHead,
               traceparent: str | None) -> Admitted:
        now = self.clock()
        key = stream_key(conn_id, head.stream_id)
        if self.draining():
            raise RequestRefused(ErrorCode.MODEL_UNAVAILABLE, "this node is shutting down", reason="draining",
                                 retry_after_s=1.0)
        if not self.engine.ready():
            raise RequestRefused(ErrorCode.MODEL_UNAVAILABLE, "the engine is not ready", reason="engine_not_ready",
                                 retry_after_s=1.0)
        terms = parse_contract(head.headers, now, time.time_ns(), self.required_headers,
                               default_priority(tenant.policy.allowed_priorities))
        if terms.model_hint is not None and terms.model_hint not in self.engine.models:
            raise model_refusal(terms.model_hint, self.engine.models, self.demand, tenant)
        length = head.headers.get("content-length")
        declared = int(length) if length and length.isdigit() else 0
        if declared > self.limits.max_body_bytes:
            self.metrics.limit_hits.labels("max_body_bytes").inc()
            raise RequestRefused(ErrorCode.INVALID_REQUEST, f"body over {self.limits.max_body_bytes} bytes",
                                 reason="body_too_large", http_status=413)
        ticket = Ticket(
            stream_key=key,
            tenant=tenant.name,
            priority=terms.priority,
            model=terms.model_hint or self.engine.models[0],
            prompt_tokens=declared // BYTES_PER_TOKEN_ESTIMATE,
            max_tokens=0,
            deadline=terms.effective_deadline(False),
            session=terms.session,
            arrived=now,
        )
        admission = self.scheduler.admit(ticket, now)
        if not admission.admitted:
            raise refusal(admission, terms.session, self.alternatives)
        return Admitted(route, key, conn_id, tenant, terms, ticket, admission.reservation, now, self.clock(),
                        traceparent)

    def reject(self, route: Route, refused: RequestRefused, traceparent: str | None = None) -> Reject:
        """Count the refusal and build its response (answered by the core; the body is discarded). No span
        is built for a refusal at the headers; its body names the client's trace when ``traceparent`` is valid."""
        self.metrics.refusals.labels(refused.code.value, refused.reason).inc()
        status, headers, body = error_response(route.wire, refused, trace_id_of(traceparent))
        self.metrics.count_request(route.name, status)
        return Reject(status, headers, body)
