"""Issue 30: JSON log lines carry the request context of the task that writes them, and only that."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from zerolayer.logformat import JsonFormatter, bind_request, configure


def _line(message: str, exc: BaseException | None = None) -> dict:
    record = logging.LogRecord("zerolayer.x", logging.ERROR, __file__, 1, message, None,
                               (type(exc), exc, exc.__traceback__) if exc else None)
    return json.loads(JsonFormatter().format(record))


def test_concurrent_requests_never_see_each_others_context():
    async def request(tenant: str, started: asyncio.Event, other: asyncio.Event) -> dict:
        bind_request(tenant=tenant, request_id=f"req-{tenant}", trace_id=None)
        started.set()
        await other.wait()  # both tasks are bound before either writes
        return _line("serving")

    async def main() -> list[dict]:
        a, b = asyncio.Event(), asyncio.Event()
        return list(await asyncio.gather(request("acme", a, b), request("globex", b, a)))

    first, second = asyncio.run(main())
    assert (first["tenant"], first["request_id"]) == ("acme", "req-acme") and "trace_id" not in first
    assert (second["tenant"], second["request_id"]) == ("globex", "req-globex")
    assert "tenant" not in _line("outside any request")


def test_exceptions_are_one_field():
    try:
        raise ValueError("boom")
    except ValueError as exc:
        line = _line("failed", exc)
    assert line["message"] == "failed" and "ValueError: boom" in line["exception"]


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="one of text, json"):
        configure("INFO", "yaml")


def test_json_everywhere_reformats_handlers_a_framework_installed():
    root = logging.getLogger()
    handler = logging.StreamHandler()
    saved = [(h, h.formatter) for h in root.handlers]  # pytest's own handlers: given back as they were
    root.addHandler(handler)
    try:
        from zerolayer.logformat import use_json_everywhere

        use_json_everywhere()
        assert isinstance(handler.formatter, JsonFormatter)
    finally:
        root.removeHandler(handler)
        for h, formatter in saved:
            h.setFormatter(formatter)
