import ast
import pathlib

import pytest

from zerolayer.operator import kube
from zerolayer.operator.errors import KubeError

OPERATOR = pathlib.Path(__file__).resolve().parents[3] / "operator"


def test_is_subset_ignores_server_defaults_but_sees_changes():
    want = {"spec": {"containers": [{"name": "a", "resources": {"requests": {"cpu": "0.5"}}}]}}
    have = {"spec": {"containers": [{"name": "a", "resources": {"requests": {"cpu": "500m"}},
                                     "terminationMessagePath": "/dev/termination-log"}], "dnsPolicy": "x"}}
    assert kube.is_subset(want, have)
    assert not kube.is_subset(want, {"spec": {"containers": []}})
    assert not kube.is_subset({"a": [1, 2]}, {"a": [1]})
    assert not kube.is_subset({"a": "1Gi"}, {"a": "2Gi"})
    assert not kube.is_subset({"a": "serving"}, {"a": "other"})


def test_paths():
    assert kube.path_of("apps/v1", "DaemonSet", "ns", "x") == "/apis/apps/v1/namespaces/ns/daemonsets/x"
    assert kube.path_of("v1", "Node", None, "n") == "/api/v1/nodes/n"
    assert kube.path_of("zerolayer.io/v1alpha1", "InferenceNode", None, "a", "status") == \
        "/apis/zerolayer.io/v1alpha1/inferencenodes/a/status"
    with pytest.raises(KubeError):
        kube.path_of("v1", "Secret", None, "s")
    with pytest.raises(KubeError):
        kube.path_of("v1", "Pod", "ns", "p")
    assert kube.resource_of("/api/v1/namespaces/a/secrets/s") == "secrets"


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_layers():
    """handlers -> reconcile -> kube; pure modules import no I/O; nothing imports the runtime;
    only kube.py talks to Kubernetes."""
    pure = {"manifests", "conditions", "validation", "config", "errors"}
    for path in OPERATOR.glob("*.py"):
        imports = _imports(path)
        assert not any(i.startswith("zerolayer.runtime") for i in imports), path.name
        if path.stem != "kube":
            assert not any(i.split(".")[0] in ("kubernetes", "aiohttp") for i in imports), path.name
        if path.stem in pure:
            ours = {i.rsplit(".", 1)[-1] for i in imports if i.startswith("zerolayer.operator")}
            assert ours <= pure, (path.name, ours)
            assert "kopf" not in imports, path.name
        if path.stem == "reconcile":
            assert "kopf" not in imports and "zerolayer.operator.handlers" not in imports
