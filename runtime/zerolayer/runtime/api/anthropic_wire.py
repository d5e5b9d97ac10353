"""The Anthropic Messages API as a :class:`~zerolayer.runtime.api.wire.WireApi` (formats in :mod:`.anthropic`)."""

from __future__ import annotations

from typing import Sequence

from zerolayer.contract import ErrorCode
from zerolayer.runtime.api import anthropic
from zerolayer.runtime.api.common import ChatRequest, Choice, dumps
from zerolayer.runtime.api.wire import StreamFrame
from zerolayer.runtime.engine.base import Delta, ToolCallPiece


class AnthropicWire:
    name = "anthropic"
    id_prefix = "msg"

    def parse(self, body: bytes) -> ChatRequest:
        return anthropic.parse(body)

    def completion(self, frame: StreamFrame, choices: Sequence[Choice], prompt_tokens: int,
                   output_tokens: int) -> bytes:
        return dumps(anthropic.message_of(frame.request_id, frame.request.model, choices[0],
                                          {"input_tokens": prompt_tokens, "output_tokens": output_tokens}))

    def stream_start(self, frame: StreamFrame, prompt_tokens: int) -> bytes:
        # Without tools the answer is one text block, opened at once; with tools each block opens
        # when its first text or call arrives.
        text_block = frame.request.tool_use is None
        if text_block:
            frame.blocks.count, frame.blocks.open = 1, "text"
        return anthropic.stream_start(frame.request_id, frame.request.model, prompt_tokens, text_block=text_block)

    def stream_delta(self, frame: StreamFrame, delta: Delta, calls: Sequence[ToolCallPiece] = ()) -> bytes:
        return anthropic.stream_piece(frame.blocks, delta.text, calls)

    def stream_end(self, frame: StreamFrame, choices: Sequence[Choice], prompt_tokens: int,
                   output_tokens: int) -> bytes:
        return anthropic.stream_close(choices[0], prompt_tokens, output_tokens, frame.blocks)

    def stream_error(self, code: ErrorCode, message: str, trace_id: str | None = None) -> bytes:
        return anthropic.stream_error(code, message, trace_id)

    def error_json(self, code: ErrorCode, message: str, trace_id: str | None = None) -> bytes:
        return anthropic.error_json(code, message, trace_id)


ANTHROPIC = AnthropicWire()
