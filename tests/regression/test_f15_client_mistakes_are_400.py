"""Finding 15: a client's own mistakes are 400 INVALID_REQUEST (not retryable), not 500s with a traceback.

On 410a271 deeply nested JSON (RecursionError is not a ValueError) and a lone ``\\ud800`` in a
message came back as ``500 INTERNAL_ERROR`` with ``x-should-retry: true`` and a logged traceback;
the SDK retried them and counted them toward its circuit breaker. A prompt longer than the
model's context went to the engine and failed there (a 500 with the engine's text).
"""

from __future__ import annotations

import json
import logging

import pytest

from tests.regression.wire import H2Peer, connect, runtime, until
from zerolayer.runtime.engine.synthetic import SyntheticEngine

pytestmark = [pytest.mark.regression, pytest.mark.timeout(30)]

DEEP = b'{"model":"synthetic","max_tokens":5,"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
SURROGATE = b'{"model":"synthetic","max_tokens":5,"messages":[{"role":"user","content":"a\\ud800b"}]}'
LONG_PROMPT = json.dumps({"model": "synthetic", "max_tokens": 5,
                          "messages": [{"role": "user", "content": "word " * 500}]}).encode()


@pytest.mark.parametrize("body", [DEEP, SURROGATE, LONG_PROMPT], ids=["deep-json", "lone-surrogate", "over-context"])
@pytest.mark.parametrize("route", ["/v1/messages", "/v1/chat/completions"])
async def test_client_mistakes_are_400_invalid_request_without_a_traceback(body, route, caplog):
    server = await runtime(engine=SyntheticEngine(max_model_len=256) if _engine_has_context() else None)
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    with caplog.at_level(logging.WARNING):
        sid = peer.request(body, path=route)
        await until(lambda: (peer.read(), peer.status(sid))[1] is not None)
    headers = peer.headers(sid)
    assert (peer.status(sid), headers.get("x-zerolayer-error"), headers.get("x-should-retry")) == \
        (400, "INVALID_REQUEST", "false"), peer.body(sid)
    assert not [r for r in caplog.records if r.exc_info], "a client mistake logged a traceback"
    assert server.scheduler.open_streams() == 0


def _engine_has_context() -> bool:
    """SyntheticEngine grew ``max_model_len`` with this fix; before it, the long prompt runs unbounded."""
    try:
        SyntheticEngine(max_model_len=256)
    except TypeError:
        return False
    return True
