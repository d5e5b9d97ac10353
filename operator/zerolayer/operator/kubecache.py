"""What the operator's watches (and its own reads and writes) last saw of each object.

:class:`~zerolayer.operator.kube.Kube` reads from here before it asks the API server, and compares
what it wants with what is here before it writes; nothing here does I/O. Objects are keyed by
``(apiVersion, kind, namespace or None, name)``.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Mapping

import kubernetes.utils

Key = tuple[str, str, str | None, str]


def _same_scalar(want: Any, have: Any) -> bool:
    if want == have:
        return True
    if isinstance(want, str) and isinstance(have, str):
        # The API server canonicalises quantities ("0.5" is stored as "500m").
        try:
            return bool(kubernetes.utils.parse_quantity(want) == kubernetes.utils.parse_quantity(have))
        except (ValueError, ArithmeticError):
            return False
    return False


def is_subset(want: Any, have: Any) -> bool:
    """Whether ``have`` already says everything ``want`` says.

    Dicts: every key of ``want`` present with a matching value (extra keys in ``have`` are
    server defaults and do not count); an empty list or dict in ``want`` also matches an
    absent key, since the server omits empty fields (``initContainers: []`` reads back as
    nothing). Lists: same length, matching element by element.
    """
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(
            is_subset(v, have[k]) if k in have else v in ([], {}) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(is_subset, want, have))
    return _same_scalar(want, have)


def comparable(manifest: Mapping[str, Any]) -> dict:
    """The parts of a desired manifest the server keeps as given."""
    out = {k: v for k, v in manifest.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    meta = manifest.get("metadata", {})
    out["metadata"] = {k: meta[k] for k in ("labels", "annotations", "ownerReferences") if k in meta}
    return out


def key_of(obj: Mapping[str, Any]) -> Key:
    """An object's cache key, from its own apiVersion, kind and metadata."""
    meta = obj.get("metadata") or {}
    return obj.get("apiVersion", ""), obj.get("kind", ""), meta.get("namespace"), meta.get("name", "")


def _version(obj: Mapping[str, Any]) -> int | None:
    """The resourceVersion as a number, or None. resourceVersions are opaque by contract but etcd
    revisions in practice; only two numeric ones are ever compared."""
    rv = (obj.get("metadata") or {}).get("resourceVersion", "")
    return int(rv) if isinstance(rv, str) and rv.isdigit() else None


class ObjectCache:
    """Objects seen through watches, kept while something tells us about their changes.

    Only kinds (and namespaces) a watch follows (:meth:`watch`) are kept with no age limit on
    their completeness; kinds :meth:`remember`-ed are kept for ``cache_seconds`` for callers that
    know when a cached copy is good enough. ``desired`` holds what the operator last applied to
    each object, for :meth:`drifted`.
    """

    def __init__(self, *, cache_seconds: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        # A watch filtered by label stops telling us about an object whose label someone removed;
        # entries are re-read after this long so even that drift is bounded.
        self.cache_seconds = cache_seconds
        self._clock = clock
        self._seen: dict[Key, tuple[float, dict]] = {}
        self._watched: set[tuple[str, str, str | None]] = set()
        self._remembered: set[tuple[str, str]] = set()
        self.desired: dict[Key, dict] = {}

    def watch(self, api_version: str, kind: str, namespace: str | None = None) -> None:
        """Declare that a watch feeds :meth:`observe` with every event of this kind (in this
        namespace, or cluster-wide for None), so reads of it may be served from what it saw."""
        self._watched.add((api_version, kind, namespace))

    def remember(self, api_version: str, kind: str) -> None:
        """Keep what our own reads and writes return for objects of this kind (no watch follows
        them): ``Kube.get(cached=True)`` may then answer from that copy for ``cache_seconds``, so
        callers ask for it only when they know the object cannot have changed in a way that
        matters to them (Reconciler: a Node while its runtime DaemonSet is scheduled there)."""
        self._remembered.add((api_version, kind))

    def observe(self, event_type: str | None, obj: Mapping[str, Any]) -> None:
        """Feed one watch event. Deletions drop the object; otherwise the newer version is kept."""
        if event_type == "DELETED":
            self._seen.pop(key_of(obj), None)
        else:
            self.keep(key_of(obj), obj)

    def keep(self, key: Key, obj: Mapping[str, Any]) -> None:
        """Keep ``obj`` (an answer or an event) unless its kind is not kept or the copy held is newer:
        an event that arrives after our own write's answer must not roll the cache back."""
        api_version, kind, namespace, _name = key
        if not ((api_version, kind, namespace) in self._watched or (api_version, kind, None) in self._watched
                or (api_version, kind) in self._remembered):
            return
        held = self._seen.get(key)
        if held is not None:
            new, old = _version(obj), _version(held[1])
            if new is not None and old is not None and new < old:
                return
        self._seen[key] = (self._clock(), dict(obj))

    def drop(self, key: Key) -> None:
        """Forget one object (gone, or to be read fresh next time)."""
        self._seen.pop(key, None)

    def clear(self) -> None:
        """Drop every cached object, so the next reads go to the API server (the full resync)."""
        self._seen.clear()

    def peek(self, key: Key) -> dict | None:
        """What the watches last saw of an object (a copy), or None when not seen or too old."""
        held = self._seen.get(key)
        if held is not None and self._clock() - held[0] < self.cache_seconds:
            return copy.deepcopy(held[1])
        return None

    def seen_all(self, api_version: str, kind: str) -> list[dict]:
        """Copies of every object of a cluster-scoped watched kind that the watch has seen (it learns of
        deletions, so no age limit applies). Complete only once the watch has listed; callers that
        write because of what is missing here re-read from the API server first (fleet.py)."""
        return [copy.deepcopy(obj) for (v, k, _ns, _name), (_at, obj) in self._seen.items()
                if v == api_version and k == kind]

    def freshest(self, obj: Mapping[str, Any]) -> Mapping[str, Any]:
        """``obj``, or the cache's copy of it when that is newer (a higher resourceVersion): a
        reconcile handed an event's body that our own status write has since overtaken must not
        write the same status (and send the same event) again."""
        held = self._seen.get(key_of(obj))
        if held is None:
            return obj
        mine, theirs = _version(obj), _version(held[1])
        if mine is not None and theirs is not None and theirs > mine:
            return copy.deepcopy(held[1])
        return obj

    def drifted(self, obj: Mapping[str, Any]) -> bool:
        """Whether a watched object no longer says what the operator last applied to it (a hand
        edit: the owner must be reconciled). Our own writes' echoes and status-only changes are
        not drift."""
        want = self.desired.get(key_of(obj))
        return want is not None and not (obj.get("metadata") or {}).get("deletionTimestamp") \
            and not is_subset(want, obj)
