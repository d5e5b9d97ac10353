"""``zerolayer operator``: run the kopf operator."""

from __future__ import annotations

import argparse
import logging
import os

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
                   help="drift repair interval: how long a deleted child or label may stay missing "
                        "($ZEROLAYER_RESYNC_SECONDS, default 30)")
    p.add_argument("--health-port", type=int, default=8080, help="liveness endpoint port, /healthz (0: off)")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0: off)")
    p.add_argument("--selector", metavar="KEY=VALUE", action="append", default=[],
                   help="only handle InferenceNodes and TenantQuotas with this label (repeatable); lets "
                        "several operators or test runs share a cluster")
    p.add_argument("--log-level", choices=["debug", "info", "warning"], default="info")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    import kopf  # imported here so `zerolayer --help` stays fast

    from zerolayer.operator.config import OperatorConfig
    from zerolayer.operator.handlers import build_registry
    from zerolayer.operator.metrics import OperatorMetrics

    try:
        config = OperatorConfig.from_env(
            os.environ, runtime_namespace=args.runtime_namespace, operator_namespace=args.operator_namespace,
            runtime_image=args.runtime_image, resync_seconds=args.resync_seconds)
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
    registry = build_registry(config, kubeconfig=args.kubeconfig, metrics=metrics, selector=selector)
    kopf.run(
        registry=registry,
        standalone=True,  # one active replica (the chart's Deployment uses Recreate); no peering CRD needed
        namespaces=[config.runtime_namespace],  # cluster-scoped kinds are served cluster-wide regardless
        liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None,
    )
    return 0
