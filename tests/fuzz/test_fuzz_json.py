"""Fuzz both JSON request parsers (runtime/api/anthropic.py, openai.py) and the error answer they lead to.

Contract: ``parse(body)`` returns a :class:`ChatRequest` whose every string is text (encodes as
UTF-8: the tokenizer and the engine get nothing else), or raises ``RequestRefused`` with
INVALID_REQUEST, which the application answers 400 with the API's error body and
``x-should-retry: false``. Nothing else may escape: an escaping exception is a 500 and a retry.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given

from tests.fuzz.seeds import reproducible
from tests.fuzz.strategies import bodies
from zerolayer.contract import ErrorCode
from zerolayer.runtime.api import anthropic, openai
from zerolayer.runtime.api.common import ChatRequest
from zerolayer.runtime.api.completions_wire import COMPLETIONS
from zerolayer.runtime.api.wire import error_response
from zerolayer.runtime.errors import RequestRefused
from zerolayer.runtime.serving.gate import WIRES

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(120)]

# Found by this test: json.loads accepts UTF-16/UTF-32 bodies, and finding 15's lone-surrogate
# guard looked for the escape in the raw bytes only, so this body reached the engine (500).
SURROGATE_UTF16 = '{"model":"synthetic","max_tokens":5,"messages":[{"role":"user","content":"a\\ud800b"}]}'.encode("utf-16-le")
SURROGATE_UTF32 = '{"model":"synthetic","max_tokens":5,"messages":[{"role":"user","content":"\\uDFFF"}]}'.encode("utf-32")

PARSE = {"anthropic": anthropic.parse, "openai": openai.parse, "completions": openai.parse_completions}


def check_parse(api: str, body: bytes) -> None:
    try:
        request = PARSE[api](body)
    except RequestRefused as refused:
        assert refused.code is ErrorCode.INVALID_REQUEST, refused.code
        check_error_answer(api, refused)
        return
    assert isinstance(request, ChatRequest)
    assert isinstance(request.max_tokens, int) and not isinstance(request.max_tokens, bool)
    assert request.max_tokens >= 1 or (request.echo and request.max_tokens == 0)
    if request.seed is not None:
        assert -2**63 <= request.seed < 2**63  # what vLLM can seed a generator with
    assert 1 <= request.choice_count <= 64
    for prompt in request.prompts:
        if isinstance(prompt, str):
            prompt.encode("utf-8")
        else:
            assert prompt and all(type(t) is int and t >= 0 for t in prompt)
    for text in (request.model, *request.stop, *(m.content for m in request.messages), *(m.role for m in request.messages)):
        assert isinstance(text, str)
        text.encode("utf-8")  # a lone surrogate here is a 500 in the engine's tokenizer
    # OpenAI's roles, or a custom one (vLLM's): a short name, which the chat template takes or refuses
    assert all(0 < len(m.role) <= 64 for m in request.messages)


def check_error_answer(api: str, refused: RequestRefused) -> None:
    """The answer the application sends for ``refused``: 4xx, the API's error JSON, not retryable."""
    status, headers, body = error_response(COMPLETIONS if api == "completions" else WIRES[api], refused)
    assert 400 <= status < 500, status
    head = dict(headers)
    assert head["x-zerolayer-error"] == refused.code.value and head["x-should-retry"] == "false"
    assert head["content-type"] == "application/json" and int(head["content-length"]) == len(body)
    document = json.loads(body)
    if api == "anthropic":
        assert document["type"] == "error" and set(document["error"]) == {"type", "message", "code"}
    else:
        assert set(document) == {"error"} and set(document["error"]) == {"message", "type", "param", "code"}
    assert document["error"]["code"] == refused.code.value and isinstance(document["error"]["message"], str)


@reproducible
@given(body=bodies("anthropic"))
@example(body=SURROGATE_UTF16)
@example(body=SURROGATE_UTF32)
def test_anthropic_parser_accepts_text_or_refuses_with_400(body):
    check_parse("anthropic", body)


@reproducible
@given(body=bodies("openai"))
@example(body=SURROGATE_UTF16)
@example(body=SURROGATE_UTF32)
def test_openai_parser_accepts_text_or_refuses_with_400(body):
    check_parse("openai", body)


@reproducible
@given(body=bodies("completions"))
def test_completions_parser_accepts_text_or_refuses_with_400(body):
    check_parse("completions", body)
