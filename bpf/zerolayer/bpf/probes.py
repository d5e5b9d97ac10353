"""The runtime side of metering: :class:`TokenProbe`, called where tokens leave for the client.

``emit`` adds tokens to the request's pending event; pending events are *fired* together once the
metering window (``window_s``, default 50 ms) has passed since the first of them, at once when
``emit`` runs outside an event loop, or early when many are pending. A window of 0 fires at the
next event-loop iteration. Each request gets one event per window carrying all its tokens of that
window; the event's id ``(runtime_id, seq)`` is given when it is fired.

Inside an event loop, the window's end *seals* the pending events and they fire one callback later
(``call_soon``). The runtime meters a piece right after handing it to its connection, whose write is
then already scheduled (``flush_soon``); a callback scheduled after every metering call of a batch
runs after every write those calls followed. So an event never fires before the bytes it meters were
written to the socket: a runtime killed between the two cannot bill a token the client never got
(tests/integration/audit/test_audit_end_to_end.py). Firing does, in order:

1. fires the USDT probe ``zerolayer:tokens`` (bpf/_probes.c) once for the whole batch. With no
   auditor attached this is a nop instruction; attached, the kernel traps once and copies the
   batch into a BPF ring buffer synchronously, so an event fired is never lost to a runtime crash;
2. optionally (``journal=True``) appends the batch to the runtime's journal in ``<spool>``: the
   in-process path for hosts without BPF. The auditor tails the journal into the same store.
   The journal is segmented: ``<runtime_id>.journal``, then ``<runtime_id>.1.journal``, ... A new
   segment starts once one reaches ``journal_max_bytes``; the auditor deletes a segment once a
   newer one exists and it has committed all of it. A failed append (a full spool) never raises
   into the request: the file is cut back to the last whole record (or, if that fails, a new
   segment starts), the failure is logged and counted, and the counters below still count the
   events, so the auditor books them by reconciliation;
3. adds the batch's tokens to the runtime's own counters per (tenant, model): the cross-check the
   auditor compares its store with, and the source it reconciles lost events from. Counters only
   ever cover fired events, so a counters snapshot never runs ahead of what the auditor can see.
   With a spool directory they are written there (atomically, at most once per
   ``snapshot_interval_s``, from a thread, and at ``close``) as ``<runtime_id>.counters.json``.

Why a window: a token event per token costs the auditor a store row per token (~10 us of CPU at
tens of thousands of tokens per second on a node); one event per request per 50 ms costs a few
per second per stream, whatever the token rate. The price: a runtime killed with SIGKILL leaves
the tokens of its last window unmetered (at most ``window_s`` x the stream's token rate, per
stream; a clean stop fires everything). ``window_s=0`` bounds that to one loop iteration.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import pathlib
import secrets
import threading
import time
from typing import Any

from zerolayer.bpf.errors import AuditError
from zerolayer.bpf.events import FLAG_FIRST, encode_record

log = logging.getLogger(__name__)

try:
    import zerolayer.bpf._probes as _probes
except ImportError:  # built without sys/sdt.h: the in-process path still works
    _probes = None  # type: ignore[assignment]

USDT_AVAILABLE = _probes is not None
LIMIT = 16383  # bytes a batch may hold: what the BPF program copies (bpf/_probes.c, token_events.bpf.c)
PENDING_MAX = 64  # fire early once this many requests have tokens pending (~7 KiB of records)
JOURNAL_MAX_BYTES = 32 << 20  # a journal segment this large is closed and a new one started
FAILURE_LOG_INTERVAL_S = 60.0


def probe_library() -> str | None:
    """Path of the shared object holding the USDT site (what the auditor attaches to), or None."""
    return None if _probes is None else _probes.__file__


def whole_records(data: bytes, limit: int) -> int:
    """Bytes of ``data`` (records, as fired) that hold only whole records within its first ``limit`` bytes."""
    pos = 0
    while pos + 4 <= limit:
        length = int.from_bytes(data[pos:pos + 4], "little")
        if length <= 0 or pos + length > limit:
            break
        pos += length
    return pos


def count_records(data: bytes, limit: int) -> int:
    """Records in the first ``limit`` bytes of ``data`` (``limit`` from :func:`whole_records`)."""
    pos = count = 0
    while pos < limit:
        pos += int.from_bytes(data[pos:pos + 4], "little")
        count += 1
    return count


class PyBatch:
    """The batch without the C extension (no sys/sdt.h at install): same records, no probe site."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self.count = 0
        self.size = 0

    def append(self, runtime_id: int, seq: int, wall_ns: int, tenant: str, model: str, request_id: str,
               input_tokens: int, output_tokens: int, flags: int) -> int:
        record = encode_record(runtime_id, seq, wall_ns, tenant, model, request_id, input_tokens, output_tokens,
                               flags)
        if len(record) > LIMIT:
            raise ValueError(f"token event of {len(record)} bytes exceeds the {LIMIT}-byte batch")
        if self.size + len(record) > LIMIT:
            raise OverflowError("batch full: fire() and clear() it first")
        self._parts.append(record)
        self.count += 1
        self.size += len(record)
        return self.size

    def fire(self) -> int:
        return self.count

    def take(self) -> bytes:
        data = b"".join(self._parts)
        self.clear()
        return data

    def clear(self) -> None:
        self._parts.clear()
        self.count = self.size = 0


class TokenProbe:
    """One per runtime process. See the module docstring for what ``emit`` guarantees."""

    def __init__(self, spool: str | os.PathLike[str] | None = None, *, journal: bool = False,
                 snapshot_interval_s: float = 1.0, usdt: bool = True, window_s: float = 0.05,
                 journal_max_bytes: int = JOURNAL_MAX_BYTES) -> None:
        if window_s < 0:
            raise AuditError(f"the metering window must be 0 or more seconds, not {window_s}")
        self.runtime_id = secrets.randbits(63) or 1
        self.pid = os.getpid()
        self.started_ns = time.time_ns()
        self.spool = pathlib.Path(spool) if spool is not None else None
        if journal and self.spool is None:
            raise AuditError("the in-process journal needs a spool directory")
        self.window_s = window_s
        self.seq = 0  # last event fired: what the counters cover
        self.batches = 0  # batches fired (probe traps when attached)
        self.totals: dict[tuple[str, str], list[int]] = {}  # (tenant, model) -> [input, output, events, requests]
        self._pending: dict[tuple[str, str, str], list[int]] = {}  # (tenant, model, request) -> [in, out, flags]
        self._sealed: list[dict[tuple[str, str, str], list[int]]] = []  # windows ended, firing one callback later
        self._lock = threading.Lock()
        self._usdt = usdt and _probes is not None
        self._batch: Any = _probes.Batch() if self._usdt else PyBatch()
        self._scheduled = False
        self._journal = journal
        self._journal_fd: int | None = None
        self._journal_segment = 0
        self._journal_size = 0  # bytes in the open segment, all of them whole records
        self.journal_max_bytes = journal_max_bytes
        self.journal_failures = 0  # appends that failed (their events are in the counters only)
        self._last_failure_log = float("-inf")
        self._dirty = threading.Event()
        self._closed = threading.Event()
        self._snapshot_interval_s = snapshot_interval_s
        self._thread: threading.Thread | None = None
        if self.spool is not None:
            try:
                self.spool.mkdir(parents=True, exist_ok=True)
                if journal:
                    self._open_segment()
            except OSError as exc:
                raise AuditError(f"cannot use audit spool {self.spool}: {exc}") from exc
            self._try_snapshot()
            self._thread = threading.Thread(target=self._snapshot_loop, name="token-counters", daemon=True)
            self._thread.start()
        log.info("token probe %016x: usdt=%s journal=%s window=%gms spool=%s", self.runtime_id, self._usdt,
                 self._journal, window_s * 1000, self.spool)

    @property
    def mode(self) -> str:
        return "+".join(m for m, on in (("usdt", self._usdt), ("journal", self._journal))
                        if on) or "counters"

    def emit(self, tenant: str, request_id: str, model: str, input_tokens: int, output_tokens: int,
             first: bool = False) -> None:
        """Meter tokens that were just handed to the client's connection (fired with the window's other
        events, after the connection's write: see the module docstring)."""
        with self._lock:
            row = self._pending.get((tenant, model, request_id))
            if row is None:
                self._pending[(tenant, model, request_id)] = [input_tokens, output_tokens, FLAG_FIRST if first else 0]
                full = len(self._pending) >= PENDING_MAX
            else:
                row[0] += input_tokens
                row[1] += output_tokens
                if first:
                    row[2] |= FLAG_FIRST
                full = False
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self._fire_locked()
                return
            if full:  # many requests pending: seal them now, fire at the next callback
                self._sealed.append(self._pending)
                self._pending = {}
                loop.call_soon(self._fire_sealed)
                return
            if self._scheduled:
                return
            self._scheduled = True
        if self.window_s:
            loop.call_later(self.window_s, self._seal)
        else:
            loop.call_soon(self._seal)

    __call__ = emit

    def _seal(self) -> None:
        """The window ended: what is pending fires one callback later, after the writes it followed."""
        with self._lock:
            self._scheduled = False
            if not self._pending:
                return
            self._sealed.append(self._pending)
            self._pending = {}
        asyncio.get_running_loop().call_soon(self._fire_sealed)

    def _fire_sealed(self) -> None:
        with self._lock:
            sealed, self._sealed = self._sealed, []
            for pending in sealed:
                self._fire(pending)

    def flush(self) -> None:
        """Fire every event now, sealed or pending (a clean stop; outside the event loop's pacing)."""
        with self._lock:
            self._fire_locked()

    def _fire_locked(self) -> None:
        self._scheduled = False
        sealed, self._sealed = self._sealed, []
        for pending in sealed:
            self._fire(pending)
        if self._pending:
            pending, self._pending = self._pending, {}
            self._fire(pending)

    def _fire(self, pending: dict[tuple[str, str, str], list[int]]) -> None:
        batch, totals, runtime_id = self._batch, self.totals, self.runtime_id
        now = time.time_ns()
        seq = self.seq
        for (tenant, model, request_id), (inp, out, flags) in pending.items():
            seq += 1
            try:
                batch.append(runtime_id, seq, now, tenant, model, request_id, inp, out, flags)
            except OverflowError:
                self._fire_batch(seq - 1)
                batch.append(runtime_id, seq, now, tenant, model, request_id, inp, out, flags)
            except ValueError as exc:
                # Too large to fire (a name of kilobytes): counted below, so the auditor sees a gap at this seq
                # and books the tokens from the counters. Never lost silently.
                log.error("token event %d for %s/%s not fired: %s", seq, tenant, model, exc)
            row = totals.get((tenant, model))
            if row is None:
                row = totals[(tenant, model)] = [0, 0, 0, 0]
            row[0] += inp
            row[1] += out
            row[2] += 1
            row[3] += flags & FLAG_FIRST
        self._fire_batch(seq)
        self._dirty.set()

    def _fire_batch(self, seq: int) -> None:
        batch = self._batch
        if batch.count:
            batch.fire()
            if self._journal:
                count = batch.count
                self._append_journal(batch.take(), count)
            else:
                batch.clear()
            self.batches += 1
        self.seq = seq

    # ------------------------------------------------------------------ journal
    def _segment_path(self, segment: int) -> pathlib.Path:
        assert self.spool is not None
        suffix = f".{segment}" if segment else ""
        return self.spool / f"{self.runtime_id:016x}{suffix}.journal"

    def _open_segment(self) -> None:
        fd = os.open(self._segment_path(self._journal_segment), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._journal_fd, self._journal_size = fd, os.fstat(fd).st_size

    def _next_segment(self) -> None:
        """Close the open segment (the auditor deletes it once consumed) and start the next one."""
        if self._journal_fd is not None:
            os.close(self._journal_fd)
            self._journal_fd = None
        self._journal_segment += 1
        self._open_segment()

    def _append_journal(self, data: bytes, events: int) -> None:
        """Append whole records; never raises (serving goes on when the spool is full)."""
        done = 0
        if self._journal_fd is None and self._closed.is_set():
            return  # emitted after close: counted only, as before the journal existed
        try:
            if self._journal_fd is None:  # a new segment could not be opened last time: try again
                self._open_segment()
            view = memoryview(data)
            while done < len(data):
                n = os.write(self._journal_fd, view[done:])  # type: ignore[arg-type]
                if n <= 0:
                    raise OSError(errno.ENOSPC, "journal write made no progress")
                done += n
            self._journal_size += done
        except OSError as exc:
            self._journal_failed(data, done, events, exc)
        if self._journal_size >= self.journal_max_bytes:
            try:
                self._next_segment()
            except OSError as exc:
                self._log_failure("cannot start a new journal segment: %s", exc)

    def _journal_failed(self, data: bytes, done: int, events: int, exc: OSError) -> None:
        self.journal_failures += 1
        whole = whole_records(data, done)
        if done > whole and self._journal_fd is not None:
            try:  # cut the torn record off: later appends must start at a record boundary
                os.ftruncate(self._journal_fd, self._journal_size + whole)
            except OSError:
                try:  # cannot cut it: leave it at the end of a closed segment, where the auditor skips it
                    self._next_segment()
                    whole = 0
                except OSError:
                    self._journal_fd = None  # reopened (as the next segment) at the next append
        self._journal_size += whole
        self._log_failure("journal append failed (%s): %d of %d events in the counters only; the auditor "
                          "reconciles them", exc, events - count_records(data, whole), events)

    def _log_failure(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last_failure_log >= FAILURE_LOG_INTERVAL_S:
            self._last_failure_log = now
            log.error(message + " (%d failures so far; logged at most once a minute)", *args,
                      self.journal_failures)

    def counters(self) -> dict[str, Any]:
        """A consistent snapshot: the counters as of fired event ``seq``."""
        with self._lock:
            seq = self.seq
            rows = [{"tenant": t, "model": m, "input_tokens": r[0], "output_tokens": r[1], "events": r[2],
                     "requests": r[3]} for (t, m), r in self.totals.items()]
        return {"runtime_id": f"{self.runtime_id:016x}", "pid": self.pid, "started_ns": self.started_ns,
                "seq": seq, "written_ns": time.time_ns(), "final": self._closed.is_set(), "totals": rows}

    def close(self) -> None:
        """Fire what is pending, write the final counters and stop the snapshot thread (idempotent)."""
        if self._closed.is_set():
            return
        self.flush()
        self._closed.set()
        if self._thread is not None:
            self._dirty.set()
            self._thread.join(timeout=5)
        if self.spool is not None:
            self._try_snapshot()
        if self._journal_fd is not None:
            os.close(self._journal_fd)
            self._journal_fd = None

    def _snapshot_loop(self) -> None:
        while not self._closed.is_set():
            self._dirty.wait()
            if self._closed.is_set():
                return
            self._dirty.clear()
            if not self._try_snapshot():
                self._dirty.set()  # try again after the interval
            self._closed.wait(self._snapshot_interval_s)

    def _try_snapshot(self) -> bool:
        """Write the counters; a failure (a full spool) is logged, never raised into serving."""
        try:
            self._write_snapshot()
            return True
        except AuditError as exc:
            log.warning("%s", exc)
            return False

    def _write_snapshot(self) -> None:
        assert self.spool is not None
        path = self.spool / f"{self.runtime_id:016x}.counters.json"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self.counters()))
            os.replace(tmp, path)
        except OSError as exc:
            raise AuditError(f"cannot write token counters to {path}: {exc}") from exc
