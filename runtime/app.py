"""The application: routing, authentication, the header contract, admission and serving.

Two entry points, both called by the transport for either protocol:

* :meth:`Application.gate` — synchronous, at HEADERS time, before any body byte is
  kept: route, tenant (API-key hash), header contract, model hint, request size and the
  scheduler's ``admit(stage="headers")``. Returns ``Accept`` or ``Reject`` (an error
  response from the contract table, with ``x-zerolayer-error`` and ``retry-after``).
* :meth:`Application.serve` — a task per accepted request once its body is complete:
  parse the API body, render the prompt with the engine's template,
  ``admit(stage="body")`` with the exact token count, generate, stream, ``settle``.

Errors before response headers become an HTTP status with an Anthropic- or
OpenAI-shaped body by route; errors after them become an SSE error event followed by
RST_STREAM with the contract's code (on HTTP/1.1: the connection is closed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from typing import Any, Callable, Mapping, Protocol, Sequence

from zerolayer import contract
from zerolayer.contract import ERRORS, ErrorCode, Priority
from zerolayer.runtime.api import anthropic, openai
from zerolayer.runtime.api.common import ChatRequest, dumps
from zerolayer.runtime.engine.base import Engine, InputRejected, SamplingOptions
from zerolayer.runtime.errors import EngineError, RequestRefused
from zerolayer.runtime.headers import RequestContract, parse_contract
from zerolayer.runtime.limits import Limits
from zerolayer.runtime.metrics import RuntimeMetrics
from zerolayer.runtime.protocol.events import Accept, Reject, RequestHead, RequestReady
from zerolayer.runtime.scheduler.api import Admission, Reservation, RunningStream, Scheduler, Ticket
from zerolayer.runtime.tenants import AuthThrottle, Tenant, TenantDirectory

log = logging.getLogger(__name__)

ROUTES: dict[str, tuple[str, str]] = {
    # path -> (method, route name)
    "/v1/messages": ("POST", "messages"),
    "/v1/chat/completions": ("POST", "chat"),
    "/v1/models": ("GET", "models"),
    "/healthz": ("GET", "healthz"),
    "/readyz": ("GET", "readyz"),
    "/metrics": ("GET", "metrics"),
    "/v1/zerolayer/map": ("GET", "map"),
}
PRESSURE_CODES = frozenset({ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.GPU_OOM})
API_OF_ROUTE = {"messages": "anthropic", "chat": "openai"}
BYTES_PER_TOKEN_ESTIMATE = 4  # a HEADERS-time guess from content-length, replaced at body time


class Channel(Protocol):
    """One response, as the transport offers it to the application."""

    key: str
    head_sent: bool

    async def send_head(self, status: int, headers: Sequence[tuple[str, str]]) -> None: ...
    async def send(self, data: bytes) -> None: ...
    async def end(self, data: bytes = b"") -> None: ...
    def reset(self, error_code: int) -> None: ...


@dataclasses.dataclass
class ActiveStream:
    """A chat request from HEADERS to settle: what the sampling loop and ``preempt`` see."""

    key: str
    route: str
    tenant: Tenant
    contract: RequestContract
    ticket: Ticket
    arrived: float
    reservation: Reservation | None = None
    task: asyncio.Task[Any] | None = None
    started: bool = False  # the serve coroutine began running
    engine_request: str | None = None  # set once engine work started
    first_token_sent: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    preempted: tuple[ErrorCode, str] | None = None
    settled: bool = False

    def running(self) -> RunningStream:
        return RunningStream(self.key, self.ticket.priority, self.prompt_tokens + self.output_tokens,
                             self.contract.effective_deadline(self.first_token_sent))


@dataclasses.dataclass(frozen=True)
class _Route:
    name: str
    api: str  # "anthropic" | "openai" | "plain"
    stream: ActiveStream | None = None


class Application:
    def __init__(
        self,
        *,
        engine: Engine,
        scheduler: Scheduler,
        tenants: TenantDirectory,
        metrics: RuntimeMetrics,
        limits: Limits,
        render_extra_metrics: Callable[[], bytes] = lambda: b"",
        clock: Callable[[], float] = time.monotonic,
        required_headers: Sequence[str] = (),
        token_sink: Callable[[str, str, str, int, int, bool], Any] | None = None,
        alternatives: Callable[[str | None], str | None] | None = None,
        map_document: Callable[[], bytes | None] | None = None,
        metrics_on_serving_port: bool = True,
    ) -> None:
        self.engine = engine
        # False when metrics have their own listener (``--metrics-port``): the serving port, which every
        # tenant namespace reaches, then answers /metrics with 404 (per-tenant usage is not theirs to read).
        self.metrics_on_serving_port = metrics_on_serving_port
        # Fleet hooks, set by the node agent when this runtime knows the GPU map (docs/gpu-map.md):
        # ``alternatives(session)`` gives the ALTERNATIVES header value for a pressure refusal (None: no
        # header); ``map_document()`` gives the body of GET /v1/zerolayer/map (None: no map, 404).
        # Both must not block: they read a snapshot.
        self.alternatives = alternatives
        self.map_document = map_document
        self.required_headers = tuple(required_headers)
        # Metering (zerolayer.bpf.probes.TokenProbe): called with (tenant, request_id, model, input_tokens,
        # output_tokens, first) right after tokens were handed to the transport for the client.
        self.token_sink = token_sink
        self.scheduler = scheduler
        self.tenants = tenants
        self.metrics = metrics
        self.limits = limits
        self.clock = clock
        self.render_extra_metrics = render_extra_metrics
        self.streams: dict[str, ActiveStream] = {}
        self.auth_throttle = AuthThrottle(limits.auth_failure_burst, limits.auth_failures_per_second)
        self.draining = False
        self.engine_requests_started = 0  # every generate() call; tests assert resets never start work
        self.created = int(time.time())
        self._models_document: bytes | None = None
        self._map_cache: tuple[float, bytes | None] | None = None  # (rendered at, document)

    # ------------------------------------------------------------------ HEADERS time
    def gate(self, conn_id: int, head: RequestHead, peer: str | None = None) -> Accept | Reject:
        """Decide from the header block alone. Never blocks; never sees the body.

        ``peer`` is the client's address: failed authentications from it are throttled.
        """
        path = head.path.split("?", 1)[0]
        known = ROUTES.get(path)
        api = API_OF_ROUTE.get(known[1], "plain") if known else "plain"
        if known is None:
            return self._reject(api, RequestRefused(ErrorCode.INVALID_REQUEST, f"no route for {path}",
                                                    reason="not_found", http_status=404), "unknown")
        method, route = known
        if route == "metrics" and not self.metrics_on_serving_port:
            return self._reject(api, RequestRefused(ErrorCode.INVALID_REQUEST, "metrics are served on the metrics port",
                                                    reason="not_found", http_status=404), "unknown")
        if head.method != method:
            return self._reject(api, RequestRefused(ErrorCode.INVALID_REQUEST, f"{path} accepts {method} only",
                                                    reason="method", http_status=405), route)
        if route in ("healthz", "readyz", "metrics"):
            return Accept(0, _Route(route, api))
        if peer is not None:
            wait = self.auth_throttle.blocked(peer, self.clock())
            if wait is not None:
                # Too many wrong keys from this address: the key is not even looked at, so guessing
                # runs at auth_failures_per_second at most, and a right guess is not confirmed now.
                self.metrics.limit_hits.labels("auth_failure_burst").inc()
                return self._reject(api, RequestRefused(
                    ErrorCode.RATE_LIMITED, "too many failed authentications from this address",
                    reason="auth_throttled", retry_after_s=wait), route)
        tenant = self.tenants.authenticate(head.headers)
        if tenant is None:
            if peer is not None:
                self.auth_throttle.failed(peer, self.clock())
            return self._reject(api, RequestRefused(
                ErrorCode.AUTHENTICATION, "missing or unknown API key (x-api-key or Authorization: Bearer)",
                reason="no_key"), route)
        if route in ("models", "map"):
            return Accept(0, _Route(route, api))
        key = f"{conn_id}/{head.stream_id}"
        try:
            stream = self._admit_headers(key, route, tenant, head)
        except RequestRefused as refused:
            return self._reject(api, refused, route)
        return Accept(self.limits.max_body_bytes, _Route(route, api, stream), owner=tenant.name)

    def _admit_headers(self, key: str, route: str, tenant: Tenant, head: RequestHead) -> ActiveStream:
        now = self.clock()
        if self.draining:
            raise RequestRefused(ErrorCode.MODEL_UNAVAILABLE, "this node is shutting down", reason="draining",
                                 retry_after_s=1.0)
        if not self.engine.ready():
            raise RequestRefused(ErrorCode.MODEL_UNAVAILABLE, "the engine is not ready", reason="engine_not_ready",
                                 retry_after_s=1.0)
        terms = parse_contract(head.headers, now, time.time_ns(), self.required_headers)
        if terms.model_hint is not None and terms.model_hint not in self.engine.models:
            raise self._unknown_model(terms.model_hint)
        length = head.headers.get("content-length")
        declared = int(length) if length and length.isdigit() else 0
        if declared > self.limits.max_body_bytes:
            self.metrics.limit_hits.labels("max_body_bytes").inc()
            raise RequestRefused(ErrorCode.INVALID_REQUEST, f"body over {self.limits.max_body_bytes} bytes",
                                 reason="body_too_large", http_status=413)
        if not terms.priority_given:
            terms = dataclasses.replace(terms, priority=default_priority(tenant.policy.allowed_priorities))
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
            raise self._refusal(admission, terms.session)
        stream = ActiveStream(key, route, tenant, terms, ticket, now, reservation=admission.reservation)
        self.streams[key] = stream
        self.metrics.streams_active.set(len(self.streams))
        return stream

    # ------------------------------------------------------------------ body complete
    async def serve(self, channel: Channel, ready: RequestReady) -> None:
        route: _Route = ready.context
        try:
            if route.name == "healthz":
                await self._plain(channel, 200, b"ok\n")
            elif route.name == "readyz":
                ok = self.engine.ready() and not self.draining
                await self._plain(channel, 200 if ok else 503, b"ready\n" if ok else b"not ready\n")
            elif route.name == "metrics":
                body = self.metrics.render() + self.render_extra_metrics()
                await self._respond(channel, 200, [("content-type", "text/plain; version=0.0.4")], body, route.name)
            elif route.name == "models":
                await self._respond(channel, 200, [("content-type", "application/json")], self.models_document(),
                                    route.name)
            elif route.name == "map":
                await self._serve_map(channel)
            else:
                assert route.stream is not None
                await self._serve_chat(channel, route, route.stream, ready.body)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must not take the connection down: log and answer 500
            log.exception("unhandled error serving %s", channel.key)
            if not channel.head_sent:
                refused = RequestRefused(ErrorCode.INTERNAL_ERROR, "internal error", reason="bug")
                await self._send_error(channel, route.api, refused, route.name)
            else:
                channel.reset(ERRORS[ErrorCode.INTERNAL_ERROR].rst_code)

    def models_document(self) -> bytes:
        """The body of GET /v1/models, built once: the served models do not change while running."""
        if self._models_document is None:
            self._models_document = openai.models(list(self.engine.models), self.created)
        return self._models_document

    def _map_snapshot(self) -> bytes | None:
        """The map document, rendered at most once per ``limits.map_cache_s`` (the gossip sample
        period is seconds): a tenant polling the map costs a write, not a fleet serialisation."""
        now = self.clock()
        cached = self._map_cache
        if cached is None or now - cached[0] >= self.limits.map_cache_s:
            document = self.map_document() if self.map_document is not None else None
            self._map_cache = cached = (now, document)
        return cached[1]

    async def _serve_map(self, channel: Channel) -> None:
        document = self._map_snapshot()
        if document is None:
            refused = RequestRefused(ErrorCode.INVALID_REQUEST, "this node has no GPU map (gossip is off)",
                                     reason="no_map", http_status=404)
            await self._send_error(channel, "plain", refused, "map")
            return
        await self._respond(channel, 200, [("content-type", "application/json"), ("cache-control", "no-store")],
                            document, "map")

    async def _serve_chat(self, channel: Channel, route: _Route, stream: ActiveStream, body: bytes) -> None:
        if stream.settled:
            # Preempted while its body was still arriving: nothing ran, answer with the code now.
            code, reason = stream.preempted or (ErrorCode.INTERNAL_ERROR, "settled")
            await self._send_error(channel, route.api, RequestRefused(
                code, f"stream stopped by the scheduler: {reason}", reason=reason,
                retry_after_s=1.0 if ERRORS[code].retryable else None), route.name)
            return
        stream.started = True
        task = asyncio.current_task()
        if stream.task is None:
            stream.task = task
        try:
            await self._generate(channel, route, stream, body)
        except RequestRefused as refused:
            await self._fail(channel, route, stream, refused)
        except InputRejected as exc:
            await self._fail(channel, route, stream, RequestRefused(ErrorCode.INVALID_REQUEST, str(exc),
                                                                     reason="input_rejected"))
        except EngineError as exc:
            # The engine's own text stays in the log: it may name internals (paths, other requests).
            log.warning("engine error on %s: %s", stream.key, exc)
            await self._fail(channel, route, stream, RequestRefused(
                ErrorCode.INTERNAL_ERROR, "the engine failed on this request", reason="engine"))
        except asyncio.CancelledError:
            if stream.preempted is None:
                raise  # the client went away or the connection closed: nobody to answer
            if task is not None:
                task.uncancel()
            code, reason = stream.preempted
            self.metrics.preemptions.labels(code.value, reason).inc()
            await self._fail(channel, route, stream, RequestRefused(
                code, f"stream stopped by the scheduler: {reason}", reason=reason,
                retry_after_s=1.0 if ERRORS[code].retryable else None), preempted=True)
        finally:
            await self._finish(stream)

    async def _generate(self, channel: Channel, route: _Route, stream: ActiveStream, body: bytes) -> None:
        api = anthropic if route.api == "anthropic" else openai
        request: ChatRequest = api.parse(body)
        if request.model not in self.engine.models:
            raise self._unknown_model(request.model)
        priority = stream.ticket.priority
        if request.priority is not None and not stream.contract.priority_given:
            priority = Priority.parse(request.priority)
        prompt = await self.engine.render(request.model, request.messages)
        self._check_context(request, prompt.token_count)
        stream.prompt_tokens = prompt.token_count
        stream.ticket = dataclasses.replace(stream.ticket, model=request.model, priority=priority,
                                            prompt_tokens=prompt.token_count, max_tokens=request.max_tokens)
        admission = self.scheduler.admit(stream.ticket, self.clock(), stage="body")
        if not admission.admitted:
            stream.reservation = None  # the scheduler released the HEADERS reservation itself
            raise self._refusal(admission, stream.ticket.session)
        stream.reservation = admission.reservation or stream.reservation
        engine_priority = getattr(admission, "engine_priority", None)
        if engine_priority is None:
            engine_priority = int(priority)
        deadline = stream.contract.effective_deadline(False)
        if deadline is not None and self.clock() >= deadline:
            raise RequestRefused(ErrorCode.DEADLINE_EXCEEDED, "deadline passed before generation started",
                                 reason="deadline_before_start")
        options = SamplingOptions(request.max_tokens, request.temperature, request.top_p, request.stop, request.seed)
        request_id = f"{'msg' if route.api == 'anthropic' else 'chatcmpl'}_{uuid.uuid4().hex[:24]}"
        stream.engine_request = request_id
        self.engine_requests_started += 1
        deltas = self.engine.generate(prompt, options, request_id, engine_priority)
        head = [("x-request-id", request_id), *admission.headers.items()]
        tenant = stream.tenant.name
        self.metrics.tokens.labels(tenant, "prompt").inc(prompt.token_count)
        if request.stream:
            await self._stream(channel, route, stream, request, deltas, head)
        else:
            await self._complete(channel, route, stream, request, deltas, head)
        self.metrics.tokens.labels(tenant, "completion").inc(stream.output_tokens)
        stream.engine_request = None  # finished: nothing to abort

    def _check_context(self, request: ChatRequest, prompt_tokens: int) -> None:
        """A prompt that fills the model's context, or a ``max_tokens`` beyond it, is the client's
        mistake (400), not an engine failure: say so before any engine work starts."""
        context = getattr(self.engine, "max_model_len", None)
        if not context:
            return
        if prompt_tokens >= context:
            raise RequestRefused(ErrorCode.INVALID_REQUEST,
                                 f"the prompt is {prompt_tokens} tokens; {request.model} takes at most {context} "
                                 "tokens of prompt and output together", reason="prompt_too_long")
        if request.max_tokens > context:
            raise RequestRefused(ErrorCode.INVALID_REQUEST,
                                 f"max_tokens {request.max_tokens} is more than {request.model}'s context of "
                                 f"{context} tokens", reason="max_tokens_over_context")

    async def _complete(self, channel, route, stream, request, deltas, head) -> None:  # type: ignore[no-untyped-def]
        rid = stream.engine_request
        try:
            await self._complete_unmetered(channel, route, stream, request, deltas, head)
        finally:
            # Metered once however it ends: answered, cancelled by the client or the scheduler, or
            # failed. The engine did the prefill and the tokens generated so far either way.
            if self.token_sink is not None:
                self.token_sink(stream.tenant.name, rid, request.model, stream.prompt_tokens, stream.output_tokens, True)

    async def _complete_unmetered(self, channel, route, stream, request, deltas, head) -> None:  # type: ignore[no-untyped-def]
        parts: list[str] = []
        finish = "stop"
        async for delta in deltas:
            if not stream.first_token_sent and delta.token_count:
                stream.first_token_sent = True
                self.metrics.ttft.observe(self.clock() - stream.arrived)
            stream.output_tokens += delta.token_count
            parts.append(delta.text)
            finish = delta.finish_reason or finish
        text = "".join(parts)
        rid = stream.engine_request
        if route.api == "anthropic":
            body = anthropic.message(rid, request.model, text, anthropic.STOP_REASONS.get(finish, "end_turn"),
                                     {"input_tokens": stream.prompt_tokens, "output_tokens": stream.output_tokens})
        else:
            body = openai.completion(rid, int(time.time()), request.model, text, openai.FINISH_REASONS.get(finish, "stop"),
                                     openai.usage(stream.prompt_tokens, stream.output_tokens))
        await self._respond(channel, 200, [("content-type", "application/json"), *head], dumps(body), route.name)

    async def _stream(self, channel, route, stream, request, deltas, head) -> None:  # type: ignore[no-untyped-def]
        rid = stream.engine_request
        created = int(time.time())
        await channel.send_head(200, [("content-type", "text/event-stream"), ("cache-control", "no-cache"), *head])
        self.metrics.requests.labels(route.name, "200").inc()
        if route.api == "anthropic":
            await channel.send(anthropic.stream_start(rid, request.model, stream.prompt_tokens))
        else:
            await channel.send(openai.chunk(rid, created, request.model, {"role": "assistant", "content": ""}, None,
                                            include_usage=request.include_usage))
        sink = self.token_sink
        if sink is not None:
            sink(stream.tenant.name, rid, request.model, stream.prompt_tokens, 0, True)
        finish = "stop"
        async for delta in deltas:
            if delta.token_count and not stream.first_token_sent:
                stream.first_token_sent = True
                self.metrics.ttft.observe(self.clock() - stream.arrived)
            stream.output_tokens += delta.token_count
            if delta.finish_reason:
                finish = delta.finish_reason
            if delta.text:
                if route.api == "anthropic":
                    await channel.send(anthropic.stream_delta(delta.text))
                else:
                    await channel.send(openai.chunk(rid, created, request.model, {"content": delta.text}, None,
                                                    include_usage=request.include_usage))
            if sink is not None and delta.token_count:
                sink(stream.tenant.name, rid, request.model, 0, delta.token_count, False)
        if route.api == "anthropic":
            await channel.end(anthropic.stream_end(anthropic.STOP_REASONS.get(finish, "end_turn"),
                                                   stream.prompt_tokens, stream.output_tokens))
        else:
            use = openai.usage(stream.prompt_tokens, stream.output_tokens)
            tail = openai.chunk(rid, created, request.model, {}, openai.FINISH_REASONS.get(finish, "stop"),
                                include_usage=request.include_usage)
            if request.include_usage:
                tail += openai.usage_chunk(rid, created, request.model, use)
            await channel.end(tail + openai.DONE)

    # ------------------------------------------------------------------ ends
    async def _fail(self, channel: Channel, route: _Route, stream: ActiveStream, refused: RequestRefused,
                    preempted: bool = False) -> None:
        if not preempted:
            self.metrics.refusals.labels(refused.code.value, refused.reason).inc()
        if not channel.head_sent:
            await self._send_error(channel, route.api, refused, route.name)
            return
        # Mid-stream: an SSE error event the SDKs understand, then RST_STREAM with the contract's code.
        api = anthropic if route.api == "anthropic" else openai
        try:
            await asyncio.wait_for(channel.send(api.stream_error(refused.code, refused.message)), 1.0)
        except (asyncio.TimeoutError, ConnectionError):
            pass  # a reader too slow to take the error event still gets the reset
        channel.reset(ERRORS[refused.code].rst_code)

    async def _finish(self, stream: ActiveStream) -> None:
        """Settle exactly once (idempotent), then abort unfinished engine work.

        Settling comes first and without an await: the connection going away cancels this task a
        second time (``connection_lost`` after ``eof_received``, or RST_STREAM then FIN), and that
        cancel lands on the first await here. Anything after it must not be bookkeeping.
        """
        request_id, stream.engine_request = stream.engine_request, None
        self.settle(stream)
        if request_id is not None:
            try:
                await asyncio.shield(self.engine.abort(request_id))
            except EngineError as exc:
                log.warning("engine abort of %s failed: %s", request_id, exc)

    def settle(self, stream: ActiveStream) -> None:
        if stream.settled:
            return
        stream.settled = True
        self.streams.pop(stream.key, None)
        self.metrics.streams_active.set(len(self.streams))
        if stream.reservation is not None:
            self.scheduler.settle(stream.reservation, stream.prompt_tokens + stream.output_tokens, self.clock())

    def stream_aborted(self, key: str) -> None:
        """The peer reset the stream or the connection went away."""
        stream = self.streams.get(key)
        if stream is None or stream.settled:
            return
        if stream.task is not None and stream.started:
            if stream.task.cancelling():
                return  # already being stopped (the peer's reset, then its FIN): one cancel is enough
            stream.task.cancel()  # its finally settles and aborts engine work
        else:
            if stream.task is not None:
                stream.task.cancel()  # never ran: the coroutine body (and its finally) will not run
            self.settle(stream)

    def connection_lost(self, conn_id: int) -> None:
        """The connection is gone: end every stream it carried."""
        prefix = f"{conn_id}/"
        for key in [k for k in self.streams if k.startswith(prefix)]:
            self.stream_aborted(key)

    def preempt(self, key: str, code: ErrorCode, reason: str) -> bool:
        """Stop a running stream with ``code`` (SSE error + RST_STREAM, engine abort). False if unknown."""
        stream = self.streams.get(key)
        if stream is None or stream.settled or stream.preempted is not None:
            return False
        stream.preempted = (code, reason)
        if stream.task is not None and stream.started:
            stream.task.cancel()
        else:
            # Body still arriving: nothing started. The transport answers when the body completes.
            if stream.task is not None:
                stream.task.cancel()
            self.metrics.preemptions.labels(code.value, reason).inc()
            self.settle(stream)
        return True

    def attach(self, key: str, task: asyncio.Task[Any]) -> None:
        stream = self.streams.get(key)
        if stream is not None:
            stream.task = task

    # ------------------------------------------------------------------ responses
    def _unknown_model(self, model: str) -> RequestRefused:
        return RequestRefused(ErrorCode.MODEL_UNAVAILABLE,
                              f"model {model!r} is not served here (serving: {', '.join(self.engine.models)})",
                              reason="unknown_model", http_status=404)

    def _refusal(self, admission: Admission, session: str | None) -> RequestRefused:
        code = admission.code or ErrorCode.RESOURCE_EXHAUSTED
        headers = admission.headers
        if code in PRESSURE_CODES and self.alternatives is not None:
            # Where the client can go instead: other admitting nodes in the session's hash order.
            endpoints = self.alternatives(session)
            if endpoints:
                headers = {**headers, contract.ALTERNATIVES: endpoints}
        # A request bigger than the tenant's whole per-minute quota can never pass, here or on any node:
        # a fixed status marks it not retryable (x-should-retry: false, no retry-after).
        fixed_status = ERRORS[code].http_status if admission.reason == "request_too_large" else None
        return RequestRefused(code, admission.message or code.value, reason=admission.reason or "scheduler",
                              retry_after_s=admission.retry_after_s, headers=headers, http_status=fixed_status)

    def _reject(self, api: str, refused: RequestRefused, route: str) -> Reject:
        self.metrics.refusals.labels(refused.code.value, refused.reason).inc()
        status, headers, body = error_response(api, refused)
        self.metrics.requests.labels(route, str(status)).inc()
        return Reject(status, headers, body)

    async def _send_error(self, channel: Channel, api: str, refused: RequestRefused, route: str) -> None:
        status, headers, body = error_response(api, refused)
        headers = [(k, v) for k, v in headers if k != "content-length"]
        await self._respond(channel, status, headers, body, route)

    async def _respond(self, channel: Channel, status: int, headers: Sequence[tuple[str, str]], body: bytes,
                       route: str) -> None:
        self.metrics.requests.labels(route, str(status)).inc()
        await channel.send_head(status, [*headers, ("content-length", str(len(body)))])
        await channel.end(body)

    async def _plain(self, channel: Channel, status: int, body: bytes) -> None:
        await self._respond(channel, status, [("content-type", "text/plain")], body, "health")


def default_priority(allowed: frozenset[Priority]) -> Priority:
    """A request naming no priority runs at normal, or at the tenant's nearest allowed class."""
    for candidate in (Priority.NORMAL, Priority.LOW, Priority.HIGH):
        if candidate in allowed:
            return candidate
    return Priority.NORMAL


def error_response(api: str, refused: RequestRefused) -> tuple[int, list[tuple[str, str]], bytes]:
    """Status, headers and body for an error before response headers (docs/protocol.md)."""
    wire = ERRORS[refused.code]
    status = refused.http_status or wire.http_status
    if api == "openai":
        body = openai.error_json(refused.code, refused.message)
    else:
        body = anthropic.error_json(refused.code, refused.message)
    headers: dict[str, str] = {"content-type": "application/json", contract.ERROR_HEADER: refused.code.value}
    headers.update({k.lower(): v for k, v in refused.headers.items()})
    retryable = wire.retryable and refused.http_status is None
    if retryable:
        retry_after = refused.retry_after_s if refused.retry_after_s is not None else 1.0
        headers.setdefault("retry-after", str(max(1, math.ceil(retry_after))))
        headers.setdefault("retry-after-ms", str(max(0, round(retry_after * 1000))))
    # Both official SDKs obey x-should-retry over their own status-code rules.
    headers["x-should-retry"] = "true" if retryable else "false"
    headers["content-length"] = str(len(body))
    return status, list(headers.items()), body


