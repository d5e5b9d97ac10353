"""Node choice and per-node circuit breakers (pure apart from the clock).

:class:`Router` answers "where does this attempt go?":

1. the alternatives a refusing node suggested, if any is usable and is a node of the map
   or the configured fallback (matched by host and port; the map's own URL is used, so a
   suggestion can neither send the tenant's key to a stranger nor downgrade https);
2. otherwise the session's node on the consistent-hash ring of nodes that are fresh
   (heartbeat younger than ``stale_after_s``), admitting and serving the request's model
   (a node whose map entry lists its models must list that one; see :meth:`Node.serves`);
3. if that node's circuit is open: the configured fallback endpoint, or without one the
   ring's next node;
4. nodes this request already failed on are tried last (so a lone node is still retried
   after its ``retry-after``).

When no node serves the model and there is no fallback, step 2 uses every fresh, admitting node:
in a cluster it refuses the model retryably and records the demand that scales a fleet from zero
(docs/fleet.md); :class:`NoNodeAvailable` means no node is fresh and admitting at all.

Step 2's order depends on ``policy``: ``"prefix"`` (default) orders the nodes for the prompt's
block hashes by :func:`~zerolayer.client.prefixroute.choose_by_prefix` (longest cached prefix within
a load bound; see docs/routing.md) and falls back to the session's ring for a prompt shorter than
one block; ``"session"`` always uses the session's ring; ``"round_robin"`` rotates through the
nodes (what a Kubernetes Service gives, for comparison). Load is this client's requests in flight
per node (see :meth:`Router._order` for why not the gossiped load).

:class:`CircuitBreaker`: ``threshold`` consecutive failures (INTERNAL_ERROR or a lost
connection) open it; after ``reset_after_s`` one probe is let through (half-open); the
probe's success closes it, its failure opens it again. Refusals (pressure, quota) neither
count nor reset: they say the node is healthy but busy.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
import urllib.parse
from typing import Callable, Sequence

from . import errors
from .events import CircuitClosed, CircuitHalfOpen, FallbackTriggered, Listener, emit
from .nodes import HashRing, Node, NodeMap, normalise_endpoint
from .prefixroute import DEFAULT_LOAD_FACTOR, Candidate, SentPrefixes, choose_by_prefix

POLICIES = ("prefix", "session", "round_robin")
IN_FLIGHT_TTL_S = 300.0


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Consecutive-failure breaker for one endpoint. Thread-safe."""

    def __init__(self, endpoint: str, *, threshold: int = 5, reset_after_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self.threshold = threshold
        self.reset_after_s = reset_after_s
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self._probe_in_flight = False
        self._lock = threading.Lock()

    def available(self, now: float) -> bool:
        """Would :meth:`acquire` succeed now? (No state change.)"""
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return True
            if self.state is BreakerState.OPEN:
                return now - self.opened_at >= self.reset_after_s
            return not self._probe_in_flight

    def acquire(self, now: float) -> tuple[bool, bool]:
        """Take permission to send one attempt: ``(allowed, became_half_open)``."""
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return True, False
            if self.state is BreakerState.OPEN and now - self.opened_at >= self.reset_after_s:
                self.state = BreakerState.HALF_OPEN
                self._probe_in_flight = True
                return True, True
            if self.state is BreakerState.HALF_OPEN and not self._probe_in_flight:
                self._probe_in_flight = True
                return True, False
            return False, False

    def success(self) -> bool:
        """Record a success; True if this closed an open circuit."""
        with self._lock:
            was_open = self.state is not BreakerState.CLOSED
            self.state = BreakerState.CLOSED
            self.failures = 0
            self._probe_in_flight = False
            return was_open

    def failure(self, now: float) -> bool:
        """Record a failure; True if this opened the circuit from closed."""
        with self._lock:
            self._probe_in_flight = False
            if self.state is BreakerState.HALF_OPEN:
                self.state = BreakerState.OPEN
                self.opened_at = now
                return False
            self.failures += 1
            if self.state is BreakerState.CLOSED and self.failures >= self.threshold:
                self.state = BreakerState.OPEN
                self.opened_at = now
                return True
            return False

    def neutral(self) -> None:
        """An attempt ended in a way that says nothing about health (refusal, bad request)."""
        with self._lock:
            if self.state is BreakerState.HALF_OPEN:
                self._probe_in_flight = False


@dataclasses.dataclass(frozen=True)
class Target:
    endpoint: str
    node: str | None  # the map's node name; None for the fallback or an alternative
    via: str  # "ring" | "alternative" | "fallback"


def counts_against_node(error: errors.APIError) -> bool:
    """Errors that say the node (not the request or the load) is unwell."""
    return isinstance(error, errors.InternalError) or (
        isinstance(error, errors.APIConnectionError) and not isinstance(error, errors.APITimeoutError)
    )


def _host_port(url: str) -> tuple[str, int | None]:
    """``(host, port)`` of a base URL, the port defaulted from the scheme (``http://a`` = ``a:80``)."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        return (parts.netloc.lower(), None)
    if port is None:
        port = {"http": 80, "https": 443}.get(parts.scheme)
    return ((parts.hostname or "").lower(), port)


class Router:
    """Chooses an endpoint per attempt and keeps one circuit breaker per endpoint."""

    def __init__(
        self,
        node_map: NodeMap,
        *,
        fallback: str | None = None,
        stale_after_s: float = 15.0,
        breaker_threshold: int = 5,
        breaker_reset_s: float = 10.0,
        listener: Listener | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        policy: str = "prefix",
        load_factor: float = DEFAULT_LOAD_FACTOR,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.node_map = node_map
        self.policy = policy
        self.load_factor = load_factor
        self.sent = SentPrefixes()
        self._in_flight: dict[str, list[float]] = {}  # endpoint -> when each attempt in flight was sent
        self._turn = 0
        self.fallback = normalise_endpoint(fallback) if fallback else None
        self.stale_after_s = stale_after_s
        self.breaker_threshold = breaker_threshold
        self.breaker_reset_s = breaker_reset_s
        self.listener = listener
        self._clock = clock
        self._wall = wall_clock
        self._breakers: dict[str, CircuitBreaker] = {}
        self._ring_key: tuple[str, ...] = ()
        self._ring = HashRing(())
        self._lock = threading.Lock()

    def breaker(self, endpoint: str) -> CircuitBreaker:
        with self._lock:
            found = self._breakers.get(endpoint)
            if found is None:
                found = self._breakers[endpoint] = CircuitBreaker(
                    endpoint, threshold=self.breaker_threshold, reset_after_s=self.breaker_reset_s
                )
            return found

    def eligible(self, model: str | None = None) -> list[Node]:
        """Nodes that are fresh, admitting and serve ``model`` (None: any), as the map says now."""
        now = self._wall()
        return [n for n in self.node_map.nodes()
                if n.admitting and n.fresh(now, self.stale_after_s) and n.serves(model)]

    def _ring_for(self, nodes: Sequence[Node]) -> HashRing:
        key = tuple(sorted(n.name for n in nodes))
        with self._lock:
            if key != self._ring_key:
                self._ring, self._ring_key = HashRing(key), key
            return self._ring

    def _take(self, endpoint: str) -> bool:
        allowed, half_open = self.breaker(endpoint).acquire(self._clock())
        if half_open:
            emit(self.listener, CircuitHalfOpen(endpoint))
        return allowed

    def trusted(self, suggested: str) -> str | None:
        """The endpoint to use for an alternative a server suggested, or None to ignore it.

        Only nodes of the current node map and the configured fallback are trusted (anyone who
        can alter a response could otherwise collect API keys), matched by host and port, and the
        endpoint used is the map's own, so an ``http://`` or bare ``host:port`` suggestion never
        downgrades an ``https`` node to cleartext.
        """
        wanted = _host_port(normalise_endpoint(suggested))
        known = [n.endpoint for n in self.node_map.nodes()] + ([self.fallback] if self.fallback else [])
        for endpoint in known:
            if _host_port(endpoint) == wanted:
                return endpoint
        return None

    def in_flight(self, endpoint: str) -> int:
        """Attempts this client sent to ``endpoint`` whose outcome is not recorded yet.

        One older than :data:`IN_FLIGHT_TTL_S` no longer counts: a caller that abandons a stream
        without its outcome being recorded must not weigh on the node's load for ever.
        """
        horizon = self._clock() - IN_FLIGHT_TTL_S
        with self._lock:
            sent = self._in_flight.get(endpoint)
            if not sent:
                return 0
            while sent and sent[0] < horizon:
                sent.pop(0)
            return len(sent)

    def _order(self, nodes: Sequence[Node], session: str, prefix: Sequence[int]) -> list[Node]:
        """Step 2's order of the eligible ``nodes`` under the router's policy."""
        by_name = {n.name: n for n in nodes}
        if self.policy == "round_robin" and nodes:
            ordered = sorted(by_name)
            with self._lock:
                self._turn += 1
                start = self._turn % len(ordered)
            return [by_name[name] for name in ordered[start:] + ordered[:start]]
        ring = self._ring_for(nodes)
        if self.policy == "prefix" and prefix and nodes:
            # Load is this client's own requests in flight: the gossiped running + waiting is a
            # heartbeat old (10 s by default; load changes alone are not published) and an idle vLLM
            # stops reporting steps, so a node could look busy for good and never be chosen.
            candidates = [Candidate(n.name, self.in_flight(n.endpoint), n.prefix_digest) for n in nodes]
            with self._lock:
                chosen = choose_by_prefix(candidates, prefix, self.sent, now=self._clock(),
                                          load_factor=self.load_factor, ring=ring)
            return [by_name[name] for name in chosen.order]
        return [by_name[name] for name in ring.walk(session)]

    def _sent_to(self, target: Target, prefix: Sequence[int]) -> Target:
        """Count the attempt as in flight and remember which prefix blocks went where."""
        with self._lock:
            self._in_flight.setdefault(target.endpoint, []).append(self._clock())
            if prefix and target.node is not None:
                self.sent.add(target.node, prefix, self._clock())
        return target

    def choose(self, session: str, *, failed: Sequence[str] = (), prefer: Sequence[str] = (),
               model: str | None = None, prefix: Sequence[int] = ()) -> Target:
        """The endpoint for the next attempt of a request in ``session`` for ``model``.

        ``failed``: endpoints this request already failed on; ``prefer``: alternatives
        suggested by the last refusal; ``prefix``: the prompt's block hashes
        (:func:`zerolayer.prefix.chat_block_hashes`). Every returned target counts as in flight
        until :meth:`record` sees its outcome. Raises :class:`NoNodeAvailable` if nothing is usable.
        """
        now = self._clock()
        tried = set(failed)
        elsewhere = {n.endpoint for n in self.node_map.nodes() if not n.serves(model)}
        for suggested in prefer:
            endpoint = self.trusted(suggested)
            if endpoint is None or endpoint in elsewhere:
                continue  # not a node we know (never send the tenant's key there), or not serving the model
            if endpoint not in tried and self.breaker(endpoint).available(now) and self._take(endpoint):
                return self._sent_to(Target(endpoint, None, "alternative"), prefix)

        nodes = {n.name: n for n in self.eligible(model)}
        if not nodes and model is not None and self.fallback is None:
            # No node serves the model yet (a fleet at zero): any fresh, admitting node refuses it
            # retryably (MODEL_UNAVAILABLE, retry-after) and records the demand that scales it up.
            nodes = {n.name: n for n in self.eligible(None)}
        order = self._order(list(nodes.values()), session, prefix)
        fallback = self.fallback if self.fallback not in tried else None  # None: no fallback, or tried
        for node in order:
            if node.endpoint in tried:
                continue
            if self.breaker(node.endpoint).available(now):
                if self._take(node.endpoint):
                    return self._sent_to(Target(node.endpoint, node.name, "ring"), prefix)
            elif fallback is not None and self.breaker(fallback).available(now) and self._take(fallback):
                return self._sent_to(Target(fallback, None, "fallback"), prefix)
        if fallback is not None and self.breaker(fallback).available(now) and self._take(fallback):
            return self._sent_to(Target(fallback, None, "fallback"), prefix)
        # Last resort: an endpoint this request already failed on (it may only have been busy).
        names = {n.endpoint: n.name for n in order}
        for endpoint in [*names, *([self.fallback] if self.fallback else [])]:
            if endpoint in tried and self.breaker(endpoint).available(now) and self._take(endpoint):
                return self._sent_to(Target(endpoint, names.get(endpoint), "ring" if endpoint in names else "fallback"),
                                     prefix)
        with self._lock:
            opened = sorted(e for e, b in self._breakers.items() if b.state is not BreakerState.CLOSED)
        raise errors.NoNodeAvailable(
            f"no node admits work: {len(self.node_map.nodes())} in the map, {len(nodes)} fresh and admitting "
            f"serving {model or 'any model'}, "
            f"circuits open: {opened or 'none'}, failed for this request: {sorted(tried) or 'none'}, "
            f"fallback: {self.fallback or 'none'}"
        )

    def record(self, target: Target, error: errors.APIError | None) -> None:
        """Feed an attempt's outcome to the endpoint's breaker (``None`` = success); it is no longer in flight."""
        with self._lock:
            sent = self._in_flight.get(target.endpoint)
            if sent:
                sent.pop(0)
        breaker = self.breaker(target.endpoint)
        if error is None:
            if breaker.success():
                emit(self.listener, CircuitClosed(target.endpoint))
        elif counts_against_node(error):
            if breaker.failure(self._clock()):
                fallback = self.fallback if self.fallback != target.endpoint else None
                emit(self.listener, FallbackTriggered(target.endpoint, fallback, breaker.failures))
        else:
            breaker.neutral()
