"""The composition root: the one place that builds a runtime and plugs its parts together.

Everything is wired through constructors, in dependency order, and nothing is set on a built
object afterwards:

1. the engine, the micro-scheduler, the GPU source and TLS from the config;
2. with CLI arguments: the token probe (:func:`zerolayer.bpf.hook.open_token_probe`, whose
   ``emit`` is the token sink) and the node agent (:class:`zerolayer.runtime.gossip.hook.NodeAgent`,
   which wraps the GPU source to see each sample and provides the energy metrics renderer and,
   with ``--node-name``, the fleet snapshot);
3. the :class:`~zerolayer.runtime.server.RuntimeServer`, given all of the above.

The caller starts the server, then ``await runtime.agent.start(server)``; see :mod:`zerolayer.runtime.cli`.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from zerolayer.runtime.errors import ConfigError

if TYPE_CHECKING:
    from zerolayer.bpf.probes import TokenProbe
    from zerolayer.runtime.config import RuntimeConfig
    from zerolayer.runtime.gossip.hook import NodeAgent
    from zerolayer.runtime.server import RuntimeServer


@dataclasses.dataclass
class Runtime:
    """A built, not yet started, runtime and the process-level parts around it."""

    server: "RuntimeServer"
    agent: "NodeAgent | None" = None
    probe: "TokenProbe | None" = None


def compose(config: "RuntimeConfig", args: argparse.Namespace | None = None, *, port: int | None = None,
            metrics_on_serving_port: bool = True, reuse_port: bool | None = None,
            fleet_quota: bool = False) -> Runtime:
    """Build the runtime ``config`` describes. With ``args`` (the ``zerolayer runtime`` flags) also the
    token probe and the node agent, wired into the server. ``port``/``reuse_port`` override the config."""
    from zerolayer.runtime.config import build_engine, build_gpu_source
    from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig, SchedulerError
    from zerolayer.runtime.server import RuntimeServer, tls_context

    try:
        scheduler = MicroScheduler(SchedulerConfig.from_mapping(config.scheduler))
    except SchedulerError as exc:
        raise ConfigError(f"scheduler: {exc}") from exc
    if fleet_quota:  # in-cluster: a tenant's limits hold across the fleet (runtime/incluster.py attach_fleet_quota)
        from zerolayer.runtime.scheduler.fleet import FleetQuotaScheduler

        scheduler = FleetQuotaScheduler(scheduler, window_s=scheduler.config.quota_window_s)
    engine = build_engine(config)
    ssl_context = tls_context(config.tls_cert, config.tls_key) if config.tls_cert and config.tls_key else None
    gpu_source = build_gpu_source(config, engine)
    wiring: dict[str, Any] = {}
    agent = probe = None
    if args is not None:
        from zerolayer.bpf.hook import open_token_probe
        from zerolayer.runtime.gossip.hook import NodeAgent

        probe = open_token_probe(args)  # USDT token events (+ counters, journal with --audit-spool)
        agent = NodeAgent.from_args(args, gpu_source)
        gpu_source = agent.gpu_source or gpu_source
        wiring.update(token_sink=probe.emit, extra_metrics=agent.extra_metrics())
        if agent.node_name:  # alternatives on pressure refusals, GET /v1/zerolayer/map
            wiring.update(fleet=agent.fleet, self_name=agent.node_name)
    server = RuntimeServer(
        engine=engine,
        scheduler=scheduler,
        tenants=config.tenants,
        gpu_source=gpu_source,
        limits=config.limits,
        host=config.host,
        port=config.port if port is None else port,
        ssl_context=ssl_context,
        sample_interval_s=config.sample_interval_s,
        required_headers=config.required_headers,
        metrics_on_serving_port=metrics_on_serving_port,
        reuse_port=config.reuse_port if reuse_port is None else reuse_port,
        **wiring,
    )
    return Runtime(server, agent, probe)


def build_server(config: "RuntimeConfig", *, port: int | None = None,
                 metrics_on_serving_port: bool = True) -> "RuntimeServer":
    """The server alone (no probe, no node agent): tests and embedders."""
    return compose(config, port=port, metrics_on_serving_port=metrics_on_serving_port).server
