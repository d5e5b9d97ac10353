import ast
import pathlib

import pytest

from zerolayer.operator import kube, kubecache, kubehttp
from zerolayer.operator.errors import KubeError

OPERATOR = pathlib.Path(__file__).resolve().parents[3] / "operator" / "zerolayer" / "operator"


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
        kube.path_of("v1", "ConfigMap", "ns", "c")
    assert kube.resource_of("/api/v1/namespaces/a/secrets/s") == "secrets"


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "zerolayer.operator":
            names.update(f"{node.module}.{a.name}" for a in node.names)  # from zerolayer.operator import plan
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_layers():
    """handlers -> reconcile -> plan | apply -> kube; pure modules (the planner among them) import no
    I/O; nothing imports the runtime; only the kube layer (kube.py and its parts) talks to Kubernetes; only
    handlers.py knows kopf."""
    kube_layer = {"kube", "kubehttp", "kubecache", "watchstream"}
    pure = {"manifests", "conditions", "validation", "config", "errors", "plan", "runtime_config"}
    for path in OPERATOR.glob("*.py"):
        imports = _imports(path)
        assert not any(i.startswith("zerolayer.runtime") for i in imports), path.name
        if path.stem not in kube_layer:
            assert not any(i.split(".")[0] in ("kubernetes", "aiohttp") for i in imports), path.name
        if path.stem in pure:
            ours = {i.rsplit(".", 1)[-1] for i in imports if i.startswith("zerolayer.operator")}
            assert ours <= pure, (path.name, ours)
            assert "kopf" not in imports, path.name
        if path.stem in ("reconcile", "apply", "keys", "nodes", "soon"):
            assert "kopf" not in imports and "zerolayer.operator.handlers" not in imports, path.name


class CountingKube(kube.Kube):
    """Kube with its transport replaced by a dict of objects, to test the watch-fed cache and
    server-side apply (an apply creates a missing object with 201, else answers 200)."""

    def __init__(self, objects):
        self.objects, self.calls = objects, []
        self.cache, self._crd_cache = kubecache.ObjectCache(), {}

    async def send(self, method, path, *, body=None, content_type="application/json", query=None):
        self.calls.append((method, path, content_type, dict(query or {})))
        if method == "GET":
            if path not in self.objects:
                raise kube.NotFound("gone", status=404)
            return 200, self.objects[path]
        if method == "PATCH":
            code = 200 if path in self.objects else 201
            base = self.objects.get(path, body)
            self.objects[path] = {**base, **body, "metadata": {**body["metadata"], "resourceVersion": "9"}}
            return code, self.objects[path]
        raise AssertionError(method)


def _ds(rv="5"):
    return {"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "d", "namespace": "ns", "resourceVersion": rv, "labels": {"a": "b"}}}


async def test_watched_objects_are_read_from_the_cache_and_deletions_drop_them():
    path = "/apis/apps/v1/namespaces/ns/daemonsets/d"
    k = CountingKube({path: _ds()})
    k.watch("apps/v1", "DaemonSet", "ns")
    assert (await k.get("apps/v1", "DaemonSet", "d", "ns", cached=True))["metadata"]["name"] == "d"
    assert (await k.get("apps/v1", "DaemonSet", "d", "ns", cached=True)) is not None
    assert len(k.calls) == 1  # the second read came from the cache
    k.observe("MODIFIED", _ds(rv="4"))  # an older event must not roll the cache back
    assert (await k.get("apps/v1", "DaemonSet", "d", "ns", cached=True))["metadata"]["resourceVersion"] == "5"
    k.observe("DELETED", _ds())
    del k.objects[path]
    assert await k.get("apps/v1", "DaemonSet", "d", "ns", cached=True) is None
    assert len(k.calls) == 2  # a miss asks the API server


async def test_unwatched_kinds_are_never_cached():
    path = "/apis/apps/v1/namespaces/other/daemonsets/d"
    k = CountingKube({path: {**_ds(), "metadata": {**_ds()["metadata"], "namespace": "other"}}})
    k.watch("apps/v1", "DaemonSet", "ns")
    for _ in range(2):
        await k.get("apps/v1", "DaemonSet", "d", "other", cached=True)
    assert len(k.calls) == 2


async def test_ensure_on_a_converged_object_makes_no_request():
    path = "/apis/apps/v1/namespaces/ns/daemonsets/d"
    k = CountingKube({path: _ds()})
    k.watch("apps/v1", "DaemonSet", "ns")
    k.observe("ADDED", _ds())
    result, _ = await k.ensure(_ds())
    assert result == "unchanged" and k.calls == []
    result, obj = await k.ensure({**_ds(), "metadata": {**_ds()["metadata"], "labels": {"a": "c"}}})
    # a hand edit is taken back with one forced server-side apply under our field manager
    assert result == "updated" and [c[:3] for c in k.calls] == [("PATCH", path, kube.APPLY_PATCH)]
    assert k.calls[0][3] == {"force": "true"}


async def test_ensure_of_an_unseen_object_is_one_unforced_apply():
    """No read first: one apply creates it (201); a conflict would mean someone else's fields."""
    k = CountingKube({})
    k.watch("apps/v1", "DaemonSet", "ns")
    result, obj = await k.ensure(_ds())
    assert result == "created" and [(c[0], c[2], c[3]) for c in k.calls] == [("PATCH", kube.APPLY_PATCH, {})]
    assert (await k.ensure(_ds()))[0] == "unchanged" and len(k.calls) == 1  # remembered from the answer


async def test_real_send_names_the_field_manager():
    """Every write carries fieldManager=zerolayer-operator (managedFields name the operator);
    the HTTP session is replaced, so the real send() builds the request."""
    import types

    class Transport(kubehttp.ApiTransport):
        def __init__(self):
            self._on_request = lambda *a: None

    k = Transport()
    calls = []

    class Response:
        status = 200

        async def text(self):
            return "{}"

        async def __aenter__(self):
            return self

        async def __aexit__(self, *a):
            return False

    class Session:
        closed = False

        def request(self, method, url, **kw):
            calls.append((method, kw["params"]))
            return Response()
    k._session = Session()
    k._credentials = types.SimpleNamespace(headers=lambda: {}, server="https://x")
    k._http = lambda: k._session
    await k.send("PATCH", "/api/v1/nodes/n", body={}, content_type=kube.APPLY_PATCH)
    await k.send("GET", "/api/v1/nodes/n")
    assert calls == [("PATCH", {"fieldManager": "zerolayer-operator"}), ("GET", {})]


def test_drift_is_a_difference_from_what_we_applied():
    k = CountingKube({})
    k.watch("apps/v1", "DaemonSet", "ns")
    k.cache.desired[("apps/v1", "DaemonSet", "ns", "d")] = kubecache.comparable(_ds())
    assert not k.drifted(_ds())  # our own write's echo
    assert not k.drifted({**_ds(), "status": {"numberReady": 1}})  # status is not ours
    assert k.drifted({**_ds(), "metadata": {**_ds()["metadata"], "labels": {"a": "edited"}}})
    assert not k.drifted({**_ds(), "metadata": {**_ds()["metadata"], "name": "other"}})  # never applied


async def test_a_write_that_finds_the_object_gone_drops_it_from_the_cache():
    """An in-flight write's answer can put an object back into the cache after the watch reported
    its deletion; the next write's 404 must drop it, or every later trigger would reach it again."""
    path = "/apis/zerolayer.io/v1alpha1/inferencenodes/x"
    obj = {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode", "metadata": {"name": "x"}}
    k = CountingKube({})
    k.watch("zerolayer.io/v1alpha1", "InferenceNode", None)
    k.observe("ADDED", obj)

    async def gone(method, path, **_):
        raise kube.NotFound("gone", status=404)
    k.send = gone
    with pytest.raises(kube.NotFound):
        await k.patch_status("zerolayer.io/v1alpha1", "InferenceNode", "x", {"phase": "Ready"})
    assert k.peek(("zerolayer.io/v1alpha1", "InferenceNode", None, "x")) is None
