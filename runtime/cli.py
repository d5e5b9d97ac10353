"""``zerolayer runtime``: serve one node from a standalone YAML config."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from zerolayer.runtime.errors import RuntimeServerError


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "runtime",
        help="serve LLM inference over HTTP/2 (and HTTP/1.1) from a standalone config",
        description="Run the zero-layer runtime: HTTP/2 server, micro-scheduler and engine in one process.",
    )
    parser.add_argument("--config", required=True, help="standalone YAML config (see examples/standalone.yaml)")
    parser.add_argument("--port", type=int, default=None, help="override listen.port")
    parser.add_argument("--log-level", default="INFO", help="Python logging level (default INFO)")
    from zerolayer.runtime.gossip.hook import add_gossip_arguments

    add_gossip_arguments(parser)  # --node-name etc.: GPU-map gossip (docs/gpu-map.md)
    from zerolayer.bpf.hook import add_audit_arguments

    add_audit_arguments(parser)  # --audit-spool, --audit-journal: token metering (docs/audit.md)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from zerolayer.runtime.config import build_server, load_config

    try:
        config = load_config(args.config)
        server = build_server(config, port=args.port)
    except RuntimeServerError as exc:
        print(f"zerolayer runtime: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop  # type: ignore[import-not-found]

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run

    async def main() -> None:
        from zerolayer.runtime.gossip.hook import start_node_agent

        from zerolayer.bpf.hook import attach_token_probe

        probe = attach_token_probe(args, server)  # USDT token events (+ counters, journal with --audit-spool)
        await server.start()
        agent = await start_node_agent(args, server)  # SIGUSR1 release; gossip with --node-name
        print(f"zerolayer runtime serving on {server.base_url} (engine: {server.engine.kind}, "
              f"models: {', '.join(server.engine.models)})", flush=True)
        try:
            await server.serve_forever()
        finally:
            await agent.stop()
            probe.close()

    try:
        runner(main())
    except RuntimeServerError as exc:
        print(f"zerolayer runtime: {exc}", file=sys.stderr)
        return 1
    return 0
