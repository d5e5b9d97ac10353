"""Which processes gpu-defragd may signal: those of its own pod, never any other.

- :class:`PodCgroup` (in Kubernetes): a process belongs to the pod when its cgroup path lies
  under the pod's cgroup (the path segment naming ``pod<uid>``, from ``/proc/self/cgroup``).
  With ``shareProcessNamespace: true`` the server's processes are visible to the defragd
  container; NVML reports host PIDs, which only match local PIDs when both are the same
  namespace, so a PID that is not visible here is simply out of scope.
- :class:`ProcessTree`: a root PID and its descendants (standalone: the runtime's PID).
- :class:`PidAllowlist`: an explicit list (tests, unusual layouts).

``contains`` is asked again right before each signal, so a PID reused in between is not hit.
Being in scope is not enough to be signalled: :func:`catches_signal` must also say the process
installed a handler for the signal (SIGUSR1's default action is to terminate the process).
"""

from __future__ import annotations

import pathlib
import re
from typing import Iterable, Protocol

from .errors import DefragError

PROC = pathlib.Path("/proc")
# "pod<uid>" (cgroupfs driver) or "kubepods-<qos>-pod<uid>.slice" (systemd driver); not "kubepods"
_POD_SEGMENT = re.compile(r"(?:^|-)pod[0-9a-fA-F][0-9a-fA-F_-]*(?:\.slice)?$")


class PodScope(Protocol):
    def contains(self, pid: int) -> bool: ...
    def describe(self) -> str: ...


def catches_signal(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (the ``SigCgt`` mask of
    ``/proc/<pid>/status``; bit ``signum - 1``). False when the process is gone or unreadable."""
    try:
        with open(PROC / str(pid) / "status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _alive(pid: int) -> bool:
    return pid > 0 and (PROC / str(pid)).is_dir()


class PidAllowlist:
    def __init__(self, pids: Iterable[int]) -> None:
        self.pids = frozenset(int(p) for p in pids)

    def contains(self, pid: int) -> bool:
        return pid in self.pids and _alive(pid)

    def describe(self) -> str:
        return f"PIDs {sorted(self.pids)}"


def _parent(pid: int) -> int | None:
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[1])


class ProcessTree:
    def __init__(self, root: int) -> None:
        self.root = int(root)

    def contains(self, pid: int) -> bool:
        seen = set()
        while pid and pid not in seen:
            if pid == self.root:
                return True
            seen.add(pid)
            parent = _parent(pid)
            if parent is None:
                return False
            pid = parent
        return False

    def describe(self) -> str:
        return f"process tree of PID {self.root}"


def _cgroup_paths(pid: int | str) -> list[str]:
    try:
        lines = (PROC / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return []
    return [line.split(":", 2)[2] for line in lines if line.count(":") >= 2]


def pod_cgroup_of(paths: Iterable[str]) -> str | None:
    """The pod's cgroup path: the prefix up to and including the segment naming ``pod<uid>``."""
    for path in paths:
        segments = path.split("/")
        for i, segment in enumerate(segments):
            if _POD_SEGMENT.search(segment):
                return "/".join(segments[: i + 1])
    return None


class PodCgroup:
    def __init__(self, pod_cgroup: str | None = None) -> None:
        found = pod_cgroup or pod_cgroup_of(_cgroup_paths("self"))
        if not found:
            raise DefragError("not running in a Kubernetes pod (no pod cgroup in /proc/self/cgroup); "
                              "give --pod-root PID or --pod-pids to say which processes are ours")
        self.pod_cgroup = found

    def contains(self, pid: int) -> bool:
        return any(p == self.pod_cgroup or p.startswith(self.pod_cgroup + "/") for p in _cgroup_paths(pid))

    def describe(self) -> str:
        return f"pod cgroup {self.pod_cgroup}"
