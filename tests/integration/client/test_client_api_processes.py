"""The SDK against ``zerolayer runtime --api-processes 2``: a node that publishes two API processes (or a
client told ``connections_per_node=2``) gets two HTTP/2 connections, counted by the runtime itself
(``zerolayer_connections_total`` on the merged metrics page), so that its requests can reach both
processes. With the runtime's exact connection balance (the default) the two connections land on the two
processes, so one SDK client's requests are served by both."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.integration.runtime.apiprocs_helpers import (KEY, Node, connection_counts, free_port, per_process,
                                                       write_config)
from zerolayer.client import AsyncClient, Client
from zerolayer.client.nodes import Node as MapNode
from zerolayer.client.nodes import StaticNodeMap

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
HI = [{"role": "user", "content": "hi"}]


def opened(node: Node, before: float, expected: int) -> int:
    """Connections the node accepted since ``before`` (all processes), once the count settled."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sum(connection_counts(node.metrics()).values()) - before < expected:
        time.sleep(0.1)
    time.sleep(0.3)  # one too many would show up now
    return int(sum(connection_counts(node.metrics()).values()) - before)


def test_the_sdk_opens_one_connection_per_api_process(tmp_path):
    port = free_port()
    node = Node(write_config(tmp_path, {"kind": "synthetic", "output_tokens": 4, "ttft_ms": 100}, port), port, 2)
    try:
        before = sum(connection_counts(node.metrics()).values())

        async def batch() -> list[str]:
            nodes = StaticNodeMap([MapNode("gpu-1", node.url, api_processes=2)])
            async with AsyncClient(api_key=KEY, nodes=nodes, max_retries=0) as client:
                messages = await asyncio.gather(*(client.messages.create(model="synthetic", max_tokens=4,
                                                                         messages=HI) for _ in range(20)))
            return [m.text for m in messages]

        assert all(asyncio.run(batch()))
        assert opened(node, before, 2) == 2  # the node's published count: two lanes
        served = per_process(node.metrics(), "zerolayer_requests_total", 'status="200"')  # any route
        assert set(served) == {"0", "1"} and sum(served.values()) == 20, served  # one lane on each process

        before = sum(connection_counts(node.metrics()).values())
        with Client(api_key=KEY, base_url=node.url, connections_per_node=2, max_retries=0) as client:
            for stream in (False, True, False, True):
                reply = client.messages.create(model="synthetic", max_tokens=4, messages=HI, stream=stream)
                if stream:
                    with reply as events:
                        assert "".join(events.text_stream)
                else:
                    assert reply.text
        assert opened(node, before, 2) == 2  # the option, on a node that publishes nothing

        before = sum(connection_counts(node.metrics()).values())
        with Client(api_key=KEY, base_url=node.url, max_retries=0) as client:
            for _ in range(4):
                assert client.messages.create(model="synthetic", max_tokens=4, messages=HI).text
        assert opened(node, before, 1) == 1  # neither: one connection, as before lanes
    finally:
        assert node.stop() == 0, node.output()
