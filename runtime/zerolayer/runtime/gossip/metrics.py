"""Gossip as Prometheus series, read from a publisher at scrape time (nothing on the gossip thread).

- ``zerolayer_gossip_patches_total{result="ok"|"failed"}``: status patches tried;
- ``zerolayer_gossip_last_heartbeat_timestamp_seconds``: the ``lastHeartbeat`` of the last status
  that reached the API server (Unix seconds, as published);
- ``zerolayer_gossip_heartbeat_seconds``: the heartbeat period in force, so an alert can say
  "three periods without a heartbeat" whatever the InferenceNode's ``gossip.heartbeatSeconds``.

A node that stops gossiping keeps the last timestamp; ``time() - that`` grows and the chart's
``ZerolayerNodeNotGossiping`` alert fires. A node that is gone (no scrape) is ``up == 0``.
"""

from __future__ import annotations

import datetime
from typing import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .publisher import GossipPublisher


def heartbeat_seconds(stamp: str) -> float:
    """An RFC 3339 ``lastHeartbeat`` (``2026-12-02T11:50:00.123Z``) as Unix seconds."""
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


class GossipCollector(Collector):
    """The series above for ``publisher()`` (None before gossip starts, and without ``--node-name``:
    then nothing is exported, so no alert reads a node that never gossips as a stale one)."""

    def __init__(self, publisher: Callable[[], GossipPublisher | None]) -> None:
        self._publisher = publisher

    def collect(self) -> Iterable[Metric]:
        publisher = self._publisher()
        if publisher is None:
            return
        patches = CounterMetricFamily("zerolayer_gossip_patches", "InferenceNode status patches tried, by result.",
                                      labels=["result"])
        patches.add_metric(["ok"], float(publisher.patches))
        patches.add_metric(["failed"], float(publisher.failures))
        yield patches
        yield GaugeMetricFamily("zerolayer_gossip_heartbeat_seconds", "The gossip heartbeat period in force.",
                                value=float(publisher.state.settings.heartbeat_s))
        status = publisher.state.last_status
        if status is not None and status.get("lastHeartbeat"):
            yield GaugeMetricFamily("zerolayer_gossip_last_heartbeat_timestamp_seconds",
                                    "lastHeartbeat of the last status the API server accepted (Unix seconds).",
                                    value=heartbeat_seconds(status["lastHeartbeat"]))
