"""``zerolayer runtime``: serve one node from a standalone YAML config, or in cluster from its InferenceNode.

This module parses the flags; :mod:`zerolayer.runtime.compose` builds and orders everything."""

from __future__ import annotations

import argparse
import os
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
    parser.add_argument("--api-processes", type=int, default=None, metavar="N",
                        help="serve the port from N API processes sharing one engine core and one admission view "
                             "(docs/api-processes.md); overrides server.api_processes (default 1)")
    parser.add_argument("--log-level", default="INFO", help="Python logging level (default INFO)")
    parser.add_argument("--log-format", choices=("text", "json"), default=os.environ.get("ZEROLAYER_LOG_FORMAT", "text"),
                        help="json: one object per line with the request's tenant, request id and trace id "
                             "(docs/observability.md; env ZEROLAYER_LOG_FORMAT)")
    from zerolayer.runtime.node.agent import add_gossip_arguments

    add_gossip_arguments(parser)  # --node-name etc.: GPU-map gossip (docs/gpu-map.md)
    from zerolayer.bpf.hook import add_audit_arguments

    add_audit_arguments(parser)  # --audit-spool, --audit-journal: token metering (docs/audit.md)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Build the runtime (:func:`zerolayer.runtime.compose.from_args`) and serve until SIGTERM/SIGINT; with
    ``server.api_processes`` > 1, supervise that many API processes (:mod:`zerolayer.runtime.apiprocs`)."""
    from zerolayer import logformat

    logformat.configure(args.log_level, args.log_format)
    from zerolayer.runtime.compose import from_args, serve, settings_from_args

    try:
        settings = settings_from_args(args)
        config = settings[0]
        if config.api_processes > 1:
            from zerolayer.runtime.apiprocs import supervise
            from zerolayer.runtime.config import build_engine

            return supervise(args, config.api_processes, lambda: build_engine(config), (config.host, config.port),
                             config.connection_balance)
        runtime = from_args(args, settings=settings)
    except RuntimeServerError as exc:
        print(f"zerolayer runtime: {exc}", file=sys.stderr)
        return 2
    return serve(runtime)
