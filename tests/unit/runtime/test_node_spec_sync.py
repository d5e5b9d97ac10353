"""An edited InferenceNode reaches a running runtime: scheduler marks live, the rest flagged for restart."""

from __future__ import annotations

import copy

import pytest

from zerolayer.contract import Priority
from zerolayer.runtime.node.incluster import NodeSpecSync
from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig
from zerolayer.runtime.scheduler.api import Pressure


def inode(**scheduler) -> dict:
    return {"metadata": {"name": "gpu-node-0"},
            "spec": {"nodeName": "gpu-node-0", "models": [{"name": "m", "source": "/m"}],
                     "runtime": {"engine": "synthetic", "port": 18080},
                     "scheduler": {"memoryThreshold": 0.92, "resumeThreshold": 0.88, "normalThreshold": 0.97,
                                   **scheduler}}}


class Reader:
    """Stands in for KubeReader (our own wrapper), returning whatever the test last put there."""

    def __init__(self, obj):
        self.obj = obj

    def inference_node(self, name):
        return copy.deepcopy(self.obj)


def pressure(fraction: float, at: float) -> Pressure:
    return Pressure(memory_fraction=fraction, running=(), waiting=0, sampled_at=at)


async def test_scheduler_marks_apply_live_and_keep_the_gate_state():
    scheduler = MicroScheduler(SchedulerConfig(low_shed_at=0.92, low_resume_below=0.88))
    reader = Reader(inode())
    sync = NodeSpecSync(reader, "gpu-node-0", {}, lambda marks: scheduler.reconfigure(SchedulerConfig.from_mapping(marks)))
    sync.prime(reader.obj)
    assert await sync.sync_once() is False  # nothing changed

    scheduler.observe(pressure(0.85, 1.0), 1.0)
    assert scheduler._state.gate.admitting(Priority.LOW)
    reader.obj = inode(memoryThreshold=0.8, resumeThreshold=0.7)
    assert await sync.sync_once() is True
    assert scheduler.config.low_shed_at == 0.8 and scheduler.config.low_resume_below == 0.7
    scheduler.observe(pressure(0.85, 2.0), 2.0)  # 0.85 is now above the new mark
    assert not scheduler._state.gate.admitting(Priority.LOW)
    scheduler.observe(pressure(0.75, 3.0), 3.0)  # between resume and shed: still shedding (hysteresis)
    assert not scheduler._state.gate.admitting(Priority.LOW)
    assert sync.restart_needed == []


async def test_engine_and_port_changes_are_flagged_for_restart_not_applied():
    applied = []
    reader = Reader(inode())
    sync = NodeSpecSync(reader, "gpu-node-0", {}, applied.append)
    sync.prime(reader.obj)
    changed = inode()
    changed["spec"]["runtime"]["port"] = 18099
    reader.obj = changed
    assert await sync.sync_once() is False
    assert applied == [] and sync.restart_needed == ["listen"]


async def test_invalid_marks_are_refused_and_the_old_ones_kept():
    scheduler = MicroScheduler(SchedulerConfig(low_shed_at=0.92, low_resume_below=0.88))
    reader = Reader(inode())
    sync = NodeSpecSync(reader, "gpu-node-0", {}, lambda marks: scheduler.reconfigure(SchedulerConfig.from_mapping(marks)))
    sync.prime(reader.obj)
    reader.obj = inode(memoryThreshold=0.5, resumeThreshold=0.9)  # resume above shed: invalid
    with pytest.raises(ValueError):
        await sync.sync_once()
    assert scheduler.config.low_shed_at == 0.92


async def test_a_fixed_spec_after_an_invalid_one_is_applied():
    scheduler = MicroScheduler(SchedulerConfig(low_shed_at=0.92, low_resume_below=0.88))
    reader = Reader(inode())
    sync = NodeSpecSync(reader, "gpu-node-0", {}, lambda marks: scheduler.reconfigure(SchedulerConfig.from_mapping(marks)))
    sync.prime(reader.obj)
    reader.obj = inode(memoryThreshold=0.5, resumeThreshold=0.9)
    with pytest.raises(ValueError):
        await sync.sync_once()
    reader.obj = inode(memoryThreshold=0.9, resumeThreshold=0.8)
    assert await sync.sync_once() is True and scheduler.config.low_shed_at == 0.9


async def test_a_second_vllm_model_is_flagged_for_restart():
    node = inode()
    node["spec"]["runtime"] = {"engine": "vllm", "port": 18080, "gpus": 0}
    reader = Reader(node)
    sync = NodeSpecSync(reader, "gpu-node-0", {}, lambda marks: None)
    sync.prime(reader.obj)
    grown = copy.deepcopy(node)
    grown["spec"]["models"].append({"name": "m2", "source": "/m2"})  # one engine becomes two (engines:)
    reader.obj = grown
    await sync.sync_once()
    assert {"engine", "engines"} <= set(sync.restart_needed)


# ------------------------------------------------------------------ LoRA adapters: live, not a restart
def vllm_node(*adapters: str, **runtime) -> dict:
    node = inode()
    node["spec"]["runtime"] = {"engine": "vllm", "port": 18080, "gpus": 0, **runtime}
    node["spec"]["models"][0]["loras"] = [{"name": a, "source": {"path": f"/adapters/{a}"}} for a in adapters]
    node["metadata"]["generation"] = 1
    return node


def adapter_sync(node: dict) -> tuple[NodeSpecSync, Reader, list]:
    from zerolayer.runtime.node.incluster import AdapterSync

    asked: list = []

    async def load(wanted):  # records what the spec sync asks the engine's adapters to become
        asked.append(copy.deepcopy(wanted))
        return AdapterSync(changed=["x"])

    reader = Reader(node)
    sync = NodeSpecSync(reader, "gpu-node-0", {}, lambda marks: None, load_adapters=load)
    sync.prime(node)
    return sync, reader, asked


@pytest.mark.parametrize("before, after", [(("a",), ("a", "b")), (("a", "b"), ("b",)), (("a",), ("c",))])
async def test_adapter_changes_load_live_and_need_no_restart(before, after):
    sync, reader, asked = adapter_sync(vllm_node(*before))
    reader.obj = vllm_node(*after)
    reader.obj["metadata"]["generation"] = 2
    assert await sync.sync_once() is True
    assert asked == [{"m": {a: f"/adapters/{a}" for a in after}}] and sync.restart_needed == []


@pytest.mark.parametrize("before, after, restart", [
    ((), ("a",), True),     # the first adapter turns LoRA on: vLLM fixes that at start
    (("a",), (), True),     # and the last one off
    (("a",), ("b",), False),
])
async def test_lora_on_or_off_is_a_restart_and_adapters_are_not(before, after, restart):
    sync, reader, _ = adapter_sync(vllm_node(*before))
    reader.obj = vllm_node(*after)
    reader.obj["metadata"]["generation"] = 2
    await sync.sync_once()
    assert (sync.restart_needed == ["engine"]) is restart


async def test_enable_lora_in_engine_args_keeps_lora_on_with_no_adapter():
    sync, reader, asked = adapter_sync(vllm_node(engineArgs={"enable_lora": True}))
    reader.obj = vllm_node("a", engineArgs={"enable_lora": True})
    reader.obj["metadata"]["generation"] = 2
    await sync.sync_once()
    assert sync.restart_needed == [] and asked == [{"m": {"a": "/adapters/a"}}]


async def test_a_heartbeat_asks_the_engine_nothing():
    sync, reader, asked = adapter_sync(vllm_node("a"))
    assert await sync.sync_once() is False and asked == []  # same generation: a status update


def test_lora_args_leave_room_for_adapters_added_later(tmp_path):
    import json

    from zerolayer.runtime.engine.lora import LoraAdapter, lora_args

    for name, rank in (("small", 8), ("wide", 48)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"r": rank}))
    small, wide = LoraAdapter("small", str(tmp_path / "small")), LoraAdapter("wide", str(tmp_path / "wide"))
    assert lora_args([small], {}) == {"enable_lora": True, "max_loras": 1, "max_lora_rank": 16}
    assert lora_args([small, wide], {})["max_lora_rank"] == 64
    assert lora_args([small], {"max_lora_rank": 8}) == {"enable_lora": True, "max_loras": 1}
    assert lora_args([], {}) == {}
