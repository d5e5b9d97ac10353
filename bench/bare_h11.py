"""The HTTP/1.1 floor: a bare python-hyper h11 server on uvloop that answers a fixed chat completion.

The HTTP/1.1 counterpart of bench/bare_h2.py: python-hyper's sans-IO HTTP/1.1 library (``h11``, the
one the runtime's Python core serves HTTP/1.1 with) on the same event loop, doing no work at all: no
routing, no auth, no JSON parsing, no engine. Every request gets ``FIXED_CHAT_COMPLETION`` (the same
bytes and headers as bare-h2's) once its body has ended; the connection is kept alive. So
``runtime HTTP/1.1 req/s ÷ bare_h11 req/s`` is the share of python-hyper's HTTP/1.1 floor the runtime
keeps, measured with the same client shape (bench/serving_floor.py: ``--h1 -c 128 -m 1``).
``--stream-tokens N`` answers with bare-h2's server-sent-event stream instead (:func:`stream_events`:
``N`` chunk events, then ``data: [DONE]``), each event one HTTP/1.1 chunk, as the runtime frames a
stream over HTTP/1.1: the floor of bench/serving_cost.py's HTTP/1.1 streaming shape.

    python bench/bare_h11.py --port 8182 [--stream-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio

import h11

from bare_h2 import FIXED_CHAT_COMPLETION, serve_protocol, stream_events

RESPONSE = h11.Response(status_code=200, reason=b"OK", headers=[
    ("content-type", "application/json"), ("content-length", str(len(FIXED_CHAT_COMPLETION)))])
BODY = h11.Data(data=FIXED_CHAT_COMPLETION)
# No content-length: h11 frames the body chunked, one chunk per Data event.
STREAM_RESPONSE = h11.Response(status_code=200, reason=b"OK", headers=[
    ("content-type", "text/event-stream"), ("cache-control", "no-cache")])


class BareH11(asyncio.Protocol):
    """One keep-alive connection: h11 events in, the fixed answer (or event stream) out when a request's
    body has ended."""

    def __init__(self, events: list[bytes] | None = None) -> None:
        self.conn = h11.Connection(h11.SERVER)
        self.transport: asyncio.Transport | None = None
        self.answer = [RESPONSE, BODY] if events is None else [STREAM_RESPONSE, *(h11.Data(data=e) for e in events)]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.conn.receive_data(data)
        out = []
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError:
                self.transport.close()
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                break
            if isinstance(event, h11.EndOfMessage):
                out += [self.conn.send(piece) for piece in self.answer]
                out.append(self.conn.send(h11.EndOfMessage()))
                if self.conn.our_state is h11.MUST_CLOSE:
                    break
                self.conn.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                break
        if out:
            self.transport.write(b"".join(out))  # type: ignore[arg-type]  # send() returns bytes here
        if self.conn.our_state is h11.MUST_CLOSE or self.conn.their_state is h11.CLOSED:
            self.transport.close()

    def eof_received(self) -> bool | None:
        self.conn.receive_data(b"")
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8182)
    parser.add_argument("--stream-tokens", type=int, default=0,
                        help="answer with an SSE stream of this many chunk events (0: the fixed JSON)")
    args = parser.parse_args()
    events = stream_events(args.stream_tokens) if args.stream_tokens else None
    serve_protocol(lambda: BareH11(events), args.host, args.port)


if __name__ == "__main__":
    main()
