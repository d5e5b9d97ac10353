"""The node-wide quota board of several API processes (scheduler/board.py): the limits hold across
processes as in one, published totals only over-state, and a real second process shares the table."""

from __future__ import annotations

import multiprocessing

import pytest

from zerolayer.contract import Priority
from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig
from zerolayer.runtime.scheduler.api import TenantPolicy, Ticket
from zerolayer.runtime.scheduler.board import BoardFull, QuotaBoard, SharedQuotaLedger


def scheduler(board: QuotaBoard, index: int, cls: type[MicroScheduler] = MicroScheduler,
              **limits: int) -> MicroScheduler:
    config = SchedulerConfig()
    ledger = SharedQuotaLedger(board, index, config.quota_window_s, config.concurrency_retry_after_s)
    micro = cls(config, ledger=ledger)
    micro.set_tenants({"acme": TenantPolicy("acme", **limits)})
    return micro


def ticket(key: str, tokens: int = 10) -> Ticket:
    return Ticket(key, "acme", Priority.NORMAL, "m", prompt_tokens=tokens, max_tokens=tokens, deadline=None)


def test_concurrency_is_node_wide_across_processes() -> None:
    board = QuotaBoard.create(2)
    a, b = scheduler(board, 0, max_concurrent_streams=2), scheduler(board, 1, max_concurrent_streams=2)
    first = a.admit(ticket("a1"), 1.0)
    second = b.admit(ticket("b1"), 1.0)
    third = b.admit(ticket("b2"), 1.0)
    assert first.admitted and second.admitted
    assert not third.admitted and third.reason == "concurrency"
    assert board.totals("acme")[0] == 2
    a.settle(first.reservation, 5, 2.0)  # a frees a slot: b may use it
    assert b.admit(ticket("b3"), 2.0).admitted
    assert board.totals("acme")[0] == 2


def test_requests_and_tokens_are_node_wide() -> None:
    board = QuotaBoard.create(3)
    procs = [scheduler(board, i, requests_per_minute=4, tokens_per_minute=1000) for i in range(3)]
    admitted = [p.admit(ticket(f"{i}-{n}"), 1.0).admitted for n in range(2) for i, p in enumerate(procs)]
    assert admitted.count(True) == 4  # six tries on three processes, four requests per minute on the node
    refused = procs[2].admit(ticket("late"), 1.5)
    assert refused.reason == "requests" and refused.retry_after_s and refused.retry_after_s > 0
    assert board.totals("acme")[1] == 4


def test_tokens_limit_and_remaining_header_count_every_process() -> None:
    board = QuotaBoard.create(2)
    a, b = scheduler(board, 0, tokens_per_minute=100), scheduler(board, 1, tokens_per_minute=100)
    ok = a.admit(ticket("a1", 30), 1.0, stage="body")  # reserves 60
    assert ok.admitted and ok.headers["x-ratelimit-remaining-tokens"] == "40"
    seen = b.admit(ticket("b1", 15), 1.0, stage="body")  # 30 more: 90 in all
    assert seen.admitted and seen.headers["x-ratelimit-remaining-tokens"] == "10"
    refused = b.admit(ticket("b2", 10), 1.0)
    assert refused.reason == "tokens"


def test_a_process_republishes_when_its_charges_leave_the_window() -> None:
    board = QuotaBoard.create(2)
    a, b = scheduler(board, 0, requests_per_minute=1), scheduler(board, 1, requests_per_minute=1)
    first = a.admit(ticket("a1"), 0.0)
    a.settle(first.reservation, 1, 0.5)
    assert not b.admit(ticket("b1"), 61.0).admitted  # a has not re-published yet: over-stated, never under
    a._state.ledger.refresh(61.0)  # what observe() does on each telemetry sample
    assert b.admit(ticket("b1"), 61.0).admitted


def test_full_board_is_a_clear_error() -> None:
    board = QuotaBoard.create(1, capacity=2)
    board.slot("t1")
    board.slot("t2")
    with pytest.raises(BoardFull, match="holds 2 tenants"):
        board.slot("t3")


def _admit_in_child(board: QuotaBoard, out: "multiprocessing.Queue[bool]") -> None:
    micro = scheduler(board, 1, max_concurrent_streams=1)
    out.put(micro.admit(ticket("child"), 1.0).admitted)


def test_a_spawned_process_sees_the_parents_streams() -> None:
    ctx = multiprocessing.get_context("spawn")
    board = QuotaBoard.create(2, context=ctx)
    parent = scheduler(board, 0, max_concurrent_streams=1)
    held = parent.admit(ticket("parent"), 1.0)
    assert held.admitted
    out: "multiprocessing.Queue[bool]" = ctx.Queue()
    child = ctx.Process(target=_admit_in_child, args=(board, out))
    child.start()
    assert out.get(timeout=60) is False  # the node's one stream is the parent's
    child.join(30)
    parent.settle(held.reservation, 1, 2.0)
    child = ctx.Process(target=_admit_in_child, args=(board, out))
    child.start()
    assert out.get(timeout=60) is True
    child.join(30)
    assert board.totals("acme")[0] == 1  # the child's stream is still open in its (exited) row


class _Interleaved(MicroScheduler):
    """A scheduler that lets another process's admission happen after its filter chain passed and before
    it charges: the window the node-wide lock no longer covers (MicroScheduler._charge)."""

    meanwhile = None

    def _first_refusal(self, ctx):  # type: ignore[no-untyped-def]
        refusal = super()._first_refusal(ctx)
        step, self.meanwhile = self.meanwhile, None
        if step is not None:
            step()
        return refusal


def test_the_quota_is_decided_again_under_the_lock_when_another_process_charged_meanwhile() -> None:
    board = QuotaBoard.create(2)
    a = scheduler(board, 0, _Interleaved, max_concurrent_streams=1, tokens_per_minute=100)
    b = scheduler(board, 1, max_concurrent_streams=1, tokens_per_minute=100)
    seen = []
    a.meanwhile = lambda: seen.append(b.admit(ticket("b1"), 1.0))  # a's chain saw 0 open streams
    late = a.admit(ticket("a1"), 1.0)
    assert seen[0].admitted
    assert not late.admitted and late.reason == "concurrency", late
    assert board.totals("acme")[0] == 1  # one open stream on the node, as the limit says


def test_a_body_stage_resize_is_decided_again_under_the_lock() -> None:
    board = QuotaBoard.create(2)
    a = scheduler(board, 0, _Interleaved, max_concurrent_streams=4, tokens_per_minute=100)
    b = scheduler(board, 1, max_concurrent_streams=4, tokens_per_minute=100)
    assert a.admit(ticket("a1", 20), 1.0).admitted  # 40 reserved at HEADERS
    seen = []
    a.meanwhile = lambda: seen.append(b.admit(ticket("b1", 25), 1.0))  # 50 more: 90 on the node
    grown = a.admit(ticket("a1", 30), 1.0, stage="body")  # a's chain saw 40 + 20 more fit; with b's 50 they do not
    assert seen[0].admitted
    assert not grown.admitted and grown.reason == "tokens", grown
    assert board.totals("acme") == (1, 2, 50)  # a's HEADERS reservation released, b's kept


def test_settles_and_releases_only_lower_a_published_row() -> None:
    board = QuotaBoard.create(2)
    a = scheduler(board, 0, max_concurrent_streams=4, tokens_per_minute=1000)
    admitted = a.admit(ticket("a1", 50), 1.0)
    assert board.totals("acme") == (1, 1, 100)
    a.settle(admitted.reservation, 30, 1.5)  # used 30 of the 100 reserved
    assert board.totals("acme") == (0, 1, 30)
