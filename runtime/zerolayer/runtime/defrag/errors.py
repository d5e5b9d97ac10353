"""gpu-defragd's exception family."""

from __future__ import annotations


class DefragError(RuntimeError):
    """gpu-defragd cannot do what it was asked (no pod scope, a reset that failed, a bad setting)."""
