"""The operator's own Node watch (Reconciler.follow_nodes) on the real local control plane: a Node
that loses its label, and a Node that disappears and comes back, are repaired from the watch alone
(the full resync is an hour away, no timer runs and no retry is pending when it happens)."""

from __future__ import annotations

import pytest

from tests.e2e.test_operator import env, wait_condition  # noqa: F401 - the module's fixture, shared

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

LABEL = "zerolayer.io/inference-node"


def labelled(objects, node):
    return (objects.get("node", node) or {}).get("metadata", {}).get("labels", {}).get(LABEL) == "true"


def test_a_node_that_loses_only_its_label_is_labelled_again(cluster, env):  # noqa: F811
    objects, operator = env
    [node] = objects.add_nodes(1)
    name = f"{node}-inode"
    objects.apply(objects.inference_node(name, node))
    wait_condition(cluster, objects, "inferencenode", name, "RuntimeReady")
    cluster.kubectl("label", "node", node, f"{LABEL}-")
    cluster.wait_for(lambda: labelled(objects, node), timeout=60, what="node label put back")


def test_a_node_that_leaves_and_rejoins_is_served_again(cluster, env):  # noqa: F811
    from zerolayer.cluster.local import node_manifest

    objects, operator = env
    [node] = objects.add_nodes(1)
    name = f"{node}-inode"
    objects.apply(objects.inference_node(name, node))
    wait_condition(cluster, objects, "inferencenode", name, "RuntimeReady")
    cluster.kubectl("delete", "node", node)
    # The DaemonSet controller sees a deleted Node only when PodGC removes the orphaned runtime pod
    # (40 s quarantine, 20 s period: docs/operator.md); CI once took more than 60 s on a loaded machine.
    wait_condition(cluster, objects, "inferencenode", name, "NodeFound", "False", "NodeMissing", timeout=150)
    objects.apply(node_manifest(node))
    cluster.wait_for(lambda: labelled(objects, node), timeout=90, what="rejoined node labelled")
    wait_condition(cluster, objects, "inferencenode", name, "RuntimeReady")
