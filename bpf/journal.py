"""The in-process path: tail the runtimes' journals (``<spool>/<runtime_id>.journal``).

Used where the kernel path cannot run (not root, no bcc, no uprobes). The runtime appends
each event with one ``os.write`` (:class:`~zerolayer.bpf.probes.TokenProbe` with
``journal=True``); this source reads what was appended since the last poll. Its resume
position per file is part of :meth:`state`, which the auditor commits in the same store
transaction as the events, so a restart resumes exactly where the store stops.
"""

from __future__ import annotations

import os
import pathlib
import time
from typing import Mapping

from zerolayer.bpf.errors import AuditError
from zerolayer.bpf.events import TokenEvent, decode_records

STATE_PREFIX = "journal:"
READ_CHUNK = 4 << 20


class JournalSource:
    kind = "journal"

    def __init__(self, spool: str | os.PathLike[str], resume: Mapping[str, str] | None = None,
                 drain_interval_s: float = 0.1) -> None:
        self.spool = pathlib.Path(spool)
        self.drain_interval_s = drain_interval_s
        try:
            self.spool.mkdir(parents=True, exist_ok=True)  # the auditor may start before any runtime
        except OSError as exc:
            raise AuditError(f"cannot use spool directory {self.spool}: {exc}") from exc
        self.offsets: dict[str, int] = {k[len(STATE_PREFIX):]: int(v) for k, v in (resume or {}).items()
                                        if k.startswith(STATE_PREFIX)}
        self._pending: dict[str, int] = {}

    def poll(self, timeout_ms: int = 100) -> list[TokenEvent]:
        """Sleeps ``min(timeout_ms, drain interval)``, then returns the events appended since the last call."""
        if timeout_ms > 0:
            time.sleep(min(timeout_ms / 1000, self.drain_interval_s))
        return self._read()

    def _read(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        for path in sorted(self.spool.glob("*.journal")):
            name = path.name
            offset = self._pending.get(name, self.offsets.get(name, 0))
            try:
                with path.open("rb") as f:
                    f.seek(offset)
                    data = f.read(READ_CHUNK)
            except OSError as exc:
                raise AuditError(f"cannot read journal {path}: {exc}") from exc
            if not data:
                continue
            try:
                batch, used = decode_records(data)
            except ValueError as exc:
                raise AuditError(f"{path}: {exc}") from exc
            events.extend(batch)
            self._pending[name] = offset + used
        return events

    def state(self) -> dict[str, str]:
        """Resume positions covering every event returned so far; commit them with those events."""
        return {STATE_PREFIX + k: str(v) for k, v in self._pending.items()}

    def committed(self) -> None:
        self.offsets.update(self._pending)

    def lost(self) -> int:
        return 0

    def close(self) -> None:
        pass
