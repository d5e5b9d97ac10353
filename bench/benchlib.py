"""Shared pieces of the side-by-side serving benches (serving_floor, granian_core, multicore, vs_vllm_serve).

Each bench starts servers as separate processes, drives them with a C or vendor client, and
reads the servers' CPU time from ``/proc/<pid>/stat`` (the whole process tree: granian and
vLLM run worker processes) before and after the measured run. Nothing here asserts a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import IO, Any, Iterator, Sequence

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
KEY = "sk-bench"
# The request every floor bench sends: a small non-streaming OpenAI chat completion.
CHAT_BODY = json.dumps({"model": "synthetic", "max_tokens": 16,
                        "messages": [{"role": "user", "content": "what does a zero layer cost?"}]}).encode()
CHAT_PATH = "/v1/chat/completions"
REQUEST_HEADERS = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    """``pid`` and every descendant (granian workers, vLLM's engine core)."""
    parents: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [pid], list(parents.get(pid, ()))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(parents.get(child, ()))
    return out


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (a process that has exited counts 0)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / ticks


class CpuMeter:
    """CPU seconds a server's process tree spends between ``start()`` and ``stop()``.

    The tree is read at start (workers must be up by then: call it after a warm-up)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.pids: list[int] = []
        self.before = 0.0

    def start(self) -> None:
        self.pids = process_tree(self.pid)
        self.before = cpu_seconds(self.pids)

    def stop(self) -> float:
        return cpu_seconds(self.pids) - self.before


class SplitCpuMeter:
    """CPU seconds of a vLLM-backed server's tree between ``start()`` and ``stop()``, split in two: the
    engine (the processes vLLM titles ``VLLM::EngineCore...`` and ``VLLM::Worker...``, the engine core
    and the model executor's worker it starts; ``/proc/PID/comm`` keeps 15 bytes of a title) and the rest,
    the front end (API processes, their helpers). The front end is the part a serving layer changes;
    the engine core does the same model steps under any of them."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.groups: dict[str, list[int]] = {}
        self.before: dict[str, float] = {}

    @staticmethod
    def _is_engine(pid: int) -> bool:
        try:
            return pathlib.Path(f"/proc/{pid}/comm").read_text().startswith(("VLLM::EngineCor", "VLLM::Worker"))
        except OSError:
            return False

    def start(self) -> None:
        tree = process_tree(self.pid)
        engine = [p for p in tree if self._is_engine(p)]
        self.groups = {"engine": engine, "front": [p for p in tree if p not in engine]}
        self.before = {k: cpu_seconds(v) for k, v in self.groups.items()}

    def stop(self) -> dict[str, float]:
        return {k: cpu_seconds(v) - self.before[k] for k, v in self.groups.items()}


#: The scheduling priority of a load generator's session (``/proc/PID/autogroup``; see :func:`run_client`).
CLIENT_AUTOGROUP_NICE = -5


def _raise_session_priority() -> None:
    """``preexec_fn`` of :func:`run_client`, in the child after ``setsid``: its new session's autogroup nice."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(CLIENT_AUTOGROUP_NICE))
    except OSError:
        pass  # no autogroup (kernel.sched_autogroup_enabled=0) or no CAP_SYS_NICE: run_client reports the group


def run_client(cmd: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
               timeout: float = 1800, log: IO[str] | None = None) -> tuple[subprocess.CompletedProcess, str]:
    """Run a load generator to completion, in a session of its own whose scheduling group outranks the
    servers' (autogroup nice ``CLIENT_AUTOGROUP_NICE``); returns the finished process and its group as the
    kernel names it (``/autogroup-N nice -5``; ``unknown`` without autogroup).

    Why: with ``kernel.sched_autogroup_enabled`` (the default on most distributions) the scheduler shares
    CPU between *sessions* first. A server started in a session of its own (:func:`server`) with vLLM's
    engine core and worker busy in it has been seen, on 2 cores, to keep a client in another session waiting
    on the run queue for up to 2 s at a time (its ``/proc/PID/schedstat`` run delay: 1.9-2.7 s in 3.4-4.5 s
    runs). The client then reads every stream late at once, and the run measures the client's starvation,
    as a server "collapse" that moves from stack to stack. A client that outranks the servers takes the
    CPU it needs (about a third of a core for ``vllm bench serve`` at c=32) whichever server it drives.

    ``log``: an open file that takes the client's stdout and stderr together (the result's are then None)."""
    streams = (subprocess.PIPE, subprocess.PIPE) if log is None else (log, subprocess.STDOUT)
    proc = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=streams[0], stderr=streams[1], text=True,
                            start_new_session=True, preexec_fn=_raise_session_priority)
    try:  # Popen returns once the child has exec'd, so its preexec_fn has run
        group = pathlib.Path(f"/proc/{proc.pid}/autogroup").read_text().strip()
    except OSError:
        group = "unknown"
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err), group


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listening on {port} after {timeout:.0f}s")


@contextlib.contextmanager
def server(cmd: Sequence[str], port: int, *, env: dict[str, str] | None = None, timeout: float = 120.0,
           log: pathlib.Path | None = None) -> Iterator[subprocess.Popen]:
    """Run ``cmd`` in its own process group until the block ends; yields once ``port`` accepts."""
    out = open(log, "wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(list(cmd), env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=HERE)  # not the repo root: its zerolayer/ would
    # shadow a PYTHONPATH checkout (bench/runtime_at.py)
    try:
        wait_port(port, proc, timeout)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        if log:
            out.close()  # type: ignore[union-attr]


def runtime_config(port: int, engine: dict[str, Any] | None = None, *, quotas: bool = True,
                   **extra: Any) -> dict[str, Any]:
    """A standalone runtime config with auth, a tenant with quotas and the scheduler's admission on.

    The tenant's quotas are set far above what a bench sends, so they are checked on every
    request but never refuse one (a refusal would be credited as a cheap answer).
    ``quotas=False``: the same tenant with no rate or concurrency quota (auth and admission stay)."""
    limits = {"tokens_per_minute": 10**10, "requests_per_minute": 10**9, "max_concurrent_streams": 4096}
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "engine": engine or {"kind": "synthetic", "models": ["synthetic"]},
        "tenants": [{"name": "bench", "keys": [{"env": "BENCH_KEY"}], **(limits if quotas else {}),
                     "priorities": ["high", "normal", "low"]}],
        "gpu": {"source": "none"},
        **extra,
    }


def write_config(config: dict[str, Any]) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump(config, f)  # JSON is YAML
    return f.name


def runtime_cmd(config_path: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "zerolayer.cli", "runtime", "--config", config_path, "--log-level", "WARNING",
            *extra]


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def duration_s(text: str) -> float:
    """h2load's durations: ``345us``, ``1.23ms``, ``1.2s``."""
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text)


def h2load(url: str, *, n: int, clients: int, streams: int, http1: bool = False,
           body: bytes = CHAT_BODY, headers: dict[str, str] | None = None, pid: int | None = None,
           threads: int = 1, timeout: float = 600) -> dict[str, Any]:
    """One h2load run; returns req/s, latency percentiles (from its per-request log), failures and,
    with ``pid``, the server tree's CPU per answered request.

    Only 2xx answers count as done: a server that refuses under load is not credited for it."""
    binary = shutil.which("h2load")
    if binary is None:
        raise RuntimeError("h2load not found (apt-get install nghttp2-client)")
    headers = REQUEST_HEADERS if headers is None else headers
    with tempfile.TemporaryDirectory() as tmp:
        body_file = pathlib.Path(tmp, "body.json")
        body_file.write_bytes(body)
        log_file = pathlib.Path(tmp, "requests.log")
        cmd = [binary, "-n", str(n), "-c", str(clients), "-m", str(streams), "-t", str(threads),
               "-d", str(body_file), "--log-file", str(log_file)]
        if http1:
            cmd.append("--h1")
        for k, v in headers.items():
            cmd += ["-H", f"{k}: {v}"]
        cmd.append(url)
        meter = CpuMeter(pid) if pid else None
        if meter:
            meter.start()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        cpu = meter.stop() if meter else None
        out = done.stdout + done.stderr
        rows = [line.split("\t") for line in log_file.read_text().splitlines() if line.strip()]
    statuses: dict[str, int] = {}
    latencies = []
    for row in rows:
        statuses[row[1]] = statuses.get(row[1], 0) + 1
        if row[1].startswith("2"):
            latencies.append(int(row[2]) / 1000.0)  # µs -> ms
    finished = re.search(r"finished in ([\d.]+\w+),", out)
    if not finished or not latencies:
        raise RuntimeError(f"h2load failed ({' '.join(cmd)}):\n{out[-2000:]}")
    ok = len(latencies)
    elapsed = duration_s(finished.group(1))
    return {
        "requests": n, "ok": ok, "failed": n - ok, "statuses": statuses,
        "rps": ok / elapsed, "elapsed_s": elapsed,
        "p50_ms": statistics.median(latencies), "p99_ms": percentile(latencies, 0.99),
        "mean_ms": statistics.fmean(latencies),
        "server_cpu_s": cpu, "cpu_ms_per_req": (cpu * 1000 / ok) if cpu is not None else None,
        "command": " ".join(["h2load", *cmd[1:]]).replace(str(body_file), "body.json").replace(
            str(log_file), "requests.log"),
    }


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or not (a > 0 and b > 0):
        return "n/a"
    return f"{a / b:.2f}x"


def machine_line() -> str:
    return (f"{os.cpu_count()} CPUs shared with the load generator and with other engineers' work "
            f"(load average at the end: {os.getloadavg()[0]:.1f}); one run per row, read the ratios")


def save(name: str, text: str, data: Any, out: pathlib.Path = RESULTS) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.txt").write_text(text.rstrip() + "\n")
    (out / f"{name}.json").write_text(json.dumps(data, indent=2, default=str) + "\n")


def pyplot():  # type: ignore[no-untyped-def]
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bench_argv() -> str:
    """The command that made this result, as a user would type it from the repository root."""
    return " ".join(["python", f"bench/{pathlib.Path(sys.argv[0]).name}", *sys.argv[1:]])
