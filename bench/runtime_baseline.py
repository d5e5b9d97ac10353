"""The conventional middle layer, for bench/runtime_overhead.py to compare against.

Two FastAPI apps run by uvicorn: ``engine_app`` serves the same synthetic engine as a
plain model server would (the role vLLM's own OpenAI server plays), and ``proxy_app``
is a gateway in front of it that authenticates, forwards the body with httpx and
relays the answer (the role LiteLLM's proxy plays). Both do the minimum: the point is
the cost of the extra hop and of a general-purpose ASGI stack, not of features.
``BENCH_ENGINE=vllm`` (with ``BENCH_MODEL``) serves the tiny vLLM model instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from typing import AsyncIterator

import httpx
from fastapi import FastAPI, Request, Response

from zerolayer.runtime.api import anthropic
from zerolayer.runtime.api.common import dumps
from zerolayer.runtime.engine.base import SamplingOptions
from zerolayer.runtime.engine.synthetic import SyntheticEngine

def _engine():  # type: ignore[no-untyped-def]
    if os.environ.get("BENCH_ENGINE") == "vllm":
        from zerolayer.runtime.engine.vllm_engine import VllmEngine

        return VllmEngine(os.environ["BENCH_MODEL"], served_name="synthetic", max_model_len=1024,
                          max_num_seqs=16, kv_cache_memory_bytes=64 * 1024 * 1024,
                          enforce_eager=True, dtype="float32")  # CPU settings
    return SyntheticEngine()


ENGINE = _engine()
KEY_HASH = hashlib.sha256(os.environ.get("BENCH_KEY", "sk-bench").encode()).hexdigest()

@contextlib.asynccontextmanager
async def _engine_lifespan(app: FastAPI) -> AsyncIterator[None]:
    await ENGINE.start()
    yield
    await ENGINE.close()


engine_app = FastAPI(lifespan=_engine_lifespan)


@engine_app.post("/v1/messages")
async def messages(request: Request) -> Response:
    req = anthropic.parse(await request.body())
    prompt = await ENGINE.render(req.model, req.messages)
    text, tokens, finish = [], 0, "stop"
    options = SamplingOptions(req.max_tokens, temperature=req.temperature)
    async for delta in ENGINE.generate(prompt, options, uuid.uuid4().hex, 1):
        text.append(delta.text)
        tokens += delta.token_count
        finish = delta.finish_reason or finish
    body = anthropic.message("msg", req.model, "".join(text), anthropic.STOP_REASONS[finish],
                             {"input_tokens": prompt.token_count, "output_tokens": tokens})
    return Response(dumps(body), media_type="application/json")


_upstream: httpx.AsyncClient | None = None


@contextlib.asynccontextmanager
async def _proxy_lifespan(app: FastAPI) -> AsyncIterator[None]:
    global _upstream
    async with httpx.AsyncClient(base_url=os.environ["BENCH_UPSTREAM"],
                                 limits=httpx.Limits(max_connections=256, max_keepalive_connections=256)) as client:
        _upstream = client
        yield


proxy_app = FastAPI(lifespan=_proxy_lifespan)


@proxy_app.post("/v1/messages")
async def proxy(request: Request) -> Response:
    key = request.headers.get("x-api-key", "")
    if hashlib.sha256(key.encode()).hexdigest() != KEY_HASH:
        return Response('{"error":"auth"}', status_code=401, media_type="application/json")
    assert _upstream is not None
    upstream = await _upstream.post("/v1/messages", content=await request.body(),
                                    headers={"content-type": "application/json"})
    return Response(upstream.content, status_code=upstream.status_code, media_type="application/json")
