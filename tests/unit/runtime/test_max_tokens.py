"""``max_tokens: 0`` is refused with 400 INVALID_REQUEST naming the field, in both wire APIs
(it used to read as "unset" in the OpenAI parser and become the 256-token default)."""

from __future__ import annotations

import json

import pytest

from zerolayer.contract import ErrorCode
from zerolayer.runtime.api import anthropic, openai
from zerolayer.runtime.api.wire import error_response
from zerolayer.runtime.serving.gate import WIRES
from zerolayer.runtime.errors import RequestRefused

USER = [{"role": "user", "content": "hi"}]


def refused(parse, body: dict) -> RequestRefused:
    with pytest.raises(RequestRefused) as err:
        parse(json.dumps(body).encode())
    return err.value


@pytest.mark.parametrize("api, parse, field, value", [
    ("openai", openai.parse, "max_tokens", 0),
    ("openai", openai.parse, "max_completion_tokens", 0),
    ("openai", openai.parse, "max_tokens", -3),
    ("openai", openai.parse, "max_completion_tokens", 2.5),
    ("openai", openai.parse, "max_tokens", True),
    ("anthropic", anthropic.parse, "max_tokens", 0),
    ("anthropic", anthropic.parse, "max_tokens", -1),
    ("anthropic", anthropic.parse, "max_tokens", "8"),
])
def test_a_given_limit_below_one_is_a_400_naming_the_field(api, parse, field, value):
    err = refused(parse, {"model": "m", "messages": USER, field: value})
    assert err.code is ErrorCode.INVALID_REQUEST
    assert err.message.startswith(f"{field}:") and repr(value) in err.message
    status, _, body = error_response(WIRES[api], err)
    assert status == 400 and field in json.loads(body)["error"]["message"]


def test_openai_max_completion_tokens_zero_is_not_hidden_by_max_tokens():
    err = refused(openai.parse, {"model": "m", "messages": USER, "max_completion_tokens": 0, "max_tokens": 9})
    assert err.message.startswith("max_completion_tokens:")


@pytest.mark.parametrize("body, expected", [
    ({}, openai.DEFAULT_MAX_TOKENS),
    ({"max_tokens": None}, openai.DEFAULT_MAX_TOKENS),
    ({"max_tokens": 1}, 1),
    ({"max_tokens": 7, "max_completion_tokens": None}, 7),
    ({"max_tokens": 7, "max_completion_tokens": 3}, 3),
])
def test_openai_limit_when_valid_or_absent(body, expected):
    assert openai.parse(json.dumps({"model": "m", "messages": USER, **body}).encode()).max_tokens == expected


def test_anthropic_limit_is_required():
    err = refused(anthropic.parse, {"model": "m", "messages": USER})
    assert err.code is ErrorCode.INVALID_REQUEST and err.message.startswith("max_tokens:")
    assert anthropic.parse(json.dumps({"model": "m", "messages": USER, "max_tokens": 1}).encode()).max_tokens == 1
