"""POST /v1/messages/count_tokens: a keyed route with a body, counted with the engine's own rendering
(the synthetic engine here), never generated, admitted or charged."""

from __future__ import annotations

import json
from typing import Sequence

import pytest

from zerolayer.runtime.serving.app import Application
from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.serving.gate import Admitted
from zerolayer.runtime.limits import Limits
from zerolayer.runtime.serving.metrics import RuntimeMetrics
from zerolayer.runtime.protocol.events import Accept, Reject, RequestHead, RequestReady
from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig, TenantPolicy
from zerolayer.runtime.tenants import Tenant, TenantDirectory, key_hash

KEY = "sk-count-test"
PATH = "/v1/messages/count_tokens"
BODY = {
    "model": "synthetic",
    "system": [{"type": "text", "text": "You are terse."}],
    "messages": [{"role": "user", "content": "How many words are in this prompt, rendered?"},
                 {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "lookup",
                                                    "input": {"q": "words"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "seven"}]}],
    "tools": [{"name": "lookup", "description": "look it up",
               "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}],
    "tool_choice": {"type": "any"},
}


class Recorder:
    """A response channel that keeps what the application sends."""

    key = "1/1"

    def __init__(self) -> None:
        self.head_sent = False
        self.status = 0
        self.body = b""

    async def send_head(self, status: int, headers: Sequence[tuple[str, str]]) -> None:
        self.head_sent, self.status = True, status

    async def send(self, data: bytes) -> None:
        self.body += data

    async def end(self, data: bytes = b"") -> None:
        self.body += data

    def reset(self, error_code: int) -> None:
        raise AssertionError(f"unexpected reset {error_code}")


async def application(policy: TenantPolicy | None = None, models: Sequence[str] = ("synthetic",)) -> Application:
    engine = SyntheticEngine(models)
    await engine.start()
    scheduler = MicroScheduler(SchedulerConfig())
    tenants = TenantDirectory([Tenant("acme", frozenset({key_hash(KEY)}), policy or TenantPolicy("acme"))])
    scheduler.set_tenants(tenants.policies())
    return Application(engine=engine, scheduler=scheduler, tenants=tenants, metrics=RuntimeMetrics(), limits=Limits())


def head(path: str = PATH, method: str = "POST", key: str | None = KEY) -> RequestHead:
    headers = {"content-type": "application/json", **({"x-api-key": key} if key else {})}
    return RequestHead(1, method, path, headers, "node", False)


async def post(app: Application, body: dict | bytes, path: str = PATH) -> tuple[int, dict]:
    request = head(path)
    verdict = app.gate(1, request)
    assert isinstance(verdict, Accept), verdict
    channel = Recorder()
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    await app.serve(channel, RequestReady(request, raw, verdict.context))
    return channel.status, json.loads(channel.body)


async def test_the_route_is_keyed_and_reads_a_body():
    app = await application()
    verdict = app.gate(1, head())
    assert isinstance(verdict, Accept) and isinstance(verdict.context, Admitted)
    assert verdict.context.ticket is None and verdict.owner == "acme"  # not admitted: no reservation
    assert verdict.max_body == app.limits.max_body_bytes
    for refused, status in ((app.gate(1, head(key=None)), 401), (app.gate(1, head(key="sk-wrong")), 401),
                            (app.gate(1, head(method="GET")), 405)):
        assert isinstance(refused, Reject) and refused.status == status
        assert json.loads(refused.body)["type"] == "error"


async def test_count_equals_the_input_tokens_of_the_same_messages_request():
    app = await application()
    status, counted = await post(app, BODY)
    assert status == 200 and set(counted) == {"input_tokens"} and counted["input_tokens"] > 20
    assert app.engine_requests_started == 0
    assert len(app.engine.served_prefixes) == 0  # a counted prompt is not a served prefix
    status, message = await post(app, {**BODY, "max_tokens": 4}, "/v1/messages")
    assert status == 200 and message["usage"]["input_tokens"] == counted["input_tokens"]


async def test_counting_charges_no_quota():
    app = await application(TenantPolicy("acme", tokens_per_minute=5, requests_per_minute=1))
    for _ in range(3):
        status, counted = await post(app, BODY)
        assert status == 200 and counted["input_tokens"] > 5


@pytest.mark.parametrize(("body", "status", "message"), [
    (b"{not json", 400, "body is not valid JSON"),
    ({**BODY, "max_tokens": 10}, 400, "max_tokens: unknown field"),
    ({**BODY, "stream": True}, 400, "stream: unknown field"),
    ({**BODY, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking: not supported"),
    ({k: v for k, v in BODY.items() if k != "model"}, 400, "model: required string"),
    ({**BODY, "messages": []}, 400, "messages: required non-empty list"),
    ({**BODY, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({**BODY, "system": 7}, 400, "system"),
    ({**BODY, "tools": [{"name": "x", "input_schema": {}, "strict": 1}]}, 400, "strict"),
    ({**BODY, "model": "elsewhere"}, 404, "'elsewhere' is not served here"),
])
async def test_bad_bodies_are_refused_naming_the_field(body, status, message):
    app = await application()
    answer_status, answer = await post(app, body)
    assert answer_status == status and answer["type"] == "error"
    assert message in answer["error"]["message"]


async def test_a_tenant_counts_only_with_its_models():
    app = await application(TenantPolicy("acme", allowed_models=frozenset({"synthetic"})),
                            models=("synthetic", "other"))
    status, answer = await post(app, {**BODY, "model": "other"})
    assert status == 403 and "may not use model 'other'" in answer["error"]["message"]
    assert (await post(app, BODY))[0] == 200


async def test_an_engine_not_ready_is_503():
    app = await application()
    await app.engine.close()
    status, answer = await post(app, BODY)
    assert status == 503 and answer["type"] == "error"
