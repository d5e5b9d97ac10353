"""In-process cost of the two HTTP/2 cores: N complete request/response exchanges on one connection.

Each exchange: a HEADERS frame and a small DATA frame (END_STREAM) in, the gate (a trivial Accept),
``RequestReady`` out, then ``send_head`` + ``send_data(end=True)`` and ``data_to_send``. The client's
bytes are encoded once beforehand by a python-hyper h2 client (its cost is not measured) and the same
byte sequence is fed to each core. Prints µs per request for the Python core
(:class:`~zerolayer.runtime.protocol.h2conn.H2ServerCore`, python-hyper h2) and the native one
(:class:`~zerolayer.runtime.protocol.h2native.NativeH2ServerCore`, Rust h2), best of ``--rounds``.

    python3 bench/h2core_micro.py [--requests 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import h2.config
import h2.connection
from hyperframe.frame import SettingsFrame, WindowUpdateFrame

from zerolayer.runtime.limits import Limits
from zerolayer.runtime.protocol.events import Accept, RequestReady
from zerolayer.runtime.protocol.h2conn import H2ServerCore

BODY = b'{"model":"synthetic","max_tokens":8,"messages":[{"role":"user","content":"hello"}]}'
ANSWER = b'{"id":"msg_1","type":"message","content":[{"type":"text","text":"hi"}]}'
HEADERS = [(":method", "POST"), (":path", "/v1/messages"), (":scheme", "http"), (":authority", "node"),
           ("content-type", "application/json"), ("x-api-key", "sk-bench"), ("anthropic-version", "2023-06-01")]


def client_bytes(n: int) -> tuple[bytes, list[bytes]]:
    """The preface + SETTINGS, then each request's frames, as one client would send them."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.increment_flow_control_window(1 << 30)  # room for every response on the connection
    preface = client.data_to_send()
    # The server's SETTINGS and connection window (Limits' 1 MiB), as the cores send them.
    client.receive_data(SettingsFrame(0).serialize() + WindowUpdateFrame(0, window_increment=1 << 30).serialize())
    preface += client.data_to_send()  # the SETTINGS ACK
    requests = []
    for i in range(n):
        sid = 1 + 2 * i
        client.send_headers(sid, HEADERS + [("content-length", str(len(BODY)))])
        client.send_data(sid, BODY, end_stream=True)
        requests.append(client.data_to_send())
    return preface, requests


def run_once(core_cls: type, preface: bytes, requests: list[bytes]) -> float:
    limits = Limits(max_concurrent_streams=1000)
    accept = Accept(1 << 20, "ctx")
    core = core_cls(lambda head: accept, limits, clock=time.monotonic)
    core.receive(preface)
    core.data_to_send()
    started = time.perf_counter()
    sent = 0
    for data in requests:
        for event in core.receive(data):
            if isinstance(event, RequestReady):
                sid = event.head.stream_id
                core.send_head(sid, 200, [("content-type", "application/json")])
                core.send_data(sid, ANSWER, end=True)
        sent += len(core.data_to_send())
    elapsed = time.perf_counter() - started
    assert sent > len(requests) * len(ANSWER), "responses did not leave"
    assert not core.ended
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    preface, requests = client_bytes(args.requests)
    cores: dict[str, type] = {"python (h2conn, python-hyper h2)": H2ServerCore}
    try:
        from zerolayer.runtime.protocol.h2native import NativeH2ServerCore

        cores["native (h2native, Rust h2)"] = NativeH2ServerCore
    except ImportError as exc:
        print(f"native core not built: {exc}")
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, cls in cores.items():
            elapsed = run_once(cls, preface, requests)
            best[name] = min(best.get(name, elapsed), elapsed)
    print(f"{args.requests} request/response exchanges on one connection, in-process, best of {args.rounds}")
    print(f"{'core':36} {'µs/request':>11}")
    for name, elapsed in best.items():
        print(f"{name:36} {elapsed / args.requests * 1e6:11.1f}")
    if len(best) == 2:
        py, native = best.values()
        print(f"{'ratio python / native':36} {py / native:11.2f}x")


if __name__ == "__main__":
    main()
