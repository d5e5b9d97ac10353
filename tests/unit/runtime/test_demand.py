"""Scale from zero, the runtime's half: a request for a model not served here is refused retryably
and its demand recorded (runtime/zerolayer/runtime/serving/demand.py), then gossiped as status.demand
(gossip/status.py), where the operator reads it (tests/unit/operator/test_fleet.py)."""

from __future__ import annotations

import json

from zerolayer import contract
from zerolayer.runtime.serving.demand import RETRY_AFTER_S, DemandLedger
from zerolayer.runtime.gossip.status import GossipSettings, GossipState, Load, build_status, change_reason
from zerolayer.runtime.protocol.events import Reject, RequestHead
from tests.unit.runtime.test_glue_fleet import KEY, application


def head(model: str) -> RequestHead:
    return RequestHead(1, "POST", "/v1/messages", {"x-api-key": KEY, "content-type": "application/json",
                                                   contract.MODEL_HINT[0]: model}, "node", False)


def test_ledger_counts_bursts_and_forgets_the_oldest_name():
    ledger = DemandLedger(max_models=2, quiet_s=60)
    ledger.record("llama", now=0.0)
    ledger.record("llama", now=10.0)
    assert ledger.entries() == [{"model": "llama", "requests": 2, "lastRequested": "1970-01-01T00:00:10.000Z"}]
    ledger.record("llama", now=100.0)  # 90 s quiet: a new burst
    assert ledger.entries()[0]["requests"] == 1
    ledger.record("b", now=101.0)
    ledger.record("c", now=102.0)  # a third name: the least recently asked (llama) goes
    assert [e["model"] for e in ledger.entries()] == ["b", "c"]


def test_ledger_ignores_names_no_inference_node_could_declare():
    ledger = DemandLedger()
    for bad in ("", "-x", "a b", "x" * 129, "é"):
        ledger.record(bad, now=1.0)
    assert ledger.entries() == [] and ledger.version == 0


async def test_standalone_unknown_model_is_still_a_404():
    app = await application()
    verdict = app.gate(1, head("not-here"))
    assert isinstance(verdict, Reject) and verdict.status == 404


async def test_in_a_cluster_a_model_not_served_here_is_a_retryable_503_and_recorded():
    ledger = DemandLedger(clock=lambda: 1000.0)
    app = await application(demand=ledger)
    verdict = app.gate(1, head("llama-70b"))
    assert isinstance(verdict, Reject) and verdict.status == 503
    headers = dict(verdict.headers)
    assert headers[contract.ERROR_HEADER] == "MODEL_UNAVAILABLE"
    assert float(headers["retry-after"]) == RETRY_AFTER_S
    assert headers.get("x-should-retry", "true") == "true"
    assert "llama-70b" in json.loads(verdict.body)["error"]["message"]
    app.gate(1, head("llama-70b"))
    assert ledger.entries() == [{"model": "llama-70b", "requests": 2, "lastRequested": "1970-01-01T00:16:40.000Z"}]


def test_status_carries_demand_and_a_new_name_or_burst_goes_out_at_once():
    entries = [{"model": "m", "requests": 1, "lastRequested": "1970-01-01T00:00:01.000Z"}]
    status = build_status([], {}, Load(), endpoint=None, heartbeat=0.0, demand=entries)
    assert status["demand"] == entries
    assert "demand" not in build_status([], {}, Load(), endpoint=None, heartbeat=0.0)
    settings = GossipSettings()
    before = build_status([], {}, Load(), endpoint=None, heartbeat=0.0)
    assert change_reason(before, status, settings) == "demand"
    grown = build_status([], {}, Load(), endpoint=None, heartbeat=1.0,
                         demand=[{**entries[0], "requests": 5}])
    assert change_reason(status, grown, settings) is None  # rides the heartbeat
    assert change_reason(grown, status, settings) == "demand"  # count went down: a new burst


def test_gossip_state_publishes_demand_on_the_next_tick():
    state = GossipState(GossipSettings(heartbeat_s=10))
    first = state.plan([], Load(), 0.0, 0.0)
    assert first is not None
    state.published(first, 0.0)
    assert state.plan([], Load(), 1.0, 1.0) is None
    plan = state.plan([], Load(), 2.0, 2.0, demand=[{"model": "m", "requests": 1, "lastRequested": "x"}])
    assert plan is not None and plan.reason == "demand"


def test_publisher_sends_the_ledger_as_status_demand():
    import io

    from zerolayer.runtime.gossip import GossipPublisher, PrintSink

    ledger = DemandLedger(clock=lambda: 0.0)
    out = io.StringIO()
    publisher = GossipPublisher("solo", PrintSink(out), readings=lambda: (), load=Load,
                                settings=GossipSettings(max_patches_per_s=1e6), demand=ledger.entries)
    publisher.step()
    ledger.record("m")
    publisher.step()
    last = json.loads(out.getvalue().splitlines()[-1])
    assert last["wouldPatch"]["status"]["demand"] == [{"model": "m", "requests": 1,
                                                       "lastRequested": "1970-01-01T00:00:00.000Z"}]


async def test_a_tenant_not_allowed_the_model_scales_nothing():
    import dataclasses

    ledger = DemandLedger(clock=lambda: 1000.0)
    app = await application(demand=ledger)
    acme = app.tenants.authenticate({"x-api-key": KEY})
    narrowed = dataclasses.replace(acme.policy, allowed_models=frozenset({"tiny"}))
    from zerolayer.runtime.serving.gate import model_refusal

    refused = model_refusal("llama-70b", ["synth"], ledger, dataclasses.replace(acme, policy=narrowed))
    assert refused.http_status == 404 and ledger.entries() == []
    assert model_refusal("llama-70b", ["synth"], ledger, acme).retry_after_s == RETRY_AFTER_S
    assert [e["model"] for e in ledger.entries()] == ["llama-70b"]
