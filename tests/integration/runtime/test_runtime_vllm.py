"""The real engine: vLLM's AsyncLLM in the runtime's process, serving the tiny generated model.

Started once for the module (~20 s on this CPU). Random weights produce noise, so these
tests check structure: token counts, finish reasons, event order, aborts, metrics.
"""

from __future__ import annotations

import asyncio
import pathlib
from typing import AsyncIterator

import pytest
import pytest_asyncio
from runtime_helpers import KEY, H2Client, chat_body, sse_events, start_runtime

from zerolayer.contract import H2_CANCEL, ErrorCode
from tests.vllm_marks import require_vllm, vllm_marks

require_vllm()

pytestmark = [*vllm_marks(timeout=300), pytest.mark.asyncio(loop_scope="session")]
REPO = pathlib.Path(__file__).resolve().parents[3]
MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Say something about zero layers."}]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vllm_runtime() -> AsyncIterator:
    from zerolayer.runtime.node import tinymodel
    from zerolayer.runtime.engine.vllm_engine import VllmEngine

    path = await asyncio.to_thread(tinymodel.generate, REPO / ".models" / MODEL)
    engine = VllmEngine(str(path), served_name=MODEL, max_model_len=1024, max_num_seqs=4,
                        kv_cache_memory_bytes=64 * 1024 * 1024, enforce_eager=True, dtype="float32")
    async with start_runtime(engine=engine, sample_interval_s=0.05) as server:
        yield server


def expected_prompt_tokens() -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / ".models" / MODEL)
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


async def test_anthropic_sdk_against_vllm(vllm_runtime):
    import anthropic

    async with anthropic.AsyncAnthropic(base_url=vllm_runtime.base_url, api_key=KEY, max_retries=0) as client:
        message = await client.messages.create(model=MODEL, max_tokens=12, messages=MESSAGES,
                                               extra_headers={"x-anthropic-priority": "high"})
        assert message.usage.input_tokens == await asyncio.to_thread(expected_prompt_tokens)
        assert 1 <= message.usage.output_tokens <= 12
        assert message.stop_reason in ("max_tokens", "end_turn")
        if message.stop_reason == "max_tokens":
            assert message.usage.output_tokens == 12
        async with client.messages.stream(model=MODEL, max_tokens=6, messages=MESSAGES) as stream:
            async for _ in stream.text_stream:
                pass
            final = await stream.get_final_message()
        assert 1 <= final.usage.output_tokens <= 6


async def test_openai_streaming_usage_against_vllm(vllm_runtime):
    import openai

    async with openai.AsyncOpenAI(base_url=vllm_runtime.base_url + "/v1", api_key=KEY, max_retries=0) as client:
        chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, stream=True, stream_options={"include_usage": True},
            extra_body={"priority": 0})]
    assert chunks[-1].usage is not None and 1 <= chunks[-1].usage.completion_tokens <= 5
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])


async def test_preempting_a_vllm_stream_aborts_the_request(vllm_runtime):
    async with H2Client(vllm_runtime.port) as client:
        body = chat_body(max_tokens=900, model=MODEL)
        sid = await client.request("/v1/messages", body, {"x-api-key": KEY})
        result = client.streams[sid]
        await asyncio.wait_for(result.got_data.wait(), 30)
        (key,) = vllm_runtime.app.streams
        vllm_runtime.preempt(key, ErrorCode.RESOURCE_EXHAUSTED, "test")
        await asyncio.wait_for(result.done.wait(), 30)
    assert result.reset_code == H2_CANCEL
    assert sse_events(bytes(result.body))[-1][0] == "error"

    async def engine_idle() -> None:
        while vllm_runtime.engine.stats().running:
            await asyncio.sleep(0.05)

    await asyncio.wait_for(engine_idle(), 30)


async def _settled(server) -> None:
    """Until vLLM runs nothing and the runtime holds no stream and no quota reservation."""
    while server.engine.stats().running or server.scheduler.open_streams() or server.app.streams:
        await asyncio.sleep(0.05)


async def test_client_disconnect_aborts_the_vllm_request_and_frees_its_quota(vllm_runtime, monkeypatch):
    """Issue 17: a client that goes away mid-stream stops the engine's work and gives its quota
    reservation back, over HTTP/2 (RST_STREAM, then the socket closes) and HTTP/1.1 (the socket
    closes: what the official SDKs do over httpx when a caller stops reading)."""
    aborted: list[str] = []
    engine_abort = vllm_runtime.engine.abort

    async def spy(request_id: str) -> None:  # vLLM's own abort runs; the test only records the call
        aborted.append(request_id)
        await engine_abort(request_id)

    monkeypatch.setattr(vllm_runtime.engine, "abort", spy)
    body = chat_body(max_tokens=900, model=MODEL)
    async with H2Client(vllm_runtime.port) as client:
        sid = await client.request("/v1/messages", body, {"x-api-key": KEY})
        await asyncio.wait_for(client.streams[sid].got_data.wait(), 30)
        assert vllm_runtime.scheduler.open_streams() == 1  # the reservation is held while it streams
        client.conn.reset_stream(sid)
        await client.flush()
    await asyncio.wait_for(_settled(vllm_runtime), 30)
    assert len(aborted) == 1

    reader, writer = await asyncio.open_connection("127.0.0.1", vllm_runtime.port)
    writer.write(b"POST /v1/messages HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
                 + f"x-api-key: {KEY}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    await asyncio.wait_for(reader.readuntil(b"content_block_delta"), 30)  # tokens are flowing
    assert vllm_runtime.scheduler.open_streams() == 1
    writer.close()
    await asyncio.wait_for(_settled(vllm_runtime), 30)
    assert len(aborted) == 2 and aborted[0] != aborted[1]


async def test_vllm_gauges_on_metrics(vllm_runtime):
    import httpx

    async with httpx.AsyncClient(base_url=vllm_runtime.base_url) as http:
        text = (await http.get("/metrics")).text
    assert f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}}' in text
    assert f'vllm:num_requests_running{{model_name="{MODEL}"}}' in text


async def test_a_cut_request_not_streamed_is_billed_what_vllm_made(vllm_runtime, monkeypatch):
    """A request not streamed asks vLLM for FINAL_ONLY output (nothing until it ends). Cut mid-way, it is
    billed the tokens vLLM made so far, read from vLLM's output processor (regression f27 on the real
    engine), and largest-first preemption sees them while it runs."""
    billed: list[tuple] = []
    monkeypatch.setattr(vllm_runtime.app.sessions, "token_sink", lambda *record: billed.append(record))
    body = chat_body(stream=False, max_tokens=900, model=MODEL)
    async with H2Client(vllm_runtime.port) as client:
        sid = await client.request("/v1/messages", body, {"x-api-key": KEY})

        async def made(n: int) -> int:
            while True:
                for session in vllm_runtime.app.streams.values():
                    if (so_far := session.running().tokens_so_far - session.prompt_tokens) >= n:
                        return so_far
                await asyncio.sleep(0.02)

        seen = await asyncio.wait_for(made(5), 60)
        assert client.streams[sid].status is None  # nothing answered yet: the completion comes whole
        client.conn.reset_stream(sid)
        await client.flush()
    await asyncio.wait_for(_settled(vllm_runtime), 30)
    assert len(billed) == 1, billed
    output_tokens = billed[0][4]
    assert seen <= output_tokens < 900
