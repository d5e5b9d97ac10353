"""A chat request's life from HEADERS to settle, and the table of those alive.

:class:`StreamSession` starts from what the admission gate decided (:class:`~zerolayer.runtime.serving.gate.Admitted`)
and owns the rest: parse the body in its wire API, render the prompt, ``admit(stage="body")``
with the exact token count, generate, write the answer (JSON or SSE), meter tokens, and
**settle exactly once** — answered, refused, failed, preempted by the scheduler, or cancelled
because the peer went away, including before its body arrived.

:class:`SessionTable` holds the sessions by stream key and the services they use; it is what the
transport's stream events (reset, connection lost, task attached) and the scheduler's
preemptions reach. Errors before response headers become a status with the wire API's error
body; after them, an SSE error event then RST_STREAM with the contract's code.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import os
from typing import Any, AsyncGenerator, Callable, Protocol

from zerolayer.contract import ERRORS, ErrorCode, Priority
from zerolayer.logformat import bind_request
from zerolayer.runtime.api.common import Assembler, ChatRequest, render_prompt
from zerolayer.runtime.api.wire import StreamFrame, WireApi, merge_deltas
from zerolayer.runtime.serving.channel import Channel, backlogged, respond, send_error
from zerolayer.runtime.serving.demand import DemandLedger
from zerolayer.runtime.engine.base import Delta, Engine, InputRejected, ToolCallPiece
from zerolayer.runtime.errors import EngineError, RequestRefused
from zerolayer.runtime.serving.gate import Admitted, Route, model_refusal, refusal
from zerolayer.runtime.serving.headers import RequestContract
from zerolayer.runtime.serving.metrics import RuntimeMetrics
from zerolayer.runtime.serving.tracing import Timeline, Tracer, trace_id_of
from zerolayer.runtime.scheduler.api import Reservation, RunningStream, Scheduler, Ticket
from zerolayer.runtime.tenants import Tenant

log = logging.getLogger(__name__)


class _RandomBytes:
    """Request ids' random part: ``os.urandom`` read 4 KiB at a time, 12 bytes per id, instead of a
    ``getrandom`` system call per request (issue 29; ``bench/percall_micro.py``). The pool is dropped
    in a forked child, so two processes never hand out the same bytes."""

    POOL = 4096

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0
        os.register_at_fork(after_in_child=self._drop)

    def _drop(self) -> None:
        self._pool, self._at = b"", 0

    def hex12(self) -> str:
        at = self._at
        if at + 12 > len(self._pool):
            self._pool, at = os.urandom(self.POOL), 0
        self._at = at + 12
        return self._pool[at:at + 12].hex()


_RANDOM = _RandomBytes()


class TokenSink(Protocol):
    """Metering (e.g. :meth:`zerolayer.bpf.probes.TokenProbe.emit`): called right after tokens were
    handed to the transport for the client. Must not block."""

    def __call__(self, tenant: str, request_id: str, model: str, input_tokens: int, output_tokens: int,
                 first: bool) -> Any: ...


class SessionTable:
    """The open sessions by stream key, and what every session needs to run.

    ``alternatives`` is the gate's (pressure refusals at body time carry it too).
    """

    def __init__(self, *, engine: Engine, scheduler: Scheduler, metrics: RuntimeMetrics,
                 clock: Callable[[], float] = time.monotonic, token_sink: TokenSink | None = None,
                 alternatives: Callable[[str | None], str | None] | None = None,
                 demand: DemandLedger | None = None, tracer: Tracer | None = None) -> None:
        self.engine = engine
        self.tracer = tracer  # None: tracing off, sessions keep no timeline
        self.scheduler = scheduler
        self.metrics = metrics
        self.clock = clock
        self.token_sink = token_sink
        self.alternatives = alternatives
        self.demand = demand  # the gate's (a body naming a model not served here is recorded too)
        self.streams: dict[str, StreamSession] = {}
        metrics.streams_active.set_function(lambda: len(self.streams))  # read at scrape, not per request
        self.engine_requests_started = 0  # every generate() call; tests assert resets never start work

    def open(self, admitted: Admitted) -> "StreamSession":
        """Register the session the gate admitted (it holds a reservation until settled)."""
        session = StreamSession(self, admitted)
        self.streams[session.key] = session
        return session

    def running(self) -> list[RunningStream]:
        """The scheduler's view of every session whose work began."""
        return [s.running() for s in self.streams.values() if s.started and not s.settled]

    def attach(self, key: str, task: asyncio.Task[Any]) -> None:
        session = self.streams.get(key)
        if session is not None:
            session.task = task

    def stream_aborted(self, key: str) -> None:
        """The peer reset the stream or the connection went away."""
        session = self.streams.get(key)
        if session is not None:
            session.abort()

    def connection_lost(self, conn_id: int) -> None:
        """The connection is gone: end every stream it carried."""
        for session in [s for s in self.streams.values() if s.conn_id == conn_id]:
            session.abort()

    def preempt(self, key: str, code: ErrorCode, reason: str) -> bool:
        """Stop a stream with ``code`` (SSE error + RST_STREAM, engine abort). False if unknown or over."""
        session = self.streams.get(key)
        return session is not None and session.preempt(code, reason)

    def _closed(self, session: "StreamSession") -> None:
        self.streams.pop(session.key, None)


class StreamSession:
    """One chat request; see the module docstring. Its fields are what the scheduler and the
    energy meter read (``running()``, token counts, ``started``/``settled``)."""

    def __init__(self, table: SessionTable, admitted: Admitted) -> None:
        assert admitted.tenant is not None and admitted.terms is not None and admitted.ticket is not None
        self.table = table
        self.key = admitted.key
        self.conn_id = admitted.conn_id
        self.route: Route = admitted.route
        self.wire: WireApi = admitted.route.wire
        self.tenant: Tenant = admitted.tenant
        self.contract: RequestContract = admitted.terms
        self.ticket: Ticket = admitted.ticket
        self.arrived = admitted.arrived
        self.reservation: Reservation | None = admitted.reservation
        self.task: asyncio.Task[Any] | None = None
        self.started = False  # run() began
        self.engine_request: str | None = None  # set once engine work started, cleared when it ended
        self.engine: Engine = table.engine  # the requested model's engine once the body names it
        self.first_token_sent = False
        self.first_token_at = 0.0  # monotonic, once first_token_sent
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.final_only = False  # the engine gives whole completions at their end (a request not streamed)
        self.preempted: tuple[ErrorCode, str] | None = None
        self.settled = False
        self.traceparent = admitted.traceparent
        self.trace = (Timeline(admitted.traceparent, admitted.arrived, admitted.gated)
                      if table.tracer is not None else None)  # tracing off: nothing kept

    def running(self) -> RunningStream:
        return RunningStream(self.key, self.ticket.priority, self.prompt_tokens + self.output_so_far(),
                             self.contract.effective_deadline(self.first_token_sent))

    def output_so_far(self) -> int:  # output tokens made so far (final_only, running: as the engine counts them)
        if self.final_only and self.engine_request is not None:
            return max(self.output_tokens, self.engine.tokens_so_far(self.engine_request))
        return self.output_tokens

    # ------------------------------------------------------------------ the body arrived
    async def run(self, channel: Channel, body: bytes) -> None:
        """Serve the request on ``channel``; settles before returning, however it ends."""
        if self.settled:
            # Preempted while its body was still arriving: nothing ran, answer with the code now.
            code, reason = self.preempted or (ErrorCode.INTERNAL_ERROR, "settled")
            await send_error(channel, self.table.metrics, self.wire, _stopped(code, reason), self.route.name,
                             trace_id=self._trace_id())
            return
        self.started = True
        if self.trace is not None:
            self.trace.body = self.table.clock()
        # this task's log lines name the request (--log-format json); its copy of the context is its own
        bind_request(tenant=self.tenant.name, trace_id=f"{self.trace.trace_id:032x}" if self.trace else None)
        task = self.task  # the transport attached the task running this (SessionTable.attach)
        if task is None:
            task = self.task = asyncio.current_task()
        try:
            await self._generate(channel, body)
        except RequestRefused as refused:
            await self._fail(channel, refused)
        except InputRejected as exc:
            await self._fail(channel, RequestRefused(ErrorCode.INVALID_REQUEST, str(exc), reason="input_rejected"))
        except EngineError as exc:
            # The engine's own text stays in the log: it may name internals (paths, other requests).
            log.warning("engine error on %s%s: %s", self.key,
                        f" (trace {self.trace.trace_id:032x})" if self.trace is not None else "", exc)
            await self._fail(channel, RequestRefused(ErrorCode.INTERNAL_ERROR, "the engine failed on this request",
                                                     reason="engine"))
        except asyncio.CancelledError:
            if self.preempted is None:
                raise  # the client went away or the connection closed: nobody to answer
            if task is not None:
                task.uncancel()
            code, reason = self.preempted
            self.table.metrics.preemptions.labels(code.value, reason).inc()
            await self._fail(channel, _stopped(code, reason), preempted=True)
        finally:
            await self._finish()

    async def _generate(self, channel: Channel, body: bytes) -> None:
        table = self.table
        engine = table.engine
        request = self.wire.parse(body)
        if request.model not in engine.models:
            raise model_refusal(request.model, engine.models, table.demand, self.tenant)
        engine = self.engine = engine.for_model(request.model)  # several models: one engine each
        priority = self.ticket.priority
        if request.priority is not None and not self.contract.priority_given:
            priority = Priority.parse(request.priority)
        prompt = await render_prompt(engine, request)
        self._check_context(request, max(p.token_count for p in prompt.each()))  # a batch: each prompt's own
        self.prompt_tokens = prompt.token_count
        self.ticket = self.ticket.sized(request.model, priority, prompt.token_count,
                                        request.max_tokens * request.choice_count)  # one output per choice
        admission = table.scheduler.admit(self.ticket, table.clock(), stage="body")
        if not admission.admitted:
            self.reservation = None  # the scheduler released the HEADERS reservation itself
            raise refusal(admission, self.ticket.session, table.alternatives)
        self.reservation = admission.reservation or self.reservation
        engine_priority = getattr(admission, "engine_priority", None)
        if engine_priority is None:
            engine_priority = int(priority)
        deadline = self.contract.effective_deadline(False)
        if deadline is not None and table.clock() >= deadline:
            raise RequestRefused(ErrorCode.DEADLINE_EXCEEDED, "deadline passed before generation started",
                                 reason="deadline_before_start")
        options = request.sampling_options()
        if options.final_only and self.contract.ttft_deadline is not None:  # a TTFT SLO waits for the 1st token
            options = dataclasses.replace(options, final_only=False)
        if self.trace is not None:  # an engine with tracing of its own (vLLM) puts its spans under ours
            options = dataclasses.replace(options, traceparent=self.trace.traceresponse())
        self.final_only = options.final_only
        request_id = f"{self.wire.id_prefix}_{_RANDOM.hex12()}"  # 24 hex digits, as uuid4().hex[:24] was
        self.engine_request = request_id
        table.engine_requests_started += 1
        bind_request(request_id=request_id)
        if self.trace is not None:
            self.trace.submitted = table.clock()
        deltas = engine.generate(prompt, options, request_id, engine_priority)
        head = [("x-request-id", request_id), *admission.headers.items(), *self._trace_headers()]
        frame = StreamFrame(request_id, int(time.time()), request)
        tenant = self.tenant.name
        table.metrics.count_tokens(tenant, "prompt", prompt.token_count)
        if request.stream:
            await self._stream(channel, frame, deltas, head)
        else:
            await self._complete(channel, frame, deltas, head)
        table.metrics.count_tokens(tenant, "completion", self.output_tokens)
        if self.output_tokens > 1:
            table.metrics.observe_tpot((table.clock() - self.first_token_at) / (self.output_tokens - 1))
        self.engine_request = None  # finished: nothing to abort

    def _check_context(self, request: ChatRequest, prompt_tokens: int) -> None:
        """A prompt that fills the model's context, or a ``max_tokens`` beyond it, is the client's
        mistake (400), not an engine failure: say so before any engine work starts."""
        context = self.engine.context_length(request.model)
        if not context:
            return
        if prompt_tokens >= context:
            raise RequestRefused(ErrorCode.INVALID_REQUEST,
                                 f"the prompt is {prompt_tokens} tokens; {request.model} takes at most {context} "
                                 "tokens of prompt and output together", reason="prompt_too_long")
        if request.max_tokens > context:
            raise RequestRefused(ErrorCode.INVALID_REQUEST,
                                 f"max_tokens {request.max_tokens} is more than {request.model}'s context of "
                                 f"{context} tokens", reason="max_tokens_over_context")

    def _first_token(self, delta: Delta) -> None:
        self.first_token_sent = True
        self.first_token_at = delta.first_token_at or self.table.clock()  # a whole completion says when
        if self.trace is not None:
            self.trace.first_token, self.trace.scheduled = self.first_token_at, delta.scheduled_at or 0.0
        self.table.metrics.observe_ttft(self.first_token_at - self.arrived)

    async def _complete(self, channel: Channel, frame: StreamFrame, deltas: Any,
                        head: list[tuple[str, str]]) -> None:
        try:
            answer = Assembler(frame.request, self.engine.parse_tool_calls)
            made = 0
            async for delta in deltas:
                if not self.first_token_sent and delta.token_count:
                    self._first_token(delta)
                made += delta.token_count  # and a cut may have read the engine's count already:
                self.output_tokens = max(self.output_tokens, made)
                answer.add(delta)
            body = self.wire.completion(frame, answer.choices(), self.prompt_tokens, self.output_tokens)
            await respond(channel, self.table.metrics, 200, [("content-type", "application/json"), *head], body,
                          self.route.name)
        finally:
            # Metered once however it ends: answered, cancelled by the client or the scheduler, or
            # failed. The engine did the prefill and the tokens generated so far either way.
            sink = self.table.token_sink
            if sink is not None:
                sink(self.tenant.name, frame.request_id, frame.request.model, self.prompt_tokens,
                     self.output_tokens, True)

    async def _stream(self, channel: Channel, frame: StreamFrame, deltas: Any, head: list[tuple[str, str]]) -> None:
        """The SSE answer: one event per engine delta while the client keeps up; while it is behind
        (:func:`~zerolayer.runtime.serving.channel.backlogged`), the deltas that come meanwhile are
        held and merged (:class:`_Batcher`), and go out as one event once the channel can take them."""
        wire, model, rid = self.wire, frame.request.model, frame.request_id
        await channel.send_head(200, [("content-type", "text/event-stream"), ("cache-control", "no-cache"), *head])
        self.table.metrics.count_request(self.route.name, 200)
        await channel.send(wire.stream_start(frame, self.prompt_tokens))
        sink = self.table.token_sink
        tenant = self.tenant.name
        meter: Callable[[int], Any] | None = None
        if sink is not None:
            sink(tenant, rid, model, self.prompt_tokens, 0, True)

            def meter_delta(tokens: int) -> Any:  # one call per engine delta, as before batching
                return sink(tenant, rid, model, 0, tokens, False)

            meter = meter_delta

        answer = Assembler(frame.request, self.engine.parse_tool_calls, self.engine.tool_call_stream)
        batcher = _Batcher(channel, wire, frame, meter)
        async with contextlib.aclosing(_paced(deltas, batcher, channel)) as paced:
            async for delta in paced:
                if delta.token_count and not self.first_token_sent:
                    self._first_token(delta)
                self.output_tokens += delta.token_count
                # tool calls stream as they are found; metered per delta once what it adds was handed over
                await batcher.put(answer.add(delta), delta.token_count)
        await batcher.flush()
        await channel.end(wire.stream_end(frame, answer.choices(), self.prompt_tokens, self.output_tokens))

    # ------------------------------------------------------------------ ends
    async def _fail(self, channel: Channel, refused: RequestRefused, preempted: bool = False) -> None:
        metrics = self.table.metrics
        if self.trace is not None:
            self.trace.attributes["error.type"] = refused.code.value
        if not preempted:
            metrics.refusals.labels(refused.code.value, refused.reason).inc()
        if not channel.head_sent:
            await send_error(channel, metrics, self.wire, refused, self.route.name, self._trace_headers(),
                             self._trace_id())
            return
        # Mid-stream: an SSE error event the SDKs understand, then RST_STREAM with the contract's code.
        try:
            event = self.wire.stream_error(refused.code, refused.message, self._trace_id())
            await asyncio.wait_for(channel.send(event), 1.0)
        except (asyncio.TimeoutError, ConnectionError):
            pass  # a reader too slow to take the error event still gets the reset
        channel.reset(ERRORS[refused.code].rst_code)

    async def _finish(self) -> None:
        """Settle exactly once (idempotent), then abort unfinished engine work.

        Settling comes first and without an await: the connection going away cancels this task a
        second time (``connection_lost`` after ``eof_received``, or RST_STREAM then FIN), and that
        cancel lands on the first await here. Anything after it must not be bookkeeping.
        """
        request_id, self.engine_request = self.engine_request, None
        self.settle()
        if self.trace is not None:
            self._emit_trace(self.trace)
        if request_id is not None:
            try:
                await asyncio.shield(self.engine.abort(request_id))
            except EngineError as exc:
                log.warning("engine abort of %s failed: %s", request_id, exc)

    def _trace_id(self) -> str | None:
        """The trace an error body names: this request's when traced, else the client's ``traceparent``'s."""
        return f"{self.trace.trace_id:032x}" if self.trace is not None else trace_id_of(self.traceparent)

    def _trace_headers(self) -> list[tuple[str, str]]:
        """``traceresponse`` naming this request's span, when traced: how a client finds its trace."""
        return [("traceresponse", self.trace.traceresponse())] if self.trace is not None else []

    def _emit_trace(self, trace: Timeline) -> None:
        """Hand the settled request's moments to the tracer (tracing on only: ``trace`` exists then)."""
        attributes = {"zerolayer.tenant": self.tenant.name, "zerolayer.model": self.ticket.model,
                      "zerolayer.priority": self.ticket.priority.name.lower(),
                      "gen_ai.usage.input_tokens": self.prompt_tokens, "gen_ai.usage.output_tokens": self.output_tokens}
        if self.table.tracer is not None:
            self.table.tracer.emit(trace.close(self.table.clock(), **attributes))

    def settle(self) -> None:
        """Leave the table and give the reservation back with the tokens used. Runs once."""
        if self.settled:
            return
        self.settled = True
        table = self.table
        table._closed(self)
        if self.reservation is not None:
            table.scheduler.settle(self.reservation, self.prompt_tokens + self.output_tokens, table.clock())

    def abort(self) -> None:
        """The peer reset the stream or its connection went away."""
        if self.settled:
            return
        if self.task is not None and self.started:
            if self.task.cancelling():
                return  # already being stopped (the peer's reset, then its FIN): one cancel is enough
            self.output_tokens = self.output_so_far()  # read before the cancel ends engine work; its finally settles
            self.task.cancel()
        else:
            if self.task is not None:
                self.task.cancel()  # never ran: the coroutine body (and its finally) will not run
            self.settle()

    def preempt(self, code: ErrorCode, reason: str) -> bool:
        """Stop with ``code`` (SSE error + RST_STREAM, engine abort). False if already over or stopping."""
        if self.settled or self.preempted is not None:
            return False
        self.preempted = (code, reason)
        if self.task is not None and self.started:
            self.output_tokens = self.output_so_far()  # whole completions: read before the cancel ends engine work
            self.task.cancel()
        else:
            # Body still arriving: nothing started. The transport answers when the body completes.
            if self.task is not None:
                self.task.cancel()
            self.table.metrics.preemptions.labels(code.value, reason).inc()
            self.settle()
        return True


# While text is held for a client that fell behind, how long the session waits for the engine's next
# delta before it looks again whether the channel can take the held text (an engine between tokens
# must not keep text a client could now read). Only a stream holding text waits this way.
_RECHECK_S = 0.005
# Held text past this many characters (or deltas) is sent even while the client is behind: from there the
# transport's own back-pressure (wait_writable, write_timeout_s) applies, as to any piece. Small on
# purpose: a merged event may go past the stream's low-water mark (limits.stream_buffer_low) by no more
# than one small event, as one unmerged event could, and a stalled reader stalls generation after this
# many characters (tests/integration/runtime/test_runtime_streams.py, slow reader). A one-token delta
# is a few characters, so a merged event still stands for tens of deltas.
_HOLD_CHARS = 512
_HOLD_DELTAS = 64  # and past this many deltas (a delta may be one character)


async def _paced(deltas: Any, batcher: "_Batcher", channel: Channel) -> AsyncGenerator[Delta, None]:
    """The engine's deltas, as ``async for`` takes them while the client keeps up. While text is held
    for a client that is behind, the next delta is awaited with a look every ``_RECHECK_S`` at whether
    the channel can take the held text meanwhile (then it is flushed)."""
    source = deltas.__aiter__()
    upcoming: asyncio.Task[Delta | None] | None = None  # the engine's next delta while text is held
    try:
        while True:
            if upcoming is None and not batcher.held:
                try:
                    delta = await source.__anext__()  # the client keeps up: as it always was
                except StopAsyncIteration:
                    return
            else:
                if upcoming is None:
                    upcoming = asyncio.ensure_future(_next_delta(source))
                done, _ = await asyncio.wait((upcoming,), timeout=_RECHECK_S if batcher.held else None)
                if not done:
                    if not backlogged(channel):
                        await batcher.flush()
                    continue
                task, upcoming = upcoming, None
                next_delta = task.result()
                if next_delta is None:
                    return
                delta = next_delta
            yield delta
    finally:
        if upcoming is not None:
            if upcoming.done():
                if not upcoming.cancelled():
                    upcoming.exception()  # retrieved: the error that ends the stream is another one
            else:
                upcoming.cancel()  # the engine's generator sees the cancel, as in `async for`


async def _next_delta(source: Any) -> Delta | None:
    """The engine's next delta, None at its end."""
    try:
        return await source.__anext__()
    except StopAsyncIteration:
        return None


@dataclasses.dataclass(slots=True)
class _Held:
    """One event waiting for a client that is behind: a delta (merged from several consecutive text
    deltas of one choice) with the tool-call pieces it completed, and the token count of every engine
    delta it stands for (metered one by one once it was handed over)."""

    delta: Delta
    calls: tuple[ToolCallPiece, ...]
    tokens: list[int]


class _Batcher:
    """A stream's delta events, and whether they go out one per delta or merged.

    While nothing is held and the channel is not :func:`backlogged`, :meth:`put` sends each delta's
    event at once and then meters its tokens: byte for byte what the stream sent before batching
    existed. Once the channel is backlogged (the previous piece has not left), deltas are held:
    consecutive text deltas of one choice merge into one (:func:`merge_deltas`); a delta carrying
    tool-call pieces is never merged and ends the merging of the text held before it, which goes out
    first as its own event. :meth:`flush` sends what is held, in order, as one write (one event per
    held item), then meters every delta it stands for, per delta.
    """

    __slots__ = ("channel", "wire", "frame", "meter", "held", "chars", "deltas", "_open")

    def __init__(self, channel: Channel, wire: WireApi, frame: StreamFrame,
                 meter: Callable[[int], Any] | None) -> None:
        self.channel = channel
        self.wire = wire
        self.frame = frame
        self.meter = meter
        self.held: list[_Held] = []
        self.chars = 0  # text held, in characters
        self.deltas = 0  # deltas held
        self._open: dict[int, _Held] = {}  # choice index -> its held item that later text merges into

    async def put(self, sent: tuple[Delta, tuple[ToolCallPiece, ...]] | None, tokens: int) -> None:
        """One engine delta: ``sent`` what :meth:`Assembler.add` made of it, ``tokens`` its token count."""
        if not self.held and (sent is None or not backlogged(self.channel)):
            if sent is not None:
                piece = self.wire.stream_delta(self.frame, *sent)
                if piece:
                    await self.channel.send(piece)
            if self.meter is not None and tokens:
                self.meter(tokens)
            return
        self._hold(sent, tokens)
        self.deltas += 1
        if self.chars >= _HOLD_CHARS or self.deltas >= _HOLD_DELTAS or not backlogged(self.channel):
            await self.flush()

    def _hold(self, sent: tuple[Delta, tuple[ToolCallPiece, ...]] | None, tokens: int) -> None:
        if sent is None:  # adds nothing to send: metered after what is held before it
            if tokens:
                self.held[-1].tokens.append(tokens)
            return
        delta, calls = sent
        self.chars += len(delta.text)
        if not calls:
            item = self._open.get(delta.index)
            if item is not None:
                item.delta = merge_deltas(item.delta, delta)
                if tokens:
                    item.tokens.append(tokens)
                return
        item = _Held(delta, calls, [tokens] if tokens else [])
        self.held.append(item)
        if calls:
            self._open.clear()  # text after a call's pieces is a new event
        else:
            self._open[delta.index] = item

    async def flush(self) -> None:
        """Send what is held (nothing: nothing happens), then meter it."""
        if not self.held:
            return
        held, self.held, self.chars, self.deltas = self.held, [], 0, 0
        self._open.clear()
        wire, frame = self.wire, self.frame
        data = b"".join([wire.stream_delta(frame, item.delta, item.calls) for item in held])
        if data:
            await self.channel.send(data)
        if self.meter is not None:
            for item in held:
                for tokens in item.tokens:
                    self.meter(tokens)


def _stopped(code: ErrorCode, reason: str) -> RequestRefused:
    return RequestRefused(code, f"stream stopped by the scheduler: {reason}", reason=reason,
                          retry_after_s=1.0 if ERRORS[code].retryable else None)
