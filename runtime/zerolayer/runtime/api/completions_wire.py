"""OpenAI Completions (``POST /v1/completions``: prompts as text or token ids) as a
:class:`~zerolayer.runtime.api.wire.WireApi` (formats in :mod:`.openai`)."""

from __future__ import annotations

from typing import Sequence

from zerolayer.contract import ErrorCode
from zerolayer.runtime.api import openai
from zerolayer.runtime.api.common import ChatRequest, Choice, dumps
from zerolayer.runtime.api.wire import StreamFrame
from zerolayer.runtime.engine.base import Delta, ToolCallPiece


class CompletionsWire:
    name = "openai"  # errors and metrics as the OpenAI API
    id_prefix = "cmpl"

    def parse(self, body: bytes) -> ChatRequest:
        return openai.parse_completions(body)

    def completion(self, frame: StreamFrame, choices: Sequence[Choice], prompt_tokens: int,
                   output_tokens: int) -> bytes:
        use = openai.usage(prompt_tokens, output_tokens, openai.cached_tokens(choices, frame.request.n))
        return dumps(openai.text_completion(frame.request_id, frame.created, frame.request.model, choices, use,
                                            logprobs=frame.request.logprobs is not None))

    def stream_start(self, frame: StreamFrame, prompt_tokens: int) -> bytes:
        frame.tally.prompt_tokens = prompt_tokens
        return b""  # the legacy stream has no opening event: the first text is the first event

    def stream_delta(self, frame: StreamFrame, delta: Delta, calls: Sequence[ToolCallPiece] = ()) -> bytes:
        request = frame.request
        return openai.text_chunk(frame.request_id, frame.created, request.model, delta.index, delta.text, None,
                                 delta.logprobs if request.logprobs is not None else None,
                                 openai.running_usage(request, frame.tally, delta.index, delta.token_count),
                                 include_usage=request.include_usage)

    def stream_end(self, frame: StreamFrame, choices: Sequence[Choice], prompt_tokens: int,
                   output_tokens: int) -> bytes:
        request = frame.request
        use = openai.usage(prompt_tokens, output_tokens, openai.cached_tokens(choices, request.n))
        return openai.text_stream_close(frame.request_id, frame.created, request.model, choices, use,
                                        include_usage=request.include_usage, continuous=request.continuous_usage)

    def stream_error(self, code: ErrorCode, message: str, trace_id: str | None = None) -> bytes:
        return openai.stream_error(code, message, trace_id)

    def error_json(self, code: ErrorCode, message: str, trace_id: str | None = None) -> bytes:
        return openai.error_json(code, message, trace_id)


COMPLETIONS = CompletionsWire()
