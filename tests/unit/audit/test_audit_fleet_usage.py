"""Billing across nodes: each node's usage is its own entry and the fleet sum is recomputed from all of them
under a resourceVersion precondition (a racing node's entry is never lost), and tenants added after the
auditor started are published from the TenantQuota watch without any LIST."""

from __future__ import annotations

import copy
import threading
from typing import Any

from zerolayer.bpf.errors import QuotaStatusConflict
from zerolayer.bpf.kube import QuotaStatusWriter


class ApiServer:
    """TenantQuotas with the API server's merge-patch and resourceVersion-precondition semantics."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.lists = 0

    def add(self, tenant: str) -> None:
        self.objects[f"{tenant}-quota"] = {"metadata": {"name": f"{tenant}-quota", "resourceVersion": "1"},
                                           "spec": {"tenant": tenant}, "status": {}}

    def list(self) -> list[dict[str, Any]]:
        self.lists += 1
        return copy.deepcopy(list(self.objects.values()))

    def get(self, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.objects[name])

    def patch_status(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        obj = self.objects[name]
        if patch.get("metadata", {}).get("resourceVersion") not in (None, obj["metadata"]["resourceVersion"]):
            raise QuotaStatusConflict("409")
        usage = obj["status"].setdefault("usage", {})
        nodes = usage.setdefault("nodes", {})
        for node, entry in patch["status"]["usage"].pop("nodes").items():
            nodes.setdefault(node, {}).update(entry)
        usage.update(patch["status"]["usage"])
        obj["metadata"]["resourceVersion"] = str(int(obj["metadata"]["resourceVersion"]) + 1)
        return copy.deepcopy(obj)


class Watch:
    """What kubewatch.WatchLoop offers the writer: ``started`` and ``objects``."""

    def __init__(self, server: ApiServer) -> None:
        self.server = server
        self.started = threading.Event()
        self.started.set()

    @property
    def objects(self) -> dict[str, dict[str, Any]]:
        return copy.deepcopy(self.server.objects)


def fields(tokens: int) -> dict[str, Any]:
    return {"windowStart": "2026-12-03T12:00:00Z", "tokensThisWindow": tokens, "requestsThisWindow": 1,
            "inputTokensTotal": tokens, "outputTokensTotal": tokens, "cost": "0.5"}


def test_two_nodes_racing_are_summed_not_overwritten():
    server = ApiServer()
    server.add("acme")
    a = QuotaStatusWriter(server, node="a", watch=Watch(server))
    b = QuotaStatusWriter(server, node="b", watch=Watch(server))
    a.refresh()
    b.refresh()  # both read version 1
    assert a.publish({"acme": fields(10)}) == 1
    assert b.publish({"acme": fields(32)}) == 1  # 409 on the stale version, re-read, summed
    usage = server.objects["acme-quota"]["status"]["usage"]
    assert b.conflicts == 1
    assert set(usage["nodes"]) == {"a", "b"}
    assert usage["inputTokensTotal"] == 42 and usage["tokensThisWindow"] == 42 and usage["cost"] == "1.0"


def test_a_tenant_added_after_start_is_published_from_the_watch():
    server = ApiServer()
    server.add("acme")
    writer = QuotaStatusWriter(server, node="a", watch=Watch(server))
    writer.refresh()
    server.add("late")  # created after the auditor started
    writer.refresh()
    assert writer.publish({"late": fields(7)}) == 1
    assert server.objects["late-quota"]["status"]["usage"]["nodes"]["a"]["inputTokensTotal"] == 7
    assert server.lists == 0  # never polled
