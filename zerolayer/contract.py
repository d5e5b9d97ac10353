"""The wire contract shared by the runtime (server) and the SDK (client).

This module is data only: header names, the error vocabulary and how each error
travels over HTTP/2. It imports nothing from the runtime, the operator or the
client, so both sides can depend on it without crossing layers.

docs/protocol.md renders these tables for people; tests check the two agree.
"""

from __future__ import annotations

import dataclasses
import enum

# --------------------------------------------------------------------------- headers
# Canonical names are ours (``x-zerolayer-*``). The reference design's names and the
# field's conventions are accepted as aliases; the first one present wins, in the
# order listed (canonical first).

SESSION = ("x-zerolayer-session", "x-anthropic-session", "x-session-id", "x-session-token")
PRIORITY = ("x-zerolayer-priority", "x-anthropic-priority")
MODEL_HINT = ("x-zerolayer-model-hint", "x-anthropic-model-hint")
OUTPUT_FORMAT = ("x-zerolayer-output-format", "x-anthropic-output-format")
# Deadline in nanoseconds: a value below DEADLINE_ABSOLUTE_THRESHOLD_NS is a relative
# budget from arrival (the reference's 150000000 = 150 ms); at or above it, an absolute
# Unix epoch time in nanoseconds. 10**17 ns is ~3.2 years as a budget and 1973 as a
# date, so no real value is ambiguous.
DEADLINE_NANOS = ("x-zerolayer-deadline-nanos", "x-anthropic-deadline-nanos")
DEADLINE_ABSOLUTE_THRESHOLD_NS = 10**17
# The longest deadline or TTFT budget a request may name: beyond it the value is a mistake (or an
# attempt to overflow the scheduler's arithmetic), answered 400.
MAX_DEADLINE_S = 86400.0
SLO_TTFT_MS = ("x-slo-ttft-ms",)  # time-to-first-token budget (Gateway API Inference Extension)
API_KEY = ("x-api-key",)  # or "authorization: Bearer <key>"
CLIENT_LATENCY = "x-zerolayer-client-latency"  # SDK's report of its previous request: "ttft_ms=..,total_ms=.."

# Response headers
ERROR_HEADER = "x-zerolayer-error"  # vocabulary code, on every error response
REQUEST_ID = "x-request-id"
ALTERNATIVES = "x-zerolayer-alternatives"  # comma-separated endpoints to try instead (pressure refusals)
RATELIMIT_HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)


class Priority(enum.IntEnum):
    """Priority classes; the value is what vLLM's priority scheduler sees (lower runs first)."""

    HIGH = 0
    NORMAL = 1
    LOW = 2

    @classmethod
    def parse(cls, value: str | int | None) -> "Priority":
        """Accept class names or numbers.

        Numbers follow vLLM's convention (lower = more urgent): ``<=0`` high, ``1`` normal,
        ``>=2`` low. Raises ValueError for anything else.
        """
        if value is None or value == "":
            return cls.NORMAL
        if isinstance(value, int) and not isinstance(value, bool):
            return cls.HIGH if value <= 0 else cls.NORMAL if value == 1 else cls.LOW
        text = str(value).strip().lower()
        try:
            return cls[text.upper()]
        except KeyError:
            pass
        try:
            return cls.parse(int(text))
        except ValueError:
            raise ValueError(f"unknown priority {value!r}: use high, normal, low or an integer") from None


# --------------------------------------------------------------------------- errors
class ErrorCode(str, enum.Enum):
    MODEL_UNAVAILABLE = "MODEL_UNAVAILABLE"
    GPU_OOM = "GPU_OOM"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    INTERNAL_ERROR = "INTERNAL_ERROR"
    # Not in the reference vocabulary but needed by every real client:
    INVALID_REQUEST = "INVALID_REQUEST"
    AUTHENTICATION = "AUTHENTICATION"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RATE_LIMITED = "RATE_LIMITED"


@dataclasses.dataclass(frozen=True)
class ErrorWire:
    """How one error code travels.

    ``http_status``: the status sent when the error happens before response headers.
    ``anthropic_type`` / ``openai_type``: the ``error.type`` in each API's JSON body.
    ``retryable``: whether a client may retry on its own (the server sends ``retry-after``).
    ``rst_code``: the RST_STREAM code sent after an SSE error event mid-stream.
    """

    http_status: int
    anthropic_type: str
    openai_type: str
    retryable: bool
    rst_code: int


# HTTP/2 error codes (RFC 9113 §7)
H2_NO_ERROR = 0x0
H2_INTERNAL_ERROR = 0x2
H2_REFUSED_STREAM = 0x7  # "not processed, safe to retry": only for work never started
H2_CANCEL = 0x8
H2_ENHANCE_YOUR_CALM = 0xB

ERRORS: dict[ErrorCode, ErrorWire] = {
    ErrorCode.MODEL_UNAVAILABLE: ErrorWire(503, "overloaded_error", "service_unavailable", True, H2_CANCEL),
    ErrorCode.GPU_OOM: ErrorWire(529, "overloaded_error", "service_unavailable", True, H2_CANCEL),
    ErrorCode.DEADLINE_EXCEEDED: ErrorWire(504, "timeout_error", "timeout", False, H2_CANCEL),
    ErrorCode.RESOURCE_EXHAUSTED: ErrorWire(529, "overloaded_error", "service_unavailable", True, H2_CANCEL),
    ErrorCode.INTERNAL_ERROR: ErrorWire(500, "api_error", "server_error", True, H2_INTERNAL_ERROR),
    ErrorCode.INVALID_REQUEST: ErrorWire(400, "invalid_request_error", "invalid_request_error", False, H2_CANCEL),
    ErrorCode.AUTHENTICATION: ErrorWire(401, "authentication_error", "authentication_error", False, H2_CANCEL),
    ErrorCode.PERMISSION_DENIED: ErrorWire(403, "permission_error", "permission_error", False, H2_CANCEL),
    ErrorCode.RATE_LIMITED: ErrorWire(429, "rate_limit_error", "rate_limit_exceeded", True, H2_CANCEL),
}
