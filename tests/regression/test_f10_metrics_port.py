"""Review finding 10: ``/metrics`` (every tenant's name, token volume, cost) was served on the
serving port that every tenant namespace reaches. The runtime now exports metrics on its own port,
and the node's NetworkPolicy admits only ``metricsScraperNamespaces`` to it (and not to serving)."""

from __future__ import annotations

import argparse

import pytest

from tests.regression.manifest_fixtures import CONFIG, containers, daemonset, inode
from zerolayer.operator import manifests as m

pytestmark = [pytest.mark.regression]


def test_server_exports_metrics_on_a_separate_named_port():
    server = containers(daemonset(inode()))["server"]
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert set(ports) == {"serving", "metrics"} and ports["metrics"] != ports["serving"]
    assert f"--metrics-port={ports['metrics']}" in server["args"]


def test_only_scraper_namespaces_reach_the_metrics_port():
    policy = m.build_runtime_networkpolicy(inode(), CONFIG)
    by_port = {}
    for rule in policy["spec"]["ingress"]:
        namespaces = {v for peer in rule["from"] for e in peer["namespaceSelector"]["matchExpressions"]
                      for v in e["values"]}
        for port in rule["ports"]:
            by_port.setdefault(port["port"], set()).update(namespaces)
    assert by_port["metrics"] == set(CONFIG.metrics_scraper_namespaces)
    assert not by_port.get("serving", set()) & set(CONFIG.metrics_scraper_namespaces)
    tenant = m.build_tenant_networkpolicy({"apiVersion": "zerolayer.io/v1alpha1", "kind": "TenantQuota",
                                           "metadata": {"name": "t", "uid": "u"},
                                           "spec": {"tenant": "t", "namespaces": ["team"]}}, CONFIG)
    assert [p["port"] for r in tenant["spec"]["ingress"] for p in r["ports"]] == ["serving"]


def test_runtime_cli_takes_the_metrics_port():
    from zerolayer.runtime import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    assert parser.parse_args(["runtime", "--config", "x.yaml", "--metrics-port", "9464"]).metrics_port == 9464


@pytest.mark.asyncio(loop_scope="session")
async def test_the_metrics_listener_answers_metrics_and_nothing_else():
    import asyncio

    from tests.regression.wire import runtime
    from zerolayer.runtime.compose import serve_metrics

    server = await runtime()
    listener = await serve_metrics(server, 0, host="127.0.0.1")
    port = listener.sockets[0].getsockname()[1]

    async def get(path: str) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        answer = await reader.read()
        writer.close()
        return answer

    try:
        metrics = await get("/metrics")
        assert metrics.startswith(b"HTTP/1.1 200") and b"zerolayer_requests" in metrics
        assert (await get("/v1/messages")).startswith(b"HTTP/1.1 404")
    finally:
        listener.close()
        await listener.wait_closed()
        await server.engine.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_serving_port_hides_metrics_when_they_have_their_own_port():
    """What every tenant namespace reaches (the serving port) must not list other tenants' usage."""
    from tests.regression import wire

    hidden = await wire.runtime(metrics_on_serving_port=False)
    conn, sock = wire.connect(hidden)
    peer = wire.H2Peer(conn, sock)
    sid = peer.request(None, path="/metrics", key=None)
    await wire.until(lambda: peer.read() is not None and peer.status(sid) is not None)
    assert peer.status(sid) == 404
    assert b"zerolayer_tokens" not in bytes(sock.written)
    # Standalone (no metrics port): the serving port keeps /metrics, as documented.
    shown = await wire.runtime()
    conn, sock = wire.connect(shown)
    peer = wire.H2Peer(conn, sock)
    sid = peer.request(None, path="/metrics", key=None)
    await wire.until(lambda: peer.read() is not None and peer.status(sid) is not None)
    assert peer.status(sid) == 200
