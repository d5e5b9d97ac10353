"""Cost of one token event: ``TokenProbe.emit`` with the auditor detached, then attached.

Prints ns per call for: the bare C call with no probe site (``_probes.noop``), the USDT site
detached (``_probes.token``), ``TokenProbe.emit`` detached, and -- as root with bcc -- the same
two with a real auditor attached in its own process (kernel trap + ring buffer copy).

    python bench/audit_probe.py [--calls 200000]
"""

from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time


def per_call_ns(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter_ns()
        for i in range(calls):
            fn(i)
        best = min(best, (time.perf_counter_ns() - start) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    from zerolayer.bpf import _probes
    from zerolayer.bpf.probes import TokenProbe

    probe = TokenProbe()
    rows: list[tuple[str, float]] = []
    rows.append(("C call, no probe site", per_call_ns(lambda i: _probes.noop(7, i, "acme", "tiny", "msg_1", 0, 1, 0),
                                                      args.calls)))
    rows.append(("USDT site, detached", per_call_ns(lambda i: _probes.token(7, i, "acme", "tiny", "msg_1", 0, 1, 0),
                                                    args.calls)))
    rows.append(("TokenProbe.emit, detached", per_call_ns(lambda i: probe.emit("acme", "msg_1", "tiny", 0, 1),
                                                          args.calls)))
    try:
        from zerolayer.bpf.loader import check_kernel

        check_kernel()
    except Exception as exc:  # noqa: BLE001 - report why the attached rows are missing
        print(f"(attached rows skipped: {exc})")
    else:
        # A real auditor in its own process, metering only this one: the emitting process pays the trap only.
        with tempfile.TemporaryDirectory() as tmp:
            log = open(os.path.join(tmp, "auditor.log"), "w+b")
            auditor = subprocess.Popen([sys.executable, "-m", "zerolayer.cli", "auditor", "--source", "bpf",
                                        "--db", os.path.join(tmp, "a.db"), "--pid", str(os.getpid()),
                                        "--ring-buffer-mb", "64"], stdout=log, stderr=subprocess.STDOUT)
            while b"bpf mode" not in open(log.name, "rb").read():
                if auditor.poll() is not None:
                    raise SystemExit(open(log.name).read())
                time.sleep(0.1)
            rows.append(("USDT site, attached", per_call_ns(
                lambda i: _probes.token(7, i, "acme", "tiny", "msg_1", 0, 1, 0), args.calls)))
            rows.append(("TokenProbe.emit, attached", per_call_ns(lambda i: probe.emit("acme", "msg_1", "tiny", 0, 1),
                                                                  args.calls)))
            os.kill(auditor.pid, signal.SIGTERM)
            auditor.wait(60)
            log.close()
            con = sqlite3.connect(os.path.join(tmp, "a.db"))
            stored = con.execute("SELECT count(*) FROM token_events").fetchone()[0]
            lost = con.execute("SELECT value FROM auditor_state WHERE key='kernel_lost_total'").fetchone()[0]
            con.close()
            rows.append((f"(auditor stored {stored} events, kernel lost {lost}: emitting faster than it drains)",
                         float("nan")))
    base = rows[0][1]
    print(f"{'path':44} {'ns/call':>9} {'vs C call':>10}")
    for name, ns in rows:
        print(f"{name:44} {ns:9.0f} {ns / base:10.2f}x" if ns == ns else name)


if __name__ == "__main__":
    main()
