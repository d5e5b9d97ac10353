"""One prefix-cache digest for a node whose API processes each serve part of its chats.

The node gossips one ``status.prefixCache`` digest (docs/routing.md): the prompt blocks its engines
hold, which the SDK matches to route a request to the node that already caches its prefix. A
process's record only sees the chats that process rendered: ``ServedPrefixes`` records them, and
``EngineCachedPrefixes`` links them to vLLM's KV events. With N API processes (docs/api-processes.md),
process 0 alone gossips, so its digest would leave out what the other processes served.

So every process other than 0 writes its records' merged digest (the Bloom filter's bits) and its
counters into its row of a shared table, once per gossip tick. Process 0 adds each row to its own
records as a :class:`PeerRecord`, and ``zerolayer.prefix.merged_status`` ORs the digests and sums the
counters, as it does for several engines in one process.

A row lags its process by at most one tick (1 s by default). Rows are written under a sequence
counter (a seqlock: one writer each), so a reader never takes a half-written filter.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from typing import Any, Sequence

from zerolayer.prefix import DIGEST_BITS, PrefixDigest, PrefixRecord, prefix_status

BITS_BYTES = DIGEST_BITS // 8
META = 4  # sequence counter, blocks, blocks hit, blocks seen


@dataclasses.dataclass
class PrefixBoard:
    """Per API process: a digest's bits and its counters. Create with :meth:`create` in the parent; it
    pickles into ``multiprocessing`` spawn arguments."""

    processes: int
    bits: Any  # RawArray('B', processes * BITS_BYTES)
    meta: Any  # RawArray('q', processes * META)

    @classmethod
    def create(cls, processes: int, context: Any = None) -> "PrefixBoard":
        ctx = context or multiprocessing.get_context("spawn")
        return cls(processes, ctx.RawArray("B", processes * BITS_BYTES), ctx.RawArray("q", processes * META))

    def write(self, process: int, digest: PrefixDigest, blocks: int, hit: int, seen: int) -> None:
        at = process * META
        self.meta[at] += 1  # odd: being written
        self.bits[process * BITS_BYTES:(process + 1) * BITS_BYTES] = digest.to_bytes()
        self.meta[at + 1:at + 4] = [blocks, hit, seen]
        self.meta[at] += 1  # even: consistent

    def read(self, process: int) -> tuple[PrefixDigest, int, int, int] | None:
        """Process ``process``'s digest and (blocks, hit, seen); None before its first write, or if it
        was being written throughout the attempts."""
        at = process * META
        for _ in range(100):
            before = self.meta[at]
            if before == 0:
                return None
            if before % 2:
                continue
            bits = bytes(self.bits[process * BITS_BYTES:(process + 1) * BITS_BYTES])
            blocks, hit, seen = self.meta[at + 1:at + 4]
            if self.meta[at] == before:
                return PrefixDigest(bits), blocks, hit, seen
        return None


def publish(board: PrefixBoard, process: int, records: Sequence[PrefixRecord]) -> None:
    """Write this process's records, merged, into its row (processes other than 0, once per tick)."""
    digest = PrefixDigest()
    for record in records:
        digest = digest.union(record.digest())
    board.write(process, digest, sum(len(r) for r in records), sum(r.blocks_hit for r in records),
                sum(r.blocks_seen for r in records))


class PeerRecord:
    """Another API process's record, as its row last said: a :class:`~zerolayer.prefix.PrefixRecord`
    for process 0's gossip. :meth:`digest` reads the row; the counters are those of that read."""

    def __init__(self, board: PrefixBoard, process: int) -> None:
        self.board, self.process = board, process
        self.blocks_hit = self.blocks_seen = self._blocks = 0

    def digest(self) -> PrefixDigest:
        row = self.board.read(self.process)
        if row is None:
            self.blocks_hit = self.blocks_seen = self._blocks = 0
            return PrefixDigest()
        digest, self._blocks, self.blocks_hit, self.blocks_seen = row
        return digest

    def status(self) -> dict[str, Any]:
        digest = self.digest()
        return prefix_status(digest, self._blocks, self.blocks_hit, self.blocks_seen)

    def __len__(self) -> int:
        return self._blocks


class PrefixShare:
    """API process ``index``'s part of the board: process 0 reads the others (:meth:`peers`), the others
    publish (:meth:`publish`)."""

    def __init__(self, board: PrefixBoard, index: int) -> None:
        self.board, self.index = board, index

    def peers(self) -> list[PeerRecord]:
        return [PeerRecord(self.board, i) for i in range(self.board.processes) if i != self.index]

    def publish(self, records: Sequence[PrefixRecord]) -> None:
        publish(self.board, self.index, records)
