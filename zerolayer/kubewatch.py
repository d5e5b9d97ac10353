"""List once, then watch: a cache of one kind of Kubernetes object kept current by one watch.

The loop every runtime-side reader uses (tenants, key hashes, its own InferenceNode, the GPU
map, fleet quota claims), in place of timers that re-read everything:

1. LIST (with the selectors given) and replace the cache; remember the list's resourceVersion;
2. WATCH from that resourceVersion (with bookmarks, so it stays fresh on a quiet watch);
   apply each event to the cache;
3. when the watch ends (the server's ``timeout_seconds``, a dropped connection), WATCH again
   from the last resourceVersion seen: no LIST;
4. LIST again only when the server answers 410 Gone (the version left etcd's history) or
   there is no version to resume from.

Errors (refused connection, 5xx, 403) are counted and retried after ``retry_s``; the cache is
kept meanwhile. So an idle runtime costs one open watch per kind and one cheap watch request
per ``watch_timeout_s``; a change costs one event, never a read.

Callbacks run in the watch thread; they must be quick and must not raise (a raise is logged).
Kubernetes client configuration comes from the caller (through :mod:`zerolayer.kubeaccess`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable, Mapping

log = logging.getLogger(__name__)

GONE = 410


def object_key(obj: Mapping[str, Any]) -> str:
    """``namespace/name`` (cluster-scoped: ``name``) of an object as a dict."""
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace")
    return f"{namespace}/{meta.get('name', '')}" if namespace else str(meta.get("name", ""))


@dataclasses.dataclass
class WatchCounters:
    """What the loop asked of the API server (for benches and metrics)."""

    lists: int = 0
    watches: int = 0
    events: int = 0
    errors: int = 0
    relists_after_gone: int = 0


class WatchLoop:
    """Keeps ``objects`` equal to what the API server holds for one list call and its selectors.

    ``list_fn(*args, **kwargs)`` is a list method of the official client (``CustomObjectsApi.
    list_cluster_custom_object``, ``CoreV1Api.list_namespaced_secret``...); Typed items (``V1Secret``)
    are kept as plain dicts (the client's ``sanitize_for_serialization``). ``on_change()`` is
    called after every LIST and every event (not bookmarks); read :attr:`objects` when needed.
    ``started`` is set after the first successful LIST.
    """

    def __init__(self, list_fn: Callable[..., Any], *args: Any, name: str,
                 on_change: Callable[[], None] | None = None,
                 field_selector: str | None = None, label_selector: str | None = None,
                 retry_s: float = 2.0, watch_timeout_s: int = 300, request_timeout_s: float = 10.0,
                 api_client: Any = None) -> None:
        self._list_fn = list_fn
        self._args = args
        self.name = name
        self._on_change = on_change
        self._selectors = {k: v for k, v in (("field_selector", field_selector),
                                             ("label_selector", label_selector)) if v}
        self.retry_s = retry_s
        self.watch_timeout_s = watch_timeout_s
        self.request_timeout_s = request_timeout_s
        self._api_client = api_client
        self._lock = threading.Lock()
        self._objects: dict[str, dict[str, Any]] = {}
        self.resource_version: str | None = None
        self.counters = WatchCounters()
        self.started = threading.Event()
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "WatchLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """End the loop: the open watch's socket is shut down (which wakes a read blocked on a quiet
        watch at once; closing alone would not), then the thread is joined for up to ``timeout``."""
        self._stop.set()
        watch = self._watch
        if watch is not None:
            watch.stop()
            response = getattr(watch, "_resp", None)
            if response is not None:
                try:
                    shutdown = getattr(response, "shutdown", None)  # urllib3 >= 2.3
                    (shutdown or response.close)()
                except Exception:  # noqa: BLE001 - a half-dead socket may fail to shut down any way it likes
                    pass
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def objects(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return dict(self._objects)

    # ------------------------------------------------------------------ steps
    def _plain(self, item: Any) -> dict[str, Any]:
        if isinstance(item, Mapping):
            return dict(item)
        if self._api_client is None:
            from kubernetes import client

            self._api_client = client.ApiClient()
        return self._api_client.sanitize_for_serialization(item)

    def list_once(self) -> str | None:
        """LIST and replace the cache; returns (and keeps) the list's resourceVersion."""
        self.counters.lists += 1
        listing = self._list_fn(*self._args, **self._selectors, _request_timeout=self.request_timeout_s)
        if isinstance(listing, Mapping):
            items, meta = listing.get("items") or [], listing.get("metadata") or {}
            version = meta.get("resourceVersion")
        else:
            items, version = listing.items or [], listing.metadata.resource_version
        objects = {object_key(o): o for o in (self._plain(i) for i in items)}
        with self._lock:
            self._objects = objects
        self.resource_version = version
        self.started.set()
        self._changed()
        return version

    def apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        """One watch event (``ADDED``/``MODIFIED``/``DELETED``; ``BOOKMARK`` only moves the version)."""
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if version:
            self.resource_version = str(version)
        if kind == "BOOKMARK":
            return
        self.counters.events += 1
        key = object_key(obj)
        with self._lock:
            if kind == "DELETED":
                self._objects.pop(key, None)
            else:
                self._objects[key] = dict(obj)
        self._changed()

    def _changed(self) -> None:
        if self._on_change is None:
            return
        try:
            self._on_change()
        except Exception:  # noqa: BLE001 - a consumer's bug must not end the watch (its data would freeze)
            log.exception("watch %s: on_change failed", self.name)

    def watch_once(self) -> None:
        """One WATCH request from :attr:`resource_version` until the server ends it."""
        from kubernetes import watch

        self.counters.watches += 1
        self._watch = watch.Watch()
        stream = self._watch.stream(self._list_fn, *self._args, **self._selectors,
                                    resource_version=self.resource_version, allow_watch_bookmarks=True,
                                    timeout_seconds=self.watch_timeout_s,
                                    # client-side too: an API server that dies mid-watch must not hang us
                                    _request_timeout=self.watch_timeout_s + 15)
        for event in stream:
            if self._stop.is_set():
                break
            obj = event.get("raw_object") if isinstance(event.get("raw_object"), Mapping) else event.get("object")
            if not isinstance(obj, Mapping):
                obj = self._plain(obj)
            self.apply(str(event.get("type")), obj)

    def _run(self) -> None:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        while not self._stop.is_set():
            try:
                if self.resource_version is None:
                    self.list_once()
                self.watch_once()
                self.last_error = None
            except ApiException as exc:
                if exc.status == GONE:
                    self.counters.relists_after_gone += 1
                    log.info("watch %s: version %s is gone (410): listing again", self.name, self.resource_version)
                    self.resource_version = None  # relist at once: nothing to wait for
                    continue
                self._failed(f"HTTP {exc.status} {exc.reason}")
            except (HTTPError, OSError, ValueError, AttributeError) as exc:
                # AttributeError: http.client reading a chunked response whose connection was closed under it
                # (an API server restarting, or re-creating its storage after a CRD update)
                self._failed(f"{exc.__class__.__name__}: {exc}")
            except Exception as exc:  # noqa: BLE001 - the loop must outlive anything one response can cause
                log.exception("watch %s failed unexpectedly", self.name)
                self._failed(f"{exc.__class__.__name__}: {exc}")

    def _failed(self, why: str) -> None:
        if self._stop.is_set():
            return
        self.counters.errors += 1
        self.last_error = why
        log.warning("watch %s: %s (again in %.1fs; cache kept)", self.name, why, self.retry_s)
        self._stop.wait(self.retry_s)
