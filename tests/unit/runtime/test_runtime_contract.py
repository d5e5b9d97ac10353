"""Header contract parsing, tenant keys and error responses: pure functions, table-tested."""

from __future__ import annotations

import json
import pathlib

import pytest

from zerolayer import contract
from zerolayer.contract import ERRORS, ErrorCode, Priority
from zerolayer.runtime.api.wire import error_response
from zerolayer.runtime.serving.gate import WIRES
from zerolayer.runtime.errors import RequestRefused
from zerolayer.runtime.serving.headers import parse_contract
from zerolayer.runtime.scheduler.api import TenantPolicy
from zerolayer.runtime.tenants import Tenant, TenantDirectory, key_hash

NOW, WALL_NS = 500.0, 1_800_000_000 * 10**9
REPO = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "headers, priority, session",
    [
        ({}, Priority.NORMAL, None),
        ({"x-zerolayer-priority": "high"}, Priority.HIGH, None),
        ({"x-anthropic-priority": "LOW", "x-anthropic-session": "s1"}, Priority.LOW, "s1"),
        ({"x-zerolayer-priority": "0", "x-anthropic-priority": "low"}, Priority.HIGH, None),  # canonical wins
        ({"x-session-id": "a", "x-session-token": "b"}, Priority.NORMAL, "a"),
        ({"x-session-token": "b"}, Priority.NORMAL, "b"),
    ],
)
def test_aliases_and_precedence(headers, priority, session):
    terms = parse_contract(headers, NOW, WALL_NS)
    assert terms.priority is priority and terms.session == session


def test_relative_and_absolute_deadlines_are_told_apart():
    relative = parse_contract({"x-anthropic-deadline-nanos": "150000000"}, NOW, WALL_NS)
    assert relative.deadline == pytest.approx(NOW + 0.150)
    absolute = parse_contract({"x-zerolayer-deadline-nanos": str(WALL_NS + 2 * 10**9)}, NOW, WALL_NS)
    assert absolute.deadline == pytest.approx(NOW + 2.0)


def test_ttft_slo_counts_only_before_the_first_token():
    terms = parse_contract({"x-slo-ttft-ms": "50", "x-zerolayer-deadline-nanos": "1000000000"}, NOW, WALL_NS)
    assert terms.effective_deadline(False) == pytest.approx(NOW + 0.05)
    assert terms.effective_deadline(True) == pytest.approx(NOW + 1.0)


@pytest.mark.parametrize(
    "headers, code",
    [
        ({"x-zerolayer-priority": "urgent"}, ErrorCode.INVALID_REQUEST),
        ({"x-zerolayer-deadline-nanos": "soon"}, ErrorCode.INVALID_REQUEST),
        ({"x-zerolayer-deadline-nanos": str(WALL_NS - 10**9)}, ErrorCode.DEADLINE_EXCEEDED),
        ({"x-slo-ttft-ms": "-1"}, ErrorCode.INVALID_REQUEST),
        ({"x-anthropic-output-format": "xml"}, ErrorCode.INVALID_REQUEST),
    ],
)
def test_bad_headers_are_refused_with_a_code(headers, code):
    with pytest.raises(RequestRefused) as err:
        parse_contract(headers, NOW, WALL_NS)
    assert err.value.code is code


def test_tenants_are_found_by_key_hash_only():
    acme = Tenant("acme", frozenset({key_hash("sk-acme")}), TenantPolicy("acme"))
    directory = TenantDirectory([acme])
    assert directory.authenticate({"x-api-key": "sk-acme"}) is acme
    assert directory.authenticate({"authorization": "Bearer sk-acme"}) is acme
    assert directory.authenticate({"authorization": "Basic sk-acme"}) is None
    assert directory.authenticate({"x-api-key": "sk-other"}) is None
    assert directory.authenticate({"x-tenant": "acme"}) is None  # naming a tenant is not authenticating


@pytest.mark.parametrize("code", list(ErrorCode))
@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_error_responses_follow_the_contract_table(code, api):
    status, headers, body = error_response(WIRES[api], RequestRefused(code, "why", retry_after_s=2.5))
    wire = ERRORS[code]
    h = dict(headers)
    assert status == wire.http_status
    assert h[contract.ERROR_HEADER] == code.value
    assert ("retry-after" in h) is wire.retryable
    assert h["x-should-retry"] == ("true" if wire.retryable else "false")
    if wire.retryable:
        assert h["retry-after"] == "3"
    data = json.loads(body)
    if api == "anthropic":
        assert data["type"] == "error" and data["error"]["type"] == wire.anthropic_type
    else:
        assert data["error"]["type"] == wire.openai_type and data["error"]["code"] == code.value


def test_protocol_doc_lists_every_error_code_and_header():
    doc = (REPO / "docs" / "protocol.md").read_text()
    for code, wire in ERRORS.items():
        assert f"`{code.value}`" in doc, code
        assert str(wire.http_status) in doc
    names = [*contract.SESSION, *contract.PRIORITY, *contract.MODEL_HINT, *contract.OUTPUT_FORMAT,
             *contract.DEADLINE_NANOS, *contract.SLO_TTFT_MS, *contract.API_KEY, contract.ERROR_HEADER,
             *contract.RATELIMIT_HEADERS, "retry-after", "authorization"]
    for name in names:
        assert f"`{name}`" in doc.lower(), name


def test_mandatory_headers_are_a_deployment_choice():
    parse_contract({}, NOW, WALL_NS)  # nothing is mandatory by default: unmodified SDKs must work
    with pytest.raises(RequestRefused, match="x-zerolayer-session") as err:
        parse_contract({"x-zerolayer-priority": "high"}, NOW, WALL_NS, required=["session"])
    assert err.value.code is ErrorCode.INVALID_REQUEST
    terms = parse_contract({"x-session-token": "s"}, NOW, WALL_NS, required=["session"])
    assert terms.session == "s"
