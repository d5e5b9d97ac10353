"""Finding 26: stop sequences and ``max_tokens`` are bounded.

On 410a271 a request could carry any number of stop sequences of any length (matched per token
in the shared engine: a noisy-neighbour cost), and ``max_tokens`` was unbounded when the tenant
had no tokens-per-minute limit, whatever the model's context.
"""

from __future__ import annotations

import json

import pytest

from tests.regression.wire import H2Peer, connect, runtime, until
from zerolayer.runtime.api import anthropic, openai
from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.errors import RequestRefused

pytestmark = [pytest.mark.regression, pytest.mark.timeout(30)]
HI = [{"role": "user", "content": "hi"}]


def anthropic_body(**extra) -> bytes:  # type: ignore[no-untyped-def]
    return json.dumps({"model": "synthetic", "max_tokens": 8, "messages": HI, **extra}).encode()


def openai_body(**extra) -> bytes:  # type: ignore[no-untyped-def]
    return json.dumps({"model": "synthetic", "max_tokens": 8, "messages": HI, **extra}).encode()


@pytest.mark.parametrize("parse,body", [
    (anthropic.parse, anthropic_body(stop_sequences=[f"s{i}" for i in range(17)])),
    (anthropic.parse, anthropic_body(stop_sequences=["x" * 1000])),
    (openai.parse, openai_body(stop=[f"s{i}" for i in range(17)])),
    (openai.parse, openai_body(stop="x" * 1000)),
], ids=["anthropic-count", "anthropic-length", "openai-count", "openai-length"])
def test_too_many_or_too_long_stop_sequences_are_invalid(parse, body):
    with pytest.raises(RequestRefused) as refused:
        parse(body)
    assert refused.value.code.value == "INVALID_REQUEST"


def test_a_few_short_stop_sequences_are_fine():
    assert anthropic.parse(anthropic_body(stop_sequences=["a", "b", "c", "d"])).stop == ("a", "b", "c", "d")


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/chat/completions"])
async def test_max_tokens_over_the_model_context_is_a_400(route):
    try:
        engine = SyntheticEngine(max_model_len=256)
    except TypeError:  # before the fix engines had no context size to check against
        engine = SyntheticEngine()
    server = await runtime(engine=engine)
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    sid = peer.request(json.dumps({"model": "synthetic", "max_tokens": 100_000, "messages": HI}).encode(), path=route)
    await until(lambda: (peer.read(), peer.status(sid))[1] is not None)
    assert peer.status(sid) == 400 and peer.headers(sid)["x-zerolayer-error"] == "INVALID_REQUEST"
