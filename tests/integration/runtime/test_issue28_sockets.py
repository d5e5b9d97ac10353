"""Issue 28's reproductions over real TCP sockets against a real runtime (synthetic engine).

The regression tier (tests/regression/test_f35..f39) drives the transport through a fake socket;
these repeat the outside test's steps with the kernel in the loop: a TCP RST mid-upload (SO_LINGER
0), an h2c peer whose window stays 0 under ``idle_timeout_s: 6`` / ``write_timeout_s: 4`` (the
issue's numbers), a PRIORITY flood while another connection asks ``/healthz``, and a 70 kB
HTTP/1.1 header in one write. Each test prints what it measured.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import sys
import time

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
from runtime_helpers import KEY, start_runtime

from zerolayer.runtime.limits import Limits

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _report(what: str) -> None:
    print(f"[issue28] {what}", file=sys.stderr, flush=True)


def _body(size: int) -> bytes:
    body = json.dumps({"model": "synthetic", "max_tokens": 2, "stream": False,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


async def _h1(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(65536), 10)
    writer.close()
    return data


def _h1_post(body: bytes, extra: str = "") -> bytes:
    return (f"POST /v1/messages HTTP/1.1\r\nhost: n\r\ncontent-type: application/json\r\nx-api-key: {KEY}\r\n"
            f"content-length: {len(body)}\r\n{extra}\r\n").encode() + body


async def test_rst_mid_upload_gives_the_budget_back_over_tcp():
    limits = Limits(max_tenant_buffered_body_bytes=100_000)
    async with start_runtime(limits=limits) as server:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends RST
        head = _h1_post(b"").replace(b"content-length: 0", b"content-length: 100000")
        sock.sendall(head + b" " * 60_000)
        deadline = time.monotonic() + 5
        while server.body_budget.total < 60_000 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        booked = server.body_budget.total
        sock.close()
        started = time.monotonic()
        while server.body_budget.total and time.monotonic() - started < 5:
            await asyncio.sleep(0.01)
        released_after = time.monotonic() - started
        answer = await _h1(server.port, _h1_post(_body(60_000)))
        _report(f"RST mid-upload: {booked} bytes booked, {server.body_budget.total} left after "
                f"{released_after * 1000:.0f} ms; "
                f"next 60 kB request: {answer.split(b' ', 2)[1].decode()}")
        assert booked == 60_000 and server.body_budget.total == 0
        assert answer.startswith(b"HTTP/1.1 200")


async def test_zero_window_h2c_peer_is_closed_with_the_issues_timeouts():
    limits = Limits(idle_timeout_s=6, write_timeout_s=4)
    async with start_runtime(limits=limits) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        client.initiate_connection()
        client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        for _ in range(10):
            sid = client.get_next_available_stream_id()
            client.send_headers(sid, [(":method", "GET"), (":path", "/healthz"), (":scheme", "http"),
                                      (":authority", "n")], end_stream=True)
        writer.write(client.data_to_send())
        started = time.monotonic()
        closed_after = None
        goaway = None
        while time.monotonic() - started < 30:
            try:
                data = await asyncio.wait_for(reader.read(65536), 30 - (time.monotonic() - started))
            except asyncio.TimeoutError:
                break
            if not data:
                closed_after = time.monotonic() - started
                break
            for event in client.receive_data(data):  # never a WINDOW_UPDATE: h2 sends none unasked
                if isinstance(event, h2.events.ConnectionTerminated):
                    goaway = event.error_code
            writer.write(client.data_to_send())
        writer.close()
        _report(f"zero window, idle 6 s / write 4 s: closed after "
                f"{'%.1f s' % closed_after if closed_after else 'more than 30 s'}, GOAWAY code {goaway}; "
                f"connections held now: {server.peers.total}")
        assert closed_after is not None and closed_after < 15


async def test_priority_flood_ends_the_connection_and_healthz_stays_quick():
    async with start_runtime() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        priority = struct.pack(">I", 5)[1:] + bytes([0x2, 0]) + struct.pack(">I", 1) + struct.pack(">IB", 0, 15)
        writer.write(PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # preface + empty SETTINGS
        sent, started, latencies = 0, time.monotonic(), []
        while sent < 200_000 and not writer.is_closing():
            writer.write(priority * 1000)
            sent += 1000
            try:
                await writer.drain()
            except ConnectionError:
                break
            if sent % 20_000 == 0:
                t = time.monotonic()
                answer = await _h1(server.port, b"GET /healthz HTTP/1.1\r\nhost: n\r\n\r\n")
                latencies.append(time.monotonic() - t)
                assert answer.startswith(b"HTTP/1.1 200")
        received = b""
        try:
            while chunk := await asyncio.wait_for(reader.read(65536), 5):
                received += chunk
        except (asyncio.TimeoutError, ConnectionError):
            pass
        writer.close()
        goaway = None
        at = 0
        while at + 9 <= len(received):  # the server's frames: SETTINGS, its ACK, then GOAWAY
            length, kind = int.from_bytes(received[at:at + 3], "big"), received[at + 3]
            if kind == 0x7:
                goaway = int.from_bytes(received[at + 13:at + 17], "big")
            at += 9 + length
        deadline = time.monotonic() + 5
        while server.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        hits = server.metrics.limit_hits.labels("ignored_frames_burst")._value.get()
        _report(f"PRIORITY flood: {sent} frames written in {time.monotonic() - started:.1f} s, GOAWAY code "
                f"{goaway}, ignored_frames_burst hits {hits:g}, connection gone: {not server.connections}; "
                f"/healthz on another connection: max {max(latencies or [0]) * 1000:.0f} ms "
                f"over {len(latencies)} probes")
        assert goaway == 0xB and hits == 1 and not server.connections


async def test_h1_70kb_header_in_one_write_is_431_over_tcp():
    async with start_runtime() as server:
        answer = await _h1(server.port, _h1_post(_body(300), extra=f"x-padding: {'a' * 70_000}\r\n"))
        _report(f"70 kB header in one write: {answer.split(b' ', 2)[1].decode()}")
        assert answer.startswith(b"HTTP/1.1 431")
