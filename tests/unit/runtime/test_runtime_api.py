"""Request parsing and response shapes of the two wire APIs."""

from __future__ import annotations

import json

import pytest

from zerolayer.runtime.api import anthropic, openai
from zerolayer.runtime.errors import RequestRefused


def events(sse: bytes) -> list[tuple[str | None, dict]]:
    out = []
    for block in sse.decode().strip().split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        out.append((name, json.loads(data) if data and data != "[DONE]" else data))
    return out


def test_anthropic_parse_with_system_and_blocks():
    req = anthropic.parse(json.dumps({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "be brief"}], "stream": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    }).encode())
    assert [m.role for m in req.messages] == ["system", "user"] and req.stream and req.max_tokens == 5


@pytest.mark.parametrize("body", [
    b"not json", b"[]", b'{"model":"m","messages":[{"role":"user","content":"x"}]}',  # max_tokens missing
    b'{"model":"m","max_tokens":1,"messages":[]}',
    b'{"model":"m","max_tokens":1,"messages":[{"role":"tool","content":"x"}]}',
    b'{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"image"}]}]}',
])
def test_anthropic_bad_bodies(body):
    with pytest.raises(RequestRefused):
        anthropic.parse(body)


def test_anthropic_stream_event_sequence():
    sse = anthropic.stream_start("id", "m", 7) + anthropic.stream_delta("hi") + anthropic.stream_end("end_turn", 7, 1)
    names = [name for name, _ in events(sse)]
    assert names == ["message_start", "content_block_start", "ping", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert events(sse)[0][1]["message"]["usage"]["input_tokens"] == 7
    assert events(sse)[5][1]["usage"]["output_tokens"] == 1


def test_openai_parse_priority_and_defaults():
    req = openai.parse(json.dumps({"model": "m", "messages": [{"role": "developer", "content": "x"}],
                                   "priority": 5, "stream": True,
                                   "stream_options": {"include_usage": True}}).encode())
    assert req.priority == 5 and req.include_usage and req.messages[0].role == "system"
    assert req.max_tokens == openai.DEFAULT_MAX_TOKENS


@pytest.mark.parametrize("body", [
    b'{"model":"m","messages":[{"role":"user","content":"x"}],"n":0}',
    b'{"model":"m","messages":[{"role":"user","content":"x"}],"priority":"high"}',
    b'{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":3}',
])
def test_openai_bad_bodies(body):
    with pytest.raises(RequestRefused):
        openai.parse(body)


def test_openai_stream_ends_with_done_and_usage_chunk():
    sse = openai.chunk("c", 1, "m", {"content": "a"}, None) + openai.usage_chunk("c", 1, "m", openai.usage(3, 1)) \
        + openai.DONE
    parsed = events(sse)
    assert parsed[-1] == (None, "[DONE]")
    assert parsed[1][1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
