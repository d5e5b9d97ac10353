"""An HTTP/1.0-style client that half-closes after its request (``printf ... | nc``, a probe)
still gets its answer: the real-node NetworkPolicy probes are such clients. Before the fix an
answer queued for the next flush was dropped when the peer's FIN arrived first."""

from __future__ import annotations

import asyncio

import pytest
from runtime_helpers import start_runtime

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
CORES = pytest.mark.parametrize("core", ["python", "native"])  # server.core: the HTTP/1.1 core too


async def _ask(port: int, path: str, half_close: bool) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.0\r\nHost: probe\r\n\r\n".encode())
    await writer.drain()
    if half_close:
        writer.write_eof()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


@CORES
async def test_half_closed_http10_probe_gets_its_answer(core):
    async with start_runtime(server_core=core) as server:
        for _ in range(5):
            for path in ("/healthz", "/readyz"):
                for half_close in (True, False):
                    answer = await _ask(server.port, path, half_close)
                    assert answer.startswith(b"HTTP/1.1 200"), (path, half_close, answer[:80])
