"""Response objects: attribute views over the JSON the runtime returns.

Shaped like the official SDK's models where it matters to callers
(``message.content[0].text``, ``message.usage.output_tokens``, ``event.type``,
``event.delta.text``), without re-declaring the whole schema: unknown fields stay
reachable as attributes and ``to_dict()`` gives the JSON back.
"""

from __future__ import annotations

from typing import Any, Mapping


def _wrap(value: Any) -> Any:
    if isinstance(value, Mapping):
        return APIObject(value)
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


class APIObject:
    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_data", dict(data))

    def __getattr__(self, name: str) -> Any:
        try:
            return _wrap(self._data[name])
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}") from None

    def __getitem__(self, key: str) -> Any:
        return _wrap(self._data[key])

    def get(self, key: str, default: Any = None) -> Any:
        return _wrap(self._data.get(key, default))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("response objects are read-only")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, APIObject) and self._data == other._data

    def to_dict(self) -> dict[str, Any]:
        return dict(self._data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._data!r})"


class Message(APIObject):
    """A complete ``/v1/messages`` response. ``request_id`` / ``endpoint`` say where it came from."""

    __slots__ = ("request_id", "endpoint", "attempts")

    def __init__(self, data: Mapping[str, Any], *, request_id: str | None, endpoint: str, attempts: int) -> None:
        super().__init__(data)
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "endpoint", endpoint)
        object.__setattr__(self, "attempts", attempts)

    @property
    def text(self) -> str:
        """All text blocks joined (a convenience the official SDK lacks)."""
        return "".join(b.get("text", "") for b in self._data.get("content", []) if isinstance(b, Mapping))


class StreamEvent(APIObject):
    """One SSE event of a streamed message (``message_start``, ``content_block_delta``, ...)."""

    __slots__ = ()
