"""Prefix-aware node choice: send a prompt where its longest prefix is most likely cached, within a load bound.

Pure (the caller passes the time). The prompt arrives as chained block hashes
(:func:`zerolayer.prefix.chat_block_hashes`). Per candidate node, the *matched* prefix is the
number of leading blocks the node is believed to hold:

- **precise**: the node gossips a :class:`~zerolayer.prefix.PrefixDigest` (``status.prefixCache``)
  built from what it served; the match is the digest's, or this client's own sends to the node in
  the last ``recent_s`` if longer (the digest is up to a publication interval old);
- **approximate**: without a digest, this client's own record of which blocks it sent where
  (:class:`SentPrefixes`, an LRU per node), which a node that restarted or dropped its cache makes
  wrong until the ring moves the prefix elsewhere.

The choice is consistent hashing with bounded loads (Mirrokni et al.; KubeAI's CHWBL): a node
is *over* when its load + 1 exceeds ``ceil(load_factor * (total load + 1) / nodes)``, or
``min_bound`` if that is larger (see :data:`DEFAULT_MIN_BOUND`). Among the
nodes not over, the longest match wins (ring order breaks ties). With no match anywhere (a new
prefix, or prompts that share nothing), CHWBL proper: the first node in ring order from the owner
of the prompt's first block that is within CHWBL's own bound (no floor). The ring is the only way
independent clients agree where a new prefix lives. Two alternatives were measured and dropped
(docs/routing.md): each client's least loaded node put every prefix group on every node (48 % hits
without digests); the least loaded then emptiest digest sent every client's new groups to the same
node for a digest interval (all digests are equally stale), leaving one of three nodes idle.

Over nodes come last. (With ``load_factor >= 1`` the least loaded node is always under the bound.) A prompt shorter than one block has no prefix: the
caller falls back to session affinity.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Iterable, Mapping, Sequence

from zerolayer.gpumap import HashRing
from zerolayer.prefix import PrefixDigest

DEFAULT_LOAD_FACTOR = 1.25  # KubeAI's meanLoadFactor default (125 %)
# A node with fewer requests than this in flight is never over the bound. CHWBL's bound alone is 1
# on a quiet fleet (ceil(1.25 * 1 / 3)), so a second request for a cached prefix would go to a cold
# node and pay a whole prefill to avoid a short wait behind one request that an engine batches anyway.
DEFAULT_MIN_BOUND = 4
DEFAULT_RECENT_S = 5.0  # own sends trusted on top of a digest: ~2 digest publication intervals
SENT_BLOCKS_PER_NODE = 4096


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A node as prefix choice sees it: its name, load (requests in flight) and digest, if published."""

    name: str
    load: int = 0
    digest: PrefixDigest | None = None


@dataclasses.dataclass(frozen=True)
class PrefixChoice:
    """The nodes in the order to try them, and why the first was chosen."""

    order: tuple[str, ...]
    matched_blocks: int  # of the first node
    # "longest-prefix" | "ring-owner" | "ring-next" | "least-loaded" | "all-over-bound" (unreachable: load_factor >= 1)
    reason: str


class SentPrefixes:
    """This client's record of the blocks it sent to each node (most recent ``per_node`` kept), with when."""

    def __init__(self, per_node: int = SENT_BLOCKS_PER_NODE) -> None:
        self.per_node = per_node
        self._sent: dict[str, collections.OrderedDict[int, float]] = {}

    def add(self, node: str, blocks: Sequence[int], now: float) -> None:
        record = self._sent.setdefault(node, collections.OrderedDict())
        for block in blocks:
            record[block] = now
            record.move_to_end(block)
        while len(record) > self.per_node:
            record.popitem(last=False)

    def matched(self, node: str, blocks: Sequence[int], since: float = -math.inf) -> int:
        record: Mapping[int, float] = self._sent.get(node, {})
        count = 0
        for block in blocks:
            when = record.get(block)
            if when is None or when < since:
                break
            count += 1
        return count

    def forget(self, node: str) -> None:
        self._sent.pop(node, None)


def load_bound(loads: Iterable[int], load_factor: float, min_bound: int = 1) -> int:
    """The most requests a node may hold counting the new one: ``max(ceil(c * (L + 1) / n), min_bound)``."""
    loads = list(loads)
    return max(1, min_bound, math.ceil(load_factor * (sum(loads) + 1) / max(1, len(loads))))


def choose_by_prefix(candidates: Sequence[Candidate], blocks: Sequence[int], sent: SentPrefixes, *, now: float,
                     load_factor: float = DEFAULT_LOAD_FACTOR, min_bound: int = DEFAULT_MIN_BOUND,
                     recent_s: float = DEFAULT_RECENT_S, ring: HashRing | None = None) -> PrefixChoice:
    """Order ``candidates`` for a prompt whose block hashes are ``blocks`` (non-empty)."""
    if not blocks:
        raise ValueError("a prompt without a full block has no prefix: route it by session")
    by_name = {c.name: c for c in candidates}
    ring = ring or HashRing(by_name)
    walk = [name for name in ring.walk(format(blocks[0], "016x")) if name in by_name]
    bound = load_bound((c.load for c in candidates), load_factor, min_bound)
    under = [n for n in walk if by_name[n].load + 1 <= bound]
    over = [n for n in walk if n not in under]

    def matched(name: str) -> int:
        node = by_name[name]
        if node.digest is None:
            return sent.matched(name, blocks)
        return max(node.digest.matched(blocks), sent.matched(name, blocks, since=now - recent_s))

    if not under:
        return PrefixChoice(tuple(walk), matched(walk[0]) if walk else 0, "all-over-bound")
    scores: Mapping[str, int] = {n: matched(n) for n in under}
    best = max(under, key=lambda n: scores[n])  # max() keeps the first of equals: ring order breaks ties
    reason = "longest-prefix"
    if scores[best] == 0:
        # A new prefix: CHWBL proper (its own bound, no floor) from the ring owner of the first block.
        # The ring is what makes independent clients agree where it lives, digests or not: placing by
        # the (equally stale) digests sent every client's new prefixes to the same node.
        strict = load_bound((c.load for c in candidates), load_factor)
        best = next((n for n in under if by_name[n].load + 1 <= strict), under[0])
        reason = "ring-owner" if best == walk[0] else "ring-next"
    rest = [n for n in under if n != best]
    return PrefixChoice((best, *rest, *over), scores[best], reason)
