"""The local cluster's processes: start one into the state file, wait while all live, stop them all.

Every process runs in its own session (so a whole group can be signalled) and outlives the command
that started it; ``state.json`` records each as a :class:`Component`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from typing import Callable, Iterable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as dead.
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclasses.dataclass
class Component:
    name: str
    pid: int
    port: int

    @property
    def alive(self) -> bool:
        return alive(self.pid)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def launch(state: dict, state_file: pathlib.Path, logs: pathlib.Path, name: str, args: list[str],
           port: int) -> subprocess.Popen:
    """Start ``args`` in its own session, logging to ``logs/<name>.log``, and record it in the state file."""
    logf = open(logs / f"{name}.log", "ab")
    # containerd's shims look for runc, kube-router and kube-proxy for iptables/ipset, on PATH.
    env = dict(os.environ, PATH=os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin",
                                                 "/sbin"]))
    proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, cwd=state_file.parent, env=env)
    logf.close()
    state["components"].append(dataclasses.asdict(Component(name, proc.pid, port)))
    state_file.write_text(json.dumps(state, indent=2))
    return proc


def wait(check: Callable[[], bool], timeout: float, what: str, components: Callable[[], list[Component]],
         error: Callable[[str], Exception]) -> None:
    """Poll ``check`` until it holds; ``error(message)`` is raised when a component exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [c.name for c in components() if not c.alive]
        if dead:
            raise error(f"{', '.join(dead)} exited while waiting for {what}")
        if check():
            return
        time.sleep(0.25)
    raise error(f"timed out after {timeout:.0f}s waiting for {what}")


def stop(components: list[Component], children: dict[int, subprocess.Popen]) -> None:
    """TERM every component's process group (last started first), KILL what lives after 10 s, and reap
    the ones that are children of this process (when up() and down() run in one) so no zombie stays."""
    for c in reversed(components):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while any(c.alive for c in components) and time.monotonic() < deadline:
        time.sleep(0.1)
    for c in components:
        if c.alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.pid, signal.SIGKILL)
    for c in components:
        child = children.pop(c.pid, None)
        if child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=5)


def log_tails(logs: Iterable[pathlib.Path]) -> str:
    """The last lines of each log, for the error of a start that failed."""
    parts = []
    for f in sorted(logs):
        lines = f.read_text(errors="replace").splitlines()[-6:]
        if lines:
            parts.append(f"--- {f.name} (last lines)\n" + "\n".join(lines))
    return "\n".join(parts)
