"""What the ``--api-processes`` tests share: a runtime process tree started from the CLI, a request on
a connection of its own, and the per-process chat counts of the merged metrics page."""

from __future__ import annotations

import hashlib
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx
import yaml

REPO = pathlib.Path(__file__).resolve().parents[3]
KEY = "sk-apiprocs-test"
BODY = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(tmp: pathlib.Path, engine: dict, port: int, sections: dict | None = None,
                 **tenant_limits: int) -> pathlib.Path:
    """A runtime config for one tenant (``acme``) with ``tenant_limits``; ``sections`` adds top-level
    sections (``server``, ``gpu``, ``scheduler``, ...)."""
    config = {"listen": {"host": "127.0.0.1", "port": port}, "engine": engine,
              "tenants": [{"name": "acme", "keys": [{"sha256": hashlib.sha256(KEY.encode()).hexdigest()}],
                           **tenant_limits}], **(sections or {})}
    path = tmp / "node.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class Node:
    """A ``zerolayer runtime`` process tree started from the CLI."""

    def __init__(self, config: pathlib.Path, port: int, processes: int, ready_s: float = 60) -> None:
        self.port, self.metrics_port = port, free_port()
        self._output: str | None = None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zerolayer.cli", "runtime", "--config", str(config),
             "--api-processes", str(processes), "--metrics-port", str(self.metrics_port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            if self.serving() >= processes:
                return
            time.sleep(0.5)
        raise AssertionError(f"{processes} API processes did not all serve in {ready_s} s:\n{self.output()}")

    def serving(self) -> int:
        """How many API processes answer the metrics page."""
        try:
            page = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        except httpx.HTTPError:
            return 0
        return len({line.split('api_process="')[1].split('"')[0] for line in page.splitlines()
                    if 'api_process="' in line and line.startswith("zerolayer_")})

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text

    def output(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        if self._output is None and self.proc.stdout is not None:
            self._output = self.proc.stdout.read()
            self.proc.stdout.close()
        return self._output or ""

    def children(self) -> list[tuple[int, str]]:
        out = subprocess.run(["ps", "-eo", "pid,ppid,comm"], capture_output=True, text=True).stdout
        rows = [line.split(None, 2) for line in out.splitlines()[1:]]
        return [(int(pid), comm) for pid, ppid, comm in rows if int(ppid) == self.proc.pid]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            self.output()


def post(url: str, body: dict = BODY) -> httpx.Response:
    """One request on a connection of its own (the kernel spreads connections, not requests)."""
    with httpx.Client(timeout=60) as client:
        return client.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"})


def serve_until_both(node: Node, body: dict = BODY) -> dict[str, float]:
    """Requests on new connections until both API processes have answered one; the chat counts then."""
    for _ in range(60):
        counts = chat_counts(node.metrics())
        if len(counts) == 2:
            return counts
        response = post(node.url, body)
        assert response.status_code == 200, response.text
    return chat_counts(node.metrics())


def per_process(page: str, family: str, *labels: str) -> dict[str, float]:
    """A counter's samples on the merged metrics page summed per ``api_process``, over the samples that
    carry every one of ``labels`` (``'route="chat"'``, ...)."""
    counts: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith(family + "{") and 'api_process="' in line and all(label in line for label in labels):
            index = line.split('api_process="')[1].split('"')[0]
            counts[index] = counts.get(index, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def chat_counts(page: str) -> dict[str, float]:
    """Chat requests answered 200, per API process."""
    return per_process(page, "zerolayer_requests_total", 'route="chat"', 'status="200"')


def connection_counts(page: str, protocol: str = "h2") -> dict[str, float]:
    """Connections each API process accepted (``zerolayer_connections_total``), by ``api_process``."""
    return per_process(page, "zerolayer_connections_total", f'protocol="{protocol}"')
