"""The do-nothing backends the serving benches compare against; each answers bare_h2's fixed JSON.

* ``starlette_app`` — a trivial Starlette app (ASGI), served by uvicorn over HTTP/1.1
  (httptools parser, uvloop): the HTTP/1.1 floor of the Python ecosystem's usual stack.
* ``rsgi_app`` — the same answer on granian's native RSGI interface (Rust hyper core):
  ``granian --interface rsgi --http 2 floor_apps:rsgi_app``.
* ``rsgi_stream_app`` — the streamed answer of bare_h2's ``--stream-tokens`` on RSGI: one
  ``send_bytes`` per event, ``BENCH_STREAM_TOKENS`` events (default 64), for bench/serving_cost.py.
* ``rsgi_header_gate`` — for bench/granian_core.py's header-time admission check: refuses
  with 429 from the request's headers alone, never reading its body.

Every backend reads the request body before answering (as a server that parses the request
must), except the header gate, whose point is not to.
"""

from __future__ import annotations

import os
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bare_h2 import FIXED_CHAT_COMPLETION, STREAM_HEADERS, stream_events

JSON_HEADERS = [("content-type", "application/json")]


async def _chat(request: Request) -> Response:
    await request.body()
    return Response(FIXED_CHAT_COMPLETION, media_type="application/json")


starlette_app = Starlette(routes=[Route("/v1/chat/completions", _chat, methods=["POST"])])


async def rsgi_app(scope: Any, protocol: Any) -> None:
    await protocol()  # the whole body
    protocol.response_bytes(200, JSON_HEADERS, FIXED_CHAT_COMPLETION)


STREAM_EVENTS = stream_events(int(os.environ.get("BENCH_STREAM_TOKENS", "64")))
RSGI_STREAM_HEADERS = [h for h in STREAM_HEADERS if not h[0].startswith(":")]


async def rsgi_stream_app(scope: Any, protocol: Any) -> None:
    await protocol()
    transport = protocol.response_stream(200, RSGI_STREAM_HEADERS)
    for event in STREAM_EVENTS:
        await transport.send_bytes(event)


async def rsgi_header_gate(scope: Any, protocol: Any) -> None:
    """429 at once for requests carrying ``x-bench-refuse``, before a body byte is read; else 200."""
    if scope.headers.get("x-bench-refuse"):
        protocol.response_bytes(429, JSON_HEADERS, b'{"error":"refused at headers"}')
        return
    await protocol()
    protocol.response_bytes(200, JSON_HEADERS, FIXED_CHAT_COMPLETION)
