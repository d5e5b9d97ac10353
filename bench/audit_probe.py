"""Cost of one token event: ``TokenProbe.emit`` with the auditor detached, then attached.

Prints ns per call for: the bare C call with no probe site (``_probes.noop``), the USDT site
detached (``_probes.token``), ``TokenProbe.emit`` detached, and -- as root with bcc -- the same
two with the BPF program attached (kernel trap + ring buffer copy; events drained by a thread).

    python bench/audit_probe.py [--calls 200000]
"""

from __future__ import annotations

import argparse
import threading
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
        from zerolayer.bpf.loader import BpfTokenSource, check_kernel

        check_kernel()
    except Exception as exc:  # noqa: BLE001 - report why the attached rows are missing
        print(f"(attached rows skipped: {exc})")
    else:
        source = BpfTokenSource(ring_buffer_bytes=64 << 20)
        received = [0]
        stop = threading.Event()

        def drain() -> None:
            while not stop.is_set():
                received[0] += len(source.poll(50))

        thread = threading.Thread(target=drain, daemon=True)
        thread.start()
        rows.append(("USDT site, attached", per_call_ns(
            lambda i: _probes.token(7, i, "acme", "tiny", "msg_1", 0, 1, 0), args.calls)))
        rows.append(("TokenProbe.emit, attached", per_call_ns(lambda i: probe.emit("acme", "msg_1", "tiny", 0, 1),
                                                              args.calls)))
        time.sleep(0.3)
        stop.set()
        thread.join()
        rows.append((f"(events received {received[0]}, lost in kernel {source.lost()})", float("nan")))
        source.close()
    base = rows[0][1]
    print(f"{'path':44} {'ns/call':>9} {'vs C call':>10}")
    for name, ns in rows:
        print(f"{name:44} {ns:9.0f} {ns / base:10.2f}x" if ns == ns else name)


if __name__ == "__main__":
    main()
