"""Issue 28, item 4 (finding 38): PRIORITY, unknown-type and ACK frames have a budget.

On 939d895 200,000 PRIORITY frames, 200,000 frames of an unknown type, or 200,000 PING ACKs drew
no GOAWAY (no budget counted them: only PING/SETTINGS needing an answer, WINDOW_UPDATE, empty
DATA/HEADERS and resets were counted) while ``/healthz`` on another connection took up to 1.3 s.
Now they share ``ignored_frames_burst`` / ``ignored_frames_per_second`` (1000, 100/s): past it
the connection ends with GOAWAY(ENHANCE_YOUR_CALM), like the other floods.
"""

from __future__ import annotations

import struct
import time

import pytest

from tests.regression.wire import H2Peer, connect, limits, runtime
from zerolayer.contract import H2_ENHANCE_YOUR_CALM

pytestmark = [pytest.mark.regression, pytest.mark.timeout(60)]
FLOOD = 5000  # the issue sent 200,000; 5x the default burst is enough to show the budget


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id) + payload


FLOODS = {
    "priority": frame(0x2, 0, 1, struct.pack(">IB", 0, 15)),
    "unknown": frame(0x42, 0, 0, b"x" * 8),
    "ping_ack": frame(0x6, 0x1, 0, b"zerolayr"),
    "settings_ack": frame(0x4, 0x1, 0, b""),
}


@pytest.mark.parametrize("kind", sorted(FLOODS))
async def test_a_flood_of_unanswered_frames_ends_the_connection(kind: str):
    server = await runtime()
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    conn.data_received(FLOODS[kind] * FLOOD)
    peer.read()
    goaway = peer.goaway()
    assert goaway is not None and goaway.error_code == H2_ENHANCE_YOUR_CALM, kind
    assert conn.core.ended


async def test_the_budget_refills_so_a_steady_trickle_is_fine():
    clock = [time.monotonic()]  # the core's buckets started on the real clock
    server = await runtime(limits=limits(ignored_frames_burst=50, ignored_frames_per_second=10))
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    conn.core.clock = lambda: clock[0]
    for _ in range(20):  # 20 frames a second for 20 s: well above the burst in all, within the rate
        clock[0] += 1.0
        conn.data_received(FLOODS["priority"] * 10)
    peer.read()
    assert peer.goaway() is None and not conn.core.ended
