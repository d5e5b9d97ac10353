"""Node-wide shedding across API processes (scheduler/running.py): process 0 picks victims from every
process's candidates, largest first and lowest class first, within one budget; each process preempts
only its own, the others carrying out process 0's orders at their next sample."""

from __future__ import annotations

import multiprocessing

from scheduler_factories import admitted, pressure, running
from zerolayer.contract import Priority
from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig
from zerolayer.runtime.scheduler.running import SLOTS, RunningBoard, SharedRunning

L, N = Priority.LOW, Priority.NORMAL


def processes(count: int, **config) -> list[MicroScheduler]:
    board = RunningBoard.create(count)
    return [MicroScheduler(SchedulerConfig(**config), running=SharedRunning(board, i)) for i in range(count)]


def tick(scheds, streams, at: float, fraction: float = 0.94, order=None) -> list[list[str]]:
    """One telemetry sample in every process (in ``order``, default 0, 1, ...); each one's preemptions."""
    out: list[list[str]] = [[] for _ in scheds]
    for i in order or range(len(scheds)):
        out[i] = [p.stream_key for p in scheds[i].observe(pressure(fraction, at, streams[i]), now=at)]
    return out


def test_the_node_sheds_its_largest_first_within_one_budget() -> None:
    a, b = processes(2, max_preemptions_per_tick=1, preempt_after_samples=1)
    mine = {0: admitted(a, [running("a-small", L, 100), running("a-mid", L, 500)]),
            1: admitted(b, [running("b-large", L, 900), running("b-tiny", L, 10)])}
    tick([a, b], mine, 0.0, fraction=0.5, order=[1, 0])  # b publishes its row; nothing sheds
    # Process 0 samples first: the node's largest is b's, so it orders it and sheds nothing of its own.
    assert tick([a, b], mine, 1.0) == [[], ["b-large"]]
    # b's row no longer lists b-large: the next largest is a's, one per sample.
    assert tick([a, b], mine, 2.0) == [["a-mid"], []]
    assert tick([a, b], mine, 3.0) == [["a-small"], []]
    assert tick([a, b], mine, 4.0) == [[], ["b-tiny"]]
    assert tick([a, b], mine, 5.0) == [[], []]


def test_an_order_waits_for_a_process_that_samples_late() -> None:
    """Process 0 samples twice before b does: b's order stays listed until b carries it out, and process 0
    does not spend its next sample's budget picking the same stream again."""
    a, b = processes(2, max_preemptions_per_tick=1, preempt_after_samples=1)
    mine = {0: admitted(a, [running("a-small", L, 100)]), 1: admitted(b, [running("b-large", L, 900)])}
    tick([a, b], mine, 0.0, fraction=0.5, order=[1, 0])
    assert tick([a, b], mine, 1.0, order=[0]) == [[], []]  # a orders b-large
    assert tick([a, b], mine, 2.0, order=[0]) == [["a-small"], []]  # the next largest, not b-large again
    assert tick([a, b], mine, 3.0, order=[1]) == [[], ["b-large"]]  # b finds its order two samples on
    assert tick([a, b], mine, 4.0) == [[], []]


def test_without_the_board_each_process_sheds_its_own_largest() -> None:
    """What the board changes: each process alone (LocalRunning) knows only its own streams."""
    a = MicroScheduler(SchedulerConfig(max_preemptions_per_tick=1, preempt_after_samples=1))
    b = MicroScheduler(SchedulerConfig(max_preemptions_per_tick=1, preempt_after_samples=1))
    mine = {0: admitted(a, [running("a-small", L, 100)]), 1: admitted(b, [running("b-large", L, 900)])}
    tick([a, b], mine, 0.0, fraction=0.5)
    assert tick([a, b], mine, 1.0) == [["a-small"], ["b-large"]]  # twice the budget, the small one too


def test_lower_classes_go_first_node_wide() -> None:
    a, b = processes(2, max_preemptions_per_tick=1, preempt_after_samples=1)
    mine = {0: admitted(a, [running("a-normal-huge", N, 5000)]), 1: admitted(b, [running("b-low", L, 10)])}
    tick([a, b], mine, 0.0, fraction=0.5, order=[1, 0])
    # above both classes' marks: the low stream goes before a larger normal one, wherever each runs
    assert tick([a, b], mine, 1.0, fraction=0.99) == [[], ["b-low"]]
    assert tick([a, b], mine, 2.0, fraction=0.99) == [["a-normal-huge"], []]


def test_a_row_holds_the_largest_candidates() -> None:
    board = RunningBoard.create(2)
    SharedRunning(board, 1).victims([running(f"s{i}", L, i) for i in range(SLOTS + 10)], lambda c: [])
    rows = board.read_row(1)
    assert len(rows) == SLOTS and min(t for _, t, _ in rows) == 10  # the 10 smallest left out
    assert board.read_row(0) == [] and board.read_orders() == []


def _follow_in_child(board: RunningBoard, result) -> None:
    own = [running("child-large", L, 777), running("child-small", L, 1)]
    first = SharedRunning(board, 1).victims(own, lambda c: [])  # publishes its row
    while not board.read_orders():
        pass
    second = SharedRunning(board, 1).victims(own, lambda c: [])
    result.value = len(first) * 10 + len(second) if [s.stream_key for s in second] == ["child-large"] else -1


def test_a_spawned_process_carries_out_process_0_s_order() -> None:
    ctx = multiprocessing.get_context("spawn")
    board = RunningBoard.create(2, context=ctx)
    result = ctx.Value("i", 0)
    child = ctx.Process(target=_follow_in_child, args=(board, result))
    child.start()
    try:
        leader = SharedRunning(board, 0)
        for _ in range(2000):
            if board.read_row(1):
                break
            child.join(0.01)
        picked = leader.victims([running("own", L, 5)], lambda c: sorted(c, key=lambda s: -s.tokens_so_far)[:1])
        assert picked == []  # the node's largest is the child's: ordered, not preempted here
        child.join(60)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0 and result.value == 1  # nothing at first, then exactly its large stream
