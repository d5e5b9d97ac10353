"""The prefix-cache digest from what the engine says it holds (vLLM's KV cache events), not from what it served.

:class:`~zerolayer.prefix.ServedPrefixes` records the SDK-style byte blocks of every chat the runtime
rendered and forgets them by count. :class:`EngineCachedPrefixes` publishes the same digest (byte
blocks, :data:`~zerolayer.prefix.BLOCK_BYTES` each, chained as the SDK chains them) but a byte block is
in it only while the engine holds the *token* blocks that cover it, as vLLM reports them:

- ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size)``: the engine cached these
  token blocks, chained on the parent block (``None``: the first block of a prompt);
- ``BlockRemoved(block_hashes)``: it evicted them; ``AllBlocksCleared``: it dropped its whole cache.

The runtime cannot compute vLLM's block hashes (sha256 of pickled or CBOR data with a seed and
extra keys; ``vllm/v1/core/kv_cache_utils.py``), so both sides are keyed by a hash this module
computes from token ids alone: the *token chain key* of a token block is ``blake2b-64(key of the
parent block || the block's token ids)``, from :data:`~zerolayer.prefix.ROOT`. An event's blocks get
theirs from its parent's (looked up by vLLM's hash, which the record keeps for every held block),
and each rendered chat's token ids are cut the same way, so a chat and an event that hold the same
tokens name the same keys. Blocks that differ only by vLLM's extra keys (a LoRA adapter, a cache
salt) share a key: the digest says "some engine state holds these tokens". A hybrid model's KV cache
groups report the same hashes once per group; the record does not tell the groups apart.

**From token depth to byte blocks (the approximation).** For each rendered chat,
:meth:`EngineCachedPrefixes.observe_turns` links the chat's byte block *i* (its bytes ``0 ..
(i + 1) * 256`` of the SDK layout) to the token block that reaches the same share of the prompt:
token depth ``ceil((i + 1) * 256 * tokens / bytes)``, rounded up to whole token blocks, where
``tokens`` and ``bytes`` are this prompt's token count and SDK layout size. A byte block is in the
digest while any token key linked to it is held. The chat template's own text (role headers, a BOS
token) sits where the SDK layout has its ``role 0x1f`` separators, so the share is close at turn
boundaries and within a few tokens elsewhere; a byte block whose depth falls in the prompt's last,
partial token block is never linked (vLLM caches only full blocks).

**Bound.** Links: at most ``capacity`` byte blocks (the digest's 512), most recently rendered kept,
each with at most :data:`LINKS_PER_BLOCK` token keys (most recent kept). vLLM hashes: at most
``max_engine_blocks`` (the engine's KV blocks once started, since vLLM reports a removal for every
block it reuses; a missed removal ages out oldest first). So the record is
O(``capacity`` x :data:`LINKS_PER_BLOCK` + ``max_engine_blocks``) entries, and the digest at most
``capacity`` blocks.

Pure apart from a lock (events arrive on a subscriber thread, chats on the event loop); no I/O and
no vLLM import: events are read by their class name and fields (vLLM's ``kv_events`` types, or any
object shaped like them).
"""

from __future__ import annotations

import array
import collections
import hashlib
import math
import threading
from typing import Any, Callable, Hashable, Iterable, Sequence

from zerolayer.prefix import (BLOCK_BYTES, DEFAULT_CAPACITY_BLOCKS, ROOT, PrefixDigest, block_hashes, prefix_status,
                              prompt_bytes)

LINKS_PER_BLOCK = 4  # token keys remembered per byte block (chats of different lengths map it differently)
DEFAULT_MAX_ENGINE_BLOCKS = 1 << 16  # vLLM block hashes kept before the engine's block count is known


def token_key(parent: int, token_ids: Sequence[int]) -> int:
    """The token chain key of one token block (see the module doc)."""
    data = parent.to_bytes(8, "big") + array.array("q", token_ids).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def token_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chain keys of ``token_ids``'s full blocks of ``block_size`` tokens."""
    keys: list[int] = []
    parent = ROOT
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        parent = token_key(parent, token_ids[start:start + block_size])
        keys.append(parent)
    return keys


def byte_block_links(data_bytes: int, tokens: int, block_size: int, full_blocks: int) -> list[int]:
    """For byte blocks 0, 1, ...: the index of the token block that covers as much of the prompt
    (the proportional mapping above); stops at the first byte block beyond ``full_blocks``."""
    out: list[int] = []
    for i in range(data_bytes // BLOCK_BYTES):
        depth = math.ceil((i + 1) * BLOCK_BYTES * tokens / data_bytes)
        needed = max(1, math.ceil(depth / block_size))
        if needed > full_blocks:
            break
        out.append(needed - 1)
    return out


class EngineCachedPrefixes:
    """The gossiped digest's record, driven by the engine's KV cache events (see the module doc).

    The same surface as :class:`~zerolayer.prefix.ServedPrefixes`: :meth:`observe_turns` for each
    rendered chat (with its token ids), :meth:`clear`, :meth:`digest`, :meth:`status`, ``len()``
    (byte blocks held now), ``hit_rate`` (share of observed byte blocks the engine already held when
    the chat was rendered), ``version`` (changes whenever what is held may have). Events go to
    :meth:`apply` (or :meth:`stored`, :meth:`removed`, :meth:`cleared`). ``block_size``: the engine's
    tokens per KV block (vLLM's ``cache_config.block_size``). ``engine_blocks`` (optional): the
    engine's ``(block_size, number of KV blocks)`` once it knows them (vLLM: once started), read while
    ``block_size`` is unset; it sets ``block_size`` and ``max_engine_blocks``. Without either, the
    first stored event's block size is used; chats rendered before any of these are not linked.
    Thread-safe.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY_BLOCKS, *, block_size: int | None = None,
                 max_engine_blocks: int = DEFAULT_MAX_ENGINE_BLOCKS,
                 engine_blocks: Callable[[], tuple[int, int] | None] | None = None) -> None:
        if capacity < 1 or max_engine_blocks < 1:
            raise ValueError("capacity and max_engine_blocks must be >= 1")
        self.capacity = capacity
        self.block_size = block_size
        self.max_engine_blocks = max_engine_blocks
        self.engine_blocks = engine_blocks
        self._links: collections.OrderedDict[int, tuple[int, ...]] = collections.OrderedDict()
        self._engine: collections.OrderedDict[Hashable, int] = collections.OrderedDict()  # vLLM hash -> key
        self._held: collections.Counter[int] = collections.Counter()  # key -> vLLM hashes naming it
        self._lock = threading.Lock()
        self.version = 0
        self.blocks_seen = 0
        self.blocks_hit = 0
        self.unplaced = 0  # stored events whose parent block was never reported (a missed event)

    # -- chats ---------------------------------------------------------------------------------

    def observe_turns(self, turns: Iterable[tuple[str, str]], tokens: int | None = None,
                      token_ids: Sequence[int] | None = None) -> int:
        """Link a rendered chat's byte blocks to its token blocks; returns how many leading byte
        blocks the engine held already. Without ``token_ids`` (or a block size) nothing is linked.
        ``tokens`` is not read (``ServedPrefixes`` takes the same call; the count is ``len(token_ids)``)."""
        data = prompt_bytes(turns)
        blocks = block_hashes(data)
        with self._lock:
            size = self._block_size()
            if token_ids and size and data:
                keys = token_keys(token_ids, size)
                for block, index in zip(blocks, byte_block_links(len(data), len(token_ids), size, len(keys))):
                    self._link(block, keys[index])
                while len(self._links) > self.capacity:
                    self._links.popitem(last=False)
                self.version += 1
            hit = 0
            for block in blocks:
                if not self._is_held(block):
                    break
                hit += 1
            self.blocks_seen += len(blocks)
            self.blocks_hit += hit
            return hit

    def _block_size(self) -> int | None:
        if self.block_size is None and self.engine_blocks is not None:
            known = self.engine_blocks()
            if known is not None:
                self.block_size, self.max_engine_blocks = known[0], max(1, known[1])
        return self.block_size

    def _link(self, block: int, key: int) -> None:
        known = tuple(k for k in self._links.pop(block, ()) if k != key)
        self._links[block] = (known + (key,))[-LINKS_PER_BLOCK:]

    def _is_held(self, block: int) -> bool:
        return any(key in self._held for key in self._links.get(block, ()))

    # -- events --------------------------------------------------------------------------------

    def apply(self, events: Iterable[Any]) -> None:
        """Apply vLLM KV cache events in order (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``,
        read by class name); events of another storage tier (``medium`` other than GPU or unset: an
        offloading connector's CPU copy) and unknown kinds are ignored."""
        for event in events:
            kind = type(event).__name__
            if getattr(event, "medium", None) not in (None, "GPU"):
                continue
            if kind == "BlockStored":
                self.stored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size)
            elif kind == "BlockRemoved":
                self.removed(event.block_hashes)
            elif kind == "AllBlocksCleared":
                self.cleared()

    def stored(self, hashes: Sequence[Hashable], parent: Hashable | None, token_ids: Sequence[int],
               block_size: int) -> None:
        """The engine cached these blocks (``token_ids``: theirs, ``block_size`` each), chained on ``parent``."""
        with self._lock:
            if self._block_size() is None:
                self.block_size = block_size
            key = ROOT if parent is None else self._engine.get(parent)
            if key is None:  # its parent's store was missed (a dropped event) or aged out: cannot place it
                self.unplaced += 1
                return
            for j, vllm_hash in enumerate(hashes):
                chunk = token_ids[j * block_size:(j + 1) * block_size]
                if len(chunk) < block_size:
                    break
                key = token_key(key, chunk)
                if vllm_hash in self._engine:  # reported again (a prefix-cache hit in vLLM's "full" mode)
                    self._engine.move_to_end(vllm_hash)
                    continue
                self._engine[vllm_hash] = key
                self._held[key] += 1
            while len(self._engine) > self.max_engine_blocks:
                self._forget(self._engine.popitem(last=False)[1])
            self.version += 1

    def removed(self, hashes: Iterable[Hashable]) -> None:
        """The engine evicted these blocks."""
        with self._lock:
            for vllm_hash in hashes:
                key = self._engine.pop(vllm_hash, None)
                if key is not None:
                    self._forget(key)
            self.version += 1

    def _forget(self, key: int) -> None:
        self._held[key] -= 1
        if self._held[key] <= 0:
            del self._held[key]

    def cleared(self) -> None:
        """The engine dropped its whole prefix cache (``reset_prefix_cache``): nothing is held. The
        chats' links stay: a prefix stored again is in the digest again."""
        with self._lock:
            self._engine.clear()
            self._held.clear()
            self.version += 1

    def clear(self) -> None:
        """Forget everything: links, held blocks."""
        with self._lock:
            self._links.clear()
            self._engine.clear()
            self._held.clear()
            self.version += 1

    # -- the published view ----------------------------------------------------------------------

    def held_blocks(self) -> list[int]:
        """The byte blocks the engine holds now (at most ``capacity``)."""
        with self._lock:
            return [block for block in self._links if self._is_held(block)]

    def __len__(self) -> int:
        return len(self.held_blocks())

    @property
    def hit_rate(self) -> float | None:
        return self.blocks_hit / self.blocks_seen if self.blocks_seen else None

    def digest(self) -> PrefixDigest:
        return PrefixDigest.of(self.held_blocks())

    def status(self) -> dict[str, Any]:
        """The ``status.prefixCache`` object a runtime publishes (docs/routing.md)."""
        held = self.held_blocks()
        return prefix_status(PrefixDigest.of(held), len(held), self.blocks_hit, self.blocks_seen)
