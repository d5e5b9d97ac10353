"""The OpenAI stream's per-token fast path writes exactly the bytes the general chunk builder writes."""

from __future__ import annotations

import json
import types

from hypothesis import given, strategies as st

from zerolayer.runtime.api import openai
from zerolayer.runtime.api.openai_wire import OPENAI
from zerolayer.runtime.api.wire import StreamFrame
from zerolayer.runtime.engine.base import Delta, TokenLogprob


@given(text=st.text(st.characters(blacklist_categories=("Cs",))), index=st.integers(0, 300),
       model=st.text(min_size=1, max_size=40, alphabet=st.characters(blacklist_categories=("Cs",))),
       created=st.integers(0, 2**40))
def test_text_piece_is_stream_piece_byte_for_byte(text: str, index: int, model: str, created: int) -> None:
    delta = Delta(text, 1, index=index)
    expected = openai.stream_piece("chatcmpl-abc", created, model, delta)
    assert openai.text_piece("chatcmpl-abc", created, model, index, text) == expected
    assert json.loads(expected[len(b"data: "):])["choices"][0]["delta"]["content"] == text


def _frame(**fields) -> StreamFrame:  # type: ignore[no-untyped-def]
    settings = {"model": "m", "n": 1, "include_usage": False, "continuous_usage": False, "logprobs": None,
                "tool_use": None, **fields}
    request = types.SimpleNamespace(**settings)
    return StreamFrame("chatcmpl-x", 1767225600, request)  # type: ignore[arg-type]


def test_the_wire_takes_the_general_path_whenever_a_chunk_carries_more_than_text() -> None:
    delta = Delta("hi", 1, logprobs=(TokenLogprob("hi", -1.0),))
    plain = OPENAI.stream_delta(_frame(), delta)
    assert plain == openai.stream_piece("chatcmpl-x", 1767225600, "m", delta)
    with_logprobs = OPENAI.stream_delta(_frame(logprobs=0), delta)
    assert json.loads(with_logprobs[6:])["choices"][0]["logprobs"] is not None
    with_usage = OPENAI.stream_delta(_frame(include_usage=True), delta)
    assert "usage" in json.loads(with_usage[6:])
