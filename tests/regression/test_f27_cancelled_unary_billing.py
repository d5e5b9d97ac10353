"""Finding 27: a non-streaming request cancelled mid-generation is billed for what the engine did.

On 410a271 the token sink (metering) heard of a unary request only after its response was
sent: a client that reset the stream (or disconnected) mid-generation consumed prefill and
generation with nothing billed, although its quota was charged.
"""

from __future__ import annotations

import pytest

from tests.regression.wire import H2Peer, chat_body, connect, runtime, turns, until
from zerolayer.runtime.engine.synthetic import SyntheticEngine

pytestmark = [pytest.mark.regression, pytest.mark.timeout(30)]


async def test_a_reset_unary_request_bills_its_prompt_and_the_tokens_generated_so_far():
    billed: list[tuple] = []
    server = await runtime(engine=SyntheticEngine(output_tokens=200, tokens_per_second=100), token_sink=lambda *record: billed.append(record))
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    sid = peer.request(chat_body(stream=False, max_tokens=200))
    # Not streamed: the engine gives the completion whole at its end (final_only); what it made so far is
    # its tokens_so_far, which the session reads when the request is cut.
    await until(lambda: server.app.streams and (s := next(iter(server.app.streams.values()))).running().tokens_so_far
                - s.prompt_tokens >= 5)
    peer.h2.reset_stream(sid, 8)
    peer.flush()
    await until(lambda: not server.app.streams)
    await turns()
    assert len(billed) == 1, billed
    tenant, request_id, model, prompt_tokens, output_tokens, first = billed[0]
    assert (tenant, model, first) == ("acme", "synthetic", True)
    assert prompt_tokens > 0 and 5 <= output_tokens < 200


async def test_a_completed_unary_request_is_billed_once():
    billed: list[tuple] = []
    server = await runtime(engine=SyntheticEngine(output_tokens=8), token_sink=lambda *record: billed.append(record))
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    sid = peer.request(chat_body(stream=False, max_tokens=8))
    await until(lambda: (peer.read(), peer.status(sid))[1] is not None)
    await turns()
    assert [(r[0], r[4]) for r in billed] == [("acme", 8)]
