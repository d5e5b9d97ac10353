"""Log lines as JSON objects (``--log-format json`` on ``zerolayer runtime`` and ``zerolayer operator``).

One object per line: ``time`` (UTC, RFC 3339 with milliseconds), ``level``, ``logger``, ``message``,
``exception`` when there is one, and, for a line written while the runtime serves a request, that
request's ``tenant``, ``request_id`` and ``trace_id`` (:func:`bind_request`; API keys never are).
The request fields live in a context variable: each request runs in its own asyncio task, which has
its own copy, so concurrent requests never see each other's.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
from typing import Any

FORMATS = ("text", "json")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_REQUEST: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("zerolayer_request", default=None)


def bind_request(**fields: str | None) -> None:
    """Add ``fields`` (None values left out) to the current task's request context."""
    current = _REQUEST.get()
    bound = {k: v for k, v in fields.items() if v is not None}
    _REQUEST.set({**current, **bound} if current else bound)  # a new dict: another task may hold the old one


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        moment = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        out: dict[str, Any] = {"time": moment.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        out.update(_REQUEST.get() or {})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure(level: str, fmt: str = "text") -> None:
    """The process's root logging: ``text`` (the default) or ``json`` lines on stderr. Like
    ``logging.basicConfig``, nothing changes when the root logger has handlers already (an embedding
    program's, a test runner's)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format: one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def use_json_everywhere() -> None:
    """Every handler on the root logger writes JSON (for processes whose framework installs its own
    handlers, as kopf does)."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(JsonFormatter())
