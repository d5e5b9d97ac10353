"""One response as the transport offers it, and the two ways the runtime answers on it whole.

The transport's ``_Channel`` implements :class:`Channel` over either protocol core; tests use
recording doubles. :func:`respond` and :func:`send_error` count every answer in
``zerolayer_requests_total`` by route and status. :func:`backlogged` says whether a stream's
previous piece is still waiting to leave (a client that fell behind: the session then batches
its stream events, docs/server-core.md).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from zerolayer.runtime.api.wire import WireApi, error_response
from zerolayer.runtime.errors import RequestRefused
from zerolayer.runtime.serving.metrics import RuntimeMetrics


class Channel(Protocol):
    """One response. ``send`` waits while the peer is slow (backpressure); ``reset`` ends the
    stream with an RST_STREAM code (HTTP/1.1: closes the connection)."""

    key: str
    head_sent: bool

    async def send_head(self, status: int, headers: Sequence[tuple[str, str]]) -> None: ...
    async def send(self, data: bytes) -> None: ...
    async def end(self, data: bytes = b"") -> None: ...
    def reset(self, error_code: int) -> None: ...


def backlogged(channel: Channel) -> bool:
    """True while what was already sent on ``channel`` has not left: HTTP/2 flow control holds bytes
    of this stream (the peer's window is spent), or the socket's write buffer is over its high-water
    mark (``pause_writing``; either protocol). Sending more then only queues behind them.

    For the transport's ``_Channel`` this reads its connection's core's ``backlog(sid)`` and the
    connection's pause flag (``_paused``: the transport has no public accessor for it), the two
    things ``Connection.wait_writable`` looks at; that one waits only past the low-water mark, far
    beyond "not left". Any other channel may say so with a ``backlogged()`` method (test doubles);
    one that does neither is never backlogged. Called once per streamed delta: kept cheap.
    """
    conn = getattr(channel, "conn", None)
    if conn is not None:
        core = conn.core
        return core is not None and (conn._paused or core.backlog(channel.sid) > 0)  # type: ignore[attr-defined]
    own = getattr(channel, "backlogged", None)
    return bool(own()) if own is not None else False


async def respond(channel: Channel, metrics: RuntimeMetrics, status: int, headers: Sequence[tuple[str, str]],
                  body: bytes, route: str) -> None:
    """A whole response: head with content-length, then the body."""
    metrics.count_request(route, status)
    await channel.send_head(status, [*headers, ("content-length", str(len(body)))])
    await channel.end(body)


async def send_error(channel: Channel, metrics: RuntimeMetrics, wire: WireApi, refused: RequestRefused,
                     route: str, extra_headers: Sequence[tuple[str, str]] = (), trace_id: str | None = None) -> None:
    """An error before response headers, in ``wire``'s format (docs/protocol.md); ``extra_headers``
    (e.g. ``traceresponse``) go out with it, ``trace_id`` goes into the error object."""
    status, headers, body = error_response(wire, refused, trace_id)
    await respond(channel, metrics, status, [*((k, v) for k, v in headers if k != "content-length"), *extra_headers],
                  body, route)
