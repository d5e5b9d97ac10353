"""The SDK's exception family.

Every error the SDK raises derives from :class:`ZerolayerError`. Errors the server
reported (by HTTP status, JSON body, ``x-zerolayer-error``, an SSE ``error`` event or an
RST_STREAM code) are :class:`APIError` subclasses, one per vocabulary entry of
:mod:`zerolayer.contract`; transport failures are :class:`APIConnectionError`. httpx and
h2 exceptions never escape: they are converted where they enter (``raise ... from exc``).

The names follow the official ``anthropic`` SDK where the meaning is the same
(``AuthenticationError``, ``PermissionDeniedError``, ``RateLimitError``,
``BadRequestError``, ``APIConnectionError``, ``APITimeoutError``), so ``except`` clauses
port over.

``processed`` says what the client knows about the work: ``False`` means the server
certainly never started it (REFUSED_STREAM, GOAWAY above the last stream id, a refused
connection, a refusal before admission), so it is safe to send again anywhere; ``None``
means unknown (a connection lost mid-request); ``True`` means it ran at least in part.
"""

from __future__ import annotations

from typing import Sequence, TypedDict

from zerolayer.contract import ErrorCode


class ZerolayerError(Exception):
    """Base of every exception raised by ``zerolayer.client``."""


class NoNodeAvailable(ZerolayerError):
    """Nothing can take the request: no node of the map is fresh and admitting (none to serve the
    model, nor to refuse it and record the demand for it) and no fallback endpoint is usable."""


class Origin(TypedDict):
    """Where an error arose, as keyword arguments of any :class:`APIError` (``**origin``)."""

    endpoint: str | None
    request_id: str | None
    tokens_delivered: int


class APIError(ZerolayerError):
    """An error reported by (or on the way to) a zerolayer runtime.

    Attributes:
        code: the vocabulary code, or ``None`` when the server gave none (e.g. a bare RST_STREAM).
        status_code: HTTP status, ``None`` when the error arrived mid-stream or as a reset.
        retry_after: seconds the server asked the client to wait, if it said.
        alternatives: endpoints the refusing node suggested instead (``x-zerolayer-alternatives``).
        endpoint: the endpoint that produced the error.
        request_id: the server's ``x-request-id``.
        processed: ``False`` certainly not started, ``None`` unknown, ``True`` started.
        tokens_delivered: output tokens the caller already received on this attempt (streams).
        body: the decoded JSON error body, if there was one.
        should_retry: the server's ``x-should-retry`` (``False``: retrying cannot help), ``None`` if absent.
    """

    code: ErrorCode | None = None

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode | None = None,
        status_code: int | None = None,
        retry_after: float | None = None,
        alternatives: Sequence[str] = (),
        endpoint: str | None = None,
        request_id: str | None = None,
        processed: bool | None = True,
        tokens_delivered: int = 0,
        body: object = None,
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.status_code = status_code
        self.retry_after = retry_after
        self.alternatives = tuple(alternatives)
        self.endpoint = endpoint
        self.request_id = request_id
        self.processed = processed
        self.tokens_delivered = tokens_delivered
        self.body = body
        self.should_retry = should_retry

    def __str__(self) -> str:
        parts = [self.message]
        if self.code is not None:
            parts.append(f"code={self.code.value}")
        if self.status_code is not None:
            parts.append(f"status={self.status_code}")
        if self.endpoint:
            parts.append(f"endpoint={self.endpoint}")
        return " ".join(parts) if len(parts) == 1 else f"{parts[0]} ({', '.join(parts[1:])})"


# --- one class per vocabulary entry ---------------------------------------------------
class ModelUnavailable(APIError):
    """The node does not serve (or cannot load now) the requested model."""

    code = ErrorCode.MODEL_UNAVAILABLE


class GpuOom(APIError):
    """The GPU ran out of memory for this request; a smaller ``max_tokens`` may fit."""

    code = ErrorCode.GPU_OOM


class DeadlineExceeded(APIError):
    """The request's deadline passed (or could not be met) on the server."""

    code = ErrorCode.DEADLINE_EXCEEDED


class ResourceExhausted(APIError):
    """The node is under pressure and refused (or preempted) the stream."""

    code = ErrorCode.RESOURCE_EXHAUSTED


class InternalError(APIError):
    """The node failed internally; counts toward the node's circuit breaker."""

    code = ErrorCode.INTERNAL_ERROR


class BadRequestError(APIError):
    """The request is malformed (missing mandatory header, bad body). Never retried."""

    code = ErrorCode.INVALID_REQUEST


class AuthenticationError(APIError):
    """The API key is missing or unknown."""

    code = ErrorCode.AUTHENTICATION


class PermissionDeniedError(APIError):
    """The tenant may not use this model or priority."""

    code = ErrorCode.PERMISSION_DENIED


class RateLimitError(APIError):
    """The tenant's quota is spent; ``retry_after`` says when it refills."""

    code = ErrorCode.RATE_LIMITED


class StreamRefused(APIError):
    """RST_STREAM(REFUSED_STREAM): the server did no work on this stream; safe to retry anywhere."""


class APIConnectionError(APIError):
    """The connection failed (refused, reset, closed mid-response). ``processed`` says what is known."""


class APITimeoutError(APIConnectionError):
    """The client-side timeout expired before the response completed."""


ERROR_CLASSES: dict[ErrorCode, type[APIError]] = {
    cls.code: cls
    for cls in (
        ModelUnavailable,
        GpuOom,
        DeadlineExceeded,
        ResourceExhausted,
        InternalError,
        BadRequestError,
        AuthenticationError,
        PermissionDeniedError,
        RateLimitError,
    )
}
assert set(ERROR_CLASSES) == set(ErrorCode), "every vocabulary entry needs an exception class"


def error_class(code: ErrorCode | None) -> type[APIError]:
    """The exception class for a vocabulary code (``APIError`` for ``None``)."""
    return ERROR_CLASSES.get(code, APIError) if code is not None else APIError
