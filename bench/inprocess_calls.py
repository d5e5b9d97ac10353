"""The runtime's cost per request with no socket and no load generator: what a request costs in Python.

The runtime (the floor bench's config: synthetic engine, API-key auth, a tenant with quotas, two-stage
admission) is built as ``zerolayer runtime`` builds it, and one of its HTTP/2 connections is fed the
bytes of a python-hyper h2 client, encoded beforehand: 16 non-streaming chat completions per read (the
floor bench's 16 streams per connection), the next read once all 16 are answered. ``--http1``: 16
HTTP/1.1 keep-alive connections instead, each read one request (the floor bench's HTTP/1.1 shape, one
request in flight per connection), the next round of reads once all 16 are answered. Prints µs of CPU
per request; ``--calls`` also runs it under cProfile and prints Python function calls per request and
the functions called most (cProfile slows everything several times: read its counts, not its times).

    python3 bench/inprocess_calls.py [-n 8000] [--http1] [--calls]

The client's encoding cost grows with the number of streams it has opened (python-hyper counts them on
each new one), so keep ``-n`` in the thousands.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import pstats
import time

import h2.config
import h2.connection
from hyperframe.frame import SettingsFrame, WindowUpdateFrame

import benchlib
from zerolayer.runtime.compose import build_server
from zerolayer.runtime.config import load_config
from zerolayer.runtime.serving.transport import Connection

IN_FLIGHT = 16
WARM_READS = 50


def client_reads(n: int) -> tuple[bytes, list[bytes]]:
    """The preface, then ``n`` requests (HEADERS + DATA with END_STREAM) in reads of :data:`IN_FLIGHT`."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.increment_flow_control_window(1 << 30)
    preface = client.data_to_send()
    client.receive_data(SettingsFrame(0).serialize() + WindowUpdateFrame(0, window_increment=1 << 30).serialize())
    preface += client.data_to_send()
    headers = [(":method", "POST"), (":path", benchlib.CHAT_PATH), (":scheme", "http"), (":authority", "node"),
               *benchlib.REQUEST_HEADERS.items(), ("content-length", str(len(benchlib.CHAT_BODY)))]
    requests = []
    for i in range(n):
        client.send_headers(1 + 2 * i, headers)
        client.send_data(1 + 2 * i, benchlib.CHAT_BODY, end_stream=True)
        requests.append(client.data_to_send())
    return preface, [b"".join(requests[i:i + IN_FLIGHT]) for i in range(0, n, IN_FLIGHT)]


def http1_request() -> bytes:
    """One request as h2load --h1 sends it (its own headers, then the bench's)."""
    fields = {"host": "node", "user-agent": "h2load nghttp2/1.52.0", **benchlib.REQUEST_HEADERS,
              "content-length": str(len(benchlib.CHAT_BODY))}
    head = f"POST {benchlib.CHAT_PATH} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items())
    return head.encode() + b"\r\n" + benchlib.CHAT_BODY


class _Transport:
    """The socket's side of asyncio's transport interface, counting what the runtime writes."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 50000) if name == "peername" else default

    def is_closing(self) -> bool:
        return False

    def can_write_eof(self) -> bool:
        return False

    def close(self) -> None:
        pass

    abort = close


async def measure(n: int, profile: cProfile.Profile | None, http1: bool = False) -> tuple[int, float, int]:
    """(requests measured, CPU seconds, bytes written) after :data:`WARM_READS` reads of warm-up."""
    os.environ["BENCH_KEY"] = benchlib.KEY
    path = benchlib.write_config(benchlib.runtime_config(0))
    try:
        server = build_server(load_config(path))
    finally:
        os.unlink(path)
    await server.start()
    transport = _Transport()
    if http1:
        conns = [Connection(server.context, False) for _ in range(IN_FLIGHT)]
        reads = [http1_request()] * (n // IN_FLIGHT)  # one round: each connection reads one request
    else:
        preface, reads = client_reads(n)
        conns = [Connection(server.context, False)]
    for conn in conns:
        conn.connection_made(transport)  # type: ignore[arg-type]
    if not http1:
        conns[0].data_received(preface)

    async def feed(chunks: list[bytes]) -> None:
        for chunk in chunks:
            for conn in conns:
                conn.data_received(chunk)
            while any(conn._tasks for conn in conns):  # every request of the round answered
                await asyncio.sleep(0)
            await asyncio.sleep(0)  # and the deferred flushes done

    await feed(reads[:WARM_READS])
    gc.collect()
    written = transport.written
    if profile is not None:
        profile.enable()
    started = time.process_time()
    await feed(reads[WARM_READS:])
    cpu = time.process_time() - started
    if profile is not None:
        profile.disable()
    await server.stop(0.1)
    return n - WARM_READS * IN_FLIGHT, cpu, transport.written - written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=8000, help="requests, warm-up included")
    parser.add_argument("--http1", action="store_true", help="HTTP/1.1 keep-alive connections instead of h2c")
    parser.add_argument("--calls", action="store_true", help="also count Python calls per request (cProfile)")
    args = parser.parse_args()
    if args.n <= (WARM_READS + 1) * IN_FLIGHT:
        parser.error(f"-n must be more than {(WARM_READS + 1) * IN_FLIGHT} (the warm-up)")
    import uvloop  # type: ignore[import-not-found]

    requests, cpu, written = uvloop.run(measure(args.n, None, args.http1))
    print(f"{requests} {'HTTP/1.1' if args.http1 else 'h2c'} requests in process, {IN_FLIGHT} in flight: "
          f"{cpu / requests * 1e6:.1f} µs of CPU per request, {written / requests:.0f} bytes written per request")
    if args.calls:
        profile = cProfile.Profile()
        requests, _, _ = uvloop.run(measure(args.n, profile, args.http1))
        stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
        calls = sum(row[1] for row in stats.values())
        print(f"under cProfile: {calls / requests:.0f} Python function calls per request; the most called:")
        for (file, line, name), row in sorted(stats.items(), key=lambda kv: -kv[1][1])[:15]:
            where = f"{file.rsplit('/', 1)[-1]}:{line}" if line else "builtin"
            print(f"  {row[1] / requests:6.1f}  {name} ({where})")
    print(f"command: python3 bench/inprocess_calls.py -n {args.n}{' --http1' if args.http1 else ''}"
          f"{' --calls' if args.calls else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
