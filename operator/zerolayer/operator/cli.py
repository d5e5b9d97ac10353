"""``zerolayer operator``: run the kopf operator."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import socket

from zerolayer.operator.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "operator", help="run the Kubernetes operator (reconciles InferenceNode and TenantQuota)",
        description="Run the kopf operator against the cluster in --kubeconfig, $KUBECONFIG or the pod's "
                    "service account. Settings not given as flags come from the ZEROLAYER_* environment "
                    "variables the Helm chart sets (see docs/operator.md).")
    p.add_argument("--kubeconfig", help="kubeconfig path (default: $KUBECONFIG, ~/.kube/config, in-cluster)")
    p.add_argument("--runtime-namespace", help="namespace of the runtime pods and network policies "
                   "($ZEROLAYER_RUNTIME_NAMESPACE, default zerolayer-system)")
    p.add_argument("--operator-namespace", help="namespace the operator runs in, admitted by the runtime "
                   "network policies ($ZEROLAYER_OPERATOR_NAMESPACE, default: the runtime namespace)")
    p.add_argument("--runtime-image", help="default runtime image ($ZEROLAYER_RUNTIME_IMAGE)")
    p.add_argument("--resync-seconds", type=float,
                   help="period of the one full resync (jittered); drift the watches see is repaired at once "
                        "($ZEROLAYER_RESYNC_SECONDS, default 10800)")
    p.add_argument("--leader-election", action=argparse.BooleanOptionalAction, default=None,
                   help="hold a coordination.k8s.io Lease before acting, so of several replicas one acts "
                        "($ZEROLAYER_LEADER_ELECTION, default on)")
    p.add_argument("--lease-seconds", type=float,
                   help="how long a leader's renewal holds the Lease, i.e. how long a dead leader blocks "
                        "its standby ($ZEROLAYER_LEASE_SECONDS, default 60)")
    p.add_argument("--leader-identity", help="this replica's name in the Lease (default: the host name, "
                                             "which is the pod name in Kubernetes)")
    p.add_argument("--health-port", type=int, default=8080, help="liveness endpoint port, /healthz (0: off)")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0: off)")
    p.add_argument("--selector", metavar="KEY=VALUE", action="append", default=[],
                   help="only handle InferenceNodes and TenantQuotas with this label (repeatable); lets "
                        "several operators or test runs share a cluster")
    p.add_argument("--log-level", choices=["debug", "info", "warning"], default="info")
    p.add_argument("--log-format", choices=["text", "json"], default=os.environ.get("ZEROLAYER_LOG_FORMAT", "text"),
                   help="json: one object per log line (docs/observability.md; env ZEROLAYER_LOG_FORMAT)")
    p.add_argument("--apply-crds", metavar="DIR",
                   help="install or upgrade the zerolayer CRDs from DIR/*.yaml (server-side apply), wait until "
                        "they are served, and exit: the Helm chart's pre-upgrade hook runs this")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    import asyncio

    if args.apply_crds:
        return asyncio.run(_apply_crds(args))
    import kopf  # imported here so `zerolayer --help` stays fast

    from zerolayer.operator.config import OperatorConfig
    from zerolayer.operator.handlers import build_registry
    from zerolayer.operator.metrics import OperatorMetrics

    try:
        config = OperatorConfig.from_env(
            os.environ, runtime_namespace=args.runtime_namespace, operator_namespace=args.operator_namespace,
            runtime_image=args.runtime_image, resync_seconds=args.resync_seconds,
            leader_election=args.leader_election, lease_seconds=args.lease_seconds)
    except ConfigError as exc:
        raise SystemExit(f"zerolayer operator: {exc}") from exc
    selector = {}
    for item in args.selector:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"zerolayer operator: --selector {item!r}: use KEY=VALUE")
        selector[key] = value
    kopf.configure(verbose=args.log_level == "debug", quiet=args.log_level == "warning")
    logging.getLogger().setLevel(args.log_level.upper())
    if args.log_format == "json":
        from zerolayer.logformat import use_json_everywhere

        use_json_everywhere()  # over the handler kopf.configure installed
    if args.log_level != "debug":
        # kopf logs every handler run at INFO ("Handler ... succeeded", each Node heartbeat);
        # our reconciler logs what it actually did. kopf's warnings and errors still show.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    metrics = OperatorMetrics()
    if args.metrics_port:
        try:
            metrics.serve(args.metrics_port)
        except OSError as exc:
            raise SystemExit(f"zerolayer operator: cannot serve metrics on port {args.metrics_port}: {exc}") from exc
    identity = args.leader_identity or socket.gethostname()
    registry = build_registry(config, kubeconfig=args.kubeconfig, metrics=metrics, selector=selector,
                              identity=identity)
    operator = functools.partial(
        kopf.operator,
        registry=registry,
        standalone=True,  # kopf's peering stays off: the Lease decides who acts (operator/leader.py)
        namespaces=[config.runtime_namespace],  # cluster-scoped kinds are served cluster-wide regardless
        liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None,
    )
    if not config.leader_election:
        metrics.leading(True)
        asyncio.run(operator())
        return 0
    return asyncio.run(_lead_then_operate(config, args, identity, metrics, operator))


async def _apply_crds(args: argparse.Namespace) -> int:
    import pathlib

    from zerolayer.operator.crds import apply_crds, load_crds
    from zerolayer.operator.errors import OperatorError
    from zerolayer.operator.kube import Credentials, Kube

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        docs = load_crds(pathlib.Path(args.apply_crds))
        kube = Kube(Credentials.load(args.kubeconfig))
        try:
            names = await apply_crds(kube, docs)
        finally:
            await kube.close()
    except (OperatorError, TimeoutError) as exc:
        raise SystemExit(f"zerolayer operator --apply-crds: {exc}") from exc
    print("applied and established: " + ", ".join(names))
    return 0


async def _lead_then_operate(config, args: argparse.Namespace, identity: str, metrics, operator) -> int:
    """Stand by until this replica holds the Lease, then run kopf while renewing it; stop acting
    the moment the Lease is lost (exit 1: Kubernetes restarts the container as a standby)."""
    import asyncio

    from zerolayer.operator.kube import Credentials, Kube
    from zerolayer.operator.leader import LeaderElector

    log = logging.getLogger("zerolayer.operator")
    kube = Kube(await asyncio.to_thread(Credentials.load, args.kubeconfig), on_request=metrics.on_request)
    elector = LeaderElector(kube, config.operator_namespace, config.lease_name, identity, config.lease_seconds)
    health = _StandbyHealth(args.health_port) if args.health_port else None
    try:
        await elector.acquire()
    finally:
        if health is not None:
            health.close()  # kopf serves /healthz from here on, on the same port
    metrics.leading(True)
    kopf_task = asyncio.create_task(operator(), name="kopf")
    hold_task = asyncio.create_task(elector.hold(), name="lease")
    try:
        done, _ = await asyncio.wait({kopf_task, hold_task}, return_when=asyncio.FIRST_COMPLETED)
        if hold_task in done:
            log.error("leadership lost: stopping every handler now, before a standby can take over")
            metrics.leading(False)
            kopf_task.cancel()
            await asyncio.gather(kopf_task, return_exceptions=True)
            return 1
        hold_task.cancel()
        await asyncio.gather(hold_task, return_exceptions=True)
        metrics.leading(False)
        await elector.release()  # a clean stop (SIGTERM): the standby takes over at its next poll
        kopf_task.result()
        return 0
    finally:
        await kube.close()


class _StandbyHealth:
    """/healthz while standing by (kopf's own endpoint exists only once it runs): a standby is
    alive, so the liveness probe must not restart it."""

    def __init__(self, port: int):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                ok = self.path.split("?")[0] == "/healthz"
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                if ok:
                    self.wfile.write(b'{"standby": true}')

            def log_message(self, *_: object) -> None:
                pass  # probes every few seconds would flood the log

        self._server = http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler)
        threading.Thread(target=self._server.serve_forever, name="standby-health", daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
