"""A real Prometheus process (Debian's ``prometheus``) for the observability tests: scrapes static
targets every second, evaluates rule files every second, answered through its HTTP API."""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from typing import Any

import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """One Prometheus process with its storage under ``tmp``; :meth:`stop` ends it."""

    def __init__(self, tmp: pathlib.Path, job: str, targets: list[str], labels: dict[str, str],
                 rules: pathlib.Path) -> None:
        """Scrape ``targets`` as ``job`` with the static ``labels`` (what a PodMonitor would add)."""
        self.port = free_port()
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(rules)],
                  "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets, "labels": labels}]}]}
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]

    def wait(self, what: str, check: Any, timeout: float = 60.0) -> Any:
        stop = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < stop:
            try:
                last = check()
            except OSError as exc:  # not listening yet
                last = exc
            else:
                if last:
                    return last
            time.sleep(0.5)
        raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r})")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()



    def firing(self, alert: str) -> list[dict[str, Any]]:
        return [a for a in self.api("alerts")["alerts"] if a["labels"]["alertname"] == alert and a["state"] == "firing"]
