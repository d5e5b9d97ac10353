"""In-process cost of per-request steps, before and after issue 29's cuts, side by side.

* ``dumps``: a non-streamed chat completion's body encoded by the runtime's ``api/common.py:dumps``
  (orjson) against the standard library's encoder that ``dumps`` used before (and still falls back to);
* ``Ticket.sized``: the body-stage ticket built directly, against ``dataclasses.replace``;
* a ``Ticket`` built: the slotted dataclass it is now, against the same fields as the frozen dataclass
  it was (every object a request builds was one; a frozen one sets each field through
  ``object.__setattr__``);
* a request id's random part: from the session's pooled ``os.urandom`` reads, against a
  ``getrandom`` call per request;
* the sampling fields of a body that sets none of them (the bench's chat body): the defaults read
  once, against the full read of every field;
* a counter increment on the serving path: added to ``PendingIncrements`` (moved in at scrape time),
  against a ``prometheus_client`` child's ``inc``.

Best of ``--rounds`` timings of ``--n`` calls each; prints µs per call and the ratio.

    python3 bench/percall_micro.py [--n 100000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import timeit

from prometheus_client import CollectorRegistry, Counter

from zerolayer.contract import Priority
from zerolayer.runtime.api import common, openai
from zerolayer.runtime.counting import PendingIncrements
from zerolayer.runtime.scheduler import Ticket
from zerolayer.runtime.serving import session

ANSWER = {"id": "chatcmpl_0123456789abcdef01234567", "object": "chat.completion", "created": 1765000000,
          "model": "synthetic", "choices": [{"index": 0, "message": {
              "role": "assistant", "content": "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod "
                                              "tempor incididunt ut labore et", "refusal": None, "tool_calls": []},
              "logprobs": None, "finish_reason": "length"}],
          "usage": {"prompt_tokens": 12, "completion_tokens": 16, "total_tokens": 28}, "system_fingerprint": None}
CHAT = {"model": "synthetic", "max_tokens": 16,
        "messages": [{"role": "user", "content": "what does a zero layer cost?"}]}  # the floor bench's body
TICKET = Ticket("7/1", "bench", Priority.NORMAL, "synthetic", 10, 0, None, None, 1.0)
REGISTRY = CollectorRegistry()
PENDING = PendingIncrements(REGISTRY)
CHILD = Counter("bench_requests", "Requests.", ["route"], registry=REGISTRY).labels("chat")
FrozenTicket = dataclasses.make_dataclass(  # Ticket's fields as the frozen dataclass it was before
    "FrozenTicket", [(f.name, f.type, f.default) if f.default is not dataclasses.MISSING else (f.name, f.type)
                     for f in dataclasses.fields(Ticket)], frozen=True)


def best_us(fn, n: int, rounds: int) -> float:  # type: ignore[no-untyped-def]
    return min(timeit.repeat(fn, number=n, repeat=rounds)) / n * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    assert common.dumps(ANSWER) == common._ENCODER.encode(ANSWER).encode()  # the same bytes either way
    rows = [
        ("dumps (orjson)", "stdlib JSONEncoder", lambda: common.dumps(ANSWER),
         lambda: common._ENCODER.encode(ANSWER).encode()),
        ("Ticket.sized", "dataclasses.replace", lambda: TICKET.sized("synthetic", Priority.HIGH, 12, 16),
         lambda: dataclasses.replace(TICKET, model="synthetic", priority=Priority.HIGH, prompt_tokens=12,
                                     max_tokens=16)),
        ("Ticket(...)", "frozen dataclass", lambda: Ticket("7/1", "bench", Priority.NORMAL, "synthetic", 10, 0, None),
         lambda: FrozenTicket("7/1", "bench", Priority.NORMAL, "synthetic", 10, 0, None)),
        ("request id hex", "os.urandom per call", session._RANDOM.hex12, lambda: os.urandom(12).hex()),
        ("sampling fields", "full read", lambda: openai._sampling(CHAT, "synthetic"),
         lambda: openai._sampling_given(CHAT, "synthetic")),
        ("counter +1", "child.inc()", lambda: PENDING.add(CHILD), CHILD.inc),
    ]
    print(f"{'step':<16} {'us/call':>8}   {'before':<20} {'us/call':>8}   after/before")
    for name, before_name, after, before in rows:
        a, b = best_us(after, args.n, args.rounds), best_us(before, args.n, args.rounds)
        print(f"{name:<16} {a:8.2f}   {before_name:<20} {b:8.2f}   {a / b:.2f}x")
    print(f"command: python3 bench/percall_micro.py --n {args.n} --rounds {args.rounds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
