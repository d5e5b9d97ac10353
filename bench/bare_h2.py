"""The HTTP/2 floor: a bare python-hyper h2 server on uvloop that answers a fixed chat completion.

It does no work at all: no routing, no auth, no JSON parsing, no engine. Every request on
every stream gets ``FIXED_CHAT_COMPLETION`` once its body has ended. It is what the same
sans-IO protocol library (h2) and event loop (uvloop) that the zerolayer runtime uses cost
by themselves, so ``runtime req/s ÷ bare_h2 req/s`` is the share of the floor the runtime
keeps. ``--workers N`` runs N processes on one port with SO_REUSEPORT (the kernel spreads
connections across them), for bench/multicore.py. ``--stream-tokens N`` answers every request
with a server-sent-event stream instead: ``N`` OpenAI ``chat.completion.chunk`` events, each its own
DATA frame, then ``data: [DONE]`` (:func:`stream_events`), for bench/serving_cost.py's streaming shape.

    python bench/bare_h2.py --port 8181 [--workers 2] [--stream-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
from typing import Callable

import h2.config
import h2.connection
import h2.events
import h2.exceptions

FIXED_CHAT_COMPLETION_WORDS = ("zero layer stream token header tenant session priority deadline engine cache memory "
                               "node cluster quota budget").split()
# The shape and size of what the runtime's /v1/chat/completions answers for a 16-token synthetic reply.
FIXED_CHAT_COMPLETION = json.dumps({
    "id": "chatcmpl-0123456789abcdef0123456789abcdef", "object": "chat.completion", "created": 1767225600,
    "model": "synthetic",
    "choices": [{"index": 0, "finish_reason": "length", "message": {
        "role": "assistant",
        "content": " ".join(FIXED_CHAT_COMPLETION_WORDS)}}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 16, "total_tokens": 28},
}, separators=(",", ":")).encode()
RESPONSE_HEADERS = [(":status", "200"), ("content-type", "application/json"),
                    ("content-length", str(len(FIXED_CHAT_COMPLETION)))]
STREAM_HEADERS = [(":status", "200"), ("content-type", "text/event-stream"), ("cache-control", "no-cache")]


def stream_events(tokens: int) -> list[bytes]:
    """What a streamed chat completion of ``tokens`` one-word tokens sends, event by event: the shape
    and size of the runtime's OpenAI stream (one ``chat.completion.chunk`` per token, then ``[DONE]``)."""
    words = FIXED_CHAT_COMPLETION_WORDS
    events = []
    for i in range(tokens):
        chunk = {"id": "chatcmpl-0123456789abcdef0123456789abcdef", "object": "chat.completion.chunk",
                 "created": 1767225600, "model": "synthetic",
                 "choices": [{"index": 0, "delta": {"content": (" " if i else "") + words[i % len(words)]},
                              "logprobs": None, "finish_reason": None if i < tokens - 1 else "length"}]}
        events.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
    return events + [b"data: [DONE]\n\n"]


class BareH2(asyncio.Protocol):
    """One connection: h2 events in, the fixed answer (or event stream) out when a request's stream ends."""

    def __init__(self, events: list[bytes] | None = None) -> None:
        self.events = events
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
            elif isinstance(event, h2.events.StreamEnded) and self.events is not None:
                self.conn.send_headers(event.stream_id, STREAM_HEADERS)
                for piece in self.events[:-1]:
                    self.conn.send_data(event.stream_id, piece)
                self.conn.send_data(event.stream_id, self.events[-1], end_stream=True)
            elif isinstance(event, h2.events.StreamEnded):
                self.conn.send_headers(event.stream_id, RESPONSE_HEADERS)
                self.conn.send_data(event.stream_id, FIXED_CHAT_COMPLETION, end_stream=True)
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.transport.close()
        out = self.conn.data_to_send()
        if out:
            self.transport.write(out)


def serve(host: str, port: int, reuse_port: bool, stream_tokens: int = 0) -> None:
    events = stream_events(stream_tokens) if stream_tokens else None
    serve_protocol(lambda: BareH2(events), host, port, reuse_port)


def serve_protocol(factory: Callable[[], asyncio.Protocol], host: str, port: int, reuse_port: bool = False) -> None:
    """Serve ``factory``'s connections on uvloop until SIGTERM or SIGINT (bare_h2 and bare_h11 alike)."""
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(factory, host, port, reuse_port=reuse_port, backlog=1024)
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
    parser.add_argument("--stream-tokens", type=int, default=0,
                        help="answer with an SSE stream of this many chunk events (0: the fixed JSON)")
    args = parser.parse_args()
    if args.workers == 1:
        serve(args.host, args.port, reuse_port=False, stream_tokens=args.stream_tokens)
        return
    # Bind once in the parent first so a port conflict fails loudly, then let each worker bind its own socket.
    probe = socket.socket()
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    probe.bind((args.host, args.port))
    workers = [multiprocessing.Process(target=serve, args=(args.host, args.port, True, args.stream_tokens))
               for _ in range(args.workers)]
    for w in workers:
        w.start()
    probe.close()
    signal.signal(signal.SIGTERM, lambda *_: [os.kill(w.pid, signal.SIGTERM) for w in workers if w.pid])
    for w in workers:
        w.join()


if __name__ == "__main__":
    main()
