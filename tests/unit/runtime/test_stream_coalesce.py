"""Batched stream events when a client falls behind (docs/server-core.md).

A client that keeps up gets one SSE event per engine delta, byte for byte what the stream sent
before batching existed (the oracle below is that loop). A channel that is backlogged (its previous
piece has not left) gets fewer events, whose text adds up to the whole output and whose usage and
metering stay exact; tool-call pieces are never merged.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, AsyncIterator, Sequence

import pytest

from tests.regression.wire import H2Peer, KEY as WIRE_KEY, connect, runtime, until
from zerolayer.runtime.api.anthropic_wire import ANTHROPIC
from zerolayer.runtime.api.common import Assembler
from zerolayer.runtime.api.completions_wire import COMPLETIONS
from zerolayer.runtime.api.openai_wire import OPENAI
from zerolayer.runtime.api.wire import StreamFrame, merge_deltas
from zerolayer.runtime.engine.base import Delta, TokenLogprob
from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.limits import Limits
from zerolayer.runtime.protocol.events import Accept, RequestHead, RequestReady
from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig, TenantPolicy
from zerolayer.runtime.serving.app import Application
from zerolayer.runtime.serving.channel import backlogged
from zerolayer.runtime.serving.metrics import RuntimeMetrics
from zerolayer.runtime.serving.session import _HOLD_DELTAS
from zerolayer.runtime.tenants import Tenant, TenantDirectory, key_hash

KEY = "sk-coalesce-test"
WIRES = {"/v1/chat/completions": OPENAI, "/v1/messages": ANTHROPIC, "/v1/completions": COMPLETIONS}
TOOL = {"type": "function", "function": {"name": "lookup", "description": "look it up",
                                         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


class TeeEngine(SyntheticEngine):
    """The synthetic engine, keeping every delta it yields (the oracle replays them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.yielded: list[Delta] = []

    async def generate(self, prompt, options, request_id, priority) -> AsyncIterator[Delta]:  # type: ignore[override]
        async for delta in super().generate(prompt, options, request_id, priority):
            self.yielded.append(delta)
            yield delta


class Recorder:
    """A response channel that keeps what it is given: each send() as one write. ``behind`` decides
    what its ``backlogged()`` answers (None: it has no such method, as a plain double)."""

    key = "1/1"

    def __init__(self) -> None:
        self.head_sent = False
        self.status = 0
        self.headers: dict[str, str] = {}
        self.writes: list[bytes] = []
        self.ended = False

    async def send_head(self, status: int, headers: Sequence[tuple[str, str]]) -> None:
        self.head_sent, self.status, self.headers = True, status, dict(headers)

    async def send(self, data: bytes) -> None:
        assert not self.ended
        self.writes.append(data)

    async def end(self, data: bytes = b"") -> None:
        self.writes.append(data)
        self.ended = True

    def reset(self, error_code: int) -> None:
        raise AssertionError(f"unexpected reset {error_code}")

    @property
    def body(self) -> bytes:
        return b"".join(self.writes)


class Behind(Recorder):
    """Always backlogged: everything after the opening event is held until the stream ends (or the
    held text passes the hold limit)."""

    def backlogged(self) -> bool:
        return True


class SlowReader(Recorder):
    """Backlogged while the reader has not taken what was written; it takes it every ``every_s``."""

    def __init__(self, every_s: float) -> None:
        super().__init__()
        self.every_s = every_s
        self.unread = 0
        self.checks = 0

    def backlogged(self) -> bool:
        self.checks += 1
        return self.unread > 0

    async def send(self, data: bytes) -> None:
        await super().send(data)
        self.unread += len(data)

    async def read_forever(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            self.unread = 0


async def application(engine: SyntheticEngine, sink: list[tuple] | None = None) -> Application:
    await engine.start()
    scheduler = MicroScheduler(SchedulerConfig())
    tenants = TenantDirectory([Tenant("acme", frozenset({key_hash(KEY)}), TenantPolicy("acme"))])
    scheduler.set_tenants(tenants.policies())
    token_sink = None
    if sink is not None:
        def token_sink(tenant: str, request_id: str, model: str, input_tokens: int, output_tokens: int,
                       first: bool) -> None:  # the TokenSink signature, strictly
            sink.append((tenant, request_id, model, input_tokens, output_tokens, first))
    return Application(engine=engine, scheduler=scheduler, tenants=tenants, metrics=RuntimeMetrics(),
                       limits=Limits(), token_sink=token_sink)


async def serve(app: Application, channel: Recorder, path: str, body: dict[str, Any]) -> None:
    request = RequestHead(1, "POST", path, {"content-type": "application/json", "x-api-key": KEY}, "node", False)
    verdict = app.gate(1, request)
    assert isinstance(verdict, Accept), verdict
    await app.serve(channel, RequestReady(request, json.dumps(body).encode(), verdict.context))
    assert channel.status == 200, channel.body


def events(body: bytes) -> list[dict[str, Any]]:
    """The SSE events' JSON (the ``[DONE]`` marker left out)."""
    out = []
    for block in body.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def text_of(path: str, body: bytes, index: int | None = None) -> str:
    """The streamed text (of choice ``index``; None: all of it, in event order)."""
    parts = []
    for event in events(body):
        if path == "/v1/messages":
            if event.get("type") == "content_block_delta" and event["delta"]["type"] == "text_delta":
                parts.append(event["delta"]["text"])
            continue
        for c in event.get("choices", []):
            if index is None or c["index"] == index:
                parts.append(c["text"] if path == "/v1/completions" else c["delta"].get("content") or "")
    return "".join(parts)


def text_events(path: str, body: bytes) -> int:
    if path == "/v1/messages":
        return sum(1 for e in events(body) if e.get("type") == "content_block_delta")
    return sum(1 for e in events(body) if e.get("choices") and
               (e["choices"][0].get("text") or (e["choices"][0].get("delta") or {}).get("content")))


def oracle(path: str, body: dict[str, Any], channel: Recorder, engine: TeeEngine, prompt_tokens: int) -> bytes:
    """What the stream sent before batching existed: the same deltas, one event each (the old loop)."""
    wire = WIRES[path]
    first = events(channel.body)
    created = first[0].get("created", 0) if first else 0
    frame = StreamFrame(channel.headers["x-request-id"], created, wire.parse(json.dumps(body).encode()))
    out = wire.stream_start(frame, prompt_tokens)
    answer = Assembler(frame.request, engine.parse_tool_calls, engine.tool_call_stream)
    for delta in engine.yielded:
        sent = answer.add(delta)
        if sent is not None:
            out += wire.stream_delta(frame, *sent)
    output_tokens = sum(d.token_count for d in engine.yielded)
    return out + wire.stream_end(frame, answer.choices(), prompt_tokens, output_tokens)


CASES = [
    ("/v1/chat/completions", {}),
    ("/v1/chat/completions", {"n": 2, "logprobs": True, "top_logprobs": 2,
                              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("/v1/messages", {}),
    ("/v1/completions", {"logprobs": 1, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("/v1/completions", {"echo": True}),
]


def request_body(path: str, extra: dict[str, Any], max_tokens: int = 60) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "synthetic", "max_tokens": max_tokens, "stream": True, **extra}
    if path == "/v1/completions":
        body["prompt"] = "once upon a time"
    else:
        body["messages"] = [{"role": "user", "content": "tell me something"}]
    return body


@pytest.mark.parametrize(("path", "extra"), CASES)
async def test_a_client_that_keeps_up_gets_one_event_per_delta_byte_for_byte(path, extra):
    engine = TeeEngine(output_tokens=60)
    sink: list[tuple] = []
    app = await application(engine, sink)
    body = request_body(path, extra)
    channel = Recorder()
    await serve(app, channel, path, body)
    assert channel.body == oracle(path, body, channel, engine, sink[0][3])
    sent = [d for d in engine.yielded if d.text or d.logprobs]
    assert text_events(path, channel.body) == len(sent)
    assert [c[3:] for c in sink[1:]] == [(0, d.token_count, False) for d in engine.yielded if d.token_count]


@pytest.mark.parametrize(("path", "extra"), CASES)
async def test_a_backlogged_channel_gets_merged_events_with_exact_text_usage_and_metering(path, extra):
    fast_engine, slow_engine = TeeEngine(output_tokens=60), TeeEngine(output_tokens=60)
    fast_sink: list[tuple] = []
    slow_sink: list[tuple] = []
    body = request_body(path, extra)
    fast, slow = Recorder(), Behind()
    await serve(await application(fast_engine, fast_sink), fast, path, body)
    await serve(await application(slow_engine, slow_sink), slow, path, body)
    assert [d.text for d in slow_engine.yielded] == [d.text for d in fast_engine.yielded]
    n = body.get("n", 1)
    # Held until the end or until _HOLD_DELTAS deltas are held: one text event per choice per flush (the
    # opening events and the close as before).
    flushes = math.ceil(len(slow_engine.yielded) / _HOLD_DELTAS)
    assert n <= text_events(path, slow.body) <= n * flushes < text_events(path, fast.body)
    for i in range(n):  # each choice's text, whole and in order (choices' events may interleave differently)
        whole = "".join(d.text for d in slow_engine.yielded if d.index == i)
        assert whole and text_of(path, slow.body, i) == text_of(path, fast.body, i) == whole
    slow_events, fast_events = events(slow.body), events(fast.body)
    assert slow_events[-1] == {**fast_events[-1], **{k: slow_events[-1][k] for k in ("id",) if k in slow_events[-1]}}
    # Metering: the same calls, per delta, in order; their sum is the output.
    assert [c[3:] for c in slow_sink] == [c[3:] for c in fast_sink]
    output = sum(d.token_count for d in slow_engine.yielded)
    assert sum(c[4] for c in slow_sink) == output
    if "continuous_usage_stats" in json.dumps(extra):
        for i in range(n):  # each choice's running usage ends at that choice's whole output
            last = [e for e in slow_events if e.get("choices") and e["choices"][0]["index"] == i
                    and e.get("usage")][-1]
            assert last["usage"]["completion_tokens"] == sum(d.token_count for d in slow_engine.yielded if d.index == i)
    if "logprobs" in extra:
        tokens = []
        for e in slow_events:
            for c in e.get("choices", []):
                lp = c.get("logprobs")
                if lp:
                    tokens += [t["token"] for t in lp["content"]] if "content" in lp else lp["tokens"]
        assert len(tokens) == sum(len(d.logprobs) for d in slow_engine.yielded)


async def test_a_slow_reader_gets_fewer_events_and_everything_in_order():
    engine = TeeEngine(output_tokens=400, tokens_per_second=4000)
    sink: list[tuple] = []
    app = await application(engine, sink)
    body = request_body("/v1/chat/completions", {"stream_options": {"include_usage": True,
                                                                   "continuous_usage_stats": True}}, 400)
    channel = SlowReader(every_s=0.01)
    reader = asyncio.ensure_future(channel.read_forever())
    try:
        await serve(app, channel, "/v1/chat/completions", body)
    finally:
        reader.cancel()
    full = "".join(d.text for d in engine.yielded)
    assert text_of("/v1/chat/completions", channel.body) == full
    chunks = [e for e in events(channel.body) if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert 1 < len(chunks) < len(engine.yielded) // 2  # batched, but not all at the end
    running = [e["usage"]["completion_tokens"] for e in chunks]
    assert running == sorted(running) and running[-1] == sum(d.token_count for d in engine.yielded)
    # Each chunk's usage counts exactly the tokens of the text before and in it.
    seen = 0
    for e in chunks:
        seen += len(e["choices"][0]["delta"]["content"])
    assert seen == len(full)
    assert events(channel.body)[-1]["usage"]["completion_tokens"] == 400
    assert [c[3:] for c in sink[1:]] == [(0, d.token_count, False) for d in engine.yielded if d.token_count]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_tool_call_streams_are_unchanged_when_behind(path):
    if path == "/v1/messages":
        tools = {"tools": [{"name": "lookup", "description": "look it up",
                            "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}],
                 "tool_choice": {"type": "any"}}
    else:
        tools = {"tools": [TOOL], "tool_choice": "required"}
    body = request_body(path, tools, 80)
    fast_engine, slow_engine = TeeEngine(output_tokens=80), TeeEngine(output_tokens=80)
    fast, slow = Recorder(), Behind()
    await serve(await application(fast_engine), fast, path, body)
    await serve(await application(slow_engine), slow, path, body)
    assert [d.text for d in slow_engine.yielded] == [d.text for d in fast_engine.yielded]

    def calls(raw: bytes) -> list[Any]:
        found = []
        for e in events(raw):
            if path == "/v1/messages":
                if e.get("type") in ("content_block_start", "content_block_delta", "content_block_stop"):
                    found.append({k: v for k, v in e.items() if not (k == "content_block" and "id" in v)})
            else:
                for c in e.get("choices", []):
                    for call in (c.get("delta") or {}).get("tool_calls") or ():
                        found.append({k: v for k, v in call.items() if k != "id"})
        return found

    assert calls(fast.body) and calls(slow.body) == calls(fast.body)
    assert text_of(path, slow.body) == text_of(path, fast.body)


async def test_merging_keeps_tool_call_pieces_apart_and_text_before_them_first():
    from zerolayer.runtime.serving.session import _Batcher
    from zerolayer.runtime.engine.base import ToolCallPiece

    channel, metered = Behind(), []
    frame = StreamFrame("chatcmpl-x", 1, OPENAI.parse(json.dumps(request_body("/v1/chat/completions", {})).encode()))
    batcher = _Batcher(channel, OPENAI, frame, metered.append)
    call = (ToolCallPiece(0, '{"q"', "call_1", "lookup"),)
    for sent, tokens in [((Delta("a", 1), ()), 1), (None, 2), ((Delta("b", 1), ()), 1),
                         ((Delta("", 1), call), 1), ((Delta("c", 1), ()), 1), ((Delta("d", 1), ()), 1)]:
        await batcher.put(sent, tokens)
    assert channel.writes == [] and metered == []  # all held: the channel is behind
    await batcher.flush()
    assert len(channel.writes) == 1  # one write...
    got = events(channel.body)  # ...of three events: "ab", the call, "cd"
    assert [e["choices"][0]["delta"] for e in got] == [
        {"content": "ab"},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "lookup", "arguments": '{"q"'}}]},
        {"content": "cd"}]
    assert metered == [1, 2, 1, 1, 1, 1]  # per delta, in order, after the write


def test_merge_deltas_concatenates_sums_and_keeps_the_last_finish():
    lp = TokenLogprob("a", -0.5)
    first = Delta("a", 1, None, 1, logprobs=(lp,), token_ids=(7,), cached_tokens=3, scheduled_at=1.0)
    then = Delta("bc", 2, "stop", 1, "END", (lp, lp), (8, 9))
    assert merge_deltas(first, then) == Delta("abc", 3, "stop", 1, "END", (lp, lp, lp), (7, 8, 9), 3, 1.0)
    assert merge_deltas(then, Delta("", 0, index=1)).finish_reason == "stop"


def test_backlogged_reads_the_transport_channel_and_defaults_to_no():
    assert not backlogged(Recorder()) and backlogged(Behind())

    class Core:
        def __init__(self) -> None:
            self.queued = 0

        def backlog(self, sid: int) -> int:
            return self.queued

    class Conn:
        def __init__(self) -> None:
            self.core, self._paused = Core(), False

    class TransportChannel:
        def __init__(self) -> None:
            self.conn, self.sid = Conn(), 1

    channel = TransportChannel()
    assert not backlogged(channel)  # type: ignore[arg-type]
    channel.conn.core.queued = 10
    assert backlogged(channel)  # type: ignore[arg-type]
    channel.conn.core.queued, channel.conn._paused = 0, True
    assert backlogged(channel)  # type: ignore[arg-type]


def _h2_events(raw: bytes) -> list[dict[str, Any]]:
    return events(raw)


TOKENS = 1000


async def test_the_real_h2_transport_batches_for_a_peer_that_stops_reading_then_reads():
    """The real Connection and HTTP/2 core: the peer reads nothing until its 64 KiB window is spent
    (the stream's bytes then wait in the core: backlogged), then reads every 20 ms."""
    server = await runtime(engine=SyntheticEngine(output_tokens=TOKENS, tokens_per_second=20000))
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    body = json.dumps({"model": "synthetic", "max_tokens": TOKENS, "stream": True,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    sid = peer.request(body, path="/v1/chat/completions", key=WIRE_KEY)
    await until(lambda: any(s.output_tokens > 500 for s in server.app.streams.values()))  # > 64 KiB
    for _ in range(500):
        await asyncio.sleep(0.02)
        peer.read()
        if peer.body(sid).endswith(b"data: [DONE]\n\n"):
            break
    assert peer.status(sid) == 200 and peer.reset_code(sid) is None
    got = _h2_events(peer.body(sid))
    chunks = [e for e in got if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert got[-1]["usage"]["completion_tokens"] == TOKENS
    assert chunks[-1]["usage"]["completion_tokens"] == TOKENS  # the running usage ends exact
    assert len(chunks) < TOKENS  # fewer events than deltas: some were merged
    assert any(len(e["choices"][0]["delta"]["content"].split()) > 1 for e in chunks)

    # The same request from a peer that keeps up: one event per token, and the same text.
    server2 = await runtime(engine=SyntheticEngine(output_tokens=TOKENS, tokens_per_second=3000))
    conn2, sock2 = connect(server2)
    peer2 = H2Peer(conn2, sock2)
    sid2 = peer2.request(body, path="/v1/chat/completions", key=WIRE_KEY)
    for _ in range(5000):
        await asyncio.sleep(0.001)
        peer2.read()
        if peer2.body(sid2).endswith(b"data: [DONE]\n\n"):
            break
    got2 = _h2_events(peer2.body(sid2))
    chunks2 = [e for e in got2 if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert "".join(e["choices"][0]["delta"]["content"] for e in chunks) == \
        "".join(e["choices"][0]["delta"]["content"] for e in chunks2)
    assert len(chunks2) == TOKENS
