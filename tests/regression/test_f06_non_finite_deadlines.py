"""Finding 6: ``x-slo-ttft-ms: inf``, ``1e400`` or a 400-digit deadline must be a 400, not a crash.

On 410a271 these values passed ``parse_contract``; the scheduler charged the stream, then
``DeadlineOrdering`` raised OverflowError: a permanent scheduler entry, and the exception escaped
``data_received`` and killed the connection with its other streams.
"""

from __future__ import annotations

import h2.config
import h2.connection
import pytest

from tests.regression.wire import H2Peer, chat_body, connect, runtime, turns, until
from zerolayer.contract import ErrorCode
from zerolayer.runtime.errors import RequestRefused
from zerolayer.runtime.serving.headers import parse_contract
from zerolayer.runtime.protocol.events import Accept
from zerolayer.runtime.protocol.h2conn import H2ServerCore
from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig, Ticket
from zerolayer.contract import Priority

pytestmark = [pytest.mark.regression, pytest.mark.timeout(30)]
NOW_WALL_NS = 1_800_000_000_000_000_000


@pytest.mark.parametrize("headers", [
    {"x-slo-ttft-ms": "inf"},
    {"x-slo-ttft-ms": "Infinity"},
    {"x-slo-ttft-ms": "nan"},
    {"x-slo-ttft-ms": "1e400"},
    {"x-slo-ttft-ms": "-0"},
    {"x-slo-ttft-ms": "1e12"},  # 31 years
    {"x-zerolayer-deadline-nanos": "9" * 400},
    {"x-zerolayer-deadline-nanos": "9" * 4000},
    {"x-zerolayer-deadline-nanos": str(NOW_WALL_NS + 10**18)},  # 31 years from now, absolute
], ids=lambda h: next(iter(h.values()))[:12])
def test_absurd_deadlines_are_invalid_requests(headers):
    with pytest.raises(RequestRefused) as refused:
        parse_contract(headers, 100.0, NOW_WALL_NS)
    assert refused.value.code is ErrorCode.INVALID_REQUEST


def test_reasonable_deadlines_still_parse():
    terms = parse_contract({"x-slo-ttft-ms": "250", "x-zerolayer-deadline-nanos": str(30 * 10**9)}, 100.0, NOW_WALL_NS)
    assert terms.ttft_deadline == pytest.approx(100.25) and terms.deadline == pytest.approx(130.0)


@pytest.mark.parametrize("deadline", [float("inf"), float("nan"), 1e300])
def test_the_scheduler_admits_and_settles_a_non_finite_deadline_without_leaking(deadline):
    scheduler = MicroScheduler(SchedulerConfig())
    ticket = Ticket("1/1", "acme", Priority.NORMAL, "synthetic", 10, 10, deadline)
    admission = scheduler.admit(ticket, 0.0)  # admitted or refused, but never an exception
    assert scheduler.open_streams() == (1 if admission.admitted else 0)
    if admission.admitted:
        scheduler.settle(admission.reservation, 0, 1.0)
    assert scheduler.open_streams() == 0


def test_a_gate_that_raises_answers_500_on_that_stream_and_keeps_the_connection():
    calls = []

    def gate(head):  # type: ignore[no-untyped-def]
        calls.append(head.path)
        if head.path == "/boom":
            raise OverflowError("int too large to convert to float")
        return Accept(1000, None)

    core = H2ServerCore(gate)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    base = [(":method", "GET"), (":scheme", "http"), (":authority", "node")]
    client.send_headers(1, base + [(":path", "/boom")], end_stream=True)
    core.receive(client.data_to_send())
    events = client.receive_data(core.data_to_send())
    status = [dict(e.headers)[b":status"] for e in events if hasattr(e, "headers") and e.stream_id == 1]
    assert status == [b"500"] and not core.ended
    client.send_headers(3, base + [(":path", "/fine")], end_stream=True)
    assert any(type(e).__name__ == "RequestReady" for e in core.receive(client.data_to_send()))


async def test_ttft_inf_over_the_wire_is_a_400_and_leaks_nothing():
    server = await runtime()
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    for value in ("inf", "1e400"):
        sid = peer.request(chat_body(), extra=[("x-slo-ttft-ms", value)])
        await until(lambda: (peer.read(), peer.status(sid))[1] is not None)
        assert peer.status(sid) == 400
    await turns()
    assert server.scheduler.open_streams() == 0 and not sock.closing
    sid = peer.request(chat_body(stream=False, max_tokens=2))
    await until(lambda: (peer.read(), peer.status(sid))[1] is not None)
    assert peer.status(sid) == 200
