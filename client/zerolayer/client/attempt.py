"""One attempt at a message request, with no I/O: what the sync and async clients share.

A client only moves bytes. It sends ``attempt.url``, ``attempt.headers`` and ``attempt.body``,
hands what comes back to the attempt, yields what the attempt returns and sleeps for
``retry_delay()``:

- :class:`MessageAttempt`: ``answered(status, headers, content)`` gives the message (success is
  recorded) or ``None`` after an error status;
- :class:`StreamAttempt`: ``opened(status, headers)`` says whether the head refused (then
  ``refused(...)`` with the body raises the error), ``feed(line)`` takes each SSE line and returns
  the events to hand out now, ``finish()`` the rest once the body ended, ``succeeded()`` records it.
  Events before the first token are held back: an attempt that fails before any output is retried
  and its events are dropped, so the caller never sees half of a failed attempt.

On a failure the client calls ``failed(error)`` (transport errors converted first) and then
``retry_delay()``, which raises the error when :class:`~._core.Call` decides not to retry.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Mapping, NoReturn

from zerolayer import contract

from . import errors, wire
from ._core import Call
from .types import Message, StreamEvent

TOKEN_EVENT = "content_block_delta"


class _Attempt:
    """Where one attempt goes, what it sends, when it started and how it failed."""

    def __init__(self, call: Call, clock: Callable[[], float] = time.monotonic) -> None:
        self.call = call
        self.attempt = call.plan()  # raises NoNodeAvailable when nowhere is usable
        self.endpoint = self.attempt.target.endpoint
        self.url, self.headers, self.body = self.attempt.url, self.attempt.headers, self.attempt.body
        self._clock = clock
        self.start = clock()
        self.request_id: str | None = None
        self.delivered = 0  # token events handed out
        self.error: errors.APIError | None = None

    def failed(self, error: errors.APIError) -> None:
        self.error = error

    def retry_delay(self) -> float:
        """After :meth:`failed`: the seconds to wait before the next attempt. Raises the error when the
        retry policy or the retry budget says there is none."""
        assert self.error is not None, "retry_delay() before failed()"
        delay = self.call.failed_attempt(self.attempt, self.error)
        if delay is None:
            raise self.error
        return delay


class MessageAttempt(_Attempt):
    """One attempt at a whole (not streamed) message."""

    def answered(self, status: int, headers: Mapping[str, str], content: bytes) -> Message | None:
        """The message, its success recorded; or ``None`` after an error status (then :meth:`retry_delay`).
        A success whose body is not JSON raises :class:`~.errors.APIError` (not retried)."""
        if status >= 400:
            self.failed(wire.error_from_response(status, headers, content, endpoint=self.endpoint))
            return None
        request_id = headers.get(contract.REQUEST_ID)
        try:
            data = json.loads(content)
        except ValueError as exc:
            raise errors.APIError(
                f"invalid JSON in a {status} response", endpoint=self.endpoint, request_id=request_id
            ) from exc
        message = Message(data, request_id=request_id, endpoint=self.endpoint, attempts=self.attempt.number)
        self.call.succeeded(self.attempt, message.request_id, None, self._clock() - self.start)
        return message


class StreamAttempt(_Attempt):
    """One attempt at a streamed message: SSE lines in, events out."""

    def __init__(self, call: Call, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(call, clock)
        self.ttft: float | None = None
        self._held: list[StreamEvent] = []  # events before the first token: dropped if the attempt fails
        self._decoder = wire.SSEDecoder()

    def opened(self, status: int, headers: Mapping[str, str]) -> bool:
        """The response head. True when it is a refusal: read the body and pass it to :meth:`refused`."""
        self.request_id = headers.get(contract.REQUEST_ID)
        return status >= 400

    def refused(self, status: int, headers: Mapping[str, str], content: bytes) -> NoReturn:
        raise wire.error_from_response(status, headers, content, endpoint=self.endpoint)

    def feed(self, line: str) -> list[StreamEvent]:
        """One line of the body; the events to hand out now (none while no token came yet).
        An SSE ``error`` event or an undecodable one raises :class:`~.errors.APIError`."""
        sse = self._decoder.feed(line)
        if sse is None:
            return []
        event = self._decode(sse)
        out: list[StreamEvent] = []
        if event.get("type") == TOKEN_EVENT:
            if self.delivered == 0:
                self.ttft = self._clock() - self.start
                out, self._held = self._held, []
            self.delivered += 1
        if self.delivered:
            out.append(event)
        else:
            self._held.append(event)
        return out

    def finish(self) -> list[StreamEvent]:
        """The body ended: the events still to hand out (an event the last line completed, and those
        held because no token came)."""
        out = self.feed("")
        out.extend(self._held)
        self._held = []
        return out

    def succeeded(self) -> None:
        """Every event was handed out: record the success (time to first token, total time)."""
        self.call.succeeded(self.attempt, self.request_id, self.ttft, self._clock() - self.start)

    def _decode(self, sse: wire.ServerSentEvent) -> StreamEvent:
        if sse.event == "error":
            raise wire.error_from_sse(sse.data, endpoint=self.endpoint, request_id=self.request_id,
                                      tokens_delivered=self.delivered)
        try:
            return StreamEvent(json.loads(sse.data))
        except ValueError as exc:
            raise errors.APIError(
                f"invalid JSON in SSE event {sse.event!r}: {sse.data[:80]!r}",
                endpoint=self.endpoint,
                request_id=self.request_id,
                tokens_delivered=self.delivered,
            ) from exc
