"""Finding 33: ``/v1/zerolayer/map`` and ``/v1/models`` do not re-serialise on every request.

On 410a271 every GET of the map (any tenant's key) rendered the whole fleet document again
(endpoints, GPU UUIDs, load): a cheap way for one tenant to burn the runtime's CPU.
"""

from __future__ import annotations

import json

import pytest

from tests.regression.wire import H2Peer, connect, limits, runtime, until
from zerolayer.gpumap import FleetMap, utc_now_rfc3339

pytestmark = [pytest.mark.regression, pytest.mark.timeout(30)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def names(body: bytes) -> list[str]:
    return [n["name"] for n in json.loads(body)["nodes"]]


async def test_the_map_document_is_rendered_once_per_sample_window():
    renders = []

    def fleet() -> FleetMap:  # the node agent's snapshot; the server renders it into the document
        renders.append(1)
        return FleetMap.from_objects([{"metadata": {"name": f"node-{len(renders)}"},
                                       "status": {"endpoint": "http://10.0.0.1:8080", "admitting": True,
                                                  "lastHeartbeat": utc_now_rfc3339()}}])

    clock = Clock()
    server = await runtime(fleet=fleet, limits=limits(map_cache_s=1.0), clock=clock)
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    for _ in range(50):
        sid = peer.request(None, path="/v1/zerolayer/map")
        await until(lambda: (peer.read(), peer.status(sid))[1] is not None)
        assert peer.status(sid) == 200 and names(peer.body(sid)) == ["node-1"]
    assert len(renders) == 1
    clock.now += 1.5  # the next sample
    sid = peer.request(None, path="/v1/zerolayer/map")
    await until(lambda: (peer.read(), peer.status(sid))[1] is not None)
    assert names(peer.body(sid)) == ["node-2"] and len(renders) == 2


async def test_the_models_document_is_built_once():
    server = await runtime()
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    bodies = []
    for _ in range(3):
        sid = peer.request(None, path="/v1/models")
        await until(lambda: (peer.read(), peer.status(sid))[1] is not None)
        bodies.append(peer.body(sid))
    assert bodies[0] == bodies[1] == bodies[2] and b"synthetic" in bodies[0]
    assert server.app.models_document() is server.app.models_document()  # the same bytes object: no rebuild
