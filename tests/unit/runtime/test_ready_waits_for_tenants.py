"""In cluster the tenants come from TenantQuotas: until they have been read once every key would be
refused, so /readyz is 503 (the pod, and so the InferenceNode, is not Ready) until the first read."""

from __future__ import annotations

import pytest

from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.limits import Limits
from zerolayer.runtime.protocol.events import Accept, RequestHead, RequestReady
from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig, TenantPolicy
from zerolayer.runtime.serving.app import Application
from zerolayer.runtime.serving.metrics import RuntimeMetrics
from zerolayer.runtime.tenants import Tenant, TenantDirectory, key_hash

from .test_count_tokens import Recorder


async def readyz(app: Application) -> int:
    head = RequestHead(1, "GET", "/readyz", {}, "node", True)
    verdict = app.gate(1, head)
    assert isinstance(verdict, Accept)
    channel = Recorder()
    await app.serve(channel, RequestReady(head, b"", verdict.context))
    return channel.status


@pytest.mark.parametrize("known", [True, False])
async def test_readyz_waits_for_the_first_tenant_read_only_when_tenants_come_from_elsewhere(known):
    engine = SyntheticEngine(("synthetic",))
    await engine.start()
    tenants = TenantDirectory((), known=known)
    app = Application(engine=engine, scheduler=MicroScheduler(SchedulerConfig()), tenants=tenants,
                      metrics=RuntimeMetrics(), limits=Limits())
    try:
        assert await readyz(app) == (200 if known else 503)
        tenants.replace([Tenant("acme", frozenset({key_hash("k")}), TenantPolicy("acme"))])
        assert await readyz(app) == 200
    finally:
        await engine.close()
