"""kubewatch.WatchLoop: the cache follows LIST and events, a watch resumes from the last version, and only
410 Gone (or no version yet) costs a LIST again."""

from __future__ import annotations

import threading

from kubernetes.client.exceptions import ApiException

from zerolayer.kubewatch import WatchLoop


def obj(name: str, version: str, **extra) -> dict:
    return {"metadata": {"name": name, "resourceVersion": version}, **extra}


class Lister:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls.append(kwargs)
        return {"metadata": {"resourceVersion": "10"}, "items": [obj("a", "5"), obj("b", "9")]}


def test_list_then_events_keep_the_cache_and_the_version():
    changes = []
    loop = WatchLoop(Lister(), name="t", on_change=lambda: changes.append(1), field_selector="metadata.name=a")
    assert loop.list_once() == "10" and set(loop.objects) == {"a", "b"} and loop.started.is_set()
    assert loop._list_fn.calls[0]["field_selector"] == "metadata.name=a"
    loop.apply("MODIFIED", obj("a", "11", spec={"x": 1}))
    loop.apply("DELETED", obj("b", "12"))
    loop.apply("BOOKMARK", obj("", "15"))
    assert loop.objects == {"a": obj("a", "11", spec={"x": 1})}
    assert loop.resource_version == "15" and loop.counters.events == 2 and len(changes) == 3


def test_a_watch_resumes_without_listing_and_relists_only_after_gone():
    loop = WatchLoop(Lister(), name="t", retry_s=0.0)
    versions, done = [], threading.Event()

    def watch_once() -> None:
        versions.append(loop.resource_version)
        if len(versions) == 1:
            loop.apply("ADDED", obj("c", "20"))  # then the server ends the watch (timeout)
        elif len(versions) == 2:
            raise ApiException(status=410, reason="Gone")
        elif len(versions) == 3:
            raise ApiException(status=500, reason="boom")  # an error: retried, cache kept
        else:
            loop._stop.set()
            done.set()

    loop.watch_once = watch_once  # type: ignore[method-assign]
    loop.start()
    assert done.wait(10)
    loop.stop()
    assert versions == ["10", "20", "10", "10"]  # resumed at 20; after 410 a fresh LIST (10 again)
    assert loop.counters.lists == 2 and loop.counters.relists_after_gone == 1 and loop.counters.errors == 1
    assert set(loop.objects) == {"a", "b"}
