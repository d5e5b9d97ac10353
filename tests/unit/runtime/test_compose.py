"""The composition root wires sinks and sources through constructors; ``listen.reuse_port``.

Real parts throughout: the synthetic engine, the simulated GPU source, the token probe without
a spool (USDT only), the node agent without ``--node-name`` (no Kubernetes).
"""

from __future__ import annotations

import argparse
import pathlib
import socket

import pytest

from zerolayer.bpf.hook import add_audit_arguments
from zerolayer.runtime.compose import compose
from zerolayer.runtime.config import parse_config
from zerolayer.runtime.errors import ConfigError
from zerolayer.runtime.node.agent import add_gossip_arguments
from zerolayer.runtime.gossip.publisher import RecordingSource

REPO = pathlib.Path(__file__).resolve().parents[3]


def cli_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_gossip_arguments(parser)
    add_audit_arguments(parser)
    return parser.parse_args(list(argv))


def test_compose_hands_the_probe_and_the_agent_to_the_server(monkeypatch):
    monkeypatch.delenv("ZEROLAYER_NODE_NAME", raising=False)
    monkeypatch.delenv("ZEROLAYER_AUDIT_SPOOL", raising=False)
    monkeypatch.delenv("ZEROLAYER_AUDIT_JOURNAL", raising=False)
    config = parse_config({"gpu": {"source": "simulated", "memory": 0.4}}, REPO, environ={})
    runtime = compose(config, cli_args(), port=0)
    server, agent, probe = runtime.server, runtime.agent, runtime.probe
    assert agent is not None and probe is not None
    try:
        # The agent sees every GPU sample the server takes: the server samples through its wrapper.
        assert isinstance(server.gpu_source, RecordingSource) and server.gpu_source is agent.gpu_source
        assert server.app.sessions.token_sink == probe.emit
        # The energy meter's series are on /metrics without anyone patching the app.
        assert b"zerolayer_energy" in server.app.render_metrics()
        assert agent.node_name is None and server.app.admission.alternatives is None  # no gossip, no fleet
    finally:
        probe.close()


def test_compose_without_args_builds_a_bare_server():
    config = parse_config({}, REPO, environ={})
    runtime = compose(config, port=0)
    assert runtime.agent is None and runtime.probe is None
    assert runtime.server.app.sessions.token_sink is None and runtime.server.gpu_source is None


def test_listen_reuse_port_parses_and_is_checked():
    assert parse_config({"listen": {"reuse_port": True}}, REPO, environ={}).reuse_port is True
    assert parse_config({}, REPO, environ={}).reuse_port is False
    with pytest.raises(ConfigError, match="listen.reuse_port"):
        parse_config({"listen": {"reuse_port": "yes"}}, REPO, environ={})


@pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"), reason="no SO_REUSEPORT on this platform")
async def test_two_runtimes_share_a_port_with_reuse_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = parse_config({"listen": {"port": port, "reuse_port": True}}, REPO, environ={})
    first, second = compose(config).server, compose(config).server
    await first.start()
    try:
        await second.start()
        try:
            assert first.port == second.port == port
        finally:
            await second.stop(drain_timeout_s=0)
    finally:
        await first.stop(drain_timeout_s=0)


async def test_without_reuse_port_a_second_runtime_cannot_bind():
    config = parse_config({"listen": {"port": 0}}, REPO, environ={})
    first = compose(config).server
    await first.start()
    try:
        taken = parse_config({"listen": {"port": first.port}}, REPO, environ={})
        with pytest.raises(ConfigError, match="cannot listen on .*reuse-port"):
            await compose(taken).server.start()
    finally:
        await first.stop(drain_timeout_s=0)


def _record(order: list[str], name: str, obj: object, method: str) -> None:
    inner = getattr(obj, method)

    async def async_wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        order.append(name)
        return await inner(*args, **kwargs)

    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        order.append(name)
        return inner(*args, **kwargs)

    import inspect

    setattr(obj, method, async_wrapper if inspect.iscoroutinefunction(inner) else wrapper)


async def test_serving_starts_in_order_and_drains_the_server_before_the_rest(monkeypatch):
    monkeypatch.delenv("ZEROLAYER_NODE_NAME", raising=False)
    monkeypatch.delenv("ZEROLAYER_AUDIT_SPOOL", raising=False)
    monkeypatch.delenv("ZEROLAYER_AUDIT_JOURNAL", raising=False)
    config = parse_config({"gpu": {"source": "simulated", "memory": 0.4}}, REPO, environ={})
    runtime = compose(config, cli_args(), port=0)
    order: list[str] = []
    _record(order, "server.start", runtime.server, "start")
    _record(order, "server.stop", runtime.server, "stop")
    _record(order, "agent.start", runtime.agent, "start")
    _record(order, "agent.stop", runtime.agent, "stop")
    _record(order, "probe.close", runtime.probe, "close")
    async with runtime.serving() as server:
        assert server is runtime.server and server.port != 0
        order.append("serving")
    # The agent outlives the drain (gossip reports it); the probe closes last.
    assert order == ["server.start", "agent.start", "serving", "server.stop", "agent.stop", "probe.close"]
    assert server.draining


async def test_a_server_that_cannot_start_is_not_stopped_and_the_probe_still_closes(monkeypatch):
    monkeypatch.delenv("ZEROLAYER_NODE_NAME", raising=False)
    monkeypatch.delenv("ZEROLAYER_AUDIT_SPOOL", raising=False)
    monkeypatch.delenv("ZEROLAYER_AUDIT_JOURNAL", raising=False)
    runtime = compose(parse_config({}, REPO, environ={}), cli_args(), port=0)
    order: list[str] = []

    async def refuse() -> None:
        raise ConfigError("cannot listen")

    monkeypatch.setattr(runtime.server, "start", refuse)
    _record(order, "server.stop", runtime.server, "stop")
    _record(order, "agent.start", runtime.agent, "start")
    _record(order, "probe.close", runtime.probe, "close")
    with pytest.raises(ConfigError, match="cannot listen"):
        async with runtime.serving():
            order.append("serving")
    assert order == ["probe.close"]
    await runtime.server.engine.close()


async def test_api_processes_other_than_0_read_the_fleet_map_and_leave_gossip_to_process_0(monkeypatch):
    """Issue 29: every API process names alternative nodes on its pressure refusals, so each reads the
    fleet map (on demand, as process 0 does); only process 0 publishes the node's status."""
    from types import SimpleNamespace

    from zerolayer.runtime.apiprocs import ApiProcess
    from zerolayer.runtime.engine.synthetic import SyntheticEngine
    from zerolayer.runtime.node import agent as node_agent

    watchers: list[dict] = []

    class Watcher:  # stands in for the InferenceNode watch (a cluster; the e2e tier runs the real one)
        def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
            watchers.append(kwargs)

        def start(self) -> "Watcher":
            return self

        def snapshot(self) -> str:
            return "the fleet map"

        def stop(self) -> None:
            watchers.append({"stopped": True})

    def no_status_writes(**kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("only process 0 writes the node's status")

    monkeypatch.setattr(node_agent, "GpuMapWatcher", Watcher)
    monkeypatch.setattr(node_agent, "NodeApi", no_status_writes)
    args = cli_args("--node-name", "gpu-1", "--kubeconfig", "/none")
    assert ApiProcess(0, 2, None, "").agent_args(args) is args
    agent = node_agent.NodeAgent.from_args(ApiProcess(1, 2, None, "").agent_args(args), None)
    assert (agent.node_name, agent.gossip) == ("gpu-1", False)
    await agent.start(SimpleNamespace(engine=SyntheticEngine()))
    try:
        assert agent.publisher is None and agent.api is None
        assert agent.fleet() == "the fleet map" and watchers == [{"kubeconfig": "/none", "on_demand_idle_s":
                                                                   node_agent.MAP_IDLE_S}]
    finally:
        await agent.stop()
    assert watchers[-1] == {"stopped": True}
