"""The HTTP/2 floor: a bare python-hyper h2 server on uvloop that answers a fixed chat completion.

It does no work at all: no routing, no auth, no JSON parsing, no engine. Every request on
every stream gets ``FIXED_CHAT_COMPLETION`` once its body has ended. It is what the same
sans-IO protocol library (h2) and event loop (uvloop) that the zerolayer runtime uses cost
by themselves, so ``runtime req/s ÷ bare_h2 req/s`` is the share of the floor the runtime
keeps. ``--workers N`` runs N processes on one port with SO_REUSEPORT (the kernel spreads
connections across them), for bench/multicore.py.

    python bench/bare_h2.py --port 8181 [--workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket

import h2.config
import h2.connection
import h2.events
import h2.exceptions

# The shape and size of what the runtime's /v1/chat/completions answers for a 16-token synthetic reply.
FIXED_CHAT_COMPLETION = json.dumps({
    "id": "chatcmpl-0123456789abcdef0123456789abcdef", "object": "chat.completion", "created": 1767225600,
    "model": "synthetic",
    "choices": [{"index": 0, "finish_reason": "length", "message": {
        "role": "assistant",
        "content": "zero layer stream token header tenant session priority deadline engine cache memory "
                   "node cluster quota budget"}}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 16, "total_tokens": 28},
}, separators=(",", ":")).encode()
RESPONSE_HEADERS = [(":status", "200"), ("content-type", "application/json"),
                    ("content-length", str(len(FIXED_CHAT_COMPLETION)))]


class BareH2(asyncio.Protocol):
    """One connection: h2 events in, the fixed answer out when a request's stream ends."""

    def __init__(self) -> None:
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport
        self.conn.initiate_connection()
        transport.write(self.conn.data_to_send())

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError:
            self.transport.write(self.conn.data_to_send())
            self.transport.close()
            return
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                # Give the window back so clients with large bodies are never stalled.
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                self.conn.send_headers(event.stream_id, RESPONSE_HEADERS)
                self.conn.send_data(event.stream_id, FIXED_CHAT_COMPLETION, end_stream=True)
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.transport.close()
        out = self.conn.data_to_send()
        if out:
            self.transport.write(out)


def serve(host: str, port: int, reuse_port: bool) -> None:
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(BareH2, host, port, reuse_port=reuse_port, backlog=1024)
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        async with server:
            await stop.wait()

    uvloop.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8181)
    parser.add_argument("--workers", type=int, default=1, help="processes sharing the port with SO_REUSEPORT")
    args = parser.parse_args()
    if args.workers == 1:
        serve(args.host, args.port, reuse_port=False)
        return
    # Bind once in the parent first so a port conflict fails loudly, then let each worker bind its own socket.
    probe = socket.socket()
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    probe.bind((args.host, args.port))
    workers = [multiprocessing.Process(target=serve, args=(args.host, args.port, True)) for _ in range(args.workers)]
    for w in workers:
        w.start()
    probe.close()
    signal.signal(signal.SIGTERM, lambda *_: [os.kill(w.pid, signal.SIGTERM) for w in workers if w.pid])
    for w in workers:
        w.join()


if __name__ == "__main__":
    main()
