"""The engine interface the server drives: render a chat into a prompt, stream deltas, abort.

Two implementations: :class:`~zerolayer.runtime.engine.synthetic.SyntheticEngine`
(deterministic, no model, for tests and benchmarks that isolate protocol and
scheduling cost) and :class:`~zerolayer.runtime.engine.vllm_engine.VllmEngine` (vLLM's
``AsyncLLM`` in this process, with vLLM's own tokenizer and chat template). Engines
import nothing above this layer; they raise :class:`~zerolayer.runtime.errors.EngineError`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Mapping, Protocol, Sequence

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


@dataclasses.dataclass(slots=True)  # slotted, not frozen: built per request (see engine.base.Delta)
class ChatMessage:
    """One turn. ``role``: "system" | "user" | "assistant" | "tool", or a custom role the chat template
    takes (vLLM's). An assistant turn may carry the calls it made; a tool turn answers the call
    ``tool_call_id``."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None  # a participant's name (OpenAI's message field), for the template
    reasoning: str | None = None  # an assistant turn's earlier reasoning (vLLM's field), for the template


@dataclasses.dataclass(slots=True)  # slotted, not frozen: built per request (see engine.base.Delta)
class Prompt:
    """A chat rendered by the model's template, ready to generate from."""

    text: str
    token_ids: tuple[int, ...]
    model: str = ""  # the model it was rendered for (a LoRA adapter's name selects the adapter)
    # A batch (``/v1/completions`` with several prompts): one Prompt per prompt, generated as separate
    # engine requests whose choices are numbered prompt by prompt (``index = k * n + i``, as vLLM
    # does). ``text`` and ``token_ids`` are then the parts' joined (what the request costs in all).
    parts: tuple["Prompt", ...] = ()

    @property
    def token_count(self) -> int:
        return len(self.token_ids)

    @classmethod
    def batch(cls, parts: Sequence["Prompt"]) -> "Prompt":
        """One prompt (itself) or a batch of several."""
        if len(parts) == 1:
            return parts[0]
        return cls(text="".join(p.text for p in parts), token_ids=tuple(t for p in parts for t in p.token_ids),
                   model=parts[0].model, parts=tuple(parts))

    def each(self) -> tuple["Prompt", ...]:
        """The prompts to generate from: the batch's parts, or this one."""
        return self.parts or (self,)


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output's form, enforced while sampling: ``kind`` ``"json_object"`` (any JSON
    object; ``schema`` None), ``"json_schema"`` (``schema``: a JSON Schema, as JSON text), or vLLM's
    ``structured_outputs`` kinds ``"choice"`` (``schema``: a JSON list of the allowed strings),
    ``"regex"`` (a regular expression) and ``"grammar"`` (an EBNF/Lark grammar)."""

    kind: str
    schema: str | None = None


@dataclasses.dataclass(slots=True)  # slotted, not frozen: built per request (see Delta)
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
    # /v1/completions echo: each choice starts with its prompt's text (a Delta of no tokens before
    # the first generated one); with max_tokens 0 that is all it has (finish "length"), as in vLLM.
    echo: bool = False
    # vLLM's sampling extensions (both OpenAI APIs), with vLLM's meaning and defaults.
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # no end of sequence (or stop) before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # token ids that end the output (not reported as stop_sequence)
    include_stop_str_in_output: bool = False  # the matched stop string stays at the end of the text
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Not sampling: the W3C ``traceparent`` of the request's span, set only when tracing is on. An engine
    # with request tracing of its own (vLLM) puts its spans under it; one without (synthetic) ignores it.
    traceparent: str | None = None
    # Not sampling: the client takes the answer whole (not streamed), so the engine may give each
    # completion as one delta at its end instead of one per step (vLLM's ``RequestOutputKind.FINAL_ONLY``,
    # what vllm serve asks for a non-streamed request): no per-token objects on the serving path. That
    # delta carries ``first_token_at``. An engine may also keep giving deltas step by step.
    final_only: bool = False

    def set_fields(self) -> list[str]:
        """The sampling fields given a value other than their default (for an engine's "cannot honour"
        check); ``traceparent`` and ``final_only`` are not ones."""
        return [f.name for f in dataclasses.fields(self)
                if f.name not in ("max_tokens", "traceparent", "final_only") and getattr(self, f.name) != f.default]


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's text and log-probability, and the ``top`` most likely alternatives at its place."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclasses.dataclass(slots=True)
class Delta:
    """New output since the previous delta. ``finish_reason`` is set on the last one:
    ``"stop"`` (end of turn or a stop string), ``"length"`` (max_tokens) or ``"abort"``.

    One is built per token, so it is a plain slotted dataclass (a frozen one costs three times as
    much to build); nothing changes a delta once the engine has yielded it (``renumbered`` copies)."""

    text: str
    token_count: int
    finish_reason: str | None = None
    index: int = 0  # which of the request's ``n`` completions this delta extends
    stop_sequence: str | None = None  # with finish_reason "stop": the stop string that ended it, if one did
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token when ``SamplingOptions.logprobs`` is set
    token_ids: tuple[int, ...] = ()  # the new tokens' ids (what vLLM's streaming tool-call parsers read)
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache (known with the first delta)
    # monotonic: when the engine first scheduled the request (on the first delta; vLLM's scheduled_ts)
    scheduled_at: float | None = None
    # monotonic: when the first of its tokens was made, on a delta that stands for a whole completion
    # (``SamplingOptions.final_only``; vLLM's first_token_ts): the time-to-first-token it measures
    first_token_at: float | None = None


def echo_deltas(prompt: "Prompt", options: SamplingOptions, first_index: int = 0) -> list[Delta]:
    """What ``options.echo`` puts before one prompt's completions (``first_index`` the first choice's
    index): its text, no tokens; with ``max_tokens`` 0 that is each choice's whole (finish ``length``)."""
    if not options.echo:
        return []
    finish = "length" if options.max_tokens == 0 else None
    return [Delta(prompt.text, 0, finish, index=first_index + i) for i in range(options.n)]


def renumbered(delta: Delta, part: int, n: int) -> Delta:
    """A delta of a batch's prompt ``part`` numbered among the whole request's choices (``part * n + i``)."""
    return delta if part == 0 else dataclasses.replace(delta, index=part * n + delta.index)


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


@dataclasses.dataclass(frozen=True)
class MemoryRelease:
    """What an engine adapter's optional ``release_memory()`` (gpu-defragd's SIGUSR1 nudge,
    :mod:`zerolayer.runtime.defrag.release`) gave back: ``freed_bytes`` of device memory and, when
    that is nothing, ``note`` saying why."""

    freed_bytes: int
    note: str = ""


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

    def model_card(self, model: str) -> Mapping[str, Any]:
        """``model``'s entry fields in ``GET /v1/models`` beyond its name, as vllm serve lists them:
        ``root`` (the weights it serves) and ``max_model_len``."""
        ...

    def model_stats(self) -> Sequence[tuple[str, EngineStats]]:
        """(base model, its engine's stats) for each engine: the ``vllm:*`` gauges per model."""
        ...


    async def start(self) -> None: ...
    async def close(self) -> None: ...
    def ready(self) -> bool: ...
    async def render(self, model: str, messages: Sequence[ChatMessage], *, tools: Sequence[ToolSpec] = (),
                     continue_final: bool = False, template_kwargs: Mapping[str, Any] | None = None) -> Prompt:
        """The chat through the model's template. ``tools`` are shown to the model (the template must
        support them, else :class:`InputRejected`); ``continue_final``: the last message is an assistant
        prefill the output continues (no new turn is opened); ``template_kwargs``: vLLM's
        ``chat_template_kwargs``, extra variables for the template (those it does not read are dropped,
        as vLLM drops them)."""
        ...

    async def encode(self, model: str, prompt: str | Sequence[int]) -> Prompt:
        """A raw prompt (``/v1/completions``): text tokenized as it is (no template), or token ids taken
        as they are, :class:`InputRejected` naming an id outside the vocabulary."""
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

    def tokens_so_far(self, request_id: str) -> int:
        """Output tokens made so far by a running request that asked ``final_only`` (its deltas come
        only at its end): what a request cut before then is billed for, and what largest-first
        preemption ranks it by. 0 for a request the engine no longer runs."""
        ...
