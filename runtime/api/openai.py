"""OpenAI Chat Completions: ``POST /v1/chat/completions`` (JSON and SSE chunks) and ``GET /v1/models``."""

from __future__ import annotations

from typing import Any

from zerolayer.contract import ERRORS, ErrorCode
from zerolayer.runtime.api.common import ChatRequest, dumps, invalid, load_json, number, sse, stops, text_of
from zerolayer.runtime.engine.base import ChatMessage

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "stop"}
DEFAULT_MAX_TOKENS = 256


def parse(body: bytes) -> ChatRequest:
    data = load_json(body)
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model: required string")
    raw = data.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages: required non-empty list")
    messages = []
    for i, message in enumerate(raw):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise invalid(f"messages[{i}].role must be system, developer, user or assistant")
        messages.append(ChatMessage(role, text_of(message.get("content"), f"messages[{i}].content")))
    max_tokens = output_limit(data)
    if data.get("n", 1) not in (1, None):
        raise invalid("n: only 1 is supported")
    priority = data.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise invalid("priority: must be an integer (lower runs first)")
    options = data.get("stream_options") or {}
    seed = data.get("seed")
    return ChatRequest(
        model=model,
        messages=tuple(messages),
        max_tokens=max_tokens,
        stream=bool(data.get("stream", False)),
        temperature=number(data, "temperature", 1.0, 0.0, 2.0),
        top_p=number(data, "top_p", 1.0, 0.0, 1.0),
        stop=stops(data.get("stop")),
        seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
        priority=priority,
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
    )


def output_limit(data: dict[str, Any]) -> int:
    """``max_completion_tokens`` (the current name), else ``max_tokens`` (the deprecated one), else
    :data:`DEFAULT_MAX_TOKENS` when neither is given (or both are null). A given value must be an
    integer >= 1: 0 is refused naming the field, never read as "unset"."""
    field = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    value = data.get(field)
    if value is None:
        return DEFAULT_MAX_TOKENS
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(f"{field}: must be an integer >= 1, got {value!r}")
    return value


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion(cid: str, created: int, model: str, text: str, finish: str, use: dict[str, int]) -> dict[str, Any]:
    return {
        "id": cid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": finish, "logprobs": None}],
        "usage": use,
    }


def chunk(cid: str, created: int, model: str, delta: dict[str, Any], finish: str | None,
          use: dict[str, int] | None = None, include_usage: bool = False) -> bytes:
    body: dict[str, Any] = {
        "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }
    if include_usage:
        body["usage"] = use
    return sse(None, body)


def usage_chunk(cid: str, created: int, model: str, use: dict[str, int]) -> bytes:
    return sse(None, {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                      "choices": [], "usage": use})


DONE = b"data: [DONE]\n\n"


def models(names: list[str], created: int) -> bytes:
    return dumps({"object": "list", "data": [
        {"id": n, "object": "model", "created": created, "owned_by": "zerolayer"} for n in names]})


def error_body(code: ErrorCode, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERRORS[code].openai_type, "param": None, "code": code.value}}


def stream_error(code: ErrorCode, message: str) -> bytes:
    return sse(None, error_body(code, message))


def error_json(code: ErrorCode, message: str) -> bytes:
    return dumps(error_body(code, message))
