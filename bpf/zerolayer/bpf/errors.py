"""The auditor's exception family: everything raised on purpose derives from :class:`AuditError`.

bcc, SQLite, ClickHouse and Kubernetes errors are converted where they enter our code.
"""

from __future__ import annotations


class AuditError(Exception):
    """Base of every error the audit subsystem raises on purpose."""


class BpfUnavailable(AuditError):
    """The kernel path cannot run here (not root, no bcc, no tracefs, no uprobes...): the reason says which."""


class StoreError(AuditError):
    """The audit store could not be opened, written or queried."""


class BillingError(AuditError):
    """Prices or energy settings are missing or invalid."""


class QuotaStatusError(AuditError):
    """TenantQuota status could not be read or written."""


class QuotaStatusConflict(QuotaStatusError):
    """A status patch's resourceVersion precondition failed: someone wrote the object in between."""


class CountersError(AuditError):
    """A runtime's counters snapshot is not a well-formed document: it is skipped, never trusted."""
