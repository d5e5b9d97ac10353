"""The application the transport talks to: the gate at HEADERS time, a handler per route once
the body is complete, and stream events passed on to the session table.

* :meth:`Application.gate` — :meth:`zerolayer.runtime.serving.gate.AdmissionGate.decide`; an admitted
  chat request becomes a :class:`~zerolayer.runtime.serving.session.StreamSession` at once (it holds a
  reservation until it settles, even if its body never comes).
* :meth:`Application.serve` — a task per accepted request: chat routes run their session; the
  others (health, readiness, metrics, models, GPU map, Anthropic token counting) are answered here.

Everything it uses comes in through the constructor (see :mod:`zerolayer.runtime.compose`):
``extra_metrics`` renderers appended to ``/metrics``, the ``token_sink`` for metering,
``alternatives(session)`` for pressure refusals and ``map_document()`` for the map endpoint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable, Sequence

from zerolayer.contract import ERRORS, ErrorCode
from zerolayer.runtime.api import anthropic, openai
from zerolayer.runtime.api.common import render_prompt
from zerolayer.runtime.serving.channel import Channel, respond, send_error
from zerolayer.runtime.serving.demand import DemandLedger
from zerolayer.runtime.engine.base import Engine, InputRejected
from zerolayer.runtime.errors import EngineError, RequestRefused
from zerolayer.runtime.serving.gate import AdmissionGate, Admitted, Route, model_refusal
from zerolayer.runtime.limits import Limits
from zerolayer.runtime.serving.metrics import RuntimeMetrics
from zerolayer.runtime.protocol.events import Accept, Reject, RequestHead, RequestReady
from zerolayer.runtime.scheduler.api import Scheduler
from zerolayer.runtime.serving.session import SessionTable, StreamSession, TokenSink
from zerolayer.runtime.serving.tracing import Tracer
from zerolayer.runtime.tenants import TenantDirectory

log = logging.getLogger(__name__)

_TEXT = [("content-type", "text/plain")]


class Application:
    def __init__(
        self,
        *,
        engine: Engine,
        scheduler: Scheduler,
        tenants: TenantDirectory,
        metrics: RuntimeMetrics,
        limits: Limits,
        extra_metrics: Sequence[Callable[[], bytes]] = (),
        clock: Callable[[], float] = time.monotonic,
        required_headers: Sequence[str] = (),
        token_sink: TokenSink | None = None,
        alternatives: Callable[[str | None], str | None] | None = None,
        map_document: Callable[[], bytes | None] | None = None,
        metrics_on_serving_port: bool = True,
        demand: DemandLedger | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.tenants = tenants
        self.metrics = metrics
        self.limits = limits
        self.clock = clock
        self.extra_metrics = tuple(extra_metrics)
        # ``map_document()`` gives the body of GET /v1/zerolayer/map (None: no map, 404); it reads a snapshot.
        self.map_document = map_document
        self.draining = False
        self.sessions = SessionTable(engine=engine, scheduler=scheduler, metrics=metrics, clock=clock,
                                     token_sink=token_sink, alternatives=alternatives, demand=demand,
                                     tracer=tracer)
        # An admitted chat request becomes its stream session in the gate's own Accept.
        self.admission = AdmissionGate(
            engine=engine, scheduler=scheduler, tenants=tenants, metrics=metrics, limits=limits, clock=clock,
            required_headers=required_headers, alternatives=alternatives, draining=lambda: self.draining,
            metrics_on_serving_port=metrics_on_serving_port, demand=demand, open_session=self.sessions.open)
        self.demand = demand  # gossiped as status.demand by the node agent
        self.created = int(time.time())
        self._models_document: tuple[tuple[str, ...], bytes] | None = None  # (served names, body)
        self._map_cache: tuple[float, bytes | None] | None = None  # (rendered at, document)

    # ------------------------------------------------------------------ what the transport calls
    def gate(self, conn_id: int, head: RequestHead, peer: str | None = None) -> Accept | Reject:
        """Decide from the header block alone (never blocks, never sees the body); an admitted chat
        request's context is its :class:`StreamSession`, opened by the gate."""
        return self.admission.decide(conn_id, head, peer)

    async def serve(self, channel: Channel, ready: RequestReady) -> None:
        """Answer an accepted request whose body is complete. A bug answers 500 (or resets), never
        takes the connection down."""
        context: StreamSession | Admitted = ready.context
        route = context.route
        try:
            if isinstance(context, StreamSession):
                await context.run(channel, ready.body)
            else:
                await self._serve_plain(channel, route, context, ready.body)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unhandled error serving %s", channel.key)
            if not channel.head_sent:
                refused = RequestRefused(ErrorCode.INTERNAL_ERROR, "internal error", reason="bug")
                await send_error(channel, self.metrics, route.wire, refused, route.name)
            else:
                channel.reset(ERRORS[ErrorCode.INTERNAL_ERROR].rst_code)

    def attach(self, key: str, task: asyncio.Task[Any]) -> None:
        self.sessions.attach(key, task)

    def stream_aborted(self, key: str) -> None:
        self.sessions.stream_aborted(key)

    def connection_lost(self, conn_id: int) -> None:
        self.sessions.connection_lost(conn_id)

    def preempt(self, key: str, code: ErrorCode, reason: str) -> bool:
        return self.sessions.preempt(key, code, reason)

    @property
    def streams(self) -> dict[str, StreamSession]:
        """The open chat sessions by stream key (read-only use)."""
        return self.sessions.streams

    @property
    def engine_requests_started(self) -> int:
        return self.sessions.engine_requests_started

    # ------------------------------------------------------------------ routes without a session
    async def _serve_plain(self, channel: Channel, route: Route, admitted: Admitted, body: bytes) -> None:
        metrics, name = self.metrics, route.name
        if name == "healthz":
            await respond(channel, metrics, 200, _TEXT, b"ok\n", "health")
        elif name == "readyz":
            ok = self.engine.ready() and self.tenants.known and not self.draining
            await respond(channel, metrics, 200 if ok else 503, _TEXT, b"ready\n" if ok else b"not ready\n", "health")
        elif name == "metrics":
            await respond(channel, metrics, 200, [("content-type", "text/plain; version=0.0.4")],
                          self.render_metrics(), name)
        elif name == "models":
            await respond(channel, metrics, 200, [("content-type", "application/json")], self.models_document(), name)
        elif name == "map":
            document = self._map_snapshot()
            if document is None:
                refused = RequestRefused(ErrorCode.INVALID_REQUEST, "this node has no GPU map (gossip is off)",
                                         reason="no_map", http_status=404)
                await send_error(channel, metrics, route.wire, refused, name)
                return
            await respond(channel, metrics, 200, [("content-type", "application/json"), ("cache-control", "no-store")],
                          document, name)
        elif name == "count_tokens":
            try:
                count = await self.count_tokens(admitted, body)
            except RequestRefused as refused:
                await send_error(channel, metrics, route.wire, refused, name)
                return
            await respond(channel, metrics, 200, [("content-type", "application/json")],
                          json.dumps({"input_tokens": count}).encode(), name)
        else:
            raise AssertionError(f"no handler for route {name!r}")

    async def count_tokens(self, admitted: Admitted, body: bytes) -> int:
        """``POST /v1/messages/count_tokens``: the prompt tokens the same body would cost on
        ``/v1/messages`` (the same parser, template and tokenizer), or RequestRefused. Nothing is
        generated, admitted or charged to the tenant's quota, and the prefix digest is left alone."""
        request = anthropic.parse_count(body)
        engine, tenant = self.engine, admitted.tenant
        if self.draining or not engine.ready():
            raise RequestRefused(ErrorCode.MODEL_UNAVAILABLE, "the engine is not ready", reason="engine_not_ready",
                                 retry_after_s=1.0)
        if request.model not in engine.models:
            raise model_refusal(request.model, engine.models, None, tenant)  # counting scales nothing up
        allowed = None if tenant is None else tenant.policy.allowed_models
        if tenant is not None and allowed is not None and request.model not in allowed:
            raise RequestRefused(ErrorCode.PERMISSION_DENIED,
                                 f"tenant {tenant.name!r} may not use model {request.model!r}",
                                 reason="model_not_allowed")
        try:
            prompt = await render_prompt(engine.for_model(request.model), request, observe=False)
        except InputRejected as exc:
            raise RequestRefused(ErrorCode.INVALID_REQUEST, str(exc), reason="input_rejected") from exc
        except EngineError as exc:
            # The engine's own text stays in the log, as for /v1/messages.
            log.warning("engine error counting tokens: %s", exc)
            raise RequestRefused(ErrorCode.INTERNAL_ERROR, "the engine failed on this request",
                                 reason="engine") from exc
        return int(prompt.token_count)

    def render_metrics(self) -> bytes:
        """The server's metrics, then every extra renderer's (scheduler, energy meter, ...)."""
        return self.metrics.render() + b"".join(render() for render in self.extra_metrics)

    def models_document(self) -> bytes:
        """The body of GET /v1/models, built again only when the served names change (LoRA adapters
        loaded or unloaded while running)."""
        names = tuple(self.engine.models)
        if self._models_document is None or self._models_document[0] != names:
            card = getattr(self.engine, "model_card", None)  # vLLM's root and max_model_len, where the engine says
            cards = {m: card(m) for m in names} if card is not None else None
            self._models_document = names, openai.models(list(names), self.created, self.engine.adapters,
                                                         cards)
        return self._models_document[1]

    def _map_snapshot(self) -> bytes | None:
        """The map document, rendered at most once per ``limits.map_cache_s`` (the gossip sample
        period is seconds): a tenant polling the map costs a write, not a fleet serialisation."""
        now = self.clock()
        cached = self._map_cache
        if cached is None or now - cached[0] >= self.limits.map_cache_s:
            document = self.map_document() if self.map_document is not None else None
            self._map_cache = cached = (now, document)
        return cached[1]
