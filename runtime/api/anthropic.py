"""Anthropic Messages API: ``POST /v1/messages`` (JSON and ``stream: true`` SSE)."""

from __future__ import annotations

from typing import Any

from zerolayer.contract import ERRORS, ErrorCode
from zerolayer.runtime.api.common import ChatRequest, dumps, invalid, load_json, number, sse, stops, text_of
from zerolayer.runtime.engine.base import ChatMessage

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}


def parse(body: bytes) -> ChatRequest:
    data = load_json(body)
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model: required string")
    max_tokens = data.get("max_tokens")
    if max_tokens is None:
        raise invalid("max_tokens: required integer >= 1")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise invalid(f"max_tokens: must be an integer >= 1, got {max_tokens!r}")
    raw = data.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages: required non-empty list")
    messages: list[ChatMessage] = []
    system = data.get("system")
    if system is not None:
        messages.append(ChatMessage("system", text_of(system, "system")))
    for i, message in enumerate(raw):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise invalid(f"messages[{i}].role must be 'user' or 'assistant'")
        messages.append(ChatMessage(message["role"], text_of(message.get("content"), f"messages[{i}].content")))
    seed = (data.get("metadata") or {}).get("seed") if isinstance(data.get("metadata"), dict) else None
    return ChatRequest(
        model=model,
        messages=tuple(messages),
        max_tokens=max_tokens,
        stream=bool(data.get("stream", False)),
        temperature=number(data, "temperature", 1.0, 0.0, 1.0),
        top_p=number(data, "top_p", 1.0, 0.0, 1.0),
        stop=stops(data.get("stop_sequences")),
        seed=seed if isinstance(seed, int) else None,
    )


def message(msg_id: str, model: str, text: str, stop_reason: str | None, usage: dict[str, int]) -> dict[str, Any]:
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": usage,
    }


def stream_start(msg_id: str, model: str, input_tokens: int) -> bytes:
    start = {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }
    return (
        sse("message_start", {"type": "message_start", "message": start})
        + sse("content_block_start", {"type": "content_block_start", "index": 0,
                                      "content_block": {"type": "text", "text": ""}})
        + sse("ping", {"type": "ping"})
    )


def stream_delta(text: str) -> bytes:
    return sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": text}})


def stream_end(stop_reason: str, input_tokens: int, output_tokens: int) -> bytes:
    return (
        sse("content_block_stop", {"type": "content_block_stop", "index": 0})
        + sse("message_delta", {"type": "message_delta",
                                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}})
        + sse("message_stop", {"type": "message_stop"})
    )


def error_body(code: ErrorCode, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERRORS[code].anthropic_type, "message": message, "code": code.value}}


def stream_error(code: ErrorCode, message: str) -> bytes:
    return sse("error", error_body(code, message))


def error_json(code: ErrorCode, message: str) -> bytes:
    return dumps(error_body(code, message))
