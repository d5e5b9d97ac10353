"""``zerolayer runtime``: serve one node from a standalone YAML config, or in cluster from its InferenceNode."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pathlib
import sys

from zerolayer.runtime.errors import RuntimeServerError


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "runtime",
        help="serve LLM inference over HTTP/2 (and HTTP/1.1) from a standalone config",
        description="Run the zero-layer runtime: HTTP/2 server, micro-scheduler and engine in one process.",
    )
    parser.add_argument("--config", help="standalone YAML config (see examples/standalone.yaml); with --in-cluster, "
                                          "the base the InferenceNode's settings are laid over")
    parser.add_argument("--in-cluster", action="store_true",
                        help="read this node's InferenceNode (--node-name) and serve the tenants of the "
                             "cluster's TenantQuotas with the key hashes the operator publishes, applying changes "
                             "without a restart "
                             "(implied by --node-name without --config)")
    parser.add_argument("--tenant-namespace", default=os.environ.get("POD_NAMESPACE", "zerolayer-system"),
                        help="namespace of the key hashes the operator publishes (Secret zl-tenant-keys; "
                             "default: the pod's)")
    parser.add_argument("--tenant-sync-seconds", type=float, default=10.0,
                        help="how often TenantQuotas and the published key hashes are re-read in cluster "
                             "(default 10; two reads whatever the number of tenants)")
    parser.add_argument("--port", type=int, default=None, help="override listen.port")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve GET /metrics on this port (all interfaces) instead of the serving port, so a "
                             "NetworkPolicy can admit only the scrapers to it (the operator's pods use 9464); "
                             "the serving port then answers /metrics with 404")
    parser.add_argument("--tls-cert", metavar="PEM", help="serve TLS (ALPN h2, http/1.1) with this certificate chain; "
                                                          "overrides tls.cert (needs --tls-key)")
    parser.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert; overrides tls.key")
    parser.add_argument("--reuse-port", action="store_true",
                        help="set SO_REUSEPORT on the serving socket so several runtime processes share the port "
                             "(the kernel spreads connections between them); overrides listen.reuse_port")
    parser.add_argument("--log-level", default="INFO", help="Python logging level (default INFO)")
    from zerolayer.runtime.gossip.hook import add_gossip_arguments

    add_gossip_arguments(parser)  # --node-name etc.: GPU-map gossip (docs/gpu-map.md)
    from zerolayer.bpf.hook import add_audit_arguments

    add_audit_arguments(parser)  # --audit-spool, --audit-journal: token metering (docs/audit.md)
    parser.set_defaults(handler=run)


def with_tls_flags(config, cert: str | None, key: str | None):  # type: ignore[no-untyped-def]
    """``config`` with ``--tls-cert``/``--tls-key`` laid over its ``tls`` section (both or neither)."""
    from zerolayer.runtime.errors import ConfigError

    if bool(cert) != bool(key):
        raise ConfigError("--tls-cert and --tls-key go together")
    if not cert:
        return config
    import dataclasses

    return dataclasses.replace(config, tls_cert=cert, tls_key=key)


async def serve_metrics(server, port: int, host: str = "0.0.0.0"):  # type: ignore[no-untyped-def]
    """A listener that answers ``GET /metrics`` (the server's metrics and its scheduler's) and
    nothing else, on the event loop (no thread reads engine state concurrently). HTTP/1.x, one
    request per connection."""

    def render() -> bytes:
        extra = getattr(server.scheduler, "registry", None)
        return server.metrics.render() + (server.metrics.render_registry(extra) if extra is not None else b"")

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

    return await asyncio.start_server(answer, host, port, limit=16384)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from zerolayer.runtime.compose import compose
    from zerolayer.runtime.config import load_config, load_mapping, parse_config

    reader = None
    inode = None
    base: dict = {}
    node = getattr(args, "node_name", None) or os.environ.get("ZEROLAYER_NODE_NAME")
    try:
        # The operator's pods run `zerolayer runtime --node-name=N ...` with no config file: that is in-cluster mode.
        if args.in_cluster or (not args.config and node):
            from zerolayer.runtime.incluster import KubeReader, config_from_inferencenode

            if not node:
                raise RuntimeServerError("--in-cluster needs --node-name (or ZEROLAYER_NODE_NAME)")
            reader = KubeReader(getattr(args, "kubeconfig", None))
            inode = reader.inference_node(node)
            if inode is None:
                raise RuntimeServerError(f"InferenceNode {node} not found")
            base = load_mapping(args.config) if args.config else {}
            config = parse_config(config_from_inferencenode(inode, base), pathlib.Path.cwd())
        elif args.config:
            config = load_config(args.config)
        else:
            raise RuntimeServerError("give --config FILE, or --in-cluster / --node-name NODE")
        config = with_tls_flags(config, args.tls_cert, args.tls_key)
        runtime = compose(config, args, port=args.port, metrics_on_serving_port=not args.metrics_port,
                          reuse_port=args.reuse_port or None, fleet_quota=reader is not None)
        server = runtime.server
    except RuntimeServerError as exc:
        print(f"zerolayer runtime: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop  # type: ignore[import-not-found]

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run

    async def main() -> None:
        probe, agent = runtime.probe, runtime.agent
        assert probe is not None and agent is not None  # compose() with args builds both
        sync = None
        fleet_quota = None
        if reader is not None:
            from zerolayer.runtime.incluster import TenantSync, attach_fleet_quota

            fleet_quota = attach_fleet_quota(server, reader, node)  # tenants' limits hold across the fleet
            sync = TenantSync(reader, server.replace_tenants, namespace=args.tenant_namespace,
                              interval_s=args.tenant_sync_seconds, registry=server.metrics.registry)
            # Serve with the cluster's tenants from the first request; if they cannot be read yet,
            # start with none (every key refused) rather than exit: a runtime that exits here takes
            # its node out of the fleet at every restart while the API server is unhappy.
            await sync.first_sync()
        await server.start()
        metrics_listener = await serve_metrics(server, args.metrics_port) if args.metrics_port else None
        if sync is not None:
            sync.start()
        if fleet_quota is not None:
            fleet_quota.start()
        spec_sync = None
        if reader is not None and inode is not None:
            from zerolayer.runtime.incluster import NodeSpecSync
            from zerolayer.runtime.scheduler import SchedulerConfig

            def apply_scheduler(marks) -> None:  # type: ignore[no-untyped-def]
                server.scheduler.reconfigure(SchedulerConfig.from_mapping(marks))

            spec_sync = NodeSpecSync(reader, node, base, apply_scheduler, interval_s=args.tenant_sync_seconds)
            spec_sync.prime(inode)
            spec_sync.start()
        await agent.start(server)  # SIGUSR1 release, energy metering; gossip with --node-name
        print(f"zerolayer runtime serving on {server.base_url} (engine: {server.engine.kind}, "
              f"models: {', '.join(server.engine.models)})", flush=True)
        try:
            await server.serve_forever()
        finally:
            if metrics_listener is not None:
                metrics_listener.close()
            if sync is not None:
                await sync.stop()
            if fleet_quota is not None:
                await asyncio.to_thread(fleet_quota.stop)
            if spec_sync is not None:
                await spec_sync.stop()
            await agent.stop()
            probe.close()

    try:
        runner(main())
    except RuntimeServerError as exc:
        print(f"zerolayer runtime: {exc}", file=sys.stderr)
        return 1
    return 0
