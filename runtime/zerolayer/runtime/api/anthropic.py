"""Anthropic Messages API: ``POST /v1/messages`` (JSON and ``stream: true`` SSE)."""

from __future__ import annotations

import json
from typing import Any, Sequence

from zerolayer.contract import ERRORS, ErrorCode
from zerolayer.runtime.api.common import (
    ChatRequest, Choice, ContentBlocks, Neutral, check_fields, dumps, integer, invalid, is_none,
    json_schema_text, load_json, number, one_of, seed as seed_of, sse, stops, text_of, top_k, user_id)
from zerolayer.runtime.engine.base import ChatMessage, ToolCall, ToolCallPiece, ToolSpec, ToolUse

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}

# Every Messages field is honoured, refused with a reason (unless sent with its neutral value), or
# unknown (400). docs/api-fields.md is the same table in prose.
HONOURED = frozenset({
    "model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
    "metadata", "tools", "tool_choice",
})
REFUSED: dict[str, tuple[str, Neutral]] = {
    "thinking": ("the models served have no extended-thinking mode",
                 lambda v: v is None or v == {"type": "disabled"}),
    "service_tier": ("one tier; priority is the x-anthropic-priority header", one_of("auto", "standard_only")),
    "container": ("no code-execution container runs here", is_none),
    "mcp_servers": ("no MCP connector runs here", lambda v: v is None or v == []),
    "context_management": ("context is not edited server-side", is_none),
}
# POST /v1/messages/count_tokens: the Messages body without the generation fields (the official
# API's own list); docs/api-fields.md has its table too.
COUNT_HONOURED = frozenset({"model", "messages", "system", "tools", "tool_choice"})
COUNT_REFUSED = {field: REFUSED[field] for field in ("thinking", "mcp_servers", "context_management")}
METADATA_FIELDS = frozenset({"user_id", "seed"})  # seed: zerolayer's extension (the API has none)
MESSAGE_FIELDS = frozenset({"role", "content"})
TOOL_FIELDS = frozenset({"name", "description", "input_schema", "type", "cache_control"})
# What the SDK's own ToolUseBlock carries when an answer's content is sent back as history.
TOOL_USE_REFUSED: dict[str, tuple[str, Neutral]] = {
    "caller": ("only direct calls: server-side (programmatic) tool calling does not run here",
               lambda v: v is None or v == {"type": "direct"}),
    "toolset_name": ("toolsets (MCP) do not run here", is_none),
}


def parse(body: bytes) -> ChatRequest:
    data = load_json(body)
    check_fields(data, HONOURED, REFUSED)
    return _request(data, counting=False)


def parse_count(body: bytes) -> ChatRequest:
    """A ``/v1/messages/count_tokens`` body: the same conversation as a Messages request (same
    checks, same rendering), with no generation fields; ``max_tokens`` is 0 (nothing is generated)."""
    data = load_json(body)
    check_fields(data, COUNT_HONOURED, COUNT_REFUSED)
    return _request(data, counting=True)


def _request(data: dict[str, Any], counting: bool) -> ChatRequest:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model: required string")
    max_tokens = 0 if counting else data.get("max_tokens")  # counting: nothing is generated
    if max_tokens is None:
        raise invalid("max_tokens: required integer >= 1")
    if not counting and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
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
        check_fields(message, MESSAGE_FIELDS, {}, f"messages[{i}].")
        messages.extend(_turn(message["role"], message.get("content"), f"messages[{i}].content"))
    metadata = data.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise invalid("metadata must be an object")
    check_fields(metadata, METADATA_FIELDS, {}, "metadata.")
    seed = seed_of(metadata, "seed", "metadata.")
    tools, tool_use = _tools(data)
    # A last assistant turn is a prefill: the answer continues it (the API's own rule), not a new turn.
    continue_final = raw[-1].get("role") == "assistant"
    if continue_final and messages[-1].tool_calls:
        raise invalid("the last assistant message is a prefill the answer continues: it cannot end in tool_use")
    return ChatRequest(
        model=model,
        messages=tuple(messages),
        max_tokens=max_tokens,
        stream=bool(data.get("stream", False)),
        temperature=number(data, "temperature", 1.0, 0.0, 1.0),
        top_p=number(data, "top_p", 1.0, 0.0, 1.0),
        top_k=top_k(data),
        stop=stops(data.get("stop_sequences")),
        seed=seed,
        tools=tools,
        tool_use=tool_use,
        continue_final=continue_final,
        user=user_id(metadata.get("user_id"), "metadata.user_id"),
    )


def _turn(role: str, content: Any, where: str) -> list[ChatMessage]:
    """One Messages turn as chat messages: an assistant turn's ``tool_use`` blocks become its tool calls;
    a user turn's ``tool_result`` blocks become tool messages (before the turn's own text)."""
    if isinstance(content, str) or not isinstance(content, list):
        return [ChatMessage(role, text_of(content, where))]
    texts, calls, results, thinking = [], [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}[{j}]"
        if kind == "thinking" and role == "assistant":
            # An earlier turn's reasoning sent back as history: to the template as the turn's reasoning,
            # as vLLM's Messages API passes it (the signature checks Anthropic's own, nothing to check here).
            check_fields(block, frozenset({"type", "thinking", "signature", "cache_control"}), {}, f"{at}.")
            if not isinstance(block.get("thinking"), str):
                raise invalid(f"{at}.thinking: required string")
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            raise invalid(f"{at}: redacted_thinking: not supported: its reasoning is encrypted for Anthropic's "
                          "models and cannot be read here; leave the block out")
        elif kind == "thinking":
            raise invalid(f"{at}: only assistant turns carry thinking blocks")
        elif kind == "tool_use" and role == "assistant":
            check_fields(block, frozenset({"type", "id", "name", "input", "cache_control"}), TOOL_USE_REFUSED, f"{at}.")
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input"), dict):
                raise invalid(f"{at}: tool_use needs id, name and an input object")
            calls.append(ToolCall(block["id"], block["name"], json.dumps(block["input"], ensure_ascii=False)))
        elif kind == "tool_result" and role == "user":
            check_fields(block, frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}), {},
                         f"{at}.")
            if not isinstance(block.get("tool_use_id"), str):
                raise invalid(f"{at}.tool_use_id: required string")
            result = block.get("content", "")
            text = text_of(result, f"{at}.content")
            if block.get("is_error"):
                text = f"Error: {text}"  # the template has no error flag: the model reads it in the text
            results.append(ChatMessage("tool", text, tool_call_id=block["tool_use_id"]))
        else:
            texts.append(text_of([block], where))
    out = results
    if texts or calls or thinking or not results:
        out = out + [ChatMessage(role, "".join(texts), tool_calls=tuple(calls),
                                 reasoning="\n".join(thinking) if thinking else None)]
    return out


def _tools(data: dict[str, Any]) -> tuple[tuple[ToolSpec, ...], ToolUse | None]:
    raw = data.get("tools")
    choice = data.get("tool_choice")
    if choice is not None and not (isinstance(choice, dict) and choice.get("type") in ("auto", "any", "tool", "none")):
        raise invalid("tool_choice.type must be auto, any, tool or none")
    if not raw:
        if choice is not None and choice.get("type") != "none":
            raise invalid("tool_choice needs tools")
        return (), None
    if not isinstance(raw, list):
        raise invalid("tools must be a list")
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            raise invalid(f"tools[{i}]: only client tools (name, description, input_schema) are supported; "
                          "server tools do not run here")
        check_fields(tool, TOOL_FIELDS, {}, f"tools[{i}].")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise invalid(f"tools[{i}].name: required string")
        description = tool.get("description") or ""
        if not isinstance(description, str):
            raise invalid(f"tools[{i}].description must be a string")
        tools.append(ToolSpec(tool["name"], description, json_schema_text(tool.get("input_schema"),
                                                                          f"tools[{i}].input_schema")))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid("tools: names must be unique")
    choice = choice or {"type": "auto"}
    check_fields(choice, frozenset({"type", "name", "disable_parallel_tool_use"}), {}, "tool_choice.")
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice["type"]
    if kind == "none":
        return tuple(tools), None
    if kind == "tool":
        if choice.get("name") not in names:
            raise invalid(f"tool_choice names {choice.get('name')!r}, which is not among the tools")
        return tuple(tools), ToolUse(tuple(tools), "function", choice["name"], parallel=False)
    return tuple(tools), ToolUse(tuple(tools), "required" if kind == "any" else "auto", parallel=parallel)


def stop_reason(choice: Choice) -> str:
    """``tool_use`` when the model called tools, ``stop_sequence`` when one of the request's ended it."""
    if choice.tool_calls:
        return "tool_use"
    if choice.finish == "stop" and choice.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(choice.finish, "end_turn")


def content_blocks(choice: Choice) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": choice.text}] if choice.text or not choice.tool_calls \
        else []
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}
               for c in choice.tool_calls]
    return blocks


def message(msg_id: str, model: str, text: str, stop_reason: str | None, usage: dict[str, int]) -> dict[str, Any]:
    return message_of(msg_id, model, Choice(0, text, "stop"), usage, stop_reason)


def message_of(msg_id: str, model: str, choice: Choice, usage: dict[str, int],
               reason: str | None = None) -> dict[str, Any]:
    """A ``message`` object for a finished choice (``reason`` overrides the derived stop reason)."""
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(choice),
        "stop_reason": reason or stop_reason(choice),
        "stop_sequence": choice.stop_sequence if choice.finish == "stop" and not choice.tool_calls else None,
        "usage": usage,
    }


def stream_start(msg_id: str, model: str, input_tokens: int, text_block: bool = True) -> bytes:
    """``message_start`` and ``ping``, and (``text_block``) the opening of text block 0."""
    start: dict[str, Any] = {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }
    opening = sse("message_start", {"type": "message_start", "message": start})
    if text_block:
        opening += sse("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "text", "text": ""}})
    return opening + sse("ping", {"type": "ping"})


def stream_delta(text: str, index: int = 0) -> bytes:
    return sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                       "delta": {"type": "text_delta", "text": text}})


def stream_piece(blocks: ContentBlocks, text: str, calls: Sequence[ToolCallPiece] = ()) -> bytes:
    """One delta's text and tool-call pieces as content-block events. Text goes to the open text
    block (one is opened, closing the open ``tool_use`` block, when text follows a call); a call's
    first piece closes the open block and opens its ``tool_use`` block (``input`` ``{}``), and its
    arguments follow as ``input_json_delta`` ``partial_json`` fragments, as the Messages API streams."""
    if not calls and blocks.open == "text":
        return stream_delta(text, blocks.count - 1) if text else b""
    out = b""
    if text:
        if blocks.open != "text":
            out += _open_block(blocks, "text", {"type": "text", "text": ""})
        out += stream_delta(text, blocks.count - 1)
    for piece in calls:
        if piece.index not in blocks.calls:
            out += _open_block(blocks, "tool_use", {"type": "tool_use", "id": piece.id, "name": piece.name,
                                                    "input": {}})
            blocks.calls[piece.index] = blocks.count - 1
        if piece.arguments:
            out += sse("content_block_delta", {"type": "content_block_delta", "index": blocks.calls[piece.index],
                                               "delta": {"type": "input_json_delta",
                                                         "partial_json": piece.arguments}})
    return out


def _open_block(blocks: ContentBlocks, kind: str, block: dict[str, Any]) -> bytes:
    """Close the open block, if any, and open ``block`` as the next one."""
    out = _close_block(blocks)
    out += sse("content_block_start", {"type": "content_block_start", "index": blocks.count, "content_block": block})
    blocks.count += 1
    blocks.open = kind
    return out


def _close_block(blocks: ContentBlocks) -> bytes:
    if blocks.open is None:
        return b""
    blocks.open = None
    return sse("content_block_stop", {"type": "content_block_stop", "index": blocks.count - 1})


def stream_end(stop_reason: str, input_tokens: int, output_tokens: int, stop_sequence: str | None = None,
               close_block: bool = True) -> bytes:
    """The closing events; ``close_block``: text block 0 is still open (it was streamed as it came)."""
    head = sse("content_block_stop", {"type": "content_block_stop", "index": 0}) if close_block else b""
    return (
        head
        + sse("message_delta", {"type": "message_delta",
                                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}})
        + sse("message_stop", {"type": "message_stop"})
    )


def stream_close(choice: Choice, input_tokens: int, output_tokens: int, blocks: ContentBlocks) -> bytes:
    """The end of a stream: the open block closed (an answer that opened none gets an empty text
    block, as its non-streamed content has one), then the stop reason (with the matched
    ``stop_sequence``), which is the whole output's, parsed as the non-streamed answer is."""
    head = _close_block(blocks)
    if blocks.count == 0:
        head += _open_block(blocks, "text", {"type": "text", "text": ""}) + _close_block(blocks)
    sequence = choice.stop_sequence if stop_reason(choice) == "stop_sequence" else None
    return head + stream_end(stop_reason(choice), input_tokens, output_tokens, sequence, close_block=False)


def error_body(code: ErrorCode, message: str, trace_id: str | None = None) -> dict[str, Any]:
    """The error object; ``trace_id`` (the request's trace, 32 hex digits) rides inside it as one more
    field, which the official SDKs keep in the error's ``body`` without parsing it."""
    error = {"type": ERRORS[code].anthropic_type, "message": message, "code": code.value}
    if trace_id is not None:
        error["trace_id"] = trace_id
    return {"type": "error", "error": error}


def stream_error(code: ErrorCode, message: str, trace_id: str | None = None) -> bytes:
    return sse("error", error_body(code, message, trace_id))


def error_json(code: ErrorCode, message: str, trace_id: str | None = None) -> bytes:
    return dumps(error_body(code, message, trace_id))
