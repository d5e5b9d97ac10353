"""The retry policy table and the retry budget's bound (no I/O)."""

from __future__ import annotations

import pytest

from zerolayer.client import errors
from zerolayer.client.retry import AttemptParams, RetryBudget, RetryPolicy

FIRST = AttemptParams(number=1, max_tokens=256, model_hint="big", deadline_s=0.5)


def policy(**kw):
    return RetryPolicy(rng=lambda: 0.5, lighter_models={"big": "small"}, **kw)


def test_gpu_oom_retries_at_once_with_half_the_tokens():
    d = policy().decide(errors.GpuOom("oom"), FIRST, streaming=False)
    assert d.delay_s == 0 and d.next.max_tokens == 128 and d.next.number == 2 and not d.avoid_same_node
    assert policy().decide(errors.GpuOom("oom"), AttemptParams(1, 1, "big", 1.0), streaming=False) is None


def test_deadline_backs_off_to_a_lighter_model_with_double_the_deadline():
    d = policy(base_delay_s=0.2).decide(errors.DeadlineExceeded("late"), FIRST, streaming=False)
    assert d.next.model_hint == "small" and d.next.deadline_s == 1.0
    assert d.delay_s == pytest.approx(0.1)  # full jitter: rng 0.5 * 0.2
    # no lighter model known: the hint stays
    d2 = policy().decide(errors.DeadlineExceeded("late"), AttemptParams(1, 8, "other", None), streaming=False)
    assert d2.next.model_hint == "other" and d2.next.deadline_s is None


def test_refusals_follow_alternatives_or_honour_retry_after():
    alt = errors.ResourceExhausted("busy", alternatives=("http://n2",), retry_after=3.0, processed=False)
    d = policy().decide(alt, FIRST, streaming=False)
    assert d.delay_s == 0 and d.prefer == ("http://n2",)
    wait = errors.ResourceExhausted("busy", retry_after=1.0, processed=False)
    assert policy().decide(wait, FIRST, streaming=False).delay_s == pytest.approx(1.1)  # never earlier than asked
    too_long = errors.RateLimitError("quota", retry_after=60.0, processed=False)
    assert policy(max_delay_s=8).decide(too_long, FIRST, streaming=False) is None
    refused = errors.StreamRefused("refused", processed=False)
    assert policy().decide(refused, FIRST, streaming=False) is not None


@pytest.mark.parametrize(
    "error",
    [
        errors.AuthenticationError("no"),
        errors.PermissionDeniedError("no"),
        errors.BadRequestError("no"),
        errors.APIError("unknown"),
        errors.APITimeoutError("slow", processed=None),
    ],
)
def test_other_errors_raise(error):
    assert policy().decide(error, FIRST, streaming=True) is None


def test_never_retry_after_a_token_was_delivered():
    err = errors.InternalError("reset", tokens_delivered=1)
    assert policy().decide(err, FIRST, streaming=True) is None


def test_unknown_outcome_retried_only_for_streams_without_tokens():
    lost = errors.APIConnectionError("lost", processed=None)
    assert policy().decide(lost, FIRST, streaming=False) is None
    assert policy().decide(lost, FIRST, streaming=True) is not None
    refused = errors.APIConnectionError("refused", processed=False)
    assert policy().decide(refused, FIRST, streaming=False).delay_s == 0


def test_max_retries():
    last = AttemptParams(number=4, max_tokens=8, model_hint=None, deadline_s=None)
    assert policy(max_retries=3).decide(errors.InternalError("x"), last, streaming=False) is None
    assert policy(max_retries=0).decide(errors.InternalError("x"), FIRST, streaming=False) is None


def test_backoff_is_jittered_exponential_and_capped():
    p = RetryPolicy(base_delay_s=0.1, max_delay_s=1.0, rng=lambda: 1.0)
    assert [p.backoff(n) for n in (1, 2, 3, 4, 5, 6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert RetryPolicy(rng=lambda: 0.0).backoff(3) == 0.0


@pytest.mark.parametrize("requests", [1, 50, 1000])
def test_budget_bounds_attempts_under_sustained_failure(requests):
    budget = RetryBudget(ratio=0.2, burst=10)
    attempts = 0
    for _ in range(requests):
        budget.on_request()
        attempts += 1
        while budget.try_spend():  # every attempt fails and wants a retry
            attempts += 1
    assert attempts <= 1.2 * requests + 10
    assert budget.retries == attempts - requests and budget.denied >= 1


def test_budget_refills_with_traffic():
    budget = RetryBudget(ratio=0.5, burst=2)
    assert budget.try_spend() and budget.try_spend() and not budget.try_spend()
    budget.on_request()
    budget.on_request()
    assert budget.try_spend()


def test_budget_rejects_nonsense():
    with pytest.raises(ValueError):
        RetryBudget(ratio=-1)


def test_deadline_fallback_changes_the_requested_model_not_only_the_hint():
    first = AttemptParams(number=1, max_tokens=8, model_hint="big", deadline_s=0.5, model="big")
    d = policy().decide(errors.DeadlineExceeded("late"), first, streaming=False)
    assert (d.next.model, d.next.model_hint) == ("small", "small")
    pinned = AttemptParams(number=1, max_tokens=8, model_hint="pool-a", deadline_s=0.5, model="big")
    d2 = policy().decide(errors.DeadlineExceeded("late"), pinned, streaming=False)
    assert (d2.next.model, d2.next.model_hint) == ("small", "pool-a")  # a hint naming no model is kept


def test_a_model_no_node_serves_yet_is_waited_for_within_model_wait_s():
    """Issue 25: a fleet scaling from zero answers MODEL_UNAVAILABLE with retry-after 5 until its first
    node is up; the SDK waits for it (bounded by model_wait_s) instead of spending its retries."""
    cold = errors.ModelUnavailable("no node serves it yet", retry_after=5.0, processed=False)
    p = policy(max_retries=0, model_wait_s=60.0)
    assert p.wait_for_model(cold, waited_s=0.0) == pytest.approx(5.5)  # retry-after, up to 20 % later
    assert p.wait_for_model(cold, waited_s=55.0) is None  # 55 + 5.5 > 60: raised (decide() then says)
    assert policy(model_wait_s=0).wait_for_model(cold, 0.0) is None
    for other in (errors.ModelUnavailable("x", retry_after=0.1, processed=False),  # not a paced wait
                  errors.ModelUnavailable("x", processed=False),  # no retry-after
                  errors.ModelUnavailable("x", retry_after=5.0, alternatives=("http://b",), processed=False),
                  errors.ModelUnavailable("x", retry_after=5.0, processed=False, should_retry=False),
                  errors.ResourceExhausted("busy", retry_after=5.0, processed=False)):
        assert p.wait_for_model(other, 0.0) is None
