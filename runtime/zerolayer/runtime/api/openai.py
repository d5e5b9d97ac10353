"""OpenAI: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON and SSE chunks), ``GET /v1/models``."""

from __future__ import annotations

import functools
import json
from typing import Any, Mapping, Sequence

from zerolayer.contract import ERRORS, ErrorCode
from zerolayer.runtime.api.common import (
    MAX_N, ChatRequest, Choice, Neutral, check_fields, dumps, integer, invalid, is_none, json_schema_text,
    load_json, logit_bias, number, one_of, seed, sse, stops, text_of, top_k, user_id)
from zerolayer.runtime.engine.base import (
    ChatMessage, StructuredOutput, TokenLogprob, ToolCall, ToolCallPiece, ToolSpec, ToolUse)

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "stop"}
DEFAULT_MAX_TOKENS = 256
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vllm serve's default for /v1/completions
# Logprob alternatives: the engine's own bound applies (vLLM's max_logprobs, 20 unless the node sets
# it): a request above it is refused by the engine, naming it. This only keeps the number sane.
MAX_LOGPROBS = 1 << 20
MAX_PROMPTS = 64  # /v1/completions prompts in one request, times n: each is a full generation

# Every Chat Completions field is honoured, refused with a reason (unless sent with its neutral value),
# or unknown (400). docs/api-fields.md is the same table in prose; tests/unit/runtime/test_api_fields_docs.py
# keeps them equal.
CHAT_HONOURED = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "temperature",
    "top_p", "top_k", "stop", "seed", "n", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls", "user",
    "safety_identifier", "prompt_cache_key", "priority", "continue_final_message", "ignore_eos",
    "structured_outputs", "chat_template_kwargs", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
})
CHAT_REFUSED: dict[str, tuple[str, Neutral]] = {
    "audio": ("the models served are text-only", is_none),
    "modalities": ("the models served produce text only", lambda v: v is None or v == ["text"]),
    "functions": ("deprecated by OpenAI: use tools", is_none),
    "function_call": ("deprecated by OpenAI: use tool_choice", is_none),
    "prediction": ("predicted outputs (speculative decoding from a given text) are not offered", is_none),
    "reasoning_effort": ("the models served have no reasoning-effort control", is_none),
    "verbosity": ("the models served have no verbosity control", is_none),
    "service_tier": ("one tier; priority is the x-anthropic-priority header or the priority field",
                     one_of("auto", "default")),
    "store": ("completions are not stored", one_of(False)),
    "metadata": ("metadata tags stored completions, which are not kept", lambda v: v is None or v == {}),
    "web_search_options": ("no web search tool runs here", is_none),
    "prompt_cache_retention": ("cached prefixes live as long as KV memory allows", is_none),
}
COMPLETIONS_HONOURED = frozenset({
    "model", "prompt", "max_tokens", "stream", "stream_options", "temperature", "top_p", "top_k", "stop", "seed",
    "n", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user", "priority", "ignore_eos",
    "echo", "structured_outputs", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
})
COMPLETIONS_REFUSED: dict[str, tuple[str, Neutral]] = {
    "suffix": ("insertion (fill-in-the-middle) is not offered", lambda v: v is None or v == ""),
    "best_of": ("server-side best-of is not offered (vLLM V1 dropped it): use n", one_of(1)),
}
# name, reasoning (vLLM's; reasoning_content its older name): passed to the chat template, as vLLM does.
MESSAGE_FIELDS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name", "reasoning",
                            "reasoning_content"})
MESSAGE_REFUSED: dict[str, tuple[str, Neutral]] = {
    "refusal": ("refusals are not replayed to the model", is_none),
    "annotations": ("URL citations are not passed to the model", lambda v: v is None or v == []),
    "audio": ("the models served are text-only", is_none),
    "function_call": ("deprecated by OpenAI: use tool_calls", is_none),
}


def parse(body: bytes) -> ChatRequest:
    """A ``/v1/chat/completions`` body."""
    data = load_json(body)
    check_fields(data, CHAT_HONOURED, CHAT_REFUSED)
    model = _model(data)
    raw = data.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages: required non-empty list")
    messages = tuple(_message(m, i) for i, m in enumerate(raw))
    tools, tool_use = _tools(data)
    continue_final = data.get("continue_final_message", False)
    if not isinstance(continue_final, bool):
        raise invalid("continue_final_message must be a boolean")
    if continue_final and messages[-1].role != "assistant":
        raise invalid("continue_final_message: the last message must be the assistant's prefill")
    top = integer(data, "top_logprobs", 0, MAX_LOGPROBS)
    wants_logprobs = data.get("logprobs")
    if wants_logprobs is not None and not isinstance(wants_logprobs, bool):
        raise invalid("logprobs must be a boolean (top_logprobs says how many alternatives)")
    if top is not None and not wants_logprobs:
        raise invalid("top_logprobs needs logprobs: true")
    return ChatRequest(
        messages=messages,
        max_tokens=output_limit(data),
        **_sampling(data, model),
        logprobs=(top or 0) if wants_logprobs else None,
        structured=_structured(data),
        tools=tools,
        tool_use=tool_use,
        continue_final=continue_final,
        template_kwargs=_template_kwargs(data.get("chat_template_kwargs")),
    )


def parse_completions(body: bytes) -> ChatRequest:
    """A ``/v1/completions`` body: one prompt or several (strings, token ids, lists of token ids),
    each tokenized without a template; ``echo`` puts each prompt before its completions."""
    data = load_json(body)
    check_fields(data, COMPLETIONS_HONOURED, COMPLETIONS_REFUSED)
    model = _model(data)
    prompts = _prompts(data.get("prompt"))
    echo = data.get("echo", False)
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise invalid("echo must be a boolean")
    given = data.get("logprobs")
    if type(given) is int and given < 0:
        raise invalid("logprobs: -1 (every token of the vocabulary) is not offered; give how many alternatives")
    logprobs = integer(data, "logprobs", 0, MAX_LOGPROBS)
    if echo and logprobs is not None:
        raise invalid("echo with logprobs: not supported: the prompt's logprobs are not returned; "
                      "send echo or logprobs, not both")
    value = data.get("max_tokens")
    if value is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    elif isinstance(value, bool) or not isinstance(value, int) or value < (0 if echo else 1):
        raise invalid(f"max_tokens: must be an integer >= 1 (0 only with echo), got {value!r}")
    else:
        max_tokens = value
    sampling = _sampling(data, model)
    if len(prompts) * sampling["n"] > MAX_PROMPTS:
        raise invalid(f"prompt: {len(prompts)} prompts times n={sampling['n']} is more than {MAX_PROMPTS} completions")
    return ChatRequest(messages=(), max_tokens=max_tokens, prompts=prompts, **sampling, logprobs=logprobs,
                       structured=_structured(data), echo=echo)


def _prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """``prompt``: a string, a list of strings, a list of token ids, or a list of token-id lists (as
    OpenAI and vLLM take it); each prompt non-empty. Ids are checked against the vocabulary by the engine."""
    def ids(items: list[Any], where: str) -> tuple[int, ...]:
        if not items:
            raise invalid(f"{where}: a token-id prompt must not be empty")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in items):
            raise invalid(f"{where}: token ids are integers >= 0")
        return tuple(items)

    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise invalid("prompt: required: a string, a list of strings, token ids or lists of token ids")
    if all(isinstance(p, str) for p in value):
        if any(not p for p in value):
            raise invalid("prompt: a prompt may not be empty")
        out: tuple[str | tuple[int, ...], ...] = tuple(value)
    elif all(isinstance(p, list) for p in value):
        out = tuple(ids(p, f"prompt[{i}]") for i, p in enumerate(value))
    elif not any(isinstance(p, (str, list)) for p in value):
        out = (ids(value, "prompt"),)
    else:
        raise invalid("prompt: a list of strings, token ids or lists of token ids, not a mix")
    if len(out) > MAX_PROMPTS:
        raise invalid(f"prompt: at most {MAX_PROMPTS} prompts in one request, got {len(out)}")
    return out


def _model(data: dict[str, Any]) -> str:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model: required string")
    return model


def _sampling(data: dict[str, Any], model: str) -> dict[str, Any]:
    """The fields Chat Completions and Completions share. A body that gives none of them (an SDK sends
    only what its caller set) takes the defaults, read once from :func:`_sampling_given`."""
    if SAMPLING_FIELDS.isdisjoint(data):
        return {**_SAMPLING_DEFAULTS, "model": model}
    return _sampling_given(data, model)


def _sampling_given(data: dict[str, Any], model: str) -> dict[str, Any]:
    priority = data.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise invalid("priority: must be an integer (lower runs first)")
    stream = data.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream must be true or false")
    options = _stream_options(data.get("stream_options"), bool(stream))
    ignore_eos = data.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise invalid("ignore_eos: must be true or false")
    return dict(
        ignore_eos=ignore_eos,
        model=model,
        stream=bool(stream),
        temperature=number(data, "temperature", 1.0, 0.0, 2.0),
        top_p=number(data, "top_p", 1.0, 0.0, 1.0),
        top_k=top_k(data),
        stop=stops(data.get("stop")),
        seed=seed(data),
        n=integer(data, "n", 1, MAX_N) or 1,
        presence_penalty=number(data, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=number(data, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=logit_bias(data.get("logit_bias")),
        priority=priority,
        include_usage=bool(options.get("include_usage")),
        continuous_usage=bool(options.get("include_usage") and options.get("continuous_usage_stats")),
        user=user_id(data.get("user"), "user") or user_id(data.get("safety_identifier"), "safety_identifier"),
        vllm_sampling=_vllm_sampling(data),
    )


MAX_STOP_TOKEN_IDS = 64
_VLLM_FLAGS = ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens")


def _vllm_sampling(data: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's sampling extensions that were given (null: its default), checked as vLLM checks them
    (``min_tokens`` against ``max_tokens`` is the engine's check)."""
    out: dict[str, Any] = {}
    if data.get("min_p") is not None:
        out["min_p"] = number(data, "min_p", 0.0, 0.0, 1.0)
    if data.get("repetition_penalty") is not None:
        value = number(data, "repetition_penalty", 1.0, 0.0, 100.0)
        if value == 0:
            raise invalid("repetition_penalty must be > 0 (1 is none)")
        out["repetition_penalty"] = value
    if data.get("min_tokens") is not None:
        out["min_tokens"] = integer(data, "min_tokens", 0, 1 << 31)
    ids = data.get("stop_token_ids")
    if ids is not None:
        if not (isinstance(ids, list) and all(type(t) is int and t >= 0 for t in ids)):
            raise invalid("stop_token_ids must be a list of token ids (integers >= 0)")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise invalid(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}")
        out["stop_token_ids"] = tuple(ids)
    for flag in _VLLM_FLAGS:
        given = data.get(flag)
        if given is not None:
            if not isinstance(given, bool):
                raise invalid(f"{flag} must be true or false")
            out[flag] = given
    return out or None


#: Every field :func:`_sampling_given` reads (a test records them): a body with none takes the defaults.
SAMPLING_FIELDS = frozenset({
    "priority", "stream", "stream_options", "ignore_eos", "temperature", "top_p", "top_k", "stop", "seed", "n",
    "presence_penalty", "frequency_penalty", "logit_bias", "user", "safety_identifier", "min_p",
    "repetition_penalty", "min_tokens", "stop_token_ids", *_VLLM_FLAGS})
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})


def _stream_options(value: Any, stream: bool) -> dict[str, Any]:
    """``stream_options``: ``include_usage`` (OpenAI) and ``continuous_usage_stats`` (vLLM's: every
    chunk carries the usage so far, with ``include_usage``); only with ``stream: true``, as OpenAI
    documents it and vLLM enforces it."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid("stream_options must be an object")
    check_fields(value, STREAM_OPTIONS, {}, "stream_options.")
    for key, flag in value.items():
        if flag is not None and not isinstance(flag, bool):
            raise invalid(f"stream_options.{key} must be true or false")
    if value and not stream:
        raise invalid("stream_options: only with stream: true")
    return value


_SAMPLING_DEFAULTS = _sampling_given({}, "")  # what a body with none of SAMPLING_FIELDS gets (_sampling)


# Template variables zerolayer sets itself from the request (vLLM refuses the first two as well).
RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize", "tools", "add_generation_prompt",
                                      "continue_final_message", "messages", "conversation", "return_dict"})


def _template_kwargs(value: Any) -> dict[str, Any] | None:
    """vLLM's ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``): extra template variables."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("chat_template_kwargs must be an object of template variables")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & value.keys())
    if reserved:
        raise invalid(f"chat_template_kwargs: {', '.join(reserved)} are set from the request's own fields "
                      "(tools, continue_final_message), not as template variables")
    return value or None


MAX_ROLE_CHARS = 64


def _message(message: Any, i: int) -> ChatMessage:
    where = f"messages[{i}]"
    role = message.get("role") if isinstance(message, dict) else None
    if role == "developer":
        role = "system"
    # OpenAI's roles, or (vLLM's custom role) any other name, which goes to the chat template as it is:
    # a template that does not take it refuses it (400, the template's own words).
    if not isinstance(role, str) or not role or len(role) > MAX_ROLE_CHARS:
        raise invalid(f"{where}.role must be system, developer, user, assistant, tool or another role "
                      f"name the chat template takes (a string of 1..{MAX_ROLE_CHARS} characters)")
    check_fields(message, MESSAGE_FIELDS, MESSAGE_REFUSED, f"{where}.")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise invalid(f"{where}.name must be a string")
    reasoning = message.get("reasoning", message.get("reasoning_content"))
    if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
        raise invalid(f"{where}.reasoning: only assistant messages carry reasoning, as a string")
    content = message.get("content")
    calls: tuple[ToolCall, ...] = ()
    if message.get("tool_calls") is not None and not isinstance(message["tool_calls"], list):
        raise invalid(f"{where}.tool_calls must be a list")
    if role == "assistant" and message.get("tool_calls"):
        calls = tuple(_history_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(message["tool_calls"]))
        text = "" if content is None else text_of(content, f"{where}.content")
    else:
        if message.get("tool_calls") is not None:
            raise invalid(f"{where}.tool_calls: only assistant messages carry tool calls")
        text = text_of(content, f"{where}.content")
    call_id = message.get("tool_call_id")
    if role == "tool":
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"{where}.tool_call_id: required string for a tool message")
    elif call_id is not None:
        raise invalid(f"{where}.tool_call_id: only tool messages answer a call")
    return ChatMessage(role, text, tool_calls=calls, tool_call_id=call_id, name=name, reasoning=reasoning)


def _history_call(call: Any, where: str) -> ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise invalid(f"{where}: must be {{'type': 'function', 'function': {{name, arguments}}}}")
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise invalid(f"{where}.function: name and arguments (a JSON string) are required")
    return ToolCall(str(call.get("id") or ""), name, arguments)


def _tools(data: dict[str, Any]) -> tuple[tuple[ToolSpec, ...], ToolUse | None]:
    raw = data.get("tools")
    choice = data.get("tool_choice")
    parallel = data.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls must be a boolean")
    if not raw:
        if choice not in (None, "none"):
            raise invalid("tool_choice needs tools")
        return (), None
    if not isinstance(raw, list):
        raise invalid("tools must be a list")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid("tools: names must be unique")
    if choice is None:
        choice = "auto"
    if choice == "none":
        return tools, None
    if choice in ("auto", "required"):
        return tools, ToolUse(tools, choice, parallel=parallel is not False)
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise invalid("tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}")
    if name not in names:
        raise invalid(f"tool_choice names {name!r}, which is not among the tools")
    return tools, ToolUse(tools, "function", name, parallel=False)


def _tool(tool: Any, i: int) -> ToolSpec:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid(f"{where}: only function tools are supported")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise invalid(f"{where}.function.name: required string")
    check_fields(function, frozenset({"name", "description", "parameters", "strict"}), {}, f"{where}.function.")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise invalid(f"{where}.function.description must be a string")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    # strict: the arguments always follow the schema where the call is forced (a structured output);
    # under "auto" they are what the model wrote, as in vllm serve.
    return ToolSpec(function["name"], description, json_schema_text(parameters, f"{where}.function.parameters"))


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
STRUCTURED_REFUSED: dict[str, tuple[str, Neutral]] = {
    "disable_any_whitespace": ("whitespace in generated JSON is the node's engine setting "
                               "(structured_outputs_config), not a request's", one_of(False)),
    "disable_additional_properties": ("give additionalProperties: false in the schema itself", one_of(False)),
    "whitespace_pattern": ("whitespace in generated JSON is the node's engine setting", is_none),
    "structural_tag": ("structural tags are not offered", is_none),
}


def _structured(data: dict[str, Any]) -> StructuredOutput | None:
    """The output's form: OpenAI's ``response_format`` or vLLM's ``structured_outputs`` (one kind of
    ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``), not both."""
    given = _response_format(data.get("response_format"))
    value = data.get("structured_outputs")
    if value is None:
        return given
    if not isinstance(value, dict):
        raise invalid("structured_outputs must be an object with one of json, regex, choice, grammar")
    check_fields(value, frozenset(STRUCTURED_KINDS), STRUCTURED_REFUSED, "structured_outputs.")
    kinds = [k for k in STRUCTURED_KINDS if value.get(k) is not None]
    if len(kinds) != 1:
        raise invalid(f"structured_outputs: give exactly one of {', '.join(STRUCTURED_KINDS)}, got {len(kinds)}")
    if given is not None:
        raise invalid("structured_outputs and response_format: give one (both constrain the output's form)")
    kind = kinds[0]
    spec = value[kind]
    where = f"structured_outputs.{kind}"
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError:
                raise invalid(f"{where}: a JSON Schema (an object, or its JSON text)") from None
        return StructuredOutput("json_schema", json_schema_text(spec, where))
    if kind == "json_object":
        if spec is not True:
            raise invalid(f"{where} must be true")
        return StructuredOutput("json_object")
    if kind == "choice":
        if not (isinstance(spec, list) and spec and all(isinstance(c, str) for c in spec)):
            raise invalid(f"{where} must be a non-empty list of strings")
        return StructuredOutput("choice", json.dumps(spec))
    if not isinstance(spec, str) or not spec:
        raise invalid(f"{where} must be a non-empty string")
    return StructuredOutput(kind, spec)


def _response_format(value: Any) -> StructuredOutput | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise invalid("response_format.json_schema.schema: required JSON Schema")
        return StructuredOutput("json_schema", json_schema_text(spec["schema"], "response_format.json_schema.schema"))
    raise invalid("response_format.type must be text, json_object or json_schema")


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


def usage(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    """OpenAI's ``usage``; with ``prompt_tokens_details.cached_tokens`` where the engine reports the
    prompt tokens its prefix cache served (vLLM does; the synthetic engine does not)."""
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def cached_tokens(choices: Sequence[Choice], n: int) -> int | None:
    """Prompt tokens served from the prefix cache, over the request's prompts (each prompt's ``n``
    choices share it: counted once, from its first choice); None where the engine reported none."""
    counts = [c.cached_tokens for c in choices if c.index % max(1, n) == 0 and c.cached_tokens is not None]
    return sum(counts) if counts else None


def running_usage(request: ChatRequest, tally: Any, index: int, tokens: int) -> dict[str, Any] | None:
    """The usage a chunk of choice ``index`` carries under vLLM's ``continuous_usage_stats`` (that
    choice's tokens so far, counting ``tokens`` more), else None (``usage: null`` with ``include_usage``)."""
    if not request.continuous_usage:
        return None
    return usage(tally.prompt_tokens, tally.add(index, tokens))


def completion(cid: str, created: int, model: str, text: str, finish: str, use: dict[str, int]) -> dict[str, Any]:
    return chat_completion(cid, created, model, [Choice(0, text, finish)], use)


def finish_reason(choice: Choice, tool_use: ToolUse | None = None) -> str:
    """``tool_calls`` when the model called tools, except for a named forced function, where OpenAI
    says ``stop``; else the engine's reason in OpenAI's words."""
    if choice.tool_calls and not (tool_use is not None and tool_use.choice == "function"):
        return "tool_calls"
    return FINISH_REASONS.get(choice.finish, "stop")


def chat_completion(cid: str, created: int, model: str, choices: Sequence[Choice], use: dict[str, int],
                    tool_use: ToolUse | None = None, logprobs: bool = False) -> dict[str, Any]:
    """A ``chat.completion`` object with one entry per choice."""
    out = []
    for c in choices:
        message: dict[str, Any] = {"role": "assistant", "content": c.text if c.text or not c.tool_calls else None}
        if c.tool_calls:
            message["tool_calls"] = tool_calls(c.tool_calls)
        out.append({"index": c.index, "message": message, "finish_reason": finish_reason(c, tool_use),
                    "logprobs": chat_logprobs(c.logprobs) if logprobs else None})
    return {"id": cid, "object": "chat.completion", "created": created, "model": model, "choices": out,
            "usage": use}


def text_completion(cid: str, created: int, model: str, choices: Sequence[Choice], use: dict[str, int],
                    logprobs: bool = False) -> dict[str, Any]:
    """A ``text_completion`` object (``/v1/completions``)."""
    return {"id": cid, "object": "text_completion", "created": created, "model": model, "usage": use,
            "choices": [{"index": c.index, "text": c.text, "finish_reason": finish_reason(c),
                         "logprobs": completion_logprobs(c.logprobs) if logprobs else None} for c in choices]}


def text_chunk(cid: str, created: int, model: str, index: int, text: str, finish: str | None,
               lps: Sequence[TokenLogprob] | None = None, use: dict[str, int] | None = None,
               include_usage: bool = False) -> bytes:
    """One ``/v1/completions`` stream event."""
    body: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created, "model": model,
                            "choices": [{"index": index, "text": text, "finish_reason": finish,
                                         "logprobs": completion_logprobs(lps) if lps is not None else None}]}
    if include_usage:
        body["usage"] = use
    return sse(None, body)


def tool_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def tool_call_deltas(pieces: Sequence[ToolCallPiece]) -> list[dict[str, Any]]:
    """Streamed tool-call pieces as ``delta.tool_calls``: a call's first piece carries ``id``,
    ``type`` and ``function.name`` (and the arguments so far); later ones only ``function.arguments``
    (``index`` tells the calls apart). The shapes ``vllm serve`` streams."""
    out: list[dict[str, Any]] = []
    for piece in pieces:
        if piece.id is not None:
            out.append({"index": piece.index, "id": piece.id, "type": "function",
                        "function": {"name": piece.name, "arguments": piece.arguments}})
        else:
            out.append({"index": piece.index, "function": {"arguments": piece.arguments}})
    return out


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Chat Completions' ``logprobs`` object: ``{"content": [...]}``, one entry per token."""
    return {"content": [
        {"token": lp.token, "logprob": lp.logprob, "bytes": _bytes(lp.token),
         "top_logprobs": [{"token": t, "logprob": v, "bytes": _bytes(t)} for t, v in lp.top]}
        for lp in lps]}


def completion_logprobs(lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The legacy Completions ``logprobs`` object (parallel lists; offsets into the text)."""
    offsets, at = [], 0
    for lp in lps:
        offsets.append(at)
        at += len(lp.token)
    return {"tokens": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [dict(lp.top) for lp in lps], "text_offset": offsets}


def chunk(cid: str, created: int, model: str, delta: dict[str, Any], finish: str | None,
          use: dict[str, int] | None = None, include_usage: bool = False, index: int = 0,
          logprobs: dict[str, Any] | None = None) -> bytes:
    body: dict[str, Any] = {
        "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
    }
    if include_usage:
        body["usage"] = use
    return sse(None, body)


def stream_piece(cid: str, created: int, model: str, delta: Any, include_usage: bool = False,
                 logprobs: bool = False, calls: Sequence[ToolCallPiece] = (),
                 use: dict[str, Any] | None = None) -> bytes:
    """One engine delta (of choice ``delta.index``) as a chat chunk: its text, the tool-call pieces it
    completed and, when asked, its logprobs. A tool-using answer's delta carries ``content`` only
    when it has text (a call's chunks carry none, as ``vllm serve`` sends them)."""
    body: dict[str, Any] = {"content": delta.text} if delta.text or not calls else {}
    if calls:
        body["tool_calls"] = tool_call_deltas(calls)
    return chunk(cid, created, model, body, None, use, include_usage=include_usage, index=delta.index,
                 logprobs=chat_logprobs(delta.logprobs) if logprobs else None)


@functools.lru_cache(maxsize=4096)  # one entry per live stream; an evicted one is rendered again
def _chunk_head(cid: str, created: int, model: str) -> bytes:
    return (b'data: {"id":' + dumps(cid) + b',"object":"chat.completion.chunk","created":' + b"%d" % created
            + b',"model":' + dumps(model) + b',"choices":[{"index":')


def text_piece(cid: str, created: int, model: str, index: int, text: str) -> bytes:
    """:func:`stream_piece` of a text-only delta with no logprobs, no tool calls and no usage — what
    almost every streamed token is — byte for byte, without building and encoding its dict: the
    stream's constant head is rendered once and only the text is JSON-encoded per token."""
    return b'%s%d,"delta":{"content":%s},"finish_reason":null,"logprobs":null}]}\n\n' % (
        _chunk_head(cid, created, model), index, json.encoder.encode_basestring(text).encode())


def stream_close(cid: str, created: int, model: str, choices: Sequence[Choice], use: dict[str, Any],
                 include_usage: bool = False, tool_use: ToolUse | None = None, continuous: bool = False) -> bytes:
    """The end of a chat stream: a finish chunk per choice (``tool_calls`` where the whole output
    parses into calls, as the non-streamed answer says), the usage chunk when asked, ``[DONE]``.
    ``continuous``: each finish chunk carries its choice's usage (vLLM's ``continuous_usage_stats``)."""
    out = b""
    for c in choices:
        mine = usage(use["prompt_tokens"], c.tokens) if continuous else None
        out += chunk(cid, created, model, {}, finish_reason(c, tool_use), mine, include_usage=include_usage,
                     index=c.index)
    if include_usage:
        out += usage_chunk(cid, created, model, use)
    return out + DONE


def text_stream_close(cid: str, created: int, model: str, choices: Sequence[Choice], use: dict[str, Any],
                      include_usage: bool = False, continuous: bool = False) -> bytes:
    """The end of a ``/v1/completions`` stream: a finish event per choice, usage when asked, ``[DONE]``."""
    out = b"".join(text_chunk(cid, created, model, c.index, "", finish_reason(c),
                              use=usage(use["prompt_tokens"], c.tokens) if continuous else None,
                              include_usage=include_usage)
                   for c in choices)
    if include_usage:
        out += usage_chunk(cid, created, model, use, obj="text_completion")
    return out + DONE


def usage_chunk(cid: str, created: int, model: str, use: dict[str, int], obj: str = "chat.completion.chunk") -> bytes:
    return sse(None, {"id": cid, "object": obj, "created": created, "model": model, "choices": [], "usage": use})


DONE = b"data: [DONE]\n\n"


def models(names: list[str], created: int, parents: Mapping[str, str] | None = None,
           cards: Mapping[str, Mapping[str, Any]] | None = None) -> bytes:
    """GET /v1/models: every served name; a LoRA adapter carries its base model as ``parent``
    (None for base models), as ``vllm serve`` lists them, and each entry vLLM's ``root`` (the
    weights it serves: a model's path or name, an adapter's path) and ``max_model_len`` (None for
    an adapter, as vLLM lists it) where ``cards`` gives them (the engine's ``model_card``)."""
    parents = parents or {}
    cards = cards or {}
    return dumps({"object": "list", "data": [
        {"id": n, "object": "model", "created": created, "owned_by": "zerolayer", "parent": parents.get(n),
         **{k: cards[n][k] for k in ("root", "max_model_len") if n in cards and k in cards[n]}}
        for n in names]})


def error_body(code: ErrorCode, message: str, trace_id: str | None = None) -> dict[str, Any]:
    """The error object; ``trace_id`` (the request's trace, 32 hex digits) rides inside it as one more
    field, which the official SDKs keep in the error's ``body`` without parsing it."""
    error: dict[str, Any] = {"message": message, "type": ERRORS[code].openai_type, "param": None, "code": code.value}
    if trace_id is not None:
        error["trace_id"] = trace_id
    return {"error": error}


def stream_error(code: ErrorCode, message: str, trace_id: str | None = None) -> bytes:
    return sse(None, error_body(code, message, trace_id))


def error_json(code: ErrorCode, message: str, trace_id: str | None = None) -> bytes:
    return dumps(error_body(code, message, trace_id))
