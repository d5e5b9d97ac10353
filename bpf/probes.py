"""The runtime side of metering: :class:`TokenProbe`, called where tokens leave for the client.

``emit`` does three things, in this order of importance:

1. fires the USDT probe ``zerolayer:token`` (bpf/_probes.c). With no auditor attached this is a
   nop instruction behind one C call; with the auditor attached the kernel copies the event into
   a BPF ring buffer synchronously, so an event emitted is never lost to a runtime crash;
2. adds the tokens to the runtime's own counters per (tenant, model): the cross-check the
   auditor compares its store with, and the source it reconciles lost events from. With a spool
   directory the counters are written there (atomically, at most once per ``snapshot_interval_s``,
   from a thread, and at ``close``) as ``<runtime_id>.counters.json``;
3. optionally (``journal=True``) appends the event to ``<spool>/<runtime_id>.journal``: the
   in-process path for hosts without BPF. The auditor tails the journal into the same store.

``emit`` is synchronous and cheap; it is called on the event loop thread. Only the snapshot
thread touches the disk for counters; the journal write is one ``os.write`` of ~100 bytes.
"""

from __future__ import annotations

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
    from zerolayer.bpf import _probes
except ImportError:  # built without sys/sdt.h: the in-process path still works
    _probes = None  # type: ignore[assignment]

USDT_AVAILABLE = _probes is not None


def probe_library() -> str | None:
    """Path of the shared object holding the USDT site (what the auditor attaches to), or None."""
    return None if _probes is None else _probes.__file__


class TokenProbe:
    """One per runtime process. See the module docstring for what ``emit`` guarantees."""

    def __init__(self, spool: str | os.PathLike[str] | None = None, *, journal: bool = False,
                 snapshot_interval_s: float = 1.0, usdt: bool = True) -> None:
        self.runtime_id = secrets.randbits(63) or 1
        self.pid = os.getpid()
        self.started_ns = time.time_ns()
        self.spool = pathlib.Path(spool) if spool is not None else None
        if journal and self.spool is None:
            raise AuditError("the in-process journal needs a spool directory")
        self.seq = 0
        self.totals: dict[tuple[str, str], list[int]] = {}  # (tenant, model) -> [input, output, events, requests]
        self._lock = threading.Lock()
        self._fire = _probes.token if (usdt and _probes is not None) else None
        self._journal_fd: int | None = None
        self._dirty = threading.Event()
        self._closed = threading.Event()
        self._snapshot_interval_s = snapshot_interval_s
        self._thread: threading.Thread | None = None
        if self.spool is not None:
            try:
                self.spool.mkdir(parents=True, exist_ok=True)
                if journal:
                    self._journal_fd = os.open(self.spool / f"{self.runtime_id:016x}.journal",
                                               os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            except OSError as exc:
                raise AuditError(f"cannot use audit spool {self.spool}: {exc}") from exc
            self._write_snapshot()
            self._thread = threading.Thread(target=self._snapshot_loop, name="token-counters", daemon=True)
            self._thread.start()
        log.info("token probe %016x: usdt=%s journal=%s spool=%s", self.runtime_id, self._fire is not None,
                 self._journal_fd is not None, self.spool)

    @property
    def mode(self) -> str:
        return "+".join(m for m, on in (("usdt", self._fire is not None), ("journal", self._journal_fd is not None))
                        if on) or "counters"

    def emit(self, tenant: str, request_id: str, model: str, input_tokens: int, output_tokens: int,
             first: bool = False) -> int:
        """Meter tokens that just left for the client; returns the event's ``seq``."""
        flags = FLAG_FIRST if first else 0
        with self._lock:
            self.seq = seq = self.seq + 1
            row = self.totals.get((tenant, model))
            if row is None:
                row = self.totals[(tenant, model)] = [0, 0, 0, 0]
            row[0] += input_tokens
            row[1] += output_tokens
            row[2] += 1
            row[3] += flags
            if self._fire is not None:
                self._fire(self.runtime_id, seq, tenant, model, request_id, input_tokens, output_tokens, flags)
            if self._journal_fd is not None:
                os.write(self._journal_fd, encode_record(self.runtime_id, seq, time.time_ns(), tenant, model,
                                                         request_id, input_tokens, output_tokens, flags))
        self._dirty.set()
        return seq

    __call__ = emit

    def counters(self) -> dict[str, Any]:
        """A consistent snapshot: the counters as of event ``seq``."""
        with self._lock:
            seq = self.seq
            rows = [{"tenant": t, "model": m, "input_tokens": r[0], "output_tokens": r[1], "events": r[2],
                     "requests": r[3]} for (t, m), r in self.totals.items()]
        return {"runtime_id": f"{self.runtime_id:016x}", "pid": self.pid, "started_ns": self.started_ns,
                "seq": seq, "written_ns": time.time_ns(), "final": self._closed.is_set(), "totals": rows}

    def close(self) -> None:
        """Write the final counters and stop the snapshot thread (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not None:
            self._dirty.set()
            self._thread.join(timeout=5)
        if self.spool is not None:
            self._write_snapshot()
        if self._journal_fd is not None:
            os.close(self._journal_fd)
            self._journal_fd = None

    def _snapshot_loop(self) -> None:
        while not self._closed.is_set():
            self._dirty.wait()
            if self._closed.is_set():
                return
            self._dirty.clear()
            try:
                self._write_snapshot()
            except AuditError as exc:
                log.warning("%s", exc)
            self._closed.wait(self._snapshot_interval_s)

    def _write_snapshot(self) -> None:
        assert self.spool is not None
        path = self.spool / f"{self.runtime_id:016x}.counters.json"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self.counters()))
            os.replace(tmp, path)
        except OSError as exc:
            raise AuditError(f"cannot write token counters to {path}: {exc}") from exc
