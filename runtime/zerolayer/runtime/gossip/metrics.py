"""Gossip as Prometheus series, read from a publisher at scrape time (nothing on the gossip thread).

- ``zerolayer_gossip_patches_total{result="ok"|"failed"}``: status patches tried;
- ``zerolayer_gossip_last_heartbeat_timestamp_seconds``: the ``lastHeartbeat`` of the last status
  that reached the API server (Unix seconds, as published);
- ``zerolayer_gossip_heartbeat_seconds``: the heartbeat period in force, so an alert can say
  "three periods without a heartbeat" whatever the InferenceNode's ``gossip.heartbeatSeconds``.

A node that stops gossiping keeps the last timestamp; ``time() - that`` grows and the chart's
``ZerolayerNodeNotGossiping`` alert fires. A node that is gone (no scrape) is ``up == 0``.

What this process puts into the node's prefix-cache digest (``status.prefixCache``), with or without
gossip (:class:`PrefixDigestCollector`), per engine (``model_name``: its base model):

- ``zerolayer_prefix_digest_blocks``: byte blocks its record holds now (``len(record)``; with
  ``prefix_digest: kv_events`` only those the engine's KV cache events say it holds). With several
  API processes each process's record holds the chats it rendered; the node's digest is their union;
- ``zerolayer_kv_events_batches_total`` / ``zerolayer_kv_events_missed_total`` (``kv_events`` only):
  vLLM event batches applied (replayed ones included), and batches known missed and not replayed.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Iterable

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


class PrefixDigestCollector(Collector):
    """The prefix-digest series above for the engines of ``engine`` (one engine, or one with ``engines``)."""

    def __init__(self, engine: Any) -> None:
        from zerolayer.runtime.engine.router import each_engine

        self._engines = each_engine(engine)

    def collect(self) -> Iterable[Metric]:
        blocks = GaugeMetricFamily("zerolayer_prefix_digest_blocks", "Byte blocks (256 B) this process's prefix "
                                   "record puts into the node's prefix-cache digest now.", labels=["model_name"])
        batches = CounterMetricFamily("zerolayer_kv_events_batches", "vLLM KV cache event batches applied to the "
                                      "prefix record (prefix_digest: kv_events), replayed ones included.",
                                      labels=["model_name"])
        missed = CounterMetricFamily("zerolayer_kv_events_missed", "vLLM KV cache event batches known missed and "
                                     "not recovered by replay.", labels=["model_name"])
        for engine in self._engines:
            record = getattr(engine, "served_prefixes", None)
            if record is None:
                continue
            model = engine.models[0]
            blocks.add_metric([model], float(len(record)))
            feed = getattr(engine, "kv_event_feed", None)
            if feed is not None:
                batches.add_metric([model], float(feed.batches))
                missed.add_metric([model], float(feed.gaps))
        yield blocks
        if batches.samples:
            yield batches
            yield missed
