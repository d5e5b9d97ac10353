"""The node agent around ``zerolayer runtime``: gossip, energy metering and gpu-defragd's nudge.

``add_gossip_arguments(parser)`` adds ``--node-name``, ``--kubeconfig`` and
``--advertise-endpoint``. The composition root (:mod:`zerolayer.runtime.compose`) builds a
:class:`NodeAgent` *before* the server and hands the server what the agent provides, through
its constructor: the GPU source (wrapped so the agent sees every sample), the energy metrics
renderer and the fleet snapshot. After ``server.start()``, ``await agent.start(server)``
(``server`` as a :class:`ServedNode`: what the agent reads of it, nothing more)

- answers SIGUSR1 by releasing memory (:mod:`zerolayer.runtime.defrag.release`), always;
- meters energy and cost per tenant and model on every GPU sample (:mod:`.energy`), whenever
  the server has a GPU source (``zerolayer_energy_*`` on ``/metrics``);
- with ``--node-name``: publishes the GPU map into that InferenceNode's status and watches
  every InferenceNode, so :meth:`NodeAgent.fleet` gives the map for alternatives
  (:func:`zerolayer.gpumap.alternatives_header`) and the map endpoint
  (:func:`zerolayer.gpumap.render_map_document`).

The agent reads the server (engine load, draining, open sessions) and never sets anything on it.
``await agent.stop()`` before the process exits publishes ``admitting: false`` once.

It lives above both node adapters it joins (:mod:`zerolayer.runtime.gossip` and
:mod:`zerolayer.runtime.defrag`), so neither imports the other's way up.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import time
from typing import Any, Callable, Protocol

from zerolayer.gpumap import FleetMap, GpuMapError, GpuMapWatcher
from zerolayer.runtime.gossip import RecordingSource, build_publisher
from zerolayer.runtime.gossip.energy import EnergyMeter, StreamUse
from zerolayer.runtime.gossip.errors import KubeApiError
from zerolayer.runtime.gossip.kube import NodeApi
from zerolayer.runtime.gossip.publisher import GossipPublisher
from zerolayer.runtime.gpu.api import GpuSource

log = logging.getLogger(__name__)

MAP_IDLE_S = 300.0  # close the fleet-map watch after this long unused (zerolayer.gpumap.GpuMapWatcher)
PREFIX_SHARE_S = 1.0  # how often an API process other than 0 publishes its prefix records to process 0


class ServedNode(Protocol):
    """What the agent reads of the started server (:class:`zerolayer.runtime.serving.server.RuntimeServer`)."""

    engine: Any  # stats(), models, what SIGUSR1 releases memory of
    draining: bool
    sample_interval_s: float
    host: str
    port: int
    app: Any  # app.sessions.streams: the open streams the energy meter splits power between; app.demand

    @property
    def base_url(self) -> str: ...

    async def stop(self, drain_timeout_s: float | None = None) -> None: ...


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


def stream_uses(server: ServedNode) -> list[StreamUse]:
    """The server's open streams as the energy meter sees them (read from the sampling thread:
    ``list()`` of the dict's values is one step under the GIL, and the fields are plain ints). A request
    not streamed counts the tokens its engine has made so far (its completion comes whole at the end)."""
    out = []
    for stream in list(server.app.sessions.streams.values()):
        if stream.started and not stream.settled:
            out.append(StreamUse(stream.key, stream.ticket.tenant, stream.ticket.model,
                                 stream.prompt_tokens + stream.output_so_far()))
    return out


def _adopt_price(meter: EnergyMeter | None, spec: Any) -> None:
    price = ((spec or {}).get("audit") or {}).get("electricityPricePerKWh")
    if meter is not None and price is not None:
        try:
            meter.price_per_kwh = float(price)
        except (TypeError, ValueError):
            log.warning("spec.audit.electricityPricePerKWh %r is not a number; keeping %s", price,
                        meter.price_per_kwh)


class NodeAgent:
    """The runtime's GPU-sample listener, energy meter, gossip publisher, fleet watcher and SIGUSR1
    handler; see the module docstring. Build it before the server, start it after."""

    def __init__(self, *, gpu_source: GpuSource | None = None, node_name: str | None = None,
                 kubeconfig: str | None = None, advertise_endpoint: str | None = None, api_processes: int = 1,
                 price_per_kwh: float = 0.15, gossip: bool = True, prefix_share: Any = None) -> None:
        self.node_name = node_name
        self.gossip = gossip  # False: another API process of the node (process 0 gossips); it reads the map
        # With several API processes (gossip/prefix_board.PrefixShare): process 0 gossips the others'
        # prefix records with its own; the others publish theirs to it.
        self.prefix_share = prefix_share
        self._sharing: asyncio.Task[None] | None = None
        self.kubeconfig = kubeconfig
        self.advertise_endpoint = advertise_endpoint
        self.api_processes = api_processes  # the node's, published as status.apiProcesses by process 0
        # The server samples through this wrapper: the agent sees each sample in the sampling thread.
        self.gpu_source: RecordingSource | None = RecordingSource(gpu_source) if gpu_source is not None else None
        self.meter: EnergyMeter | None = EnergyMeter(price_per_kwh=price_per_kwh) if gpu_source is not None else None
        self.release: Any = None
        self.publisher: GossipPublisher | None = None
        self.watcher: GpuMapWatcher | None = None
        self.api: NodeApi | None = None
        self._server: ServedNode | None = None
        if self.gpu_source is not None:
            self.gpu_source.on_sample = self._on_sample

    @classmethod
    def from_args(cls, args: argparse.Namespace, gpu_source: GpuSource | None,
                  prefix_share: Any = None, *, api_processes: int = 1) -> "NodeAgent":
        """``api_processes``: how many API processes serve the node (``server.api_processes``)."""
        return cls(gpu_source=gpu_source, node_name=getattr(args, "node_name", None) or None, prefix_share=prefix_share,
                   kubeconfig=getattr(args, "kubeconfig", None),
                   advertise_endpoint=getattr(args, "advertise_endpoint", None),
                   price_per_kwh=float(os.environ.get("ZEROLAYER_ELECTRICITY_PRICE_PER_KWH", "0.15")),
                   gossip=getattr(args, "gossip", True), api_processes=api_processes)

    def extra_metrics(self) -> list[Callable[[], bytes]]:
        """Renderers for the server's ``/metrics``: gossip's (``zerolayer_gossip_*``, once it runs) and the
        energy meter's, when there is one."""
        from prometheus_client import CollectorRegistry, generate_latest

        from zerolayer.runtime.gossip.metrics import GossipCollector

        gossip = CollectorRegistry()
        gossip.register(GossipCollector(lambda: self.publisher))
        renderers: list[Callable[[], bytes]] = [lambda: generate_latest(gossip)]
        meter = self.meter
        if meter is not None:
            renderers.append(lambda: generate_latest(meter.registry))
        return renderers

    def fleet(self) -> FleetMap | None:
        """The latest fleet map (never blocks); ``None`` without gossip."""
        return self.watcher.snapshot() if self.watcher is not None else None

    def _on_sample(self) -> None:
        """After each good GPU sample, in the sampling thread: meter first, then wake the publisher."""
        server, meter = self._server, self.meter
        if meter is not None and server is not None and self.gpu_source is not None:
            try:
                meter.observe(self.gpu_source.latest or (), time.monotonic(), stream_uses(server))
            except Exception:  # metering must never break sampling (the scheduler depends on it)
                log.exception("energy metering failed")
        publisher = self.publisher
        if publisher is not None:
            publisher.notify()

    async def start(self, server: ServedNode) -> "NodeAgent":
        """Start what was asked for around a started ``server``.

        Without a usable Kubernetes configuration for ``node_name`` the server is stopped again and
        :class:`~zerolayer.runtime.errors.ConfigError` is raised (the CLI prints it and exits).
        """
        from zerolayer.runtime.defrag.fragmentation import allocator_fragmentation
        from zerolayer.runtime.defrag.release import ReleaseOnSignal
        from zerolayer.runtime.errors import ConfigError

        self._server = server
        self.release = ReleaseOnSignal(asyncio.get_running_loop(), server.engine).install()
        name = self.node_name
        if not name:
            return self
        if not self.gossip:
            self.watcher = self._fleet_watcher()
            if self.prefix_share is not None:
                self._sharing = asyncio.get_running_loop().create_task(self._share_prefixes(server))
            log.info("fleet map: watching InferenceNodes for alternatives (process 0 of %s gossips)", name)
            return self
        try:
            self.api = await asyncio.to_thread(NodeApi, kubeconfig=self.kubeconfig)
        except KubeApiError as exc:
            self.release.remove()
            self.release = None
            await server.stop()
            raise ConfigError(f"--node-name {name}: {exc}") from exc
        publisher = build_publisher(name, self.api, engine=server.engine, draining=lambda: server.draining,
                                    recording=self.gpu_source, tick_s=server.sample_interval_s,
                                    endpoint=self.advertise_endpoint,
                                    on_spec=lambda spec: _adopt_price(self.meter, spec),
                                    fragmentation=allocator_fragmentation,
                                    demand=server.app.demand.entries if server.app.demand is not None else None,
                                    peer_prefixes=self.prefix_share.peers() if self.prefix_share is not None else (),
                                    api_processes=self.api_processes)
        if not publisher.state.endpoint:
            publisher.state.endpoint = advertised_endpoint(server.base_url, server.host, server.port)
        self.publisher = publisher
        publisher.start()
        self.watcher = self._fleet_watcher()
        log.info("gossip: publishing to InferenceNode %s as %s", name, publisher.state.endpoint)
        return self

    def _fleet_watcher(self) -> GpuMapWatcher | None:
        """On demand: the map names alternatives on pressure refusals and answers the map endpoint; a
        process that does neither for MAP_IDLE_S closes its watch and receives no one's heartbeats."""
        try:
            return GpuMapWatcher(kubeconfig=self.kubeconfig, on_demand_idle_s=MAP_IDLE_S).start()
        except GpuMapError as exc:  # the map is for alternatives only: gossip still works without it
            log.warning("no fleet map (alternatives disabled): %s", exc)
            return None

    async def _share_prefixes(self, server: ServedNode) -> None:
        """Another API process than 0: put its prefix records where process 0's gossip reads them, each
        gossip tick (``PREFIX_SHARE_S``)."""
        from zerolayer.runtime.gossip import prefix_records

        records = prefix_records(server.engine)
        while records:
            try:
                self.prefix_share.publish(records)
            except Exception:  # the digest must never stop the server
                log.exception("publishing the prefix digest to API process 0 failed")
            await asyncio.sleep(PREFIX_SHARE_S)

    async def stop(self) -> None:
        if self._sharing is not None:
            self._sharing.cancel()
        if self.release is not None:
            self.release.remove()
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.stop)
        if self.watcher is not None:
            await asyncio.to_thread(self.watcher.stop)
        if self.api is not None:
            self.api.close()
