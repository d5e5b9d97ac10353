"""Which InferenceNodes claim which Kubernetes Node, and waiting for the Nodes that are missing.

No watch follows every Node: kwok (and kubelets, less often) rewrite each Node's status every few
seconds, and at 200 Nodes receiving those events cost the operator 2-10 % of a core while nothing
else moved. The DaemonSet controller watches Nodes anyway: a Node that disappears or loses the
inference-node label makes its runtime DaemonSet unscheduled (desiredNumberScheduled 0 at the
current spec), and that status change reaches the operator through its DaemonSet watch. So a Node
is read from the API server when its DaemonSet says so (or when no copy of it from our own reads
and writes is left), and a Node an InferenceNode waits for is watched by name until it appears.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import Callable

from zerolayer.operator import manifests as m
from zerolayer.operator.kube import Kube


class NodeWaits:
    """``index`` maps a Node name to the InferenceNodes that claim it, so a Node event reaches its
    InferenceNodes without a list call; ``missing`` holds the Nodes some InferenceNode waits for, each
    followed by one watch by name (``watches``) that calls ``appeared(inference_node)`` for each
    claimant when the Node appears."""

    def __init__(self, kube: Kube, runtime_namespace: str, appeared: Callable[[str], None]):
        self.kube = kube
        self.runtime_namespace = runtime_namespace
        self.appeared = appeared
        self.index: dict[str, set[str]] = collections.defaultdict(set)
        self.missing: set[str] = set()
        self.watches: dict[str, asyncio.Task] = {}  # missing Node -> the watch waiting for it

    def claim(self, inference_node: str, node_name: str) -> None:
        """Record that ``inference_node`` now names ``node_name`` (and no other Node)."""
        for other, claimants in list(self.index.items()):
            claimants.discard(inference_node)
            if not claimants and other != node_name:  # nobody waits for that Node any more
                del self.index[other]
                self.missing.discard(other)
                self.stop_waiting(other)
        self.index[node_name].add(inference_node)

    def release(self, inference_node: str, node_name: str) -> None:
        """``inference_node`` is going away: forget its claim (and the wait, if it was the last)."""
        self.index[node_name].discard(inference_node)
        if not self.index[node_name]:
            self.index.pop(node_name, None)
            self.missing.discard(node_name)
            self.stop_waiting(node_name)

    def found(self, node_name: str) -> None:
        self.missing.discard(node_name)
        self.stop_waiting(node_name)

    def copy_will_do(self, inference_node: str) -> bool:
        """False when the watch-fed cache shows this InferenceNode's runtime DaemonSet, at its
        latest spec, scheduled nowhere: its Node went away or lost the label, so a remembered copy
        of the Node would hide that. Otherwise (scheduled there, or not yet seen by the DaemonSet
        controller, whose verdict will come as a DaemonSet event) a copy will do."""
        ds = self.kube.peek(("apps/v1", "DaemonSet", self.runtime_namespace, m.runtime_name(inference_node)))
        if ds is None:
            return True
        status = ds.get("status") or {}
        observed = status.get("observedGeneration", 0) >= (ds.get("metadata") or {}).get("generation", 1)
        return not (observed and status.get("desiredNumberScheduled", 0) == 0)

    def wait_for(self, node_name: str) -> None:
        """Watch for the missing Node by name (one watch per missing Node, closed once it
        appears); when it does, each InferenceNode that claims it is handed to ``appeared``."""
        self.missing.add(node_name)
        if node_name not in self.watches:
            self.watches[node_name] = asyncio.get_running_loop().create_task(
                self._node_appears(node_name), name=f"wait for node {node_name}")

    def stop_waiting(self, node_name: str) -> None:
        task = self.watches.pop(node_name, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _node_appears(self, node_name: str) -> None:
        try:
            async with contextlib.aclosing(self.kube.watch_stream(  # type: ignore[type-var]
                    "v1", "Node", field_selector=f"metadata.name={node_name}")) as events:
                async for event_type, _node in events:
                    if event_type in ("ADDED", "MODIFIED"):
                        break
                else:
                    return
        finally:
            if self.watches.get(node_name) is asyncio.current_task():
                del self.watches[node_name]
        for name in sorted(self.index.get(node_name) or ()):
            self.appeared(name)

    def close(self) -> list[asyncio.Task]:
        """Cancel every watch; returns the tasks to await."""
        tasks = list(self.watches.values())
        self.watches.clear()
        for task in tasks:
            task.cancel()
        return tasks
