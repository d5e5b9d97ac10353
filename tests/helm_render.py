"""The chart rendered by the real Helm the local control plane's toolchain builds (scripts/setup.sh step 4)."""

from __future__ import annotations

import pathlib
import subprocess
from typing import Any

import yaml

CHART = pathlib.Path(__file__).resolve().parents[1] / "helm" / "zerolayer"
MONITORING = ("metrics.podMonitor=true", "metrics.prometheusRule=true", "metrics.grafanaDashboard=true")


def helm_binary() -> pathlib.Path | None:
    from zerolayer.cluster.build import toolchain_dir

    helm = toolchain_dir() / "helm"
    return helm if helm.exists() else None


def render(*sets: str, release: str = "zl", namespace: str = "zl-system") -> list[dict[str, Any]]:
    """``helm template`` with ``--set`` for each of ``sets``; the objects, in order."""
    helm = helm_binary()
    assert helm is not None, "no Helm: run scripts/setup.sh (it builds the control plane's toolchain)"
    args = [str(helm), "template", release, str(CHART), "-n", namespace, "--kube-version", "1.35.0"]
    for value in sets:
        args += ["--set", value]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def monitoring_objects(*sets: str, **kw: str) -> dict[str, dict[str, Any]]:
    """The PodMonitor, PrometheusRule and dashboard ConfigMap of a render with all three on, by kind."""
    objects = render(*MONITORING, *sets, **kw)
    found = {o["kind"]: o for o in objects if o["kind"] in ("PodMonitor", "PrometheusRule")}
    found.update({"Dashboard": o for o in objects if o["kind"] == "ConfigMap"
                  and o["metadata"].get("labels", {}).get("grafana_dashboard") == "1"})
    return found
