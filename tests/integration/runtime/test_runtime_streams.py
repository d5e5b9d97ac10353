"""Stream lifecycles over real sockets: preemption, deadlines, pressure, drain, resets, flow control, TLS."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import pathlib
import signal
import ssl
import subprocess
import sys

import h2.config
import h2.connection
import h2.events
import pytest
from runtime_helpers import KEY, H2Client, chat_body, sse_events, start_runtime

from zerolayer.contract import H2_CANCEL, H2_ENHANCE_YOUR_CALM, H2_NO_ERROR, H2_REFUSED_STREAM, ErrorCode
from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.gpu.simulated import SimulatedGpuSource
from zerolayer.runtime.limits import Limits
from zerolayer.runtime.serving.server import tls_context

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60), pytest.mark.asyncio(loop_scope="session")]
REPO = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(params=["python", "native"], autouse=True)
def server_core(request, monkeypatch):  # type: ignore[no-untyped-def]
    """Every stream lifecycle over a socket runs on both HTTP/2 cores (``server.core``)."""
    if request.param == "native":
        pytest.importorskip("zerolayer_h2core", reason="the native core is not built: pip install ./native/h2core")
        if request.node.name.startswith("test_cli_"):
            pytest.skip("the CLI's runtime is another process, on its config's core; HTTP/1.1 here anyway")
        from zerolayer.runtime.serving import transport

        chosen = transport.h2_core_class
        monkeypatch.setattr(transport, "h2_core_class", lambda name: chosen("native"))
    return request.param


async def wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout)


async def test_preempt_mid_stream_sends_sse_error_then_rst_and_aborts_the_engine(slow_runtime):
    engine = slow_runtime.engine
    async with H2Client(slow_runtime.port) as client:
        sid = await client.request("/v1/messages", chat_body(), {"x-api-key": KEY})
        result = client.streams[sid]
        await asyncio.wait_for(result.got_data.wait(), 5)
        await wait_for(lambda: b"content_block_delta" in result.body)
        (key,) = slow_runtime.app.streams
        assert slow_runtime.preempt(key, ErrorCode.RESOURCE_EXHAUSTED, "test")
        await asyncio.wait_for(result.done.wait(), 5)
    assert result.status == 200 and result.reset_code == H2_CANCEL and not result.ended
    name, data = sse_events(bytes(result.body))[-1]
    assert name == "error" and data["error"]["type"] == "overloaded_error"
    assert data["error"]["code"] == "RESOURCE_EXHAUSTED"
    await wait_for(lambda: engine.stats().running == 0)  # engine work aborted
    assert slow_runtime.app.streams == {} and slow_runtime.scheduler.open_streams() == 0
    assert slow_runtime.metrics.value("zerolayer_preemptions_total", code="RESOURCE_EXHAUSTED", reason="test") == 1


async def test_openai_stream_preempted_gets_an_error_data_line(slow_runtime):
    async with H2Client(slow_runtime.port) as client:
        body = b'{"model":"synthetic","stream":true,"messages":[{"role":"user","content":"x"}]}'
        sid = await client.request("/v1/chat/completions", body, {"authorization": f"Bearer {KEY}"})
        result = client.streams[sid]
        await asyncio.wait_for(result.got_data.wait(), 5)
        (key,) = slow_runtime.app.streams
        slow_runtime.preempt(key, ErrorCode.GPU_OOM, "test")
        await asyncio.wait_for(result.done.wait(), 5)
    _, data = sse_events(bytes(result.body))[-1]
    assert data["error"]["code"] == "GPU_OOM" and result.reset_code == H2_CANCEL


async def test_deadline_stops_a_running_stream(slow_runtime):
    async with H2Client(slow_runtime.port) as client:
        sid = await client.request("/v1/messages", chat_body(),
                                   {"x-api-key": KEY, "x-anthropic-deadline-nanos": "300000000"})  # 300 ms
        result = client.streams[sid]
        await asyncio.wait_for(result.done.wait(), 10)
    name, data = sse_events(bytes(result.body))[-1]
    assert name == "error" and data["error"]["code"] == "DEADLINE_EXCEEDED"
    assert result.reset_code == H2_CANCEL


async def test_memory_pressure_refuses_low_and_preempts_running_low_streams():
    gpu = SimulatedGpuSource.constant(0.5)
    engine = SyntheticEngine(output_tokens=500, tokens_per_second=100)
    async with start_runtime(engine=engine, gpu_source=gpu, sample_interval_s=0.05) as server, \
            H2Client(server.port) as client:
        running = await client.request("/v1/messages", chat_body(max_tokens=500),
                                       {"x-api-key": KEY, "x-zerolayer-priority": "low"})
        high = await client.request("/v1/messages", chat_body(max_tokens=500),
                                    {"x-api-key": KEY, "x-zerolayer-priority": "high"})
        await asyncio.wait_for(client.streams[running].got_data.wait(), 5)
        gpu.set_memory(0.99)
        await asyncio.wait_for(client.streams[running].done.wait(), 5)
        refused = await client.request("/v1/messages", chat_body(), {"x-api-key": KEY, "x-zerolayer-priority": "low"})
        await asyncio.wait_for(client.streams[refused].done.wait(), 5)
        assert not client.streams[high].done.is_set()  # high priority is never shed
    low_result = client.streams[running]
    # the running stream lost memory it held: GPU_OOM; the refusal at admission held none: RESOURCE_EXHAUSTED
    assert sse_events(bytes(low_result.body))[-1][1]["error"]["code"] == "GPU_OOM"
    assert low_result.reset_code == H2_CANCEL
    answer = client.streams[refused]
    assert answer.status == 529 and answer.headers["x-zerolayer-error"] == "RESOURCE_EXHAUSTED"
    assert int(answer.headers["retry-after"]) >= 1


async def test_graceful_drain_finishes_streams_and_refuses_new_ones(slow_runtime):
    """While a stream is open the draining connection refuses new streams (REFUSED_STREAM) and
    sends no GOAWAY; the GOAWAY comes once the last stream has ended, naming it."""
    async with H2Client(slow_runtime.port) as client:
        first = await client.request("/v1/messages", chat_body(max_tokens=100), {"x-api-key": KEY})
        await asyncio.wait_for(client.streams[first].got_data.wait(), 5)
        stopping = asyncio.get_running_loop().create_task(slow_runtime.stop(drain_timeout_s=20))
        await wait_for(lambda: slow_runtime.draining)
        late = await client.request("/v1/messages", chat_body(max_tokens=5), {"x-api-key": KEY})
        await asyncio.wait_for(client.streams[late].done.wait(), 5)
        assert client.streams[late].reset_code == H2_REFUSED_STREAM and client.streams[late].status is None
        assert not client.goaway_seen.is_set() and not client.streams[first].done.is_set()
        await asyncio.wait_for(client.streams[first].done.wait(), 10)
        await asyncio.wait_for(client.goaway_seen.wait(), 5)
        assert client.goaway.error_code == H2_NO_ERROR and client.goaway.last_stream_id == first
        await asyncio.wait_for(stopping, 10)
    result = client.streams[first]
    assert result.ended and result.reset_code is None
    assert sse_events(bytes(result.body))[-1][0] == "message_stop"


async def test_sdk_and_httpx_streams_open_at_drain_start_complete(slow_runtime):
    """httpcore 1.0.9 raises on every open stream once any GOAWAY arrives (encode/httpcore#730): the
    SDK's stream and plain httpx HTTP/2 and HTTP/1.1 streams open when the drain starts must still
    complete, and a request the SDK sends on the draining connection is refused, not processed."""
    import contextlib

    import httpx

    from zerolayer.client import AsyncClient, RetryPolicy, StreamRefused

    no_retry = RetryPolicy(max_retries=0)
    url, headers = f"{slow_runtime.base_url}/v1/messages", {"x-api-key": KEY, "content-type": "application/json"}
    async with contextlib.AsyncExitStack() as stack:
        sdk = await stack.enter_async_context(AsyncClient(api_key=KEY, base_url=slow_runtime.base_url,
                                                          retry_policy=no_retry))
        stream = await sdk.messages.create(model="synthetic", max_tokens=100, stream=True,
                                           messages=[{"role": "user", "content": "hello"}])
        sdk_events = stream.__aiter__()
        events = [await sdk_events.__anext__()]
        bodies, chunks = [], {}
        for version, plain in (("HTTP/2", httpx.AsyncClient(http1=False, http2=True, timeout=10)),
                               ("HTTP/1.1", httpx.AsyncClient(timeout=10))):
            await stack.enter_async_context(plain)
            answer = await stack.enter_async_context(plain.stream("POST", url, content=chat_body(max_tokens=100),
                                                                  headers=headers))
            assert answer.status_code == 200 and answer.http_version == version
            bodies.append((version, answer.aiter_bytes()))
            chunks[version] = [await bodies[-1][1].__anext__()]
        stopping = asyncio.get_running_loop().create_task(slow_runtime.stop(drain_timeout_s=20))
        await wait_for(lambda: slow_runtime.draining)
        with pytest.raises(StreamRefused) as refused:
            await sdk.messages.create(model="synthetic", max_tokens=5, messages=[{"role": "user", "content": "late"}])
        assert refused.value.processed is False
        for version, body in bodies:
            chunks[version] += [chunk async for chunk in body]
        events += [event async for event in sdk_events]
        await asyncio.wait_for(stopping, 10)
    assert [e.type for e in events][-1] == "message_stop"
    assert sum(e.type == "content_block_delta" for e in events) == 100
    for version, got in chunks.items():
        assert sse_events(b"".join(got))[-1][0] == "message_stop", version


async def test_streams_still_running_at_the_drain_deadline_end_with_a_retryable_error(slow_runtime):
    """h2 and HTTP/1.1 alike: the client's last event is MODEL_UNAVAILABLE (an SSE error event; then
    RST_STREAM on h2, the connection closed mid-body on HTTP/1.1), not a body that merely stops."""
    import httpx

    async with H2Client(slow_runtime.port) as client, httpx.AsyncClient(timeout=10) as h1:
        first = await client.request("/v1/messages", chat_body(max_tokens=200), {"x-api-key": KEY})
        await asyncio.wait_for(client.streams[first].got_data.wait(), 5)
        chunks: list[bytes] = []
        async with h1.stream("POST", f"{slow_runtime.base_url}/v1/messages", content=chat_body(max_tokens=200),
                             headers={"x-api-key": KEY, "content-type": "application/json"}) as answer:
            assert answer.status_code == 200
            stopping = asyncio.get_running_loop().create_task(slow_runtime.stop(drain_timeout_s=0.3))
            with pytest.raises(httpx.RemoteProtocolError):  # HTTP/1.1 has no reset: the cut is the signal
                async for chunk in answer.aiter_bytes():
                    chunks.append(chunk)
        h1_body = b"".join(chunks)
        await asyncio.wait_for(client.streams[first].done.wait(), 5)
        await asyncio.wait_for(stopping, 10)
    for body in (bytes(client.streams[first].body), h1_body):
        event, data = sse_events(body)[-1]
        assert event == "error" and data["error"]["type"] == "overloaded_error", (event, data)
    assert client.streams[first].reset_code == H2_CANCEL
    assert slow_runtime.metrics.value("zerolayer_preemptions_total", code="MODEL_UNAVAILABLE",
                                      reason="drain_timeout") == 2


async def test_rapid_reset_never_starts_engine_work_and_gets_goaway():
    limits = Limits(rapid_reset_burst=200, rapid_reset_per_second=1)
    async with start_runtime(limits=limits) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        head = [(":method", "POST"), (":path", "/v1/messages"), (":scheme", "http"), (":authority", "t"),
                ("x-api-key", KEY)]
        for i in range(300):
            sid = 1 + 2 * i
            conn.send_headers(sid, head)  # admitted at HEADERS, body never completes
            conn.reset_stream(sid, error_code=H2_CANCEL)
        writer.write(conn.data_to_send())
        await writer.drain()
        goaway = None
        while goaway is None:
            data = await asyncio.wait_for(reader.read(65536), 10)
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ConnectionTerminated):
                    goaway = event
        writer.close()
        await writer.wait_closed()
        assert goaway is not None and goaway.error_code == H2_ENHANCE_YOUR_CALM
        assert server.app.engine_requests_started == 0
        await wait_for(lambda: not server.app.streams)
        assert server.scheduler.open_streams() == 0  # every HEADERS-time reservation was settled
        assert server.metrics.value("zerolayer_h2_limit_hits_total", limit="rapid_reset_burst") == 1


async def test_slow_reader_pauses_generation_with_bounded_buffers():
    engine = SyntheticEngine(output_tokens=5000)
    limits = Limits(stream_buffer_low=4096)
    async with start_runtime(engine=engine, limits=limits) as server, \
            H2Client(server.port, window=8192, auto_window=False) as client:
        sid = await client.request("/v1/messages", chat_body(max_tokens=5000), {"x-api-key": KEY})
        await asyncio.wait_for(client.streams[sid].got_data.wait(), 5)
        (conn,) = server.connections
        await asyncio.sleep(0.3)  # the producer had time to run ahead if it were unbounded
        stream = next(iter(server.app.streams.values()))
        produced_while_stalled = stream.output_tokens
        backlog = conn.core.backlog(sid)
        assert backlog <= limits.stream_buffer_low + 1024  # queued at most one event past the low mark
        # Generation waits for the reader. While it is behind, held deltas go out merged (up to 64 deltas an
        # event, serving/session.py), so the low mark's bytes stand for a few hundred tokens, not 5000.
        assert produced_while_stalled < 1000
        while not client.streams[sid].done.is_set():  # now read everything, a window at a time
            client.read_more(sid, 1 << 20)
            await client.flush()
            await asyncio.sleep(0.01)
    assert client.streams[sid].ended
    assert sse_events(bytes(client.streams[sid].body))[-2][1]["usage"]["output_tokens"] == 5000


def _self_signed(tmp: pathlib.Path) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


async def test_tls_alpn_h2_and_http11(tmp_path):
    import httpx

    cert, key = _self_signed(tmp_path)
    async with start_runtime(ssl_context=tls_context(cert, key)) as server:
        verify = ssl.create_default_context(cafile=cert)
        async with httpx.AsyncClient(http2=True, verify=verify) as h2_client, \
                httpx.AsyncClient(verify=verify) as h1_client:
            for client, version in ((h2_client, "HTTP/2"), (h1_client, "HTTP/1.1")):
                response = await client.post(f"{server.base_url}/v1/messages", content=chat_body(stream=False),
                                             headers={"x-api-key": KEY})
                assert response.status_code == 200 and response.http_version == version
                assert response.json()["usage"]["output_tokens"] == 16


async def test_cli_serves_and_drains_on_sigterm(tmp_path):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "zerolayer.cli", "runtime", "--config", str(REPO / "examples" / "standalone.yaml"),
        "--port", "0", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path,
        env={**os.environ, "ZEROLAYER_DEMO_KEY": "sk-from-env"})
    try:
        url = None
        while url is None:
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            assert line, "runtime exited before serving"
            if "serving on " in line:
                url = line.split("serving on ")[1].split()[0]
        import httpx

        async with httpx.AsyncClient() as client:
            for key in ("sk-zerolayer-demo", "sk-from-env"):
                response = await client.post(f"{url}/v1/messages", content=chat_body(stream=False, max_tokens=2),
                                             headers={"x-api-key": key})
                assert response.status_code == 200, response.text
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_idle_connections_are_pinged_then_closed():
    limits = Limits(ping_interval_s=0.2, idle_timeout_s=1.0)
    async with start_runtime(limits=limits) as server, H2Client(server.port) as client:
        sid = await client.request("/healthz", method="GET")
        await asyncio.wait_for(client.streams[sid].done.wait(), 5)
        await asyncio.wait_for(client.closed.wait(), 10)  # idle past the timeout: closed by the server
        assert server.metrics.value("zerolayer_h2_pings_sent_total") >= 1
        assert server.metrics.value("zerolayer_idle_connections_closed_total") == 1
        assert client.goaway is not None and client.goaway.error_code == H2_NO_ERROR


async def test_a_dropped_connection_settles_streams_still_waiting_for_their_body(runtime):
    reader, writer = await asyncio.open_connection("127.0.0.1", runtime.port)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    for sid in (1, 3, 5):  # admitted at HEADERS; the bodies never come
        conn.send_headers(sid, [(":method", "POST"), (":path", "/v1/messages"), (":scheme", "http"),
                                (":authority", "t"), ("x-api-key", KEY)])
    writer.write(conn.data_to_send())
    await writer.drain()
    await wait_for(lambda: len(runtime.app.streams) == 3)
    assert runtime.scheduler.open_streams() == 3
    writer.close()  # TCP goes away without RST_STREAM or GOAWAY
    await writer.wait_closed()
    await wait_for(lambda: not runtime.app.streams)
    assert runtime.scheduler.open_streams() == 0 and runtime.app.engine_requests_started == 0
