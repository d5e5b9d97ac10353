"""The GPU map of a busy vLLM node (issue 27).

NVML on a GPU that vLLM serves from reads ~0.91 of its memory (pre-allocated at start) and ~99 %
utilisation while the engine works: ``SimulatedGpuSource.under_vllm()`` is that double, behind the
``GpuSource`` interface of the real adapter. Before the fix the runtime published such a GPU as
not admitting (utilisation above 0.95) and every reader dropped it again by the same threshold,
so a vLLM node left the map exactly when it was serving.
"""

from __future__ import annotations

from zerolayer.gpumap import node_from_object
from zerolayer.runtime.gossip.status import GossipSettings, GossipState, Load
from zerolayer.runtime.gpu import SimulatedGpuSource

WALL = 1_800_000_000.0


def publish(state: GossipState, kv: float, now: float) -> dict:
    readings = SimulatedGpuSource.under_vllm(gpus=2).sample()
    plan = state.plan(readings, Load(running=8, waiting=0, kv_cache_usage=kv), now, WALL + now)
    if plan is None:  # nothing that matters changed: what was published stands
        assert state.last_status is not None
        return state.last_status
    state.published(plan, now)
    return plan.status


def read(status: dict, **scheduler) -> object:
    return node_from_object({"metadata": {"name": "n"}, "spec": {"nodeName": "n", "scheduler": scheduler},
                             "status": status}, now=WALL + 100)


def test_a_busy_vllm_gpu_admits_while_its_kv_cache_has_room():
    state = GossipState(GossipSettings(), endpoint="https://n:8443", engine_preallocates=True)
    status = publish(state, kv=0.30, now=100.0)
    assert status["pressureSignal"] == "kvCache"
    assert status["admitting"] and status["gpusAdmitting"] == "2/2"
    assert all(g["utilization"] > 0.95 for g in status["gpus"])  # published as read: it is information
    node = read(status)
    assert node.admitting and node.gpus_admitting == "2/2" and node.pressure_signal == "kvCache"


def test_a_vllm_node_stops_admitting_when_its_kv_cache_fills_and_resumes_below_the_resume_mark():
    state = GossipState(GossipSettings(), endpoint="https://n:8443", engine_preallocates=True)
    publish(state, kv=0.30, now=100.0)
    full = publish(state, kv=0.95, now=101.0)
    assert not full["admitting"] and not read(full).admitting
    assert not publish(state, kv=0.90, now=102.0)["admitting"]  # hysteresis band: still out
    assert publish(state, kv=0.50, now=103.0)["admitting"]


def test_an_engine_that_does_not_preallocate_keeps_the_gpu_memory_and_utilisation_rules():
    state = GossipState(GossipSettings(), endpoint="https://n:8443", engine_preallocates=False)
    status = publish(state, kv=0.0, now=100.0)
    assert status["pressureSignal"] == "gpuMemory"
    assert not status["admitting"]  # 99 % utilisation is load for this engine
    status_claiming = dict(status, admitting=True, gpus=[dict(g, admitting=True) for g in status["gpus"]])
    assert read(status_claiming).gpus_admitting == "0/2"  # the reader applies the threshold itself


def test_the_spec_setting_overrides_auto():
    settings = GossipSettings.from_spec({"scheduler": {"pressureSignal": "gpuMemory"}})
    state = GossipState(settings, endpoint="https://n:8443", engine_preallocates=True)
    assert publish(state, kv=0.0, now=100.0)["pressureSignal"] == "gpuMemory"


def test_a_node_that_publishes_no_signal_is_read_as_before():
    status = {"admitting": True, "lastHeartbeat": "2027-01-15T08:01:40.000Z", "endpoint": "https://n:8443",
              "gpus": [{"uuid": "G", "index": 0, "utilization": 0.99, "admitting": True}]}
    node = read(status)
    assert node.pressure_signal is None and not node.admitting and node.reason == "no GPU admitting"


def test_the_sdk_routes_to_a_busy_vllm_node_through_the_map_endpoint_and_the_watched_status():
    """The whole chain a client sees: what the runtime publishes, read back by the map endpoint
    (``render_map_document``) and by a watch of the InferenceNode objects, then the SDK's router."""
    import json

    from zerolayer.client.nodes import StaticNodeMap, nodes_from_document
    from zerolayer.client.routing import Router
    from zerolayer.gpumap import FleetMap, render_map_document

    state = GossipState(GossipSettings(), endpoint="https://busy:8443", engine_preallocates=True)
    obj = {"metadata": {"name": "busy"}, "spec": {"nodeName": "busy"}, "status": publish(state, kv=0.4, now=100.0)}
    document = json.loads(render_map_document(FleetMap.from_objects([obj], now=WALL + 100)))
    for nodes in (nodes_from_document(document), nodes_from_document({"items": [obj]})):
        router = Router(StaticNodeMap(nodes), wall_clock=lambda: WALL + 100)
        assert [n.name for n in router.eligible()] == ["busy"]
        assert all(g["utilization"] > 0.95 for g in nodes[0].gpus)
