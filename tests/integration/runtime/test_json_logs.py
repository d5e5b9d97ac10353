"""Issue 30: ``--log-format json``: one JSON object per line, and a line written while a request is
served names its tenant and request id (never its key)."""

from __future__ import annotations

import io
import json
import logging
import pathlib
import subprocess
import sys
from typing import Any, AsyncIterator

import httpx
import pytest
import yaml
from runtime_helpers import KEY, chat_body, start_runtime

from zerolayer.logformat import JsonFormatter
from zerolayer.runtime.engine.synthetic import SyntheticEngine

pytestmark = pytest.mark.integration
REPO = pathlib.Path(__file__).resolve().parents[3]
log = logging.getLogger("tests.json_logs")


class TalkativeEngine(SyntheticEngine):
    """The synthetic engine, logging one line from inside each request it serves."""

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:  # type: ignore[override]
        log.warning("generating")
        async for delta in super().generate(*args, **kwargs):
            yield delta


@pytest.mark.asyncio(loop_scope="session")
async def test_a_line_written_inside_a_request_names_its_tenant_and_request_id():
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    log.addHandler(handler)
    try:
        async with start_runtime(engine=TalkativeEngine()) as server:
            async with httpx.AsyncClient(base_url=server.base_url) as http:
                answers = [await http.post("/v1/messages", content=chat_body(stream=False, max_tokens=4),
                                           headers={"x-api-key": KEY}) for _ in range(2)]
    finally:
        log.removeHandler(handler)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(line["message"], line["tenant"], line["request_id"]) for line in lines] == [
        ("generating", "acme", a.headers["x-request-id"]) for a in answers]
    assert KEY not in out.getvalue()
    assert lines[0]["level"] == "WARNING" and lines[0]["time"].endswith("Z")


def test_the_runtime_process_logs_json_lines(tmp_path):
    config = yaml.safe_load((REPO / "examples" / "standalone.yaml").read_text())
    config["listen"]["port"] = 0
    (tmp_path / "runtime.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "zerolayer.cli", "runtime", "--config", str(tmp_path / "runtime.yaml"),
                             "--log-format", "json"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        assert proc.stderr is not None
        first = json.loads(proc.stderr.readline())  # the start-up line, as JSON
    finally:
        proc.terminate()
        proc.communicate(timeout=30)  # drains and closes the pipe
    assert {"time", "level", "logger", "message"} <= set(first)
