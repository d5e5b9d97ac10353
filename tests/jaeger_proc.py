"""A real Jaeger v2 process (``cmd/jaeger`` built from Go modules, zerolayer/cluster/build.py) for the
tracing tests: its OTLP/HTTP receiver takes the runtime's spans into in-memory storage, and the spans
are read back as Jaeger stored them, through its query API (``/api/v3/traces/{trace id}``)."""

from __future__ import annotations

import base64
import json
import pathlib
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest
import yaml

from tests.otlp_receiver import ReceivedSpan
from tests.prometheus_proc import free_port


# A span as Jaeger stored it: the same fields as one the in-process receiver decoded.
StoredSpan = ReceivedSpan


def jaeger_binary() -> pathlib.Path:
    """The cached Jaeger, built on first use (``scripts/setup.sh`` builds it ahead); skips the calling
    test, naming why, when it cannot be built (no Go toolchain, no module proxy)."""
    from zerolayer.cluster.build import BuildError, ensure_jaeger

    try:
        return ensure_jaeger().path("jaeger")
    except BuildError as exc:
        pytest.skip(f"Jaeger (the real OTLP receiver) cannot be built here: {str(exc)[:300]}")


def _hex(value: str) -> str:
    """An id as OTLP/JSON writes it (hex); base64, as protobuf's JSON mapping writes bytes, also accepted."""
    if not value:
        return ""
    try:
        int(value, 16)
        return value.lower()
    except ValueError:
        return base64.b64decode(value).hex()


def _value(any_value: dict[str, Any]) -> Any:
    (kind, value), = any_value.items()
    return int(value) if kind == "intValue" else value


def _spans(body: dict[str, Any]) -> Iterator[StoredSpan]:
    for resource_spans in body.get("result", {}).get("resourceSpans", []):
        resource = {a["key"]: _value(a["value"]) for a in resource_spans.get("resource", {}).get("attributes", [])}
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                yield StoredSpan(_hex(span["traceId"]), _hex(span["spanId"]), _hex(span.get("parentSpanId", "")),
                                 span["name"], int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"]),
                                 {a["key"]: _value(a["value"]) for a in span.get("attributes", [])},
                                 str(resource.get("service.name", "")))


class Jaeger:
    """``with Jaeger(tmp) as jaeger:`` runs Jaeger on free loopback ports; ``jaeger.endpoint`` is its
    OTLP/HTTP traces URL, :meth:`trace` reads a trace back from its storage."""

    def __init__(self, tmp: pathlib.Path) -> None:
        self.otlp_port, self.query_port, self.health_port = free_port(), free_port(), free_port()
        self.endpoint = f"http://127.0.0.1:{self.otlp_port}/v1/traces"
        config = {
            "service": {"extensions": ["jaeger_storage", "jaeger_query", "healthcheckv2"],
                        "pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["jaeger_storage_exporter"]}},
                        "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "info"}}},
            "extensions": {
                "jaeger_storage": {"backends": {"memory_store": {"memory": {"max_traces": 10000}}}},
                # enable_tracing (on by default) has Jaeger trace itself to localhost:4317: someone else's port
                "jaeger_query": {"storage": {"traces": "memory_store"}, "enable_tracing": False,
                                 "http": {"endpoint": f"127.0.0.1:{self.query_port}"},
                                 "grpc": {"endpoint": f"127.0.0.1:{free_port()}"}},
                "healthcheckv2": {"use_v2": True, "http": {"endpoint": f"127.0.0.1:{self.health_port}"}},
            },
            "receivers": {"otlp": {"protocols": {"http": {"endpoint": f"127.0.0.1:{self.otlp_port}"}}}},
            "exporters": {"jaeger_storage_exporter": {"trace_storage": "memory_store"}},
        }
        self._config = tmp / "jaeger.yaml"
        self._config.write_text(yaml.safe_dump(config))
        self._log_path = tmp / "jaeger.log"
        self._binary = jaeger_binary()
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> "Jaeger":
        self._log = open(self._log_path, "w")
        self._proc = subprocess.Popen([str(self._binary), "--config", str(self._config)], stdout=self._log,
                                      stderr=subprocess.STDOUT)
        stop = time.monotonic() + 60
        while self._get(f"http://127.0.0.1:{self.query_port}/api/v3/services") is None:
            assert self._proc.poll() is None, f"jaeger exited: {self._log_path.read_text()[-3000:]}"
            assert time.monotonic() < stop, f"jaeger not serving queries in 60 s: {self._log_path.read_text()[-3000:]}"
            time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=30)
        self._log.close()

    @staticmethod
    def _get(url: str) -> dict[str, Any] | None:
        """The JSON answer; None while not listening or for a 404 (a trace not stored yet)."""
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return dict(json.load(response))
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        except OSError:
            return None

    def trace(self, trace_id: str, count: int, timeout: float = 30.0) -> list[StoredSpan]:
        """The stored spans of ``trace_id`` once ``count`` of them are there (AssertionError after ``timeout``)."""
        stop = time.monotonic() + timeout
        while True:
            body = self._get(f"http://127.0.0.1:{self.query_port}/api/v3/traces/{trace_id}")
            found = [s for s in _spans(body or {}) if s.trace_id == trace_id]
            if len(found) >= count or time.monotonic() > stop:
                assert len(found) >= count, f"{len(found)} of {count} spans of trace {trace_id} stored: {found}"
                return found
            time.sleep(0.1)
