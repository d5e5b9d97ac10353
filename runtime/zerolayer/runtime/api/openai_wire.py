"""OpenAI Chat Completions as a :class:`~zerolayer.runtime.api.wire.WireApi` (formats in :mod:`.openai`)."""

from __future__ import annotations

from typing import Sequence

from zerolayer.contract import ErrorCode
from zerolayer.runtime.api import openai
from zerolayer.runtime.api.common import ChatRequest, Choice, dumps
from zerolayer.runtime.api.wire import StreamFrame
from zerolayer.runtime.engine.base import Delta, ToolCallPiece


class OpenAIWire:
    name = "openai"
    id_prefix = "chatcmpl"

    def parse(self, body: bytes) -> ChatRequest:
        return openai.parse(body)

    def completion(self, frame: StreamFrame, choices: Sequence[Choice], prompt_tokens: int,
                   output_tokens: int) -> bytes:
        request = frame.request
        use = openai.usage(prompt_tokens, output_tokens, openai.cached_tokens(choices, request.n))
        return dumps(openai.chat_completion(frame.request_id, frame.created, request.model, choices,
                                            use, tool_use=request.tool_use,
                                            logprobs=request.logprobs is not None))

    def stream_start(self, frame: StreamFrame, prompt_tokens: int) -> bytes:
        request = frame.request
        frame.tally.prompt_tokens = prompt_tokens
        return b"".join(openai.chunk(frame.request_id, frame.created, request.model,
                                     {"role": "assistant", "content": ""}, None,
                                     openai.running_usage(request, frame.tally, i, 0),
                                     include_usage=request.include_usage, index=i) for i in range(request.n))

    def stream_delta(self, frame: StreamFrame, delta: Delta, calls: Sequence[ToolCallPiece] = ()) -> bytes:
        request = frame.request
        if not (calls or request.include_usage or request.continuous_usage or request.logprobs is not None):
            return openai.text_piece(frame.request_id, frame.created, request.model, delta.index, delta.text)
        return openai.stream_piece(frame.request_id, frame.created, request.model, delta,
                                   include_usage=request.include_usage, logprobs=request.logprobs is not None,
                                   calls=calls,
                                   use=openai.running_usage(request, frame.tally, delta.index, delta.token_count))

    def stream_end(self, frame: StreamFrame, choices: Sequence[Choice], prompt_tokens: int,
                   output_tokens: int) -> bytes:
        request = frame.request
        use = openai.usage(prompt_tokens, output_tokens, openai.cached_tokens(choices, request.n))
        return openai.stream_close(frame.request_id, frame.created, request.model, choices, use,
                                   include_usage=request.include_usage, tool_use=request.tool_use,
                                   continuous=request.continuous_usage)

    def stream_error(self, code: ErrorCode, message: str, trace_id: str | None = None) -> bytes:
        return openai.stream_error(code, message, trace_id)

    def error_json(self, code: ErrorCode, message: str, trace_id: str | None = None) -> bytes:
        return openai.error_json(code, message, trace_id)


OPENAI = OpenAIWire()
