"""The one module that knows httpx and h2: connection pools and error conversion.

HTTP/2 everywhere: plain ``http://`` endpoints use prior knowledge (h2c, as the runtime
speaks it), ``https://`` negotiates h2 by ALPN. One connection per endpoint carries many
concurrent streams, or one per lane for a node served by several API processes (:mod:`.lanes`:
lane *i* of every endpoint is the *i*-th httpx pool of :class:`LanedPool`); idle connections are
kept 45 s (the runtime PINGs every 30 s).
An endpoint listed in ``http1_endpoints`` (for instance the HTTP/1.1 gateway a team
migrates from, used as the fallback) gets a pool that speaks HTTP/1.1 or ALPN h2.

:func:`convert_error` turns httpx/httpcore/h2 failures into the SDK's errors. httpcore
surfaces an RST_STREAM as ``RemoteProtocolError(<h2 StreamReset event>)`` and a GOAWAY as
``RemoteProtocolError(<h2 ConnectionTerminated event>)``; httpx re-raises them ``from``
the httpcore exception, so the h2 event is found on the cause chain.

A draining connection (a runtime stopping, or a connection past its ``server.max_connection_age_s``)
finishes its streams and answers new ones RST_STREAM(REFUSED_STREAM) until its last stream ends, and
only then sends GOAWAY (httpcore would fail the open streams on an earlier one). httpcore keeps
choosing such a connection, so a lane whose request is refused that way gets a new pool: the retry
and every later request open a fresh connection, while the old pool's requests finish; it is closed
when its last one ends (:meth:`LanedPool._failed`).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from typing import Any, AsyncIterator, Callable, Generic, Iterable, Iterator, TypeVar

import h2.events
import h2.exceptions
import httpx

from zerolayer.contract import H2_REFUSED_STREAM
from zerolayer.version import __version__

from . import errors, wire
from .lanes import Lanes

KEEPALIVE_S = 45.0
USER_AGENT = f"zerolayer-client/{__version__}"


def _limits() -> httpx.Limits:
    return httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_S)


def sync_pool(timeout: httpx.Timeout, http1_endpoints: Iterable[str] = (),
              width: Callable[[str], int] = lambda url: 1) -> PerThreadPool:
    """The sync client's pool: per thread, ``width(url)`` connections to each endpoint (:mod:`.lanes`)."""
    endpoints = tuple(http1_endpoints)
    return PerThreadPool(lambda: SyncLanedPool(lambda: _sync_client(timeout, endpoints), Lanes(width)))


def _sync_client(timeout: httpx.Timeout, http1_endpoints: Iterable[str]) -> httpx.Client:
    mounts: dict[str, httpx.BaseTransport | None] = {
        f"all://{_authority(url)}": httpx.HTTPTransport(http1=True, http2=True, limits=_limits()) for url in http1_endpoints
    }
    return httpx.Client(
        http1=False, http2=True, limits=_limits(), timeout=timeout, mounts=mounts or None, trust_env=False,
        headers={"user-agent": USER_AGENT},
    )


_Pool = TypeVar("_Pool")


class LanedPool(Generic[_Pool]):
    """httpx pools by lane: a request goes to the pool of the lane :class:`~.lanes.Lanes` picks for its URL.

    Each pool keeps one connection per endpoint, so an endpoint of K lanes gets K connections. Pools
    are made on first use: with one lane everywhere there is exactly one, as without lanes.
    """

    def __init__(self, make: Callable[[], _Pool], lanes: Lanes) -> None:
        self._make = make
        self.lanes = lanes
        self.pools: list[_Pool] = []
        self.closed = False
        self._in_flight: collections.Counter[int] = collections.Counter()  # requests per pool (by id)
        self._retired: dict[int, _Pool] = {}  # pools replaced after a refusal, closed when idle

    def _pool(self, index: int) -> _Pool:
        if self.closed:
            raise RuntimeError("the client is closed")
        while len(self.pools) <= index:
            self.pools.append(self._make())
        return self.pools[index]

    def _enter(self, index: int) -> _Pool:
        pool = self._pool(index)
        self._in_flight[id(pool)] += 1
        return pool

    def _failed(self, index: int, pool: _Pool, exc: BaseException) -> None:
        """A stream refused by its connection (RST_STREAM REFUSED_STREAM: it is draining): lane ``index``
        gets a new pool, so the next request opens a new connection; ``pool`` is retired."""
        if refused_stream(exc) and index < len(self.pools) and self.pools[index] is pool:
            self.pools[index] = self._make()
            self._retired[id(pool)] = pool

    def _leave(self, pool: _Pool) -> _Pool | None:
        """One request of ``pool`` is over; the pool itself when it is retired and that was its last."""
        key = id(pool)
        self._in_flight[key] -= 1
        if self._in_flight[key] > 0:
            return None
        del self._in_flight[key]
        return self._retired.pop(key, None)

    def _all_pools(self) -> list[_Pool]:
        pools, self._retired = [*self.pools, *self._retired.values()], {}
        return pools


class SyncLanedPool(LanedPool[httpx.Client]):
    """One thread's lanes (the sync client's pools are per thread, see :class:`PerThreadPool`)."""

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        with self.stream("POST", url, **kwargs) as response:
            response.read()
            return response

    @contextlib.contextmanager
    def stream(self, method: str, url: str, **kwargs: Any) -> Iterator[httpx.Response]:
        lane = self.lanes.take(url)
        pool: httpx.Client | None = None
        try:
            pool = self._enter(lane.number)
            with pool.stream(method, url, **kwargs) as response:
                yield response
        except TRANSPORT_ERRORS as exc:
            if pool is not None:
                self._failed(lane.number, pool, exc)
            raise
        finally:
            self.lanes.done(lane)
            idle = self._leave(pool) if pool is not None else None
            if idle is not None:
                idle.close()

    def close(self) -> None:
        self.closed = True
        for pool in self._all_pools():
            pool.close()


class AsyncLanedPool(LanedPool[httpx.AsyncClient]):
    """The async client's lanes (one event loop: one set of pools)."""

    async def post(self, url: str, **kwargs: Any) -> httpx.Response:
        async with self.stream("POST", url, **kwargs) as response:
            await response.aread()
            return response

    @contextlib.asynccontextmanager
    async def stream(self, method: str, url: str, **kwargs: Any) -> AsyncIterator[httpx.Response]:
        lane = self.lanes.take(url)
        pool: httpx.AsyncClient | None = None
        try:
            pool = self._enter(lane.number)
            async with pool.stream(method, url, **kwargs) as response:
                yield response
        except TRANSPORT_ERRORS as exc:
            if pool is not None:
                self._failed(lane.number, pool, exc)
            raise
        finally:
            self.lanes.done(lane)
            idle = self._leave(pool) if pool is not None else None
            if idle is not None:
                await idle.aclose()

    async def aclose(self) -> None:
        self.closed = True
        for pool in self._all_pools():
            await pool.aclose()


class PerThreadPool:
    """One pool (a :class:`SyncLanedPool`) per thread behind the sync SDK client, which threads may share.

    httpx's sync HTTP/2 connection is not safe to drive from several threads at once: concurrent
    streams on one connection raise ``RuntimeError: deque mutated during iteration`` or hang
    (encode/httpx#3566; reproduced by tests/integration/client/test_client_threads.py). Each thread
    gets its own pool (its own connections), closed when that thread's object is collected or when
    the client is closed, whichever comes first.
    """

    def __init__(self, make: Callable[[], SyncLanedPool]) -> None:
        self._make = make
        self._pools: dict[int, tuple[SyncLanedPool, weakref.finalize]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _pool(self) -> SyncLanedPool:
        thread = threading.current_thread()
        key = id(thread)  # unique while the thread object lives; its finalizer removes the entry
        with self._lock:
            entry = self._pools.get(key)
            if entry is None:
                if self._closed:
                    raise RuntimeError("the client is closed")
                entry = self._pools[key] = (self._make(), weakref.finalize(thread, self._forget, key))
        return entry[0]

    def _forget(self, key: int) -> None:
        with self._lock:
            entry = self._pools.pop(key, None)
        if entry is not None:
            entry[0].close()

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self._pool().post(url, **kwargs)

    def stream(self, method: str, url: str, **kwargs: Any) -> Any:
        return self._pool().stream(method, url, **kwargs)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            entries, self._pools = list(self._pools.values()), {}
        for pool, finalizer in entries:
            finalizer.detach()
            pool.close()


def async_pool(timeout: httpx.Timeout, http1_endpoints: Iterable[str] = (),
               width: Callable[[str], int] = lambda url: 1) -> AsyncLanedPool:
    """The async client's pool: ``width(url)`` connections to each endpoint (:mod:`.lanes`)."""
    endpoints = tuple(http1_endpoints)
    return AsyncLanedPool(lambda: _async_client(timeout, endpoints), Lanes(width))


def _async_client(timeout: httpx.Timeout, http1_endpoints: Iterable[str]) -> httpx.AsyncClient:
    mounts: dict[str, httpx.AsyncBaseTransport | None] = {
        f"all://{_authority(url)}": httpx.AsyncHTTPTransport(http1=True, http2=True, limits=_limits())
        for url in http1_endpoints
    }
    return httpx.AsyncClient(
        http1=False, http2=True, limits=_limits(), timeout=timeout, mounts=mounts or None, trust_env=False,
        headers={"user-agent": USER_AGENT},
    )


def _authority(url: str) -> str:
    return httpx.URL(url).netloc.decode()


def _h2_cause(exc: BaseException) -> object | None:
    """The h2 StreamReset / ConnectionTerminated event or StreamClosedError on ``exc``'s cause chain."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 8:
        if isinstance(current, h2.exceptions.StreamClosedError):
            return current
        for arg in current.args:
            if isinstance(arg, (h2.events.StreamReset, h2.events.ConnectionTerminated, h2.exceptions.StreamClosedError)):
                return arg
        current = current.__cause__ or current.__context__
        seen += 1
    return None


def convert_error(
    exc: Exception, *, endpoint: str, request_id: str | None = None, tokens_delivered: int = 0
) -> errors.APIError:
    """An SDK error for an httpx (or h2) failure on one attempt. Sets ``__cause__``."""
    common = errors.Origin(endpoint=endpoint, request_id=request_id, tokens_delivered=tokens_delivered)
    event = _h2_cause(exc)
    err: errors.APIError
    if isinstance(event, h2.exceptions.StreamClosedError):
        # The server ended the stream while we were still sending the request: it answered
        # (refused) at HEADERS time and reset with NO_ERROR, as RFC 9113 §8.1 allows. httpcore
        # cannot read such an early response, but the server cannot have generated anything
        # without the body, so the work is certainly unprocessed.
        err = errors.StreamRefused(
            "the server closed the stream before the request body was sent (an early refusal)",
            processed=False,
            **common,
        )
    elif isinstance(event, h2.events.StreamReset):
        err = wire.error_from_reset(int(event.error_code), **common)
    elif isinstance(event, h2.events.ConnectionTerminated):
        err = errors.APIConnectionError(
            f"connection closed by GOAWAY (HTTP/2 error code {int(event.error_code or 0):#x}) while the stream was "
            "open",
            processed=None,
            **common,
        )
    elif isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        err = errors.APIConnectionError(f"cannot connect to {endpoint}: {exc}", processed=False, **common)
    elif isinstance(exc, httpx.TimeoutException):
        err = errors.APITimeoutError(f"timed out waiting for {endpoint}: {exc}", processed=None, **common)
    elif isinstance(exc, (httpx.HTTPError, h2.exceptions.H2Error)):
        err = errors.APIConnectionError(f"connection to {endpoint} failed: {exc or type(exc).__name__}", processed=None, **common)
    else:
        raise TypeError(f"not a transport error: {exc!r}") from exc
    err.__cause__ = exc
    return err


TRANSPORT_ERRORS = (httpx.HTTPError, h2.exceptions.H2Error)


def refused_stream(exc: BaseException) -> bool:
    """Whether ``exc`` is an RST_STREAM(REFUSED_STREAM): the connection took no new stream (it drains)."""
    event = _h2_cause(exc)
    return isinstance(event, h2.events.StreamReset) and int(event.error_code) == H2_REFUSED_STREAM
