"""The client half of the wire contract, with no I/O.

- :class:`RequestContract`: what the SDK sends on every request (fixed at construction).
- :func:`error_from_response` / :func:`error_from_sse` / :func:`error_from_reset`: turn
  what a runtime sent back into the SDK's typed errors.
- :class:`SSEDecoder`: server-sent events from text lines.

Everything here works on plain strings, bytes and mappings so it is table-testable.
"""

from __future__ import annotations

import dataclasses
import email.utils
import json
import time
import uuid
from typing import Any, Mapping

from zerolayer import contract
from zerolayer.contract import ErrorCode, Priority

from . import errors

# Header names a caller may not set per request: the contract is fixed at construction.
PROTECTED_HEADERS = frozenset(
    name.lower()
    for name in (
        *contract.SESSION,
        *contract.PRIORITY,
        *contract.MODEL_HINT,
        *contract.OUTPUT_FORMAT,
        *contract.DEADLINE_NANOS,
        *contract.SLO_TTFT_MS,
        *contract.API_KEY,
        "authorization",
        contract.CLIENT_LATENCY,
    )
)
# Keyword arguments that look like a per-request override of the contract.
PROTECTED_PARAMS = frozenset(
    {"api_key", "priority", "session", "session_id", "model_hint", "output_format", "deadline", "deadline_ns"}
)
OUTPUT_FORMATS = ("text", "json")


@dataclasses.dataclass(frozen=True)
class RequestContract:
    """The header contract one client sends on every request.

    ``deadline_s`` is a relative budget per attempt, sent as nanoseconds below
    ``contract.DEADLINE_ABSOLUTE_THRESHOLD_NS`` so the server reads it as relative.
    ``model_hint=None`` sends the request's own ``model`` as the hint.
    """

    api_key: str = dataclasses.field(repr=False)  # never in logs, tracebacks or debuggers
    priority: Priority = Priority.NORMAL
    session: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    model_hint: str | None = None
    output_format: str = "text"
    deadline_s: float | None = 60.0

    def __post_init__(self) -> None:
        if not self.api_key:
            raise ValueError("api_key is required: the runtime authenticates every tenant")
        object.__setattr__(self, "priority", Priority.parse(self.priority))
        if not self.session or any(c in self.session for c in "\r\n,"):
            raise ValueError(f"session must be a non-empty header-safe token, got {self.session!r}")
        if self.output_format not in OUTPUT_FORMATS:
            raise ValueError(f"output_format must be one of {OUTPUT_FORMATS}, got {self.output_format!r}")
        if self.deadline_s is not None and not 0 < self.deadline_s <= contract.MAX_DEADLINE_S:
            raise ValueError(f"deadline must be a positive relative budget of at most {contract.MAX_DEADLINE_S:g} "
                             f"seconds (the runtime refuses longer ones), got {self.deadline_s!r}")

    def headers(self, *, model: str, model_hint: str | None = None, deadline_s: float | None = None) -> dict[str, str]:
        """Headers for one attempt. ``model_hint`` / ``deadline_s`` are the retry policy's adjustments."""
        hint = model_hint or self.model_hint or model
        deadline = deadline_s if deadline_s is not None else self.deadline_s
        out = {
            contract.API_KEY[0]: self.api_key,
            contract.PRIORITY[0]: self.priority.name.lower(),
            contract.SESSION[0]: self.session,
            contract.MODEL_HINT[0]: hint,
            contract.OUTPUT_FORMAT[0]: self.output_format,
        }
        if deadline is not None:
            out[contract.DEADLINE_NANOS[0]] = str(int(deadline * 1e9))
        return out


def check_no_override(params: Mapping[str, Any], extra_headers: Mapping[str, str] | None) -> None:
    """Raise ValueError if a request tries to change the contract fixed at construction."""
    bad = sorted(PROTECTED_PARAMS & set(params))
    bad += sorted(h for h in (extra_headers or {}) if h.lower() in PROTECTED_HEADERS)
    if bad:
        raise ValueError(
            f"{', '.join(bad)} is fixed when the client is constructed and cannot be overridden per request; "
            "use client.with_options(...) to derive a client with a different contract"
        )


# --------------------------------------------------------------------------- decoding errors
_STATUS_CODES: dict[int, ErrorCode] = {
    400: ErrorCode.INVALID_REQUEST,
    401: ErrorCode.AUTHENTICATION,
    403: ErrorCode.PERMISSION_DENIED,
    429: ErrorCode.RATE_LIMITED,
    500: ErrorCode.INTERNAL_ERROR,
    503: ErrorCode.MODEL_UNAVAILABLE,
    504: ErrorCode.DEADLINE_EXCEEDED,
    529: ErrorCode.RESOURCE_EXHAUSTED,  # also GPU_OOM; only x-zerolayer-error or the body tells them apart
}
# error.type in an Anthropic-shaped body, for servers that send no code of ours.
_ANTHROPIC_TYPES: dict[str, ErrorCode] = {
    "invalid_request_error": ErrorCode.INVALID_REQUEST,
    "authentication_error": ErrorCode.AUTHENTICATION,
    "permission_error": ErrorCode.PERMISSION_DENIED,
    "rate_limit_error": ErrorCode.RATE_LIMITED,
    "rate_limit_exceeded": ErrorCode.RATE_LIMITED,
    "api_error": ErrorCode.INTERNAL_ERROR,
    "server_error": ErrorCode.INTERNAL_ERROR,
    "timeout_error": ErrorCode.DEADLINE_EXCEEDED,
    "timeout": ErrorCode.DEADLINE_EXCEEDED,
    "overloaded_error": ErrorCode.RESOURCE_EXHAUSTED,
    "service_unavailable": ErrorCode.RESOURCE_EXHAUSTED,
}
# Codes the server sends only for work it refused before starting it.
_REFUSAL_CODES = frozenset(
    {
        ErrorCode.INVALID_REQUEST,
        ErrorCode.AUTHENTICATION,
        ErrorCode.PERMISSION_DENIED,
        ErrorCode.RATE_LIMITED,
        ErrorCode.MODEL_UNAVAILABLE,
        ErrorCode.RESOURCE_EXHAUSTED,
    }
)


def parse_code(value: object) -> ErrorCode | None:
    """A vocabulary code from a header/body value, ``None`` if it is not one."""
    if not isinstance(value, str):
        return None
    try:
        return ErrorCode(value.strip().upper())
    except ValueError:
        return None


def parse_retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms``, or ``retry-after`` (seconds or an HTTP date)."""
    lower = {k.lower(): v for k, v in headers.items()}
    ms = lower.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = lower.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def parse_alternatives(headers: Mapping[str, str]) -> tuple[str, ...]:
    lower = {k.lower(): v for k, v in headers.items()}
    raw = lower.get(contract.ALTERNATIVES, "")
    return tuple(a.strip().rstrip("/") for a in raw.split(",") if a.strip())


def _error_object(body: object) -> dict:
    """The ``error`` object of an Anthropic- or OpenAI-shaped body (``{}`` if absent)."""
    if isinstance(body, dict):
        inner = body.get("error")
        if isinstance(inner, dict):
            return inner
    return {}


def _code_from_error_object(obj: Mapping[str, Any]) -> ErrorCode | None:
    for key in ("code", "zerolayer_code"):
        code = parse_code(obj.get(key))
        if code is not None:
            return code
    return _ANTHROPIC_TYPES.get(str(obj.get("type", "")))


def error_from_response(
    status: int, headers: Mapping[str, str], body: bytes | str, *, endpoint: str | None = None
) -> errors.APIError:
    """Decode an error response sent before any output (status >= 400).

    The code comes from ``x-zerolayer-error`` first (a standard-client-readable header),
    then ``error.code`` in the JSON body, then ``error.type``, then the status alone.
    """
    lower = {k.lower(): v for k, v in headers.items()}
    try:
        decoded: object = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        decoded = None
    obj = _error_object(decoded)
    code = parse_code(lower.get(contract.ERROR_HEADER)) or _code_from_error_object(obj)
    if status == 503 and code == ErrorCode.RESOURCE_EXHAUSTED and contract.ERROR_HEADER not in lower:
        code = ErrorCode.MODEL_UNAVAILABLE  # a bare "overloaded" 503 is the model-unavailable status
    if code is None:
        code = _STATUS_CODES.get(status) or (ErrorCode.INTERNAL_ERROR if status >= 500 else None)
    message = str(obj.get("message") or "") or (body.decode(errors="replace") if isinstance(body, bytes) else body)
    message = message.strip() or f"HTTP {status}"
    return errors.error_class(code)(
        message,
        code=code,
        status_code=status,
        retry_after=parse_retry_after(lower),
        alternatives=parse_alternatives(lower),
        endpoint=endpoint,
        request_id=lower.get(contract.REQUEST_ID),
        processed=False if code in _REFUSAL_CODES else True,
        body=decoded,
        should_retry=parse_should_retry(lower),
    )


def parse_should_retry(headers: Mapping[str, str]) -> bool | None:
    """The server's ``x-should-retry`` (both official SDKs obey it too); None when absent."""
    value = {k.lower(): v for k, v in headers.items()}.get("x-should-retry", "").strip().lower()
    return {"true": True, "false": False}.get(value)


def error_from_sse(
    data: str, *, endpoint: str | None = None, request_id: str | None = None, tokens_delivered: int = 0
) -> errors.APIError:
    """Decode an SSE ``error`` event's data (the stream had already started)."""
    try:
        decoded: object = json.loads(data)
    except ValueError:
        decoded = None
    obj = _error_object(decoded)
    code = _code_from_error_object(obj) or ErrorCode.INTERNAL_ERROR
    retry_after = obj.get("retry_after")
    return errors.error_class(code)(
        str(obj.get("message") or data or "stream failed"),
        code=code,
        retry_after=float(retry_after) if isinstance(retry_after, (int, float)) else None,
        alternatives=tuple(obj.get("alternatives") or ()),
        endpoint=endpoint,
        request_id=request_id,
        processed=True,
        tokens_delivered=tokens_delivered,
        body=decoded,
    )


def error_from_reset(
    h2_code: int, *, endpoint: str | None = None, request_id: str | None = None, tokens_delivered: int = 0
) -> errors.APIError:
    """Decode an RST_STREAM (or GOAWAY) error code received for our stream."""
    common = errors.Origin(endpoint=endpoint, request_id=request_id, tokens_delivered=tokens_delivered)
    if h2_code == contract.H2_REFUSED_STREAM:
        return errors.StreamRefused("stream refused before any work (REFUSED_STREAM)", processed=False, **common)
    if h2_code == contract.H2_INTERNAL_ERROR:
        return errors.InternalError(
            "stream reset by the server (INTERNAL_ERROR)", code=ErrorCode.INTERNAL_ERROR, **common
        )
    if h2_code == contract.H2_ENHANCE_YOUR_CALM:
        return errors.RateLimitError("stream reset: ENHANCE_YOUR_CALM", code=ErrorCode.RATE_LIMITED, **common)
    return errors.APIError(f"stream reset by the server (HTTP/2 error code {h2_code:#x})", **common)


# --------------------------------------------------------------------------- SSE
@dataclasses.dataclass(frozen=True)
class ServerSentEvent:
    event: str
    data: str

    def json(self) -> Any:
        return json.loads(self.data)


class SSEDecoder:
    """Feed lines (without their newline), get complete events (per the WHATWG rules we need)."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []

    def feed(self, line: str) -> ServerSentEvent | None:
        if line == "":
            if not self._data and not self._event:
                return None
            sse = ServerSentEvent(self._event or "message", "\n".join(self._data))
            self._event, self._data = "", []
            return sse
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None


def latency_header(ttft_s: float | None, total_s: float, request_id: str | None = None) -> str:
    """The ``x-zerolayer-client-latency`` value reporting one finished request."""
    parts = []
    if request_id:
        parts.append(f"request_id={request_id}")
    if ttft_s is not None:
        parts.append(f"ttft_ms={ttft_s * 1000:.1f}")
    parts.append(f"total_ms={total_s * 1000:.1f}")
    return ",".join(parts)
