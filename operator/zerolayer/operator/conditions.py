"""Standard status conditions (``type``, ``status``, ``reason``, ``message``,
``observedGeneration``, ``lastTransitionTime``), computed purely.

``lastTransitionTime`` moves only when ``status`` changes, so re-running a reconcile that
changes nothing yields an identical list, and the operator skips the status patch.
"""

from __future__ import annotations

import datetime
from typing import Any, Iterable, Mapping

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"


def timestamp(now: datetime.datetime) -> str:
    """RFC 3339 with seconds precision in UTC, the form Kubernetes uses."""
    return now.astimezone(datetime.timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, status: str | bool, reason: str, message: str) -> dict:
    """A condition without the bookkeeping fields (see :func:`merge_conditions`)."""
    if isinstance(status, bool):
        status = TRUE if status else FALSE
    if status not in (TRUE, FALSE, UNKNOWN):
        raise ValueError(f"condition status must be True, False or Unknown, got {status!r}")
    return {"type": type_, "status": status, "reason": reason, "message": message}


def merge_conditions(
    previous: Iterable[Mapping[str, Any]] | None,
    updates: Iterable[Mapping[str, Any]],
    *,
    generation: int | None,
    now: datetime.datetime,
) -> list[dict]:
    """Apply ``updates`` over ``previous`` and return the new list.

    Conditions keep their position; new types are appended in the order given. A
    condition whose status did not change keeps its ``lastTransitionTime``.
    Conditions in ``previous`` that ``updates`` does not mention are kept as they are.
    """
    result = [dict(c) for c in previous or ()]
    index = {c.get("type"): i for i, c in enumerate(result)}
    for update in updates:
        new = dict(update)
        if generation is not None:
            new["observedGeneration"] = generation
        old = result[index[new["type"]]] if new["type"] in index else None
        if old is not None and old.get("status") == new["status"] and old.get("lastTransitionTime"):
            new["lastTransitionTime"] = old["lastTransitionTime"]
        else:
            new["lastTransitionTime"] = timestamp(now)
        if old is None:
            index[new["type"]] = len(result)
            result.append(new)
        else:
            result[index[new["type"]]] = new
    return result


def find(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    for c in conditions or ():
        if c.get("type") == type_:
            return c
    return None


def is_true(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> bool:
    c = find(conditions, type_)
    return c is not None and c.get("status") == TRUE
