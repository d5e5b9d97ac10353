"""The engine interface the server drives: render a chat into a prompt, stream deltas, abort.

Two implementations: :class:`~zerolayer.runtime.engine.synthetic.SyntheticEngine`
(deterministic, no model, for tests and benchmarks that isolate protocol and
scheduling cost) and :class:`~zerolayer.runtime.engine.vllm_engine.VllmEngine` (vLLM's
``AsyncLLM`` in this process, with vLLM's own tokenizer and chat template). Engines
import nothing above this layer; they raise :class:`~zerolayer.runtime.errors.EngineError`.
"""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator, Mapping, Protocol, Sequence

from zerolayer.runtime.errors import EngineError


class InputRejected(EngineError):
    """The engine refuses this request's input (a chat template that rejects the messages, text
    that cannot be tokenized): the client's mistake, answered 400 INVALID_REQUEST, not retried."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A call the model made (or made earlier, in a chat's history): ``arguments`` is a JSON object's text."""

    id: str
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """A function the model may call: ``parameters`` is a JSON Schema (an object schema), as JSON text
    so the spec stays hashable."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'


@dataclasses.dataclass(frozen=True)
class ToolUse:
    """The tools a request offers and how the model must use them. ``choice``: ``"auto"`` (the model
    decides; needs the engine's tool-call parser), ``"required"`` (at least one call) or
    ``"function"`` (exactly a call of ``function``). ``"none"`` never reaches the engine: the API
    layer then renders the tools but asks for no call."""

    tools: tuple[ToolSpec, ...]
    choice: str = "auto"
    function: str | None = None
    parallel: bool = True


@dataclasses.dataclass(frozen=True)
class ChatMessage:
    """One turn. ``role``: "system" | "user" | "assistant" | "tool". An assistant turn may carry the
    calls it made; a tool turn answers the call ``tool_call_id``."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A chat rendered by the model's template, ready to generate from."""

    text: str
    token_ids: tuple[int, ...]
    model: str = ""  # the model it was rendered for (a LoRA adapter's name selects the adapter)

    @property
    def token_count(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output's form, enforced while sampling: ``kind`` ``"json_object"`` (any JSON
    object; ``schema`` None) or ``"json_schema"`` (``schema``: a JSON Schema, as JSON text)."""

    kind: str
    schema: str | None = None


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """What the engine must honour for one request; an engine that cannot honour a field that is set
    (not at its default) raises :class:`InputRejected` naming it, never ignores it.

    ``top_k``: None or -1 is "all tokens". ``logit_bias``: (token id, bias in [-100, 100]) pairs.
    ``logprobs``: None (none returned), else how many top alternatives (0..20) to return with each
    sampled token's own logprob. ``n``: independent completions, told apart by ``Delta.index``.
    ``structured``: the output's form (JSON). ``tools``: forced tool calls (choice ``"required"``
    or ``"function"``) are a structured output the engine derives from the tools."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_k: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    n: int = 1
    structured: StructuredOutput | None = None
    tools: ToolUse | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past the end-of-sequence token

    def set_fields(self) -> list[str]:
        """The fields given a value other than their default (for an engine's "cannot honour" check)."""
        return [f.name for f in dataclasses.fields(self)
                if f.name != "max_tokens" and getattr(self, f.name) != f.default]


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's text and log-probability, and the ``top`` most likely alternatives at its place."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class Delta:
    """New output since the previous delta. ``finish_reason`` is set on the last one:
    ``"stop"`` (end of turn or a stop string), ``"length"`` (max_tokens) or ``"abort"``."""

    text: str
    token_count: int
    finish_reason: str | None = None
    index: int = 0  # which of the request's ``n`` completions this delta extends
    stop_sequence: str | None = None  # with finish_reason "stop": the stop string that ended it, if one did
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token when ``SamplingOptions.logprobs`` is set
    token_ids: tuple[int, ...] = ()  # the new tokens' ids (what vLLM's streaming tool-call parsers read)


@dataclasses.dataclass(frozen=True)
class ToolCallPiece:
    """Part of a tool call as it streams. The first piece of call ``index`` (0, 1, ... within one
    completion) carries its ``id`` and ``name``; every piece may carry more ``arguments`` text, and
    a call's pieces' ``arguments`` concatenated are its arguments (a JSON object's text)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclasses.dataclass(frozen=True)
class ToolStreamStep:
    """What one delta of a tool-using output adds to the answer: ``content`` (text for the client)
    and the tool-call pieces that became known, in order."""

    content: str = ""
    calls: tuple[ToolCallPiece, ...] = ()


class ToolCallStream(Protocol):
    """Finds tool calls in one completion while it is generated (one per completion: it keeps state).

    :meth:`feed` takes the completion's deltas in order and says what each adds; the delta whose
    ``finish_reason`` is set also flushes whatever is still held back. The content and pieces sent
    add up to what :meth:`Engine.parse_tool_calls` finds in the whole output, except where the
    output was cut short (``max_tokens``) inside a call: that call's pieces were sent as they came.
    """

    def feed(self, delta: Delta) -> ToolStreamStep: ...


@dataclasses.dataclass(frozen=True)
class LoraStats:
    """LoRA adapters in use, as vLLM's scheduler reports them each step (``vllm:lora_requests_info``):
    ``max_loras`` adapters fit in one batch; ``running``/``waiting``: adapter names with requests in
    that state."""

    max_loras: int
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_cache_usage: float  # 0..1
    lora: LoraStats | None = None  # None: the engine serves no adapters


class Engine(Protocol):
    kind: str  # "synthetic" | "vllm"
    models: Sequence[str]  # every name a request may give: base models, then LoRA adapters
    adapters: Mapping[str, str]  # LoRA adapter name -> the base model it applies to

    def for_model(self, model: str) -> "Engine":
        """The engine that serves ``model`` (one of :attr:`models`): itself, or with several base
        models (:class:`~zerolayer.runtime.engine.router.ModelRouter`) that model's own engine."""
        ...

    def context_length(self, model: str) -> int | None:
        """Prompt and output tokens together that ``model`` takes (None: no limit known)."""
        ...

    def model_stats(self) -> Sequence[tuple[str, EngineStats]]:
        """(base model, its engine's stats) for each engine: the ``vllm:*`` gauges per model."""
        ...


    async def start(self) -> None: ...
    async def close(self) -> None: ...
    def ready(self) -> bool: ...
    async def render(self, model: str, messages: Sequence[ChatMessage], *, tools: Sequence[ToolSpec] = (),
                     continue_final: bool = False) -> Prompt:
        """The chat through the model's template. ``tools`` are shown to the model (the template must
        support them, else :class:`InputRejected`); ``continue_final``: the last message is an assistant
        prefill the output continues (no new turn is opened)."""
        ...

    async def encode(self, model: str, text: str) -> Prompt:
        """A raw prompt (``/v1/completions``): the text tokenized as it is, no template."""
        ...

    def parse_tool_calls(self, text: str, tools: ToolUse) -> tuple[str, tuple[ToolCall, ...]]:
        """A finished output split into (remaining text, the tool calls in it). Forced calls (choice
        ``"required"``/``"function"``) are the JSON the structured output asked for; ``"auto"`` uses the
        engine's tool-call parser (:class:`InputRejected` at generate time where it has none)."""
        ...

    def tool_call_stream(self, tools: ToolUse) -> ToolCallStream:
        """A fresh :class:`ToolCallStream` for one completion of a request that offers ``tools``
        (forced choices: the structured output's JSON read incrementally; ``"auto"``: the engine's
        tool-call parser in streaming mode; :class:`InputRejected` where it has none)."""
        ...

    def generate(
        self, prompt: Prompt, options: SamplingOptions, request_id: str, priority: int
    ) -> AsyncIterator[Delta]: ...
    async def abort(self, request_id: str) -> None: ...
    def stats(self) -> EngineStats: ...
