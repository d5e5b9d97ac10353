"""Every query the chart's dashboard and PrometheusRule make, with the labels its legend or alert text
names: what the observability proofs evaluate against a real Prometheus. The runtime's and auditor's
queries are proved in tests/integration/runtime/test_observability_vllm.py, the operator's (they read
``zerolayer_operator_*``) in tests/e2e/test_operator_scrape.py, where a real operator runs."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

ALERT_SHAPE = re.compile(r"^(?P<series>.+?)\s*(==|!=|>=|<=|>|<)\s*[0-9.]+$")
OPERATOR_SERIES = re.compile(r"\bzerolayer(_|:)operator_")


@dataclasses.dataclass(frozen=True)
class Query:
    what: str  # "panel 'KV cache use'", "rule zerolayer:scheduler_shedding"
    expr: str
    labels: frozenset[str]  # every series it returns must carry these

    @property
    def operator(self) -> bool:
        """Whether it reads the operator's series (directly or through a recorded one)."""
        return bool(OPERATOR_SERIES.search(self.expr))


def queries(chart: dict[str, Any]) -> list[Query]:
    """The panels' queries (``$__rate_interval`` at its floor, 1m), then each recorded signal and the series
    side of each alert (every alert is ``<series> <op> <number>``)."""
    out = []
    for panel in json.loads(chart["Dashboard"]["data"]["zerolayer.json"])["panels"]:
        for target in panel["targets"]:
            out.append(Query(f"panel {panel['title']!r}", target["expr"].replace("$__rate_interval", "1m"),
                             frozenset(re.findall(r"\{\{\s*(\w+)\s*\}\}", target["legendFormat"]))))
    for rule in (r for g in chart["PrometheusRule"]["spec"]["groups"] for r in g["rules"]):
        if "record" in rule:
            out.append(Query(f"rule {rule['record']}", rule["record"], frozenset()))
            continue
        shape = ALERT_SHAPE.match(rule["expr"])
        assert shape, rule["expr"]
        out.append(Query(f"rule {rule['alert']}", shape["series"],
                         frozenset(re.findall(r"\$labels\.(\w+)", json.dumps(rule["annotations"])))))
    return out
