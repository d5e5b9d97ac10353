"""Finding 14: quotas are per node, so the SDK must not multiply them by retrying a 429 elsewhere,
and a 429 that can never pass (``request_too_large``) must not be retried at all.

On 410a271 a RATE_LIMITED error was retried on another node (``avoid_same_node=True``), and the
runtime sent ``request_too_large`` as a retryable 429 (``x-should-retry: true``, ``retry-after: 1``).
"""

from __future__ import annotations

import pytest

from tests.regression.wire import KEY, H2Peer, chat_body, connect, runtime, until
from zerolayer.client import errors, wire
from zerolayer.client.retry import AttemptParams, RetryPolicy
from zerolayer.contract import ErrorCode
from zerolayer.runtime.scheduler import TenantPolicy
from zerolayer.runtime.tenants import Tenant, key_hash

pytestmark = [pytest.mark.regression, pytest.mark.timeout(30)]
FIRST = AttemptParams(number=1, max_tokens=64, model_hint="m", deadline_s=None)


def test_rate_limited_is_retried_on_the_same_node_only():
    error = errors.RateLimitError("quota", code=ErrorCode.RATE_LIMITED, retry_after=0.5, endpoint="http://a:80",
                                  processed=False)
    decision = RetryPolicy(rng=lambda: 0.0).decide(error, FIRST, streaming=False)
    assert decision is not None
    assert decision.avoid_same_node is False and decision.prefer in ((), ("http://a:80",))


def test_rate_limited_ignores_alternatives():
    error = errors.RateLimitError("quota", code=ErrorCode.RATE_LIMITED, retry_after=0.5, endpoint="http://a:80",
                                  alternatives=("http://b:80",), processed=False)
    decision = RetryPolicy(rng=lambda: 0.0).decide(error, FIRST, streaming=False)
    assert decision is not None and "http://b:80" not in decision.prefer and not decision.avoid_same_node


def test_a_server_that_says_do_not_retry_is_not_retried():
    error = wire.error_from_response(429, {"x-zerolayer-error": "RATE_LIMITED", "x-should-retry": "false"},
                                     b'{"type":"error","error":{"type":"rate_limit_error","message":"too large"}}')
    assert RetryPolicy().decide(error, FIRST, streaming=False) is None


async def test_request_too_large_is_sent_as_not_retryable():
    server = await runtime()
    server.replace_tenants([Tenant("acme", frozenset({key_hash(KEY)}), TenantPolicy("acme", tokens_per_minute=100))])
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    sid = peer.request(chat_body(max_tokens=500))  # needs > 100 tokens: can never pass on any node
    await until(lambda: (peer.read(), peer.status(sid))[1] is not None)
    headers = peer.headers(sid)
    assert peer.status(sid) == 429 and headers["x-zerolayer-error"] == "RATE_LIMITED"
    assert headers["x-should-retry"] == "false" and "retry-after" not in headers
    error = wire.error_from_response(429, headers, peer.body(sid))
    assert RetryPolicy().decide(error, FIRST, streaming=False) is None
