"""The fleet autoscaler (operator/zerolayer/operator/autoscale.py): recommendation, stabilisation,
scale to and from zero. Table-driven; times are Unix seconds."""

from __future__ import annotations

import pytest

from zerolayer.operator.autoscale import Point, Policy, decide, history_from_status, metric_value, recommend, remember

P = Policy(min_replicas=0, max_replicas=3, metric="waitingRequests", target=4, up_window_s=0, down_window_s=300)


@pytest.mark.parametrize("values,current,demand,want,reason", [
    ([], 0, 0, 0, "Idle"),                      # nothing, nobody asked: stays at zero
    ([], 0, 2, 1, "Demand"),                    # a refused request scales from zero
    ([0, 0], 2, 0, 0, "Idle"),                  # idle fleet recommends zero (windows decide when)
    ([0], 1, 3, 1, "Demand"),                   # fresh demand keeps at least one
    ([8], 1, 0, 2, "Load"),                     # ceil(8 / 4)
    ([9, 9, 9], 3, 0, 3, "Load"),               # ceil(27 / 4) = 7, clamped to max 3
    ([4, 4], 2, 0, 2, "WithinTolerance"),       # exactly on target
    ([4.3, 4.3], 2, 0, 2, "WithinTolerance"),   # 7.5 % over: within HPA's 10 %
    ([1], 2, 0, 1, "Load"),                     # ceil(1 / 4) = 1
])
def test_recommend(values, current, demand, want, reason):
    assert recommend(P, values, current, demand) == (want, reason)


def test_recommend_kv_cache_fractions_and_min():
    kv = Policy(min_replicas=1, max_replicas=10, metric="kvCacheUsage", target=0.7)
    assert recommend(kv, [0.9, 0.9], 2)[0] == 3   # ceil(1.8 / 0.7)
    assert recommend(kv, [0.0], 1)[0] == 1        # idle, but minReplicas 1


def test_scale_up_is_immediate_without_window():
    d = decide(P, [12], 1, (), 1000.0)
    assert (d.replicas, d.recommended, d.reason) == (3, 3, "Load")


def test_scale_up_window_takes_the_lowest_recent_recommendation():
    slow = Policy(min_replicas=0, max_replicas=5, target=4, up_window_s=60, down_window_s=300)
    history = (Point(900.0, 1),)
    d = decide(slow, [12], 1, history, 950.0)  # 3 wanted, but 1 was recommended 50 s ago
    assert d.replicas == 1 and d.reason == "ScaleUpStabilizing"
    d = decide(slow, [12], 1, d.history, 1011.0)  # 3 has held for 61 s
    assert d.replicas == 3


def test_scale_down_waits_for_the_whole_window():
    history: tuple[Point, ...] = ()
    replicas = 3
    # Busy at t=0, idle from t=10 on: nothing removed until 300 s after the last busy recommendation.
    d = decide(P, [12, 0, 0], replicas, history, 0.0)
    assert d.replicas == 3
    for t in (10.0, 100.0, 299.0):
        d = decide(P, [0, 0, 0], replicas, d.history, t)
        assert d.replicas == 3 and d.reason == "ScaleDownStabilizing", t
    d = decide(P, [0, 0, 0], replicas, d.history, 311.0)
    assert d.replicas == 0 and d.recommended == 0


def test_lull_shorter_than_window_removes_nothing():
    d = decide(P, [12], 3, (), 0.0)
    d = decide(P, [0], 3, d.history, 100.0)
    d = decide(P, [12], 3, d.history, 200.0)
    d = decide(P, [0], 3, d.history, 450.0)  # busy at 200 s: still in the 300 s window
    assert d.replicas == 3


def test_demand_scales_from_zero_at_once_and_history_only_keeps_changes():
    d = decide(P, [], 0, (), 50.0, demand=1)
    assert (d.replicas, d.reason) == (1, "Demand")
    again = decide(P, [], 1, d.history, 60.0, demand=1)
    assert again.history == d.history  # same recommendation: no new point, no status write


def test_spec_outside_bounds_is_clamped():
    bounded = Policy(min_replicas=1, max_replicas=2)
    assert decide(bounded, [0], 5, (), 0.0).replicas == 2
    assert decide(bounded, [], 0, (), 0.0).replicas == 1


def test_remember_forgets_old_points_but_keeps_the_one_in_force():
    points = (Point(0.0, 1), Point(100.0, 2), Point(200.0, 3))
    assert remember(points, 3, 1000.0, 300.0) == (Point(200.0, 3),)
    assert remember(points, 1, 350.0, 300.0) == (Point(0.0, 1), Point(100.0, 2), Point(200.0, 3),
                                                 Point(350.0, 1))


@pytest.mark.parametrize("kwargs", [dict(max_replicas=1, min_replicas=2), dict(max_replicas=1, metric="tokens"),
                                    dict(max_replicas=1, target=0)])
def test_policy_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        Policy(**kwargs)


def test_policy_from_spec_defaults_and_metric_reading():
    p = Policy.from_spec({"maxReplicas": 4})
    assert (p.min_replicas, p.metric, p.target, p.up_window_s, p.down_window_s) == (1, "waitingRequests", 4.0, 0, 300)
    assert metric_value({"waiting": 3, "running": 1}, "waitingRequests") == 3
    assert metric_value({"kvCacheUsage": 0.5}, "kvCacheUsage") == 0.5
    assert metric_value(None, "runningRequests") == 0
    assert metric_value({"waiting": True}, "waitingRequests") == 0


def test_history_from_status_skips_malformed_entries():
    def parse(value):
        return {"a": 1.0, "b": 2.0}.get(value)
    entries = [{"time": "b", "replicas": 2}, {"time": "a", "replicas": 1}, {"time": "zz", "replicas": 3},
               {"time": "a", "replicas": "x"}]
    assert history_from_status(entries, parse) == (Point(1.0, 1), Point(2.0, 2))
