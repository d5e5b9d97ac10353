"""Where the SDK learns which nodes exist and which admit work: the GPU map.

:class:`NodeMap` is the small interface node choice depends on; three sources implement it:

- :class:`StaticNodeMap`: a fixed list of endpoints (standalone, tests, a pinned fleet);
- :class:`HttpNodeMap`: polls a runtime's map endpoint (no Kubernetes credentials needed);
- :class:`KubernetesNodeMap`: watches ``InferenceNode`` objects (``zerolayer.io/v1alpha1``,
  cluster-scoped) and reads their ``status``: ``endpoint``, ``admitting``, ``gpus[]`` and
  ``heartbeat`` / ``lastHeartbeat``.

Polling and watching run in a daemon thread (both are blocking clients), so neither the
sync nor the async client ever blocks on them; ``nodes()`` returns the last snapshot.

:class:`HashRing` is consistent hashing for session affinity: a session keeps its node
while the node set is stable, and only ~1/N of sessions move when a node joins or leaves.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
from typing import Any, Iterable, Iterator, Mapping, Protocol, Sequence

from zerolayer.prefix import PrefixDigest

from . import errors

log = logging.getLogger("zerolayer.client")

GROUP, VERSION, PLURAL = "zerolayer.io", "v1alpha1", "inferencenodes"


@dataclasses.dataclass(frozen=True)
class Node:
    """One runtime as the client sees it.

    ``heartbeat`` is the Unix time of the node's last published heartbeat; ``None`` means
    the source has no liveness signal (a static list) and the node is never stale.
    """

    name: str
    endpoint: str
    admitting: bool = True
    heartbeat: float | None = None
    gpus: tuple[Mapping[str, Any], ...] = ()
    models: tuple[str, ...] | None = None  # the models it serves; None: the source does not say
    load: int | None = None  # gossiped running + waiting requests; None: not published
    prefix_digest: PrefixDigest | None = None  # what it holds in its prefix cache (docs/routing.md)
    api_processes: int | None = None  # processes serving the endpoint; None: the source does not say

    def fresh(self, now: float, stale_after_s: float) -> bool:
        return self.heartbeat is None or now - self.heartbeat <= stale_after_s

    def serves(self, model: str | None) -> bool:
        """Whether a request for ``model`` may go here: a node that lists its models must list it;
        one whose source does not say (a static list, an older map) is not ruled out."""
        return model is None or self.models is None or model in self.models


class NodeMap(Protocol):
    """A source of the current node set. ``nodes()`` must be cheap and never block on I/O."""

    def nodes(self) -> Sequence[Node]: ...

    def close(self) -> None: ...


def normalise_endpoint(endpoint: str) -> str:
    """``host:port`` or a URL -> a base URL without a trailing slash."""
    endpoint = endpoint.strip().rstrip("/")
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    return endpoint


class StaticNodeMap:
    """A fixed list of endpoints (or :class:`Node` objects); every node admits and is never stale."""

    def __init__(self, endpoints: Iterable[str | Node]) -> None:
        nodes = []
        for item in endpoints:
            if isinstance(item, Node):
                nodes.append(dataclasses.replace(item, endpoint=normalise_endpoint(item.endpoint)))
            else:
                url = normalise_endpoint(item)
                nodes.append(Node(name=url, endpoint=url))
        if not nodes:
            raise ValueError("a static node map needs at least one endpoint")
        self._nodes = tuple(nodes)

    def nodes(self) -> Sequence[Node]:
        return self._nodes

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- parsing
def parse_time(value: object) -> float | None:
    """Unix seconds from an RFC 3339 string or a number; ``None`` if absent or unreadable."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and value:
        try:
            parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=datetime.timezone.utc)
        return parsed.timestamp()
    return None


def model_names(value: object) -> tuple[str, ...] | None:
    """Served model names from a list of names or of ``{"name": ...}`` entries (the CRD's
    ``spec.models``); ``None`` when absent or unreadable."""
    if not isinstance(value, list):
        return None
    names = [v if isinstance(v, str) else v.get("name") if isinstance(v, Mapping) else None for v in value]
    return tuple(n for n in names if isinstance(n, str) and n) if all(isinstance(n, str) for n in names) else None


def node_from_status(name: str, status: Mapping[str, Any], spec: Mapping[str, Any] | None = None) -> Node | None:
    """A :class:`Node` from an ``InferenceNode.status`` (or a runtime's own map document).

    A node admits if ``status.admitting`` says so; without that field, if any GPU admits. Its
    models are ``status.models`` when published, else the names in ``spec.models`` (what the
    node was told to serve), else unknown. Its load is ``status.load.running + waiting``, its
    prefix digest ``status.prefixCache.digest`` (docs/routing.md) and its API processes
    ``status.apiProcesses`` (a positive integer), each ``None`` when absent or unreadable. Returns
    ``None`` when the status has no endpoint yet (not routable).
    """
    endpoint = status.get("endpoint")
    if not endpoint:
        return None
    gpus = tuple(g for g in status.get("gpus") or () if isinstance(g, Mapping))
    admitting = status.get("admitting")
    if admitting is None:
        admitting = any(bool(g.get("admitting", True)) for g in gpus) if gpus else True
    heartbeat = parse_time(status.get("heartbeat", status.get("lastHeartbeat")))
    models = model_names(status.get("models"))
    if models is None and spec is not None:
        models = model_names(spec.get("models"))
    load: Mapping[str, Any] = status["load"] if isinstance(status.get("load"), Mapping) else {}
    counts = [load.get(k) for k in ("running", "waiting")]
    busy = sum(counts) if all(isinstance(c, int) and not isinstance(c, bool) for c in counts) else None  # type: ignore[arg-type]
    cache: Mapping[str, Any] = status["prefixCache"] if isinstance(status.get("prefixCache"), Mapping) else {}
    processes = status.get("apiProcesses")
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        processes = None
    return Node(name=name, endpoint=normalise_endpoint(str(endpoint)), admitting=bool(admitting), heartbeat=heartbeat,
                gpus=gpus, models=models, load=busy, prefix_digest=PrefixDigest.decode(cache.get("digest")),
                api_processes=processes)


def nodes_from_document(doc: object) -> list[Node]:
    """Nodes from a map document: a list of InferenceNode objects (``items``), a ``nodes`` list
    of flat node records, or one node's own record."""
    records: list[tuple[str, Mapping[str, Any]]] = []
    specs: dict[str, Mapping[str, Any]] = {}
    if isinstance(doc, Mapping) and isinstance(doc.get("items"), list):
        for item in doc["items"]:
            if isinstance(item, Mapping):
                name = str((item.get("metadata") or {}).get("name", ""))
                records.append((name, item.get("status") or {}))
                specs[name] = item.get("spec") or {}
    elif isinstance(doc, Mapping) and isinstance(doc.get("nodes"), list):
        for item in doc["nodes"]:
            if isinstance(item, Mapping):
                records.append((str(item.get("name") or item.get("node") or item.get("endpoint", "")), item))
    elif isinstance(doc, Mapping):
        records.append((str(doc.get("name") or doc.get("node") or doc.get("endpoint", "")), doc))
    out = []
    for name, status in records:
        node = node_from_status(name, status, specs.get(name))
        if node is not None:
            out.append(node)
    return out


# --------------------------------------------------------------------------- polling sources
class _PollingMap:
    """Holds the latest snapshot; subclasses fill it from a daemon thread."""

    def __init__(self, initial: Sequence[Node] = ()) -> None:
        self._snapshot: tuple[Node, ...] = tuple(initial)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: Exception | None = None

    def nodes(self) -> Sequence[Node]:
        return self._snapshot

    def _publish(self, nodes: Iterable[Node]) -> None:
        self._snapshot = tuple(nodes)
        self._ready.set()

    def wait_ready(self, timeout: float = 5.0) -> bool:
        """Block until the first snapshot arrived (for start-up; not for the event loop)."""
        return self._ready.wait(timeout)

    def _start(self, target, name: str) -> None:
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


class HttpNodeMap(_PollingMap):
    """Polls a runtime's GPU-map endpoint every ``interval_s`` (default 1 s).

    The document may be a list of InferenceNode objects, ``{"nodes": [...]}`` or one
    node's record; see :func:`nodes_from_document`. A failed poll keeps the previous
    snapshot (the nodes then go stale by their heartbeats) and is kept in ``last_error``.
    The runtime's ``/v1/zerolayer/map`` reveals every node's endpoint and load, so it wants a
    tenant key: pass ``api_key`` (the same key the client uses).
    """

    def __init__(self, url: str, *, api_key: str | None = None, interval_s: float = 1.0, timeout_s: float = 2.0,
                 http2_prior_knowledge: bool = True) -> None:
        super().__init__()
        import httpx  # only the HTTP source needs it

        self.url = url
        self.interval_s = interval_s
        headers = {"x-api-key": api_key} if api_key else {}
        self._http = httpx.Client(http1=not http2_prior_knowledge, http2=True, timeout=timeout_s, headers=headers)
        self._httpx = httpx
        self._start(self._run, "zerolayer-node-map-http")

    def poll_once(self) -> list[Node]:
        try:
            response = self._http.get(self.url)
            response.raise_for_status()
            doc = response.json()
        except (self._httpx.HTTPError, ValueError) as exc:
            raise errors.ZerolayerError(f"cannot read the GPU map from {self.url}: {exc}") from exc
        return nodes_from_document(doc)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._publish(self.poll_once())
                self.last_error = None
            except errors.ZerolayerError as exc:
                self.last_error = exc
                log.warning("%s", exc)
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        super().close()
        self._http.close()


class KubernetesNodeMap(_PollingMap):
    """Watches cluster-scoped ``InferenceNode`` objects and keeps their status as the map.

    ``api`` is a ``kubernetes.client.CustomObjectsApi``; without it the in-cluster config
    is loaded, else the kubeconfig. The watch restarts (relisting) when it ends or fails.
    ``label_selector`` narrows the map to matching InferenceNodes (e.g. ``zerolayer.io/fleet=<name>``
    or a pool label), as the API server applies it to the list and the watch.
    """

    def __init__(self, api: Any = None, *, retry_s: float = 2.0, label_selector: str | None = None) -> None:
        super().__init__()
        self._selector = {"label_selector": label_selector} if label_selector else {}
        from kubernetes import client, config, watch

        if api is None:
            from zerolayer import kubeaccess

            api = client.CustomObjectsApi(kubeaccess.api_client())
        self._api = api
        self._watch_mod = watch
        self._retry_s = retry_s
        self._objects: dict[str, Node] = {}
        self._start(self._run, "zerolayer-node-map-k8s")

    def _apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        name = str((obj.get("metadata") or {}).get("name", ""))
        node = node_from_status(name, obj.get("status") or {}, obj.get("spec") or {})
        if kind == "DELETED" or node is None:
            self._objects.pop(name, None)
        else:
            self._objects[name] = node
        self._publish(self._objects.values())

    def _run(self) -> None:
        from kubernetes.client.exceptions import ApiException

        while not self._stop.is_set():
            try:
                listing = self._api.list_cluster_custom_object(GROUP, VERSION, PLURAL, **self._selector)
                self._objects = {}
                for item in listing.get("items", []):
                    self._apply("ADDED", item)
                self._publish(self._objects.values())
                watcher = self._watch_mod.Watch()
                stream = watcher.stream(
                    self._api.list_cluster_custom_object,
                    GROUP,
                    VERSION,
                    PLURAL,
                    resource_version=listing.get("metadata", {}).get("resourceVersion"),
                    timeout_seconds=30,
                    **self._selector,
                )
                for event in stream:
                    if self._stop.is_set():
                        watcher.stop()
                        break
                    self._apply(event["type"], event["object"])
            except (ApiException, OSError, ValueError) as exc:
                self.last_error = errors.ZerolayerError(f"InferenceNode watch failed: {exc}")
                log.warning("%s", self.last_error)
                self._stop.wait(self._retry_s)


# --------------------------------------------------------------------------- consistent hashing
# One ring for the whole fleet: runtimes (alternatives), `zerolayer map` and the SDK must agree on
# which node owns a session, so the SDK uses the GPU-map reader's ring (zerolayer core, not runtime).
from zerolayer.gpumap import HashRing  # noqa: E402  (re-exported: zerolayer.client.HashRing)
