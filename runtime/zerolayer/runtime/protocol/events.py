"""What the sans-IO connection cores emit and what they ask of the application.

Both cores (HTTP/2 in :mod:`.h2conn`, HTTP/1.1 in :mod:`.h1conn`) turn bytes into
these events and call one *gate* per request the moment its header block is
complete — before a single body byte is buffered. The gate returns :class:`Accept`
(buffer up to ``max_body`` bytes, then emit :class:`RequestReady`) or
:class:`Reject` (answer now, discard the body as it arrives).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence, Union


@dataclasses.dataclass(slots=True)  # slotted, not frozen: built per request (see engine.base.Delta)
class RequestHead:
    stream_id: int
    method: str
    path: str
    headers: Mapping[str, str]  # lower-case names; repeated names joined with ", "
    authority: str
    end_stream: bool  # no body follows
    http_version: str = "2"


@dataclasses.dataclass(slots=True)  # slotted, not frozen: built per request (see engine.base.Delta)
class Accept:
    max_body: int
    context: Any = None  # opaque to the core, handed back in RequestReady
    owner: str | None = None  # whose body budget the buffered bytes count against (the tenant)


@dataclasses.dataclass(frozen=True)
class Reject:
    status: int
    headers: Sequence[tuple[str, str]]
    body: bytes


Verdict = Union[Accept, Reject]
Gate = Callable[[RequestHead], Verdict]


@dataclasses.dataclass(slots=True)  # slotted, not frozen: built per request (see engine.base.Delta)
class RequestReady:
    """An accepted request whose body is complete."""

    head: RequestHead
    body: bytes
    context: Any


@dataclasses.dataclass(frozen=True)
class StreamAborted:
    """The peer reset the stream (or the body broke a limit): stop work for it."""

    stream_id: int
    error_code: int


@dataclasses.dataclass(frozen=True)
class ConnectionEnded:
    """The connection is over (GOAWAY sent or received, protocol error, limit)."""

    error_code: int
    reason: str


Event = Union[RequestReady, StreamAborted, ConnectionEnded]


def stream_key(conn_id: int, stream_id: int) -> str:
    """The one name of a request across the runtime: ``"{connection}/{stream}"``.

    The transport, the admission gate, the session table and the scheduler's ``Ticket.stream_key``
    all use this; build it nowhere else.
    """
    return f"{conn_id}/{stream_id}"
