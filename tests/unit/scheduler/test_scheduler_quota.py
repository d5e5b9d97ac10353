"""Tenant quotas: the overshoot bound under concurrency and across window boundaries,
retry-after and the x-ratelimit-* headers."""

from __future__ import annotations

import asyncio
import heapq
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from scheduler_factories import scheduler, ticket
from zerolayer.contract import RATELIMIT_HEADERS, ErrorCode, Priority
from zerolayer.runtime.scheduler import TenantPolicy
from zerolayer.runtime.scheduler.quota import QuotaLedger, format_duration, retry_after_header

pytestmark = pytest.mark.timeout(60)


def assert_sliding_bound(events: list[tuple[float, int]], limit: int, window: float) -> None:
    """Every interval of length ``window`` holds <= ``limit`` of the charged amounts."""
    events = sorted(events)
    for i, (start, _) in enumerate(events):
        inside = sum(amount for at, amount in events[i:] if at < start + window)
        assert inside <= limit, f"{inside} > {limit} in the window starting at {start}"


def test_fifty_concurrent_threads_cannot_overshoot_tokens():
    limit = 500  # room for 16 requests of 30 tokens, not 17
    sched = scheduler({"acme": TenantPolicy("acme", tokens_per_minute=limit)})
    barrier = threading.Barrier(50)

    def one(i: int):
        barrier.wait()
        return sched.admit(ticket(prompt=10, max_tokens=20, key=f"t{i}"), now=1000.0)

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(one, range(50)))
    admitted = [r for r in results if r.admitted]
    assert len(admitted) == limit // 30
    assert sum(r.reservation.reserved_tokens for r in admitted) <= limit
    refused = [r for r in results if not r.admitted]
    assert {r.code for r in refused} == {ErrorCode.RATE_LIMITED}
    assert {r.reason for r in refused} == {"tokens"}


async def test_fifty_concurrent_streams_on_the_event_loop_with_settlement():
    """50 streams admitted from tasks, each settling with fewer tokens than reserved:
    the refunds make room, and reservations still never exceed the limit at any instant."""
    limit = 300
    sched = scheduler({"acme": TenantPolicy("acme", tokens_per_minute=limit, max_concurrent_streams=8)})
    clock = [0.0]
    outstanding = 0
    peak = 0
    results = []

    async def stream(i: int):
        nonlocal outstanding, peak
        await asyncio.sleep(0)
        adm = sched.admit(ticket(prompt=10, max_tokens=40, key=f"a{i}"), now=clock[0])
        results.append(adm)
        if not adm.admitted:
            return
        outstanding += adm.reservation.reserved_tokens
        peak = max(peak, outstanding)
        await asyncio.sleep(0)
        sched.settle(adm.reservation, 15, now=clock[0])
        outstanding -= adm.reservation.reserved_tokens

    await asyncio.gather(*(stream(i) for i in range(50)))
    admitted = [r for r in results if r.admitted]
    assert peak <= limit
    assert sched.open_streams() == 0
    # settled tokens are what is charged: 15 each, within the limit over the window
    assert 15 * len(admitted) <= limit
    assert {r.reason for r in results if not r.admitted} <= {"tokens", "concurrency"}


@pytest.mark.parametrize("seed", range(5))
def test_bound_holds_across_window_boundaries(seed):
    """Random arrivals over 5 minutes, bursts at minute edges: every sliding 60 s holds <= limit
    reserved tokens and <= rpm admissions (a fixed-window limiter would allow 2x at an edge)."""
    rnd = random.Random(seed)
    tpm, rpm = 1000, 20
    sched = scheduler({"acme": TenantPolicy("acme", tokens_per_minute=tpm, requests_per_minute=rpm)})
    times = sorted([rnd.uniform(0, 300) for _ in range(300)] +
                   [edge + rnd.uniform(-0.5, 0.5) for edge in (60, 120, 180, 240) for _ in range(30)])
    charged: list[tuple[float, int]] = []
    count: list[tuple[float, int]] = []
    settles: list[tuple[float, int, object, int]] = []  # streams end 0-5 s after admission, in time order
    for i, at in enumerate(times):
        while settles and settles[0][0] <= at:
            end, _, reservation, used = heapq.heappop(settles)
            sched.settle(reservation, used, now=end)
        t = ticket(prompt=rnd.randint(1, 50), max_tokens=rnd.randint(1, 100), key=f"w{i}")
        adm = sched.admit(t, now=at)
        if adm.admitted:
            used = rnd.randint(0, adm.reservation.reserved_tokens)
            heapq.heappush(settles, (at + rnd.uniform(0, 5), i, adm.reservation, used))
            charged.append((at, used))
            count.append((at, 1))
    assert len(charged) > 40  # the test exercised real admissions
    assert_sliding_bound(count, rpm, 60.0)
    # settled counts, charged at their admission time, obey the token bound in every window
    assert_sliding_bound(charged, tpm, 60.0)


def test_ledger_token_sum_never_exceeds_limit_at_any_admission():
    rnd = random.Random(7)
    tpm = 800
    sched = scheduler({"acme": TenantPolicy("acme", tokens_per_minute=tpm)})
    ledger = sched._state.ledger.tenant("acme")
    now = 0.0
    open_: list = []
    for i in range(2000):
        now += rnd.expovariate(5.0)
        adm = sched.admit(ticket(prompt=rnd.randint(1, 30), max_tokens=rnd.randint(1, 90), key=f"l{i}"), now=now)
        assert ledger.tokens_in_window(now) <= tpm
        if adm.admitted:
            open_.append(adm.reservation)
        while open_ and rnd.random() < 0.5:
            res = open_.pop(rnd.randrange(len(open_)))
            sched.settle(res, rnd.randint(0, res.reserved_tokens), now=now)
            assert ledger.tokens_in_window(now) <= tpm


def test_reserved_tokens_in_every_sliding_window_stay_under_limit_without_refunds():
    """Settling with the full reservation (no refunds): the reserved amounts themselves obey the bound."""
    rnd = random.Random(3)
    tpm = 600
    sched = scheduler({"acme": TenantPolicy("acme", tokens_per_minute=tpm)})
    charged = []
    for i in range(600):
        at = i * 0.5 + rnd.uniform(0, 0.4)
        adm = sched.admit(ticket(prompt=rnd.randint(1, 40), max_tokens=rnd.randint(1, 60), key=f"r{i}"), now=at)
        if adm.admitted:
            sched.settle(adm.reservation, adm.reservation.reserved_tokens, now=at)
            charged.append((at, adm.reservation.reserved_tokens))
    assert len(charged) > 20
    assert_sliding_bound(charged, tpm, 60.0)


def test_retry_after_is_exact_for_tokens():
    sched = scheduler({"acme": TenantPolicy("acme", tokens_per_minute=100)})
    first = sched.admit(ticket(prompt=20, max_tokens=40, key="a"), now=10.0)    # 60 tokens at t=10
    second = sched.admit(ticket(prompt=10, max_tokens=20, key="b"), now=30.0)   # 30 tokens at t=30
    assert first.admitted and second.admitted
    refused = sched.admit(ticket(prompt=20, max_tokens=30, key="c"), now=40.0)  # 50 more: must wait for t=70
    assert not refused.admitted and refused.reason == "tokens"
    assert refused.retry_after_s == pytest.approx(30.0)
    assert refused.headers["retry-after"] == "30"
    assert refused.headers["retry-after-ms"] == "30000"
    assert not sched.admit(ticket(prompt=20, max_tokens=30, key="c"), now=69.99).admitted
    assert sched.admit(ticket(prompt=20, max_tokens=30, key="c"), now=70.0).admitted


def test_settling_refunds_unused_tokens():
    sched = scheduler({"acme": TenantPolicy("acme", tokens_per_minute=100)})
    a = sched.admit(ticket(prompt=10, max_tokens=80, key="a"), now=0.0)
    assert not sched.admit(ticket(prompt=10, max_tokens=20, key="b"), now=1.0).admitted
    sched.settle(a.reservation, 25, now=2.0)
    assert sched.admit(ticket(prompt=10, max_tokens=20, key="b"), now=3.0).admitted


def test_retry_after_for_requests_and_headers():
    sched = scheduler({"acme": TenantPolicy("acme", requests_per_minute=2, tokens_per_minute=1000)})
    ok1 = sched.admit(ticket(key="a"), now=5.0, stage="body")
    ok2 = sched.admit(ticket(key="b"), now=20.0, stage="body")  # the stage whose headers the response carries
    assert ok1.admitted and ok2.admitted
    assert ok2.headers["x-ratelimit-remaining-requests"] == "0"
    assert ok2.headers["x-ratelimit-remaining-tokens"] == str(1000 - 60)
    refused = sched.admit(ticket(key="c"), now=21.5)
    assert refused.code is ErrorCode.RATE_LIMITED and refused.reason == "requests"
    assert refused.retry_after_s == pytest.approx(43.5)  # the charge at t=5 leaves at t=65
    assert refused.headers["retry-after"] == "44"
    assert set(RATELIMIT_HEADERS) <= set(refused.headers)
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert refused.headers["x-ratelimit-reset-requests"] == "58.5s"  # until the newest (t=20) leaves
    assert refused.headers["x-ratelimit-limit-tokens"] == "1000"
    # an accepted HEADERS stage builds none: the response head waits for the body stage's
    assert sched.admit(ticket(key="d"), now=130.0).headers == {}


def test_concurrency_limit_and_release_on_settle():
    sched = scheduler({"acme": TenantPolicy("acme", max_concurrent_streams=2)})
    a = sched.admit(ticket(key="a"), now=0.0)
    sched.admit(ticket(key="b"), now=0.0)
    refused = sched.admit(ticket(key="c"), now=0.0)
    assert refused.reason == "concurrency" and refused.retry_after_s == 1.0
    sched.settle(a.reservation, 5, now=0.1)
    assert sched.admit(ticket(key="c"), now=0.2).admitted


def test_request_larger_than_the_whole_limit_says_so():
    sched = scheduler({"acme": TenantPolicy("acme", tokens_per_minute=100)})
    refused = sched.admit(ticket(prompt=60, max_tokens=60), now=0.0)
    assert refused.reason == "request_too_large" and refused.retry_after_s is None
    assert "lower max_tokens" in refused.message


def test_body_stage_resizes_without_counting_a_second_request():
    sched = scheduler({"acme": TenantPolicy("acme", tokens_per_minute=100, requests_per_minute=1,
                                            max_concurrent_streams=1)})
    head = sched.admit(ticket(prompt=0, max_tokens=50, key="k"), now=0.0)
    body = sched.admit(ticket(prompt=30, max_tokens=50, key="k"), now=0.01, stage="body")
    assert head.admitted and body.admitted and body.reservation.reserved_tokens == 80
    assert body.headers["x-ratelimit-remaining-tokens"] == "20"
    too_big = sched.admit(ticket(prompt=60, max_tokens=50, key="k"), now=0.02, stage="body")
    assert not too_big.admitted
    # the refused body stage released the HEADERS reservation: tokens and concurrency are free again
    assert sched.open_streams() == 0
    sched.settle(head.reservation, 0, now=0.03)  # the server's settle is a harmless no-op
    assert sched._state.ledger.tenant("acme").tokens_in_window(0.04) == 0


def test_unlimited_tenant_gets_no_ratelimit_headers():
    sched = scheduler({"acme": TenantPolicy("acme")})
    assert sched.admit(ticket(), now=0.0).headers == {}


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (0.0004, "1ms"), (0.25, "250ms"), (1.5, "1.5s"), (59.9986, "59.999s"), (59.9994, "1m0s"), (60, "1m0s"),
    (360, "6m0s"), (3723.5, "1h2m3.5s"),
])
def test_reset_duration_format(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("seconds, text", [(0, "0"), (0.001, "1"), (1.0, "1"), (1.2, "2"), (43.5, "44")])
def test_retry_after_header_rounds_up(seconds, text):
    assert retry_after_header(seconds) == text


def test_priority_of_tenant_has_no_effect_on_quota():
    sched = scheduler({"acme": TenantPolicy("acme", requests_per_minute=1)})
    assert sched.admit(ticket(Priority.HIGH), now=0.0).admitted
    assert not sched.admit(ticket(Priority.HIGH), now=1.0).admitted


def test_reads_at_one_moment_expire_once_and_a_new_window_applies_at_once():
    ledger = QuotaLedger(window_s=60.0)
    tenant = ledger.tenant("acme")
    tenant.charge("s1", 100, 0.0, new_request=True)
    assert tenant.tokens_in_window(30.0) == 100 and tenant.requests_in_window(30.0) == 1
    tenant.charge("s2", 50, 30.0, new_request=True)  # charged at the moment just read: inside a window > 0
    assert tenant.tokens_in_window(30.0) == 150
    ledger.retune(10.0, 1.0)  # shorter: s1 (at 0) has left the window at 30, though 30 was read already
    assert tenant.tokens_in_window(30.0) == 50 and tenant.requests_in_window(30.0) == 1
    assert tenant.tokens_in_window(40.0) == 0
