"""Which of a node's connections carries the next request: the node's lanes. Pure: no I/O.

A node may serve its port with several API processes (``status.apiProcesses``, docs/api-processes.md),
and each connection is served by one of them for its whole life, so an HTTP/2 client that keeps one
connection per endpoint reaches one process only, whatever their number. The client therefore keeps
K connections ("lanes") to such a node and sends each request on the lane with the fewest of its
requests in flight, ties going round (:class:`Lanes`). K is the client's ``connections_per_node`` when
given, else the node's published ``api_processes``, else 1 (:class:`LaneWidth`); an endpoint that is
no node of the map (the fallback) has one lane. transport.py opens one connection per lane.

Lanes are keyed by origin (scheme, host, port), as connections are.
"""

from __future__ import annotations

import threading
import urllib.parse
from typing import Callable, NamedTuple, Sequence

from .nodes import Node, NodeMap

OPTION = "connections_per_node"


def check_connections_per_node(value: object) -> int | None:
    """``value`` if it is ``None`` or an integer >= 1; a ValueError naming the option otherwise."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value  # type: ignore[return-value]
    raise ValueError(f"{OPTION} must be an integer >= 1 (or None: each node's published apiProcesses), "
                     f"got {value!r}")


def origin(url: str) -> str:
    """``scheme://host:port`` of a URL, the port defaulted from the scheme: what one connection serves."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        port = {"http": 80, "https": 443}.get(parts.scheme)
    return f"{parts.scheme}://{(parts.hostname or '').lower()}:{port}"


class LaneWidth:
    """How many lanes a URL's origin gets, as the node map says now (``width(url)``).

    ``connections_per_node`` (validated by :func:`check_connections_per_node`) overrides every node's
    published ``api_processes``. The origins' widths are recomputed only when the map's snapshot changes.
    """

    def __init__(self, node_map: NodeMap, connections_per_node: int | None = None) -> None:
        self.node_map = node_map
        self.connections_per_node = check_connections_per_node(connections_per_node)
        self._seen: tuple[Sequence[Node] | None, dict[str, int]] = (None, {})

    def of_node(self, node: Node) -> int:
        return self.connections_per_node or node.api_processes or 1

    def __call__(self, url: str) -> int:
        nodes = self.node_map.nodes()
        seen, widths = self._seen
        if nodes is not seen:
            widths = {}
            for node in nodes:
                key = origin(node.endpoint)
                widths[key] = max(widths.get(key, 1), self.of_node(node))
            self._seen = (nodes, widths)  # one assignment: threads read a consistent pair
        return widths.get(origin(url), 1)


class Lane(NamedTuple):
    origin: str
    number: int  # 0 .. width - 1


class Lanes:
    """Requests in flight on each lane of each origin; :meth:`take` picks the lane, :meth:`done` frees it.

    The lane with the fewest requests in flight among the origin's ``width(url)`` lanes; among equals
    the first at or after the one after the last pick (round-robin), so sequential requests still use
    every lane. Thread-safe. A width that shrinks leaves the lanes above it unused, not miscounted.
    """

    def __init__(self, width: Callable[[str], int] = lambda url: 1) -> None:
        self.width = width
        self._flight: dict[str, list[int]] = {}
        self._next: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, url: str) -> Lane:
        key, width = origin(url), max(1, self.width(url))
        with self._lock:
            flight = self._flight.setdefault(key, [])
            if len(flight) < width:
                flight.extend([0] * (width - len(flight)))
            fewest = min(flight[:width])
            start = self._next.get(key, 0)
            index = next(i for i in ((start + step) % width for step in range(width)) if flight[i] == fewest)
            flight[index] += 1
            self._next[key] = (index + 1) % width
        return Lane(key, index)

    def done(self, lane: Lane) -> None:
        with self._lock:
            self._flight[lane.origin][lane.number] -= 1

    def in_flight(self, url: str) -> list[int]:
        """Requests in flight on each lane of ``url``'s origin (for tests and inspection)."""
        with self._lock:
            return list(self._flight.get(origin(url), ()))
