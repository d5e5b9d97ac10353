"""One wire API: what the runtime needs from a chat API's format, whichever API it is.

A :class:`WireApi` turns a request body into a :class:`~zerolayer.runtime.api.common.ChatRequest`
and the engine's output into that API's bytes: a whole JSON answer, the SSE events of a
stream, and errors (before response headers: a JSON body; mid-stream: an SSE error event).
The implementations are :data:`zerolayer.runtime.api.anthropic_wire.ANTHROPIC` (``/v1/messages``)
and :data:`zerolayer.runtime.api.openai_wire.OPENAI` (``/v1/chat/completions``). They are
stateless; one stream's constant parts (id, model, creation time, options) travel in a
:class:`StreamFrame` so the per-chunk call formats only what changes, and so does the one thing a
stream's events depend on that came before: the content blocks it opened
(:class:`~zerolayer.runtime.api.common.ContentBlocks`, Anthropic's block numbering).

A new response field goes into the implementation (and the format module it calls); a new
API is a new implementation plus a route in :mod:`zerolayer.runtime.serving.gate`. Nothing here
knows about sockets, the scheduler or the transport.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol, Sequence

from zerolayer.contract import ERROR_HEADER, ERRORS, ErrorCode
from zerolayer.runtime.api.common import ChatRequest, Choice, ContentBlocks
from zerolayer.runtime.engine.base import Delta, ToolCallPiece
from zerolayer.runtime.errors import RequestRefused


class StreamTally:
    """Tokens a stream has sent so far, per choice (vLLM's ``continuous_usage_stats``: every chunk
    carries the usage up to it). Kept by the wire's own calls: :meth:`WireApi.stream_start` sets
    the prompt's count, each :meth:`WireApi.stream_delta` adds its delta's tokens."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.output_tokens: dict[int, int] = {}

    def add(self, index: int, tokens: int) -> int:
        """Count ``tokens`` more for choice ``index``; its total so far."""
        self.output_tokens[index] = self.output_tokens.get(index, 0) + tokens
        return self.output_tokens[index]


@dataclasses.dataclass(slots=True)  # slotted, not frozen: built per request (see engine.base.Delta)
class StreamFrame:
    """What stays the same for every event of one answer (and the blocks it opened, see
    :class:`ContentBlocks`)."""

    request_id: str
    created: int  # Unix seconds, as the OpenAI format carries it
    request: ChatRequest
    blocks: ContentBlocks = dataclasses.field(default_factory=ContentBlocks)
    tally: StreamTally = dataclasses.field(default_factory=StreamTally)


class WireApi(Protocol):
    """A chat API's wire format. Implementations are stateless (a stream's state is its frame's) and never block."""

    name: str  # "anthropic" | "openai": metrics labels and logs
    id_prefix: str  # request ids are ``{id_prefix}_{hex}``

    def parse(self, body: bytes) -> ChatRequest:
        """The request, or :class:`RequestRefused` (INVALID_REQUEST) naming the bad field."""
        ...

    def completion(self, frame: StreamFrame, choices: Sequence[Choice], prompt_tokens: int,
                   output_tokens: int) -> bytes:
        """The JSON body of a non-streamed answer: one :class:`Choice` per ``n`` (text, the engine's
        finish reason, matched stop string, tool calls, logprobs)."""
        ...

    def stream_start(self, frame: StreamFrame, prompt_tokens: int) -> bytes:
        """The SSE events sent before the first token."""
        ...

    def stream_delta(self, frame: StreamFrame, delta: Delta, calls: Sequence[ToolCallPiece] = ()) -> bytes:
        """The SSE events for one engine delta of choice ``delta.index``: its text and logprobs, and
        the tool-call pieces it completed (see :meth:`~zerolayer.runtime.api.common.Assembler.add`).
        For a client that fell behind, ``delta`` may be several consecutive text deltas merged
        (:func:`merge_deltas`); what it renders must then mean what their events together meant."""
        ...

    def stream_end(self, frame: StreamFrame, choices: Sequence[Choice], prompt_tokens: int,
                   output_tokens: int) -> bytes:
        """The SSE events that close a stream that ended normally: finish/stop reasons (taken from
        ``choices``, the whole output parsed as the non-streamed answer is) and usage."""
        ...

    def stream_error(self, code: ErrorCode, message: str, trace_id: str | None = None) -> bytes:
        """The SSE error event sent mid-stream before the reset; ``trace_id`` (32 hex digits): the
        request's trace, an extra field of the error object."""
        ...

    def error_json(self, code: ErrorCode, message: str, trace_id: str | None = None) -> bytes:
        """The JSON body of an error answered before response headers (``trace_id`` as in :meth:`stream_error`)."""
        ...


def merge_deltas(first: Delta, then: Delta) -> Delta:
    """One delta that says what ``first`` then ``then`` (the same choice, no tool-call pieces) say: text
    and logprobs and token ids concatenated, token counts summed, the finish reason and stop string of
    the last that has one, the cached-token count and scheduling time of the first that has one.

    Every wire renders a stream delta from its text, logprobs and token count (the finish reason goes
    out with :meth:`WireApi.stream_end`), so the merged delta's one event carries what the two events
    carried: the session sends it when a client fell behind (docs/server-core.md).
    """
    assert first.index == then.index, (first.index, then.index)
    return Delta(first.text + then.text, first.token_count + then.token_count,
                 then.finish_reason or first.finish_reason, first.index,
                 then.stop_sequence if then.finish_reason else first.stop_sequence,
                 first.logprobs + then.logprobs, first.token_ids + then.token_ids,
                 first.cached_tokens if first.cached_tokens is not None else then.cached_tokens,
                 first.scheduled_at if first.scheduled_at is not None else then.scheduled_at)


def error_response(wire: WireApi, refused: RequestRefused,
                   trace_id: str | None = None) -> tuple[int, list[tuple[str, str]], bytes]:
    """Status, headers and body for an error before response headers (docs/protocol.md).

    The headers carry the contract's error code, ``x-should-retry`` (both official SDKs obey it
    over their own status rules) and, for retryable codes, ``retry-after``/``retry-after-ms``.
    ``trace_id``: the request's trace, written into the error object (docs/observability.md).
    """
    wire_error = ERRORS[refused.code]
    status = refused.http_status or wire_error.http_status
    body = wire.error_json(refused.code, refused.message, trace_id)
    headers: dict[str, str] = {"content-type": "application/json", ERROR_HEADER: refused.code.value}
    headers.update({k.lower(): v for k, v in refused.headers.items()})
    retryable = wire_error.retryable and refused.http_status is None
    if retryable:
        retry_after = refused.retry_after_s if refused.retry_after_s is not None else 1.0
        headers.setdefault("retry-after", str(max(1, math.ceil(retry_after))))
        headers.setdefault("retry-after-ms", str(max(0, round(retry_after * 1000))))
    headers["x-should-retry"] = "true" if retryable else "false"
    headers["content-length"] = str(len(body))
    return status, list(headers.items()), body
