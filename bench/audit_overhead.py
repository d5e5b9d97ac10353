"""Auditor overhead and capacity, against named comparisons.

1. Runtime throughput with the auditor attached (BPF) against detached: output tokens per second
   the clients receive from a real ``zerolayer runtime`` (synthetic engine, no pacing), in
   rounds in ABBA order (detached, attached, attached, detached, ...) so that drift cancels. Target
   ratio >= 0.99. Note: on a small machine the auditor's own CPU competes with the runtime and the
   load generator; the ratio includes that.
2. Events per second the auditor sustains: emitter processes fire batches of 64 token events
   through the USDT probe as fast as they can for a few seconds while a real auditor (CLI, SQLite
   store) writes; compared with the emit rate. Loss at saturation is the kernel's counted
   ring-buffer drops, for two ring sizes. (With the runtime's 50 ms window an event carries all of
   a request's tokens of its window: a stream makes at most 20 events per second.)

    python bench/audit_overhead.py [--rounds 3] [--seconds 6] [--workers 16]

Needs root and bcc (bpf/setup-host.sh); writes bench/results/audit_overhead_<engine>[_pinned].txt.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import pathlib
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time

import httpx

HERE = pathlib.Path(__file__).parent
KEY = "sk-bench-audit"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PIN: dict[str, set[int]] = {}  # role -> CPUs, filled by --pin


def zerolayer(workdir: pathlib.Path, name: str, *args: str, role: str = "") -> subprocess.Popen[bytes]:
    log = open(workdir / f"{name}.log", "wb")
    cpus = PIN.get(role)
    try:
        return subprocess.Popen([sys.executable, "-m", "zerolayer.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    finally:
        log.close()


def wait_for(pred, what: str, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        return True
    except OSError:
        return False


def start_auditor(workdir: pathlib.Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    proc = zerolayer(workdir, name, "auditor", "--source", "bpf", *args, role="auditor")
    wait_for(lambda: "bpf mode" in (workdir / f"{name}.log").read_text(errors="replace") or proc.poll() is not None,
             "the auditor")
    if proc.poll() is not None:
        raise SystemExit((workdir / f"{name}.log").read_text())
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(60)


async def drive(port: int, seconds: float, workers: int, model: str = "synthetic") -> int:
    """Output tokens received by ``workers`` streaming clients in ``seconds`` (from the usage they report)."""
    received = 0
    body = {"model": model, "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    deadline = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal received
        async with httpx.AsyncClient(http1=False, http2=True, timeout=30) as client:
            while time.monotonic() < deadline:
                async with client.stream("POST", f"http://127.0.0.1:{port}/v1/messages", json=body,
                                         headers={"x-api-key": KEY}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and '"message_delta"' in line:
                            received += json.loads(line[6:])["usage"]["output_tokens"]

    await asyncio.gather(*(worker() for _ in range(workers)))
    return received


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (less sensitive to a noisy machine than throughput)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throughput(workdir: pathlib.Path, rounds: int, seconds: float, workers: int, engine: str,
               window_ms: float) -> list[str]:
    config = workdir / "runtime.json"
    model = "synthetic"
    spec: dict[str, object] = {"kind": "synthetic", "models": ["synthetic"], "output_tokens": 64}
    if engine == "vllm":
        model = "tiny-llama"
        spec = {"kind": "vllm", "model_path": str(workdir / "tiny-llama"), "generate_tiny_model": True,
                "served_name": model, "max_model_len": 512, "max_num_seqs": workers,
                "kv_cache_memory_bytes": 128 << 20, "enforce_eager": True, "dtype": "float32"}
    config.write_text(json.dumps({
        "listen": {"host": "127.0.0.1", "port": 0},
        "engine": spec,
        "tenants": [{"name": "bench", "keys": [{"sha256": hashlib.sha256(KEY.encode()).hexdigest()}]}]}))
    port = free_port()
    runtime = zerolayer(workdir, "runtime", "runtime", "--config", str(config), "--port", str(port),
                        "--audit-spool", str(workdir / "spool"), "--audit-window-ms", str(window_ms),
                        role="runtime")
    rates: dict[str, list[float]] = {"detached": [], "attached": []}
    cpu: dict[str, list[float]] = {"detached": [], "attached": []}  # runtime CPU microseconds per token
    auditor_cpu: list[float] = []
    try:
        wait_for(lambda: listening(port), "the runtime", 300)
        asyncio.run(drive(port, 2.0, workers, model))  # warm-up
        for i in range(rounds):
            # ABBA order (detached, attached, attached, detached, ...): a machine that drifts faster or
            # slower over the run (vLLM warms up for minutes) favours neither mode.
            for mode in (("detached", "attached") if i % 2 == 0 else ("attached", "detached")):
                auditor = start_auditor(workdir, f"auditor-{i}", "--db", str(workdir / "tp.db")) \
                    if mode == "attached" else None
                before = cpu_seconds(runtime.pid)
                audit_before = cpu_seconds(auditor.pid) if auditor is not None else 0.0
                tokens = asyncio.run(drive(port, seconds, workers, model))
                rates[mode].append(tokens / seconds)
                cpu[mode].append((cpu_seconds(runtime.pid) - before) * 1e6 / max(tokens, 1))
                if auditor is not None:
                    auditor_cpu.append((cpu_seconds(auditor.pid) - audit_before) * 1e6 / max(tokens, 1))
                    stop(auditor)
                print(f"  round {i + 1} {mode:9} {tokens / seconds:10.0f} tokens/s "
                      f"{cpu[mode][-1]:7.1f} runtime CPU us/token", flush=True)
    finally:
        stop(runtime)
    det, att = (sorted(rates[m])[rounds // 2] for m in ("detached", "attached"))  # medians
    # Each attached round against the detached round of the same ABBA pair: the machine's slow drifts cancel.
    paired = sorted(a / d for a, d in zip(rates["attached"], rates["detached"]))
    spread = f"paired ratios: median {paired[rounds // 2]:.3f}, range {paired[0]:.3f}-{paired[-1]:.3f}"
    cdet, catt = (sorted(cpu[m])[rounds // 2] for m in ("detached", "attached"))
    acpu = sorted(auditor_cpu)[rounds // 2]
    # What metering costs per token, from quantities this machine measures precisely: kernel traps per token
    # (every batch carries one kernel timestamp) times the cost of one trap, plus the auditor's CPU.
    con = sqlite3.connect(workdir / "tp.db")
    events, batches, out = con.execute("SELECT count(*), count(DISTINCT wall_ns), sum(output_tokens) "
                                       "FROM token_events").fetchone()
    con.close()
    trap = trap_ns(workdir)
    runtime_us = batches / max(out or 1, 1) * trap / 1000
    share = (runtime_us + acpu) / cdet
    cost = [f"{'metering cost per output token':40} {'':>12} {'':>12} {'us':>11} {'of runtime':>12}",
            f"{'  events per 1000 tokens':40} {1000 * events / max(out or 1, 1):12.1f}",
            f"{'  kernel traps per 1000 tokens':40} {1000 * batches / max(out or 1, 1):12.1f}",
            f"{f'  runtime: traps x {trap:.0f} ns':40} {'':12} {'':12} {runtime_us:11.3f} {runtime_us / cdet:12.2%}",
            f"{'  auditor process (all its CPU)':40} {'':12} {'':12} {acpu:11.3f} {acpu / cdet:12.2%}",
            f"{'  total; throughput ratio it allows':40} {1 / (1 + share):12.3f} {'':12} {runtime_us + acpu:11.3f} "
            f"{share:12.2%}"]
    return [f"{engine + ' runtime, median of ' + str(rounds) + ' rounds':40} {'tokens/s':>12} {'vs detached':>12} "
            f"{'CPU us/tok':>11} {'vs detached':>12}",
            f"{'auditor detached':40} {det:12.0f} {1.0:12.3f} {cdet:11.1f} {1.0:12.3f}",
            f"{'auditor attached (BPF)':40} {att:12.0f} {att / det:12.3f} {catt:11.1f} {catt / cdet:12.3f}",
            f"{'auditor process itself':40} {'':12} {'':12} {acpu:11.1f}",
            f"({spread})", "", *cost]


def trap_ns(workdir: pathlib.Path, calls: int = 20000) -> float:
    """ns one fired batch costs the runtime with an auditor attached, over the same call detached."""
    from zerolayer.bpf import _probes

    from zerolayer.bpf.probes import TokenProbe

    batch = _probes.Batch()
    batch.append(TokenProbe().runtime_id, 1, time.time_ns(), "bench", "synthetic", "msg_trap", 0, 1, 0)

    def per_fire() -> float:
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter_ns()
            for _ in range(calls):
                batch.fire()  # the same event again and again: the store keeps it once
            best = min(best, (time.perf_counter_ns() - start) / calls)
        return best

    detached = per_fire()
    auditor = start_auditor(workdir, "trap", "--db", str(workdir / "trap.db"), "--pid", str(os.getpid()))
    try:
        attached = per_fire()
    finally:
        stop(auditor)
    return attached - detached


EMITTER = """
import asyncio, sys, time
from zerolayer.bpf.probes import TokenProbe
# A saturated runtime: 64 streams, each with tokens in every batch; window 0 fires once per loop iteration.
probe = TokenProbe(window_s=0)
ids = [f"msg_{i:024x}" for i in range(64)]
sys.stdin.readline()  # go
async def run():
    n, end = 0, time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end:
        for rid in ids:
            probe.emit("bench", rid, "synthetic", 0, 1)
        n += len(ids)
        await asyncio.sleep(0)
    probe.close()
    return n
print(asyncio.run(run()))
"""


def capacity(workdir: pathlib.Path, seconds: float, emitters: int, ring_mb: float) -> str:
    db = workdir / f"cap-{ring_mb}.db"
    procs = [subprocess.Popen([sys.executable, "-c", EMITTER, str(seconds)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE) for _ in range(emitters)]
    pids = [a for p in procs for a in ("--pid", str(p.pid))]  # only our emitters, not other probe users
    auditor = start_auditor(workdir, f"cap-{ring_mb}", "--db", str(db), "--ring-buffer-mb", str(ring_mb), *pids)
    emitted = sum(int(p.communicate(b"go\n")[0]) for p in procs)
    stop(auditor)
    con = sqlite3.connect(db)
    written = con.execute("SELECT count(*) FROM token_events").fetchone()[0]
    lost = int(con.execute("SELECT value FROM auditor_state WHERE key='kernel_lost_total'").fetchone()[0])
    con.close()
    return (f"{f'ring {ring_mb:g} MiB, {emitters} emitters':40} {emitted / seconds:12.0f} {written / seconds:12.0f} "
            f"{lost:10d} {lost / emitted:9.2%} {emitted - written - lost:8d}")


def capacity_table(workdir: pathlib.Path, seconds: float, emitters: int) -> list[str]:
    lines = [f"{'auditor capacity (USDT flood)':40} {'emitted/s':>12} {'stored/s':>12} {'lost':>10} "
             f"{'lost %':>9} {'other':>8}"]
    for ring in (16.0, 0.25):
        lines.append(capacity(workdir, seconds, emitters, ring))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--emitters", type=int, default=2)
    parser.add_argument("--engine", choices=("synthetic", "vllm"), default="synthetic",
                        help="synthetic: no model cost, the harshest ratio; vllm: the real tiny model on CPU")
    parser.add_argument("--window-ms", type=float, default=50.0,
                        help="the runtime's metering window (--audit-window-ms; 50 is its default)")
    parser.add_argument("--skip-capacity", action="store_true")
    parser.add_argument("--pin", action="store_true",
                        help="runtime alone on CPU 0; clients and auditor on the other CPUs (the auditor's own "
                             "CPU then does not compete with the runtime: what the runtime itself pays)")
    args = parser.parse_args()
    if args.pin:
        others = set(range(1, os.cpu_count() or 2))
        PIN.update(runtime={0}, auditor=others)
        os.sched_setaffinity(0, others)  # the load generator
    from zerolayer.bpf.loader import check_kernel

    check_kernel()
    lines = [f"pinning: {'runtime on CPU 0, clients and auditor on the others' if args.pin else 'none'}; "
             f"{os.cpu_count()} CPUs; metering window {args.window_ms:g} ms; {args.workers} streams"]
    with tempfile.TemporaryDirectory(prefix="audit-bench-") as tmp:
        workdir = pathlib.Path(tmp)
        lines += throughput(workdir, args.rounds, args.seconds, args.workers, args.engine, args.window_ms)
        lines.append("")
    with tempfile.TemporaryDirectory(prefix="audit-bench-") as tmp:
        workdir = pathlib.Path(tmp)
        if args.skip_capacity:
            lines.append("(capacity skipped)")
        else:
            lines += capacity_table(workdir, args.seconds, args.emitters)
    text = "\n".join(lines)
    print(text)
    (HERE / "results").mkdir(exist_ok=True)
    name = f"audit_overhead_{args.engine}{'_pinned' if args.pin else ''}.txt"
    (HERE / "results" / name).write_text(text + "\n")


if __name__ == "__main__":
    main()
