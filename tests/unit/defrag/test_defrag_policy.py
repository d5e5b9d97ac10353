"""gpu-defragd's pure parts: policy from spec, fragmentation, reset decisions, pod scope, the SIGUSR1 answer."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from zerolayer.runtime.defrag.daemon import DefragMetrics, Defragd, LogEvents
from zerolayer.runtime.defrag.errors import DefragError
from zerolayer.runtime.defrag.fragmentation import fragmentation
from zerolayer.runtime.defrag.policy import DefragPolicy, reset_decisions
from zerolayer.runtime.defrag.release import ReleaseOnSignal, release
from zerolayer.runtime.defrag.scope import PidAllowlist, PodCgroup, ProcessTree, pod_cgroup_of
from zerolayer.runtime.gpu.api import GpuReading
from zerolayer.runtime.gpu.simulated import SimulatedGpuSource

GiB = 1024**3


def gpu(frag: float | None, uuid: str = "G0", index: int = 0) -> GpuReading:
    return GpuReading(uuid=uuid, index=index, name="g", memory_used_bytes=GiB, memory_total_bytes=80 * GiB,
                      utilization=0.1, fragmentation=frag)


def test_policy_from_spec_and_overrides():
    spec = {"defrag": {"intervalSeconds": 60, "idleMemoryFraction": 0.1, "idleMinutes": 2,
                       "resetFragmentation": 0.3, "allowReset": True, "dryRun": False}}
    p = DefragPolicy.from_spec(spec, dry_run=True, interval_s=None)
    assert (p.interval_s, p.idle_memory_fraction, p.idle_s, p.reset_fragmentation, p.allow_reset, p.dry_run) == \
        (60, 0.1, 120, 0.3, True, True)
    assert DefragPolicy.from_spec({}) == DefragPolicy()
    assert DefragPolicy().idle_s == 1800 and DefragPolicy().interval_s == 300


@pytest.mark.parametrize("reserved, allocated, expected", [(0, 0, 0.0), (100, 75, 0.25), (100, 100, 0.0),
                                                           (100, 120, 0.0)])
def test_fragmentation_definition(reserved, allocated, expected):
    assert fragmentation(reserved, allocated) == expected


def test_reset_needs_permission_and_a_drained_node():
    allowed = DefragPolicy(allow_reset=True)
    readings = [gpu(0.30), gpu(0.10, "G1", 1), gpu(None, "G2", 2)]
    decisions, known = reset_decisions(readings, {"G2": 0.5}, DefragPolicy(), in_flight=0)
    assert [(d.gpu_uuid, d.action) for d in decisions] == [("G0", "refused"), ("G2", "refused")]
    assert known == {"G0": 0.30, "G1": 0.10, "G2": 0.5}
    assert [d.action for d in reset_decisions(readings[:1], {}, allowed, in_flight=3)[0]] == ["deferred"]
    assert [d.action for d in reset_decisions(readings[:1], {}, allowed, in_flight=None)[0]] == ["deferred"]
    assert [d.action for d in reset_decisions(readings[:1], {}, allowed, in_flight=0)[0]] == ["reset"]


def node_with(load, *, allow=True, dry=False, frag=0.4):
    from zerolayer.gpumap import utc_now_rfc3339

    return {"metadata": {"name": "n"}, "spec": {"defrag": {"allowReset": allow, "dryRun": dry}},
            "status": {"load": load, "lastHeartbeat": utc_now_rfc3339(),
                       "gpus": [{"uuid": "SIM-GPU-0000", "index": 0, "fragmentation": frag}]}}


def test_daemon_resets_only_when_drained_and_reports_each_action():
    resets, events, metrics = [], LogEvents(), DefragMetrics()
    state = {"node": node_with({"running": 2, "waiting": 0})}
    daemon = Defragd(SimulatedGpuSource.constant(0.5), PidAllowlist([]), node=lambda: state["node"],
                     events=events, metrics=metrics, reset=resets.append, clock=lambda: 0.0)
    daemon.scan_once()
    assert resets == [] and events.recorded[-1][0] == "GpuResetDeferred"
    state["node"] = node_with({"running": 0, "waiting": 0}, dry=True)
    daemon.scan_once()
    assert resets == [] and events.recorded[-1][1].startswith("dry run: would reset")
    state["node"] = node_with({"running": 0, "waiting": 0})
    daemon.scan_once()
    assert resets == [0] and events.recorded[-1][0] == "GpuReset"
    assert metrics.value("zerolayer_gpu_fragmentation_ratio", gpu="SIM-GPU-0000", index="0") == 0.4
    assert metrics.value("zerolayer_defrag_actions_total", action="reset", mode="live", result="ok") == 1
    assert metrics.value("zerolayer_defrag_actions_total", action="reset", mode="dry_run", result="ok") == 1
    assert metrics.value("zerolayer_defrag_actions_total", action="reset_deferred", mode="live", result="ok") == 1


def test_failed_reset_is_a_warning_event_and_a_failed_metric():
    def fail(index):
        raise DefragError("nvidia-smi said no")

    events, metrics = LogEvents(), DefragMetrics()
    daemon = Defragd(SimulatedGpuSource.constant(0.5), PidAllowlist([]), events=events, metrics=metrics,
                     node=lambda: node_with({"running": 0, "waiting": 0}), reset=fail)
    daemon.scan_once()
    assert events.recorded[-1][0] == "GpuResetFailed" and events.recorded[-1][3] == "Warning"
    assert metrics.value("zerolayer_defrag_actions_total", action="reset", mode="live", result="failed") == 1


def test_scopes():
    me = os.getpid()
    assert PidAllowlist([me]).contains(me) and not PidAllowlist([me]).contains(1)
    assert ProcessTree(os.getppid()).contains(me) and not ProcessTree(me).contains(os.getppid())
    assert pod_cgroup_of(["/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podab12.slice/"
                          "cri-containerd-ff.scope"]) == \
        "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podab12.slice"
    assert pod_cgroup_of(["/kubepods/burstable/pod1234/abcd"]) == "/kubepods/burstable/pod1234"
    assert pod_cgroup_of(["/user.slice/session-1.scope"]) is None
    here = PodCgroup(pod_cgroup="/")  # root: every process; real pods are a subtree
    assert here.contains(me)
    assert not PodCgroup(pod_cgroup="/kubepods/burstable/pod-not-here").contains(me)


def test_pod_cgroup_outside_kubernetes_says_what_to_do(monkeypatch):
    monkeypatch.setattr("zerolayer.runtime.defrag.scope._cgroup_paths", lambda pid: ["/user.slice/x.scope"])
    with pytest.raises(DefragError, match="--pod-root"):
        PodCgroup()


class ReleasingEngine:
    """Test double for an engine adapter with a release hook."""

    def __init__(self):
        self.released = 0

    async def release_memory(self):
        self.released += 1


async def test_release_calls_the_engine_hook_and_collects():
    engine = ReleasingEngine()
    steps = await release(engine)
    assert engine.released == 1 and steps[0] == "engine.release_memory" and steps[1].startswith("gc.collect")
    assert (await release(object()))[0].startswith("gc.collect")  # engines without the hook


class PrefixCacheThatMustStay:
    """A stand-in for vLLM's AsyncLLM: resetting its prefix cache would free nothing (vLLM counts idle
    prefix blocks as free) and lose what prefix-aware routing sends requests here for."""

    errored = False

    async def reset_prefix_cache(self):
        raise AssertionError("gpu-defragd's nudge must not reset vLLM's prefix cache")


async def test_a_vllm_engine_releases_nothing_and_keeps_its_prefix_cache(caplog):
    from zerolayer.runtime.engine.base import MemoryRelease
    from zerolayer.runtime.engine.router import ModelRouter
    from zerolayer.runtime.engine.synthetic import SyntheticEngine
    from zerolayer.runtime.engine.vllm_engine import NOTHING_TO_RELEASE, VllmEngine

    engine = VllmEngine("/models/m", served_name="m")
    engine._llm = PrefixCacheThatMustStay()  # started, as far as release_memory can tell
    engine.served_prefixes.observe([1, 2, 3])
    with caplog.at_level("DEBUG", logger="zerolayer.runtime.engine.vllm_engine"):
        steps = await release(engine)
    assert steps[0] == f"engine.release_memory(freed 0 bytes: {NOTHING_TO_RELEASE})"
    assert NOTHING_TO_RELEASE in caplog.text  # said at debug, why nothing was done
    assert len(engine.served_prefixes) == 3  # the gossiped digest keeps routing prefixes here
    router = ModelRouter([engine, SyntheticEngine(("s",))])  # the synthetic engine has no hook
    assert await router.release_memory() == MemoryRelease(freed_bytes=0, note=NOTHING_TO_RELEASE)


@pytest.mark.timeout(10)
async def test_sigusr1_runs_release_on_the_loop():
    engine = ReleasingEngine()
    done = asyncio.Event()
    handler = ReleaseOnSignal(asyncio.get_running_loop(), engine, on_release=lambda steps: done.set()).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        await asyncio.wait_for(done.wait(), 5)
    finally:
        handler.remove()
    assert engine.released == 1 and handler.count == 1
