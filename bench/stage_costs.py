"""Where a request's microseconds go: the runtime's stages timed one by one, beside the whole request.

Each stage of a non-streaming chat completion (the floor bench's request: synthetic engine, a tenant
with quotas, two-stage admission) is run alone in a loop, and the whole request is run in process
over HTTP/1.1 and h2c (bench/inprocess_calls.py: the runtime as ``zerolayer runtime`` builds it, fed
a client's bytes, no socket). Prints µs of CPU per request for each: the best of ``--rounds`` rounds of
``-n`` calls (the stages), the median of ``--rounds`` runs (the whole request). The stages do not add
up to the whole: what joins them (the session, the gate's authentication and contract, the task per
request and its coroutines, the transport, metrics, logging context) is the last row, the whole HTTP/1.1
request less the stages it runs (the h11, bare-h11 and no-quota rows are for comparison, not part of it).

  HTTP/1.1 core cycle   the compiled HTTP/1.1 core (llhttp) reading the request and writing the answer
  h11 core cycle        the same with the python core (h11), the protocol the HTTP/1.1 floor runs
  bare-h11 cycle        the HTTP/1.1 floor's own request (bench/bare_h11.py's data_received: h11 reads
                        the request and writes the fixed answer), no socket: what a request costs
                        with no work at all
  scheduler             admit at HEADERS + admit at body + settle, with the tenant's quotas
  scheduler, no quotas  the same for a tenant with no rate or concurrency quota
  request JSON          the OpenAI body parsed into a ChatRequest
  prompt                the synthetic engine's chat template and token count
  prefix record         the served prompt recorded for the gossiped prefix digest
  generate              the synthetic engine's 16-token answer, as a whole completion
  answer JSON           the chat.completion body written

    python3 bench/stage_costs.py [-n 20000] [--rounds 5] [--name stage_costs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable, Coroutine

import benchlib
import inprocess_calls
from zerolayer.contract import Priority
from zerolayer.runtime.api.common import Assembler
from zerolayer.runtime.api.openai_wire import OpenAIWire
from zerolayer.runtime.api.wire import StreamFrame
from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.protocol.events import Accept, RequestReady
from zerolayer.runtime.protocol.h1conn import H1ServerCore
from zerolayer.runtime.protocol.h1native import NativeH1ServerCore
from zerolayer.runtime.scheduler.api import TenantPolicy, Ticket
from zerolayer.runtime.scheduler.config import SchedulerConfig
from zerolayer.runtime.scheduler.core import MicroScheduler

# What the runtime answers the bench's request with (its response head's fields, the body's size).
RESPONSE_FIELDS = [("content-type", "application/json"), ("x-request-id", "chatcmpl_0123456789abcdef01234567"),
                   ("x-ratelimit-limit-requests", "1000000000"), ("x-ratelimit-remaining-requests", "999999999"),
                   ("x-ratelimit-reset-requests", "1m0s"), ("x-ratelimit-limit-tokens", "10000000000"),
                   ("x-ratelimit-remaining-tokens", "9999999999"), ("x-ratelimit-reset-tokens", "1m0s"),
                   ("content-length", "480")]
RESPONSE_BODY = b"y" * 480
LIMITS = {"tokens_per_minute": 10**10, "requests_per_minute": 10**9, "max_concurrent_streams": 4096}


def best_us(call: Callable[[], Any], n: int, rounds: int) -> float:
    """µs of CPU per call: the best of ``rounds`` rounds of ``n`` calls."""
    times = []
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(n):
            call()
        times.append((time.process_time() - started) / n)
    return min(times) * 1e6


def core_cycle(cls: type) -> Callable[[], None]:
    core = cls(lambda head: Accept(1 << 20, None))
    raw = inprocess_calls.http1_request()

    def cycle() -> None:
        sid = next(e.head.stream_id for e in core.receive(raw) if isinstance(e, RequestReady))
        core.send_head(sid, 200, RESPONSE_FIELDS)
        core.send_data(sid, RESPONSE_BODY, end=True)
        core.data_to_send()
        core.resume()
    return cycle


def bare_h11_cycle() -> Callable[[], None]:
    from bare_h11 import BareH11

    floor = BareH11()
    floor.connection_made(inprocess_calls._Transport())  # type: ignore[arg-type]
    raw = inprocess_calls.http1_request()
    return lambda: floor.data_received(raw)


def scheduler_pair(quotas: bool) -> Callable[[], None]:
    scheduler = MicroScheduler(SchedulerConfig())
    scheduler.set_tenants({"bench": TenantPolicy("bench", **(LIMITS if quotas else {}))})
    count = iter(range(1 << 62))

    def pair() -> None:
        now = time.monotonic()
        ticket = Ticket(f"1/{next(count)}", "bench", Priority.NORMAL, "synthetic", 23, 0, None, None, now)
        scheduler.admit(ticket, now)
        body = scheduler.admit(ticket.sized("synthetic", Priority.NORMAL, 9, 16), time.monotonic(), stage="body")
        assert body.reservation is not None
        scheduler.settle(body.reservation, 25, time.monotonic())
    return pair


def drive(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends (the synthetic engine's, unpaced) to its end, without a loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the coroutine suspended: it needs an event loop")


def engine_stages(n: int, rounds: int) -> dict[str, float]:
    """The request's JSON, its prompt, the prefix record, the answer and its JSON: each alone."""
    engine, wire = SyntheticEngine(), OpenAIWire()
    drive(engine.start())
    request = wire.parse(benchlib.CHAT_BODY)
    options = request.sampling_options()
    render = lambda: drive(engine.render(request.model, request.messages))  # noqa: E731
    prompt = render()
    turns = [(m.role, m.content) for m in request.messages]

    async def answer() -> list[Any]:
        return [d async for d in engine.generate(prompt, options, "bench", 1)]

    deltas = drive(answer())
    frame = StreamFrame("chatcmpl_0123456789abcdef01234567", 1765000000, request)

    def encode() -> bytes:
        assembled = Assembler(request, engine.parse_tool_calls)
        for delta in deltas:
            assembled.add(delta)
        return wire.completion(frame, assembled.choices(), prompt.token_count, 16)

    return {
        "request JSON": best_us(lambda: wire.parse(benchlib.CHAT_BODY), n, rounds),
        "prompt": best_us(render, n, rounds),
        "prefix record": best_us(lambda: engine.served_prefixes.observe_turns(turns, tokens=prompt.token_count),
                                 n, rounds),
        "generate": best_us(lambda: drive(answer()), n, rounds),
        "answer JSON": best_us(encode, n, rounds),
    }


def whole(http1: bool, rounds: int) -> float:
    import uvloop  # type: ignore[import-not-found]

    runs = []
    for _ in range(rounds):
        requests, cpu, _ = uvloop.run(inprocess_calls.measure(8000, None, http1))
        runs.append(cpu / requests * 1e6)
    return statistics.median(runs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20000, help="calls per round for each stage")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--name", default="stage_costs", help="result file name under bench/results/")
    args = parser.parse_args()
    rows = {
        "whole request, HTTP/1.1 (in process)": whole(True, args.rounds),
        "whole request, h2c (in process)": whole(False, args.rounds),
        "HTTP/1.1 core cycle (llhttp)": best_us(core_cycle(NativeH1ServerCore), args.n, args.rounds),
        "h11 core cycle (python core)": best_us(core_cycle(H1ServerCore), args.n, args.rounds),
        "bare-h11 cycle (the floor's request)": best_us(bare_h11_cycle(), args.n, args.rounds),
        "scheduler (2 admits + settle)": best_us(scheduler_pair(True), args.n, args.rounds),
        "scheduler, no quotas": best_us(scheduler_pair(False), args.n, args.rounds),
        **engine_stages(args.n, args.rounds),
    }
    total = rows["whole request, HTTP/1.1 (in process)"]
    named = [name for name in rows if not name.startswith(("whole", "h11", "bare-h11", "scheduler, no"))]
    rows["the rest: session, gate, task, transport, metrics"] = total - sum(rows[name] for name in named)
    lines = [f"runtime at {os.environ.get('ZEROLAYER_BENCH_REV', 'working tree')}", benchlib.machine_line(), "",
             f"{'stage':<52} {'us/request':>10} {'of HTTP/1.1 whole':>18}"]
    lines += [f"{name:<52} {us:>10.1f} {us / total:>17.0%}" for name, us in rows.items()]
    lines += ["", "stages: best of rounds; whole requests: median of rounds (bench/inprocess_calls.py)",
              f"command: python3 bench/stage_costs.py -n {args.n} --rounds {args.rounds}"]
    text = "\n".join(lines)
    print(text)
    benchlib.save(args.name, text, {"us_per_request": rows, "command": benchlib.bench_argv()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
