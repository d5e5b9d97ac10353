"""A watch of one kind that never ends: list, then watch from the list's version, resume, relist on 410.

The operator's own watch (kopf's watches live as long as the operator): it waits for one missing
Node by name (nodes.py). Requests go through the two callables :class:`~zerolayer.operator.kube.Kube`
passes in (its ``request`` and ``watch_once``), so this module does no HTTP of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator, Callable, Mapping, Protocol

from zerolayer.operator.errors import KubeError
from zerolayer.operator.kubehttp import KINDS

log = logging.getLogger(__name__)


class Request(Protocol):
    def __call__(self, method: str, path: str, *, query: Mapping[str, str] | None = None) -> Any: ...


# (path, plural, resourceVersion or None, timeoutSeconds, selector) -> the events of one watch request
WatchOnce = Callable[[str, str, "str | None", int, Mapping[str, str]], Any]


def _expired(plural: str, error: Mapping[str, Any]) -> None:
    """A watch's ERROR event: 410 Gone (the version it resumes from is too old: list again) is
    logged; any other code raises."""
    if error.get("code") != 410:
        raise KubeError(f"watch of {plural}: {error.get('code')} {error.get('message')}",
                        status=int(error.get("code") or 0))
    log.info("watch of %s: %s; listing again", plural, error.get("message", "410 Gone"))


async def follow(request: Request, watch_once: WatchOnce, api_version: str, kind: str,
                 namespace: str | None = None, *, field_selector: str | None = None, timeout_seconds: int = 1800,
                 retry_seconds: float = 1.0) -> AsyncIterator[tuple[str, dict]]:
    """Follow the objects of a kind (in ``namespace``, or cluster-wide for None; only those
    ``field_selector`` matches when given): yields ``(event type, object)``, first ``ADDED``
    for each listed object, then the watch's events.

    The watch resumes from the last resourceVersion it saw (bookmarks advance it without
    an event), so a watch the server ends after ``timeout_seconds`` costs one request; only
    410 Gone costs a LIST again, whose differences are yielded (``DELETED`` for an object
    gone meanwhile, with its name only). Errors are logged and retried after
    ``retry_seconds`` (doubling up to 30 s); the generator never returns on its own.

    For a watch that lives and dies with one task (kopf's watches live as long as the
    operator): the operator uses it to wait for one missing Node by name.
    """
    prefix, plural, namespaced = KINDS[(api_version, kind)]
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespaced and namespace else f"{prefix}/{plural}"
    selector = {"fieldSelector": field_selector} if field_selector else {}
    known: set[tuple[str | None, str]] = set()
    version: str | None = None
    delay = retry_seconds
    while True:
        try:
            if version is None:
                version, fresh = await _list(request, api_version, kind, path, selector)
                for ns, name in sorted(known - set(fresh), key=str):
                    yield "DELETED", {"apiVersion": api_version, "kind": kind,
                                      "metadata": {"name": name, **({"namespace": ns} if ns else {})}}
                known = set(fresh)
                for item in fresh.values():
                    yield "ADDED", item
            opened = time.monotonic()
            async with contextlib.aclosing(watch_once(path, plural, version, timeout_seconds, selector)) as events:
                async for event_type, obj in events:
                    delay = retry_seconds
                    meta = obj.get("metadata") or {}
                    if event_type == "ERROR":
                        _expired(plural, obj)  # raises unless the watch's version is gone (410)
                        version = None
                        break
                    version = meta.get("resourceVersion") or version
                    if event_type == "BOOKMARK":
                        continue
                    key = (meta.get("namespace"), meta.get("name", ""))
                    if event_type == "DELETED":
                        known.discard(key)
                    else:
                        known.add(key)
                    yield event_type, obj
            if time.monotonic() - opened < retry_seconds:
                await asyncio.sleep(retry_seconds)  # a server that ends watches at once must not spin us
        except KubeError as exc:
            if exc.status == 410:
                version = None
                continue
            log.warning("watch of %s failed, again in %.0f s: %s", plural, delay, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)


async def _list(request: Request, api_version: str, kind: str, path: str, selector: Mapping[str, str]
                ) -> tuple[str | None, dict[tuple[str | None, str], dict]]:
    """The list a watch starts from: its resourceVersion and the objects by (namespace, name)."""
    listing = await request("GET", path, query=selector or None)
    fresh: dict[tuple[str | None, str], dict] = {}
    for item in listing.get("items") or ():
        item = {"apiVersion": api_version, "kind": kind, **item}  # list items lack them
        meta = item["metadata"]
        fresh[(meta.get("namespace"), meta["name"])] = item
    return (listing.get("metadata") or {}).get("resourceVersion") or None, fresh
