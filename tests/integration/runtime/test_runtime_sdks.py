"""Unmodified official SDKs and curl against a real runtime (synthetic engine)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import anthropic
import httpx
import openai
import pytest
from runtime_helpers import KEY, LIMITED_KEY, LOW_KEY, H2Client, chat_body, sse_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60), pytest.mark.asyncio(loop_scope="session")]

MESSAGES = [{"role": "user", "content": "hello there"}]


async def test_anthropic_sync_and_sync_streaming(runtime):
    def run():  # type: ignore[no-untyped-def]
        with anthropic.Anthropic(base_url=runtime.base_url, api_key=KEY, max_retries=0) as client:
            message = client.messages.create(model="synthetic", max_tokens=5, messages=MESSAGES)
            with client.messages.stream(model="synthetic", max_tokens=50, messages=MESSAGES) as stream:
                texts = list(stream.text_stream)
                final = stream.get_final_message()
        return message, texts, final

    message, texts, final = await asyncio.to_thread(run)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5
    assert message.usage.input_tokens > 0 and message.content[0].text
    assert len(texts) == 16 and final.stop_reason == "end_turn"  # the synthetic engine answers 16 tokens
    assert final.usage.output_tokens == 16 and "".join(texts) == final.content[0].text


def _sdk_http_module(sdk):  # type: ignore[no-untyped-def]
    """The httpx flavour the installed SDK wants for http_client (newer releases use httpx2)."""
    import importlib

    source = importlib.import_module(f"{sdk.__name__}._base_client")
    return pytest.importorskip("httpx2") if hasattr(source, "httpx2") or "httpx2" in repr(vars(source)) else httpx


async def test_anthropic_async_over_http2_prior_knowledge(runtime):
    http_module = _sdk_http_module(anthropic)
    async with http_module.AsyncClient(http1=False, http2=True) as http, anthropic.AsyncAnthropic(
            base_url=runtime.base_url, api_key=KEY, http_client=http, max_retries=0) as client:
        raw = await client.messages.with_raw_response.create(model="synthetic", max_tokens=3, messages=MESSAGES)
        assert raw.http_response.http_version == "HTTP/2"
        assert raw.headers["x-ratelimit-limit-requests"] == "100000"
        assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 10_000_000
        message = await raw.parse()
        assert message.usage.output_tokens == 3
        async with client.messages.stream(model="synthetic", max_tokens=4, messages=MESSAGES) as stream:
            texts = [t async for t in stream.text_stream]
        assert len(texts) == 4


async def test_openai_sync_async_and_streaming_with_usage(runtime):
    def run_sync():  # type: ignore[no-untyped-def]
        with openai.OpenAI(base_url=runtime.base_url + "/v1", api_key=KEY, max_retries=0) as client:
            return client.chat.completions.create(model="synthetic", messages=MESSAGES, max_tokens=7)

    completion = await asyncio.to_thread(run_sync)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 7

    async with openai.AsyncOpenAI(base_url=runtime.base_url + "/v1", api_key=KEY, max_retries=0) as client:
        await _openai_async(client)


async def _openai_async(client: openai.AsyncOpenAI) -> None:
    completion = await client.chat.completions.create(model="synthetic", messages=MESSAGES)
    assert completion.choices[0].finish_reason == "stop" and completion.usage.completion_tokens == 16
    chunks = [c async for c in await client.chat.completions.create(
        model="synthetic", messages=MESSAGES, stream=True, stream_options={"include_usage": True})]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == completion.choices[0].message.content  # deterministic engine: same prompt, same answer
    assert chunks[-1].usage.completion_tokens == 16
    models = await client.models.list()
    assert [m.id for m in models.data] == ["synthetic"]


async def test_sdk_errors_carry_the_contract(runtime):
    url = runtime.base_url
    async with anthropic.AsyncAnthropic(base_url=url, api_key="sk-wrong", max_retries=0) as client, \
            anthropic.AsyncAnthropic(base_url=url, api_key=LOW_KEY, max_retries=0) as low, \
            openai.AsyncOpenAI(base_url=url + "/v1", api_key=LIMITED_KEY, max_retries=0) as limited:
        await _errors(client, low, limited)


async def _errors(client, low, limited) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(anthropic.AuthenticationError) as err:
        await client.messages.create(model="synthetic", max_tokens=3, messages=MESSAGES)
    assert err.value.response.headers["x-zerolayer-error"] == "AUTHENTICATION"

    with pytest.raises(anthropic.PermissionDeniedError):
        await low.messages.create(model="synthetic", max_tokens=3, messages=MESSAGES,
                                  extra_headers={"x-anthropic-priority": "high"})
    ok = await low.messages.create(model="synthetic", max_tokens=3, messages=MESSAGES,
                                   extra_headers={"x-anthropic-priority": "low"})
    assert ok.usage.output_tokens == 3

    with pytest.raises(anthropic.NotFoundError) as err:
        await client.with_options(api_key=KEY).messages.create(model="gpt-9", max_tokens=3, messages=MESSAGES)
    assert err.value.response.headers["x-zerolayer-error"] == "MODEL_UNAVAILABLE"

    await limited.chat.completions.create(model="synthetic", messages=MESSAGES)
    with pytest.raises(openai.RateLimitError) as err:
        await limited.chat.completions.create(model="synthetic", messages=MESSAGES)
    headers = err.value.response.headers
    assert headers["x-zerolayer-error"] == "RATE_LIMITED" and int(headers["retry-after"]) >= 1
    assert err.value.body["code"] == "RATE_LIMITED"


async def test_openai_body_priority_is_checked_against_the_tenant(runtime):
    async with openai.AsyncOpenAI(base_url=runtime.base_url + "/v1", api_key=LOW_KEY, max_retries=0) as low:
        with pytest.raises(openai.PermissionDeniedError):
            await low.chat.completions.create(model="synthetic", messages=MESSAGES, extra_body={"priority": 0})
        ok = await low.chat.completions.create(model="synthetic", messages=MESSAGES, extra_body={"priority": 5})
    assert ok.usage.completion_tokens == 16


async def test_health_models_and_metrics(runtime):
    async with httpx.AsyncClient(base_url=runtime.base_url) as http:
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.get("/readyz")).status_code == 200
        assert (await http.get("/v1/models")).status_code == 401
        models = await http.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
        assert models.json()["data"][0]["id"] == "synthetic"
        assert (await http.get("/nope")).status_code == 404
        assert (await http.get("/v1/messages")).status_code == 405
        metrics = (await http.get("/metrics")).text
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "zerolayer_h2_limit_hits_total", "zerolayer_requests_total", "zerolayer_scheduler"):
        assert name in metrics, name


async def test_many_streams_share_one_http2_connection(runtime):
    async with H2Client(runtime.port) as client:
        sids = [await client.request("/v1/messages", chat_body(max_tokens=8), {"x-api-key": KEY})
                for _ in range(50)]
        await asyncio.wait_for(asyncio.gather(*(client.streams[s].done.wait() for s in sids)), 20)
    for sid in sids:
        result = client.streams[sid]
        assert result.status == 200 and result.ended
        assert sse_events(bytes(result.body))[-1][0] == "message_stop"
    assert runtime.metrics.value("zerolayer_connections_total", protocol="h2") == 1


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_http2_prior_knowledge_streaming(runtime):
    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["curl", "-sS", "-i", "-N", "--http2-prior-knowledge", f"{runtime.base_url}/v1/messages",
             "-H", f"x-api-key: {KEY}", "-H", "x-anthropic-priority: high", "-d", chat_body(max_tokens=4).decode()],
            capture_output=True, text=True, timeout=20)

    out = await asyncio.to_thread(run)
    if "--http2-prior-knowledge" in out.stderr or "not support" in out.stderr:
        pytest.skip(f"this curl has no HTTP/2: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    head, _, body = out.stdout.partition("\n\n")  # text mode turned \r\n into \n
    assert head.startswith("HTTP/2 200")
    names = [name for name, _ in sse_events(body.encode())]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert json.loads(body.split("event: message_delta\ndata: ")[1].split("\n")[0])["usage"]["output_tokens"] == 4
