"""The runtime's exception family.

Everything the runtime raises on purpose derives from :class:`RuntimeServerError`;
errors from h2, h11, vLLM, YAML and the OS are converted where they enter our code.
:class:`RequestRefused` is special: it is how a request is answered with an error from
the wire contract (``zerolayer.contract.ERRORS``) rather than a crash.
"""

from __future__ import annotations

from typing import Mapping

from zerolayer.contract import ErrorCode


class RuntimeServerError(Exception):
    """Base of every error the runtime raises on purpose."""


class ConfigError(RuntimeServerError):
    """The runtime configuration (file, flags, environment) is invalid."""


class EngineError(RuntimeServerError):
    """The inference engine failed to start or to serve a request."""


class ConnectionFlood(RuntimeServerError):
    """A peer exceeded a hardening limit; the connection gets GOAWAY(ENHANCE_YOUR_CALM).

    ``limit`` names the setting in :class:`zerolayer.runtime.limits.Limits` (and the
    ``limit`` label of ``zerolayer_h2_limit_hits_total``).
    """

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


class RequestRefused(RuntimeServerError):
    """Answer this request with a contract error instead of a result.

    ``retry_after_s`` is sent as ``retry-after`` when the code is retryable; ``headers``
    (rate-limit headers, alternatives) are added to the error response.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        reason: str = "",
        retry_after_s: float | None = None,
        headers: Mapping[str, str] | None = None,
        http_status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or code.value.lower()
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})
        self.http_status = http_status  # overrides the contract's status (404, 405, 413)
