"""The runtime server: engine, scheduler, tenants and listeners in one process.

``RuntimeServer`` is also the in-process handle tests and the scheduler's own tests use:
start it with any engine, scheduler and GPU source, read ``metrics``, call ``preempt``
or ``sample_once``, and ``stop`` it (GOAWAY, drain, close).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
import time
from typing import Callable, Sequence

from prometheus_client import Counter

from zerolayer.contract import ErrorCode
from zerolayer.gpumap import FleetMap, alternatives_header, render_map_document
from zerolayer.runtime.serving.app import Application
from zerolayer.runtime.serving.demand import DemandLedger
from zerolayer.runtime.serving.handoff import BACKLOG, HandoffReceiver
from zerolayer.runtime.engine.base import Engine
from zerolayer.runtime.errors import ConfigError
from zerolayer.runtime.gpu.api import GpuReading, GpuSource, GpuSourceError
from zerolayer.runtime.limits import BodyBudget, Limits
from zerolayer.runtime.serving.metrics import RuntimeMetrics
from zerolayer.runtime.scheduler.api import Preemption, Pressure, Scheduler
from zerolayer.runtime.scheduler.config import AUTO, KV_CACHE, SchedulerError
from zerolayer.runtime.scheduler.pressure import pressure_from_readings, resolve_pressure_signal
from zerolayer.runtime.serving.session import TokenSink
from zerolayer.runtime.serving.tracing import Tracer
from zerolayer.runtime.tenants import Tenant, TenantDirectory
from zerolayer.runtime.serving.transport import Connection, ConnectionAge, ConnectionContext, PeerLedger

log = logging.getLogger(__name__)


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """Server TLS offering ALPN ``h2`` then ``http/1.1``."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS certificate {cert_file!r} / key {key_file!r}: {exc}") from exc
    context.set_alpn_protocols(["h2", "http/1.1"])
    return context


def fleet_views(fleet: Callable[[], FleetMap | None] | None, self_name: str | None) -> tuple[
        Callable[[str | None], str | None] | None, Callable[[], bytes | None] | None]:
    """From a non-blocking fleet-map snapshot: the alternatives header for a refused session and the
    map document (``GET /v1/zerolayer/map``); both None without a fleet."""
    if fleet is None:
        return None, None

    def alternatives(session: str | None) -> str | None:
        return alternatives_header(fleet(), session, self_name=self_name)

    def map_document() -> bytes | None:
        current = fleet()
        return render_map_document(current) if current is not None else None

    return alternatives, map_document


class RuntimeServer:
    """Listeners, the sampling loop and drain around one :class:`~zerolayer.runtime.serving.app.Application`.

    Sinks and sources come in through the constructor, never by setting attributes later (see
    :mod:`zerolayer.runtime.compose`): ``token_sink`` meters tokens; ``extra_metrics`` renderers
    are appended to ``/metrics`` (the scheduler's registry always is); ``fleet()`` is a
    non-blocking GPU-map snapshot (the node agent's) that gives alternatives on pressure
    refusals and ``GET /v1/zerolayer/map``, ``self_name`` being this node's name in it; ``clock``
    (monotonic seconds) is what admission, throttling and sessions read.
    ``reuse_port`` sets SO_REUSEPORT so several runtime processes can share ``port``; ``handoff``
    instead takes connections the parent accepted (API processes with exact balance, handoff.py). Each
    connection is given :attr:`context` (:class:`~zerolayer.runtime.serving.transport.ConnectionContext`),
    not the server.
    """

    def __init__(
        self,
        *,
        engine: Engine,
        scheduler: Scheduler,
        tenants: Sequence[Tenant] | TenantDirectory = (),
        gpu_source: GpuSource | None = None,
        limits: Limits | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        ssl_context: ssl.SSLContext | None = None,
        sample_interval_s: float = 0.2,
        required_headers: Sequence[str] = (),
        metrics_on_serving_port: bool = True,
        reuse_port: bool = False,
        handoff: HandoffReceiver | None = None,
        server_core: str = "python",
        connection_age: ConnectionAge | None = None,
        token_sink: TokenSink | None = None,
        extra_metrics: Sequence[Callable[[], bytes]] = (),
        fleet: Callable[[], FleetMap | None] | None = None,
        self_name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        tracer: Tracer | None = None,
    ) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.tenants = tenants if isinstance(tenants, TenantDirectory) else TenantDirectory(tenants)
        self.gpu_source = gpu_source
        self.limits = limits or Limits()
        self.host, self.port = host, port
        self.ssl_context, self.sample_interval_s = ssl_context, sample_interval_s
        self.last_pressure: Pressure | None = None
        self.last_readings: Sequence[GpuReading] = ()  # the last good GPU sample (zerolayer_gpu_* gauges)
        self.metrics = self._runtime_metrics()
        self.reuse_port, self.handoff = reuse_port, handoff  # how connections come: a listener, or handed over
        extra = getattr(scheduler, "registry", None)
        renderers = [lambda: self.metrics.render_registry(extra)] if extra is not None else []
        alternatives, map_document = fleet_views(fleet, self_name)
        self.app = Application(
            engine=engine, scheduler=scheduler, tenants=self.tenants, metrics=self.metrics, limits=self.limits,
            required_headers=required_headers, alternatives=alternatives, map_document=map_document,
            metrics_on_serving_port=metrics_on_serving_port, token_sink=token_sink,
            extra_metrics=[*renderers, *extra_metrics], clock=clock,
            # In a cluster a model missing here may be a fleet's at zero replicas: record the demand.
            demand=DemandLedger() if fleet is not None else None,
            tracer=tracer,
        )
        self.draining = False
        # What each connection is given, instead of this server (transport.ConnectionContext).
        self.context = ConnectionContext(
            app=self.app, limits=self.limits,
            peers=PeerLedger(self.limits),  # connection caps
            body_budget=BodyBudget.from_limits(self.limits),  # request bodies buffered, all connections
            metrics=self.metrics, draining=lambda: self.draining,
            server_core=server_core, ended=handoff.ended if handoff is not None else lambda: None,
            age=connection_age)  # server.max_connection_age_s
        self._servers: list[asyncio.base_events.Server] = []
        self._sampler: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()

    def _runtime_metrics(self) -> RuntimeMetrics:
        """The serving metrics, reading the engine's per-model stats and the last GPU sample."""
        metrics = RuntimeMetrics()
        metrics.watch_engine(self.engine.model_stats)
        metrics.watch_gpus(lambda: self.last_readings)
        self.failed_samples = Counter(
            "zerolayer_gpu_samples_failed", "GPU samples that gave no reading (the scheduler kept its state).",
            registry=metrics.registry)
        return metrics

    @property
    def connections(self) -> set[Connection]:
        return self.context.connections

    @property
    def peers(self) -> PeerLedger:
        return self.context.peers

    @property
    def body_budget(self) -> BodyBudget:
        return self.context.body_budget

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> "RuntimeServer":
        await self.engine.start()
        self._adopt_kv_capacity()
        self.scheduler.set_tenants(self.tenants.policies())
        loop = asyncio.get_running_loop()
        tls = self.ssl_context is not None
        if self.handoff is not None:
            # The parent accepts on the port and hands connections over (handoff.py): no listener here.
            self.handoff.start(lambda: Connection(self.context, tls), self.ssl_context)
            self._sampler = loop.create_task(self._sample_loop())
            log.info("zerolayer runtime on %s, connections handed over by the parent (engine %s, models %s)",
                     self.base_url, self.engine.kind, ", ".join(self.engine.models))
            return self
        try:
            # The system's largest listen queue, not asyncio's 100: clients that connect together (a burst
            # of reconnects) would otherwise see SYNs dropped and wait 1 s or more for the retransmission.
            server = await loop.create_server(lambda: Connection(self.context, tls), self.host, self.port,
                                              ssl=self.ssl_context, reuse_address=True,
                                              reuse_port=self.reuse_port or None, backlog=BACKLOG)
        except OSError as exc:
            await self.engine.close()
            hint = "" if self.reuse_port else " (runtimes sharing a port need --reuse-port / listen.reuse_port)"
            raise ConfigError(f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}{hint}") from exc
        self._servers.append(server)
        self.port = server.sockets[0].getsockname()[1]
        self._sampler = loop.create_task(self._sample_loop())
        log.info("zerolayer runtime on %s (engine %s, models %s)", self.base_url, self.engine.kind,
                 ", ".join(self.engine.models))
        return self

    @property
    def base_url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://{self.host}:{self.port}"

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """GOAWAY every connection, let in-flight streams finish, then close and stop the engine."""
        if self.draining:
            await self._stopped.wait()
            return
        self.draining = True
        self.app.draining = True
        for server in self._servers:
            server.close()
        if self.handoff is not None:
            self.handoff.close()
        for conn in list(self.connections):
            conn.start_drain()
        timeout = self.limits.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        deadline = time.monotonic() + timeout
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.app.streams:
            # Streams still running at the deadline end with a contract error the client can act on
            # (MODEL_UNAVAILABLE: retryable, elsewhere) rather than a connection cut mid-body; a moment
            # for those last writes, then the connections close.
            for key in list(self.app.streams):
                self.app.preempt(key, ErrorCode.MODEL_UNAVAILABLE, "drain_timeout")
            grace = time.monotonic() + 1.0
            while self.app.streams and time.monotonic() < grace:
                await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        await self.engine.close()
        if self.gpu_source is not None:
            self.gpu_source.close()
        self._stopped.set()

    async def serve_forever(self) -> None:
        """Serve until SIGTERM/SIGINT, then drain and exit."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            log.info("signal received: draining")
            await self.stop()

    def _adopt_kv_capacity(self) -> None:
        """Give the scheduler the engine's KV-cache size for its projection when its config left it 0."""
        capacity = getattr(self.engine, "kv_capacity_tokens", None)
        adopt = getattr(self.scheduler, "adopt_kv_capacity", None)
        if isinstance(capacity, int) and capacity > 0 and callable(adopt) and adopt(capacity):
            log.info("scheduler projection: KV-cache capacity %d tokens (from the engine)", capacity)

    def replace_tenants(self, tenants: Sequence[Tenant]) -> None:
        """Apply new tenants and quotas without a restart."""
        self.tenants.replace(tenants)
        self.scheduler.set_tenants(self.tenants.policies())

    # ------------------------------------------------------------------ scheduler hooks
    def preempt(self, stream_key: str, code: ErrorCode, reason: str = "manual") -> bool:
        """Stop a stream: SSE error event + RST_STREAM (or an error status if nothing was sent), engine abort."""
        return self.app.preempt(stream_key, code, reason)

    @property
    def pressure_signal(self) -> str:
        """What the pressure gate reads now, ``kvCache`` or ``gpuMemory``: the scheduler's
        ``pressure_signal`` with ``auto`` resolved by whether the engine pre-allocates its GPU
        memory (vLLM does; docs/scheduler.md). Read per sample: the setting applies live."""
        config = getattr(self.scheduler, "config", None)
        return resolve_pressure_signal(getattr(config, "pressure_signal", AUTO),
                                       bool(getattr(self.engine, "preallocates_gpu_memory", False)))

    async def sample_once(self) -> Sequence[Preemption]:
        """One telemetry sample: build ``Pressure``, ask the scheduler, preempt what it returns."""
        running = self.app.sessions.running()
        stats = self.engine.stats()
        now = time.monotonic()
        pressure: Pressure | None
        kv_signal = self.pressure_signal == KV_CACHE
        if self.gpu_source is not None:
            # Sampled whatever the signal: the readings feed the GPU map, energy and defragd.
            try:
                readings = await asyncio.to_thread(self.gpu_source.sample)
                self.last_readings = readings
                now = time.monotonic()
                pressure = pressure_from_readings(readings, running, stats.waiting, now,
                                                  kv_cache_usage=stats.kv_cache_usage if kv_signal else None)
            except (GpuSourceError, SchedulerError) as exc:
                # No reading is not "0 % memory": skip observe so the gate keeps its state, but
                # deadlines below are still enforced. The KV cache is the engine's own reading:
                # a GPU-source hiccup does not hide it.
                log.warning("GPU sample failed: %s", exc)
                self.failed_samples.inc()
                now = time.monotonic()
                pressure = Pressure(stats.kv_cache_usage, tuple(running), stats.waiting, now) if kv_signal else None
        else:
            pressure = Pressure(stats.kv_cache_usage, tuple(running), stats.waiting, now)
        preemptions: list[Preemption] = []
        if pressure is not None:
            self.last_pressure = pressure
            preemptions.extend(self.scheduler.observe(pressure, now))
        preemptions.extend(self.scheduler.expired(running, now))
        for p in preemptions:
            self.preempt(p.stream_key, p.code, p.reason)
        return preemptions

    async def _sample_loop(self) -> None:
        while True:
            try:
                await self.sample_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep sampling: one bad sample must not stop admission control
                log.exception("telemetry sample failed")
            await asyncio.sleep(self.sample_interval_s)
