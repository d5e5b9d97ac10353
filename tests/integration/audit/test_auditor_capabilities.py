"""Which capabilities the auditor's kernel path needs, proven one by one (issue 17).

The pod runs the auditor as uid 0 with ``capabilities: {drop: [ALL], add: AUDITOR_CAPABILITIES}``,
no privilege escalation, beside a server running as uid 65532 (operator/manifests.py). Here the
same: a real runtime as uid 65532, and the real ``zerolayer auditor --source=bpf`` as uid 0 whose
bounding, permitted and effective sets are exactly the tested set (``setpriv --bounding-set``; for
root, exec makes permitted = bounding, as a container runtime does), with ``--no-new-privs``. Each
run streams through the runtime and compares what the kernel path metered with what the clients
received. On this project's kernel the kernel path needs CAP_SYS_ADMIN (alone it suffices); the manifest
does not grant it, so the test also proves that under the manifest's set the pod's default
``audit.mode: auto`` still meters every token, from the runtime's journal.

The runtime keeps CAP_DAC_READ_SEARCH only so that uid 65532 can reach this machine's Python
(under a 0700 home); the auditor's ptrace checks against it are then decided by the uid
difference, as in the pod (the auditor holds that capability in every run where it matters).

This machine: cgroup v1 (so ``--pods-from-spool`` selects the runtime; ``--pod-uid`` needs v2) and
root lacks CAP_SYS_RESOURCE (docs/security.md says what that means for the result).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from audit_helpers import TENANTS, bpf_skip_reason, free_port, key, wait_for_port, write_config  # noqa: E402

from zerolayer.operator.manifests import AUDITOR_CAPABILITIES  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.bpf, pytest.mark.timeout(600)]
RUNTIME_UID = 65532
# Every capability the manifest has ever granted the auditor: the ones it still grants must each be
# needed, and the ones it dropped must stay unneeded.
# SYS_ADMIN: never granted, but on this kernel the USDT uprobe does not attach without it (see the report).
CANDIDATES = ("BPF", "PERFMON", "SYS_RESOURCE", "SYS_PTRACE", "DAC_READ_SEARCH", "SYS_ADMIN")
STREAMS = 6
TOKENS = 20


def bounding_set() -> set[str]:
    """Capabilities this process can hand on (root here lacks SYS_RESOURCE)."""
    status = pathlib.Path("/proc/self/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("CapBnd:")), 16)
    numbers = {"DAC_READ_SEARCH": 2, "SYS_PTRACE": 19, "SYS_ADMIN": 21, "SYS_RESOURCE": 24, "PERFMON": 38, "BPF": 39}
    return {name for name, bit in numbers.items() if mask >> bit & 1}


@dataclasses.dataclass
class Outcome:
    caps: tuple[str, ...]
    attached: bool
    metered: int  # output tokens booked from kernel events (not reconciled from counters)
    received: int
    error: str

    @property
    def works(self) -> bool:
        return self.attached and self.metered == self.received > 0


def setpriv(caps: tuple[str, ...], uid: int = 0, ambient: bool = False) -> list[str]:
    names = ",".join(f"+{c.lower()}" for c in caps)
    args = ["setpriv", "--no-new-privs", f"--bounding-set=-all{',' + names if names else ''}"]
    if uid:
        args += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    if ambient:
        args += [f"--inh-caps=-all,{names}", f"--ambient-caps=-all,{names}"]
    else:
        args += ["--inh-caps=-all"]
    return args + ["--"]


def run_with(caps: tuple[str, ...], workdir: pathlib.Path, source: str = "bpf") -> Outcome:
    """``source="auto"``: the pod's default; the runtime also journals, and ``metered`` counts what was
    booked from events of either path (kernel or journal), never from counters."""
    workdir.mkdir()
    spool, db, config = workdir / "spool", workdir / "audit.db", workdir / "runtime.json"
    spool.mkdir()
    os.chown(spool, RUNTIME_UID, RUNTIME_UID)  # the runtime writes its spool, as in the pod's emptyDir
    write_config(config, output_tokens=TOKENS, tokens_per_second=2000)
    os.chmod(config, 0o644)
    port = free_port()
    logs = {name: open(workdir / f"{name}.log", "wb") for name in ("auditor", "runtime")}
    auditor = subprocess.Popen(
        setpriv(caps) + [sys.executable, "-m", "zerolayer.cli", "auditor", f"--source={source}", f"--db={db}",
                         f"--spool={spool}", "--pids-from-spool", "--flush-interval=0.2", "--reconcile-interval=600"],
        stdout=logs["auditor"], stderr=subprocess.STDOUT, cwd=workdir)
    runtime = None
    received = 0
    try:
        deadline = time.monotonic() + 60
        while b" mode, store" not in (workdir / "auditor.log").read_bytes() and auditor.poll() is None:
            assert time.monotonic() < deadline, "auditor neither attached nor exited"
            time.sleep(0.1)
        if auditor.poll() is None:
            runtime = subprocess.Popen(
                setpriv(("DAC_READ_SEARCH",), uid=RUNTIME_UID, ambient=True)
                + [sys.executable, "-m", "zerolayer.cli", "runtime", "--config", str(config), "--port", str(port),
                   "--audit-spool", str(spool), "--audit-window-ms=0"]
                + (["--audit-journal"] if source == "auto" else []),
                stdout=logs["runtime"], stderr=subprocess.STDOUT, cwd="/tmp", env={**os.environ, "HOME": "/tmp"})
            wait_for_port(port, 60)
            time.sleep(1.0)  # the auditor finds the runtime's pid in the spool and attaches to it
            with httpx.Client(timeout=30) as client:
                for i in range(STREAMS):
                    tenant = TENANTS[i % len(TENANTS)]
                    response = client.post(f"http://127.0.0.1:{port}/v1/messages", headers={"x-api-key": key(tenant)},
                                           json={"model": "synthetic", "max_tokens": TOKENS, "messages": [
                                               {"role": "user", "content": "count me"}]})
                    assert response.status_code == 200, response.text
                    received += response.json()["usage"]["output_tokens"]
            time.sleep(1.0)  # two flush intervals
    finally:
        for proc in (runtime, auditor):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for log in logs.values():
            log.close()
    text = (workdir / "auditor.log").read_text(errors="replace")
    attached = "bpf mode" in text
    metered = 0
    if db.exists():
        with sqlite3.connect(db) as conn:
            metered = conn.execute("SELECT coalesce(sum(output_tokens), 0) FROM usage_minute").fetchone()[0]
    errors = [line for line in text.splitlines() if "rror" in line or "ermission" in line or "not permitted" in line]
    return Outcome(caps, attached, metered, received, errors[-1][:160] if errors else "")


def test_auditor_capabilities_kernel_path_and_fallback(tmp_path):
    if reason := bpf_skip_reason():
        pytest.skip(reason)
    available = bounding_set()
    manifest = tuple(c for c in AUDITOR_CAPABILITIES if c in available)
    runs = {"manifest": run_with(manifest, tmp_path / "manifest")}
    for cap in CANDIDATES:
        if cap in available:
            without = tuple(c for c in CANDIDATES if c != cap and c in available)
            runs[f"all but {cap}"] = run_with(without, tmp_path / f"without-{cap.lower()}")
    report = {name: dataclasses.asdict(o) | {"works": o.works} for name, o in runs.items()}
    (tmp_path / "capabilities.json").write_text(json.dumps(report, indent=2))
    print("\n" + "\n".join(f"{name:24} works={o.works!s:5} attached={o.attached!s:5} metered={o.metered}/{o.received} "
                           f"{o.error}" for name, o in runs.items()))
    # What the kernel path needs on this kernel: SYS_ADMIN alone attaches and meters every token, and
    # with it none of the others is needed. (The USDT probe has a semaphore; its uprobe does not
    # attach under BPF+PERFMON here: perf_event_open answers EACCES. A plain uprobe does.)
    if "SYS_ADMIN" in available:
        runs["SYS_ADMIN alone"] = alone = run_with(("SYS_ADMIN",), tmp_path / "sys-admin-alone")
        print(f"{'SYS_ADMIN alone':24} works={alone.works!s:5} attached={alone.attached!s:5} "
              f"metered={alone.metered}/{alone.received} {alone.error}")
        assert alone.works, ("the kernel path does not meter even with CAP_SYS_ADMIN", alone)
        assert not runs["all but SYS_ADMIN"].works, "the kernel path now attaches without SYS_ADMIN: " \
            "drop it from docs/security.md's evidence and re-check AUDITOR_CAPABILITIES"
    assert "SYS_ADMIN" not in AUDITOR_CAPABILITIES, "the auditor must not be granted CAP_SYS_ADMIN"
    if runs["manifest"].works:
        return
    # The manifest keeps the narrower set (docs/security.md, "Privileges"): where the kernel path cannot
    # attach with it, the pod's default audit.mode auto must still meter every token, from the journal.
    fallback = run_with(manifest, tmp_path / "manifest-auto", source="auto")
    print(f"{'manifest, source=auto':24} works={fallback.metered == fallback.received > 0!s:5} "
          f"metered={fallback.metered}/{fallback.received} {fallback.error}")
    assert fallback.metered == fallback.received > 0, ("auto does not meter under the manifest's set", fallback)
