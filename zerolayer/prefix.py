"""Prompt-prefix identity shared by the SDK (prefix-aware node choice) and the runtime (the digest it gossips).

vLLM's prefix cache names each full block of ``block_size`` prompt *tokens* by a hash chained on
its parent block's hash (``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens(parent_hash,
token_ids, extra_keys)``), so a block's hash identifies the whole prefix up to it, and only full
blocks are cached. The SDK has no tokenizer, so this module applies the same scheme to *bytes*:

- the chat is laid out as ``role 0x1f content 0x1e`` per turn (system first), UTF-8;
- it is cut into full blocks of :data:`BLOCK_BYTES` bytes (a partial last block is not hashed,
  as vLLM does not cache a partial block);
- block ``i``'s hash is ``blake2b-64(hash[i-1] || block_i)``, starting from :data:`ROOT`;
- at most :data:`MAX_BLOCKS` blocks are hashed (16 KiB of prompt): beyond that a longer match
  changes no decision worth its hashing cost.

This is an approximation of the engine's cache, not a copy: 256 bytes are ~50-70 tokens of
English, the chat template adds text the SDK does not see, and a byte block boundary is not a
token block boundary. What matters for routing holds: two prompts that share their first ``k *
256`` bytes share the hashes of their first ``k`` blocks, and the engine caches (at least) the
tokens of that shared text on a node that served either.

:class:`PrefixDigest` is the bounded, compact form a runtime gossips (a Bloom filter);
:class:`ServedPrefixes` is the runtime's LRU record of the blocks it served, which the digest is
built from. Pure apart from a lock; no I/O.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import math
import threading
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

BLOCK_BYTES = 256
MAX_BLOCKS = 64
ROOT = 0x5A45524F4C415952  # "ZEROLAYR": the parent hash of the first block (vLLM's NONE_HASH)

DIGEST_BITS = 4096  # 512 bytes, 684 characters of base64 in InferenceNode.status
DIGEST_HASHES = 3
DIGEST_VERSION = "bloom1"
DEFAULT_CAPACITY_BLOCKS = 512  # blocks a runtime remembers: ~3 % false positives at 4096 bits, k=3


def chat_turns(body: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(role, text)`` turns of an Anthropic Messages or OpenAI chat body, system first.

    Content given as a list keeps its text blocks only, joined with nothing (as the runtime's
    ``text_of`` does); a turn with no readable text contributes an empty string, so the layout
    of the turns before it is unaffected.
    """

    def text(content: Any) -> str:
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return "".join(b["text"] for b in content
                           if isinstance(b, Mapping) and b.get("type") == "text" and isinstance(b.get("text"), str))
        return ""

    turns: list[tuple[str, str]] = []
    if body.get("system") is not None:
        turns.append(("system", text(body["system"])))
    for message in body.get("messages") or ():
        if isinstance(message, Mapping):
            turns.append((str(message.get("role", "")), text(message.get("content"))))
    return turns


def prompt_bytes(turns: Iterable[tuple[str, str]]) -> bytes:
    """The byte layout that is cut into blocks: ``role 0x1f content 0x1e`` per turn."""
    return b"".join(role.encode() + b"\x1f" + content.encode() + b"\x1e" for role, content in turns)


def block_hashes(data: bytes, *, block_bytes: int = BLOCK_BYTES, max_blocks: int = MAX_BLOCKS) -> tuple[int, ...]:
    """Chained 64-bit hashes of ``data``'s full blocks (at most ``max_blocks``)."""
    out: list[int] = []
    parent = ROOT
    for start in range(0, min(len(data) // block_bytes, max_blocks) * block_bytes, block_bytes):
        digest = hashlib.blake2b(parent.to_bytes(8, "big") + data[start:start + block_bytes], digest_size=8)
        parent = int.from_bytes(digest.digest(), "big")
        out.append(parent)
    return tuple(out)


def chat_block_hashes(turns: Iterable[tuple[str, str]]) -> tuple[int, ...]:
    return block_hashes(prompt_bytes(turns))


class PrefixDigest:
    """A Bloom filter of block hashes: what a runtime says it holds, in a bounded size.

    :data:`DIGEST_BITS` bits with :data:`DIGEST_HASHES` probes (double hashing on the two halves of
    the 64-bit block hash). With :data:`DEFAULT_CAPACITY_BLOCKS` entries the false-positive rate is
    ~3 %; because blocks are chained, a reader walks from the first block and stops at the first
    miss, so a false positive must also follow a true hit to mislead it.
    Encoded as ``"bloom1:" + base64(bits)`` (684 characters).
    """

    def __init__(self, bits: bytes | None = None) -> None:
        self._bits = bytearray(bits if bits is not None else DIGEST_BITS // 8)
        if len(self._bits) * 8 != DIGEST_BITS:
            raise ValueError(f"a digest has {DIGEST_BITS} bits, got {len(self._bits) * 8}")

    @staticmethod
    def _positions(block: int) -> Iterable[int]:
        low, high = block & 0xFFFFFFFF, (block >> 32) | 1
        return ((low + i * high) % DIGEST_BITS for i in range(DIGEST_HASHES))

    @classmethod
    def of(cls, blocks: Iterable[int]) -> "PrefixDigest":
        digest = cls()
        for block in blocks:
            digest.add(block)
        return digest

    def add(self, block: int) -> None:
        for p in self._positions(block):
            self._bits[p >> 3] |= 1 << (p & 7)

    def __contains__(self, block: object) -> bool:
        return isinstance(block, int) and all(self._bits[p >> 3] >> (p & 7) & 1 for p in self._positions(block))

    def matched(self, blocks: Sequence[int]) -> int:
        """How many leading ``blocks`` the digest holds (the longest cached prefix, in blocks)."""
        count = 0
        for block in blocks:
            if block not in self:
                break
            count += 1
        return count

    def fill(self) -> float:
        """Share of the bits set: how full the node's record is (0 empty, ~0.31 at 512 blocks)."""
        return sum(bin(byte).count("1") for byte in self._bits) / DIGEST_BITS

    def union(self, other: "PrefixDigest") -> "PrefixDigest":
        return PrefixDigest(bytes(x | y for x, y in zip(self._bits, other._bits)))

    def to_bytes(self) -> bytes:
        """The filter's bits (:data:`DIGEST_BITS` / 8 bytes); ``PrefixDigest(bits)`` reads them back."""
        return bytes(self._bits)

    def encode(self) -> str:
        return f"{DIGEST_VERSION}:{base64.b64encode(bytes(self._bits)).decode()}"

    @classmethod
    def decode(cls, value: object) -> "PrefixDigest | None":
        """The digest in a published string; ``None`` for anything unreadable or of another version
        (a reader then routes as if the node published none)."""
        if not isinstance(value, str) or not value.startswith(DIGEST_VERSION + ":"):
            return None
        try:
            return cls(base64.b64decode(value[len(DIGEST_VERSION) + 1:], validate=True))
        except (ValueError, TypeError):
            return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PrefixDigest) and self._bits == other._bits

    def __hash__(self) -> int:
        return hash(bytes(self._bits))


def false_positive_rate(entries: int, bits: int = DIGEST_BITS, probes: int = DIGEST_HASHES) -> float:
    """The Bloom filter's expected false-positive rate with ``entries`` blocks in it."""
    return (1.0 - math.exp(-probes * entries / bits)) ** probes


class ServedPrefixes:
    """The runtime's record of the prompt blocks it served, most recent ``capacity`` blocks kept.

    An approximation of the engine's prefix cache (which evicts by its own LRU over KV blocks):
    ``observe`` is called with every rendered chat, ``clear`` when the engine drops its cache, so
    the digest follows the reset (gpu-defragd's SIGUSR1 does not drop vLLM's: docs/defragd.md).
    ``hit_rate`` is the share of observed blocks that were already recorded: the runtime's estimate
    of its prefix-cache hit rate.

    ``cache_tokens`` (optional): the engine's KV cache size in tokens, read at each observation
    (vLLM knows it only once started). With it, the record keeps no more blocks than that cache
    could hold: ``cache_tokens`` x the bytes per token of the prompts observed so far (their byte
    layout over the token counts the engine gave them) / :data:`BLOCK_BYTES`, so a digest stops
    claiming prefixes an engine smaller than the record has certainly evicted. It is an upper
    bound: running requests' own tokens share that cache.
    ``version`` changes whenever the recorded set does. Thread-safe.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY_BLOCKS,
                 cache_tokens: Callable[[], int | None] | None = None) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.cache_tokens = cache_tokens
        self._blocks: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.version = 0
        self.blocks_seen = 0
        self.blocks_hit = 0
        self.bytes_seen = 0  # prompt bytes and tokens of the observations that gave a token count
        self.tokens_seen = 0

    def limit(self) -> int:
        """Blocks kept now: ``capacity``, or fewer when the engine's cache holds fewer (see above)."""
        tokens = self.cache_tokens() if self.cache_tokens is not None else None
        if not tokens or not self.tokens_seen:
            return self.capacity
        return max(1, min(self.capacity, int(tokens * self.bytes_seen / self.tokens_seen) // BLOCK_BYTES))

    def observe(self, blocks: Sequence[int]) -> int:
        """Record a served prompt's blocks; returns how many leading ones were already held."""
        with self._lock:
            hit = 0
            for block in blocks:
                if block not in self._blocks:
                    break
                hit += 1
            self.blocks_seen += len(blocks)
            self.blocks_hit += hit
            changed = hit < len(blocks)
            for block in blocks:
                if block in self._blocks:
                    self._blocks.move_to_end(block)
                else:
                    self._blocks[block] = None
            limit = self.limit()
            while len(self._blocks) > limit:
                self._blocks.popitem(last=False)
                changed = True
            if changed:
                self.version += 1
            return hit

    def observe_turns(self, turns: Iterable[tuple[str, str]], tokens: int | None = None,
                      token_ids: Sequence[int] | None = None) -> int:
        """Record a rendered chat; ``tokens``: its prompt's token count in the engine (sizes the record
        to the engine's cache, see the class doc). ``token_ids`` is not read here (the same call feeds
        :class:`zerolayer.engine_prefixes.EngineCachedPrefixes`, which needs them)."""
        data = prompt_bytes(turns)
        if tokens:
            with self._lock:
                self.bytes_seen += len(data)
                self.tokens_seen += tokens
        return self.observe(block_hashes(data))

    def clear(self) -> None:
        with self._lock:
            if self._blocks:
                self._blocks.clear()
                self.version += 1

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def hit_rate(self) -> float | None:
        return self.blocks_hit / self.blocks_seen if self.blocks_seen else None

    def digest(self) -> PrefixDigest:
        with self._lock:
            return PrefixDigest.of(self._blocks)

    def status(self) -> dict[str, Any]:
        """The ``status.prefixCache`` object a runtime publishes (see docs/routing.md)."""
        return prefix_status(self.digest(), len(self), self.blocks_hit, self.blocks_seen)


def prefix_status(digest: PrefixDigest, blocks: int, blocks_hit: int, blocks_seen: int) -> dict[str, Any]:
    """``status.prefixCache``: the digest, the blocks in it, and the hit rate (None before any chat)."""
    return {"digest": digest.encode(), "blocks": blocks, "blockBytes": BLOCK_BYTES,
            "hitRate": round(blocks_hit / blocks_seen, 4) if blocks_seen else None}


class PrefixRecord(Protocol):
    """What a runtime's record of its cached prefixes offers the gossip (:class:`ServedPrefixes`, or
    :class:`zerolayer.engine_prefixes.EngineCachedPrefixes` driven by the engine's KV cache events)."""

    blocks_seen: int
    blocks_hit: int

    def digest(self) -> PrefixDigest: ...

    def status(self) -> dict[str, Any]: ...

    def __len__(self) -> int: ...


def merged_status(records: Sequence[PrefixRecord]) -> dict[str, Any]:
    """One ``status.prefixCache`` for several engines' records: the union of their digests."""
    if len(records) == 1:
        return records[0].status()
    digest = PrefixDigest()
    for record in records:
        digest = digest.union(record.digest())
    return prefix_status(digest, sum(len(r) for r in records), sum(r.blocks_hit for r in records),
                         sum(r.blocks_seen for r in records))
