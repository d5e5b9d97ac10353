"""What both wire APIs parse into, and the helpers they share."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from zerolayer.contract import ErrorCode
from zerolayer.runtime.engine.base import ChatMessage
from zerolayer.runtime.errors import RequestRefused


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    max_tokens: int
    stream: bool
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    priority: int | None = None  # OpenAI's body field (vLLM convention: lower first)
    include_usage: bool = False  # OpenAI stream_options.include_usage


def invalid(message: str) -> RequestRefused:
    return RequestRefused(ErrorCode.INVALID_REQUEST, message, reason="invalid_body")


# A JSON escape of a UTF-16 surrogate (\ud800-\udfff): the only way a lone surrogate gets into a str.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_ASCII_COMPATIBLE = ("utf-8", "utf-8-sig")  # encodings json.detect_encoding names in which that pattern is found


def load_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or INVALID_REQUEST: bad JSON, nesting deeper than the parser
    allows, or a lone surrogate escape (valid JSON, but not Unicode: it cannot be encoded)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise invalid("body is nested too deeply") from None
    if not isinstance(data, dict):
        raise invalid("body must be a JSON object")
    # json.loads also takes UTF-16 and UTF-32 bodies, where the escape's bytes are not ASCII: walk
    # those always (found by tests/fuzz/test_fuzz_json.py).
    suspect = json.detect_encoding(body) not in _ASCII_COMPATIBLE or _SURROGATE_ESCAPE.search(body)
    if suspect and not _encodable(data):
        raise invalid("body contains a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is not text")
    return data


def _encodable(data: Any) -> bool:
    """Every string (keys too) encodes as UTF-8. Iterative: the parser already allowed deep nesting."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def text_of(content: Any, where: str) -> str:
    """A message's content: a string or a list of ``{"type": "text", "text": ...}`` blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise invalid(f"{where}: only text content blocks are supported")
            parts.append(block["text"])
        return "".join(parts)
    raise invalid(f"{where}: content must be a string or a list of text blocks")


def number(data: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = data.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise invalid(f"{key} must be a number in [{lo}, {hi}]")
    return float(value)


# Stop sequences are matched on every generated token in the shared engine: bounded, so one
# tenant's request cannot make every step slower for everyone (docs/security.md, finding 26).
MAX_STOP_SEQUENCES = 16
MAX_STOP_SEQUENCE_CHARS = 256


def stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        raise invalid("stop sequences must be a string or a list of strings")
    if len(value) > MAX_STOP_SEQUENCES:
        raise invalid(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(value)}")
    if any(len(s) > MAX_STOP_SEQUENCE_CHARS for s in value):
        raise invalid(f"a stop sequence may be at most {MAX_STOP_SEQUENCE_CHARS} characters")
    return tuple(value)


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def sse(event: str | None, data: Any) -> bytes:
    payload = data if isinstance(data, bytes) else dumps(data)
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + payload + b"\n\n"
