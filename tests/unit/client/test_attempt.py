"""The sans-IO attempts both clients drive (client/attempt.py): lines and answers in, events and
decisions out, with a recording stand-in for :class:`~zerolayer.client._core.Call` and a fake clock."""

from __future__ import annotations

import json
import types

import pytest

from zerolayer.client import errors
from zerolayer.client.attempt import MessageAttempt, StreamAttempt

ENDPOINT = "http://node-a:8080"


class RecordingCall:
    """Plans one attempt; records what the attempt reports; retries ``retries`` times after 0.5 s."""

    def __init__(self, retries: int = 0) -> None:
        self.retries = retries
        self.succeeded_with: tuple | None = None  # type: ignore[type-arg]
        self.failures: list[errors.APIError] = []

    def plan(self):  # type: ignore[no-untyped-def]
        target = types.SimpleNamespace(endpoint=ENDPOINT)
        return types.SimpleNamespace(target=target, url=ENDPOINT + "/v1/messages", headers={}, body={}, number=1)

    def succeeded(self, attempt, request_id, ttft_s, total_s) -> None:  # type: ignore[no-untyped-def]
        self.succeeded_with = (request_id, ttft_s, total_s)

    def failed_attempt(self, attempt, error):  # type: ignore[no-untyped-def]
        self.failures.append(error)
        return 0.5 if len(self.failures) <= self.retries else None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sse(kind: str, **data: object) -> list[str]:
    return [f"event: {kind}", "data: " + json.dumps({"type": kind, **data}), ""]


START = sse("message_start")
TOKEN = sse("content_block_delta", delta={"text": "hi"})
STOP = sse("message_stop")


def types_of(events) -> list[str]:  # type: ignore[no-untyped-def]
    return [e["type"] for e in events]


def run(lines: list[str], call: RecordingCall | None = None, clock: Clock | None = None):  # type: ignore[no-untyped-def]
    attempt = StreamAttempt(call or RecordingCall(), clock or Clock())  # type: ignore[arg-type]
    assert attempt.opened(200, {"x-request-id": "r1"}) is False
    handed = [types_of(attempt.feed(line)) for line in lines]
    return attempt, handed, types_of(attempt.finish())


@pytest.mark.parametrize("lines, per_line_out, at_finish", [
    # Events before the first token wait for it, then leave with it.
    (START + TOKEN + STOP, [[], [], [], [], [], ["message_start", "content_block_delta"], [], [], ["message_stop"]],
     []),
    # No token at all: everything is handed out at the end.
    (START + STOP, [[]] * 6, ["message_start", "message_stop"]),
    # The last event without its blank line is completed by finish().
    (TOKEN + STOP[:2], [[], [], ["content_block_delta"], [], []], ["message_stop"]),
    # Comments and keep-alives produce nothing.
    ([": ping", ""] + TOKEN, [[], [], [], [], ["content_block_delta"]], []),
])
def test_feed_holds_events_until_the_first_token(lines, per_line_out, at_finish):
    _, handed, rest = run(lines)
    assert handed == per_line_out
    assert rest == at_finish


def test_success_records_time_to_first_token_and_total():
    call, clock = RecordingCall(), Clock()
    attempt = StreamAttempt(call, clock)  # type: ignore[arg-type]
    attempt.opened(200, {"x-request-id": "r1"})
    clock.now = 100.25
    for line in START + TOKEN:
        attempt.feed(line)
    clock.now = 101.0
    attempt.finish()
    attempt.succeeded()
    assert call.succeeded_with == ("r1", 0.25, 1.0) and attempt.delivered == 1


def test_an_error_event_raises_with_the_tokens_delivered():
    attempt, _, _ = run(TOKEN)
    with pytest.raises(errors.APIError) as caught:
        for line in sse("error", error={"type": "overloaded_error", "message": "busy"}):
            attempt.feed(line)
    assert caught.value.tokens_delivered == 1 and caught.value.endpoint == ENDPOINT


def test_undecodable_event_raises():
    attempt = StreamAttempt(RecordingCall(), Clock())  # type: ignore[arg-type]
    with pytest.raises(errors.APIError, match="invalid JSON in SSE event"):
        for line in ["event: message_start", "data: {nope", ""]:
            attempt.feed(line)


def test_a_refusal_raises_the_decoded_error_and_retry_delay_decides():
    call = RecordingCall(retries=1)
    attempt = StreamAttempt(call, Clock())  # type: ignore[arg-type]
    body = json.dumps({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}).encode()
    assert attempt.opened(529, {"x-request-id": "r2"}) is True
    with pytest.raises(errors.APIError) as caught:
        attempt.refused(529, {}, body)
    attempt.failed(caught.value)
    assert attempt.retry_delay() == 0.5  # the call allows one retry
    again = StreamAttempt(call, Clock())  # type: ignore[arg-type]
    again.failed(caught.value)
    with pytest.raises(errors.APIError):
        again.retry_delay()  # no retry left: the error itself is raised


def test_message_attempt_answers_or_fails():
    call = RecordingCall()
    ok = MessageAttempt(call, Clock())  # type: ignore[arg-type]
    message = ok.answered(200, {"x-request-id": "r3"}, json.dumps({"content": []}).encode())
    assert message is not None and message.request_id == "r3" and message.attempts == 1
    assert call.succeeded_with == ("r3", None, 0.0)
    refused = MessageAttempt(call, Clock())  # type: ignore[arg-type]
    assert refused.answered(503, {}, b'{"type": "error", "error": {"type": "api_error", "message": "x"}}') is None
    assert isinstance(refused.error, errors.APIError)
    with pytest.raises(errors.APIError, match="invalid JSON in a 200 response"):
        MessageAttempt(call, Clock()).answered(200, {}, b"<html>")  # type: ignore[arg-type]
