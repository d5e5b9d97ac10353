"""Issue 7 on the real API server: the auditor's TenantQuota.status.usage writes fit the CRD, show in
`kubectl get tenantquotas`, leave the operator's fields alone and stay within the rate bound."""

from __future__ import annotations

import json
import time

import pytest

from zerolayer.bpf.kube import QuotaStatusWriter, TenantQuotaApi, usage_fields

pytestmark = pytest.mark.e2e
NAME = "usage-probe"


def test_auditor_usage_lands_in_status_at_a_bounded_rate(cluster):
    quota = {"apiVersion": "zerolayer.io/v1alpha1", "kind": "TenantQuota", "metadata": {"name": NAME},
             "spec": {"tenant": "usage-probe", "apiKeySecretRef": {"name": "none"}, "namespaces": ["probe"],
                      "tokensPerMinute": 1000, "requestsPerMinute": 10}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(quota))
    try:
        # What the operator owns in status must survive the auditor's patches.
        cluster.kubectl("patch", "tenantquota", NAME, "--subresource=status", "--type=merge", "-p",
                        json.dumps({"status": {"phase": "Ready", "keyCount": 2}}))
        clock = [1_000_000.0]
        writer = QuotaStatusWriter(TenantQuotaApi(cluster.kubeconfig), min_interval_s=15, clock=lambda: clock[0])
        writer.refresh()
        first = usage_fields(time.time() - 30, 420, 3, 120, 300, "0.0123")
        assert writer.publish({"usage-probe": first, "unknown-tenant": first}) == 1  # unknown: no quota, no patch
        status = cluster.kubectl_json("get", "tenantquota", NAME)["status"]
        assert status["phase"] == "Ready" and status["keyCount"] == 2
        usage = status["usage"]
        assert usage["tokensThisWindow"] == 420 and usage["outputTokensTotal"] == 300 and usage["cost"] == "0.0123"
        assert usage["lastUpdate"].endswith("Z")
        row = cluster.kubectl("get", "tenantquota", NAME).stdout.splitlines()[1].split()
        assert row[:4] == [NAME, "usage-probe", "1000", "420"]  # the Used column reads the auditor's field

        second = usage_fields(time.time(), 500, 4, 130, 370, "0.0150")
        clock[0] += 5
        assert writer.publish({"usage-probe": second}) == 0  # within 15 s: held back
        clock[0] += 11
        assert writer.publish({"usage-probe": second}) == 1
        assert writer.publish({"usage-probe": second}) == 0  # unchanged: nothing to write
        assert cluster.kubectl_json("get", "tenantquota", NAME)["status"]["usage"]["tokensThisWindow"] == 500
        assert writer.patches == 2
    finally:
        cluster.kubectl("delete", "tenantquota", NAME, "--wait=false", check=False)
