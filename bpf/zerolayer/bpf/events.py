"""The token event, and its on-disk form for the in-process (journal) path.

An event's identity is ``(runtime_id, seq)``: ``runtime_id`` is random per runtime process
(so a restarted runtime never reuses ids), ``seq`` counts 1, 2, 3... within it. Both the BPF
path and the journal path deliver the same events; the store keeps each identity once.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

FLAG_FIRST = 1  # first event of a request: counts one request
NS = 1_000_000_000

# Journal record: u32 total length, then the fixed part, then tenant, model, request id (UTF-8, NUL-separated).
_FIXED = struct.Struct("<QQqIII")  # runtime_id, seq, wall_ns, input, output, flags
_LEN = struct.Struct("<I")


def minute_of(wall_ns: int) -> int:
    """The start of an event's minute, in seconds: the audit store's aggregation key."""
    return wall_ns // NS // 60 * 60


class TokenEvent(NamedTuple):
    """One event; a named tuple because the auditor builds hundreds of thousands per second."""

    runtime_id: int
    seq: int
    wall_ns: int  # when the tokens left for the client (Unix epoch, ns)
    tenant: str
    model: str
    request_id: str
    input_tokens: int
    output_tokens: int
    flags: int = 0
    pid: int = 0
    cgroup_id: int = 0
    source: str = "journal"  # "bpf" | "journal"

    @property
    def first(self) -> bool:
        return bool(self.flags & FLAG_FIRST)


def encode_record(runtime_id: int, seq: int, wall_ns: int, tenant: str, model: str, request_id: str,
                  input_tokens: int, output_tokens: int, flags: int) -> bytes:
    tail = b"\0".join((tenant.encode(), model.encode(), request_id.encode()))
    body = _FIXED.pack(runtime_id, seq, wall_ns, input_tokens, output_tokens, flags) + tail
    return _LEN.pack(_LEN.size + len(body)) + body


def corrupt_offset(buffer: bytes) -> int | None:
    """Where the first record of ``buffer`` that can never decode starts (a bad length or the wrong number
    of strings), or None. A trailing partial record is not corrupt: it may still be completed."""
    head, size = _LEN.size, _LEN.size + _FIXED.size
    pos, end = 0, len(buffer)
    while pos + head <= end:
        (length,) = _LEN.unpack_from(buffer, pos)
        if length < size:
            return pos
        if pos + length > end:
            return None
        if buffer[pos + size:pos + length].count(b"\0") != 2:
            return pos
        pos += length
    return None


def decode_records(buffer: bytes, pid: int = 0, *, wall_ns: int | None = None, cgroup_id: int = 0,
                   source: str = "journal") -> tuple[list[TokenEvent], int]:
    """Decode complete records from ``buffer``; returns the events and the bytes consumed.

    A trailing partial record (a writer caught mid-write) is left for the next read. ``wall_ns``
    (the kernel's timestamp of a BPF batch) replaces the runtime's own; ``pid``, ``cgroup_id`` and
    ``source`` are stamped on every event.
    """
    events: list[TokenEvent] = []
    append = events.append
    unpack_len, unpack_fixed = _LEN.unpack_from, _FIXED.unpack_from
    head, size = _LEN.size, _LEN.size + _FIXED.size
    pos, end = 0, len(buffer)
    while pos + head <= end:
        (length,) = unpack_len(buffer, pos)
        if length < size:
            raise ValueError(f"corrupt journal record at byte {pos}: length {length}")
        if pos + length > end:
            break
        runtime_id, seq, wall, inp, out, flags = unpack_fixed(buffer, pos + head)
        strings = buffer[pos + size:pos + length].split(b"\0")
        if len(strings) != 3:
            raise ValueError(f"corrupt journal record at byte {pos}: {len(strings)} strings")
        tenant, model, request_id = strings
        append(TokenEvent(runtime_id, seq, wall if wall_ns is None else wall_ns, tenant.decode("utf-8", "replace"),
                          model.decode("utf-8", "replace"), request_id.decode("utf-8", "replace"), inp, out, flags,
                          pid, cgroup_id, source))
        pos += length
    return events, pos
