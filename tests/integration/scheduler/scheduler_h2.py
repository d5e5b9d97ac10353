"""Helpers for the scheduler's integration tests: a real RuntimeServer in this process and an
HTTP/2 client (httpx, h2c prior knowledge) that records what a streaming caller sees."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time

import httpx

from zerolayer.runtime.scheduler import TenantPolicy
from zerolayer.runtime.serving.server import RuntimeServer
from zerolayer.runtime.tenants import Tenant, key_hash

API_KEY = "scheduler-test-key"
TENANT = "sched"


def tenant(**policy) -> Tenant:
    return Tenant(TENANT, frozenset({key_hash(API_KEY)}), TenantPolicy(TENANT, **policy))


@contextlib.asynccontextmanager
async def running_server(**kwargs):
    server = await RuntimeServer(**kwargs).start()
    try:
        async with httpx.AsyncClient(base_url=server.base_url, http1=False, http2=True,
                                     timeout=httpx.Timeout(60.0),
                                     limits=httpx.Limits(max_connections=4)) as client:
            yield server, client
    finally:
        await server.stop(drain_timeout_s=0.5)


def body(words: int = 8, max_tokens: int = 16, model: str = "synthetic", stream: bool = True,
         temperature: float | None = None) -> dict:
    data = {"model": model, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": " ".join(["hello"] * words)}]}
    if temperature is not None:
        data["temperature"] = temperature
    return data


def headers(priority: str, **extra: str) -> dict[str, str]:
    return {"x-api-key": API_KEY, "x-zerolayer-priority": priority, **extra}


@dataclasses.dataclass
class StreamResult:
    status: int | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    events: list[str] = dataclasses.field(default_factory=list)
    error_code: str | None = None  # from an SSE error event or the JSON error body
    reset: bool = False  # the stream ended with RST_STREAM (httpx sees a protocol error)
    ttft_s: float | None = None
    total_s: float | None = None
    first_token: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def completed(self) -> bool:
        return self.status == 200 and "message_stop" in self.events


async def stream_messages(client: httpx.AsyncClient, priority: str, result: StreamResult | None = None, *,
                          words: int = 8, max_tokens: int = 16, temperature: float | None = None,
                          **extra_headers: str) -> StreamResult:
    """One streaming /v1/messages call; never raises for HTTP errors or resets."""
    result = result or StreamResult()
    started = time.monotonic()
    try:
        async with client.stream("POST", "/v1/messages", json=body(words, max_tokens, temperature=temperature),
                                  headers=headers(priority, **extra_headers)) as response:
            result.status = response.status_code
            result.headers = dict(response.headers)
            if response.status_code != 200:
                payload = json.loads(await response.aread())
                result.error_code = payload["error"].get("code")
                return result
            event = None
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                    result.events.append(event)
                elif line.startswith("data: ") and event == "content_block_delta" and result.ttft_s is None:
                    result.ttft_s = time.monotonic() - started
                    result.first_token.set()
                elif line.startswith("data: ") and event == "error":
                    result.error_code = json.loads(line[6:])["error"].get("code")
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.StreamError):
        result.reset = True
    result.total_s = time.monotonic() - started
    return result


async def eventually(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` until true (no timed assertion: the timeout only stops a hang)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        await asyncio.sleep(0.01)
