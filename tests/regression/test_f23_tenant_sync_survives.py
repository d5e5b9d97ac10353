"""Review finding 23: ``TenantSync.run`` caught only ``ClusterReadError``; any other exception
ended the background task silently and revocations stopped propagating. It now survives any
exception, counts it, and keeps syncing."""

from __future__ import annotations

import asyncio

import pytest

from tests.regression.incluster_fakes import Reader, quota
from zerolayer.runtime.node.incluster import TenantSync
from zerolayer.runtime.tenants import TenantDirectory

pytestmark = [pytest.mark.regression, pytest.mark.timeout(30)]


@pytest.mark.asyncio(loop_scope="session")
async def test_an_unexpected_error_is_counted_and_the_loop_keeps_running():
    reader = Reader([quota("acme")], {"acme-keys": ["sk-old"]})
    boom = {"left": 2}
    list_quotas = reader.tenant_quotas

    def flaky():  # type: ignore[no-untyped-def]
        if boom["left"]:
            boom["left"] -= 1
            raise ValueError("a malformed object the code did not expect")
        return list_quotas()

    reader.tenant_quotas = flaky
    directory = TenantDirectory()
    sync = TenantSync(reader, directory.replace, namespace="zerolayer", interval_s=0.01).start()
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while directory.authenticate({"x-api-key": "sk-old"}) is None:
            assert not sync._task.done(), f"the sync task died: {sync._task.exception()!r}"
            assert asyncio.get_running_loop().time() < deadline, "the sync never recovered"
            await asyncio.sleep(0.01)
        assert sync.errors == 2
        reader.keys["acme-keys"] = ["sk-new"]  # and it keeps following changes
        while directory.authenticate({"x-api-key": "sk-old"}) is not None:
            assert asyncio.get_running_loop().time() < deadline, "revocation did not propagate"
            await asyncio.sleep(0.01)
    finally:
        await sync.stop()
