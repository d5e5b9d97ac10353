"""The gossip subsystem's exception family."""

from __future__ import annotations


class GossipError(RuntimeError):
    """Publishing the GPU map failed in a way the caller should know about."""


class KubeApiError(GossipError):
    """A Kubernetes API call failed; ``status`` is the HTTP status when the server answered."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
