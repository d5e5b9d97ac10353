"""Wiring gossip and gpu-defragd's nudge into ``zerolayer runtime`` (the server owns nothing of this).

``add_gossip_arguments(parser)`` adds ``--node-name``, ``--kubeconfig`` and
``--advertise-endpoint``; ``await start_node_agent(args, server)`` after ``server.start()``
returns a :class:`NodeAgent` that

- answers SIGUSR1 by releasing memory (:mod:`zerolayer.runtime.defrag.release`), always;
- meters energy and cost per tenant and model on every GPU sample (:mod:`.energy`) and adds
  ``zerolayer_energy_*`` to ``/metrics``, whenever the server has a GPU source;
- with ``--node-name``: publishes the GPU map into that InferenceNode's status and watches
  every InferenceNode, so :meth:`NodeAgent.fleet` gives the map for alternatives
  (:func:`zerolayer.gpumap.alternatives_header`) and the map endpoint
  (:func:`zerolayer.gpumap.render_map_document`).

``await agent.stop()`` before the process exits publishes ``admitting: false`` once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import time
from typing import Any

from zerolayer.gpumap import FleetMap, GpuMapError, GpuMapWatcher

from . import attach_to_server, recording_source
from .energy import EnergyMeter, StreamUse
from .errors import KubeApiError
from .kube import NodeApi
from .publisher import GossipPublisher

log = logging.getLogger(__name__)


def add_gossip_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("GPU-map gossip (Kubernetes)")
    group.add_argument("--node-name", default=os.environ.get("ZEROLAYER_NODE_NAME"),
                       help="InferenceNode whose status this runtime publishes (enables gossip; "
                            "env ZEROLAYER_NODE_NAME)")
    group.add_argument("--kubeconfig", default=None,
                       help="kubeconfig for gossip (default: in-cluster config, then ~/.kube/config)")
    group.add_argument("--advertise-endpoint", default=os.environ.get("ZEROLAYER_ADVERTISE_ENDPOINT"),
                       help="endpoint published in status (default: the URL the server listens on)")


def advertised_endpoint(base_url: str, host: str, port: int) -> str:
    """The URL clients can reach: ``base_url``, unless the server listens on every address.

    Then ``POD_IP`` (the downward API's ``status.podIP``) or this host's address stands in for
    ``0.0.0.0`` / ``::``, which no client can dial.
    """
    if host not in ("0.0.0.0", "::", ""):
        return base_url
    address = os.environ.get("POD_IP")
    if not address:
        try:
            address = socket.gethostbyname(socket.gethostname())
        except OSError:
            address = "127.0.0.1"
    scheme = base_url.split("://", 1)[0]
    return f"{scheme}://[{address}]:{port}" if ":" in address else f"{scheme}://{address}:{port}"


def stream_uses(server: Any) -> list[StreamUse]:
    """The server's open streams as the energy meter sees them (read from the sampling thread:
    ``list()`` of the dict's values is one step under the GIL, and the fields are plain ints)."""
    out = []
    for stream in list(server.app.streams.values()):
        if stream.started and not stream.settled:
            out.append(StreamUse(stream.key, stream.ticket.tenant, stream.ticket.model,
                                 stream.prompt_tokens + stream.output_tokens))
    return out


def _adopt_price(meter: EnergyMeter | None, spec: Any) -> None:
    price = ((spec or {}).get("audit") or {}).get("electricityPricePerKWh")
    if meter is not None and price is not None:
        try:
            meter.price_per_kwh = float(price)
        except (TypeError, ValueError):
            log.warning("spec.audit.electricityPricePerKWh %r is not a number; keeping %s", price,
                        meter.price_per_kwh)


def _both(first: Any, second: Any) -> Any:
    if second is None:
        return first

    def call() -> None:
        first()
        second()
    return call


def attach_energy_meter(server: Any) -> EnergyMeter | None:
    """Meter energy per tenant and model on every GPU sample; add its metrics to ``/metrics``.

    ``None`` without a GPU source. The metrics are appended to the server's existing extra
    metrics (``server.app.render_extra_metrics``), which stays the server's to define.
    """
    from prometheus_client import generate_latest

    recording = recording_source(server)
    if recording is None:
        return None
    meter = EnergyMeter(price_per_kwh=float(os.environ.get("ZEROLAYER_ELECTRICITY_PRICE_PER_KWH", "0.15")))

    def observe() -> None:
        try:
            meter.observe(recording.latest or (), time.monotonic(), stream_uses(server))
        except Exception:  # metering must never break sampling (the scheduler depends on it)
            log.exception("energy metering failed")

    recording.on_sample = _both(observe, recording.on_sample) if recording.on_sample else observe
    previous = server.app.render_extra_metrics
    server.app.render_extra_metrics = lambda: previous() + generate_latest(meter.registry)
    return meter


class NodeAgent:
    """The runtime's gossip publisher, fleet watcher and SIGUSR1 handler; see the module docstring."""

    def __init__(self, *, release: Any = None, publisher: GossipPublisher | None = None,
                 watcher: GpuMapWatcher | None = None, api: NodeApi | None = None,
                 meter: EnergyMeter | None = None) -> None:
        self.meter = meter
        self.release = release
        self.publisher = publisher
        self.watcher = watcher
        self.api = api

    def fleet(self) -> FleetMap | None:
        """The latest fleet map (never blocks); ``None`` without gossip."""
        return self.watcher.snapshot() if self.watcher is not None else None

    async def stop(self) -> None:
        if self.release is not None:
            self.release.remove()
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.stop)
        if self.watcher is not None:
            await asyncio.to_thread(self.watcher.stop)
        if self.api is not None:
            self.api.close()


async def start_node_agent(args: argparse.Namespace, server: Any) -> NodeAgent:
    """Start what ``args`` asks for around a started ``server``.

    Without a usable Kubernetes configuration for ``--node-name`` the server is stopped again and
    :class:`~zerolayer.runtime.errors.ConfigError` is raised (the CLI prints it and exits).
    """
    from zerolayer.runtime.errors import ConfigError
    from zerolayer.runtime.defrag.release import ReleaseOnSignal

    loop = asyncio.get_running_loop()
    release = ReleaseOnSignal(loop, server.engine).install()
    meter = attach_energy_meter(server)
    name = getattr(args, "node_name", None)
    if not name:
        return NodeAgent(release=release, meter=meter)
    kubeconfig = getattr(args, "kubeconfig", None)
    try:
        api = await asyncio.to_thread(NodeApi, kubeconfig=kubeconfig)
    except KubeApiError as exc:
        release.remove()
        await server.stop()
        raise ConfigError(f"--node-name {name}: {exc}") from exc
    recording = recording_source(server)
    metering = recording.on_sample if recording is not None else None  # set by attach_energy_meter
    publisher = attach_to_server(server, name, api, endpoint=getattr(args, "advertise_endpoint", None),
                                 on_spec=lambda spec: _adopt_price(meter, spec))
    if recording is not None:  # attach_to_server wired notify alone: the meter keeps its turn first
        recording.on_sample = _both(metering, publisher.notify) if metering else publisher.notify
    if not publisher.state.endpoint:
        publisher.state.endpoint = advertised_endpoint(server.base_url, server.host, server.port)
    publisher.start()
    try:
        watcher: GpuMapWatcher | None = GpuMapWatcher(kubeconfig=kubeconfig).start()
    except GpuMapError as exc:  # the map is for alternatives only: gossip still works without it
        log.warning("no fleet map (alternatives disabled): %s", exc)
        watcher = None
    log.info("gossip: publishing to InferenceNode %s as %s", name, publisher.state.endpoint)
    return NodeAgent(release=release, publisher=publisher, watcher=watcher, api=api, meter=meter)
