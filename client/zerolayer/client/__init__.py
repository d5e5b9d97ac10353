"""zerolayer.client: the SDK half of the zero-layer architecture.

Shaped like the official ``anthropic`` SDK::

    from zerolayer.client import Client

    client = Client(api_key="tenant-key", base_url="http://127.0.0.1:8080", priority="high")
    message = client.messages.create(model="tiny", max_tokens=64, messages=[{"role": "user", "content": "hi"}])

What it adds: the header contract on every request (fixed at construction), typed errors
for the runtime's vocabulary, error-code-driven retries under a retry budget, node choice
from the GPU map with session affinity, a per-node circuit breaker with a fallback
endpoint, and client-side latency reported back to the server. See docs/client.md.

Layering: this package imports ``zerolayer.contract`` and nothing from the runtime or
the operator.
"""

from zerolayer.contract import ErrorCode, Priority

from ._client import AsyncClient, AsyncMessageStream, Client, MessageStream
from .errors import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    DeadlineExceeded,
    GpuOom,
    InternalError,
    ModelUnavailable,
    NoNodeAvailable,
    PermissionDeniedError,
    RateLimitError,
    ResourceExhausted,
    StreamRefused,
    ZerolayerError,
)
from .events import CircuitClosed, CircuitHalfOpen, FallbackTriggered, RequestLatency, RetryScheduled
from .nodes import HashRing, HttpNodeMap, KubernetesNodeMap, Node, NodeMap, StaticNodeMap
from .retry import RetryBudget, RetryPolicy
from .routing import BreakerState, CircuitBreaker, Router
from .types import Message, StreamEvent

__all__ = [
    "APIConnectionError",
    "APIError",
    "APITimeoutError",
    "AsyncClient",
    "AsyncMessageStream",
    "AuthenticationError",
    "BadRequestError",
    "BreakerState",
    "CircuitBreaker",
    "CircuitClosed",
    "CircuitHalfOpen",
    "Client",
    "DeadlineExceeded",
    "ErrorCode",
    "FallbackTriggered",
    "GpuOom",
    "HashRing",
    "HttpNodeMap",
    "InternalError",
    "KubernetesNodeMap",
    "Message",
    "MessageStream",
    "ModelUnavailable",
    "NoNodeAvailable",
    "Node",
    "NodeMap",
    "PermissionDeniedError",
    "Priority",
    "RateLimitError",
    "RequestLatency",
    "ResourceExhausted",
    "RetryBudget",
    "RetryPolicy",
    "RetryScheduled",
    "Router",
    "StaticNodeMap",
    "StreamEvent",
    "StreamRefused",
    "ZerolayerError",
]
