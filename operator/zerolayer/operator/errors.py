"""The operator's exception family.

Everything the operator raises derives from :class:`OperatorError`. Errors from the
Kubernetes client are converted where they enter our code (in :mod:`.kube`), so the
rest of the operator never sees ``ApiException``.
"""

from __future__ import annotations


class OperatorError(RuntimeError):
    """Base of every error the operator raises."""


class ConfigError(OperatorError):
    """The operator's own settings (flags, environment) are invalid."""


class SpecError(OperatorError):
    """A custom resource's spec is invalid in a way only a person can fix (no retry helps)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


class WaitingFor(OperatorError):
    """A dependency outside the operator is missing or still moving; retry after ``delay`` seconds
    (kopf ``TemporaryError``). The status says what is awaited."""

    def __init__(self, message: str, delay: float):
        self.delay = delay
        super().__init__(message)


class KubeError(OperatorError):
    """A Kubernetes API call failed.

    ``status`` is the HTTP status (0 when no response came back), ``reason`` the API's
    machine-readable reason (``NotFound``, ``AlreadyExists``, ``Conflict``, ``Forbidden``...).
    """

    def __init__(self, message: str, *, status: int = 0, reason: str = ""):
        self.status = status
        self.reason = reason
        super().__init__(message)

    @property
    def retryable(self) -> bool:
        """Whether trying again later can succeed without a person's help."""
        return self.status in (0, 409, 429) or self.status >= 500


class NotFound(KubeError):
    """The object does not exist (HTTP 404)."""


class Conflict(KubeError):
    """The object exists already or changed under us (HTTP 409)."""


class NotOwned(KubeError):
    """A child of ours by name is controlled by another object (two owners map to one child name).

    Raised by ``Kube.ensure`` instead of adopting it: the operator never patches or deletes it."""

    def __init__(self, message: str, controller: str):
        self.controller = controller
        super().__init__(message, status=409, reason="NotOwned")
