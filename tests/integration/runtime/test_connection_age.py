"""``server.max_connection_age_s`` over real sockets, on both cores (``server.core``): an aged connection
finishes what it carries and goes away (HTTP/2: GOAWAY once its last stream ends; HTTP/1.1:
``connection: close``), an idle one at its next request, a stream still running at the grace's end is cut, the default ages nothing, and
the SDK moves to a fresh connection with no error reaching the caller. Ages are 0.5 s (+-10 %)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from runtime_helpers import KEY, H2Client, chat_body, sse_events, start_runtime

from zerolayer.contract import H2_NO_ERROR, H2_REFUSED_STREAM
from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.serving.transport import ConnectionAge

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
CORES = pytest.mark.parametrize("core", ["python", "native"])  # server.core: the HTTP/2 and HTTP/1.1 cores
AUTH = {"x-api-key": KEY}


def aged(core: str, grace_s: float = 20.0, tokens: int = 150, **kwargs):  # type: ignore[no-untyped-def]
    """A runtime whose connections age at 0.5 s; its streams last tokens / 100 s."""
    if core == "native":
        pytest.importorskip("zerolayer_h2core", reason="the native core is not built: pip install ./native/h2core")
    engine = SyntheticEngine(output_tokens=tokens, tokens_per_second=100)
    return start_runtime(engine=engine, server_core=core, connection_age=ConnectionAge(0.5, grace_s), **kwargs)


async def wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout)


def aged_count(server, stage: str) -> float:  # type: ignore[no-untyped-def]
    return server.metrics.value("zerolayer_connections_aged_total", stage=stage)


@CORES
async def test_an_aged_h2_connection_finishes_its_stream_then_sends_goaway(core):
    async with aged(core, tokens=300) as server:
        async with H2Client(server.port) as client:
            first = await client.request("/v1/messages", chat_body(max_tokens=300), AUTH)  # 3 s
            await asyncio.wait_for(client.streams[first].got_data.wait(), 5)
            await wait_for(lambda: aged_count(server, "drain") == 1)
            late = await client.request("/v1/messages", chat_body(max_tokens=5), AUTH)
            await asyncio.wait_for(client.streams[late].done.wait(), 5)
            assert client.streams[late].reset_code == H2_REFUSED_STREAM  # never started: safe to retry
            assert not client.goaway_seen.is_set() and not client.streams[first].done.is_set()
            await asyncio.wait_for(client.streams[first].done.wait(), 10)
            await asyncio.wait_for(client.goaway_seen.wait(), 5)
            assert client.goaway.error_code == H2_NO_ERROR and client.goaway.last_stream_id == first
            await asyncio.wait_for(client.closed.wait(), 5)
        result = client.streams[first]
        assert result.ended and result.reset_code is None
        assert sse_events(bytes(result.body))[-1][0] == "message_stop"
        async with H2Client(server.port) as again:  # the next connection is served as any
            sid = await again.request("/v1/messages", chat_body(max_tokens=5), AUTH)
            await asyncio.wait_for(again.streams[sid].done.wait(), 5)
            assert again.streams[sid].status == 200 and again.streams[sid].ended
        assert aged_count(server, "grace") == 0


@CORES
async def test_an_idle_aged_connection_serves_its_next_request_then_goes_away(core):
    """Idle at its age, a connection is not closed under a client that may be about to write (httpcore
    does not read an idle HTTP/2 connection): its next request is served and carries the signal."""
    async with aged(core) as server, H2Client(server.port) as client, httpx.AsyncClient(timeout=10) as h1:
        url, headers = f"{server.base_url}/v1/messages", {**AUTH, "content-type": "application/json"}
        first = await client.request("/v1/messages", chat_body(max_tokens=5), AUTH)
        assert (await h1.post(url, content=chat_body(stream=False, max_tokens=5), headers=headers)).status_code == 200
        await wait_for(lambda: aged_count(server, "drain") == 2)  # both connections, idle
        await asyncio.sleep(0.2)
        assert not client.goaway_seen.is_set() and not client.closed.is_set()
        then = await client.request("/v1/messages", chat_body(max_tokens=5), AUTH)
        await asyncio.wait_for(client.streams[then].done.wait(), 5)
        assert client.streams[then].status == 200 and client.streams[then].ended
        await asyncio.wait_for(client.closed.wait(), 5)
        assert client.goaway.error_code == H2_NO_ERROR and client.goaway.last_stream_id == then > first
        answer = await h1.post(url, content=chat_body(stream=False, max_tokens=5), headers=headers)
        assert answer.status_code == 200 and answer.headers["connection"] == "close"
        assert (await h1.post(url, content=chat_body(stream=False, max_tokens=5), headers=headers)).status_code == 200
        assert server.metrics.value("zerolayer_connections_total", protocol="http/1.1") == 2
        assert aged_count(server, "grace") == 0


@CORES
async def test_a_stream_still_running_at_the_grace_end_is_cut(core):
    async with aged(core, grace_s=0.3, tokens=500) as server, H2Client(server.port) as client, \
            httpx.AsyncClient(timeout=10) as h1:
        first = await client.request("/v1/messages", chat_body(max_tokens=500), AUTH)  # 5 s
        chunks: list[bytes] = []
        async with h1.stream("POST", f"{server.base_url}/v1/messages", content=chat_body(max_tokens=500),
                             headers={**AUTH, "content-type": "application/json"}) as answer:
            assert answer.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):  # HTTP/1.1 has no reset: the cut is the signal
                async for chunk in answer.aiter_bytes():
                    chunks.append(chunk)
        await asyncio.wait_for(client.closed.wait(), 5)
        result = client.streams[first]
        assert result.status == 200 and not result.ended and b"content_block_delta" in result.body
        for body in (bytes(result.body), b"".join(chunks)):
            assert b"content_block_delta" in body and b"message_stop" not in body
        assert client.goaway_seen.is_set()
        assert aged_count(server, "drain") == 2 and aged_count(server, "grace") == 2
        await wait_for(lambda: not server.app.streams and server.engine.stats().running == 0)


@CORES
async def test_http1_gets_connection_close_then_a_new_connection_serves(core):
    async with aged(core, tokens=100) as server, httpx.AsyncClient(timeout=10) as h1:
        url, headers = f"{server.base_url}/v1/messages", {**AUTH, "content-type": "application/json"}
        # Not streamed: the head leaves when the answer is complete, ~1 s in, after the age.
        answer = await h1.post(url, content=chat_body(stream=False, max_tokens=100), headers=headers)
        assert answer.status_code == 200 and answer.http_version == "HTTP/1.1"
        assert answer.headers["connection"] == "close"
        again = await h1.post(url, content=chat_body(stream=False, max_tokens=5), headers=headers)
        assert again.status_code == 200 and "connection" not in again.headers
        assert server.metrics.value("zerolayer_connections_total", protocol="http/1.1") == 2


@CORES
async def test_off_by_default_nothing_is_aged(core):
    if core == "native":
        pytest.importorskip("zerolayer_h2core")
    engine = SyntheticEngine(output_tokens=5, tokens_per_second=100)
    async with start_runtime(engine=engine, server_core=core) as server, H2Client(server.port) as client:
        for _ in range(3):
            sid = await client.request("/v1/messages", chat_body(max_tokens=5), AUTH)
            await asyncio.wait_for(client.streams[sid].done.wait(), 5)
            assert client.streams[sid].ended
            await asyncio.sleep(0.6)
        assert not client.goaway_seen.is_set() and not client.closed.is_set()
        assert server.context.age is None and aged_count(server, "drain") == 0


@CORES
async def test_the_sdk_moves_to_a_fresh_connection_with_no_error(core):
    """The SDK's stream open when its connection ages completes; a request sent while that connection
    drains is refused there (REFUSED_STREAM) and retried by the SDK on a new connection; the caller sees
    neither."""
    from zerolayer.client import AsyncClient

    # The long stream outlasts the SDK's retries (3, <= 1.4 s of backoff): without a new connection
    # every retry is refused on the draining one.
    async with aged(core, tokens=400) as server, AsyncClient(api_key=KEY, base_url=server.base_url) as sdk:
        stream = await sdk.messages.create(model="synthetic", max_tokens=400, stream=True,
                                           messages=[{"role": "user", "content": "long"}])
        events = stream.__aiter__()
        seen = [await events.__anext__()]
        await wait_for(lambda: aged_count(server, "drain") == 1)
        short = await sdk.messages.create(model="synthetic", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        assert short.stop_reason == "max_tokens"
        seen += [event async for event in events]
        assert seen[-1].type == "message_stop" and sum(e.type == "content_block_delta" for e in seen) == 400
        after = await sdk.messages.create(model="synthetic", max_tokens=5, messages=[{"role": "user", "content": "y"}])
        assert after.stop_reason == "max_tokens"
    assert server.metrics.value("zerolayer_connections_total", protocol="h2") >= 2
