"""The auditor's CPU per token event, by step: decoding a batch, and writing it to the SQLite store.

What the auditor pays per event is what bench/audit_overhead.py reports as "auditor process"; this
splits it. Events are shaped like a busy runtime's (3 tenants, 16 streams, one model), written in
flushes of ``--batch`` events (about half a second of tiny vLLM's events at the 50 ms window).
CPU time (user + system, so the store's fsync counts), best of three.

    python bench/audit_store.py [--events 60000] [--batch 300]
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

from zerolayer.bpf.events import decode_records, encode_record
from zerolayer.bpf.store import SqliteStore


def cpu_us_per_event(fn, events: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        fn()
        best = min(best, (time.process_time() - start) * 1e6 / events)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=60000)
    parser.add_argument("--batch", type=int, default=300)
    args = parser.parse_args()
    n, b = args.events, args.batch
    buffer = b"".join(encode_record(7, i + 1, time.time_ns(), ("acme", "globex", "initech")[i % 3], "tiny-llama",
                                    f"msg_{i % 16:024x}", 0, 7, 0) for i in range(n))
    events, _ = decode_records(buffer, wall_ns=time.time_ns(), source="bpf")
    decode = cpu_us_per_event(lambda: decode_records(buffer, wall_ns=time.time_ns(), source="bpf"), n)
    with tempfile.TemporaryDirectory() as tmp:
        runs = iter(range(10))

        def write() -> None:  # a fresh store each time: new events, not replays
            store = SqliteStore(pathlib.Path(tmp) / f"{next(runs)}.db")
            for i in range(0, n, b):
                store.write(events[i:i + b], {"journal:bench": str(i)})
            store.close()

        store = cpu_us_per_event(write, n)
    print(f"{'auditor step, CPU per event':40} {'us':>8}")
    print(f"{'decode (journal format, one batch)':40} {decode:8.2f}")
    print(f"{f'store write (SQLite WAL, {b} per flush)':40} {store:8.2f}")
    print(f"{'total':40} {decode + store:8.2f}")


if __name__ == "__main__":
    main()
