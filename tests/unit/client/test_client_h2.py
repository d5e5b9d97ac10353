"""The SDK against a real HTTP/2 peer that injects faults (h2peer.py).

Every fault here crosses a real socket as real frames: status codes with JSON bodies,
SSE error events, RST_STREAM (INTERNAL_ERROR, REFUSED_STREAM), GOAWAY and a TCP abort.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from h2peer import GoAway, Kill, Request, Reset, Respond, Stream, error_body, sse_events

from zerolayer import contract
from zerolayer.client import (
    APIConnectionError,
    AsyncClient,
    AuthenticationError,
    BreakerState,
    Client,
    DeadlineExceeded,
    GpuOom,
    InternalError,
    ModelUnavailable,
    NoNodeAvailable,
    PermissionDeniedError,
    RateLimitError,
    ResourceExhausted,
    RetryBudget,
    RetryPolicy,
    StreamRefused,
)
from zerolayer.client.events import CircuitClosed, CircuitHalfOpen, FallbackTriggered, RequestLatency, RetryScheduled

pytestmark = pytest.mark.timeout(30)
HI = [{"role": "user", "content": "hi"}]


def client(peer, policy, **kw) -> Client:
    return Client(api_key="tenant-key", base_url=peer.url, retry_policy=policy, **kw)


def error(status: int, code: str, headers: dict | None = None, etype: str = "api_error") -> Respond:
    return Respond(status, error_body(code, etype=etype), {contract.ERROR_HEADER: code, **(headers or {})})


# --------------------------------------------------------------------------- transport + contract
async def test_many_streams_share_one_connection(peer, fast_policy):
    peer.handler = lambda req: Respond(200, {"type": "message", "content": [{"type": "text", "text": "ok"}]}, delay_s=0.2)
    async with AsyncClient(api_key="k", base_url=peer.url, retry_policy=fast_policy) as c:
        results = await asyncio.gather(*(c.messages.create(model="tiny", max_tokens=4, messages=HI) for _ in range(20)))
    assert [m.text for m in results] == ["ok"] * 20
    assert peer.connections == 1 and peer.max_concurrent_streams > 1


def test_contract_headers_on_every_request_and_overrides_raise(peer, fast_policy):
    with client(peer, fast_policy, priority="high", session="sess-1", output_format="json", deadline=0.15) as c:
        c.messages.create(model="tiny", max_tokens=4, messages=HI)
        with c.messages.create(model="tiny", max_tokens=4, messages=HI, stream=True) as s:
            assert "".join(s.text_stream) == "hello world"
        low = c.with_options(priority="low")
        low.messages.create(model="tiny", max_tokens=4, messages=HI, extra_headers={"x-trace": "t1"})
        with pytest.raises(ValueError, match="priority"):
            c.messages.create(model="tiny", max_tokens=4, messages=HI, priority="low")
        with pytest.raises(ValueError, match="x-zerolayer-session"):
            c.messages.create(model="tiny", max_tokens=4, messages=HI, extra_headers={"x-zerolayer-session": "s2"})
        with pytest.raises(ValueError, match="header contract"):
            c.with_options(max_retries=9)
    assert len(peer.requests) == 3 and peer.connections == 1  # the derived client shares the connection
    for req in peer.requests:
        h = req.headers
        assert h["x-api-key"] == "tenant-key" and h["x-zerolayer-session"] == "sess-1"
        assert h["x-zerolayer-output-format"] == "json" and h["x-zerolayer-deadline-nanos"] == "150000000"
        assert h["x-zerolayer-model-hint"] == "tiny" and h["user-agent"].startswith("zerolayer-client/")
    assert [r.headers["x-zerolayer-priority"] for r in peer.requests] == ["high", "high", "low"]
    assert peer.requests[1].json["stream"] is True and peer.requests[2].headers["x-trace"] == "t1"


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "reply, expected",
    [
        (error(503, "MODEL_UNAVAILABLE", etype="overloaded_error"), ModelUnavailable),
        (error(529, "GPU_OOM", etype="overloaded_error"), GpuOom),
        (error(504, "DEADLINE_EXCEEDED", etype="timeout_error"), DeadlineExceeded),
        (error(529, "RESOURCE_EXHAUSTED", etype="overloaded_error"), ResourceExhausted),
        (error(500, "INTERNAL_ERROR"), InternalError),
        (error(401, "AUTHENTICATION", etype="authentication_error"), AuthenticationError),
        (error(403, "PERMISSION_DENIED", etype="permission_error"), PermissionDeniedError),
        (error(429, "RATE_LIMITED", etype="rate_limit_error"), RateLimitError),
        (Respond(529, error_body("GPU_OOM", etype="overloaded_error")), GpuOom),  # body code only
    ],
)
def test_status_errors_are_typed(peer, reply, expected):
    peer.handler = lambda req: reply
    with client(peer, RetryPolicy(max_retries=0)) as c:
        with pytest.raises(expected) as info:
            c.messages.create(model="tiny", max_tokens=4, messages=HI)
        with pytest.raises(expected):
            c.messages.create(model="tiny", max_tokens=4, messages=HI, stream=True)
    assert info.value.status_code == reply.status and info.value.request_id == "req-1-1"


def test_sse_error_after_tokens_raises_and_is_not_retried(peer, fast_policy):
    def handler(req: Request):
        events = sse_events(req, ["a", "b"])[:4]  # start, block start, two tokens
        events.append(("error", error_body("RESOURCE_EXHAUSTED", "preempted", "overloaded_error")))
        return Stream(events, then=Reset(contract.H2_CANCEL))

    peer.handler = handler
    with client(peer, fast_policy) as c:
        stream = c.messages.create(model="tiny", max_tokens=4, messages=HI, stream=True)
        seen = []
        with pytest.raises(ResourceExhausted) as info:
            for event in stream:
                seen.append(event.type)
    assert seen == ["message_start", "content_block_start", "content_block_delta", "content_block_delta"]
    assert info.value.tokens_delivered == 2 and len(peer.requests) == 1


def test_sse_error_before_the_first_token_is_retried_invisibly(peer, fast_policy):
    peer.script(lambda req: Stream([sse_events(req)[0], ("error", error_body("INTERNAL_ERROR"))], then=Reset(0x2)))
    with client(peer, fast_policy) as c:
        with c.messages.create(model="tiny", max_tokens=4, messages=HI, stream=True) as s:
            types = [e.type for e in s]
    assert types.count("message_start") == 1 and types[-1] == "message_stop"  # the failed attempt's events were held back
    assert len(peer.requests) == 2


def test_refused_stream_is_retried_and_typed(peer, fast_policy):
    peer.script(Reset(contract.H2_REFUSED_STREAM))
    with client(peer, fast_policy) as c:
        assert c.messages.create(model="tiny", max_tokens=4, messages=HI).attempts == 2
    peer.script(Reset(contract.H2_REFUSED_STREAM))
    with client(peer, RetryPolicy(max_retries=0)) as c:
        with pytest.raises(StreamRefused) as info:
            c.messages.create(model="tiny", max_tokens=4, messages=HI)
    assert info.value.processed is False and info.value.status_code is None


def test_rst_internal_error_after_a_token_raises(peer, fast_policy):
    peer.handler = lambda req: Stream(sse_events(req, ["a"])[:3], then=Reset(contract.H2_INTERNAL_ERROR))
    with client(peer, fast_policy) as c:
        stream = c.messages.create(model="tiny", max_tokens=4, messages=HI, stream=True)
        with pytest.raises(InternalError) as info:
            list(stream)
    assert info.value.tokens_delivered == 1 and len(peer.requests) == 1


def test_connection_killed_mid_unary_request_is_raised_not_repeated(peer, fast_policy):
    peer.script(Kill())
    with client(peer, fast_policy) as c:
        with pytest.raises(APIConnectionError) as info:
            c.messages.create(model="tiny", max_tokens=4, messages=HI)
        assert info.value.processed is None  # it may have run: not ours to repeat
        assert c.messages.create(model="tiny", max_tokens=4, messages=HI).text == "hello world"  # reconnects
    assert len(peer.requests) == 2 and peer.connections == 2


def test_connection_killed_before_the_first_token_is_retried(peer, fast_policy):
    peer.script(lambda req: Stream(sse_events(req)[:1], then=Kill()))
    with client(peer, fast_policy) as c:
        with c.messages.create(model="tiny", max_tokens=4, messages=HI, stream=True) as s:
            assert "".join(s.text_stream) == "hello world"
    assert len(peer.requests) == 2


def test_goaway_mid_stream_is_a_connection_error(peer, fast_policy):
    peer.script(GoAway(code=0x2, last_stream_id=1))
    with client(peer, RetryPolicy(max_retries=0)) as c:
        with pytest.raises(APIConnectionError, match="GOAWAY"):
            c.messages.create(model="tiny", max_tokens=4, messages=HI)


def test_connection_refused_moves_to_another_node(peers, fast_policy):
    alive = peers()
    dead = peers()
    dead.stop()
    with Client(api_key="k", nodes=[dead.url, alive.url], retry_policy=fast_policy) as c:
        for i in range(10):
            c.with_options(session=f"s{i}").messages.create(model="tiny", max_tokens=4, messages=HI)
    assert len(alive.requests) == 10


# --------------------------------------------------------------------------- retry policy over the wire
def test_gpu_oom_retries_at_once_with_half_the_tokens(peer, fast_policy):
    peer.script(error(529, "GPU_OOM"), error(529, "GPU_OOM"))
    with client(peer, fast_policy) as c:
        message = c.messages.create(model="tiny", max_tokens=100, messages=HI)
    assert message.attempts == 3 and [r.json["max_tokens"] for r in peer.requests] == [100, 50, 25]


def test_deadline_exceeded_retries_lighter_with_double_deadline(peer):
    policy = RetryPolicy(base_delay_s=0.001, lighter_models={"big": "small"})
    peer.script(error(504, "DEADLINE_EXCEEDED", etype="timeout_error"))
    with client(peer, policy, deadline=0.5) as c:
        c.messages.create(model="big", max_tokens=8, messages=HI)
    first, second = peer.requests
    assert (first.headers["x-zerolayer-model-hint"], first.headers["x-zerolayer-deadline-nanos"]) == ("big", "500000000")
    assert (second.headers["x-zerolayer-model-hint"], second.headers["x-zerolayer-deadline-nanos"]) == ("small", "1000000000")
    assert second.json["model"] == "small"  # the lighter model is asked for in the body, not only the hint


def test_refusal_alternatives_are_followed(peers, fast_policy):
    busy, spare = peers(), peers()
    busy.handler = lambda req: error(529, "RESOURCE_EXHAUSTED", {contract.ALTERNATIVES: spare.url, "retry-after": "5"})
    with client(busy, fast_policy, fallback_url=spare.url) as c:  # alternatives must be nodes the SDK knows
        message = c.messages.create(model="tiny", max_tokens=4, messages=HI)
    assert message.endpoint == spare.url and len(busy.requests) == 1 and len(spare.requests) == 1


def test_retry_after_is_honoured(peer, fast_policy):
    events = []
    peer.script(error(503, "MODEL_UNAVAILABLE", {"retry-after-ms": "40"}))
    with client(peer, fast_policy, on_event=events.append) as c:
        c.messages.create(model="tiny", max_tokens=4, messages=HI)
    retries = [e for e in events if isinstance(e, RetryScheduled)]
    assert len(retries) == 1 and retries[0].error == "MODEL_UNAVAILABLE" and 0.04 <= retries[0].delay_s <= 0.048


def test_non_retryable_errors_are_sent_once(peer, fast_policy):
    peer.handler = lambda req: error(401, "AUTHENTICATION", etype="authentication_error")
    with client(peer, fast_policy) as c:
        with pytest.raises(AuthenticationError):
            c.messages.create(model="tiny", max_tokens=4, messages=HI)
    assert len(peer.requests) == 1


def test_retry_budget_holds_during_a_total_outage(peer):
    peer.handler = lambda req: error(529, "RESOURCE_EXHAUSTED", {"retry-after": "0"})
    budget = RetryBudget(ratio=0.2, burst=5)
    with client(peer, RetryPolicy(max_retries=5, base_delay_s=0.0), retry_budget=budget) as c:
        for _ in range(100):
            with pytest.raises(ResourceExhausted):
                c.messages.create(model="tiny", max_tokens=4, messages=HI)
    assert len(peer.requests) <= 1.2 * 100 + 5
    assert budget.denied > 0


# --------------------------------------------------------------------------- fallback + latency
def test_five_internal_errors_open_the_circuit_then_half_open_recovers(peers, fast_policy):
    node, gateway = peers(), peers()
    broken = {"on": True}
    node.handler = lambda req: error(500, "INTERNAL_ERROR") if broken["on"] else Respond(200, {"content": []})
    events = []
    with client(node, fast_policy, fallback_url=gateway.url, breaker_reset_s=0.2, on_event=events.append) as c:
        for _ in range(5):  # each fails on the node, then its retry lands on the fallback
            assert c.messages.create(model="tiny", max_tokens=4, messages=HI).endpoint == gateway.url
        opened = [e for e in events if isinstance(e, FallbackTriggered)]
        assert opened == [FallbackTriggered(node.url, gateway.url, 5)]
        assert c.router.breaker(node.url).state is BreakerState.OPEN
        assert c.messages.create(model="tiny", max_tokens=4, messages=HI).endpoint == gateway.url
        assert len(node.requests) == 5  # open: the node is not even tried
        broken["on"] = False
        time.sleep(0.25)  # let the cool-down pass (waiting, not asserting on time)
        assert c.messages.create(model="tiny", max_tokens=4, messages=HI).endpoint == node.url  # the probe
        assert any(isinstance(e, CircuitHalfOpen) for e in events) and isinstance(events[-2], CircuitClosed)
        assert c.router.breaker(node.url).state is BreakerState.CLOSED


def test_open_circuit_without_fallback_fails_fast(peer, fast_policy):
    peer.handler = lambda req: error(500, "INTERNAL_ERROR")
    with client(peer, RetryPolicy(max_retries=0), breaker_reset_s=60) as c:
        for _ in range(5):
            with pytest.raises(InternalError):
                c.messages.create(model="tiny", max_tokens=4, messages=HI)
        with pytest.raises(NoNodeAvailable):
            c.messages.create(model="tiny", max_tokens=4, messages=HI)
    assert len(peer.requests) == 5


def test_latency_reaches_the_listener_and_the_server(peer, fast_policy):
    events = []
    with client(peer, fast_policy, on_event=events.append) as c:
        with c.messages.create(model="tiny", max_tokens=4, messages=HI, stream=True) as s:
            list(s)
        c.messages.create(model="tiny", max_tokens=4, messages=HI)
    latency = [e for e in events if isinstance(e, RequestLatency)]
    assert latency[0].streaming and latency[0].ttft_s is not None and latency[0].ttft_s <= latency[0].total_s
    assert latency[1].ttft_s is None  # unary: no first-token time to observe
    first, second = peer.requests
    assert contract.CLIENT_LATENCY not in first.headers
    report = dict(p.split("=") for p in second.headers[contract.CLIENT_LATENCY].split(","))
    assert report["request_id"] == latency[0].request_id and float(report["ttft_ms"]) == round(latency[0].ttft_s * 1000, 1)


def test_listener_errors_do_not_fail_requests(peer, fast_policy, caplog):
    def listener(event):
        raise RuntimeError("buggy listener")

    with client(peer, fast_policy, on_event=listener) as c:
        assert c.messages.create(model="tiny", max_tokens=4, messages=HI).text == "hello world"
    assert "listener failed" in caplog.text


# --------------------------------------------------------------------------- asyncio twin
async def test_async_stream_retries_before_first_token_and_raises_after(peer, fast_policy):
    peer.script(
        Reset(contract.H2_REFUSED_STREAM),
        lambda req: Stream(sse_events(req, ["x"])[:3], then=Reset(contract.H2_INTERNAL_ERROR)),
    )
    async with AsyncClient(api_key="k", base_url=peer.url, retry_policy=fast_policy) as c:
        stream = await c.messages.create(model="tiny", max_tokens=4, messages=HI, stream=True)
        texts = []
        with pytest.raises(InternalError):
            async for text in stream.text_stream:
                texts.append(text)
        assert texts == ["x"]
        async with await c.messages.create(model="tiny", max_tokens=4, messages=HI, stream=True) as ok:
            assert [t async for t in ok.text_stream] == ["hello", " world"]
        peer.script(error(529, "GPU_OOM"))
        message = await c.messages.create(model="tiny", max_tokens=10, messages=HI)
        assert message.attempts == 2 and peer.requests[-1].json["max_tokens"] == 5
        with pytest.raises(ValueError):
            await c.messages.create(model="tiny", max_tokens=4, messages=HI, session="x")


def test_a_cold_model_is_waited_for_without_spending_retries_or_the_budget(peer):
    """Issue 25: five refusals while a fleet scales from zero, then the answer; max_retries=1 and an
    empty-able budget of one retry would have raised on the second refusal before."""
    events = []
    cold = error(503, "MODEL_UNAVAILABLE", {"retry-after-ms": "500"})
    peer.script(*[cold] * 5)
    budget = RetryBudget(ratio=0.0, burst=1)
    with client(peer, RetryPolicy(max_retries=1, model_wait_s=60, rng=lambda: 0.0), retry_budget=budget,
                on_event=events.append) as c:
        message = c.messages.create(model="tiny", max_tokens=4, messages=HI)
    assert message.endpoint == peer.url and len(peer.requests) == 6
    waits = [e for e in events if isinstance(e, RetryScheduled)]
    assert [e.reason for e in waits] == ["model_wait"] * 5 and budget.retries == 0
    peer.script(*[cold] * 3)
    with client(peer, RetryPolicy(max_retries=0, model_wait_s=1.2, rng=lambda: 0.0)) as c:
        with pytest.raises(ModelUnavailable):  # the bound: 0.5 + 0.5 s waited, a third would pass 1.2 s
            c.messages.create(model="tiny", max_tokens=4, messages=HI)
