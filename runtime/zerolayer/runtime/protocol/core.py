"""What both sans-IO server cores are built from and hold: the gate, the limits, the clock, the body
budget, and the connection's outbound bytes and life flags. No I/O (``clock`` is injected).

:class:`~zerolayer.runtime.protocol.h1conn.H1ServerCore` and
:class:`~zerolayer.runtime.protocol.h2conn.H2ServerCore` take the same constructor (the transport
builds either from one :class:`~zerolayer.runtime.serving.transport.ConnectionContext`) and add their
protocol's own state in :meth:`ServerCore._open`.
"""

from __future__ import annotations

import abc
import time
from typing import Callable

from zerolayer.runtime.limits import BodyBudget, Limits
from zerolayer.runtime.protocol.events import Gate


class ServerCore(abc.ABC):
    """``gate(head)`` is called once per request when its head is complete and must not block.
    ``on_limit(name)`` is called each time a hardening limit trips."""

    http_version = ""

    def __init__(
        self,
        gate: Gate,
        limits: Limits | None = None,
        *,
        on_limit: Callable[[str], None] = lambda name: None,
        clock: Callable[[], float] = time.monotonic,
        budget: BodyBudget | None = None,
    ) -> None:
        self.gate = gate
        self.limits = limits or Limits()
        self.on_limit = on_limit
        self.clock = clock
        self.budget = budget or BodyBudget.from_limits(self.limits)
        self._out = bytearray()
        self.draining = False
        self.ended = False
        self.discarded_body_bytes = 0  # body bytes received for refused requests (never stored)
        now = clock()
        self.last_activity = now
        self._open(now)

    @property
    def pending_bytes(self) -> int:
        """Bytes produced for the peer and not yet taken by :meth:`data_to_send`."""
        return len(self._out)

    @abc.abstractmethod
    def _open(self, now: float) -> None:
        """The protocol's own connection state, set up once by the constructor."""
