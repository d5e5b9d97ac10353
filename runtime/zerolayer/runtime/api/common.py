"""What both wire APIs parse into, and the helpers they share."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Mapping

import orjson

from zerolayer.contract import ErrorCode
from zerolayer.runtime.engine.base import (
    ChatMessage,
    Delta,
    Prompt,
    SamplingOptions,
    StructuredOutput,
    TokenLogprob,
    ToolCall,
    ToolCallPiece,
    ToolCallStream,
    ToolSpec,
    ToolUse,
)
from zerolayer.runtime.errors import RequestRefused


@dataclasses.dataclass(slots=True)  # slotted, not frozen: built per request (see engine.base.Delta)
class ChatRequest:
    """A parsed request of any of the three APIs. ``prompts`` are set (and ``messages`` empty) for a
    ``/v1/completions`` request: each a text tokenized without a template, or token ids; the answer
    has ``n`` choices per prompt (:attr:`choice_count`), numbered prompt by prompt.

    ``tools`` are rendered into the prompt; ``tool_use`` says how the model must call them (None:
    it is not asked to, ``tool_choice`` none). ``continue_final``: the last message is an assistant
    prefill that the output continues. ``user``: the end-user id the client gives (OpenAI ``user`` /
    ``safety_identifier``, Anthropic ``metadata.user_id``); generation does not read it."""

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
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage in every chunk
    top_k: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: no logprobs; else how many top alternatives per token
    n: int = 1
    structured: StructuredOutput | None = None
    tools: tuple[ToolSpec, ...] = ()
    tool_use: ToolUse | None = None
    continue_final: bool = False
    prompts: tuple[str | tuple[int, ...], ...] = ()
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension (OpenAI APIs): what `vllm bench serve` sends
    echo: bool = False  # /v1/completions: each choice's text starts with its prompt
    vllm_sampling: Mapping[str, Any] | None = None  # vLLM's sampling extensions given (SamplingOptions' names)
    template_kwargs: Mapping[str, Any] | None = None  # vLLM's chat_template_kwargs

    @property
    def choice_count(self) -> int:
        """Choices in the answer: ``n`` per prompt."""
        return self.n * max(1, len(self.prompts))

    def sampling_options(self) -> SamplingOptions:
        """What the engine must honour for this request."""
        return SamplingOptions(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, stop=self.stop,
            seed=self.seed, top_k=self.top_k, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias, logprobs=self.logprobs,
            n=self.n, structured=self.structured, tools=self.tool_use, ignore_eos=self.ignore_eos, echo=self.echo,
            final_only=not self.stream, **(self.vllm_sampling or {}))


@dataclasses.dataclass(slots=True)  # slotted, not frozen: built per request (see engine.base.Delta)
class Choice:
    """One finished completion, as both APIs' response builders take it. ``finish`` is the engine's
    reason (``stop``/``length``/``abort``); ``stop_sequence`` the stop string that ended it, if one did."""

    index: int
    text: str
    finish: str
    tokens: int = 0
    stop_sequence: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    cached_tokens: int | None = None  # its prompt's tokens served from the prefix cache (None: not reported)


def invalid(message: str) -> RequestRefused:
    return RequestRefused(ErrorCode.INVALID_REQUEST, message, reason="invalid_body")


# A JSON escape of a UTF-16 surrogate (\ud800-\udfff): the only way a lone surrogate gets into a str.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_ASCII_COMPATIBLE = ("utf-8", "utf-8-sig")  # encodings json.detect_encoding names in which that pattern is found
_DECODER = json.JSONDecoder()  # json.loads' own default decoder


def load_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or INVALID_REQUEST: bad JSON, nesting deeper than the parser
    allows, or a lone surrogate escape (valid JSON, but not Unicode: it cannot be encoded)."""
    # What json.loads(body) does, with the encoding found once (the surrogate check below needs it too).
    encoding = json.detect_encoding(body)
    try:
        data = _DECODER.decode(body.decode(encoding, "surrogatepass"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise invalid("body is nested too deeply") from None
    if not isinstance(data, dict):
        raise invalid("body must be a JSON object")
    # json.loads also takes UTF-16 and UTF-32 bodies, where the escape's bytes are not ASCII: walk
    # those always (found by tests/fuzz/test_fuzz_json.py).
    suspect = encoding not in _ASCII_COMPATIBLE or _SURROGATE_ESCAPE.search(body)
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


# A refused field is accepted when its value is the neutral one (what not sending it means), because
# SDKs and frameworks often send defaults; any other value is refused naming the field.
Neutral = Callable[[Any], bool]


def is_none(value: Any) -> bool:
    return value is None


def one_of(*values: Any) -> Neutral:
    return lambda value: value is None or any(value == v and type(value) is type(v) for v in values)


def check_fields(data: Mapping[str, Any], honoured: frozenset[str], refused: Mapping[str, tuple[str, Neutral]],
                 where: str = "") -> None:
    """Every key of ``data`` is honoured, or refused with its reason (unless neutral), or unknown: a
    field is never silently dropped (docs/api-fields.md lists both tables)."""
    for key, value in data.items():
        if key in honoured:
            continue
        if key in refused:
            reason, neutral = refused[key]
            if neutral(value):
                continue
            raise invalid(f"{where}{key}: not supported: {reason}")
        raise invalid(f"{where}{key}: unknown field")


def integer(data: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise invalid(f"{key} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a 64-bit signed integer, vLLM's (and torch's) seed range


def seed(data: Mapping[str, Any], key: str = "seed", where: str = "") -> int | None:
    """``seed``: an integer in the 64-bit signed range; outside it vLLM cannot seed a generator (a
    400 there too), so it is the client's mistake, never the engine's."""
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not SEED_MIN <= value <= SEED_MAX:
        raise invalid(f"{where}{key} must be an integer in [-2**63, 2**63 - 1], got {value!r}")
    return value


def top_k(data: Mapping[str, Any]) -> int | None:
    """``top_k``: None, -1 or 0 (all tokens, vLLM's convention), or at least 1."""
    value = integer(data, "top_k", -1, 1 << 31)
    return None if value is None or value <= 0 else value


MAX_LOGIT_BIAS = 1024  # entries; each is applied at every step of a shared batch


def logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` with bias in [-100, 100]. A refusal names every bad entry, not
    only the first (token ids outside the vocabulary are the engine's to name, also all at once)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("logit_bias must be an object of token id -> bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid(f"logit_bias: at most {MAX_LOGIT_BIAS} entries")
    out, bad_keys, bad_values = [], [], []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            bad_keys.append(key)
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            bad_values.append(key)
        else:
            out.append((int(key), float(bias)))
    problems = []
    if bad_keys:
        problems.append(f"keys are token ids (decimal strings), got {', '.join(repr(k) for k in bad_keys[:20])}")
    if bad_values:
        problems.append(f"biases must be numbers in [-100, 100], not those of {', '.join(bad_values[:20])}")
    if problems:
        raise invalid("logit_bias: " + "; ".join(problems))
    return tuple(out)


MAX_N = 16  # completions per request: each is a full generation


def json_schema_text(schema: Any, where: str) -> str:
    if not isinstance(schema, dict):
        raise invalid(f"{where} must be a JSON Schema object")
    return json.dumps(schema, sort_keys=True)


def user_id(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 256:
        raise invalid(f"{where} must be a string of at most 256 characters")
    return value


def text_of(content: Any, where: str) -> str:
    """A message's content: a string or a list of ``{"type": "text", "text": ...}`` blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise invalid(f"{where}: only text content blocks are supported (the models served are text-only)")
            check_fields(block, TEXT_BLOCK_FIELDS, TEXT_BLOCK_REFUSED, f"{where}[{i}].")
            parts.append(block["text"])
        return "".join(parts)
    raise invalid(f"{where}: content must be a string or a list of text blocks")


# cache_control: prefix caching is automatic (every request's prefix is cached), so the marker asks
# for nothing more. citations: a text block's citations are not something the model reads.
TEXT_BLOCK_FIELDS = frozenset({"type", "text", "cache_control"})
TEXT_BLOCK_REFUSED: dict[str, tuple[str, Neutral]] = {
    "citations": ("citations are not passed to the model", lambda v: v is None or v == []),
}


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
    if any(not s for s in value):
        raise invalid("a stop sequence may not be empty")
    if any(len(s) > MAX_STOP_SEQUENCE_CHARS for s in value):
        raise invalid(f"a stop sequence may be at most {MAX_STOP_SEQUENCE_CHARS} characters")
    return tuple(value)


# What orjson refuses goes through this one (json.dumps with these options builds a new JSONEncoder per call).
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def dumps(obj: Any) -> bytes:
    """Compact JSON as UTF-8, what ``json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()``
    gives, encoded by orjson (compiled: a chat completion's answer in under a tenth of the standard
    library's time, ``bench/percall_micro.py``). What orjson refuses (an integer past 64 bits, a key that is not a string) goes through the
    standard library as before (a lone surrogate still raises UnicodeEncodeError). Two differences: a
    float is written in orjson's shortest form (``1e-7`` where the standard library writes ``1e-07``;
    the same number), and a non-finite float as ``null`` where the standard library wrote
    ``NaN``/``Infinity``, which JSON does not have (logprobs are clamped first, as ``vllm serve`` does:
    ``engine/vllm_engine.py``)."""
    try:
        return orjson.dumps(obj)
    except orjson.JSONEncodeError:
        return _ENCODER.encode(obj).encode()


def sse(event: str | None, data: Any) -> bytes:
    payload = data if isinstance(data, bytes) else dumps(data)
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + payload + b"\n\n"


class ContentBlocks:
    """The content blocks one stream has opened so far (Anthropic numbers text and ``tool_use``
    blocks in one sequence, and a block is open until the next one starts): the one piece of a
    stream's state a wire format keeps between events."""

    def __init__(self) -> None:
        self.count = 0  # blocks opened so far; the open one, if any, is count - 1
        self.open: str | None = None  # "text" | "tool_use" | None (none open)
        self.calls: dict[int, int] = {}  # tool call index -> its block's index


class Assembler:
    """Collects an answer's deltas into its finished :class:`Choice`\\ s (one per ``n``) and, for a
    stream, says what each delta adds to it.

    ``parse_tools`` is the engine's :meth:`~zerolayer.runtime.engine.base.Engine.parse_tool_calls`
    (the finished choices' tool calls, as the non-streamed answer gives them). ``tool_stream`` is
    the engine's :meth:`~zerolayer.runtime.engine.base.Engine.tool_call_stream`: given (a stream
    of a request offering tools), each completion's calls are found while it is generated and
    :meth:`add` returns its content and call pieces as they become known.
    """

    def __init__(self, request: ChatRequest,
                 parse_tools: Callable[[str, ToolUse], tuple[str, tuple[ToolCall, ...]]],
                 tool_stream: Callable[[ToolUse], ToolCallStream] | None = None) -> None:
        self.request = request
        self.parse_tools = parse_tools
        self._streams: dict[int, ToolCallStream] | None = None
        if request.tool_use is not None and tool_stream is not None:
            self._streams = {i: tool_stream(request.tool_use) for i in range(request.n)}
        count = request.choice_count
        self._text: dict[int, list[str]] = {i: [] for i in range(count)}
        self._logprobs: dict[int, list[TokenLogprob]] = {i: [] for i in range(count)}
        self._tokens = dict.fromkeys(range(count), 0)
        self._finish: dict[int, str] = {}
        self._stop: dict[int, str | None] = {}
        self._cached: dict[int, int] = {}

    def add(self, delta: Delta) -> tuple[Delta, tuple[ToolCallPiece, ...]] | None:
        """Take one engine delta; return what it adds to a stream: the delta to send (for a
        tool-using answer, its text replaced by the content the tool-call stream let through) and the
        tool-call pieces it completed; None when it adds nothing to send (yet)."""
        self._text[delta.index].append(delta.text)
        if delta.logprobs:
            self._logprobs[delta.index].extend(delta.logprobs)
        self._tokens[delta.index] += delta.token_count
        if delta.cached_tokens is not None:
            self._cached.setdefault(delta.index, delta.cached_tokens)
        if delta.finish_reason:
            self._finish[delta.index] = delta.finish_reason
            self._stop[delta.index] = delta.stop_sequence
        if self._streams is None:
            return (delta, ()) if delta.text or delta.logprobs else None
        step = self._streams[delta.index].feed(delta)
        if not (step.content or step.calls or delta.logprobs):
            return None
        return dataclasses.replace(delta, text=step.content), step.calls

    def choices(self) -> list[Choice]:
        """The finished choices, tool calls parsed out of their text where tools were offered."""
        out = []
        for i in range(self.request.choice_count):
            text = "".join(self._text[i])
            calls: tuple[ToolCall, ...] = ()
            finish = self._finish.get(i, "stop")
            if self.request.tool_use is not None and finish != "abort":
                text, calls = self.parse_tools(text, self.request.tool_use)
            out.append(Choice(i, text, finish, self._tokens[i], self._stop.get(i), calls,
                              tuple(self._logprobs[i]), self._cached.get(i)))
        return out


async def render_prompt(engine: Any, request: ChatRequest, *, observe: bool = True) -> Any:
    """The request's prompt: ``/v1/completions`` prompts tokenized as they are (several: a batch),
    else the chat through the engine's template (with the tools, continuing a prefill), recorded in the engine's
    ``served_prefixes`` when it keeps one (the prefix-cache digest the node gossips) unless ``observe`` is
    false (a prompt only counted, never generated from, puts nothing in the cache)."""
    if request.prompts:
        return Prompt.batch([await engine.encode(request.model, p) for p in request.prompts])
    prompt = await engine.render(request.model, request.messages, tools=request.tools,
                                 continue_final=request.continue_final,
                                 **({"template_kwargs": request.template_kwargs} if request.template_kwargs else {}))
    served = getattr(engine, "served_prefixes", None)  # the gossiped digest's record (zerolayer.prefix.PrefixRecord)
    if served is not None and observe:
        served.observe_turns([(m.role, m.content) for m in request.messages], tokens=prompt.token_count,
                             token_ids=prompt.token_ids)
    return prompt
