"""Forced tool calls as a structured output, the same way ``vllm serve`` does them.

``tool_choice`` ``"required"`` or a named function needs no model-specific tool-call parser: the
engine constrains the output with a JSON Schema derived from the tools, so whatever the weights,
the output is a well-formed call, and parsing it is reading that JSON back:

- a named function: the output is the function's arguments object;
- ``"required"``: the output is a list of ``{"name": ..., "parameters": {...}}`` (one item when
  parallel calls are off).

``"auto"`` (the model decides whether to call) is different: the model writes calls in its own
format, which only the model family's parser reads (vLLM's ``ToolParserManager``, see
vllm_engine.py). Engine-independent, so both engines share it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from zerolayer.runtime.engine.base import InputRejected, ToolCall, ToolSpec, ToolUse


def _parameters(tool: ToolSpec) -> dict[str, Any]:
    return json.loads(tool.parameters)


def forced_schema(use: ToolUse) -> dict[str, Any]:
    """The JSON Schema a forced choice constrains the output to (vLLM's own shapes).

    A named function's parameters are the whole schema, so their ``$defs`` stay where their
    ``#/$defs/...`` references point. For ``"required"`` each tool's parameters sit deeper in the
    schema: their ``$defs`` move to its root, merged, as vLLM's ``_get_json_schema_from_tools``
    does (pydantic puts every nested model there); one name defined differently by two tools is
    :class:`InputRejected`."""
    if use.choice == "function":
        return _parameters(named_tool(use))
    if use.choice != "required":
        raise ValueError(f"tool choice {use.choice!r} is not a forced one")
    items: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for tool in use.tools:
        parameters = _parameters(tool)
        own = parameters.pop("$defs", {}) if isinstance(parameters, dict) else {}
        if not isinstance(own, dict):
            raise InputRejected(f"tools: $defs in the parameters of {tool.name!r} must be an object")
        for name, definition in own.items():
            if name in defs and defs[name] != definition:
                raise InputRejected(f"tools: $defs/{name} is defined differently by two tools; "
                                    "give one definition per name")
            defs[name] = definition
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [tool.name]}, "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not use.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_tool(use: ToolUse) -> ToolSpec:
    """The tool a named forced choice (``"function"``) calls; :class:`InputRejected` if none is so named."""
    for tool in use.tools:
        if tool.name == use.function:
            return tool
    raise InputRejected(f"tool_choice names {use.function!r}, which is not among the tools")


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_forced(text: str, use: ToolUse) -> tuple[str, tuple[ToolCall, ...]]:
    """The calls in a forced output: ``("", calls)``. Output cut short (``max_tokens``) is not JSON:
    then ``(text, ())`` — the text is returned as it is, as vLLM does."""
    try:
        value = json.loads(text)
    except ValueError:
        return text, ()
    if use.choice == "function":
        if not isinstance(value, dict):
            return text, ()
        return "", (ToolCall(call_id(), named_tool(use).name, json.dumps(value, ensure_ascii=False)),)
    if not isinstance(value, list) or not all(
            isinstance(v, dict) and isinstance(v.get("name"), str) for v in value):
        return text, ()
    return "", tuple(ToolCall(call_id(), v["name"], json.dumps(v.get("parameters", {}), ensure_ascii=False))
                     for v in value)
