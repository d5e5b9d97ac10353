"""Fuzz whole requests through the real runtime: transport, both cores, gate, contract, parsers, scheduler.

Nothing is faked but the socket (tests/regression/wire.py): a RuntimeServer on the synthetic
engine answers each fuzzed request over HTTP/2 or HTTP/1.1. Contract: every answer is 200 (a
request that was valid after all) or a client error, 4xx, with the API's JSON error body, the
``x-zerolayer-error`` code and ``x-should-retry``; the one non-4xx refusal is 504
DEADLINE_EXCEEDED for a well-formed deadline already past. No 5xx, no hang, and the scheduler
holds no stream afterwards.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import h11
import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st

from tests.fuzz.seeds import reproducible
from tests.fuzz.strategies import bodies, header_values
from tests.fuzz.test_fuzz_json import SURROGATE_UTF16
from tests.regression.wire import KEY, H2Peer, connect, h1_request, runtime, until
from zerolayer import contract
from zerolayer.runtime.engine.synthetic import SyntheticEngine

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(300)]

ROUTES = {"/v1/messages": "anthropic", "/v1/chat/completions": "openai", "/v1/completions": "completions"}
CONTRACT_NAMES = (*contract.PRIORITY, *contract.MODEL_HINT, *contract.OUTPUT_FORMAT, *contract.DEADLINE_NANOS,
                  *contract.SLO_TTFT_MS, *contract.SESSION[:1])
# A printable header value: the cores hand the gate latin-1 text, the wire carries no CR/LF/NUL.
printable = header_values.map(lambda v: "".join(c for c in v if " " <= c <= "~").strip())
_peers = itertools.count(1)  # each example its own address: the auth-failure throttle is per address


@st.composite
def requests(draw):  # type: ignore[no-untyped-def]
    path = draw(st.sampled_from(sorted(ROUTES)))
    headers = draw(st.dictionaries(st.sampled_from(CONTRACT_NAMES), printable, max_size=3))
    return path, draw(bodies(ROUTES[path])), sorted(headers.items()), draw(st.sampled_from([KEY, KEY, KEY, "sk-wrong", ""]))


async def _h2(path: str, body: bytes, headers, key: str, peer_addr) -> tuple[int, dict[str, str], bytes]:  # type: ignore[no-untyped-def]
    server = await runtime(engine=SyntheticEngine(output_tokens=3, tokens_per_second=10_000, max_model_len=256))
    conn, sock = connect(server, peer=peer_addr)
    peer = H2Peer(conn, sock)
    sid = peer.request(body, path=path, key=key, extra=headers)

    def answered() -> bool:
        peer.read()
        return peer.reset_code(sid) is not None or any(
            getattr(e, "stream_id", None) == sid and type(e).__name__ == "StreamEnded" for e in peer.events)

    await until(answered, timeout=10)
    await until(lambda: server.scheduler.open_streams() == 0, timeout=10)
    conn.connection_lost(None)
    return peer.status(sid) or 0, peer.headers(sid), peer.body(sid)


async def _h1(path: str, body: bytes, headers, key: str, peer_addr) -> tuple[int, dict[str, str], bytes]:  # type: ignore[no-untyped-def]
    server = await runtime(engine=SyntheticEngine(output_tokens=3, tokens_per_second=10_000, max_model_len=256))
    conn, sock = connect(server, peer=peer_addr)
    conn.data_received(h1_request(body, path=path, key=key, extra=headers))
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="POST", target=path, headers=[("host", "x"), ("content-length", "0")]))
    client.send(h11.EndOfMessage())
    response, data = None, b""
    while True:
        await until(lambda: bool(sock.written) or sock.closing, timeout=10)
        client.receive_data(sock.take() or (b"" if sock.closing else None))  # type: ignore[arg-type]
        while (item := client.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
            if isinstance(item, h11.Response):
                response = item
            elif isinstance(item, h11.Data):
                data += item.data
            elif isinstance(item, (h11.EndOfMessage, h11.ConnectionClosed)):
                await until(lambda: server.scheduler.open_streams() == 0, timeout=10)
                conn.connection_lost(None)
                assert response is not None
                return response.status_code, {k.decode(): v.decode() for k, v in response.headers}, data


def check_answer(route: str, status: int, headers: dict[str, str], body: bytes) -> None:
    api = ROUTES[route]
    event(f"{api} {status}")
    if status == 200:
        return
    assert 400 <= status < 500 or (status == 504 and headers.get("x-zerolayer-error") == "DEADLINE_EXCEEDED"), \
        (status, body[:300])
    assert headers.get("content-type") == "application/json", headers
    assert headers.get("x-should-retry") in ("true", "false") and headers.get("x-zerolayer-error"), headers
    document = json.loads(body)
    error = document["error"]
    if api == "anthropic":
        assert document["type"] == "error" and {"type", "message"} <= set(error)
    else:
        assert {"message", "type", "code"} <= set(error)
    assert error.get("code") == headers["x-zerolayer-error"]


@reproducible
@given(request=requests(), http2=st.booleans())
@example(request=("/v1/messages", SURROGATE_UTF16, [], KEY), http2=True)  # was a 500 (tests/fuzz/test_fuzz_json.py)
@example(request=("/v1/chat/completions", b'{"model":"synthetic","messages":[{"role":"user","content":"x"}],'
                  b'"max_tokens":1e999}', [], KEY), http2=False)
@example(request=("/v1/messages", b"{}", [("x-slo-ttft-ms", "nan")], KEY), http2=True)
def test_every_fuzzed_request_is_answered_200_or_a_client_error(request, http2):
    path, body, headers, key = request
    peer_addr = (f"10.{next(_peers) % 250}.0.1", 40000)
    status, answer_headers, answer = asyncio.run((_h2 if http2 else _h1)(path, body, headers, key, peer_addr))
    check_answer(path, status, answer_headers, answer)
