"""The header contract and error decoding, table-driven (no I/O)."""

from __future__ import annotations

import json

import pytest

from zerolayer import contract
from zerolayer.client import errors, wire
from zerolayer.contract import ErrorCode, Priority


def test_contract_headers_use_canonical_names():
    c = wire.RequestContract(api_key="k", priority="high", session="s1", output_format="json", deadline_s=0.15)
    h = c.headers(model="tiny")
    assert h == {
        contract.API_KEY[0]: "k",
        contract.PRIORITY[0]: "high",
        contract.SESSION[0]: "s1",
        contract.MODEL_HINT[0]: "tiny",  # no hint configured: the model itself
        contract.OUTPUT_FORMAT[0]: "json",
        contract.DEADLINE_NANOS[0]: "150000000",  # the reference's relative 150 ms
    }
    assert int(h[contract.DEADLINE_NANOS[0]]) < contract.DEADLINE_ABSOLUTE_THRESHOLD_NS


def test_contract_retry_adjustments_and_defaults():
    c = wire.RequestContract(api_key="k", model_hint="big")
    assert c.priority is Priority.NORMAL and len(c.session) == 32
    h = c.headers(model="big", model_hint="small", deadline_s=2.0)
    assert h[contract.MODEL_HINT[0]] == "small" and h[contract.DEADLINE_NANOS[0]] == str(2 * 10**9)
    assert contract.DEADLINE_NANOS[0] not in wire.RequestContract(api_key="k", deadline_s=None).headers(model="m")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(api_key=""),
        dict(api_key="k", priority="urgent"),
        dict(api_key="k", session="a\r\nb"),
        dict(api_key="k", output_format="xml"),
        dict(api_key="k", deadline_s=0),
        dict(api_key="k", deadline_s=1e9),  # would read as an absolute time on the server
    ],
)
def test_contract_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        wire.RequestContract(**kwargs)


@pytest.mark.parametrize(
    "params, headers",
    [
        ({"priority": "high"}, None),
        ({"session": "other"}, None),
        ({"deadline": 1.0}, None),
        ({"model_hint": "x"}, None),
        ({}, {"X-Zerolayer-Priority": "high"}),
        ({}, {"x-anthropic-session": "s"}),
        ({}, {"Authorization": "Bearer other-tenant"}),
        ({}, {"x-slo-ttft-ms": "10"}),
    ],
)
def test_per_request_override_raises(params, headers):
    with pytest.raises(ValueError, match="fixed when the client is constructed"):
        wire.check_no_override(params, headers)


def test_unrelated_params_and_headers_pass():
    wire.check_no_override({"temperature": 0.2, "system": "x"}, {"x-trace": "1"})


def _body(code=None, etype="api_error", message="boom"):
    err = {"type": etype, "message": message}
    if code:
        err["code"] = code
    return json.dumps({"type": "error", "error": err}).encode()


@pytest.mark.parametrize(
    "status, headers, body, expected",
    [
        # the x-zerolayer-error header wins (529 is shared by GPU_OOM and RESOURCE_EXHAUSTED)
        (529, {"x-zerolayer-error": "GPU_OOM"}, _body(etype="overloaded_error"), errors.GpuOom),
        (529, {"x-zerolayer-error": "RESOURCE_EXHAUSTED"}, _body(etype="overloaded_error"), errors.ResourceExhausted),
        # no header: the body's code, then its type, then the status
        (529, {}, _body("GPU_OOM", "overloaded_error"), errors.GpuOom),
        (504, {}, _body(etype="timeout_error"), errors.DeadlineExceeded),
        (503, {}, _body(etype="overloaded_error"), errors.ModelUnavailable),
        (500, {}, b"not json", errors.InternalError),
        (502, {}, b"", errors.InternalError),
        (401, {}, b"", errors.AuthenticationError),
        (403, {}, _body(etype="permission_error"), errors.PermissionDeniedError),
        (429, {}, _body(etype="rate_limit_error"), errors.RateLimitError),
        (400, {}, _body(etype="invalid_request_error"), errors.BadRequestError),
        (404, {}, b"", errors.APIError),
    ],
)
def test_error_from_response(status, headers, body, expected):
    err = wire.error_from_response(status, headers, body, endpoint="http://n1")
    assert type(err) is expected
    assert err.status_code == status and err.endpoint == "http://n1"


def test_error_from_response_carries_retry_hints():
    err = wire.error_from_response(
        529,
        {"X-Zerolayer-Error": "RESOURCE_EXHAUSTED", "Retry-After": "2", "x-zerolayer-alternatives": "n2:80, http://n3:80/",
         "x-request-id": "r1"},
        _body(message="memory above 92%"),
    )  # fmt: skip
    assert isinstance(err, errors.ResourceExhausted)
    assert err.retry_after == 2.0 and err.alternatives == ("n2:80", "http://n3:80") and err.request_id == "r1"
    assert err.processed is False and err.message == "memory above 92%"
    assert "RESOURCE_EXHAUSTED" in str(err)


def test_retry_after_forms():
    assert wire.parse_retry_after({"retry-after-ms": "250"}) == 0.25
    assert wire.parse_retry_after({"retry-after": "1.5"}) == 1.5
    assert wire.parse_retry_after({"retry-after": "Thu, 01 Jan 1970 00:00:10 GMT"}, now=4.0) == 6.0
    assert wire.parse_retry_after({"retry-after": "soon"}) is None
    assert wire.parse_retry_after({}) is None


def test_every_vocabulary_code_has_a_class_that_round_trips():
    for code, wire_info in contract.ERRORS.items():
        err = wire.error_from_response(wire_info.http_status, {contract.ERROR_HEADER: code.value}, b"")
        assert err.code is code and isinstance(err, errors.ERROR_CLASSES[code])


def test_error_from_sse_event():
    data = json.dumps({"type": "error", "error": {"type": "overloaded_error", "message": "preempted", "code": "RESOURCE_EXHAUSTED"}})
    err = wire.error_from_sse(data, endpoint="e", tokens_delivered=3)
    assert isinstance(err, errors.ResourceExhausted) and err.tokens_delivered == 3 and err.processed is True
    # an Anthropic-only server: the type alone
    assert isinstance(wire.error_from_sse(json.dumps({"type": "error", "error": {"type": "api_error"}})), errors.InternalError)
    assert isinstance(wire.error_from_sse("garbage"), errors.InternalError)


@pytest.mark.parametrize(
    "code, expected, processed",
    [
        (contract.H2_REFUSED_STREAM, errors.StreamRefused, False),
        (contract.H2_INTERNAL_ERROR, errors.InternalError, True),
        (contract.H2_ENHANCE_YOUR_CALM, errors.RateLimitError, True),
        (contract.H2_CANCEL, errors.APIError, True),
    ],
)
def test_error_from_reset(code, expected, processed):
    err = wire.error_from_reset(code)
    assert type(err) is expected and err.processed is processed


def test_sse_decoder():
    d = wire.SSEDecoder()
    lines = ["event: message_start", 'data: {"a":', "data: 1}", "", ": comment", "data: x", ""]
    out = [e for e in map(d.feed, lines) if e]
    assert out == [wire.ServerSentEvent("message_start", '{"a":\n1}'), wire.ServerSentEvent("message", "x")]


def test_latency_header():
    assert wire.latency_header(0.0123, 0.5, "r1") == "request_id=r1,ttft_ms=12.3,total_ms=500.0"
    assert wire.latency_header(None, 0.25) == "total_ms=250.0"


def test_vocabulary_classes_are_one_family():
    for cls in errors.ERROR_CLASSES.values():
        assert issubclass(cls, errors.APIError) and issubclass(cls, errors.ZerolayerError)
    assert issubclass(errors.APITimeoutError, errors.APIConnectionError)
    assert {c for c in ErrorCode} == set(errors.ERROR_CLASSES)


def test_transport_errors_convert_at_the_boundary():
    import h2.events
    import h2.exceptions
    import httpcore
    import httpx

    from zerolayer.client import transport

    def chained(outer_cls, inner):
        try:
            try:
                raise httpcore.RemoteProtocolError(inner)
            except httpcore.RemoteProtocolError as exc:
                raise outer_cls(str(exc)) from exc
        except outer_cls as exc:
            return exc

    reset = h2.events.StreamReset(stream_id=1, error_code=contract.H2_REFUSED_STREAM)
    err = transport.convert_error(chained(httpx.RemoteProtocolError, reset), endpoint="e")
    assert isinstance(err, errors.StreamRefused) and err.processed is False and err.__cause__ is not None
    early = transport.convert_error(chained(httpx.LocalProtocolError, h2.exceptions.StreamClosedError(5)), endpoint="e")
    assert isinstance(early, errors.StreamRefused) and "before the request body" in str(early)
    gone = h2.events.ConnectionTerminated()
    gone.error_code, gone.last_stream_id = 0, 3
    assert transport.convert_error(chained(httpx.RemoteProtocolError, gone), endpoint="e").processed is None
    refused = transport.convert_error(httpx.ConnectError("refused"), endpoint="e")
    assert type(refused) is errors.APIConnectionError and refused.processed is False
    assert isinstance(transport.convert_error(httpx.ReadTimeout("slow"), endpoint="e"), errors.APITimeoutError)
    with pytest.raises(TypeError):
        transport.convert_error(KeyError("x"), endpoint="e")


def test_sdk_layering_imports_only_the_contract():
    """The SDK may depend on zerolayer.contract, never on the runtime or the operator."""
    import ast
    import pathlib

    root = pathlib.Path(errors.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                assert not name.startswith(("zerolayer.runtime", "zerolayer.operator", "zerolayer.cluster")), (path, name)
