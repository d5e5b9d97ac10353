"""``Client`` and ``AsyncClient``: the same API, blocking or on asyncio.

Both keep one HTTP/2 pool (one connection per endpoint, many streams on it; one per API process
of a node that runs several, see :mod:`zerolayer.client.lanes`), send the
header contract on every request, decode errors into the SDK's exceptions, and retry by
the policy in :mod:`zerolayer.client.retry` under a shared retry budget.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Iterator, Mapping, Sequence

import httpx

from . import errors, lanes, transport, wire
from ._core import CONTRACT_OPTIONS, Call, Shared, make_contract, request_body
from .attempt import TOKEN_EVENT, MessageAttempt, StreamAttempt
from .events import Listener
from .nodes import NodeMap
from .retry import RetryBudget, RetryPolicy
from .types import Message, StreamEvent

def _lost(exc: Exception, attempt: MessageAttempt | StreamAttempt) -> errors.APIError:
    """A transport failure as the SDK error the retry policy reads."""
    return transport.convert_error(exc, endpoint=attempt.endpoint, request_id=attempt.request_id,
                                   tokens_delivered=attempt.delivered)


class _Options:
    """Construction shared by both clients (see :class:`Client` for the parameters)."""

    def __init__(
        self,
        api_key: str | None = None,
        base_url: str | None = None,
        *,
        nodes: NodeMap | Sequence[str] | None = None,
        fallback_url: str | None = None,
        fallback_http1: bool = False,
        priority: str | int | None = None,
        session: str | None = None,
        model_hint: str | None = None,
        output_format: str | None = None,
        deadline: float | None = 60.0,
        timeout: float | httpx.Timeout = 600.0,
        max_retries: int = 3,
        model_wait_s: float = 180.0,
        retry_policy: RetryPolicy | None = None,
        retry_budget: RetryBudget | None = None,
        lighter_models: Mapping[str, str] | None = None,
        breaker_threshold: int = 5,
        breaker_reset_s: float = 10.0,
        stale_after_s: float = 15.0,
        on_event: Listener | None = None,
        connections_per_node: int | None = None,
        _shared: Shared | None = None,
        _pool: Any = None,
    ) -> None:
        self._connections_per_node = lanes.check_connections_per_node(connections_per_node)
        self._options: dict[str, Any] = dict(
            api_key=api_key, priority=priority, session=session, model_hint=model_hint,
            output_format=output_format, deadline=deadline,
        )  # fmt: skip
        self.contract = make_contract(**self._options)
        self._owner = _shared is None
        self._shared = _shared or Shared(
            base_url=base_url,
            nodes=nodes,
            fallback_url=fallback_url,
            max_retries=max_retries,
            retry_policy=retry_policy,
            retry_budget=retry_budget,
            lighter_models=lighter_models,
            breaker_threshold=breaker_threshold,
            breaker_reset_s=breaker_reset_s,
            stale_after_s=stale_after_s,
            on_event=on_event,
            model_wait_s=model_wait_s,
        )
        self._timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout, connect=5.0)
        self._http1 = [self._shared.router.fallback] if fallback_http1 and self._shared.router.fallback else []
        self._pool = _pool

    def _lane_width(self) -> lanes.LaneWidth:
        """How many connections the pool keeps to each endpoint (:mod:`zerolayer.client.lanes`)."""
        return lanes.LaneWidth(self._shared.node_map, self._connections_per_node)

    @property
    def router(self):
        """Node choice and circuit breakers (inspect ``router.breaker(endpoint).state``)."""
        return self._shared.router

    @property
    def retry_budget(self) -> RetryBudget:
        return self._shared.budget

    def _derive(self, changes: Mapping[str, Any]):
        unknown = set(changes) - set(CONTRACT_OPTIONS)
        if unknown:
            raise ValueError(f"with_options changes only the header contract ({', '.join(CONTRACT_OPTIONS)}), not {sorted(unknown)}")
        options = {**self._options, **changes}
        return type(self)(**options, _shared=self._shared, _pool=self._pool)


class Client(_Options):
    """Blocking client.

    Parameters (all keyword except the first two):
        api_key: the tenant's key (or ``ZEROLAYER_API_KEY``); sent as ``x-api-key``.
        base_url: one runtime (or ``ZEROLAYER_BASE_URL``); or give ``nodes`` instead.
        nodes: a :class:`NodeMap` or a list of endpoints to choose from per session.
        fallback_url: where a node's sessions go while its circuit is open.
        fallback_http1: the fallback speaks HTTP/1.1 (e.g. the gateway being migrated from).
        priority, session, model_hint, output_format, deadline: the header contract, fixed
            for this client (``deadline`` is a relative budget in seconds per attempt).
            Derive a client with other values with :meth:`with_options`.
        timeout: client-side timeout in seconds (or an ``httpx.Timeout``).
        max_retries, lighter_models: the reference retry policy's knobs; or pass a whole
            ``retry_policy``. retry_budget: share one :class:`RetryBudget` between clients.
        model_wait_s: how long a request waits for a model no node serves yet (a fleet scaling
            from zero): a ``MODEL_UNAVAILABLE`` refusal with ``retry-after`` is asked again after
            it until the request's first attempt is this old (default 180 s; 0: no waiting), without
            spending ``max_retries`` or the retry budget. See ``retry.py``.
        breaker_threshold, breaker_reset_s, stale_after_s: node health (see ``routing.py``).
        on_event: a listener for :mod:`zerolayer.client.events` (fallback, retries, latency).
        connections_per_node: HTTP/2 connections to each node of the map (``None``: the node's published
            ``apiProcesses``, else 1), each request on the one with the fewest in flight, so that requests
            reach every API process of a node that runs several (``zerolayer.client.lanes``). The sync
            client keeps them per thread. The fallback endpoint keeps one.
    """

    def __init__(self, api_key: str | None = None, base_url: str | None = None, **kwargs: Any) -> None:
        super().__init__(api_key, base_url, **kwargs)
        if self._pool is None:
            self._pool = transport.sync_pool(self._timeout, self._http1, self._lane_width())
        self.messages = Messages(self)

    def with_options(self, **changes: Any) -> "Client":
        """A client with a different header contract sharing this one's connections, breakers and budget."""
        return self._derive(changes)

    def close(self) -> None:
        if self._owner:
            self._pool.close()
            self._shared.node_map.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- sending: the attempts (attempt.py) decide, these loops only move bytes and sleep ----------
    def _send(self, call: Call) -> Message:
        while True:
            attempt = MessageAttempt(call)
            try:
                response = self._pool.post(attempt.url, headers=attempt.headers, json=attempt.body)
            except transport.TRANSPORT_ERRORS as exc:
                attempt.failed(_lost(exc, attempt))
            else:
                message = attempt.answered(response.status_code, response.headers, response.content)
                if message is not None:
                    return message
            time.sleep(attempt.retry_delay())

    def _stream(self, call: Call) -> Iterator[StreamEvent]:
        """Events of one logical stream; attempts that fail before the first token are retried."""
        while True:
            attempt = StreamAttempt(call)
            try:
                with self._pool.stream("POST", attempt.url, headers=attempt.headers, json=attempt.body) as response:
                    if attempt.opened(response.status_code, response.headers):
                        attempt.refused(response.status_code, response.headers, response.read())
                    for line in response.iter_lines():
                        yield from attempt.feed(line)
                    rest = attempt.finish()
                yield from rest
                attempt.succeeded()
                return
            except errors.APIError as exc:
                attempt.failed(exc)
            except transport.TRANSPORT_ERRORS as exc:
                attempt.failed(_lost(exc, attempt))
            time.sleep(attempt.retry_delay())


class AsyncClient(_Options):
    """The asyncio twin of :class:`Client` (same parameters); use ``async with``."""

    def __init__(self, api_key: str | None = None, base_url: str | None = None, **kwargs: Any) -> None:
        super().__init__(api_key, base_url, **kwargs)
        if self._pool is None:
            self._pool = transport.async_pool(self._timeout, self._http1, self._lane_width())
        self.messages = AsyncMessages(self)

    def with_options(self, **changes: Any) -> "AsyncClient":
        """A client with a different header contract sharing this one's connections, breakers and budget."""
        return self._derive(changes)

    async def close(self) -> None:
        if self._owner:
            await self._pool.aclose()
            await asyncio.to_thread(self._shared.node_map.close)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _send(self, call: Call) -> Message:
        while True:
            attempt = MessageAttempt(call)
            try:
                response = await self._pool.post(attempt.url, headers=attempt.headers, json=attempt.body)
            except transport.TRANSPORT_ERRORS as exc:
                attempt.failed(_lost(exc, attempt))
            else:
                message = attempt.answered(response.status_code, response.headers, response.content)
                if message is not None:
                    return message
            await asyncio.sleep(attempt.retry_delay())

    async def _stream(self, call: Call) -> AsyncIterator[StreamEvent]:
        while True:
            attempt = StreamAttempt(call)
            try:
                async with self._pool.stream("POST", attempt.url, headers=attempt.headers, json=attempt.body) as response:
                    if attempt.opened(response.status_code, response.headers):
                        attempt.refused(response.status_code, response.headers, await response.aread())
                    async for line in response.aiter_lines():
                        for event in attempt.feed(line):
                            yield event
                    rest = attempt.finish()
                for event in rest:
                    yield event
                attempt.succeeded()
                return
            except errors.APIError as exc:
                attempt.failed(exc)
            except transport.TRANSPORT_ERRORS as exc:
                attempt.failed(_lost(exc, attempt))
            await asyncio.sleep(attempt.retry_delay())


# --------------------------------------------------------------------------- resources
class MessageStream:
    """A streamed message: iterate for events; ``text_stream`` for the text only.

    ``create(stream=True)`` returns once the first token arrived (or raises), so errors
    that happen before any output surface from ``create`` as in the official SDK, and
    are retried there. Close it (or use ``with``) if you stop reading early.
    """

    def __init__(self, events: Iterator[StreamEvent]) -> None:
        self._events = events
        self._head: list[StreamEvent] = []
        try:
            self._head.append(next(events))
        except StopIteration:
            pass

    def __iter__(self) -> Iterator[StreamEvent]:
        while self._head:
            yield self._head.pop(0)
        yield from self._events

    @property
    def text_stream(self) -> Iterator[str]:
        for event in self:
            if event.get("type") == TOKEN_EVENT:
                text = event.delta.get("text")
                if text:
                    yield text

    def close(self) -> None:
        self._events.close()  # type: ignore[attr-defined]

    def __enter__(self) -> "MessageStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncMessageStream:
    """The asyncio twin of :class:`MessageStream`; obtained with ``await create(stream=True)``."""

    def __init__(self, events: AsyncIterator[StreamEvent]) -> None:
        self._events = events
        self._head: list[StreamEvent] = []

    async def _prime(self) -> "AsyncMessageStream":
        try:
            self._head.append(await self._events.__anext__())
        except StopAsyncIteration:
            pass
        return self

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        while self._head:
            yield self._head.pop(0)
        async for event in self._events:
            yield event

    @property
    async def text_stream(self) -> AsyncIterator[str]:
        async for event in self:
            if event.get("type") == TOKEN_EVENT:
                text = event.delta.get("text")
                if text:
                    yield text

    async def close(self) -> None:
        await self._events.aclose()  # type: ignore[attr-defined]

    async def __aenter__(self) -> "AsyncMessageStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Messages:
    """``client.messages``: ``create(model=, max_tokens=, messages=, stream=False, ...)``."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def create(
        self,
        *,
        model: str,
        max_tokens: int,
        messages: Sequence[Mapping[str, Any]],
        stream: bool = False,
        extra_headers: Mapping[str, str] | None = None,
        **params: Any,
    ) -> Message | MessageStream:
        """Send one message request. Contract fields (priority, session, ...) raise ValueError here."""
        wire.check_no_override(params, extra_headers)
        body = request_body(model, max_tokens, messages, params)
        call = Call(self._client._shared, self._client.contract, body, streaming=stream, extra_headers=extra_headers)
        if stream:
            return MessageStream(self._client._stream(call))
        return self._client._send(call)


class AsyncMessages:
    """``client.messages`` of :class:`AsyncClient`."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(
        self,
        *,
        model: str,
        max_tokens: int,
        messages: Sequence[Mapping[str, Any]],
        stream: bool = False,
        extra_headers: Mapping[str, str] | None = None,
        **params: Any,
    ) -> Message | AsyncMessageStream:
        """Send one message request. Contract fields (priority, session, ...) raise ValueError here."""
        wire.check_no_override(params, extra_headers)
        body = request_body(model, max_tokens, messages, params)
        call = Call(self._client._shared, self._client.contract, body, streaming=stream, extra_headers=extra_headers)
        if stream:
            return await AsyncMessageStream(self._client._stream(call))._prime()
        return await self._client._send(call)
