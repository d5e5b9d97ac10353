"""One response as the transport offers it, and the two ways the runtime answers on it whole.

The transport's ``_Channel`` implements :class:`Channel` over either protocol core; tests use
recording doubles. :func:`respond` and :func:`send_error` count every answer in
``zerolayer_requests_total`` by route and status.
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
