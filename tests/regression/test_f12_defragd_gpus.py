"""Review finding 12: defragd got ``NVIDIA_VISIBLE_DEVICES=all``: NVML access to every GPU of the
node, other pods' included. A sidecar cannot share the server's device-plugin allocation, so
defragd now runs only where ``all`` *is* the runtime's allocation (the runtime requests every GPU
the Node has); elsewhere it is left out of the pod (and the docs say why)."""

from __future__ import annotations

import pytest

from tests.regression.manifest_fixtures import containers, daemonset, inode

pytestmark = [pytest.mark.regression]


def visible(ds):  # type: ignore[no-untyped-def]
    defragd = containers(ds).get("defragd")
    if defragd is None:
        return None
    return {e["name"]: e.get("value") for e in defragd["env"]}.get("NVIDIA_VISIBLE_DEVICES")


def test_defragd_sees_no_gpu_of_another_pod():
    # The runtime holds 2 of the Node's 8 GPUs: "all" would expose the other 6.
    assert visible(daemonset(inode(runtime={"gpus": 2}), node_gpus=8)) is None


def test_defragd_keeps_working_when_the_runtime_holds_every_gpu():
    assert visible(daemonset(inode(runtime={"gpus": 8}), node_gpus=8)) == "all"
