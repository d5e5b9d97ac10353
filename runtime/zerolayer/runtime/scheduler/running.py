"""Which streams memory pressure sheds, node-wide, when several API processes share one engine.

Under sustained memory pressure the micro-scheduler preempts running streams of the lowest classes,
at most ``max_preemptions_per_tick`` per telemetry sample, largest first (``plugins.LargestFirst``).
With N API processes (docs/api-processes.md) the engine's KV cache is one, but each process holds
only its own streams. Left alone, each would shed its own largest: N times the budget per sample,
and a process holding only small streams would shed them while another holds the large ones.

So one process picks for the node, and the others carry out its picks:

- every process publishes its shed-class candidates (priority, tokens so far, a key hash) in its row
  of a shared table at each sample;
- API process 0 picks from its own streams plus every other row, with the scheduler's picker, gate
  and budget (the same code as one process), and writes its picks for other processes in an orders
  list. It preempts its own picks at once;
- at each of its samples, every other process preempts those of its streams that the orders list
  names.

Guarantees:

- **Budget.** Picks are made in one place, so the node sheds at most ``max_preemptions_per_tick``
  per sample of process 0.
- **Order.** Streams are shed largest first across the processes, lowest class first.
- **No lost or repeated orders.** An order stays in the list until its stream is gone from its
  owner's row; the owner leaves a preempted stream out of its row. So a process that samples late
  still finds its orders, and process 0 does not pick the same stream twice.
- **Delay.** A stream of another process is preempted up to one of its sample intervals after the
  pick (200 ms by default).

Rows and the orders list are written under a sequence counter (a seqlock: one writer each), so a
reader never takes a half-written one; no lock is shared between processes.

:class:`LocalRunning` is the one-process case: the picks are taken from one's own streams.
"""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing
from typing import Any, Callable, Protocol, Sequence

from zerolayer.contract import Priority

from .api import RunningStream

SLOTS = 64  # candidates a process publishes: its largest shed-class streams (the picker takes the largest)
ORDERS = 256  # outstanding picks for other processes that the orders list holds
FIELDS = 3  # a candidate: priority, tokens so far, key hash
HEADER = 2  # a table's sequence counter and number of entries
ROW = HEADER + SLOTS * FIELDS
Picker = Callable[[Sequence[RunningStream]], list[RunningStream]]


class RunningView(Protocol):
    """What the scheduler asks of the node's running streams when it sheds."""

    def victims(self, own: Sequence[RunningStream], pick: Picker) -> list[RunningStream]:
        """Which of ``own`` (this process's shed-class streams, not yet preempted) to preempt now;
        ``pick`` chooses one sample's victims from a list of candidates."""
        ...


class LocalRunning:
    """One API process: the picks are taken from its own streams."""

    def victims(self, own: Sequence[RunningStream], pick: Picker) -> list[RunningStream]:
        return pick(own)


@dataclasses.dataclass
class RunningBoard:
    """The shared tables: a row of candidates per process and the orders list. Create with :meth:`create`
    in the parent; it pickles into ``multiprocessing`` spawn arguments."""

    processes: int
    rows: Any  # RawArray('q', processes * ROW)
    orders: Any  # RawArray('q', HEADER + ORDERS): node-wide stream keys (process, key hash) packed

    @classmethod
    def create(cls, processes: int, context: Any = None) -> "RunningBoard":
        ctx = context or multiprocessing.get_context("spawn")
        return cls(processes, ctx.RawArray("q", processes * ROW), ctx.RawArray("q", HEADER + ORDERS * 2))

    def write_row(self, process: int, entries: Sequence[tuple[int, int, int]]) -> None:
        _write(self.rows, process * ROW, [v for entry in entries[:SLOTS] for v in entry], FIELDS)

    def read_row(self, process: int) -> list[tuple[int, int, int]]:
        flat = _read(self.rows, process * ROW, FIELDS, SLOTS)
        return [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), FIELDS)]

    def write_orders(self, orders: Sequence[tuple[int, int]]) -> None:
        _write(self.orders, 0, [v for order in orders[:ORDERS] for v in order], 2)

    def read_orders(self) -> list[tuple[int, int]]:
        flat = _read(self.orders, 0, 2, ORDERS)
        return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


def _write(cells: Any, base: int, values: Sequence[int], width: int) -> None:
    """One writer's update of a table at ``base``: sequence counter odd while writing."""
    cells[base] += 1
    cells[base + HEADER:base + HEADER + len(values)] = list(values)
    cells[base + 1] = len(values) // width
    cells[base] += 1


def _read(cells: Any, base: int, width: int, most: int) -> list[int]:
    """A consistent copy of a table's entries (flat), or none if it was being written throughout."""
    for _ in range(100):
        before = cells[base]
        if before % 2:
            continue
        count = min(cells[base + 1], most)
        values = cells[base + HEADER:base + HEADER + count * width]
        if cells[base] == before:
            return list(values)
    return []


def stream_hash(stream_key: str) -> int:
    """A signed 64-bit key for a stream key (what the shared tables hold)."""
    return int.from_bytes(hashlib.blake2b(stream_key.encode(), digest_size=8).digest(), "little", signed=True)


def node_key(process: int, key_hash: int) -> str:
    """A stream's name in the node-wide list, the same whichever process lists it (the picker breaks
    ties by it)."""
    return f"{process:02d}/{key_hash & 0xFFFFFFFFFFFFFFFF:016x}"


class SharedRunning:
    """API process ``index``'s part: process 0 picks for the node, the others carry out its orders."""

    def __init__(self, board: RunningBoard, index: int) -> None:
        if not 0 <= index < board.processes:
            raise ValueError(f"API process {index} is not one of the board's {board.processes}")
        self.board, self.index = board, index
        self._ordered: set[tuple[int, int]] = set()  # process 0: picks for others not yet carried out

    def victims(self, own: Sequence[RunningStream], pick: Picker) -> list[RunningStream]:
        if self.index != 0:
            orders = set(self.board.read_orders())
            chosen = [s for s in own if (self.index, stream_hash(s.stream_key)) in orders]
            self._publish([s for s in own if s not in chosen])
            return chosen
        return self._pick_for_the_node(own, pick)

    def _publish(self, own: Sequence[RunningStream]) -> None:
        largest = sorted(own, key=lambda s: -s.tokens_so_far)[:SLOTS]
        self.board.write_row(self.index, [(int(s.priority), s.tokens_so_far, stream_hash(s.stream_key))
                                          for s in largest])

    def _pick_for_the_node(self, own: Sequence[RunningStream], pick: Picker) -> list[RunningStream]:
        mine = {node_key(0, stream_hash(s.stream_key)): s for s in own}
        candidates = [dataclasses.replace(s, stream_key=key) for key, s in mine.items()]
        theirs: dict[str, tuple[int, int]] = {}  # node key -> (process, key hash), for the orders
        for other in range(1, self.board.processes):
            for priority, tokens, key_hash in self.board.read_row(other):
                theirs[node_key(other, key_hash)] = (other, key_hash)
                if (other, key_hash) not in self._ordered:
                    candidates.append(RunningStream(node_key(other, key_hash), Priority(priority), tokens, None))
        self._ordered &= set(theirs.values())  # carried out: its owner no longer lists it
        chosen: list[RunningStream] = []
        for victim in pick(candidates):
            if victim.stream_key in mine:
                chosen.append(mine[victim.stream_key])
            else:
                self._ordered.add(theirs[victim.stream_key])
        self.board.write_orders(sorted(self._ordered))
        return chosen
