"""A request not streamed asks the engine for whole completions (``SamplingOptions.final_only``, what
vllm serve asks vLLM for with ``RequestOutputKind.FINAL_ONLY``): the answer is byte for byte the one
built from step-by-step deltas, the TTFT metric still measures the first token, and a request with a
TTFT SLO keeps its deltas (the SLO is enforced until the first token comes)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, AsyncIterator

import pytest

from tests.unit.runtime.test_stream_coalesce import KEY, Recorder, TeeEngine, application, request_body
from zerolayer.runtime.engine.base import Delta
from zerolayer.runtime.protocol.events import Accept, RequestHead, RequestReady

PATHS = ["/v1/chat/completions", "/v1/messages", "/v1/completions"]


class StepsOnly(TeeEngine):
    """The synthetic engine told to ignore ``final_only``: the step-by-step answer to compare with."""

    async def generate(self, prompt, options, request_id, priority) -> AsyncIterator[Delta]:  # type: ignore[override]
        async for delta in super().generate(prompt, dataclasses.replace(options, final_only=False), request_id,
                                            priority):
            yield delta


class Asked(TeeEngine):
    """Keeps the options each request asked for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[Any] = []

    async def generate(self, prompt, options, request_id, priority) -> AsyncIterator[Delta]:  # type: ignore[override]
        self.asked.append(options)
        async for delta in super().generate(prompt, options, request_id, priority):
            yield delta


async def answer(engine: TeeEngine, path: str, body: dict[str, Any], **headers: str) -> tuple[Recorder, Any]:
    app = await application(engine)
    channel = Recorder()
    head = RequestHead(1, "POST", path, {"content-type": "application/json", "x-api-key": KEY, **headers},
                       "node", False)
    verdict = app.gate(1, head)
    assert isinstance(verdict, Accept), verdict
    await app.serve(channel, RequestReady(head, json.dumps(body).encode(), verdict.context))
    assert channel.status == 200, channel.body
    return channel, app


def comparable(raw: bytes) -> dict[str, Any]:
    doc = json.loads(raw)
    doc.pop("id", None)
    doc.pop("created", None)
    return doc


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("extra", [{}, {"n": 2, "logprobs": True, "top_logprobs": 2}, {"stop": ["zz"]}])
async def test_a_whole_completion_gives_the_same_answer_as_its_steps(path, extra):
    if path == "/v1/messages" and extra.get("n"):
        pytest.skip("the Messages API has no n or logprobs")
    if path == "/v1/completions" and "top_logprobs" in extra:
        extra = {"n": 2, "logprobs": 2}
    if path == "/v1/messages" and "stop" in extra:
        extra = {"stop_sequences": extra["stop"]}
    body = {**request_body(path, extra), "stream": False}
    whole_engine, steps_engine = TeeEngine(output_tokens=12), StepsOnly(output_tokens=12)
    whole, _ = await answer(whole_engine, path, body)
    steps, _ = await answer(steps_engine, path, body)
    assert comparable(whole.body) == comparable(steps.body)
    choices = body.get("n", 1)
    assert len(whole_engine.yielded) == choices and len(steps_engine.yielded) == choices * 12


async def test_ttft_is_the_first_tokens_time_not_the_answers():
    engine = TeeEngine(output_tokens=20, tokens_per_second=100)  # 0.19 s from the first token to the last
    _, app = await answer(engine, "/v1/chat/completions", {**request_body("/v1/chat/completions", {}), "stream": False})
    metrics = app.sessions.metrics
    assert metrics.value("zerolayer_time_to_first_token_seconds_count") == 1
    assert metrics.value("zerolayer_time_to_first_token_seconds_sum") < 0.1


async def test_a_ttft_slo_keeps_the_steps():
    body = {**request_body("/v1/chat/completions", {}), "stream": False}
    engine = Asked(output_tokens=4)
    await answer(engine, "/v1/chat/completions", body)
    await answer(engine, "/v1/chat/completions", body, **{"x-slo-ttft-ms": "5000"})
    assert [o.final_only for o in engine.asked] == [True, False]
