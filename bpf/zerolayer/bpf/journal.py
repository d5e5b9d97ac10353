"""The in-process path: tail the runtimes' journals in the spool.

Used where the kernel path cannot run (not root, no bcc, no uprobes). The runtime appends each
batch of events to its journal (:class:`~zerolayer.bpf.probes.TokenProbe` with ``journal=True``),
in segments ``<runtime_id>.journal``, ``<runtime_id>.1.journal``, ...; this source reads what was
appended since the last poll. Its resume position per file is part of :meth:`state`, which the
auditor commits in the same store transaction as the events, so a restart resumes exactly where
the store stops.

Damage never stops metering: a record that cannot be decoded, or a partial record that will never
be completed (torn by a failed write), is skipped and counted in :meth:`lost`; the runtime's
counters still cover those events, so reconciliation books them. Records carry no sync marker,
so after a corrupt record the rest of the file as it is now is skipped; the writer only ever
appends whole records after damage it left (it cuts a torn record off, or starts a new segment).
A partial record at the end of a file is torn when a newer segment of the same runtime exists
(the writer has moved on) or when it has not been completed for ``torn_after_s``.

Disk: a segment is deleted once everything in it is committed and it will never grow again: a
newer segment of the same runtime exists, or the runtime's counters say it finished (``final``).
An auditor that meters through the kernel reads no journal (the runtime may still write one,
e.g. ``audit.mode: auto``): :func:`discard_unread_journals` keeps only the segments in use.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import time
from typing import Callable, Mapping

from zerolayer.bpf.errors import AuditError
from zerolayer.bpf.events import TokenEvent, corrupt_offset, decode_records

log = logging.getLogger(__name__)
STATE_PREFIX = "journal:"
READ_CHUNK = 4 << 20
STALE_S = 600.0  # a journal nobody reads, not written for this long, belongs to a runtime that is gone
FINAL_CHECK_S = 10.0  # how often a consumed journal's counters are read to see whether its runtime finished
_SEGMENT = re.compile(r"^(?P<runtime>[^.]+)(?:\.(?P<segment>\d+))?\.journal$")


def segments(spool: pathlib.Path) -> dict[str, list[tuple[int, pathlib.Path]]]:
    """Journal files per runtime, oldest segment first."""
    found: dict[str, list[tuple[int, pathlib.Path]]] = {}
    for path in spool.glob("*.journal"):
        m = _SEGMENT.match(path.name)
        if m:
            found.setdefault(m["runtime"], []).append((int(m["segment"] or 0), path))
    return {k: sorted(v) for k, v in sorted(found.items())}


def discard_unread_journals(spool: pathlib.Path, *, stale_s: float = STALE_S,
                            now: float | None = None) -> int:
    """Where the auditor meters through the kernel: delete every journal segment that is closed (a newer one
    exists) or not written for ``stale_s``. The kernel delivered the same events (or the counters reconcile
    them); the open segment of a live runtime stays until it is closed. Returns the segments deleted."""
    now = time.time() if now is None else now
    removed = 0
    for files in segments(spool).values():
        for i, (_, path) in enumerate(files):
            try:
                if i < len(files) - 1 or now - path.stat().st_mtime >= stale_s:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot delete journal segment %s: %s", path, exc)
    return removed


def runtime_finished(spool: pathlib.Path, runtime: str) -> bool:
    """Whether the runtime's counters say it closed (it will never append to its journal again)."""
    try:
        return json.loads((spool / f"{runtime}.counters.json").read_text()).get("final") is True
    except (OSError, ValueError, AttributeError):
        return False


def create_spool(spool: pathlib.Path) -> None:
    """Make the spool directory if it is missing, as shared as the directory it is made in.

    In a pod the spool lives on an emptyDir that the runtime (non-root) and the auditor (root)
    share; when the auditor starts first, a directory it made with the default mode would lock the
    runtime out of its own journal (seen on a real node: "Permission denied" and a crash loop).
    Taking the parent's mode (the volume's: group-writable and setgid under ``fsGroup``) keeps
    it exactly as writable as the volume the operator made, and no more.
    """
    if spool.is_dir():
        return
    spool.mkdir(parents=True, exist_ok=True)
    spool.chmod(spool.parent.stat().st_mode & 0o7777)


class JournalSource:
    kind = "journal"

    def __init__(self, spool: str | os.PathLike[str], resume: Mapping[str, str] | None = None,
                 drain_interval_s: float = 0.1, torn_after_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spool = pathlib.Path(spool)
        self.drain_interval_s = drain_interval_s
        self.torn_after_s = torn_after_s
        self.clock = clock
        try:
            create_spool(self.spool)  # the auditor may start before any runtime
        except OSError as exc:
            raise AuditError(f"cannot use spool directory {self.spool}: {exc}") from exc
        self.offsets: dict[str, int] = {k[len(STATE_PREFIX):]: int(v) for k, v in (resume or {}).items()
                                        if k.startswith(STATE_PREFIX)}
        self._pending: dict[str, int] = {}
        self._skipped = 0  # records skipped (torn or corrupt), counted in lost()
        self._partial: dict[str, tuple[int, int, float]] = {}  # name -> (offset, size, first seen)
        self._sealed: dict[str, pathlib.Path] = {}  # segments that never grow again: a newer one exists
        self._newest: dict[str, tuple[str, pathlib.Path]] = {}  # name -> (runtime, path) of each last segment
        self._final_checked: dict[str, float] = {}  # name -> when its runtime's counters were last read

    def poll(self, timeout_ms: int = 100) -> list[TokenEvent]:
        """Sleeps ``min(timeout_ms, drain interval)``, then returns the events appended since the last call."""
        if timeout_ms > 0:
            time.sleep(min(timeout_ms / 1000, self.drain_interval_s))
        return self._read()

    def _read(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        sealed: dict[str, pathlib.Path] = {}
        newest: dict[str, tuple[str, pathlib.Path]] = {}
        for runtime, files in segments(self.spool).items():
            for i, (_, path) in enumerate(files):
                if i < len(files) - 1:
                    sealed[path.name] = path
                else:
                    newest[path.name] = (runtime, path)
                events.extend(self._read_file(path, sealed=i < len(files) - 1))
        self._sealed, self._newest = sealed, newest
        return events

    def _read_file(self, path: pathlib.Path, *, sealed: bool) -> list[TokenEvent]:
        name = path.name
        offset = self._pending.get(name, self.offsets.get(name, 0))
        try:
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size <= offset:
                    return []
                f.seek(offset)
                data = f.read(READ_CHUNK)
        except FileNotFoundError:
            return []  # deleted by us after its last commit, or by the runtime's cleanup
        except OSError as exc:
            raise AuditError(f"cannot read journal {path}: {exc}") from exc
        bad = None
        try:
            batch, used = decode_records(data)
        except ValueError:  # only now look for where the damage starts (the common path decodes once)
            bad = corrupt_offset(data) or 0
            batch, used = decode_records(data[:bad])
        position = offset + used
        if bad is not None:
            self._skip(name, position, size, f"corrupt record at byte {position}")
        elif position < size and offset + len(data) >= size:  # a partial record at the end of the file
            self._partial_tail(name, position, size, sealed)
        else:
            self._pending[name] = position
            self._partial.pop(name, None)
        return batch

    def _partial_tail(self, name: str, position: int, size: int, sealed: bool) -> None:
        self._pending[name] = position
        seen = self._partial.get(name)
        now = self.clock()
        if seen is None or seen[:2] != (position, size):
            self._partial[name] = seen = (position, size, now)
        if sealed:
            self._skip(name, position, size, "torn record at the end of a closed segment")
        elif now - seen[2] >= self.torn_after_s:
            self._skip(name, position, size, f"partial record not completed for {now - seen[2]:.0f} s")

    def _skip(self, name: str, position: int, size: int, why: str) -> None:
        self._skipped += 1
        self._pending[name] = size
        self._partial.pop(name, None)
        log.error("journal %s: %s; skipping %d bytes (counted as lost; the runtime's counters reconcile it)",
                  name, why, size - position)

    def state(self) -> dict[str, str]:
        """Resume positions covering every event returned so far; commit them with those events."""
        return {STATE_PREFIX + k: str(v) for k, v in self._pending.items()}

    def committed(self) -> None:
        """The store holds everything returned so far: delete segments that are consumed and done growing."""
        self.offsets.update(self._pending)
        now = self.clock()
        for name, path in list(self._sealed.items()):
            if self._delete_if_consumed(name, path):
                del self._sealed[name]
        for name, (runtime, path) in list(self._newest.items()):
            if now - self._final_checked.get(name, float("-inf")) < FINAL_CHECK_S:
                continue
            if self._consumed(name, path):
                self._final_checked[name] = now
                if runtime_finished(self.spool, runtime) and self._delete_if_consumed(name, path):
                    del self._newest[name]
                    self._final_checked.pop(name, None)

    def _consumed(self, name: str, path: pathlib.Path) -> bool:
        try:
            return self.offsets.get(name, 0) >= path.stat().st_size
        except OSError:
            return False

    def _delete_if_consumed(self, name: str, path: pathlib.Path) -> bool:
        """Delete ``path`` when every byte of it is committed; True when it is gone."""
        try:
            if self.offsets.get(name, 0) < path.stat().st_size:
                return False
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot delete consumed journal segment %s: %s", path, exc)
            return False
        self._pending.pop(name, None)
        self.offsets.pop(name, None)
        return True

    def lost(self) -> int:
        """Records skipped since this source started (torn or corrupt): their events are missing."""
        return self._skipped

    def close(self) -> None:
        pass
