"""Fleet glue at the Application level: alternatives on pressure refusals, the GPU-map endpoint.

The fleet is a plain callable here (the node agent's ``fleet()`` reads a Kubernetes watch);
everything else is the real application, scheduler and synthetic engine.
"""

from __future__ import annotations

import json
from typing import Sequence

import pytest

from zerolayer import contract
from zerolayer.contract import Priority
from zerolayer.gpumap import FleetMap, alternatives_header, render_map_document, utc_now_rfc3339
from zerolayer.runtime.serving.app import Application
from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.limits import Limits
from zerolayer.runtime.serving.metrics import RuntimeMetrics
from zerolayer.runtime.protocol.events import Accept, Reject, RequestHead, RequestReady
from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig, TenantPolicy
from zerolayer.runtime.scheduler.api import Pressure
from zerolayer.runtime.tenants import Tenant, TenantDirectory, key_hash

KEY = "sk-glue-test"


def inference_node(name: str, endpoint: str, admitting: bool = True) -> dict:
    return {"metadata": {"name": name},
            "status": {"endpoint": endpoint, "admitting": admitting, "lastHeartbeat": utc_now_rfc3339()}}


FLEET = FleetMap.from_objects([inference_node("self", "http://10.0.0.1:8080"),
                               inference_node("b", "http://10.0.0.2:8080"),
                               inference_node("c", "http://10.0.0.3:8080"),
                               inference_node("full", "http://10.0.0.4:8080", admitting=False)])


class Recorder:
    """A response channel that keeps what the application sends."""

    key = "1/1"

    def __init__(self) -> None:
        self.head_sent = False
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""

    async def send_head(self, status: int, headers: Sequence[tuple[str, str]]) -> None:
        self.head_sent, self.status, self.headers = True, status, dict(headers)

    async def send(self, data: bytes) -> None:
        self.body += data

    async def end(self, data: bytes = b"") -> None:
        self.body += data

    def reset(self, error_code: int) -> None:
        raise AssertionError(f"unexpected reset {error_code}")


async def application(**hooks) -> Application:
    engine = SyntheticEngine()
    await engine.start()
    scheduler = MicroScheduler(SchedulerConfig())
    tenants = TenantDirectory([Tenant("acme", frozenset({key_hash(KEY)}), TenantPolicy("acme"))])
    scheduler.set_tenants(tenants.policies())
    return Application(engine=engine, scheduler=scheduler, tenants=tenants, metrics=RuntimeMetrics(),
                       limits=Limits(), **hooks)


def chat_head(session: str | None = "s-42", priority: str = "normal") -> RequestHead:
    headers = {"x-api-key": KEY, "content-type": "application/json", contract.PRIORITY[0]: priority}
    if session is not None:
        headers["x-zerolayer-session"] = session
    return RequestHead(1, "POST", "/v1/messages", headers, "node", False)


def under_pressure(app: Application) -> None:
    app.scheduler.observe(Pressure(0.99, (), 0, 1.0), 1.0)


async def test_pressure_refusal_names_alternatives_for_the_session():
    asked = []

    def alternatives(session):
        asked.append(session)
        return alternatives_header(FLEET, session, self_name="self")

    app = await application(alternatives=alternatives)
    under_pressure(app)
    verdict = app.gate(1, chat_head())
    assert isinstance(verdict, Reject) and verdict.status == 529
    headers = dict(verdict.headers)
    assert headers[contract.ERROR_HEADER] == "RESOURCE_EXHAUSTED"
    assert asked == ["s-42"]
    endpoints = headers[contract.ALTERNATIVES].split(",")
    # Admitting nodes other than this one, in the session's ring order; never a full node.
    assert endpoints == [n.endpoint for n in FLEET.choose("s-42", exclude=["self"], limit=2)]
    assert "http://10.0.0.1:8080" not in endpoints and "http://10.0.0.4:8080" not in endpoints


async def test_no_fleet_no_alternatives_header():
    app = await application()
    under_pressure(app)
    verdict = app.gate(1, chat_head())
    assert isinstance(verdict, Reject) and contract.ALTERNATIVES not in dict(verdict.headers)


async def test_fleet_with_no_other_admitting_node_sends_no_header():
    app = await application(alternatives=lambda session: alternatives_header(
        FleetMap.from_objects([inference_node("self", "http://10.0.0.1:8080")]), session, self_name="self"))
    under_pressure(app)
    verdict = app.gate(1, chat_head())
    assert isinstance(verdict, Reject) and contract.ALTERNATIVES not in dict(verdict.headers)


async def test_refusals_other_than_pressure_carry_no_alternatives():
    app = await application(alternatives=lambda session: "http://elsewhere:1")
    app.tenants.replace([Tenant("acme", frozenset({key_hash(KEY)}),
                                TenantPolicy("acme", allowed_priorities=frozenset({Priority.LOW})))])
    app.scheduler.set_tenants(app.tenants.policies())
    verdict = app.gate(1, chat_head(priority="high"))
    assert isinstance(verdict, Reject) and verdict.status == 403
    assert contract.ALTERNATIVES not in dict(verdict.headers)


def map_head(key: str | None = KEY) -> RequestHead:
    return RequestHead(3, "GET", "/v1/zerolayer/map", {"x-api-key": key} if key else {}, "node", True)


async def serve(app: Application, head: RequestHead) -> Recorder:
    verdict = app.gate(1, head)
    assert isinstance(verdict, Accept), verdict
    channel = Recorder()
    await app.serve(channel, RequestReady(head, b"", verdict.context))
    return channel


async def test_map_endpoint_serves_the_fleet_document():
    app = await application(map_document=lambda: render_map_document(FLEET))
    answer = await serve(app, map_head())
    assert answer.status == 200 and answer.headers["content-type"] == "application/json"
    document = json.loads(answer.body)
    assert [n["name"] for n in document["nodes"]] == ["b", "c", "full", "self"]
    assert document == json.loads(render_map_document(FLEET))


async def test_map_endpoint_without_a_map_is_404_json():
    for hooks in ({}, {"map_document": lambda: None}):
        app = await application(**hooks)
        answer = await serve(app, map_head())
        assert answer.status == 404
        assert json.loads(answer.body)["type"] == "error"


@pytest.mark.parametrize("key", [None, "sk-wrong"])
async def test_map_endpoint_needs_a_tenant_key(key):
    app = await application(map_document=lambda: render_map_document(FLEET))
    verdict = app.gate(1, map_head(key))
    assert isinstance(verdict, Reject) and verdict.status == 401
