"""An edited InferenceNode reaches a running runtime: scheduler marks live, the rest flagged for restart."""

from __future__ import annotations

import copy

import pytest

from zerolayer.contract import Priority
from zerolayer.runtime.incluster import NodeSpecSync
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
