"""The Anthropic Messages API as a :class:`~zerolayer.runtime.api.wire.WireApi` (formats in :mod:`.anthropic`)."""

from __future__ import annotations

from zerolayer.contract import ErrorCode
from zerolayer.runtime.api import anthropic
from zerolayer.runtime.api.common import ChatRequest, dumps
from zerolayer.runtime.api.wire import StreamFrame


class AnthropicWire:
    name = "anthropic"
    id_prefix = "msg"

    def parse(self, body: bytes) -> ChatRequest:
        return anthropic.parse(body)

    def completion(self, frame: StreamFrame, text: str, finish: str, prompt_tokens: int,
                   output_tokens: int) -> bytes:
        return dumps(anthropic.message(frame.request_id, frame.request.model, text,
                                       anthropic.STOP_REASONS.get(finish, "end_turn"),
                                       {"input_tokens": prompt_tokens, "output_tokens": output_tokens}))

    def stream_start(self, frame: StreamFrame, prompt_tokens: int) -> bytes:
        return anthropic.stream_start(frame.request_id, frame.request.model, prompt_tokens)

    def stream_delta(self, frame: StreamFrame, text: str) -> bytes:
        return anthropic.stream_delta(text)

    def stream_end(self, frame: StreamFrame, finish: str, prompt_tokens: int, output_tokens: int) -> bytes:
        return anthropic.stream_end(anthropic.STOP_REASONS.get(finish, "end_turn"), prompt_tokens, output_tokens)

    def stream_error(self, code: ErrorCode, message: str) -> bytes:
        return anthropic.stream_error(code, message)

    def error_json(self, code: ErrorCode, message: str) -> bytes:
        return anthropic.error_json(code, message)


ANTHROPIC = AnthropicWire()
