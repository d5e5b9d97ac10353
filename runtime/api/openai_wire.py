"""OpenAI Chat Completions as a :class:`~zerolayer.runtime.api.wire.WireApi` (formats in :mod:`.openai`)."""

from __future__ import annotations

from zerolayer.contract import ErrorCode
from zerolayer.runtime.api import openai
from zerolayer.runtime.api.common import ChatRequest, dumps
from zerolayer.runtime.api.wire import StreamFrame


class OpenAIWire:
    name = "openai"
    id_prefix = "chatcmpl"

    def parse(self, body: bytes) -> ChatRequest:
        return openai.parse(body)

    def completion(self, frame: StreamFrame, text: str, finish: str, prompt_tokens: int,
                   output_tokens: int) -> bytes:
        return dumps(openai.completion(frame.request_id, frame.created, frame.request.model, text,
                                       openai.FINISH_REASONS.get(finish, "stop"),
                                       openai.usage(prompt_tokens, output_tokens)))

    def stream_start(self, frame: StreamFrame, prompt_tokens: int) -> bytes:
        return openai.chunk(frame.request_id, frame.created, frame.request.model, {"role": "assistant", "content": ""},
                            None, include_usage=frame.request.include_usage)

    def stream_delta(self, frame: StreamFrame, text: str) -> bytes:
        return openai.chunk(frame.request_id, frame.created, frame.request.model, {"content": text}, None,
                            include_usage=frame.request.include_usage)

    def stream_end(self, frame: StreamFrame, finish: str, prompt_tokens: int, output_tokens: int) -> bytes:
        request = frame.request
        tail = openai.chunk(frame.request_id, frame.created, request.model, {},
                            openai.FINISH_REASONS.get(finish, "stop"), include_usage=request.include_usage)
        if request.include_usage:
            tail += openai.usage_chunk(frame.request_id, frame.created, request.model,
                                       openai.usage(prompt_tokens, output_tokens))
        return tail + openai.DONE

    def stream_error(self, code: ErrorCode, message: str) -> bytes:
        return openai.stream_error(code, message)

    def error_json(self, code: ErrorCode, message: str) -> bytes:
        return openai.error_json(code, message)


OPENAI = OpenAIWire()
