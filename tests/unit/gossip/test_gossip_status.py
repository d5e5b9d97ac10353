"""The publication policy: what goes into status, when it goes out, and the rate limit (pure)."""

from __future__ import annotations

import pytest

from zerolayer.runtime.gossip.status import GossipSettings, GossipState, Load, build_status, change_reason
from zerolayer.runtime.gpu.api import GpuReading

GiB = 1024**3


def reading(memory: float, *, uuid: str = "GPU-0", index: int = 0, util: float = 0.5, **extra) -> GpuReading:
    return GpuReading(uuid=uuid, index=index, name="Test GPU", memory_used_bytes=round(memory * 80 * GiB),
                      memory_total_bytes=80 * GiB, utilization=util, **extra)


def test_settings_from_spec_reads_gossip_and_scheduler_fields():
    spec = {"gossip": {"heartbeatSeconds": 3, "staleAfterSeconds": 9, "maxPatchesPerSecond": 0.5,
                       "memoryStep": 0.1},
            "scheduler": {"memoryThreshold": 0.9, "resumeThreshold": 0.8, "utilizationThreshold": 0.97}}
    s = GossipSettings.from_spec(spec)
    assert (s.heartbeat_s, s.stale_after_s, s.max_patches_per_s, s.memory_step) == (3, 9, 0.5, 0.1)
    assert (s.memory_threshold, s.resume_threshold, s.utilization_threshold) == (0.9, 0.8, 0.97)
    assert GossipSettings.from_spec({}) == GossipSettings()
    with pytest.raises(ValueError):
        GossipSettings.from_spec({"scheduler": {"memoryThreshold": 0.5, "resumeThreshold": 0.6}})


def test_build_status_fields_match_the_crd():
    r = reading(0.5, power_watts=301.26, temperature_c=61.0, nvlink_errors=0)
    status = build_status([r, reading(0.96, uuid="GPU-1", index=1)], {"GPU-0": True, "GPU-1": False},
                          Load(3, 1, 0.4251), endpoint="http://n:8443", heartbeat=0.0, fragmentation={0: 0.125})
    assert status["admitting"] is True
    assert status["gpusAdmitting"] == "1/2"
    assert status["memoryPercent"] == 73  # (0.5 + 0.96) / 2
    assert status["lastHeartbeat"] == "1970-01-01T00:00:00.000Z"
    assert status["load"] == {"running": 3, "waiting": 1, "kvCacheUsage": 0.4251}
    g0, g1 = status["gpus"]
    assert g0 == {"uuid": "GPU-0", "index": 0, "name": "Test GPU", "memoryUsedBytes": 40 * GiB,
                  "memoryTotalBytes": 80 * GiB, "utilization": 0.5, "admitting": True, "powerWatts": 301.3,
                  "temperatureC": 61.0, "fragmentation": 0.125, "nvlinkErrors": 0}
    assert "fragmentation" not in g1 and "powerWatts" not in g1 and g1["admitting"] is False
    assert "phase" not in status and "conditions" not in status  # the operator's fields
    assert "models" not in status  # a runtime that does not say what it serves publishes nothing there


def test_status_lists_the_served_models_adapters_included():
    from zerolayer.client.nodes import node_from_status

    status = build_status([reading(0.5)], {}, Load(0, 0, 0.0), endpoint="http://n:8443", heartbeat=0.0,
                          models=("base", "base-sql", "other"))
    assert status["models"] == ["base", "base-sql", "other"]
    node = node_from_status("n", status, spec={"models": [{"name": "base"}]})  # the published list wins
    assert node is not None and node.serves("base-sql") and not node.serves("gone")


def test_draining_or_every_gpu_full_means_not_admitting():
    assert build_status([reading(0.1)], {"GPU-0": True}, Load(draining=True), endpoint=None, heartbeat=0)[
        "admitting"] is False
    assert build_status([reading(0.99)], {"GPU-0": False}, Load(), endpoint=None, heartbeat=0)["admitting"] is False
    assert build_status([], {}, Load(), endpoint=None, heartbeat=0)["admitting"] is True  # no GPU source


def test_gpu_admission_has_hysteresis_on_memory_and_utilisation():
    state = GossipState()
    seen = []
    for memory, util in [(0.5, 0.5), (0.925, 0.5), (0.90, 0.5), (0.87, 0.5), (0.5, 0.96), (0.5, 0.93), (0.5, 0.85)]:
        seen.append(state.admission.update([reading(memory, util=util)], state.settings)["GPU-0"])
    assert seen == [True, False, False, True, False, False, True]


@pytest.mark.parametrize("change, reason", [
    (dict(memory=0.5), None),
    (dict(memory=0.54), None),
    (dict(memory=0.56), "memory-step"),
    (dict(memory=0.5, admitting=False), "gpu-threshold"),
    (dict(memory=0.5, uuid="GPU-9"), "gpus"),
])
def test_change_reason(change, reason):
    settings = GossipSettings()
    before = build_status([reading(0.5)], {"GPU-0": True, "GPU-1": True}, Load(), endpoint="e", heartbeat=0)
    r = reading(change["memory"], uuid=change.get("uuid", "GPU-0"))
    after = build_status([r, reading(0.1, uuid="GPU-1", index=1)] if "admitting" in change else [r],
                         {r.uuid: change.get("admitting", True), "GPU-1": True}, Load(), endpoint="e", heartbeat=5)
    if "admitting" in change:
        before = build_status([reading(0.5), reading(0.1, uuid="GPU-1", index=1)], {"GPU-0": True, "GPU-1": True},
                              Load(), endpoint="e", heartbeat=0)
    assert change_reason(before, after, settings) == reason


def test_admitting_flip_and_endpoint_change_are_reasons():
    s = GossipSettings()
    a = build_status([reading(0.5)], {"GPU-0": True}, Load(), endpoint="e", heartbeat=0)
    assert change_reason(None, a, s) == "first"
    assert change_reason(a, build_status([reading(0.5)], {"GPU-0": True}, Load(), endpoint="f", heartbeat=0),
                         s) == "endpoint"
    assert change_reason(a, build_status([reading(0.5)], {"GPU-0": True}, Load(draining=True), endpoint="e",
                                         heartbeat=0), s) == "admitting"
    load_only = build_status([reading(0.5)], {"GPU-0": True}, Load(running=40), endpoint="e", heartbeat=9)
    assert change_reason(a, load_only, s) is None  # load changes ride the heartbeat


def run(state: GossipState, memories, *, dt: float = 0.2, fail_at=()):
    """Feed one sample per tick; returns [(tick, reason, admitting)] of attempted publications."""
    out = []
    for tick, memory in enumerate(memories):
        now = tick * dt
        plan = state.plan([reading(memory)], Load(), now, 1_700_000_000 + now)
        if plan is None:
            continue
        out.append((tick, plan.reason, plan.status["admitting"]))
        if tick in fail_at:
            state.failed(now)
        else:
            state.published(plan, now)
    return out


def test_steady_state_publishes_only_heartbeats():
    state = GossipState(GossipSettings(heartbeat_s=2))
    out = run(state, [0.5] * 51)  # 10 s of 200 ms samples
    assert [r for _, r, _ in out] == ["first"] + ["heartbeat"] * 5
    assert [t for t, _, _ in out] == [0, 10, 20, 30, 40, 50]


def test_threshold_crossing_goes_out_on_the_crossing_sample():
    state = GossipState(GossipSettings(heartbeat_s=10, max_patches_per_s=2))
    memories = [0.5] * 5 + [0.93]
    out = run(state, memories)
    assert out[-1] == (5, "admitting", False)  # one GPU: the node flips with it


def test_rate_limit_holds_changes_back_and_then_sends_the_latest():
    state = GossipState(GossipSettings(heartbeat_s=10, max_patches_per_s=1))  # one patch a second = 5 ticks
    memories = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.85, 0.85, 0.85]
    out = run(state, memories)
    ticks = [t for t, _, _ in out]
    assert ticks == [0, 5, 10]
    assert all(b - a >= 5 for a, b in zip(ticks, ticks[1:]))


def test_failed_patch_is_retried_with_backoff_and_not_forgotten():
    state = GossipState(GossipSettings(heartbeat_s=10, max_patches_per_s=100))
    out = run(state, [0.5] * 12, dt=0.2, fail_at={0, 3})
    # first try fails at tick 0; retried after 0.5 s (tick 3) which fails too; then after 1 s (tick 8)
    assert [(t, r) for t, r, _ in out] == [(0, "first"), (3, "first"), (8, "first")]
    assert state.last_status is not None and state.failures == 0


def test_an_adapter_loaded_or_unloaded_while_running_goes_out_at_once():
    s = GossipSettings()
    a = build_status([reading(0.5)], {"GPU-0": True}, Load(), endpoint="e", heartbeat=0, models=["m", "m-sql"])
    more = build_status([reading(0.5)], {"GPU-0": True}, Load(), endpoint="e", heartbeat=1,
                        models=["m", "m-sql", "m-chat"])
    assert change_reason(a, more, s) == "models" and change_reason(more, a, s) == "models"
    assert change_reason(a, dict(a, lastHeartbeat=more["lastHeartbeat"]), s) is None
