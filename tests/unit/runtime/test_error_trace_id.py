"""Issue 30: an error names the request's trace inside its error object (both wire formats, before
headers and mid-stream), and the official SDKs still parse it as the error they know."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from zerolayer.contract import ErrorCode
from zerolayer.runtime.api.anthropic_wire import ANTHROPIC
from zerolayer.runtime.api.completions_wire import COMPLETIONS
from zerolayer.runtime.api.openai_wire import OPENAI
from zerolayer.runtime.api.wire import error_response
from zerolayer.runtime.errors import RequestRefused
from zerolayer.runtime.serving.tracing import Timeline, trace_id_of

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
WIRES = {"anthropic": ANTHROPIC, "openai": OPENAI, "completions": COMPLETIONS}


@pytest.mark.parametrize("api", sorted(WIRES))
@pytest.mark.parametrize("trace_id", [TRACE, None])
def test_the_error_object_carries_the_trace_id_only_when_given(api, trace_id):
    _, _, body = error_response(WIRES[api], RequestRefused(ErrorCode.GPU_OOM, "full"), trace_id)
    error = json.loads(body)["error"]
    assert error["code"] == "GPU_OOM" and error.get("trace_id") == trace_id and ("trace_id" in error) is bool(trace_id)
    event = WIRES[api].stream_error(ErrorCode.GPU_OOM, "full", trace_id).decode()
    data = json.loads(next(line for line in event.splitlines() if line.startswith("data:"))[5:])
    assert data["error"].get("trace_id") == trace_id


@pytest.mark.parametrize("sdk, api, path, kind", [
    (anthropic.Anthropic, "anthropic", "/v1/messages", anthropic.RateLimitError),
    (openai.OpenAI, "openai", "/v1/chat/completions", openai.RateLimitError),
])
def test_the_official_sdks_parse_an_error_that_names_its_trace(sdk, api, path, kind):
    status, headers, body = error_response(WIRES[api], RequestRefused(ErrorCode.RATE_LIMITED, "slow down"), TRACE)
    response = httpx.Response(status, headers=headers, content=body,
                              request=httpx.Request("POST", f"http://runtime.test{path}"))
    error = sdk(api_key="k", base_url="http://runtime.test")._make_status_error_from_response(response)
    assert isinstance(error, kind) and "slow down" in error.message
    inner = error.body["error"] if api == "anthropic" else error.body  # openai's body is the error object
    assert inner["trace_id"] == TRACE and inner["code"] == "RATE_LIMITED"


@pytest.mark.parametrize("traceparent, expected", [
    (f"00-{TRACE}-00f067aa0ba902b7-01", TRACE),
    (f"00-{TRACE}-0000000000000000-01", None),  # invalid parent id
    ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", None),  # invalid trace id
    ("garbage", None),
    (None, None),
])
def test_trace_id_of_a_traceparent(traceparent, expected):
    assert trace_id_of(traceparent) == expected
    timeline = Timeline(traceparent, 1.0, 1.0)  # a traced request keeps a valid client trace, else starts its own
    assert (f"{timeline.trace_id:032x}" == TRACE) is (expected is not None)
