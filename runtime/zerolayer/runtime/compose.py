"""The composition root: the one place that builds a runtime and owns its start and stop order.

Everything is wired through constructors, in dependency order, and nothing is set on a built
object afterwards:

1. the engine, the micro-scheduler, the GPU source and TLS from the config;
2. with CLI arguments: the token probe (:func:`zerolayer.bpf.hook.open_token_probe`, whose
   ``emit`` is the token sink) and the node agent (:class:`zerolayer.runtime.node.agent.NodeAgent`,
   which wraps the GPU source to see each sample and provides the energy metrics renderer and,
   with ``--node-name``, the fleet snapshot);
3. the :class:`~zerolayer.runtime.serving.server.RuntimeServer`, given all of the above;
4. in cluster (:func:`from_args` with ``--in-cluster`` or ``--node-name``): tenant sync, the
   fleet-quota claim thread and the InferenceNode spec sync (:mod:`zerolayer.runtime.node.incluster`).

``async with runtime.serving():`` starts the parts in that order and, at exit, drains the server
first, then stops the rest in the order they started. :mod:`zerolayer.runtime.cli` only parses
arguments and calls :func:`from_args`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import pathlib
import sys
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Coroutine, Mapping

from zerolayer.runtime.errors import ConfigError, RuntimeServerError

if TYPE_CHECKING:
    from zerolayer.bpf.probes import TokenProbe
    from zerolayer.runtime.node.agent import NodeAgent
    from zerolayer.runtime.config import RuntimeConfig
    from zerolayer.runtime.node.incluster import KubeReader
    from zerolayer.runtime.serving.server import RuntimeServer
    from zerolayer.runtime.serving.transport import ConnectionAge
    from zerolayer.runtime.serving.tracing import OtlpTracer
    from zerolayer.runtime.apiprocs import ApiProcess
    from zerolayer.runtime.scheduler.api import Scheduler


@dataclasses.dataclass
class InCluster:
    """Where this node's settings come from in cluster: its InferenceNode ``inode`` (named ``node``),
    read through ``reader``, laid over the config mapping ``base``."""

    reader: "KubeReader"
    node: str
    inode: Mapping[str, Any]
    base: Mapping[str, Any]
    tenant_namespace: str = "zerolayer-system"
    sync_interval_s: float = 10.0


@dataclasses.dataclass
class Runtime:
    """A built, not yet started, runtime and the process-level parts around it."""

    server: "RuntimeServer"
    agent: "NodeAgent | None" = None
    probe: "TokenProbe | None" = None
    cluster: InCluster | None = None
    metrics_port: int | None = None  # GET /metrics on a port of its own (serve_metrics)
    metrics_socket: str | None = None  # one of several API processes: GET /metrics on this Unix socket (apiprocs.py)
    claimant: str | None = None  # the name its fleet-quota claims go under; None: the node's
    tracer: "OtlpTracer | None" = None  # telemetry.tracing: flushed and stopped after the server drains

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator["RuntimeServer"]:
        """Start every part, yield the started server, and stop everything on exit.

        Start order: the first tenant sync (in cluster), the server, the metrics listener, tenant
        sync, fleet quotas, the spec sync, the node agent. At exit the server drains first (GOAWAY,
        in-flight streams finish), then the parts stop in the order they started, so gossip still
        reports the drain while it lasts; the token probe closes last.
        """
        server = self.server
        stops: list[Callable[[], Awaitable[None]]] = []
        started = False
        try:
            tenants = self._tenant_sync()
            if tenants is not None:
                # Serve with the cluster's tenants from the first request; if they cannot be read yet,
                # start with none (every key refused, /readyz 503 until a read succeeds) rather than exit:
                # a runtime that exits here takes its node out of the fleet at every restart while the
                # API server is unhappy.
                await tenants.first_sync()
            await server.start()
            started = True
            if self.metrics_port:
                listener = await serve_metrics(server, self.metrics_port)
                stops.append(lambda: _close_listener(listener))
            if self.metrics_socket:
                unix = await asyncio.start_unix_server(metrics_answer(server.app.render_metrics), self.metrics_socket)
                stops.append(lambda: _close_listener(unix))
            if tenants is not None:
                tenants.start()
                stops.append(tenants.stop)
            stops.extend(self._start_cluster_syncs())
            if self.agent is not None:
                await self.agent.start(server)  # SIGUSR1 release, energy metering; gossip with --node-name
                stops.append(self.agent.stop)
            yield server
        finally:
            if started:
                await server.stop()
            for stop in stops:
                await stop()
            if self.tracer is not None:
                await asyncio.to_thread(self.tracer.close)
            if self.probe is not None:
                self.probe.close()

    def _tenant_sync(self) -> Any:
        if self.cluster is None:
            return None
        from zerolayer.runtime.node.incluster import TenantSync

        return TenantSync(self.cluster.reader, self.server.replace_tenants, namespace=self.cluster.tenant_namespace,
                          interval_s=self.cluster.sync_interval_s, registry=self.server.metrics.registry)

    def _start_cluster_syncs(self) -> list[Callable[[], Awaitable[None]]]:
        """Start fleet quotas (tenants' limits hold across the fleet) and the InferenceNode spec sync
        (scheduler marks and LoRA adapters without a restart); their stops, in that order."""
        cluster = self.cluster
        if cluster is None:
            return []
        from zerolayer.runtime.node.incluster import NodeSpecSync, attach_fleet_quota, sync_adapters
        from zerolayer.runtime.scheduler import SchedulerConfig

        server = self.server
        fleet_quota = attach_fleet_quota(server, cluster.reader, self.claimant or cluster.node)
        fleet_quota.start()

        def apply_scheduler(marks: Mapping[str, Any]) -> None:
            server.scheduler.reconfigure(SchedulerConfig.from_mapping(marks))  # type: ignore[attr-defined]

        spec_sync = NodeSpecSync(cluster.reader, cluster.node, cluster.base, apply_scheduler,
                                 interval_s=cluster.sync_interval_s,
                                 load_adapters=lambda wanted: sync_adapters(server.engine, wanted))
        spec_sync.prime(cluster.inode)
        spec_sync.start()
        return [lambda: asyncio.to_thread(fleet_quota.stop), spec_sync.stop]


async def _close_listener(listener: asyncio.AbstractServer) -> None:
    listener.close()


def compose(config: "RuntimeConfig", args: argparse.Namespace | None = None, *, port: int | None = None,
            metrics_on_serving_port: bool = True, reuse_port: bool | None = None,
            fleet_quota: bool = False, tenants_from_cluster: bool = False, api: "ApiProcess | None" = None) -> Runtime:
    """Build the runtime ``config`` describes. With ``args`` (the ``zerolayer runtime`` flags) also the
    token probe and the node agent, wired into the server. ``port``/``reuse_port`` override the config.
    ``tenants_from_cluster``: the tenants are read from the cluster, so ``/readyz`` waits for the first read.
    ``api``: this is API process *i* of N (:mod:`zerolayer.runtime.apiprocs`): the port is shared, the
    quota ledger is the node's board, a vLLM engine is a client of the shared engine core, and only
    process 0 gossips the node's map."""
    from zerolayer.runtime.config import build_engine, build_gpu_source
    from zerolayer.runtime.serving.server import RuntimeServer, tls_context
    from zerolayer.runtime.tenants import TenantDirectory

    scheduler = build_scheduler(config, fleet_quota, api)
    engine = build_engine(config, **(api.engine_wiring() if api is not None else {}))
    if api is not None:
        reuse_port = True
    handoff = api.handoff() if api is not None else None  # exact balance: the parent hands connections over
    ssl_context = tls_context(config.tls_cert, config.tls_key) if config.tls_cert and config.tls_key else None
    gpu_source = build_gpu_source(config, engine)
    wiring: dict[str, Any] = {}
    tracer = None
    if config.tracing is not None:  # off by default: sessions then keep no timeline at all
        tracer = wiring["tracer"] = build_tracer(config.tracing)
    agent = probe = None
    if args is not None:
        from zerolayer.bpf.hook import open_token_probe
        from zerolayer.runtime.node.agent import NodeAgent

        probe = open_token_probe(args)  # USDT token events (+ counters, journal with --audit-spool)
        agent = NodeAgent.from_args(api.agent_args(args) if api is not None else args, gpu_source,
                                    api.prefix_share() if api is not None else None,
                                    api_processes=config.api_processes)  # gossiped as status.apiProcesses
        gpu_source = agent.gpu_source or gpu_source
        wiring.update(token_sink=probe.emit, extra_metrics=agent.extra_metrics())
        if agent.node_name:  # alternatives on pressure refusals, GET /v1/zerolayer/map
            wiring.update(fleet=agent.fleet, self_name=agent.node_name)
    wiring["extra_metrics"] = [*wiring.get("extra_metrics", ()), prefix_digest_metrics(engine)]
    server = RuntimeServer(
        engine=engine,
        scheduler=scheduler,
        tenants=TenantDirectory(config.tenants, known=not tenants_from_cluster),
        gpu_source=gpu_source,
        limits=config.limits,
        host=config.host,
        port=config.port if port is None else port,
        ssl_context=ssl_context,
        sample_interval_s=config.sample_interval_s,
        required_headers=config.required_headers,
        metrics_on_serving_port=metrics_on_serving_port,
        reuse_port=config.reuse_port if reuse_port is None else reuse_port,
        handoff=handoff,
        server_core=config.server_core,
        connection_age=build_connection_age(config),
        **wiring,
    )
    return Runtime(server, agent, probe, tracer=tracer)


def build_connection_age(config: "RuntimeConfig") -> "ConnectionAge | None":
    """``server.max_connection_age_s`` with its grace: ``server.max_connection_age_grace_s``, else
    ``limits.drain_timeout_s`` (what a stream may take to finish when its connection is asked to go on
    SIGTERM); None when the age is unset."""
    from zerolayer.runtime.serving.transport import ConnectionAge

    if config.max_connection_age_s is None:
        return None
    grace = config.max_connection_age_grace_s
    return ConnectionAge(config.max_connection_age_s, config.limits.drain_timeout_s if grace is None else grace)


def prefix_digest_metrics(engine: Any) -> Callable[[], bytes]:
    """``/metrics``' prefix-digest series (``zerolayer_prefix_digest_blocks``, ``zerolayer_kv_events_*``)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from zerolayer.runtime.gossip.metrics import PrefixDigestCollector

    registry = CollectorRegistry()
    registry.register(PrefixDigestCollector(engine))
    return lambda: generate_latest(registry)


def build_scheduler(config: "RuntimeConfig", fleet_quota: bool, api: "ApiProcess | None") -> "Scheduler":
    """The micro-scheduler (with the node's quota board as its ledger for one of several API processes),
    wrapped in the fleet-quota check in cluster (runtime/node/incluster.py attach_fleet_quota)."""
    from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig, SchedulerError

    try:
        scheduler_config = SchedulerConfig.from_mapping(config.scheduler)
    except SchedulerError as exc:
        raise ConfigError(f"scheduler: {exc}") from exc
    micro = MicroScheduler(scheduler_config, ledger=api.ledger(scheduler_config) if api is not None else None,
                           running=api.running() if api is not None else None)
    if not fleet_quota:
        return micro
    from zerolayer.runtime.scheduler.fleet import FleetQuotaScheduler

    return FleetQuotaScheduler(micro, window_s=micro.config.quota_window_s)


def build_tracer(settings: Any) -> "OtlpTracer":
    """The OTLP span exporter ``telemetry.tracing`` asks for; a clear error without the ``tracing`` extra."""
    from zerolayer.runtime.serving.tracing import OtlpTracer

    try:
        return OtlpTracer(settings.otlp_endpoint, settings.service_name)
    except ImportError as exc:
        raise ConfigError("telemetry.tracing needs OpenTelemetry: pip install 'zerolayer[tracing]' "
                          f"({exc})") from exc


def from_args(args: argparse.Namespace, api: "ApiProcess | None" = None,
              settings: tuple["RuntimeConfig", InCluster | None] | None = None) -> Runtime:
    """The runtime the ``zerolayer runtime`` flags describe (``settings``, else :func:`settings_from_args`);
    ``api``: as API process *i* of N. Raises :class:`~zerolayer.runtime.errors.RuntimeServerError`."""
    config, cluster = settings if settings is not None else settings_from_args(args)
    runtime = compose(config, args, port=args.port, metrics_on_serving_port=not args.metrics_port,
                      reuse_port=args.reuse_port or None, fleet_quota=cluster is not None,
                      tenants_from_cluster=cluster is not None, api=api)
    runtime.cluster = cluster
    if api is None:
        runtime.metrics_port = args.metrics_port
    else:  # the parent answers the metrics port with every process's series (apiprocs.py)
        runtime.metrics_socket = api.metrics_socket
        runtime.claimant = api.claimant(cluster.node) if cluster is not None else None
    return runtime


def settings_from_args(args: argparse.Namespace) -> tuple["RuntimeConfig", InCluster | None]:
    """The config the flags describe: from ``--config``, or in cluster from this node's InferenceNode
    (``--in-cluster``, or ``--node-name`` without ``--config``) laid over it; ``--tls-*`` and
    ``--api-processes`` laid over that."""
    from zerolayer.runtime.config import load_config, load_mapping, parse_config

    node = getattr(args, "node_name", None) or os.environ.get("ZEROLAYER_NODE_NAME")
    cluster = None
    # The operator's pods run `zerolayer runtime --node-name=N ...` with no config file: that is in-cluster mode.
    if args.in_cluster or (not args.config and node):
        from zerolayer.runtime.node.incluster import KubeReader, config_from_inferencenode

        if not node:
            raise RuntimeServerError("--in-cluster needs --node-name (or ZEROLAYER_NODE_NAME)")
        reader = KubeReader(getattr(args, "kubeconfig", None))
        inode = reader.inference_node(node)
        if inode is None:
            raise RuntimeServerError(f"InferenceNode {node} not found")
        base = load_mapping(args.config) if args.config else {}
        config = parse_config(config_from_inferencenode(inode, base), pathlib.Path.cwd())
        cluster = InCluster(reader, node, inode, base, tenant_namespace=args.tenant_namespace,
                            sync_interval_s=args.tenant_sync_seconds)
    elif args.config:
        config = load_config(args.config)
    else:
        raise RuntimeServerError("give --config FILE, or --in-cluster / --node-name NODE")
    config = with_tls_flags(config, args.tls_cert, args.tls_key)
    count = getattr(args, "api_processes", None)
    if count is not None and count != config.api_processes:
        from zerolayer.runtime.config import parse_api_processes

        parse_api_processes({"api_processes": count})
        config = dataclasses.replace(config, api_processes=count)
    return config, cluster


def with_tls_flags(config: "RuntimeConfig", cert: str | None, key: str | None) -> "RuntimeConfig":
    """``config`` with ``--tls-cert``/``--tls-key`` laid over its ``tls`` section (both or neither)."""
    if bool(cert) != bool(key):
        raise ConfigError("--tls-cert and --tls-key go together")
    if not cert:
        return config
    return dataclasses.replace(config, tls_cert=cert, tls_key=key)


async def serve_metrics(server: "RuntimeServer", port: int, host: str = "0.0.0.0") -> asyncio.AbstractServer:
    """A listener that answers ``GET /metrics`` (the server's metrics and its scheduler's) and
    nothing else, on the event loop (no thread reads engine state concurrently). HTTP/1.x, one
    request per connection."""

    # the same series as /metrics on the serving port: scheduler, gossip, energy too
    return await asyncio.start_server(metrics_answer(server.app.render_metrics), host, port, limit=16384)


def metrics_answer(render: Callable[[], bytes]) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                                            Awaitable[None]]:
    """A connection handler that answers ``GET /metrics`` with ``render()`` and anything else with 404."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            method, path = (head.split(b"\r\n", 1)[0].split(b" ") + [b"", b""])[:2]
            if method == b"GET" and path.split(b"?")[0] == b"/metrics":
                body, status, kind = render(), b"200 OK", b"text/plain; version=0.0.4; charset=utf-8"
            else:
                body, status, kind = b"not found\n", b"404 Not Found", b"text/plain"
            writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: " + kind + b"\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    return answer


def build_server(config: "RuntimeConfig", *, port: int | None = None,
                 metrics_on_serving_port: bool = True) -> "RuntimeServer":
    """The server alone (no probe, no node agent): tests and embedders."""
    return compose(config, port=port, metrics_on_serving_port=metrics_on_serving_port).server


def serve(runtime: Runtime, label: str = "") -> int:
    """Serve a built runtime until SIGTERM/SIGINT; the exit status (``label`` prefixes the start line)."""
    runner: Callable[[Coroutine[Any, Any, None]], None]
    try:
        import uvloop  # type: ignore[import-not-found]

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run

    async def main() -> None:
        async with runtime.serving() as server:
            print(f"{label}zerolayer runtime serving on {server.base_url} (engine: {server.engine.kind}, "
                  f"models: {', '.join(server.engine.models)})", flush=True)
            await server.serve_forever()

    try:
        runner(main())
    except RuntimeServerError as exc:
        print(f"zerolayer runtime: {exc}", file=sys.stderr)
        return 1
    return 0
