"""Review finding 7: each runtime read every tenant's Secret every 10 s (one GET per tenant per
cycle: ~20,000 requests/s at 200 nodes x 1,000 tenants). A sync now costs a constant number of
reads however many tenants there are: the TenantQuota list and the one Secret of key hashes
the operator publishes per fleet."""

from __future__ import annotations

import pytest

from tests.regression.incluster_fakes import Reader, quota
from zerolayer.runtime.node.incluster import TenantSync

pytestmark = [pytest.mark.regression, pytest.mark.timeout(60)]


@pytest.mark.asyncio(loop_scope="session")
async def test_reads_per_sync_do_not_grow_with_the_number_of_tenants():
    costs = {}
    for tenants in (10, 1000):
        reader = Reader([quota(f"t{i}") for i in range(tenants)], {f"t{i}-keys": [f"sk-{i}"] for i in range(tenants)})
        sync = TenantSync(reader, lambda t: None, namespace="zerolayer")
        await sync.sync_once()
        before = reader.requests()
        reader.keys["t1-keys"] = ["sk-rotated"]  # one change
        await sync.sync_once()
        await sync.sync_once()  # and none
        costs[tenants] = (reader.requests() - before) / 2
    assert costs[1000] == costs[10] <= 2, f"API reads per sync by tenant count: {costs}"
