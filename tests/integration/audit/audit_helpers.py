"""Real processes for the audit tier: a runtime (zerolayer runtime), an auditor, streaming clients.

Every process is started from the ``zerolayer`` console command, killed with signals by pid, and
reaped by :class:`Processes` at the end of the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

TENANTS = ("acme", "globex", "initech")
MODEL = "synthetic"
SYNTHETIC_RATE = 400  # tokens per second per stream of the synthetic engine in these tests


def bpf_skip_reason() -> str | None:
    """Why the real BPF path cannot run here, or None."""
    from zerolayer.bpf.errors import BpfUnavailable
    from zerolayer.bpf.loader import check_kernel

    try:
        check_kernel()
    except BpfUnavailable as exc:
        return f"real BPF path unavailable: {exc} (CI runs bpf/setup-host.sh as root)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def key(tenant: str) -> str:
    return f"sk-{tenant}-audit"


VLLM_MODEL = "tiny-llama"


def vllm_skip_reason() -> str | None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "the real engine is not installed (pip install -e .[engine]; see DESIGN.md section 6)"
    return None


def write_config(path: pathlib.Path, *, engine_kind: str = "synthetic", output_tokens: int = 40,
                 tokens_per_second: float | None = SYNTHETIC_RATE, model_dir: pathlib.Path | None = None) -> str:
    """Write a runtime config for the three tenants; returns the served model name."""
    tenants = [{"name": t, "keys": [{"sha256": hashlib.sha256(key(t).encode()).hexdigest()}],
                "tokens_per_minute": 100_000_000, "requests_per_minute": 1_000_000,
                "max_concurrent_streams": 1000} for t in TENANTS]
    engine: dict[str, Any]
    if engine_kind == "vllm":
        assert model_dir is not None
        engine = {"kind": "vllm", "model_path": str(model_dir), "generate_tiny_model": True,
                  "served_name": VLLM_MODEL, "max_model_len": 512, "max_num_seqs": 8,
                  "kv_cache_memory_bytes": 64 << 20, "enforce_eager": True, "dtype": "float32"}  # CPU settings
        model = VLLM_MODEL
    else:
        engine = {"kind": "synthetic", "models": [MODEL], "output_tokens": output_tokens}
        if tokens_per_second:
            engine["tokens_per_second"] = tokens_per_second
        model = MODEL
    path.write_text(json.dumps({"listen": {"host": "127.0.0.1", "port": 0}, "engine": engine, "tenants": tenants}))
    return model


class Processes:
    def __init__(self, workdir: pathlib.Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """Start ``zerolayer *args``; its output goes to ``<name>.log`` (use a new name per start)."""
        log = open(self.workdir / f"{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "zerolayer.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                cwd=self.workdir)
        log.close()
        self.procs.append(proc)
        return proc

    @staticmethod
    def kill(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL, timeout: float = 30) -> int:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        return proc.wait(timeout)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                self.kill(proc)

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def auditor_starter(procs: Processes, source: str, spool: pathlib.Path, db: pathlib.Path) -> Any:
    """A function that starts one more auditor (``auditor-1``, ``auditor-2``, ...) on ``spool`` into ``db`` and
    returns its process once it reports its mode. bpf: only the pids this test's runtimes wrote to the spool."""
    args = ["auditor", "--source", source, "--db", str(db), "--spool", str(spool),
            "--flush-interval", "0.2", "--reconcile-interval", "1"]
    if source == "bpf":
        args.append("--pids-from-spool")  # only this test's runtimes, not other probe users
    starts = iter(range(1, 100))

    def start() -> subprocess.Popen[bytes]:
        name = f"auditor-{next(starts)}"
        proc = procs.start(name, *args)
        wait_for_line(procs, name, f"zerolayer auditor: {source} mode", proc)
        return proc

    return start


def wait_for_line(procs: Processes, name: str, needle: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while needle not in procs.log(name):
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited with {proc.returncode}:\n{procs.log(name)[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} did not print {needle!r}:\n{procs.log(name)[-3000:]}")
        time.sleep(0.05)


def wait_for_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}")


class Ledger:
    """What the clients saw: output tokens received per tenant, and how streams ended."""

    def __init__(self) -> None:
        self.received = {t: 0 for t in TENANTS}
        self.completed = 0
        self.broken = 0
        self.usage_mismatch = 0


async def stream_once(client: httpx.AsyncClient, base: str, tenant: str, ledger: Ledger, max_tokens: int,
                      model: str = MODEL) -> None:
    """One streamed Messages request.

    Counts each text delta as it arrives (one token for the synthetic engine); a stream that
    completes is then counted by the usage the server reports in ``message_delta`` (vLLM can
    produce a token with no text, which is metered but sends no delta).
    """
    body = {"model": model, "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": f"audit me {tenant}"}]}
    got = 0
    ended = False
    async with client.stream("POST", f"{base}/v1/messages", json=body,
                             headers={"x-api-key": key(tenant), "x-zerolayer-priority": "normal"}) as r:
        if r.status_code != 200:
            await r.aread()
            raise httpx.HTTPStatusError(f"status {r.status_code}", request=r.request, response=r)
        try:
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = json.loads(line[6:])
                if data.get("type") == "content_block_delta":
                    got += 1
                    ledger.received[tenant] += 1
                elif data.get("type") == "message_delta":
                    usage = data["usage"]["output_tokens"]
                    if usage != got:
                        ledger.usage_mismatch += 1
                        ledger.received[tenant] += usage - got
                elif data.get("type") == "message_stop":
                    ended = True
        except (httpx.TransportError, httpx.RemoteProtocolError):
            pass
        # A stream the runtime kill cut is broken however the transport reported it: an HTTP/2
        # connection that closes can end the body with no error, and counting that stream as
        # completed would leave its unmetered tail out of the kill's bound.
        if ended:
            ledger.completed += 1
        else:
            ledger.broken += 1


async def load(port_of: Any, ledger: Ledger, stop: asyncio.Event, *, workers_per_tenant: int = 4,
               max_tokens: int = 40, model: str = MODEL) -> None:
    """Concurrent streams from every tenant until ``stop``; survives the runtime going away."""

    async def worker(tenant: str) -> None:
        while not stop.is_set():
            base = f"http://127.0.0.1:{port_of()}"
            try:
                async with httpx.AsyncClient(http1=False, http2=True, timeout=30) as client:
                    while not stop.is_set():
                        await stream_once(client, base, tenant, ledger, max_tokens, model)
            except (httpx.TransportError, httpx.HTTPStatusError):
                await asyncio.sleep(0.1)  # runtime restarting

    await asyncio.gather(*(worker(t) for t in TENANTS for _ in range(workers_per_tenant)))
