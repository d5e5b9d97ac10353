"""Publishing tenants' key hashes: the fleet's one ``zl-tenant-keys`` Secret, written in batches.

Each TenantQuota owns one data entry (:func:`~.manifests.build_tenant_key_entry`); runtimes read the
Secret and never a tenant's own. The leader is the Secret's only writer, so the copy kept here stays
right between reads, and entries that arrive together go out in one merge patch.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Callable

from zerolayer.operator import manifests as m
from zerolayer.operator.kube import Kube

PUBLISHED_MAX_AGE = 300.0
PUBLISH_WINDOW = 1.0  # seconds key-hash entries wait for others to share one write (at most one write a second)


class KeyPublisher:
    """The published key-hash entries, as last read or written, and the batched writes of new ones."""

    def __init__(self, kube: Kube, namespace: str, now: Callable[[], datetime.datetime]):
        self.kube = kube
        self.namespace = namespace
        self.now = now
        self._keys: dict[str, dict] | None = None  # parsed entries by TenantQuota name
        self._raw: dict[str, str] = {}
        self._read_at: datetime.datetime | None = None
        self._pending: dict[str, str | None] = {}  # entries waiting for the next batched write
        self._flush: asyncio.Future | None = None
        self._write_lock = asyncio.Lock()

    def forget(self) -> None:
        """Read the Secret again at the next use (a full resync re-reads everything)."""
        self._keys = None

    async def published(self) -> dict[str, dict]:
        """The fleet's published key hashes by TenantQuota name, re-read at most every
        ``PUBLISHED_MAX_AGE`` seconds and at each full resync (1,000 TenantQuotas must not mean
        1,000 reads of one large Secret; the leader is its only writer, so our copy stays right)."""
        age = self.now() - self._read_at if self._read_at is not None else None
        if self._keys is None or age is None or age.total_seconds() > PUBLISHED_MAX_AGE:
            raw = await self.kube.read_published_keys(self.namespace)
            self._keys = {k: e for k, e in ((k, m.read_tenant_key_entry(v)) for k, v in raw.items()) if e is not None}
            self._raw = dict(raw)
            self._read_at = self.now()
        return self._keys

    async def publish(self, name: str, entry: str | None) -> None:
        """Set (or with None remove) one TenantQuota's entry; returns once it is written. Entries
        that arrive within ``PUBLISH_WINDOW`` of each other go out in one merge patch (1,000
        TenantQuotas created together cost a handful of writes, not 1,000)."""
        await self.published()
        if self._raw.get(name) == entry and name not in self._pending:
            return  # unchanged: a converged reconcile writes nothing
        self._pending[name] = entry
        if self._flush is None:
            self._flush = asyncio.ensure_future(self._flush_pending())
        # shield: one caller's cancellation must not cancel the write the others wait for
        await asyncio.shield(self._flush)

    async def _flush_pending(self) -> None:
        await asyncio.sleep(PUBLISH_WINDOW)
        # One write of the Secret at a time (group commit): concurrent merge patches of one object
        # make the API server retry them against each other. Entries that arrive while a write
        # is in flight gather in the next batch, which goes out when that write is done.
        async with self._write_lock:
            batch, self._pending, self._flush = self._pending, {}, None  # later entries: next batch
            await self.kube.publish_keys(self.namespace, batch)
        for name, entry in batch.items():
            if entry is None:
                self._raw.pop(name, None)
            else:
                self._raw[name] = entry
            if self._keys is not None:  # None: a resync dropped the copy, the next use re-reads it
                parsed = m.read_tenant_key_entry(entry) if entry is not None else None
                if parsed is None:
                    self._keys.pop(name, None)
                else:
                    self._keys[name] = parsed
